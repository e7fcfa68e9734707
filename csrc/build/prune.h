// The build's relative-neighbourhood rule applied to chosen rows of a graph: what editing a built
// index needs (new rows and their reverse edges in Index.add, the rows a removal cut off in
// Index.compact, the rows two graphs exchange in a merge). One recipe for both devices; the CPU
// kernel (csrc/cpu/prune_cpu.cpp) and the CUDA kernel (csrc/cuda/prune_cuda.cu) follow it step
// for step:
//
//   1. Candidates of vertex v: its entries of `candidates` in [0, n), other than v; a repeat
//      counts once. Those in the first `fixed` columns are fixed: kept whatever the rule says
//      (a row's own entries that stay, when only its vacated places are to be filled).
//   2. They are ranked by (d(v, u), u). The list looked at: the nearest kPruneListFactor x degree
//      free ones (DiskANN's list L: a farther one is almost always blocked by a kept nearer one,
//      and the rule's cost grows as the square of the list) and the nearest `degree` fixed ones,
//      however far (a row's long edges, which a search navigates by, must not be pushed out by
//      near candidates offered beside them), in that order.
//   3. The rule (seed 000, eq. 2, as the build's update applies it): walking the list in that
//      order, a fixed u is kept; a free u is kept while places are left beside the fixed
//      ones, unless a kept w is closer to u than v is (d(w, u) < d(v, u)). The row's free
//      places then go to the nearest of the ones the rule dropped, as the build fills its rows
//      after the rule (fill.h).
//      Without the rule, the fixed ones and the nearest free ones are kept.
//   4. The row: kept entries in list order (ascending distance), -1 padded to `degree`.
//
// With `shrink` (a row of the graph and the new vertices that link to it, in Index.add), only
// the surplus over `degree` goes, and the row is not ranked again: the graph keeps every row
// ascending by distance, so computing d(v, u) for all of its entries would only sort it again.
// `fixed` must be 0.
//   S1. The row: the entries of the first min(degree, c) columns, in their order (ids outside
//       [0, n) and v skipped). Newcomers: the ids of the other columns in [0, n) that are not
//       v, not in the row and not a repeat of an earlier column, the first `degree` of them,
//       ranked by (d(v, x), x).
//   S2. Each newcomer's place p: the binary search over the row's distances, lo = 0, hi = row
//       length; while lo < hi: mid = (lo + hi) / 2, lo = mid + 1 if d(v, row[mid]) <= d(v, x),
//       else hi = mid; p = lo (after the row's entries at an equal distance). A newcomer's place
//       is raised to the place of the newcomer ranked before it where that is farther along (a
//       row out of order could give a lower one). d(v, row[i]) is computed only where a search
//       reaches it.
//   S3. The list: each newcomer before the row entry at its place, after the newcomers ranked
//       before it at that place.
//   S4. Walking from the farthest entry u towards the nearest, u is dropped if a nearer entry w
//       of the list covers it (d(w, u) < d(v, u)), until `degree` remain; where too few are
//       covered, the farthest ones left go too. A row that takes one new vertex costs about a
//       binary search and one pass over its entries, where the rule (as HNSW and DiskANN
//       re-prune a full list) costs a pass over every pair, and the entries the build chose
//       for it stay unless one is covered.
//   S5. The row: the entries left in list order, -1 padded to `degree`.
//
// Distances are the build's: the metric's on the prepared rows (cosine normalised), inner
// product as squared l2 in the lifted space (params.h, lifts_inner_product), the lift taken
// over all rows of `data`.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

#include "../core/params.h"

namespace grnnd {

constexpr int64_t kPruneListFactor = 2;
// Candidates a row may offer (columns of `candidates`): the CUDA kernel sorts a row's candidates
// in shared memory, 8 bytes each, rounded up to a power of two.
constexpr int64_t kMaxPruneCandidates = 2048;

// The extra coordinate of each prepared row x that turns inner product into squared l2
// (params.h, lifts_inner_product): sqrt(max |x|^2 - |x_i|^2), float32 [n]; undefined for the
// other metrics. The builds and prune_rows take it from the same rows, so they agree.
at::Tensor inner_product_lift(const at::Tensor& x, Metric metric);

}  // namespace grnnd
