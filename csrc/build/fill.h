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
//      per = min(degree, max(1, fill_candidates(degree) / c)) entries of u's row. Ids outside [0, n), v
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
#include "../core/philox.h"

namespace grnnd {

// Two-hop candidates a row looks at, spread over its entries (step 1): about four per entry of
// a half-full row of 32. On 50k x 128 clustered rows (CPU) four and eight per entry gave the same
// search recall.
constexpr int kFillCandidates = 128;
constexpr int kFillPasses = 3;
// Rows wider than kFillDegree places look at proportionally more. A widened build's rows of 96
// (build_schedule.h, kWidenShare) filled from 128 left rows as short as 63 entries on zipf_aniso
// 1M x 1024 and recalled less (one H200, recall@10 at list 32 / 64 / 128: 0.807 / 0.882 / 0.930
// against 0.820 / 0.885 / 0.935 from 256; zipf 1M x 384 0.787 / 0.858 / 0.915 against 0.792 /
// 0.866 / 0.917; benchmarks/results/scale_widen_1m_{fill128_,}h200.md).
constexpr int kFillDegree = 48;
GRNND_HOST_DEVICE int fill_candidates(int degree) {
  return degree > kFillDegree ? kFillCandidates * degree / kFillDegree : kFillCandidates;
}

// Keys of the CUDA fill are 2 * id + 1 bit (repeats adjacent, own first), below the sort's empty
// key 2^31 - 1.
constexpr int64_t kMaxFillRows = (int64_t{1} << 30) - 1;

// The graph (int32 [n, degree], rows ascending by distance, -1 padded) with its rows filled by
// the recipe above; x and lift are the prepared rows and inner-product lift the build measured
// (prune.h, inner_product_lift), `metric` the build's metric.
// `graph` by value: a caller that moves it in frees it after the first pass.
at::Tensor fill_rows_cpu(at::Tensor graph, const at::Tensor& x, const at::Tensor& lift, Metric metric);
at::Tensor fill_rows_cuda(at::Tensor graph, const at::Tensor& x, const at::Tensor& lift, Metric metric);

}  // namespace grnnd
