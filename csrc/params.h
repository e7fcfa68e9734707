// Parameters of the ops, parsed and validated once for every backend.
//
// The defaults live in the op schemas (csrc/grnnd.cpp); this file only turns the schema's
// arguments into typed structs and rejects values that make no sense, naming the argument.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include <c10/util/Exception.h>

namespace grnnd {

// Distances are always "smaller is closer":
//   kL2     squared Euclidean distance,
//   kIP     negative inner product,
//   kCosine 1 - cosine similarity (computed as 1 - <x, y> on rows normalised once up front).
enum class Metric { kL2, kIP, kCosine };

// Inner product is no metric, and the relative-neighbourhood rule on -<x, y> lets long vectors
// collect every edge. The build therefore works in a lifted space where each row gets one more
// coordinate, sqrt(M^2 - |x|^2) with M the largest norm: there |x' - y'|^2 is a true squared
// Euclidean distance, and for a query lifted with 0, |q' - x'|^2 = |q|^2 + M^2 - 2<q, x> ranks
// rows exactly as -<q, x> does. So the graph is built on lifted l2 and searched with plain -ip.
inline bool lifts_inner_product(Metric metric) { return metric == Metric::kIP; }

inline Metric parse_metric(const std::string& name) {
  if (name == "l2") return Metric::kL2;
  if (name == "ip") return Metric::kIP;
  if (name == "cosine") return Metric::kCosine;
  TORCH_CHECK_VALUE(false, "metric: expected one of \"l2\", \"ip\", \"cosine\", got \"", name, "\"");
}

// In which order a vertex walks its pool when applying the relative-neighbourhood rule
// (seed 000, section 4.3 / Figure 7): random is GRNND's disordered propagation, ascending is
// the sequential RNN-Descent order that traps a parallel build, descending is the ablation.
enum class UpdateOrder { kRandom, kAscending, kDescending };

inline UpdateOrder parse_update_order(const std::string& name) {
  if (name == "random") return UpdateOrder::kRandom;
  if (name == "ascending") return UpdateOrder::kAscending;
  if (name == "descending") return UpdateOrder::kDescending;
  TORCH_CHECK_VALUE(false, "update_order: expected one of \"random\", \"ascending\", \"descending\", got \"",
                    name, "\"");
}

// Largest pool a vertex may hold. The CUDA kernels keep a pool in registers of one warp
// (a few slots per lane), which bounds R; the CPU kernel shares the bound so both accept the
// same arguments.
constexpr int kMaxPoolSize = 256;

struct BuildParams {
  int degree;            // out-degree of the returned graph
  int initial_degree;    // S: random neighbours each vertex starts with
  int pool_size;         // R: capacity of a vertex's candidate pool
  int outer_iters;       // T1: rounds of (T2 updates + reverse-edge sampling)
  int inner_iters;       // T2: update rounds per outer iteration
  double reverse_ratio;  // rho: share of each pool (closest first) that gets a reverse edge
  UpdateOrder update_order;
  Metric metric;
  uint64_t seed;
};

inline BuildParams make_build_params(int64_t degree, int64_t initial_degree, int64_t pool_size,
                                     int64_t outer_iters, int64_t inner_iters, double reverse_ratio,
                                     const std::string& update_order, const std::string& metric,
                                     int64_t seed) {
  TORCH_CHECK_VALUE(degree >= 1, "degree: expected >= 1, got ", degree);
  TORCH_CHECK_VALUE(pool_size >= 2 && pool_size <= kMaxPoolSize, "pool_size: expected 2 <= R <= ",
                    kMaxPoolSize, ", got ", pool_size);
  TORCH_CHECK_VALUE(degree <= pool_size, "degree: expected <= pool_size (", pool_size, "), got ", degree);
  TORCH_CHECK_VALUE(initial_degree >= 1 && initial_degree <= pool_size,
                    "initial_degree: expected 1 <= S <= pool_size (", pool_size, "), got ", initial_degree);
  TORCH_CHECK_VALUE(outer_iters >= 1, "outer_iters: expected >= 1, got ", outer_iters);
  TORCH_CHECK_VALUE(inner_iters >= 0, "inner_iters: expected >= 0, got ", inner_iters);
  TORCH_CHECK_VALUE(reverse_ratio >= 0.0 && reverse_ratio <= 1.0,
                    "reverse_ratio: expected 0 <= rho <= 1, got ", reverse_ratio);
  return {static_cast<int>(degree),      static_cast<int>(initial_degree), static_cast<int>(pool_size),
          static_cast<int>(outer_iters), static_cast<int>(inner_iters),    reverse_ratio,
          parse_update_order(update_order), parse_metric(metric),        static_cast<uint64_t>(seed)};
}

// Largest internal list the search keeps (k <= list_size <= this).
constexpr int kMaxListSize = 1024;

struct SearchParams {
  int k;
  int list_size;     // internal sorted candidate list (CAGRA's itopk, HNSW's ef)
  int search_width;  // parents expanded per iteration
  int max_iters;     // iteration cap; 0 = until no unexpanded parent is left
  Metric metric;
  uint64_t seed;     // for the random entry points
};

inline SearchParams make_search_params(int64_t k, int64_t list_size, int64_t search_width,
                                       int64_t max_iters, const std::string& metric, int64_t seed) {
  TORCH_CHECK_VALUE(k >= 1, "k: expected >= 1, got ", k);
  const int64_t list = list_size > 0 ? list_size : std::max<int64_t>(k, 64);
  TORCH_CHECK_VALUE(list <= kMaxListSize, "list_size: expected <= ", kMaxListSize, ", got ", list);
  TORCH_CHECK_VALUE(k <= list, "k: expected <= list_size (", list, "), got ", k);
  TORCH_CHECK_VALUE(search_width >= 1 && search_width <= 32, "search_width: expected 1..32, got ", search_width);
  TORCH_CHECK_VALUE(max_iters >= 0, "max_iters: expected >= 0, got ", max_iters);
  return {static_cast<int>(k), static_cast<int>(list), static_cast<int>(search_width),
          static_cast<int>(max_iters), parse_metric(metric), static_cast<uint64_t>(seed)};
}

}  // namespace grnnd
