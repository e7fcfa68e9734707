// What the exact CUDA k-NN kernels (knn_segments_cuda.cu, knn_grid_cuda.cu) share with each other
// and with their CPU twins: the distance step and the best k of a query in registers.
#pragma once

#include <cstdint>
#include <limits>

namespace grnnd {
namespace cuda {

// The CPU's per-dimension step, d += (q - r)^2, rounded the same way (no contraction to an FMA).
__device__ __forceinline__ float add_square(float d, float q, float r) {
  const float diff = __fsub_rn(q, r);
  return __fadd_rn(d, __fmul_rn(diff, diff));
}

// The best K (distance, row) pairs seen so far, ascending, in registers. Candidates that arrive
// in row order (the scan) need only distances: a candidate goes after the entries at an equal
// distance, so ties go to the lower row. kAnyOrder compares (distance, row) instead, for
// candidates in any order (the grid), with the same result. An empty slot is (+inf, -1): every
// finite distance goes before it, an infinite one never does.
template <int K, bool kAnyOrder = false>
struct RegisterBest {
  float d[K];
  int32_t i[K];

  __device__ void init() {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      d[j] = std::numeric_limits<float>::infinity();
      i[j] = -1;
    }
  }

  __device__ __forceinline__ float worst() const { return d[K - 1]; }

  // Whether (dist, row) goes before the entry in slot j.
  __device__ __forceinline__ bool before(float dist, int32_t row, int j) const {
    if constexpr (kAnyOrder) return dist < d[j] || (dist == d[j] && row < i[j]);
    return dist < d[j];
  }

  // Entries after the candidate move up one slot and it takes the slot they left; the farthest
  // entry falls off the end.
  __device__ __forceinline__ void insert(float dist, int32_t row) {
    if (!before(dist, row, K - 1)) return;
#pragma unroll
    for (int j = K - 1; j > 0; --j) {
      if (before(dist, row, j - 1)) {
        d[j] = d[j - 1];
        i[j] = i[j - 1];
      } else if (before(dist, row, j)) {
        d[j] = dist;
        i[j] = row;
      }
    }
    if (before(dist, row, 0)) {
      d[0] = dist;
      i[0] = row;
    }
  }

  __device__ void store(float* out_d, int64_t* out_i, int k) const {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      if (j < k) {
        out_d[j] = d[j];
        out_i[j] = i[j];
      }
    }
  }
};

}  // namespace cuda
}  // namespace grnnd
