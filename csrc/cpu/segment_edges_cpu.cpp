// knn_segments' results as an edge index on the CPU: the twin of
// csrc/cuda/segment_edges_cuda.cu. Two passes over the rows: how many entries of each row the
// filter keeps, then the kept entries at their row's offset, in row-major order.
#include <algorithm>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../core/checks.h"

namespace grnnd {
namespace cpu {
namespace {

at::Tensor segment_edges_cpu(const at::Tensor& dists, const at::Tensor& ids, c10::optional<double> max_distance,
                             bool drop_self, bool neighbour_first, int64_t most) {
  const EdgeFilter filter = check_segment_edges_inputs(dists, ids, max_distance, drop_self, most);
  const at::Tensor d = dists.contiguous(), i = ids.contiguous();
  const int64_t queries = i.size(0), k = i.size(1);
  const float* dp = d.data_ptr<float>();
  const int64_t* ip = i.data_ptr<int64_t>();
  std::vector<int64_t> offset(queries + 1, 0);
  at::parallel_for(0, queries, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      int64_t kept = 0;
      for (int64_t j = 0; j < k; ++j) kept += filter.keep(q, ip[q * k + j], dp[q * k + j]);
      offset[q + 1] = std::min(kept, filter.most);
    }
  });
  for (int64_t q = 0; q < queries; ++q) offset[q + 1] += offset[q];
  const int64_t edges = offset[queries];
  at::Tensor out = at::empty({2, edges}, i.options());
  int64_t* query_row = out.data_ptr<int64_t>() + (neighbour_first ? edges : 0);
  int64_t* id_row = out.data_ptr<int64_t>() + (neighbour_first ? 0 : edges);
  at::parallel_for(0, queries, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      int64_t at = offset[q];
      for (int64_t j = 0; j < k && at < offset[q + 1]; ++j) {
        if (!filter.keep(q, ip[q * k + j], dp[q * k + j])) continue;
        query_row[at] = q;
        id_row[at] = ip[q * k + j];
        ++at;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CPU, m) { m.impl("segment_edges", &segment_edges_cpu); }

}  // namespace cpu
}  // namespace grnnd
