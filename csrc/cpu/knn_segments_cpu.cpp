// Exact k nearest neighbours within segments on the CPU: the twin of
// csrc/cuda/knn_segments_cuda.cu, which returns the same neighbours and distances.
//
// A batch of small examples (point clouds, graphs) in one call, as PyTorch Geometric batches
// them: the rows of example b of `x` are ptr_x[b] .. ptr_x[b + 1], and query i of `y` looks
// only at the rows of example batch_y[i]. Candidates are visited in row order and kept by
// (distance, row), so ties go to the lower row, as in torch_cluster.
#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../core/checks.h"
#include "../pyg/grid.h"

namespace grnnd {
namespace cpu {
namespace {

std::tuple<at::Tensor, at::Tensor> knn_segments_cpu(const at::Tensor& x, const at::Tensor& y,
                                                    const c10::optional<at::Tensor>& ptr_x, const at::Tensor& batch_y,
                                                    int64_t k, c10::string_view method,
                                                    const c10::optional<at::Tensor>& batch_x, int64_t examples_given) {
  const SegmentsOfX segments = check_knn_segments_inputs(x, y, ptr_x, batch_y, k, batch_x, examples_given);
  const at::Tensor xs = x.contiguous(), ys = y.contiguous();
  const at::Tensor ptr = segments.as_ptr(), batch = batch_y.contiguous();
  const int64_t nx = xs.size(0), ny = ys.size(0), dim = xs.size(1), examples = segments.examples;
  if (use_grid(std::string(method), xs, examples, k)) {
    const Grid grid = make_grid(xs, ptr);
    if (grid.valid) return knn_grid_cpu(grid, ys, batch, examples, k);
    TORCH_CHECK_VALUE(method != "grid", "knn_segments: method=\"grid\" needs ascending ptr_x");
  }
  at::Tensor out_d = at::full({ny, k}, std::numeric_limits<float>::infinity(), y.options().dtype(at::kFloat));
  at::Tensor out_i = at::full({ny, k}, -1, y.options().dtype(at::kLong));
  const float* xp = xs.data_ptr<float>();
  const float* yp = ys.data_ptr<float>();
  const int64_t* pp = ptr.data_ptr<int64_t>();
  const int64_t* bp = batch.data_ptr<int64_t>();
  float* dp = out_d.data_ptr<float>();
  int64_t* ip = out_i.data_ptr<int64_t>();

  at::parallel_for(0, ny, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const SegmentRange rows = segment_range(pp, examples, nx, bp[i]);
      float* best_d = dp + i * k;
      int64_t* best_i = ip + i * k;
      const float* q = yp + i * dim;
      for (int64_t c = rows.begin; c < rows.end; ++c) {
        insert_nearest(best_d, best_i, k, ordered_squared_l2(q, xp + c * dim, dim), c);
      }
    }
  });
  return {out_d, out_i};
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CPU, m) { m.impl("knn_segments", &knn_segments_cpu); }

}  // namespace cpu
}  // namespace grnnd
