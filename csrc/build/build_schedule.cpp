// The build's measures of its rows (build_schedule.h): reach between outer iterations
// (unfound_share) and the spread of their neighbourhoods that sizes a widening's pools
// (neighbourhood_dimensions).
#include "build_schedule.h"

#include <algorithm>
#include <vector>

#include <torch/library.h>

#include "../core/search_op.h"
#include "hubs.h"

namespace grnnd {

double unfound_share(const at::Tensor& data, const at::Tensor& graph, c10::string_view metric) {
  const int64_t n = data.size(0);
  if (n == 0) return 0.0;
  const int64_t count = std::min(n, kUnfoundSample);
  const at::Tensor rows = strata_rows(n, count, data.options());
  const at::Tensor sampled = data.index_select(0, rows);
  const int64_t k = std::min(n, kUnfoundK);
  // The search's defaults otherwise: width, iterations, seed, searches and hub entries as a
  // user's search of this graph would take them.
  const at::Tensor ids = std::get<1>(search_op().call(data, graph, sampled, k,
                                                      std::max(kUnfoundList, k), 0, 0, metric, 0, c10::nullopt, 0, -1,
                                                      /*codes=*/c10::nullopt, /*code_grid=*/c10::nullopt));
  // A row counts as found when a result is the row or a copy of it: a row with k copies need
  // not come first among them (CPU: 20 rows all alike measured 0.8 by ids alone, 1 000 rows of
  // eight copies each 0.5; both 0 now).
  const at::Tensor queries = sampled.unsqueeze(1);
  const at::Tensor results = data.index_select(0, ids.clamp_min(0).flatten()).view({count, k, data.size(1)});
  const at::Tensor found = (results.eq(queries).all(2) & ids.ge(0)).any(1);
  return 1.0 - found.to(at::kDouble).mean().item<double>();
}

double neighbourhood_dimensions(const at::Tensor& data, c10::string_view metric) {
  TORCH_CHECK_VALUE(metric == "l2" || metric == "cosine", "neighbourhood_dimensions: expected metric \"l2\" or ",
                    "\"cosine\" (inner products are no distances), got \"", metric, "\"");
  const int64_t n = data.size(0), dims = data.size(1);
  if (n <= kDimensionK) return 1.0;
  const at::Tensor queries = data.index_select(0, strata_rows(n, std::min(n, kDimensionSample), data.options()));
  // The exact search a slice of the rows at a time, so that its products (queries x rows, float32)
  // stay a small share of the pools beside them: one search of all 200 000 rows of a build took
  // 410 MB, against pools of 154 MB.
  const int64_t slice = std::max(kDimensionK + 1, (n + kDimensionSlices - 1) / kDimensionSlices);
  std::vector<at::Tensor> slice_dists, slice_ids;
  for (int64_t first = 0; first < n; first += slice) {
    const int64_t length = std::min(slice, n - first);
    auto found = knn_op().call(data.narrow(0, first, length), queries, std::min(kDimensionK + 1, length), metric);
    slice_dists.push_back(std::get<0>(found));
    slice_ids.push_back(std::get<1>(found) + first);
  }
  const at::Tensor nearest = std::get<1>(at::cat(slice_dists, 1).topk(kDimensionK + 1, 1, /*largest=*/false));
  // The first neighbour is the row itself (or a copy of it) and is left out.
  const at::Tensor ids = at::cat(slice_ids, 1).gather(1, nearest).narrow(1, 1, kDimensionK);
  at::Tensor neighbours = data.index_select(0, ids.flatten()).to(at::kFloat).view({-1, kDimensionK, dims});
  if (metric == "cosine") neighbours = neighbours / neighbours.norm(2, {2}, true).clamp_min(1e-30);
  // Neighbours 0 and 1, 2 and 3, ...: differences that share no row, as unit vectors (a zero
  // difference, of two copies, stays zero and counts as orthogonal to the others).
  const at::Tensor steps = neighbours.slice(1, 0, kDimensionK, 2) - neighbours.slice(1, 1, kDimensionK, 2);
  const at::Tensor units = steps / steps.norm(2, {2}, true).clamp_min(1e-30);
  const int64_t pairs = kDimensionK / 2;
  const at::Tensor squares = at::bmm(units, units.transpose(1, 2)).pow(2);
  // The mean over the pairs of two different differences: all entries less the diagonal's ones.
  const double off_diagonal = (squares.sum() - squares.diagonal(0, 1, 2).sum()).item<double>() /
                              static_cast<double>(squares.size(0) * pairs * (pairs - 1));
  return std::min(1.0, 1.0 / (std::max(off_diagonal, 1e-30) * static_cast<double>(dims)));
}

TORCH_LIBRARY_IMPL(grnnd, CompositeExplicitAutograd, m) {
  m.impl("neighbourhood_dimensions", &neighbourhood_dimensions);
}

}  // namespace grnnd
