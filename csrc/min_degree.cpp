// The minimum out-degree fill (min_degree.h).
#include "min_degree.h"

#include <algorithm>
#include <limits>

#include "reachability.h"

namespace grnnd {
namespace {

// Scratch of one chunk of rows (their candidates' rows gathered, counted as float32): as much
// as the graph takes twice over, within these bounds; the build's pools, freed before the fill,
// took several times that, so the fill does not raise the build's peak.
constexpr int64_t kMinChunkBytes = int64_t{1} << 26;
constexpr int64_t kMaxChunkBytes = int64_t{1} << 31;
// A row whose neighbours' rows are short too finds few candidates in one pass; the next pass
// sees the rows the first one grew. On clustered data the second pass left almost no short row.
constexpr int kMaxPasses = 3;

// Sorts each row of `keys` ascending (stably) and applies the same order to `values`.
void sort_rows_by(at::Tensor& keys, std::initializer_list<at::Tensor*> values) {
  auto sorted = at::sort(keys, /*stable=*/true, /*dim=*/1, /*descending=*/false);
  keys = std::get<0>(sorted);
  for (at::Tensor* v : values) *v = v->gather(1, std::get<1>(sorted));
}

// One pass: each short row takes the nearest of its two-hop neighbours. Returns the edges added.
int64_t fill_pass(at::Tensor& graph, const at::Tensor& x, const at::Tensor& lift, int64_t target) {
  const at::Tensor before = graph.ge(0).sum(1);
  const at::Tensor short_rows = before.lt(target).nonzero().flatten();
  const int64_t total = short_rows.numel();
  if (total == 0) return 0;
  // Candidates of a short row: its own entries (at most target - 1, in its first target
  // columns) and the first target entries of each of their rows.
  const int64_t candidates = target + target * target;
  const int64_t chunk_bytes = std::clamp<int64_t>(graph.numel() * 8, kMinChunkBytes, kMaxChunkBytes);
  const int64_t rows_per_chunk =
      std::max<int64_t>(1, chunk_bytes / (candidates * std::max<int64_t>(1, x.size(1)) * 4));
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t start = 0; start < total; start += rows_per_chunk) {
    const at::Tensor v = short_rows.slice(0, start, std::min(total, start + rows_per_chunk));
    const int64_t m = v.numel();
    const at::Tensor own = graph.index_select(0, v).slice(1, 0, target).to(at::kLong);
    at::Tensor hops = graph.index_select(0, own.clamp_min(0).flatten()).slice(1, 0, target).to(at::kLong);
    hops = hops.view({m, target * target}).masked_fill_(own.lt(0).repeat_interleave(target, 1), -1);
    at::Tensor ids = at::cat({own, hops}, 1);
    const at::Tensor invalid = ids.lt(0).logical_or_(ids.eq(v.unsqueeze(1)));
    at::Tensor dist = pair_distances(x, lift, v, ids.clamp_min(0)).masked_fill_(invalid, inf);
    // Own entries rank first whatever their distance; every other candidate by distance.
    at::Tensor rank = dist.clone();
    rank.slice(1, 0, target).masked_fill_(own.ge(0), -1.0f);
    // One copy of each id, its best rank: sort by rank, then stably by id, and drop repeats.
    sort_rows_by(rank, {&ids, &dist});
    sort_rows_by(ids, {&rank, &dist});
    rank.slice(1, 1).masked_fill_(ids.slice(1, 1).eq(ids.slice(1, 0, -1)), inf);
    auto chosen = at::topk(rank, target, /*dim=*/1, /*largest=*/false, /*sorted=*/true);
    at::Tensor chosen_ids = ids.gather(1, std::get<1>(chosen));
    at::Tensor chosen_dist = dist.gather(1, std::get<1>(chosen)).masked_fill_(std::get<0>(chosen).isinf(), inf);
    sort_rows_by(chosen_dist, {&chosen_ids});
    chosen_ids.masked_fill_(chosen_dist.isinf(), -1);
    graph.slice(1, 0, target).index_copy_(0, v, chosen_ids.to(graph.scalar_type()));
  }
  return graph.ge(0).sum().item<int64_t>() - before.sum().item<int64_t>();
}

}  // namespace

int64_t fill_short_rows(at::Tensor& graph, const at::Tensor& x, const at::Tensor& lift) {
  const int64_t n = graph.size(0), degree = graph.size(1);
  const int64_t target = std::min({kMinOutDegree, degree, n - 1});
  if (target <= 0) return 0;
  int64_t added = 0;
  for (int pass = 0; pass < kMaxPasses; ++pass) {
    const int64_t now = fill_pass(graph, x, lift, target);
    if (now == 0) break;
    added += now;
  }
  return added;
}

}  // namespace grnnd
