// The build's schedule of rounds, shared by the CPU and CUDA builds: when to sample reverse
// edges, when the build has converged, and the progress reports.
//
// Seed 000 runs a fixed T1 x T2 rounds. How many rounds a graph needs grows with N and with the
// number of separate neighbourhoods in the data (the clustered sets in benchmarks/ lost recall
// from 0.95 at 1M to 0.77 at 4M rows under 3 x 6 rounds), so the build decides from its own work,
// as NN-Descent does: a round that changes at most delta * N * pool_size pool entries ends its
// outer iteration early. The first round after the reverse edges never gets that low: some of
// the reverse edges are pruned again every time and move entries back and forth (on 1M and 4M
// clustered rows, H100, the first round settled near 0.02 N R outer iteration after outer
// iteration while the last fell to 0.0015 N R). So the build ends after an outer iteration whose
// first round changed at most kOuterDelta * delta * N * pool_size entries; the first outer
// iteration, whose first round follows no reverse edges, never ends it this way, and neither does
// the second of a build from scratch (first_tested_outer_iteration), nor one that made more of
// its rows findable by a search than delta / 2 of them (unfound_share, below). T1 and T2 are caps.
// With a start from hubs the change curves of 1M and 4M rows were the same, round for round, and
// recall@10 at list 64 after 18 rounds (the last changing 0.0096 N R) was within 0.001 of 60
// rounds; from a random start 4M rows still changed 0.046 N R after 18 rounds and recalled 0.79
// (benchmarks/README.md, scale).
#pragma once

#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>

#include "../core/params.h"
#include "../core/philox.h"
#include "../core/progress.h"

namespace grnnd {

// A build may start from entries it is given (the op's `init`), as seed 003's merge (GGM) starts
// from two built graphs: each vertex's pool first takes, as old ones, the init entries that the
// rule keeps among themselves (walked nearest first, an entry goes when a kept one is closer to
// it than the vertex is: a built row's fill entries, csrc/build/fill.h, mostly go). Pairs of two old
// entries are never compared, so the rounds spend their distances on what is new, its S draws.
// Entries outside [0, N), the vertex itself and repeats are dropped.
// Only the first pool_size - S columns are used, so the draws always find room. Returns int32
// [N, columns] contiguous, or an undefined tensor when there is nothing to start from.
inline at::Tensor start_entries(const c10::optional<at::Tensor>& init, const at::Tensor& data, const BuildParams& p) {
  if (!init.has_value() || !init->defined()) return at::Tensor();
  const at::Tensor& t = *init;
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, "init: expected int32 (a graph as build returns it), got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == data.size(0), "init: expected shape [", data.size(0),
                    ", c] (a row per row of data), got ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == data.device(), "init: expected it on ", data.device(), " like data, got ",
                    t.device());
  const int64_t columns = std::min<int64_t>(t.size(1), p.pool_size - p.initial_degree);
  if (columns <= 0) return at::Tensor();
  return t.slice(1, 0, columns).contiguous();
}

// How a build's rows divide (init_split, init_mode): rows [0, row) come from a built graph, and
// rows [row, n) are a second built graph (a merge, seed 003's GGM: torch_grnnd/merging.py) or,
// when `grows`, new rows without a graph (Index.add of a large batch). row 0: neither.
struct Split {
  int64_t row = 0;
  bool grows = false;
  int graph_draws = 0;  // growing: the draws of each row of the graph, all among the new rows

