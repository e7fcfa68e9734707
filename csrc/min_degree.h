// A minimum out-degree for built graphs, on any device (ATen code shared by the CPU and CUDA
// builds).
//
// The relative-neighbourhood rule keeps a neighbour only when no kept one is closer to it, so in
// a dense cluster a vertex can end with one or two out-edges: on clustered data about a quarter
// of the rows held fewer than 8 and one in a hundred at most 2 (1M-10M rows, H100). A search that
// walks into such a vertex has few ways on, and a vertex that is a search's entry point fewer
// still. The fill gives every row at least kMinOutDegree entries: its own, then the nearest of its
// two-hop neighbours (the entries of its neighbours' rows), which is where the rule sent the
// candidates it pruned (a pruned neighbour went to the pool of the closer neighbour that
// blocked it). Only the short rows change; the rule's choice stays first in each row.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

namespace grnnd {

// The fewest out-edges a built row has (where the data has that many other rows and the degree
// allows it).
constexpr int64_t kMinOutDegree = 8;

// Fills every row of `graph` (int32 [n, degree], rows ascending by distance, -1 padded) that
// holds fewer than kMinOutDegree entries, in place, keeping rows sorted. x and lift: the
// prepared rows and inner-product lift the build measured (reachability.h, pair_distances).
// Returns the edges it added.
int64_t fill_short_rows(at::Tensor& graph, const at::Tensor& x, const at::Tensor& lift);

}  // namespace grnnd
