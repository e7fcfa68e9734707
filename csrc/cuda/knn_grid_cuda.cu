// knn_segments by a grid on the GPU (grid.h): the twin of csrc/cpu/knn_grid_cpu.cpp. One thread
// per query, queries taken in the order of their cells so that the threads of a warp visit the
// same cells (their rows then come from L1). The best K >= k are kept in registers ordered by
// (distance, row), so the result does not depend on the order cells are visited in; a query
// stops once its K-th best is nearer than any unvisited cell, which also bounds its k-th.
#include <limits>

#include <torch/library.h>

#include "../pyg/grid.h"
#include "detail/top_k_cuda.cuh"
#include "detail/vectors_cuda.cuh"

namespace grnnd {
namespace cuda {
namespace {

constexpr int kGridQueries = 128;  // threads per block

struct GridQueries {
  GridView grid;
  const float* y;        // [ny, dim]
  const int64_t* batch;  // [ny]
  const int64_t* order;  // [ny]: queries in cell order
  int64_t ny, examples;
  int dim, k;
  float* out_d;
  int64_t* out_i;
};

template <int K>
__global__ void __launch_bounds__(kGridQueries) knn_grid_kernel(GridQueries a) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kGridQueries + threadIdx.x;
  if (t >= a.ny) return;
  const int64_t i = a.order[t];
  const int64_t example = a.batch[i];
  if (example < 0 || example >= a.examples) return;  // the output stays padded
  const GridView& g = a.grid;
  const float* q = a.y + i * a.dim;
  float corner[3] = {0.0f, 0.0f, 0.0f};
  int64_t c[3] = {0, 0, 0};
  for (int j = 0; j < g.dims; ++j) {
    corner[j] = q[j];
    c[j] = g.cell_of(j, q[j]);
  }
  RegisterTopK<K, /*ROW_TIES=*/true> best;  // (distance, row) order: independent of the cells' order
  best.init();
  const auto visit = [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) {
      const float* r = g.sorted + s * a.dim;
      float d = 0.0f;
      for (int j = 0; j < a.dim; ++j) d = add_square(d, q[j], __ldg(r + j));
      best.insert(d, static_cast<int32_t>(__ldg(g.rows + s)));
    }
  };
  for (int64_t r = 0;; ++r) {
    g.ring(example, c, r, visit);
    if (g.covers(c, r) || best.worst() < g.outside_bound(corner, c, r)) break;
  }
  float* out_d = a.out_d + i * a.k;
  int64_t* out_i = a.out_i + i * a.k;
  best.store(out_d, out_i, a.k);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> knn_grid_cuda(const Grid& grid, const at::Tensor& ys, const at::Tensor& batch,
                                                 int64_t examples, int64_t k) {
  const int64_t ny = ys.size(0);
  at::Tensor out_d = at::full({ny, k}, std::numeric_limits<float>::infinity(), ys.options());
  at::Tensor out_i = at::full({ny, k}, -1, ys.options().dtype(at::kLong));
  if (ny == 0) return {out_d, out_i};
  const at::Tensor order = query_order(grid, ys, batch, examples);
  const GridQueries a{grid.view,
                      ys.data_ptr<float>(),
                      batch.data_ptr<int64_t>(),
                      order.data_ptr<int64_t>(),
                      ny,
                      examples,
                      static_cast<int>(ys.size(1)),
                      static_cast<int>(k),
                      out_d.data_ptr<float>(),
                      out_i.data_ptr<int64_t>()};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(ys.device().index()).stream();
  const unsigned blocks = static_cast<unsigned>(ceil_div(ny, kGridQueries));
  if (k <= 8) {
    knn_grid_kernel<8><<<blocks, kGridQueries, 0, stream>>>(a);
  } else if (k <= 16) {
    knn_grid_kernel<16><<<blocks, kGridQueries, 0, stream>>>(a);
  } else if (k <= 24) {
    knn_grid_kernel<24><<<blocks, kGridQueries, 0, stream>>>(a);
  } else {
    knn_grid_kernel<32><<<blocks, kGridQueries, 0, stream>>>(a);
  }
  check_launch();
  return {out_d, out_i};
}

}  // namespace cuda
}  // namespace grnnd
