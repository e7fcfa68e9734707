// knn_segments by a grid on the CPU (grid.h): the twin of csrc/cuda/knn_grid_cuda.cu, one
// query per thread, the best k kept ordered by (distance, row).
#include <limits>
#include <vector>

#include <ATen/Parallel.h>

#include "../pyg/grid.h"
#include "../pyg/segments.h"

namespace grnnd {
namespace cpu {

std::tuple<at::Tensor, at::Tensor> knn_grid_cpu(const Grid& grid, const at::Tensor& ys, const at::Tensor& batch,
                                                int64_t examples, int64_t k) {
  const int64_t ny = ys.size(0), dim = ys.size(1);
  at::Tensor out_d = at::full({ny, k}, std::numeric_limits<float>::infinity(), ys.options());
  at::Tensor out_i = at::full({ny, k}, -1, ys.options().dtype(at::kLong));
  const GridView& g = grid.view;
  const float* yp = ys.data_ptr<float>();
  const int64_t* bp = batch.data_ptr<int64_t>();
  float* dp = out_d.data_ptr<float>();
  int64_t* ip = out_i.data_ptr<int64_t>();

  at::parallel_for(0, ny, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> best_d(k);
    std::vector<int64_t> best_i(k);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t example = bp[i];
      if (example < 0 || example >= examples) continue;
      const float* q = yp + i * dim;
      float corner[3] = {0, 0, 0};
      int64_t c[3] = {0, 0, 0};
      for (int j = 0; j < g.dims; ++j) {
        corner[j] = q[j];
        c[j] = g.cell_of(j, q[j]);
      }
      std::fill(best_d.begin(), best_d.end(), std::numeric_limits<float>::infinity());
      std::fill(best_i.begin(), best_i.end(), -1);
      const auto visit = [&](int64_t first, int64_t last) {
        for (int64_t s = first; s < last; ++s) {
          insert_nearest(best_d.data(), best_i.data(), k, ordered_squared_l2(q, g.sorted + s * dim, dim), g.rows[s]);
        }
      };
      for (int64_t r = 0;; ++r) {
        g.ring(example, c, r, visit);
        if (g.covers(c, r) || best_d[k - 1] < g.outside_bound(corner, c, r)) break;
      }
      std::copy(best_d.begin(), best_d.end(), dp + i * k);
      std::copy(best_i.begin(), best_i.end(), ip + i * k);
    }
  });
  return {out_d, out_i};
}

}  // namespace cpu
}  // namespace grnnd
