// Parameters of the ops, parsed and validated once for every backend (params.cpp).
//
// The defaults live in the op schemas (csrc/grnnd.cpp); this file only turns the schema's
// arguments into typed structs and rejects values that make no sense, naming the argument.
#pragma once

#include <cstdint>
#include <algorithm>
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
// the sequential RNN-Descent order that traps a parallel build, descending is the paper's
// ablation and the default: with delta = 0.02 it built better graphs than random with 0.01 on
// real sentence embeddings and clustered data from 1M to 10M rows (benchmarks/README.md).
// Descending then random walks descending in every outer iteration but the last and randomly in
// the last: on real sentence embeddings descending built the better graph but cost 1.35x
// random, and in the last outer iteration it bought little (benchmarks/README.md).
enum class UpdateOrder { kRandom, kAscending, kDescending, kDescendingThenRandom };

UpdateOrder parse_update_order(const std::string& name);

// The order the rounds of outer iteration t1 (0-based, of outer_iters) walk in: the mixed order
// resolved to one of the three plain ones, which are returned as they are.
inline UpdateOrder order_for_iteration(UpdateOrder order, int t1, int outer_iters) {
  if (order != UpdateOrder::kDescendingThenRandom) return order;
  return t1 + 1 < outer_iters ? UpdateOrder::kDescending : UpdateOrder::kRandom;
}

// Where a vertex's initial neighbours come from: kHubs draws most of them from the cells of its
// two nearest hubs (hubs.h), a start that is already local; kRandom draws them all uniformly,
// as seed 000 does. Data too small for hubs starts randomly either way.
enum class Start { kHubs, kRandom };

Start parse_start(const std::string& name);

// Largest pool a vertex may hold. The CUDA build copies a vertex's pool into its warp's share
// of shared memory, which bounds R; the CPU kernel shares the bound so both accept the same
// arguments.
constexpr int kMaxPoolSize = 256;

// A widened build whose first unfound share reaches this returns rows of twice its degree, one
// below it rows a third wider (BuildParams::wide_degree_for).
constexpr double kTwiceTheDegreeShare = 0.15;

// A widened build whose rows' neighbourhoods spread over fewer than this share of their dimensions
// (build_schedule.h, neighbourhood_dimensions) goes on with pools of twice its pool size, one
// above it with pools a third larger (BuildParams::wide_pool_size_for).
constexpr double kFewNeighbourhoodDimensions = 0.65;

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
  // delta: a round that changes at most delta * N * pool_size pool entries has converged: it
  // ends its outer iteration, and the build ends once an outer iteration converges in its first
  // round. T1 and T2 are then caps. 0 runs all T1 x T2 rounds.
  double delta;
  Start start;
  // widen: a build from scratch whose rows stay hard to find goes on with wide pools and returns
  // wide rows (build_schedule.h, kWidenShare).
  bool widen;

  // The most pool entries a converged round may change.
  double converged_changes(int64_t n) const { return delta * static_cast<double>(n) * pool_size; }
  // The widths a widened build goes on with: pools a third larger (64 from the defaults' 48),
  // and rows a third wider too (64) where the unfound share that decided the widening stays
  // below kTwiceTheDegreeShare, twice the degree (96) from there. Wider rows find more at a list
  // but cost a query more per expansion, and pay only where rows are hardest to find. One H200,
  // queries/s at equal recall (benchmarks/README.md, "How wide a widened row is"): at shares of
  // 0.067 and 0.116 (zipf_aniso 10M x 128, 1M x 384) rows of 64 ran at 1.01-1.16x rows of 96,
  // which ran at 0.95x the narrow graph on the first; at 0.18 and 0.22 rows of 80 ran at
  // 0.95-1.03x rows of 96; at 0.29 (zipf_aniso 4M x 1024) rows of 64 ran at 0.87-0.93x and of 80
  // at 0.91-0.95x rows of 96, and at 0.36 (10M x 1024) rows of 128 at 0.93-0.94x.
  int wide_degree_for(double unfound_share) const {
    const int wider = unfound_share < kTwiceTheDegreeShare ? degree / 3 : degree;
    return std::min(degree + wider, kMaxPoolSize);
  }
  int wide_degree() const { return wide_degree_for(1.0); }  // the widest rows a build may return
  // The pools a widened build goes on with: twice the pool size (96 from the defaults' 48) where
  // the rows' neighbourhoods spread over few of their dimensions, a third larger (64) elsewhere.
  // Larger pools find more of the rows of anisotropic clusters, and slow the search on isotropic
  // ones at the same recall. One H200, zipf_aniso's four variants at 10M x 384, pools of 96
  // against 64, queries/s at equal recall (benchmarks/README.md, "Wider pools where neighbourhoods
  // spread over few dimensions"): anisotropic noise, 1.00-1.15x on overlapping centres and
  // 1.04-1.26x on centres far apart; isotropic noise of the same energy, 0.87-0.92x at lists
  // 32-64 whether the centres overlap or not.
  int wide_pool_size_for(double neighbourhood_dimensions) const {
    const int wider = neighbourhood_dimensions < kFewNeighbourhoodDimensions ? pool_size : pool_size / 3;
    return std::min(pool_size + wider, kMaxPoolSize);
  }
  int wide_pool_size() const { return wide_pool_size_for(0.0); }  // the largest pools a build may grow
};

BuildParams make_build_params(int64_t degree, int64_t initial_degree, int64_t pool_size, int64_t outer_iters,
                              int64_t inner_iters, double reverse_ratio, const std::string& update_order,
                              const std::string& metric, int64_t seed, double delta, const std::string& start,
                              bool widen);

