// Every vertex of a built graph reachable from the search's entry points, on any device (ATen
// code shared by the CPU and CUDA builds).
//
// The relative-neighbourhood rule may leave a vertex that no edge leads to: all its neighbours
// handed it on, and no reverse edge brought it back (on 4M clustered rows about 1 vertex in
// 25 000, H100). A search cannot return what it cannot walk to, so the build ends with a repair:
// a breadth-first search from the hubs (hubs.h; vertex 0 for data without hubs), then each
// vertex it did not reach gets an edge from the nearest reached vertex that a search of the
// graph finds for it (as an insertion into HNSW links a new vertex), or from its nearest hub
// where the search finds none. Its nearest reached out-neighbour would be cheaper but can lie
// outside its neighbourhood: a vertex of a small far island whose only out-edge leads back to
// the bulk of the data got its way in from there, and a search that reached the island could
// not walk to it. A full row gives up its farthest entry, which a later pass reconnects if
// that was its only way in; rows stay sorted by distance.
#pragma once

#include <ATen/ATen.h>

namespace grnnd {

// The build's distance (squared l2 of the prepared rows x, plus the inner-product lift's term
// where lift is defined) from row from[i] to each row to[i, :]: float32 [m, c] for int64 from [m]
// and to [m, c].
at::Tensor pair_distances(const at::Tensor& x, const at::Tensor& lift, const at::Tensor& from, const at::Tensor& to);

// bool [n]: the vertices a walk along graph's edges reaches from `sources` (int64 ids).
at::Tensor reached_from(const at::Tensor& graph, const at::Tensor& sources);

// The search's entry points for reachability: the hubs, or vertex 0 for data without hubs.
at::Tensor reachability_sources(int64_t n, const at::TensorOptions& options);

// Makes every vertex of `graph` (int32 [n, degree], rows ascending by distance, -1 padded)
// reachable from reachability_sources, in place. data and metric: as given to the build (the
// search runs on them); x: the prepared rows the build measured; lift: the inner-product lift
// or undefined. Distances for the row order are the build's (squared l2, lifted). Returns the
// edges it added.
int64_t connect_unreachable(at::Tensor& graph, const at::Tensor& data, c10::string_view metric, const at::Tensor& x,
                            const at::Tensor& lift);

// The op `connect` (grnnd.diagnostics.connect): a copy of graph with the repair above applied,
// after the checks a search makes of data and graph. x: data prepared by the device's build.
at::Tensor connected_copy(const at::Tensor& data, const at::Tensor& graph, c10::string_view metric,
                          const at::Tensor& x);

}  // namespace grnnd
