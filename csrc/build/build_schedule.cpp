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
  const int64_t k = std::min(n, kUnfoundK);
  // The search's defaults otherwise: width, iterations, seed, searches and hub entries as a
  // user's search of this graph would take them.
  const at::Tensor ids = std::get<1>(search_op().call(data, graph, data.index_select(0, rows), k,
                                                      std::max(kUnfoundList, k), 0, 0, metric, 0, c10::nullopt, 0, -1,
                                                      /*codes=*/c10::nullopt, /*code_grid=*/c10::nullopt));
  const at::Tensor found = ids.eq(rows.unsqueeze(1)).any(1);
  return 1.0 - found.to(at::kDouble).mean().item<double>();
}

}  // namespace grnnd