// Largest k the exact knn returns (its GPU selection keeps k plus a margin in shared memory).
constexpr int kMaxKnnK = 1024;

// Largest internal list the search keeps (k <= list_size <= this).
constexpr int kMaxListSize = 1024;

// A query may be answered by several independent searches (CAGRA's multi-CTA mode, made
// deterministic): each starts from its own random entry points and keeps a shorter list, and
// their results are merged. On the GPU they run as separate thread blocks, which is how a small
// batch fills the machine. At most this many per query, and searches * k <= kMaxMergeKeys (the
// GPU merges the candidates in shared memory).
constexpr int kMaxSearches = 32;
constexpr int kMaxMergeKeys = 4096;

struct SearchParams {
  int k;
  int list_size;     // internal sorted candidate list (CAGRA's itopk, HNSW's ef)
  int search_width;  // parents expanded per iteration; 0 = the backend picks (resolve_search_width)
  int max_iters;     // iteration cap; 0 = until no unexpanded parent is left
  Metric metric;
  uint64_t seed;     // for the random entry points
  int searches;      // independent searches per query; 0 = the backend picks (searches_for_batch)
  int hub_entries;   // entry points taken from the query's nearest hubs (hubs.h); the rest are random
};

SearchParams make_search_params(int64_t k, int64_t list_size, int64_t search_width, int64_t max_iters,
                                const std::string& metric, int64_t seed, int64_t searches, int64_t hub_entries);

// Parents a search expands per iteration when its search_width is 0 (automatic): on a GPU 4, or
// fewer where a round of width x degree candidates would outgrow kGpuWidestWarpRound, the widest
// round the CUDA search's warp loop takes (graphs of degree above 64); 1 on the CPU. A query's
// iterations are a chain of dependent memory round trips; wider iterations shorten the chain for
// a few more distances (about 250-400 more a query at batch 10 000). On a GPU the shorter chain
// won at every batch measured, at equal recall. On the H200 (1M x 384 real embeddings): a batch of
// 1 000 by int8 codes at list 48 ran at 1.56M q/s, recall 0.965, with width 4 against 1.27M,
// 0.961, with width 1 (a one-off sweep, results/sweep_search_settings_h200.txt); a batch of
// 10 000 by int4 codes at recall 0.95 / 0.964 / 0.977 / 0.993 at 4.22M / 3.50M / 2.34M / 641K q/s
// against 3.63M / 2.85M / 1.77M / 382K (results/gpu_text1m_minilm_width4_h200{_before,}.md). On
// the families at batch 10 000 (1M x 384 zipf and zipf_tiny, 1M x 128 zipf_aniso, 500K x 1024
// aniso; degree 48) width 4 ran at 0.8-1.4x width 1's q/s at the same list and was never more than
// 5% slower at equal recall (benchmarks/README.md, "Width 4 at every GPU batch; searches by the
// list size"). Degrees above 64 were not measured. The CPU runs one query per core at full speed
// already, so the extra distances would only cost.
//
// A search whose list (per search, list_per_search) is longer than kGpuLongList expands
// kGpuLongListWidth parents, within kGpuWidestLongRound candidates a round: past the warp loop,
// so the block loop takes it, with at least 128 threads a block (pick_threads in search_cuda.cu).
// The chain of a long list is long, and the block loop spreads a wide round over all its threads.
// On the H200 (1M x 384 real embeddings, batch 10 000, degree 48, median of 3 timings of 3
// searches, spread under 2%; benchmarks/README.md, "Wider rounds for long lists"): int4 codes at
// lists 192 / 256 / 320 / 384 ran at 1.06M / 901K / 688K / 579K q/s with 6 parents against 895K /
// 693K / 604K / 538K with 4, at the same or higher recall; the rows at 515K / 435K / 340K / 283K
// against 528K / 401K / 304K / 276K. At list 128 and below the warp loop with 4 parents was as
// fast or faster.
constexpr int64_t kGpuWidestWarpRound = 256;
constexpr int64_t kGpuLongList = 128;
constexpr int64_t kGpuLongListWidth = 6;
constexpr int64_t kGpuWidestLongRound = 512;
inline int resolve_search_width(int search_width, bool on_gpu, int64_t degree, int64_t list_size) {
  if (search_width > 0) return search_width;
  if (!on_gpu) return 1;
  const bool long_list = list_size > kGpuLongList;
  const int64_t fits = (long_list ? kGpuWidestLongRound : kGpuWidestWarpRound) / (degree > 0 ? degree : 1);
  const int64_t wanted = long_list ? kGpuLongListWidth : 4;
  return static_cast<int>(fits < 1 ? 1 : fits > wanted ? wanted : fits);
}

// Entry points of a search with a list of `list` entries that come from hubs: hub_entries, or
// for -1 (automatic) half the list.
inline int hub_entries_for_list(int hub_entries, int list) { return hub_entries < 0 ? list / 2 : std::min(hub_entries, list); }

// List each of `searches` searches keeps for a query whose budget is `list_size`: about
// 2 * list_size / sqrt(searches), but at least half of list_size (a short list stops before it
// finds the last few neighbours, which no number of searches makes up for) and at least k.
// Trade-off: `searches` times the work for a shorter chain of dependent iterations. Recall is
// close to one search's, not equal: above on real sentence embeddings at moderate recall, up to
// about 0.01 below where one search already exceeds 0.98 (tests/test_build_search.py bounds both).
int list_per_search(int list_size, int k, int searches);

// Largest number of searches per query the merge allows for this k.
inline int max_searches_for_k(int k) {
  const int by_merge = kMaxMergeKeys / k;
  return by_merge < kMaxSearches ? (by_merge < 1 ? 1 : by_merge) : kMaxSearches;
}

}  // namespace grnnd
