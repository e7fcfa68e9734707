// Reachability of the built graph and its repair (reachability.h).
#include "reachability.h"

#include <algorithm>
#include <limits>

#include <ATen/core/dispatch/Dispatcher.h>

#include "../core/checks.h"
#include "hubs.h"
#include "prune.h"
#include "../core/search_op.h"

namespace grnnd {
namespace {

// Repair passes before giving up; each reconnects at least one lost vertex per parent, and on
// the data of benchmarks/bench_scale.py one or two passes left nothing unreached.
constexpr int kMaxPasses = 64;
// Edges gathered at once (a breadth-first level's out-edges, in-degree counts), per row of the
// graph: with their int64 copies about 70 bytes a row, a tenth of the build's pools, whatever
// the degree. A whole level at degree 64 raised the build's peak memory above its pools'.
constexpr int64_t kEdgesPerRowAtOnce = 4;

// Rows of `graph` whose edges are gathered at once.
int64_t rows_at_once(const at::Tensor& graph) {
  return std::max<int64_t>(1024, kEdgesPerRowAtOnce * graph.size(0) / std::max<int64_t>(1, graph.size(1)));
}
// Parents whose rows are rebuilt at once (their neighbours' rows are gathered in float32).
constexpr int64_t kRowsPerChunk = 4096;

// Adds the edge parent[i] -> child[i] to each parent's row (parents distinct), rows re-sorted by
// distance. A row with a free place takes the child there. A full row gives up its farthest
// entry that another reached vertex also links to (reached_in_degree >= 2), so the repair takes
// no vertex's only way in; only a row of nothing but such sole links drops its farthest entry.
// Dropping the farthest entry whatever it was could cycle: parent p takes lost a and drops b,
// b's nearest reached vertex is p again, which takes b back and drops a, and so on until the
// passes ran out (one vertex of 4M clustered rows was left unreachable so, H100).
void add_edges(at::Tensor& graph, const at::Tensor& x, const at::Tensor& lift, const at::Tensor& parent,
               const at::Tensor& child, const at::Tensor& reached_in_degree) {
  const int64_t degree = graph.size(1);
  const at::Tensor position = at::arange(1, degree + 1, parent.options());
  for (int64_t start = 0; start < parent.numel(); start += kRowsPerChunk) {
    const int64_t end = std::min(parent.numel(), start + kRowsPerChunk);
    const at::Tensor p = parent.slice(0, start, end);
    const at::Tensor rows = graph.index_select(0, p).to(at::kLong);
    const at::Tensor padding = rows.lt(0);
    // The place the child takes: the last that is free or shared (rows are padded at the end and
    // ascending by distance, so that is a free place or else the farthest shared entry), else
    // the last place.
    const at::Tensor shared = reached_in_degree.index_select(0, rows.clamp_min(0).flatten()).view_as(rows).ge(2);
    const at::Tensor replaceable = padding.logical_or(shared);
    at::Tensor place = (replaceable.to(at::kLong) * position).argmax(1, /*keepdim=*/true);
    place.masked_fill_(replaceable.any(1, /*keepdim=*/true).logical_not(), degree - 1);
    const at::Tensor candidates = rows.scatter(1, place, child.slice(0, start, end).unsqueeze(1));
    const at::Tensor dist = pair_distances(x, lift, p, candidates.clamp_min(0))
                                .masked_fill_(candidates.lt(0), std::numeric_limits<float>::infinity());
    const at::Tensor order = std::get<1>(at::sort(dist, /*stable=*/true, /*dim=*/1, /*descending=*/false));
    graph.index_copy_(0, p, candidates.gather(1, order).to(graph.scalar_type()));
  }
}

// Per vertex, the edges that lead to it from reached vertices: a row may give up an entry with
// two or more without making its target unreachable. Counted a chunk of rows at a time.
at::Tensor reached_in_degree(const at::Tensor& graph, const at::Tensor& seen) {
  const int64_t n = graph.size(0);
  at::Tensor count = at::zeros({n}, graph.options().dtype(at::kLong));
  const int64_t chunk = rows_at_once(graph);
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t end = std::min(n, start + chunk);
    const at::Tensor rows = graph.slice(0, start, end);
    const at::Tensor ids = rows.masked_select(rows.ge(0).logical_and(seen.slice(0, start, end).unsqueeze(1)));
    count.index_add_(0, ids.to(at::kLong), at::ones_like(ids, count.options()));
  }
  return count;
}

}  // namespace

