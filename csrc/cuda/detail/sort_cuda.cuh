// Block-wide sorting of (distance, id) keys in shared memory: the bitonic networks the search
// merges its candidate lists with (seed 002, OB 8) and the exact k-NN selects with.
//
// Every function here is called by all threads of a block together, in blocks of whole warps.
#pragma once

#include <cstdint>
#include <limits>

#include "vectors_cuda.cuh"

namespace grnnd {
namespace cuda {

constexpr uint32_t kEmptyId = 0x7fffffffu;  // unused slot; above every real id (n < 2^31 - 1)
constexpr uint32_t kIdMask = 0x7fffffffu;   // the bits of a key's id that order it; the top bit is a flag
// Sorting networks up to this many keys run in warp 0 alone with __syncwarp between stages:
// at <= 2 compare-exchanges per lane and stage that is cheaper than a block-wide barrier.
constexpr int kWarpSortMax = 128;

__host__ __device__ constexpr int next_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

// Total order on (distance, id): ties broken by id so that every thread, every run, sorts
// the same way (results are reproducible, and a CUDA-graph replay equals the eager call).
__device__ __forceinline__ bool key_less(float da, uint32_t ia, float db, uint32_t ib) {
  ia &= kIdMask;
  ib &= kIdMask;
  return da < db || (da == db && ia < ib);
}

__device__ __forceinline__ void compare_swap(float* d, uint32_t* id, int lo, int hi, bool ascending) {
  const float dl = d[lo], dh = d[hi];
  const uint32_t il = id[lo], ih = id[hi];
  if (key_less(dh, ih, dl, il) == ascending) {
    d[lo] = dh;
    d[hi] = dl;
    id[lo] = ih;
    id[hi] = il;
  }
}

// One stage of a bitonic network over n keys: pair t compares slots lo and lo + stride. With
// `size` = 0 every pair sorts ascending (a merge stage); otherwise pairs alternate direction in
// blocks of `size` (a stage of the full sort).
__device__ __forceinline__ void bitonic_stage(float* d, uint32_t* id, int n, int size, int stride, int first,
                                              int step) {
  for (int t = first; t < n / 2; t += step) {
    const int lo = 2 * t - (t & (stride - 1));
    compare_swap(d, id, lo, lo + stride, size == 0 || (lo & size) == 0);
  }
}

// Sorts n keys ascending (n a power of two), or, with kMergeOnly, sorts a bitonic sequence of n
// keys. Called by the whole block after a __syncthreads that published the keys; returns after
// one, so the result is visible to every thread.
template <bool kMergeOnly>
__device__ void bitonic(float* d, uint32_t* id, int n) {
  if (n >= 2) {
    const int first_size = kMergeOnly ? n : 2;
    if (n <= kWarpSortMax) {
      if (threadIdx.x < kWarpSize) {
        for (int size = first_size; size <= n; size <<= 1) {
          for (int stride = size >> 1; stride > 0; stride >>= 1) {
            bitonic_stage(d, id, n, size == n ? 0 : size, stride, threadIdx.x, kWarpSize);
            __syncwarp();  // orders warp 0's shared-memory writes before the next stage reads
          }
        }
      }
    } else {
      // Pair t of a stage is thread t % blockDim.x's (blockDim.x a multiple of 32), so the 32
      // pairs [32 w, 32 w + 32) are always one warp's, and at strides up to 32 they touch only
      // the 64 keys [64 w, 64 w + 64): a run of such stages needs no block-wide barrier, only
      // the warp's own. The barrier stays where a stride above 32 ends or begins. Of the 55
      // stages that sort 1 024 keys, 45 run between warp barriers.
      for (int size = first_size; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
          bitonic_stage(d, id, n, size == n ? 0 : size, stride, threadIdx.x, blockDim.x);
          const int next_stride = stride > 1 ? stride >> 1 : size;  // the next size starts at size
          if (stride > kWarpSize || next_stride > kWarpSize) {
            __syncthreads();
          } else {
            __syncwarp();  // orders the warp's shared-memory writes before its next stage reads
          }
        }
      }
    }
  }
  __syncthreads();
}

// Merges the sorted src[0, n_src) into the sorted dst[0, cap) (cap a power of two) and keeps
// its best `keep` entries, the rest emptied. Comparing dst[j] with src[cap-1-j] is the first
// half-cleaner of a bitonic merge of dst ++ reversed src; its lower half holds the cap smallest
// keys as a bitonic sequence, which a log2(cap)-stage merge then sorts. Called by the whole
// block after a __syncthreads that published src; dst is final for all threads at the next one.
__device__ inline void merge_sorted(float* dst_d, uint32_t* dst_i, int cap, int keep, const float* src_d,
                             const uint32_t* src_i, int n_src) {
  for (int j = threadIdx.x; j < cap; j += blockDim.x) {
    const int r = cap - 1 - j;
    if (r < n_src && key_less(src_d[r], src_i[r], dst_d[j], dst_i[j])) {
      dst_d[j] = src_d[r];
      dst_i[j] = src_i[r];
    }
  }
  __syncthreads();
  bitonic<true>(dst_d, dst_i, cap);
  for (int j = keep + threadIdx.x; j < cap; j += blockDim.x) {
    dst_d[j] = std::numeric_limits<float>::infinity();
    dst_i[j] = kEmptyId;
  }
}

// Register-resident keys of one warp: lane l holds one key (d, id). One compare-exchange stage of
// a bitonic network across lanes: the partner is lane ^ stride; the lower lane of a pair keeps
// the smaller key when `ascending`, else the larger.
__device__ __forceinline__ void warp_exchange(float& d, uint32_t& id, int stride, bool ascending) {
  const int lane = threadIdx.x % kWarpSize;
  const float od = __shfl_xor_sync(kFullMask, d, stride);
  const uint32_t oi = __shfl_xor_sync(kFullMask, id, stride);
  const bool lower = (lane & stride) == 0;
  const bool take = lower == ascending ? key_less(od, oi, d, id) : key_less(d, id, od, oi);
  if (take) {
    d = od;
    id = oi;
  }
}

// Sorts the warp's 32 keys ascending by lane (called by all lanes of one warp).
__device__ __forceinline__ void warp_sort32(float& d, uint32_t& id) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int size = 2; size <= kWarpSize; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) warp_exchange(d, id, stride, (lane & size) == 0);
  }
}

