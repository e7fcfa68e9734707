// Parameters of the ops, parsed and validated once for every backend (params.cpp).
//
// The defaults live in the op schemas (csrc/grnnd.cpp); this file only turns the schema's
// arguments into typed structs and rejects values that make no sense, naming the argument.
#pragma once

#include <cstdint>
#include <string>

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

Metric parse_metric(const std::string& name);

// In which order a vertex walks its pool when applying the relative-neighbourhood rule
// (seed 000, section 4.3 / Figure 7): random is GRNND's disordered propagation, ascending is
// the sequential RNN-Descent order that traps a parallel build, descending is the ablation.
enum class UpdateOrder { kRandom, kAscending, kDescending };

UpdateOrder parse_update_order(const std::string& name);

// Largest pool a vertex may hold. The CUDA build copies a vertex's pool into its warp's share
// of shared memory, which bounds R; the CPU kernel shares the bound so both accept the same
// arguments.
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

BuildParams make_build_params(int64_t degree, int64_t initial_degree, int64_t pool_size, int64_t outer_iters,
                              int64_t inner_iters, double reverse_ratio, const std::string& update_order,
                              const std::string& metric, int64_t seed);

// Largest k the exact knn returns (its GPU selection keeps k plus a margin in shared memory).
constexpr int kMaxKnnK = 1024;

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

SearchParams make_search_params(int64_t k, int64_t list_size, int64_t search_width, int64_t max_iters,
                                const std::string& metric, int64_t seed);

}  // namespace grnnd
