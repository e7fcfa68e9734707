// Exact k nearest neighbours within segments on the GPU: the twin of
// csrc/cpu/knn_segments_cpu.cpp, for many small examples in one launch.
//
// One thread per query, 128 consecutive queries per block. A sorted batch (PyTorch Geometric's
// convention) puts a block's queries in one or a few neighbouring examples, so the block walks
// the union of their row ranges once, staging tiles of rows in shared memory that every thread
// reads by broadcast; each thread keeps only the rows of its own example. The running best k
// live in local memory in (distance, row) order; rows come in ascending order and only a
// strictly closer one is admitted, so ties go to the lower row, as on the CPU and in
// torch_cluster. Example bounds are clamped to [0, nx] and a query of an example outside
// [0, examples) has no candidates, so no input reads out of bounds.
#include <limits>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "vectors_cuda.cuh"

namespace grnnd {
namespace cuda {
namespace {

constexpr int kSegmentThreads = 128;
constexpr int kTileBytes = 48 * 1024;  // default dynamic shared memory, no opt-in needed

__global__ void __launch_bounds__(kSegmentThreads)
    knn_segments_kernel(const float* __restrict__ x, const float* __restrict__ y, const int64_t* __restrict__ ptr_x,
                        const int64_t* __restrict__ batch_y, int64_t nx, int64_t ny, int64_t examples, int dim,
                        int k, int tile_rows, float* __restrict__ out_d, int64_t* __restrict__ out_i) {
  extern __shared__ float tile[];  // tile_rows x dim
  __shared__ unsigned long long block_begin, block_end;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kSegmentThreads + threadIdx.x;
  const bool active = i < ny;
  const SegmentRange rows = active ? segment_range(ptr_x, examples, nx, batch_y[i]) : SegmentRange{0, 0};
  if (threadIdx.x == 0) {
    block_begin = static_cast<unsigned long long>(nx);
    block_end = 0;
  }
  __syncthreads();
  if (rows.end > rows.begin) {
    atomicMin(&block_begin, static_cast<unsigned long long>(rows.begin));
    atomicMax(&block_end, static_cast<unsigned long long>(rows.end));
  }
  __syncthreads();
  const int64_t first = static_cast<int64_t>(block_begin), last = static_cast<int64_t>(block_end);

  float* best_d = active ? out_d + i * k : nullptr;
  int64_t* best_i = active ? out_i + i * k : nullptr;
  float best[kMaxSegmentK];
  int64_t ids[kMaxSegmentK];
  for (int p = 0; p < k; ++p) {
    best[p] = std::numeric_limits<float>::infinity();
    ids[p] = -1;
  }
  const float* q = active ? y + i * dim : nullptr;
  for (int64_t t0 = first; t0 < last; t0 += tile_rows) {
    const int count = static_cast<int>(min(static_cast<int64_t>(tile_rows), last - t0));
    __syncthreads();  // the previous tile is no longer read
    for (int e = threadIdx.x; e < count * dim; e += kSegmentThreads) tile[e] = x[t0 * dim + e];
    __syncthreads();
    const int64_t c_begin = max(rows.begin, t0), c_end = min(rows.end, t0 + count);
    for (int64_t c = c_begin; c < c_end; ++c) {
      const float* r = tile + (c - t0) * dim;
      float d = 0.f;
      for (int j = 0; j < dim; ++j) {
        const float diff = q[j] - r[j];
        d += diff * diff;
      }
      if (!(d < best[k - 1])) continue;
      int p = k - 1;
      for (; p > 0 && best[p - 1] > d; --p) {
        best[p] = best[p - 1];
        ids[p] = ids[p - 1];
      }
      best[p] = d;
      ids[p] = c;
    }
  }
  if (active) {
    for (int p = 0; p < k; ++p) {
      best_d[p] = best[p];
      best_i[p] = ids[p];
    }
  }
}

std::tuple<at::Tensor, at::Tensor> knn_segments_cuda(const at::Tensor& x, const at::Tensor& y,
                                                     const at::Tensor& ptr_x, const at::Tensor& batch_y, int64_t k) {
  check_knn_segments_inputs(x, y, ptr_x, batch_y, k);
  TORCH_CHECK_VALUE(k <= kMaxSegmentK, "k: expected at most ", kMaxSegmentK, " on CUDA, got ", k);
  const int64_t dim = x.size(1);
  TORCH_CHECK_VALUE(dim * static_cast<int64_t>(sizeof(float)) <= kTileBytes, "x: expected at most ",
                    kTileBytes / sizeof(float), " columns on CUDA, got ", dim);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  const at::Tensor xs = x.contiguous(), ys = y.contiguous();
  const at::Tensor ptr = ptr_x.contiguous(), batch = batch_y.contiguous();
  const int64_t nx = xs.size(0), ny = ys.size(0);
  at::Tensor out_d = at::empty({ny, k}, y.options().dtype(at::kFloat));
  at::Tensor out_i = at::empty({ny, k}, y.options().dtype(at::kLong));
  if (ny == 0) return {out_d, out_i};
  const int tile_rows = static_cast<int>(std::min<int64_t>(256, kTileBytes / (dim * sizeof(float))));
  const int64_t blocks = (ny + kSegmentThreads - 1) / kSegmentThreads;
  knn_segments_kernel<<<static_cast<unsigned>(blocks), kSegmentThreads, tile_rows * dim * sizeof(float), stream>>>(
      xs.data_ptr<float>(), ys.data_ptr<float>(), ptr.data_ptr<int64_t>(), batch.data_ptr<int64_t>(), nx, ny,
      ptr.size(0) - 1, static_cast<int>(dim), static_cast<int>(k), tile_rows, out_d.data_ptr<float>(),
      out_i.data_ptr<int64_t>());
  check_launch();
  return {out_d, out_i};
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CUDA, m) { m.impl("knn_segments", &knn_segments_cuda); }

}  // namespace cuda
}  // namespace grnnd
