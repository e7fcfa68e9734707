// The best K (distance, row) pairs a thread has seen, ascending, in its registers: the per-query
// selection of the exact k-NN of point clouds (knn_segments_cuda.cu, knn_grid_cuda.cu; their
// CPU twins share insert_nearest, csrc/pyg/segments.h). K is a compile-time constant, so the
// loops unroll and the arrays stay in registers.
#pragma once

#include <cstdint>
#include <limits>

namespace grnnd {
namespace cuda {

// With ROW_TIES equal distances are ordered by row, so the result does not depend on the order
// rows arrive in (the grid visits cells in any order); without, a newcomer goes after the equal
// ones already held (the scan visits rows in order, so ties end up ordered by row there too). An
// empty slot is (+inf, -1): every finite distance goes before it, an infinite or NaN one never does.
template <int K, bool ROW_TIES>
struct RegisterTopK {
  float d[K];
  int32_t i[K];

  __device__ __forceinline__ static bool before(float da, int32_t ia, float db, int32_t ib) {
    return da < db || (ROW_TIES && da == db && ia < ib);
  }

  __device__ void init() {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      d[j] = std::numeric_limits<float>::infinity();
      i[j] = -1;
    }
  }

  __device__ __forceinline__ float worst() const { return d[K - 1]; }

  // Entries after the candidate move down one slot; the farthest falls off the end.
  __device__ __forceinline__ void insert(float dist, int32_t row) {
    if (!before(dist, row, d[K - 1], i[K - 1])) return;
#pragma unroll
    for (int j = K - 1; j > 0; --j) {
      if (before(dist, row, d[j - 1], i[j - 1])) {
        d[j] = d[j - 1];
        i[j] = i[j - 1];
      } else if (before(dist, row, d[j], i[j])) {
        d[j] = dist;
        i[j] = row;
      }
    }
    if (before(dist, row, d[0], i[0])) {
      d[0] = dist;
      i[0] = row;
    }
  }

  // The first k (<= K) into an output row.
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
