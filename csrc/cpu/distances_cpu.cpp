// Distance loops of the CPU kernels (declared in vectors_cpu.h), one copy per instruction set.
#include <cstring>

#include "vectors_cpu.h"

namespace grnnd {
namespace cpu {
namespace {

constexpr int kLanes = 32;

// Everything below is inlined into the copy for its instruction set; the 32-byte vectors of the
// AVX2 copy never cross a call, so the ABI note GCC gives for them does not apply.
#define GRNND_INLINE inline __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi"

// Width floats as one vector (GCC/Clang vector extension: SSE or AVX registers as the target allows).
template <int Width>
struct Lanes {
  typedef float type __attribute__((vector_size(4 * Width)));
  static GRNND_INLINE type load(const float* p) {
    type v;
    std::memcpy(&v, p, sizeof v);  // rows are only float-aligned
    return v;
  }
};

// Sum over dimensions of term(a[i], b[i]) in kLanes partial sums (vectors_cpu.h says why), with
// the last dim % 8 terms added one by one at the end.
template <int Width, typename Term>
GRNND_INLINE float lane_sum(const float* a, const float* b, int dim, Term term) {
  constexpr int kRegisters = kLanes / Width;
  using L = Lanes<Width>;
  typename L::type sum[kRegisters];
  for (int r = 0; r < kRegisters; ++r) sum[r] = typename L::type{};
  int i = 0;
  for (; i + kLanes <= dim; i += kLanes) {
#pragma GCC unroll 8
    for (int r = 0; r < kRegisters; ++r) sum[r] += term(L::load(a + i + r * Width), L::load(b + i + r * Width));
  }
  for (; i + 8 <= dim; i += 8) {  // lanes 0-7 take what is left in blocks of 8
#pragma GCC unroll 2
    for (int r = 0; r < 8 / Width; ++r) sum[r] += term(L::load(a + i + r * Width), L::load(b + i + r * Width));
  }
  // Lane l += lane l + 16, then lane l += lane l + 8, then the 8 lanes left in a fixed tree.
#pragma GCC unroll 8
  for (int r = 0; r < kRegisters / 2; ++r) sum[r] += sum[r + kRegisters / 2];
#pragma GCC unroll 4
  for (int r = 0; r < kRegisters / 4; ++r) sum[r] += sum[r + kRegisters / 4];
  float lane[8];
  std::memcpy(lane, sum, sizeof lane);
  float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
  for (; i < dim; ++i) s += term(a[i], b[i]);
  return s;
}

struct SquareOfDifference {
  template <typename T>
  GRNND_INLINE T operator()(T x, T y) const {
    const T t = x - y;
    return t * t;
  }
};

struct Product {
  template <typename T>
  GRNND_INLINE T operator()(T x, T y) const {
    return x * y;
  }
};

float dot_baseline(const float* a, const float* b, int dim) { return lane_sum<4>(a, b, dim, Product{}); }
float squared_l2_baseline(const float* a, const float* b, int dim) {
  return lane_sum<4>(a, b, dim, SquareOfDifference{});
}

using DistanceLoop = float (*)(const float*, const float*, int);

#if defined(__x86_64__) && defined(__GNUC__)
// No FMA here: a fused multiply-add rounds once where the baseline rounds twice.
__attribute__((target("avx2"))) float dot_avx2(const float* a, const float* b, int dim) {
  return lane_sum<8>(a, b, dim, Product{});
}
__attribute__((target("avx2"))) float squared_l2_avx2(const float* a, const float* b, int dim) {
  return lane_sum<8>(a, b, dim, SquareOfDifference{});
}

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}

const bool kAvx2 = has_avx2();
const DistanceLoop kDot = kAvx2 ? dot_avx2 : dot_baseline;
const DistanceLoop kSquaredL2 = kAvx2 ? squared_l2_avx2 : squared_l2_baseline;
#else
const DistanceLoop kDot = dot_baseline;
const DistanceLoop kSquaredL2 = squared_l2_baseline;
#endif

}  // namespace

float dot(const float* a, const float* b, int dim) { return kDot(a, b, dim); }
float squared_l2(const float* a, const float* b, int dim) { return kSquaredL2(a, b, dim); }

}  // namespace cpu
}  // namespace grnnd