// A sorted list of 32 * ROWS keys held by one warp (lane l: position r * 32 + l in register row
// r) takes in the warp's 32 sorted keys (lane l: position l) and keeps its best `keep`
// (<= 32 * ROWS), the rest emptied: the half-cleaner of a bitonic merge of list ++ reversed keys
// (only the last row meets a real key, the others meet padding), then the bitonic merge of the
// surviving 32 * ROWS keys: strides of whole rows compare within a lane, strides below 32 across
// lanes. The same network merge_sorted runs in shared memory.
template <int ROWS>
__device__ __forceinline__ void warp_merge(float (&d)[ROWS], uint32_t (&id)[ROWS], float cd, uint32_t ci, int keep) {
  const int lane = threadIdx.x % kWarpSize;
  const float rd = __shfl_sync(kFullMask, cd, kWarpSize - 1 - lane);
  const uint32_t ri = __shfl_sync(kFullMask, ci, kWarpSize - 1 - lane);
  if (key_less(rd, ri, d[ROWS - 1], id[ROWS - 1])) {
    d[ROWS - 1] = rd;
    id[ROWS - 1] = ri;
  }
#pragma unroll
  for (int rows = ROWS / 2; rows > 0; rows >>= 1) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if ((r & rows) == 0 && key_less(d[r + rows], id[r + rows], d[r], id[r])) {
        const float td = d[r];
        const uint32_t ti = id[r];
        d[r] = d[r + rows];
        id[r] = id[r + rows];
        d[r + rows] = td;
        id[r + rows] = ti;
      }
    }
  }
#pragma unroll
  for (int stride = kWarpSize / 2; stride > 0; stride >>= 1) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) warp_exchange(d[r], id[r], stride, true);
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (r * kWarpSize + lane >= keep) {
      d[r] = std::numeric_limits<float>::infinity();
      id[r] = kEmptyId;
    }
  }
}

}  // namespace cuda
}  // namespace grnnd
