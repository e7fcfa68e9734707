// torch.ops.grnnd.search and knn called from C++ (the build's reachability repair and measures,
// knn_graph): their typed handles, declared once so that a change of a schema (csrc/grnnd.cpp) is
// made here alone.
#pragma once

#include <tuple>

#include <ATen/core/dispatch/Dispatcher.h>

namespace grnnd {

using SearchSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& data, const at::Tensor& graph, const at::Tensor& queries, int64_t k, int64_t list_size,
    int64_t search_width, int64_t max_iters, c10::string_view metric, int64_t seed,
    const c10::optional<at::Tensor>& filter, int64_t searches, int64_t hub_entries,
    const c10::optional<at::Tensor>& codes, const c10::optional<at::Tensor>& code_grid);

inline const c10::TypedOperatorHandle<SearchSignature>& search_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("grnnd::search", "").typed<SearchSignature>();
  return op;
}

using KnnSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& data, const at::Tensor& queries, int64_t k,
                                                         c10::string_view metric);

// torch.ops.grnnd.knn, the exact k nearest rows (knn_graph, the build's neighbourhood_dimensions).
inline const c10::TypedOperatorHandle<KnnSignature>& knn_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("grnnd::knn", "").typed<KnnSignature>();
  return op;
}

}  // namespace grnnd
