// Built rows filled to the full out-degree: the last step of a build, with a CPU and a CUDA
// twin (csrc/cpu/fill_cpu.cpp, csrc/cuda/fill_cuda.cu) that follow this recipe step for step.
//
// Why: the relative-neighbourhood rule leaves a row about 15 of its 32 places on clustered data
// and on sentence embeddings. A search computes a parent's neighbour distances side by side
// (a team of lanes each), so the empty places save little time and cost recall: filled with the
// nearest vertices two hops away (where the rule sent the candidates it pruned: a pruned
// neighbour went to the pool of the closer neighbour that blocked it), they let a search reach
// a query's true neighbours in fewer iterations. The rule's entries all stay; the fill only
// adds. Measured on one H100 (benchmarks/README.md, quality): recall@10 at list 64 on clustered
// 4M x 384 rose from 0.955 to 0.971, on 10M x 128 from 0.969 to 0.980.
//
// Recipe, for each row v holding c entries (ids >= 0), 0 < c < degree:
//   1. Candidates: its c entries ("own"), then for each own entry u, in row order, the first
//      per = min(degree, max(1, kFillCandidates / c)) entries of u's row. Ids outside [0, n), v
//      itself and repeats are dropped; an id that is also own counts as own.
//   2. d(v, w) for each distinct candidate: the build's distance (the metric on the prepared
//      rows; inner product as squared l2 in the lifted space, params.h).
//   3. Walking them by (distance, id) ascending: every own entry, and the others until
//      degree - c of them are taken.
//   4. The row: the taken entries in that order, -1 padded to degree.
// Rows that are empty or already full stay as they are. kFillPasses passes, each reading the
// rows the previous one wrote: a row whose neighbours were short as well finds their filled
// rows in the next pass (tests/test_connectivity.py's far islands of four rows: two passes left
// 7 of 100 160 rows short of the degree, three none). A pass over full rows reads one row each.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

#include "../core/params.h"

namespace grnnd {

// Two-hop candidates a row looks at, spread over its entries (step 1): about four per entry of
// a half-full row of 32. On 50k x 128 clustered rows (CPU) four and eight per entry gave the same
// search recall.
constexpr int kFillCandidates = 128;
constexpr int kFillPasses = 3;

// Keys of the CUDA fill are 2 * id + 1 bit (repeats adjacent, own first), below the sort's empty
// key 2^31 - 1.
constexpr int64_t kMaxFillRows = (int64_t{1} << 30) - 1;

// The graph (int32 [n, degree], rows ascending by distance, -1 padded) with its rows filled by
// the recipe above; x and lift are the prepared rows and inner-product lift the build measured
// (prune.h, inner_product_lift), `metric` the build's metric.
at::Tensor fill_rows_cpu(const at::Tensor& graph, const at::Tensor& x, const at::Tensor& lift, Metric metric);
at::Tensor fill_rows_cuda(const at::Tensor& graph, const at::Tensor& x, const at::Tensor& lift, Metric metric);

}  // namespace grnnd
