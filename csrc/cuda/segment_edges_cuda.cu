// knn_segments' results as an edge index on the GPU: the twin of
// csrc/cpu/segment_edges_cpu.cpp. A warp per query row counts the entries the filter keeps, a
// scan turns the counts into offsets, and after reading the total (the one host
// synchronisation: the output's size) a second pass writes each row's kept entries at its
// offset. Five launches and no sort, against about ten small kernels for the same edges
// composed from torch ops (mask, nonzero, index, stack, flip).
#include <torch/library.h>

#include "../core/checks.h"
#include "detail/warp_cuda.cuh"

namespace grnnd {
namespace cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // a warp per query row: its k entries are read coalesced

// How many entries of query row q the filter keeps, over the row's k entries 32 at a time.
// Called by all lanes of the warp; every lane gets the count.
__device__ __forceinline__ int64_t kept_in_row(const float* dists, const int64_t* ids, int64_t q, int64_t k,
                                               const EdgeFilter& filter, int lane) {
  int64_t kept = 0;
  for (int64_t j0 = 0; j0 < k; j0 += kWarpSize) {
    const int64_t j = j0 + lane;
    kept += __popc(__ballot_sync(kFullMask, j < k && filter.keep(q, ids[q * k + j], dists[q * k + j])));
  }
  return kept;
}

__global__ void __launch_bounds__(kRowsPerBlock * kWarpSize)
    count_edges_kernel(const float* dists, const int64_t* ids, int64_t queries, int64_t k, EdgeFilter filter,
                       int64_t* counts) {
  const int64_t q = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (q >= queries) return;  // warp-uniform
  const int64_t kept = kept_in_row(dists, ids, q, k, filter, lane);
  if (lane == 0) counts[q] = kept < filter.most ? kept : filter.most;
}

// ends[q]: the offset after query q's edges (an inclusive scan of the counts, each at most
// filter.most). Each kept entry goes to its row's offset plus the kept entries before it (a
// ballot prefix), while that is before the row's end.
__global__ void __launch_bounds__(kRowsPerBlock * kWarpSize)
    write_edges_kernel(const float* dists, const int64_t* ids, int64_t queries, int64_t k, EdgeFilter filter,
                       const int64_t* ends, int64_t* query_row, int64_t* id_row) {
  const int64_t q = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (q >= queries) return;  // warp-uniform
  int64_t at = q == 0 ? 0 : ends[q - 1];
  const int64_t end = ends[q];
  for (int64_t j0 = 0; j0 < k && at < end; j0 += kWarpSize) {  // warp-uniform
    const int64_t j = j0 + lane;
    const int64_t id = j < k ? ids[q * k + j] : -1;
    const bool keep = j < k && filter.keep(q, id, dists[q * k + j]);
    const unsigned kept = __ballot_sync(kFullMask, keep);
    const int64_t slot = at + __popc(kept & lanes_below(lane));
    if (keep && slot < end) {
      query_row[slot] = q;
      id_row[slot] = id;
    }
    at += __popc(kept);
  }
}

at::Tensor segment_edges_cuda(const at::Tensor& dists, const at::Tensor& ids, c10::optional<double> max_distance,
                              bool drop_self, bool neighbour_first, int64_t most) {
  const EdgeFilter filter = check_segment_edges_inputs(dists, ids, max_distance, drop_self, most);
  const c10::cuda::CUDAGuard guard(ids.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(ids.device().index()).stream();
  const at::Tensor d = dists.contiguous(), i = ids.contiguous();
  const int64_t queries = i.size(0), k = i.size(1);
  if (queries == 0 || k == 0) return at::empty({2, 0}, i.options());
  const unsigned blocks = static_cast<unsigned>(ceil_div(queries, kRowsPerBlock));
  at::Tensor counts = at::empty({queries}, i.options());
  count_edges_kernel<<<blocks, kRowsPerBlock * kWarpSize, 0, stream>>>(d.data_ptr<float>(), i.data_ptr<int64_t>(), queries, k,
                                                          filter, counts.data_ptr<int64_t>());
  check_launch();
  const at::Tensor ends = counts.cumsum(0);
  const int64_t edges = ends[queries - 1].item<int64_t>();
  at::Tensor out = at::empty({2, edges}, i.options());
  if (edges == 0) return out;
  int64_t* query_row = out.data_ptr<int64_t>() + (neighbour_first ? edges : 0);
  int64_t* id_row = out.data_ptr<int64_t>() + (neighbour_first ? 0 : edges);
  write_edges_kernel<<<blocks, kRowsPerBlock * kWarpSize, 0, stream>>>(d.data_ptr<float>(), i.data_ptr<int64_t>(), queries, k,
                                                          filter, ends.data_ptr<int64_t>(), query_row, id_row);
  check_launch();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CUDA, m) { m.impl("segment_edges", &segment_edges_cuda); }

}  // namespace cuda
}  // namespace grnnd
