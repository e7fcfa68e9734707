// knn_graph: the k nearest other rows of every row, for any backend, composed from the ops
// (build + search, or knn when exact) through the dispatcher.
#include <torch/library.h>

#include "../core/checks.h"
#include "../core/search_op.h"

namespace grnnd {
namespace {

std::tuple<at::Tensor, at::Tensor> knn_graph(const at::Tensor& data, int64_t k, c10::string_view metric, bool exact,
                                             int64_t list_size, int64_t seed) {
  check_points(data, "data");
  const int64_t n = data.size(0);
  TORCH_CHECK_VALUE(k >= 1 && k < n, "k: expected 1 <= k <= ", n - 1,
                    " (number of data rows minus the row itself), got ", k);
  static const auto build_op = c10::Dispatcher::singleton().findSchemaOrThrow("grnnd::build", "").typed<
      at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, double, c10::string_view,
                 c10::string_view, int64_t, double, c10::string_view, const c10::optional<at::Tensor>&,
                 int64_t, c10::string_view, const c10::optional<at::Tensor>&, double, bool)>();

  at::Tensor dists, ids;
  if (exact) {
    std::tie(dists, ids) = knn_op().call(data, data, k + 1, metric);
  } else {
    // The build's own defaults, read from the schema, so they live in one place.
    const auto& args = build_op.schema().arguments();
    auto int_default = [&](const char* name) { return args[*build_op.schema().argumentIndexWithName(name)].default_value()->toInt(); };
    auto float_default = [&](const char* name) { return args[*build_op.schema().argumentIndexWithName(name)].default_value()->toDouble(); };
    auto str_default = [&](const char* name) { return args[*build_op.schema().argumentIndexWithName(name)].default_value()->toStringRef(); };
    auto bool_default = [&](const char* name) {
      return args[*build_op.schema().argumentIndexWithName(name)].default_value()->toBool();
    };
    const at::Tensor graph =
        build_op.call(data, int_default("degree"), int_default("initial_degree"), int_default("pool_size"),
                      int_default("outer_iters"), int_default("inner_iters"), float_default("reverse_ratio"),
                      str_default("update_order"), metric, seed, float_default("delta"), str_default("start"),
                      /*init=*/c10::nullopt, /*init_split=*/0, str_default("init_mode"),
                      /*pair_code_rows=*/c10::nullopt, /*pair_code_scale=*/0.0, bool_default("widen"));
    std::tie(dists, ids) = search_op().call(data, graph, data, k + 1, list_size > 0 ? std::max(list_size, k + 1) : 0, 1,
                                          0, metric, seed, c10::nullopt, /*searches=*/0, /*hub_entries=*/-1,
                                          /*codes=*/c10::nullopt, /*code_grid=*/c10::nullopt);
  }
  // Drop each row's own id; where the row is missing from its list, drop the last entry.
  // A stable sort of the "drop" marks keeps the order of the rest and needs no host sync.
  const at::Tensor self = at::arange(n, ids.options()).unsqueeze(1);
  at::Tensor drop = ids.eq(self);
  drop.select(1, k).logical_or_(drop.any(1).logical_not());
  const at::Tensor keep = std::get<1>(at::sort(drop.to(at::kByte), /*stable=*/c10::optional<bool>(true), /*dim=*/1,
                                                    /*descending=*/false)).narrow(1, 0, k);
  return {dists.gather(1, keep), ids.gather(1, keep)};
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CompositeExplicitAutograd, m) { m.impl("knn_graph", &knn_graph); }

}  // namespace grnnd
