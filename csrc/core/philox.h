// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11).
//
// GRNND's disordered propagation (seed 000, section 3.3) needs an independent random stream
// per vertex and per round. A counter-based generator gives that without any state: the
// value is a pure function of (seed, counter), so the CPU and CUDA kernels draw exactly the
// same numbers for the same (vertex, round, slot) and a build is reproducible from its seed.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define GRNND_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define GRNND_HOST_DEVICE inline
#endif

namespace grnnd {

struct Philox4x32 {
  uint32_t v[4];
};

GRNND_HOST_DEVICE void mul_hi_lo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// Ten rounds of the Philox bijection of `counter` under `key`.
GRNND_HOST_DEVICE Philox4x32 philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                        uint64_t key) {
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mul_hi_lo(0xD2511F53u, c0, hi0, lo0);
    mul_hi_lo(0xCD9E8D57u, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// What a random draw is for; keeps the streams of different uses apart.
enum class Stream : uint32_t { kInitialNeighbours = 1, kVisitOrder = 2, kEntryPoints = 3 };

// One 32-bit random number for (stream, item, round, slot). Cheap enough to call per slot.
GRNND_HOST_DEVICE uint32_t random_u32(uint64_t seed, Stream stream, uint32_t item, uint32_t round,
                                      uint32_t slot) {
  return philox4x32(item, round, slot, static_cast<uint32_t>(stream), seed).v[0];
}

// Uniform integer in [0, n) by the multiply-shift reduction (bias < n / 2^32, irrelevant here).
GRNND_HOST_DEVICE uint32_t random_below(uint32_t r, uint32_t n) {
  return static_cast<uint32_t>((static_cast<uint64_t>(r) * n) >> 32);
}

}  // namespace grnnd