at::Tensor pair_distances(const at::Tensor& x, const at::Tensor& lift, const at::Tensor& from, const at::Tensor& to) {
  // |b - a|^2 = |a|^2 + |b|^2 - 2 <a, b>: one batched product over the gathered rows, kept in
  // their storage type on the GPU (tensor cores, float32 results), and norms reduced in float32
  // straight from it. Forming b - a in float32 instead moved about five times the bytes: the
  // minimum out-degree fill of 4M x 384 float16 rows spent most of its 0.5 s on it (H100).
  const bool half = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  const bool native = half && x.is_cuda();
  at::Tensor a = x.index_select(0, from);
  at::Tensor b = x.index_select(0, to.flatten()).view({to.size(0), to.size(1), -1});
  if (!native) {
    a = a.to(at::kFloat);
    b = b.to(at::kFloat);
  }
  const at::Tensor dot = native ? at::bmm(b, a.unsqueeze(2), at::kFloat) : at::bmm(b, a.unsqueeze(2));
  const at::Tensor a_norm = at::linalg_vector_norm(a, 2, {1}, false, at::kFloat).square_();
  const at::Tensor b_norm = at::linalg_vector_norm(b, 2, {2}, false, at::kFloat).square_();
  at::Tensor d = (b_norm + a_norm.unsqueeze(1)).sub_(dot.squeeze(2), 2).clamp_min_(0);
  if (lift.defined()) {
    d += (lift.index_select(0, to.flatten()).view_as(to) - lift.index_select(0, from).unsqueeze(1)).pow_(2);
  }
  return d;
}

at::Tensor reached_from(const at::Tensor& graph, const at::Tensor& sources) {
  const int64_t n = graph.size(0);
  at::Tensor seen = at::zeros({n}, graph.options().dtype(at::kBool));
  at::Tensor frontier = sources.to(at::kLong);
  seen.index_fill_(0, frontier, true);
  // One level per step; reading a level's size is a host synchronisation. A level may hold most
  // of the graph: its rows are gathered a chunk at a time.
  const int64_t chunk = rows_at_once(graph);
  while (frontier.numel() > 0) {
    at::Tensor fresh = at::zeros({n}, seen.options());
    for (int64_t start = 0; start < frontier.numel(); start += chunk) {
      const int64_t end = std::min(frontier.numel(), start + chunk);
      const at::Tensor next = graph.index_select(0, frontier.slice(0, start, end)).flatten();
      fresh.index_fill_(0, next.masked_select(next.ge(0)).to(at::kLong), true);
    }
    fresh.logical_and_(seen.logical_not());
    seen.logical_or_(fresh);
    frontier = fresh.nonzero().flatten();
  }
  return seen;
}

at::Tensor reachability_sources(int64_t n, const at::TensorOptions& options) {
  const at::Tensor hubs = hub_ids(n, options.dtype(at::kLong));
  return hubs.numel() > 0 ? hubs : at::zeros({std::min<int64_t>(n, 1)}, options.dtype(at::kLong));
}

int64_t connect_unreachable(at::Tensor& graph, const at::Tensor& data, c10::string_view metric, const at::Tensor& x,
                            const at::Tensor& lift) {
  const int64_t n = graph.size(0);
  if (n == 0 || graph.size(1) == 0) return 0;
  const at::TensorOptions ids = graph.options().dtype(at::kLong);
  const at::Tensor sources = reachability_sources(n, ids);
  const at::Tensor hubs = hub_ids(n, ids);
  int64_t added = 0;
  for (int pass = 0; pass < kMaxPasses; ++pass) {
    const at::Tensor seen = reached_from(graph, sources);
    const at::Tensor lost = seen.logical_not().nonzero().flatten();
    if (lost.numel() == 0) break;
    // Parent of a lost vertex: the nearest reached vertex a search finds for it (the filter
    // keeps lost vertices out of the results; list and seed are the search's defaults)...
    const at::Tensor found =
        std::get<1>(search_op().call(data, graph, data.index_select(0, lost), 1, std::min<int64_t>(64, n), 1, 0,
                                     metric, 0, seen, 0, -1, /*codes=*/c10::nullopt, /*code_grid=*/c10::nullopt))
            .squeeze(1);
    // ... else its nearest hub (vertex 0 without hubs).
    at::Tensor fallback = at::zeros_like(found);
    if (hubs.numel() > 0) {
      const at::Tensor hub = nearest_hubs(x.index_select(0, lost), x.index_select(0, hubs), 1, Metric::kL2,
                                          lift.defined() ? lift.index_select(0, lost) : at::Tensor(),
                                          lift.defined() ? lift.index_select(0, hubs) : at::Tensor());
      fallback = hubs.index_select(0, hub.flatten());
    }
    const at::Tensor parent = at::where(found.ge(0), found, fallback);
    // One new edge per parent and pass: to its lost vertex of lowest id.
    const auto sorted = at::sort(parent, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const at::Tensor& by_parent = std::get<0>(sorted);
    at::Tensor first = at::ones_like(by_parent, by_parent.options().dtype(at::kBool));
    if (by_parent.numel() > 1) first.slice(0, 1).copy_(by_parent.slice(0, 1).ne(by_parent.slice(0, 0, -1)));
    const at::Tensor parents = by_parent.masked_select(first);
    add_edges(graph, x, lift, parents, lost.index_select(0, std::get<1>(sorted)).masked_select(first),
              reached_in_degree(graph, seen));
    added += parents.numel();
  }
  return added;
}

at::Tensor connected_copy(const at::Tensor& data, const at::Tensor& graph, c10::string_view metric,
                          const at::Tensor& x) {
  check_search_inputs(data, graph, data, 1, c10::nullopt);
  check_search_contents(data, graph, data);
  at::Tensor out = graph.clone(at::MemoryFormat::Contiguous);
  connect_unreachable(out, data, metric, x, inner_product_lift(x, parse_metric(std::string(metric))));
  return out;
}

}  // namespace grnnd
