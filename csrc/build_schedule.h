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
// iteration, whose first round follows no reverse edges, never ends it this way. T1 and T2 are caps.
// With a start from hubs the change curves of 1M and 4M rows were the same, round for round, and
// recall@10 at list 64 after 18 rounds (the last changing 0.0096 N R) was within 0.001 of 60
// rounds; from a random start 4M rows still changed 0.046 N R after 18 rounds and recalled 0.79
// (benchmarks/README.md, scale).
#pragma once

#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>

#include "params.h"
#include "philox.h"
#include "progress.h"

namespace grnnd {

// A build may start from entries it is given (the op's `init`), as seed 003's merge (GGM) starts
// from two built graphs: each vertex's pool first takes, as old ones, the init entries that the
// rule keeps among themselves (walked nearest first, an entry goes when a kept one is closer to
// it than the vertex is: a built row's fill entries, csrc/fill.h, mostly go). Pairs of two old
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

// init_split checked: the row where a merge's second graph starts; 0 when the build is not a
// merge of two non-empty graphs (init_split 0 or n).
inline int64_t start_split(int64_t init_split, int64_t n) {
  TORCH_CHECK_VALUE(init_split >= 0 && init_split <= n, "init_split: expected a row in [0, ", n, "], got ",
                    init_split);
  return init_split < n ? init_split : 0;
}

// Whether a vertex's update compares its pool entries a and b (a_new, b_new: their "new"
// flags). A pair of two old entries was compared before and passed (RNN-Descent's new/old
// flags). In a merge (split, start_split: rows [0, split) and [split, n) come from two built
// graphs) only pairs across the two graphs are compared, as seed 003's GGM compares them: what a
// merge must find is how the rows of one graph sit among those of the other, and a pair of two
// rows of one graph was pruned by that graph's own build. Comparing the other graph's rows with
// each other as well (a pair of two rows of the vertex's own graph was always skipped) refined both
// graphs a little, but its hand-overs within one graph kept a merge busy to its cap of eight
// rounds: with pairs across only, merges of clustered halves ended after six or seven rounds,
// and merges took 40% to 50% of a fresh build's time instead of 54% to 59%, at recall@10 (list
// 64) within 0.0025 of the fresh build where the wider rule had been up to 0.002 above it (one
// H100 and one H200: clustered 10M x 128 and 1M x 384, Zipf-sized clusters and anisotropic rows
// 2M; benchmarks/README.md, "A merge compares pairs across the two graphs only").
GRNND_HOST_DEVICE bool compares_pair(int64_t a, bool a_new, int64_t b, bool b_new, int64_t split) {
  if (!a_new && !b_new) return false;
  if (split == 0) return true;
  return (a < split) != (b < split);
}

constexpr double kOuterDelta = 10.0;

// update(order, round, count) runs update round `round` (1-based, the random streams' counter)
// in `order` and returns the pool entries it changed when `count` is true (on the GPU counting
// costs a host synchronisation); reverse() samples reverse edges. Reports (rounds done, T1 x T2,
// changes) after each round, and (done, done, changes) at the end of a build that converged
// before the cap. Returns the rounds run.
template <typename Update, typename Reverse>
int64_t run_schedule(const BuildParams& p, int64_t n, Update&& update, Reverse&& reverse) {
  const bool converge = p.delta > 0;
  const bool report = progress_requested();
  const int64_t cap = static_cast<int64_t>(p.outer_iters) * p.inner_iters;
  int64_t done = 0, changes = 0;
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
      if (t2 == 0 && t1 > 0) {
        settled = converge && static_cast<double>(changes) <= kOuterDelta * p.converged_changes(n);
      }
      if (report) report_progress(done, cap, changes);
    }
    // Unlike Algorithm 3 (line 12), the last outer iteration samples reverse edges too: the
    // returned rows then also hold incoming RNG edges, which makes the sparse pruned graph
    // easier to navigate at no distance cost (recall@10 at list 64 on 5000 x 32 clusters:
    // 0.947 -> 0.962).
    if (p.reverse_ratio > 0) reverse();
    if (settled) {
      if (report && done < cap) report_progress(done, done, changes);
      return done;
    }
  }
  return done;
}

}  // namespace grnnd
