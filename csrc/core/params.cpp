#include "params.h"

#include <algorithm>
#include <cmath>

#include <c10/util/Exception.h>

namespace grnnd {

Metric parse_metric(const std::string& name) {
  if (name == "l2") return Metric::kL2;
  if (name == "ip") return Metric::kIP;
  if (name == "cosine") return Metric::kCosine;
  TORCH_CHECK_VALUE(false, "metric: expected one of \"l2\", \"ip\", \"cosine\", got \"", name, "\"");
}

UpdateOrder parse_update_order(const std::string& name) {
  if (name == "random") return UpdateOrder::kRandom;
  if (name == "ascending") return UpdateOrder::kAscending;
  if (name == "descending") return UpdateOrder::kDescending;
  if (name == "descending_then_random") return UpdateOrder::kDescendingThenRandom;
  TORCH_CHECK_VALUE(false,
                    "update_order: expected one of \"random\", \"ascending\", \"descending\", "
                    "\"descending_then_random\", got \"",
                    name, "\"");
}

Start parse_start(const std::string& name) {
  if (name == "hubs") return Start::kHubs;
  if (name == "random") return Start::kRandom;
  TORCH_CHECK_VALUE(false, "start: expected \"hubs\" or \"random\", got \"", name, "\"");
}

BuildParams make_build_params(int64_t degree, int64_t initial_degree, int64_t pool_size, int64_t outer_iters,
                              int64_t inner_iters, double reverse_ratio, const std::string& update_order,
                              const std::string& metric, int64_t seed, double delta, const std::string& start,
                              bool widen) {
  // A row keeps what the relative-neighbourhood rule left of its pool (about 15 entries on
  // clustered data) and is filled up to the degree from two hops away (fill.h), so the degree
  // may exceed the pool.
  TORCH_CHECK_VALUE(degree >= 1 && degree <= kMaxPoolSize, "degree: expected 1 <= degree <= ", kMaxPoolSize,
                    ", got ", degree);
  TORCH_CHECK_VALUE(pool_size >= 2 && pool_size <= kMaxPoolSize, "pool_size: expected 2 <= R <= ",
                    kMaxPoolSize, ", got ", pool_size);
  TORCH_CHECK_VALUE(initial_degree >= 1 && initial_degree <= pool_size,
                    "initial_degree: expected 1 <= S <= pool_size (", pool_size, "), got ", initial_degree);
  TORCH_CHECK_VALUE(outer_iters >= 1, "outer_iters: expected >= 1, got ", outer_iters);
  TORCH_CHECK_VALUE(inner_iters >= 0, "inner_iters: expected >= 0, got ", inner_iters);
  TORCH_CHECK_VALUE(reverse_ratio >= 0.0 && reverse_ratio <= 1.0,
                    "reverse_ratio: expected 0 <= rho <= 1, got ", reverse_ratio);
  TORCH_CHECK_VALUE(delta >= 0.0 && delta < 1.0, "delta: expected 0 <= delta < 1, got ", delta);
  return {static_cast<int>(degree),
          static_cast<int>(initial_degree),
          static_cast<int>(pool_size),
          static_cast<int>(outer_iters),
          static_cast<int>(inner_iters),
          reverse_ratio,
          parse_update_order(update_order),
          parse_metric(metric),
          static_cast<uint64_t>(seed),
          delta,
          parse_start(start),
          widen};
}

SearchParams make_search_params(int64_t k, int64_t list_size, int64_t search_width, int64_t max_iters,
                                const std::string& metric, int64_t seed, int64_t searches, int64_t hub_entries) {
  TORCH_CHECK_VALUE(k >= 1, "k: expected >= 1, got ", k);
  const int64_t list = list_size > 0 ? list_size : std::max<int64_t>(k, 64);
  TORCH_CHECK_VALUE(list <= kMaxListSize, "list_size: expected <= ", kMaxListSize, ", got ", list);
  TORCH_CHECK_VALUE(k <= list, "k: expected <= list_size (", list, "), got ", k);
  TORCH_CHECK_VALUE(search_width >= 0 && search_width <= 32, "search_width: expected 0 (automatic) .. 32, got ",
                    search_width);
  TORCH_CHECK_VALUE(max_iters >= 0, "max_iters: expected >= 0, got ", max_iters);
  TORCH_CHECK_VALUE(searches >= 0 && searches <= kMaxSearches, "searches: expected 0 (automatic) .. ",
                    kMaxSearches, ", got ", searches);
  TORCH_CHECK_VALUE(searches * k <= kMaxMergeKeys, "searches * k: expected <= ", kMaxMergeKeys,
                    " (the merged candidates of a query), got ", searches, " * ", k);
  TORCH_CHECK_VALUE(hub_entries >= -1 && hub_entries <= kMaxListSize,
                    "hub_entries: expected -1 (automatic) .. ", kMaxListSize, ", got ", hub_entries);
  return {static_cast<int>(k),         static_cast<int>(list), static_cast<int>(search_width),
          static_cast<int>(max_iters), parse_metric(metric),   static_cast<uint64_t>(seed),
          static_cast<int>(searches),  static_cast<int>(hub_entries)};
}

int list_per_search(int list_size, int k, int searches) {
  if (searches <= 1) return list_size;
  const int split = static_cast<int>(std::ceil(2.0 * list_size / std::sqrt(static_cast<double>(searches))));
  const int floor = std::max(k, (list_size + 1) / 2);  // deep enough for the last few neighbours
  return std::clamp(split, std::min(floor, list_size), list_size);
}

}  // namespace grnnd