  // A row of a growing build that has no graph: its init row is not read.
  GRNND_HOST_DEVICE bool new_row(int64_t v) const { return grows && v >= row; }
  // How many rows v draws at the start (S = initial_degree): a row of the graph that grows
  // draws the new rows' share of S, as its neighbours in the union are new in that share. With
  // half the rows new (one H200, recall@10 at list 64, fresh build 0.7253 on anisotropic 2M x 96
  // rows, 0.9897 on clustered 1M x 384), 0, 4 and 8 draws (S = 16) gave 0.6845, 0.7155 and 0.7306
  // on the anisotropic rows and 0.9880, 0.9898 and 0.9902 on the clustered ones.
  GRNND_HOST_DEVICE int draws(int64_t v, int initial_degree) const {
    return grows && v < row ? graph_draws : initial_degree;
  }
  // Where v draws from, as initial_neighbour's `split`: the other part's rows, but a new row
  // draws from all rows (its neighbours are new rows as much as the graph's).
  GRNND_HOST_DEVICE int64_t draws_from(int64_t v) const { return new_row(v) ? 0 : row; }
};

// init_split and init_mode checked. A split at 0 or n leaves nothing to merge or add: no split.
inline Split start_split(int64_t init_split, c10::string_view init_mode, int64_t n, const BuildParams& p) {
  TORCH_CHECK_VALUE(init_split >= 0 && init_split <= n, "init_split: expected a row in [0, ", n, "], got ",
                    init_split);
  TORCH_CHECK_VALUE(init_mode == "merge" || init_mode == "grow", "init_mode: expected \"merge\" or \"grow\", got \"",
                    init_mode, "\"");
  if (init_split == 0 || init_split == n) return Split{};
  Split split{init_split, init_mode == "grow", 0};
  if (split.grows) {
    const double share = static_cast<double>(n - init_split) / static_cast<double>(n);
    split.graph_draws = std::max(1, static_cast<int>(std::lround(p.initial_degree * share)));
  }
  return split;
}

// Whether a vertex's update compares its pool entries a and b (a_new, b_new: their "new"
// flags). A pair of two old entries was compared before and passed (RNN-Descent's new/old
// flags). In a merge only pairs across the two graphs are compared, as seed 003's GGM compares
// them: what a merge must find is how the rows of one graph sit among those of the other, and a
// pair of two rows of one graph was pruned by that graph's own build (comparing those too kept
// merges busy to their cap of rounds for no recall: benchmarks/README.md, "A merge compares pairs
// across the two graphs only"). A growing graph compares every pair with a new row in it, for
// the same reason.
GRNND_HOST_DEVICE bool compares_pair(int64_t a, bool a_new, int64_t b, bool b_new, const Split& split) {
  if (!a_new && !b_new) return false;
  if (split.row == 0) return true;
  if (split.grows) return a >= split.row || b >= split.row;
  return (a < split.row) != (b < split.row);
}

// The rows whose changes the convergence test counts (run_schedule's n): a growing graph's own
// rows settled in its build, and counting them too would halve the measure of a half added and
// end the rounds an outer iteration early (anisotropic 2M x 96 rows, half added, the graph's rows
// drawing nothing, one H200: recall@10 at list 64 0.6100 after 15 rounds counting all rows,
// 0.6845 after 21 counting the new ones; a fresh build 0.7253 after 20).
inline int64_t counted_rows(const Split& split, int64_t n) { return split.grows ? n - split.row : n; }

constexpr double kOuterDelta = 10.0;

// The counts of changed pool entries say when the pools have settled, but not whether the
// graph they make still gains reach: the rounds improve every part of the pools at about the
// same pace (per row, the rows of clusters of under 10 rows changed no more entries in any round
// than those of clusters of 1 000 and more: zipf_tiny 100k x 128, CPU), yet on data of many tiny
// clusters inside big ones a row that a search cannot find becomes findable in later outer
// iterations when elsewhere nothing more is found (benchmarks/README.md, "Where builds stop").
// So a build from scratch also measures that reach between outer iterations: the share of a
// fixed sample of rows that a search of the pools' graph for each row misses (unfound_share),
// and an outer iteration that made more than kFoundShareOfDelta * delta of the sample findable
// does not end the build. kUnfoundSample rows (all of them below it), searched with a list of
// kUnfoundList for their kUnfoundK nearest, as grnnd.diagnostics.unfound_share measures a built
// graph (there 10 000 random rows by default). A search of 4 096 rows costs the CPU about a sixth
// of an outer iteration (100k x 128 float16 rows, 2 threads); on the GPU (one H200, 1M x 384) the
// two searches of a build that ends after its third outer iteration cost 1-2% of the build.
constexpr int64_t kUnfoundSample = 4096;
constexpr int64_t kUnfoundList = 16;
constexpr int64_t kUnfoundK = 4;
constexpr double kFoundShareOfDelta = 0.5;

// The share of the sample rows (hubs.h, strata_rows: a function of N) that a search of `graph`
// (the pools' rows so far, -1 padded) for each of them, with the build's `metric`, does not
// return among its kUnfoundK results. One search of at most kUnfoundSample queries; on the GPU
// one host synchronisation.
double unfound_share(const at::Tensor& data, const at::Tensor& graph, c10::string_view metric);

// The first outer iteration (0-based) whose first round may end a build. The first round after
// the first reverse edges changes about as many entries as the line on every family, so a build
// from scratch that stopped there stopped by chance; its test starts an outer iteration later
// (benchmarks/README.md, "Where builds stop"). A build from a graph (`init`: a merge, a growing
// graph) starts from settled rows and keeps the test from its second outer iteration.
inline int first_tested_outer_iteration(bool from_graph) { return from_graph ? 1 : 2; }

// Where the rows stay hard to find, a wider graph finds more at a list: on the families of large
// low-contrast clusters degree 96 over pools of 64 found at list 64 what the defaults' 48 and 48
// found at list 128 (zipf_aniso 10M x 1024, one H200: recall@10 0.696 -> 0.777 in queries, 0.958
// -> 0.975 rare) at 0.88-1.30x their queries/s at equal recall, while on blobs and real sentence
// embeddings, whose recall saturates, it only cost (0.57x at equal recall on the embeddings). No
// sample of the rows tells the two apart (a sample's density is not the data's), but the unfound
// share a build measures after its second outer iteration does: at most 0.0134 on every set that
// should keep its width (blobs 10M x 384; 0.0056 on 1M real embeddings), at least 0.18 on every
// hard one from 1M rows, 0.077 on zipf 200k x 128 where the wider graph gained 0.04 at list 64
// (benchmarks/README.md, "A wider graph on the hard families"). So a build whose first measured
// share passes kWidenShare, near the middle of the two on a log scale, goes on with the wide
// widths (BuildParams::wide_degree_for that share, wide_pool_size): its pools grow in place,
// keeping what they hold, and its rows widen the more, the more rows that share left unfound.
// The share its wider pools measure next cannot end the build, only start the comparisons
// again: measured against the narrow pools' share it counted the widening as reach gained, and
// measured alone it ended the build an outer iteration after the widening, short of a build wide
// from the start (CPU, one Gaussian of 60 000 x 64 rows, recall@10 at list 32: 0.698 against
// 0.722; going on, 0.716). Measured on the families (benchmarks/README.md, "Widening the hard
// builds").
constexpr double kWidenShare = 0.05;

// How much a widening build's pools grow depends on the shape of the rows' neighbourhoods, not on
// their share left unfound: pools of twice the size found more of zipf_aniso's rows, whose noise
// has a scale of its own in each dimension, and only slowed the search on the same clusters with
// isotropic noise, at the same first share (BuildParams::wide_pool_size_for). So a build that
// widens measures how many directions its rows' neighbourhoods spread over: for each of
// kDimensionSample rows of the strata (hubs.h, strata_rows), its kDimensionK exact nearest rows
// (the knn op) paired off into kDimensionK / 2 differences; two independent differences of
// covariance C meet at a squared cosine of tr(C^2) / tr(C)^2 on average, the inverse of C's
// participation ratio, the number of directions it spreads over evenly. The share of D it
// returns is one over D times the mean squared cosine of the differences of a row with each
// other, over all sample rows: 1.00 on isotropic Gaussians of 32 to 1 024 dimensions and
// 0.41 on Gaussians of log-uniform scales over 1.25 decades, rotated or not (CPU, 32 000 rows;
// the local dimension of Levina and Bickel's estimate, over D, fell with D on both: 0.77 to
// 0.18 and 0.53 to 0.11). On the benchmark families (one H200, 1M rows and more): 0.98-1.00 on
// zipf at 128, 384 and 1 024 dimensions, zipf_iso and blobs, 0.36-0.43 on zipf_aniso,
// zipf_aniso_apart, zipf_tiny and aniso. Measured once, when a build widens.
constexpr int64_t kDimensionSample = 512;
constexpr int64_t kDimensionK = 20;
// The exact search runs over this many slices of the rows, each one search (its products are
// kDimensionSample x the slice's rows, float32: 4% of the pools of 48 entries a row).
constexpr int64_t kDimensionSlices = 64;

// The share of D that data's rows' neighbourhoods spread over, as above, under the build's metric
// (l2, or cosine on the unit rows); 1 where there are too few rows to take kDimensionK neighbours
// from. One host synchronisation.
double neighbourhood_dimensions(const at::Tensor& data, c10::string_view metric);

// Whether a build may widen: one from scratch that measures the unfound share (run_schedule) and
// has wider widths to go to, under l2 or cosine. Under inner product a row need not be its own
// best match, so the share does not tell rows hard to find (20 000 x 32 Gaussian rows, CPU: a
// first share of 0.067 under inner product, 0.0068 under l2). The fake kernel
// (torch_grnnd/ops.py) gives such a build's graph a width that depends on the data
// (BuildParams.may_widen, the same condition).
inline bool may_widen(const BuildParams& p, bool from_graph) {
  return p.widen && p.metric != Metric::kIP && p.delta > 0 && !from_graph &&
         p.outer_iters > first_tested_outer_iteration(from_graph) &&
         (p.wide_degree() > p.degree || p.wide_pool_size() > p.pool_size);
}

// from_graph: the build starts from entries it is given (start_entries). update(order, round,
// count) runs update round `round` (1-based, the random streams' counter) in `order` and returns
// the pool entries it changed when `count` is true (on the GPU counting costs a host
// synchronisation); reverse() samples reverse edges; unfound() measures the current pools'
// unfound_share (after reverse(), from the outer iteration before the first tested one on, in
// builds from scratch that converge and have an outer iteration left). Reports (rounds done,
// T1 x T2, changes, the last unfound share or -1) after each round, and (done, done, changes,
// unfound) at the end of a build that converged before the cap. dimensions() measures the rows'
// neighbourhood_dimensions, once, where the build widens. widen(wide_pool_size) grows the pools
// to that many entries a row and returns false, changing nothing, where there is no memory for
// them (pools of twice the size then try a third larger); the schedule then sets p's degree and
// pool size to the wide ones (a build passes its own p, and returns rows of p.degree). Returns the
// rounds run.
template <typename Update, typename Reverse, typename Unfound, typename Dimensions, typename Widen>
int64_t run_schedule(BuildParams& p, int64_t n, bool from_graph, Update&& update, Reverse&& reverse,
                     Unfound&& unfound, Dimensions&& dimensions, Widen&& widen) {
  const bool converge = p.delta > 0;
  const bool report = progress_requested();
  const int64_t cap = static_cast<int64_t>(p.outer_iters) * p.inner_iters;
  const int first_tested = first_tested_outer_iteration(from_graph);
  // A build from a graph starts from rows a search already finds; its new rows are few or
  // settle with the rest (merges, growing adds), and the change counts alone decide its end.
  const bool probes = converge && !from_graph;
  bool may_grow = may_widen(p, from_graph);
  int64_t done = 0, changes = 0;
  double unfound_rows = -1;  // the last measured unfound share; -1 before the first
  double baseline = -1;      // the share the next one is compared with; -1 after a widening too
  bool widened = false;      // the pools grew after the last measure
  uint32_t round = 0;
  for (int t1 = 0; t1 < p.outer_iters; ++t1) {
    const UpdateOrder order = order_for_iteration(p.update_order, t1, p.outer_iters);
    bool converged = false, settled = false;
    for (int t2 = 0; t2 < p.inner_iters && !converged; ++t2) {
      changes = update(order, ++round, converge || report);
      ++done;
      converged = converge && static_cast<double>(changes) <= p.converged_changes(n);
      // Only a first round after reverse edges tells: the very first round of a build changes
      // about 0.27 N R from a hub start, which a delta of 0.03 already counted as settled
      // (a build of 9 rounds, recall@10 0.87 against 0.96 at list 64 on real embeddings, H100).
      if (t2 == 0 && t1 >= first_tested) {
        settled = converge && static_cast<double>(changes) <= kOuterDelta * p.converged_changes(n);
      }
      if (report) report_progress(done, cap, changes, unfound_rows);
    }
    // Unlike Algorithm 3 (line 12), the last outer iteration samples reverse edges too: the
    // returned rows then also hold incoming RNG edges, which makes the sparse pruned graph
    // easier to navigate at no distance cost (recall@10 at list 64 on 5000 x 32 clusters:
    // 0.947 -> 0.962).
    if (p.reverse_ratio > 0) reverse();
    if (probes && t1 + 1 >= first_tested && t1 + 1 < p.outer_iters) {
      unfound_rows = unfound();
      // Without a share to compare with (the first after a widening) the build goes on.
      if (baseline < 0 ? widened : baseline - unfound_rows > kFoundShareOfDelta * p.delta) settled = false;
      baseline = unfound_rows;
      widened = false;
      if (may_grow && unfound_rows > kWidenShare) {
        int pool_size = p.wide_pool_size_for(dimensions());
        const int third_larger = p.wide_pool_size_for(1.0);
        bool grew = widen(pool_size);
        if (!grew && pool_size > third_larger) grew = widen(pool_size = third_larger);
        if (grew) {
          p.degree = p.wide_degree_for(unfound_rows);
          p.pool_size = pool_size;
          baseline = -1;
          widened = true;
          settled = false;
        }
      }
      may_grow = false;  // only the first measure decides
    }
    if (settled) {
      if (report && done < cap) report_progress(done, done, changes, unfound_rows);
      return done;
    }
  }
  return done;
}

}  // namespace grnnd
