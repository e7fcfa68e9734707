// The build's measure of reach between outer iterations (build_schedule.h, unfound_share).
#include "build_schedule.h"

#include <algorithm>

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

}  // namespace grnnd
