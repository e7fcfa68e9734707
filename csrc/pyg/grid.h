// A uniform grid over the first (up to three) coordinates of the rows of x, per example, for
// exact k nearest neighbours of low-dimensional points (PyTorch Geometric's point clouds):
// instead of every row of its example, a query visits the cells around its own, ring after ring
// (cells at Chebyshev distance r = 0, 1, 2, ...), and stops when no point of an unvisited cell
// can be nearer than its k-th (the distance from the query to the faces of the visited block
// bounds them). Exact whatever the data: a query whose example has fewer than k rows, or whose
// k-th neighbour is far, just visits more rings; the rest of the coordinates only add to each
// distance.
//
// The CPU (csrc/cpu/knn_grid_cpu.cpp) and CUDA (csrc/cuda/knn_grid_cuda.cu) kernels return
// what knn_segments' scan of every row returns, bit for bit: the same distance arithmetic, and
// the best k kept ordered by (distance, row) so that ties go to the lower row in any visiting
// order. knn_segments takes this path where measured to win (use_grid in grid.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

namespace grnnd {

// Rows of x per cell the grid is sized for (on average over the data's bounding box).
constexpr int64_t kGridRowsPerCell = 4;
// The grid takes points of at most kGridMaxDim coordinates and k <= kGridMaxK; knn_segments'
// "auto" takes it where it is expected to be faster (use_grid).
constexpr int64_t kGridMaxDim = 3;
constexpr int64_t kGridMaxK = 32;

// The geometry kernels read: plain values, the same on the host and the device.
struct GridView {
  int dims;             // gridded coordinates, min(3, D)
  int64_t cells[3];     // per axis (1 on axes past dims)
  float lo[3];          // the box's low corner
  float size[3];        // cell size per axis
  int64_t per_example;  // cells[0] * cells[1] * cells[2]
  const int64_t* start;  // [examples * per_example + 1]: first sorted row of each cell
  const int64_t* rows;   // [nx]: the row of x at each sorted position
  const float* sorted;   // [nx, D]: x's rows in cell order

  // The cell index of a coordinate along `axis`, clamped into the grid.
  C10_HOST_DEVICE int64_t cell_of(int axis, float v) const {
    const float t = std::floor((v - lo[axis]) / size[axis]);
    if (!(t > 0)) return 0;  // also NaN
    return t >= static_cast<float>(cells[axis] - 1) ? cells[axis] - 1 : static_cast<int64_t>(t);
  }

  // A lower bound on the squared distance from q to any point of a cell outside the block of
  // cells [c - r, c + r] on every axis; +inf when the block covers the whole grid. Coordinates
  // were binned in float, so a point may sit a rounding error past its cell's face: the bound
  // gives that back.
  C10_HOST_DEVICE float outside_bound(const float* q, const int64_t* c, int64_t r) const {
    float nearest = INFINITY;
    for (int j = 0; j < dims; ++j) {
      const float slack = 1e-5f * (std::fabs(lo[j]) + std::fabs(q[j]) + static_cast<float>(cells[j]) * size[j]);
      if (c[j] - r > 0) {
        const float face = q[j] - (lo[j] + static_cast<float>(c[j] - r) * size[j]) - slack;
        nearest = face < nearest ? face : nearest;
      }
      if (c[j] + r + 1 < cells[j]) {
        const float face = lo[j] + static_cast<float>(c[j] + r + 1) * size[j] - q[j] - slack;
        nearest = face < nearest ? face : nearest;
      }
    }
    if (nearest == INFINITY) return INFINITY;
    return nearest > 0 ? nearest * nearest * (1.0f - 1e-5f) : 0.0f;
  }

  // Whether ring r already reached every cell.
  C10_HOST_DEVICE bool covers(const int64_t* c, int64_t r) const {
    for (int j = 0; j < 3; ++j) {
      if (c[j] - r > 0 || c[j] + r + 1 < cells[j]) return false;
    }
    return true;
  }

  // Calls visit(begin, end) with the sorted rows of every cell of `example` at Chebyshev
  // distance exactly r from cell c (clipped to the grid).
  template <typename Visit>
  C10_HOST_DEVICE void ring(int64_t example, const int64_t* c, int64_t r, Visit&& visit) const {
    const int64_t base = example * per_example;
    for (int64_t a = c[0] - r; a <= c[0] + r; ++a) {
      if (a < 0 || a >= cells[0]) continue;
      for (int64_t b = c[1] - r; b <= c[1] + r; ++b) {
        if (b < 0 || b >= cells[1]) continue;
        const bool edge = a == c[0] - r || a == c[0] + r || b == c[1] - r || b == c[1] + r;
        const int64_t step = edge || r == 0 ? 1 : 2 * r;  // inside the ring's faces: only both ends
        for (int64_t z = c[2] - r; z <= c[2] + r; z += step) {
          if (z < 0 || z >= cells[2]) continue;
          const int64_t cell = base + (a * cells[1] + b) * cells[2] + z;
          visit(start[cell], start[cell + 1]);
        }
      }
    }
  }
};

// The grid's tensors (kept alive while a GridView points into them) and its view.
struct Grid {
  at::Tensor start, rows, sorted;
  GridView view;
  bool valid;  // false where ptr_x descends somewhere: then only the scan follows its ranges
};

// Bins x's rows (float32 [nx, D], examples back to back as ptr_x says) into a grid sized for
// kGridRowsPerCell rows per cell on average. Reads the bounding box (and whether ptr_x ascends)
// on the host: one synchronisation on CUDA.
Grid make_grid(const at::Tensor& x, const at::Tensor& ptr_x);

// The queries y (in examples batch_y) in the order of their cells: int64 [ny], so that threads
// next to each other visit the same cells.
at::Tensor query_order(const Grid& grid, const at::Tensor& y, const at::Tensor& batch_y, int64_t examples);

// knn_segments by a valid grid of x (same results; k <= kGridMaxK): y float32 [ny, D] and
// batch_y int64 [ny] contiguous, `examples` as in ptr_x.
namespace cpu {
std::tuple<at::Tensor, at::Tensor> knn_grid_cpu(const Grid& grid, const at::Tensor& y, const at::Tensor& batch_y,
                                                int64_t examples, int64_t k);
}  // namespace cpu
namespace cuda {
std::tuple<at::Tensor, at::Tensor> knn_grid_cuda(const Grid& grid, const at::Tensor& y, const at::Tensor& batch_y,
                                                 int64_t examples, int64_t k);
}  // namespace cuda

// knn_segments' choice: whether the grid is the faster exact path for x in `examples` examples
// ("auto", from costs measured per device), or the one asked for ("grid" or "scan"; anything
// else raises). Never with no example.
bool use_grid(const std::string& method, const at::Tensor& x, int64_t examples, int64_t k);

}  // namespace grnnd
