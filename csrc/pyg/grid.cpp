// The grid of knn_segments' low-dimensional path (grid.h): binning in ATen, on either device.
#include "grid.h"

#include <algorithm>
#include <cmath>
#include <string>

#include <c10/util/Exception.h>

namespace grnnd {
namespace {

// At most this many cells in all (the start offsets take 8 bytes each).
constexpr int64_t kMaxGridCells = int64_t{1} << 25;

// Where "auto" takes the grid. On CUDA the grid costs a fixed ~1.2 ms (binning and sorting in
// ATen, one host synchronisation) plus ~16 ns a point, the scan ~2.8 ps a (query, row) pair;
// measured on an H100 with benchmarks/bench_pyg.py, d = 3, k = 16-20: 32 clouds x 1024 points
// took 1.74 ms by the grid against 0.35 ms by the scan, 8 x 16 384 3.58 ms against 5.92 ms, one
// cloud of 1M points 16.8 ms against 1158 ms. On the CPU the grid has no such fixed cost and
// won from about a thousand points an example (2 threads: 32 x 1024 in 56 ms against 86 ms).
constexpr double kCudaGridFixedSeconds = 1.2e-3;
constexpr double kCudaGridSecondsPerPoint = 1.6e-8;
constexpr double kCudaScanSecondsPerPair = 2.8e-12;
constexpr int64_t kCpuGridMinRowsPerExample = 512;

// int64 keys (example * per_example + cell) of points `p` [m, >= dims] in examples `example`
// [m]; points of no example (outside [0, examples)) get the key past every cell.
at::Tensor cell_keys(const GridView& g, const at::Tensor& p, const at::Tensor& example, int64_t examples) {
  at::Tensor key = at::zeros({p.size(0)}, p.options().dtype(at::kLong));
  for (int j = 0; j < g.dims; ++j) {
    // floor((v - lo) / size), clamped into the grid: GridView::cell_of, elementwise.
    const at::Tensor t = ((p.select(1, j) - g.lo[j]) / g.size[j]).floor().nan_to_num(0, 0, 0);
    key = key * g.cells[j] + t.clamp(0, static_cast<double>(g.cells[j] - 1)).to(at::kLong);
  }
  for (int j = g.dims; j < 3; ++j) key = key * g.cells[j];
  const at::Tensor inside = example.ge(0).logical_and_(example.lt(examples));
  return at::where(inside, example * g.per_example + key, examples * g.per_example);
}

}  // namespace

bool use_grid(const std::string& method, const at::Tensor& x, int64_t examples, int64_t k) {
  if (method == "scan" || examples < 1) return false;  // no example: no rows to bin, nothing to find
  if (method == "grid") {
    TORCH_CHECK_VALUE(k <= kGridMaxK, "knn_segments: method=\"grid\" takes k <= ", kGridMaxK, ", got ", k);
    return true;
  }
  TORCH_CHECK_VALUE(method == "auto", "method: expected \"auto\", \"grid\" or \"scan\", got \"", method, "\"");
  if (x.size(0) == 0 || x.size(1) > kGridMaxDim || k > kGridMaxK) return false;
  const double points = static_cast<double>(x.size(0)), per_example = points / static_cast<double>(examples);
  if (!x.is_cuda()) return per_example >= kCpuGridMinRowsPerExample;
  return points * per_example * kCudaScanSecondsPerPair > kCudaGridFixedSeconds + points * kCudaGridSecondsPerPoint;
}

Grid make_grid(const at::Tensor& x, const at::Tensor& ptr_x) {
  const int64_t nx = x.size(0), examples = ptr_x.size(0) - 1;
  GridView g{};
  g.dims = static_cast<int>(std::min<int64_t>(3, x.size(1)));
  for (int j = 0; j < 3; ++j) {
    g.cells[j] = 1;
    g.lo[j] = 0.0f;
    g.size[j] = 1.0f;
  }
  // The bounding box, read on the host.
  const at::Tensor coords = x.slice(1, 0, g.dims);
  const auto [low, high] = nx > 0 ? at::aminmax(coords, 0) : std::tuple<at::Tensor, at::Tensor>(
                                                                  at::zeros({g.dims}, x.options()),
                                                                  at::zeros({g.dims}, x.options()));
  // One transfer: the box, then whether ptr_x ascends (the grid bins rows by searching it).
  const at::Tensor ascends = examples > 1 ? ptr_x.slice(0, 1).ge(ptr_x.slice(0, 0, -1)).all().reshape({1})
                                          : at::ones({1}, ptr_x.options().dtype(at::kBool));
  const at::Tensor box = at::cat({at::stack({low, high}).flatten().to(at::kFloat), ascends.to(at::kFloat)})
                             .to(at::kCPU);
  const float* b = box.data_ptr<float>();
  // Cells for kGridRowsPerCell rows each in an average example, shaped like the box; an axis
  // without extent (or with a non-finite one) gets one cell.
  const int64_t per_example_rows = nx / std::max<int64_t>(1, examples);
  const double target = std::clamp<double>(static_cast<double>(per_example_rows) / kGridRowsPerCell, 1.0,
                                           static_cast<double>(kMaxGridCells / std::max<int64_t>(1, examples)));
  double volume = 1.0;
  int spread = 0;
  for (int j = 0; j < g.dims; ++j) {
    const double extent = static_cast<double>(b[g.dims + j]) - b[j];
    g.lo[j] = std::isfinite(b[j]) ? b[j] : 0.0f;
    if (std::isfinite(extent) && extent > 0) {
      volume *= extent;
      ++spread;
    }
  }
  const double side = spread > 0 ? std::pow(volume / std::max(1.0, target), 1.0 / spread) : 1.0;
  for (int j = 0; j < g.dims; ++j) {
    const double extent = static_cast<double>(b[g.dims + j]) - b[j];
    if (std::isfinite(extent) && extent > 0 && side > 0) {
      g.cells[j] = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(extent / side)), 1,
                                       static_cast<int64_t>(target) + 1);
      g.size[j] = static_cast<float>(extent / static_cast<double>(g.cells[j]));
      if (!(g.size[j] > 0)) {
        g.cells[j] = 1;
        g.size[j] = 1.0f;
      }
    }
  }
  g.per_example = g.cells[0] * g.cells[1] * g.cells[2];
  const int64_t total = std::max<int64_t>(examples, 0) * g.per_example;

  Grid grid;
  grid.valid = b[2 * g.dims] > 0;
  const at::Tensor example =
      at::searchsorted(ptr_x, at::arange(nx, ptr_x.options()), /*out_int32=*/false, /*right=*/true) - 1;
  const auto [sorted_keys, order] =
      at::sort(cell_keys(g, x, example, std::max<int64_t>(examples, 0)), /*stable=*/true, 0, false);
  grid.start = at::searchsorted(sorted_keys, at::arange(total + 1, sorted_keys.options()));
  grid.rows = order;
  grid.sorted = x.index_select(0, order).contiguous();
  g.start = grid.start.data_ptr<int64_t>();
  g.rows = grid.rows.data_ptr<int64_t>();
  g.sorted = grid.sorted.data_ptr<float>();
  grid.view = g;
  return grid;
}

// Query keys share the binning; exposed for the kernels' query order.
at::Tensor query_order(const Grid& grid, const at::Tensor& y, const at::Tensor& batch_y, int64_t examples) {
  return std::get<1>(at::sort(cell_keys(grid.view, y, batch_y, examples), /*stable=*/true, 0, false));
}

}  // namespace grnnd
