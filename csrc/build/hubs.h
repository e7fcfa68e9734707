// Hubs: a fixed sample of the rows that gives the build a local start and the search entry
// points near each query, on any device (ATen code, shared by the CPU and CUDA kernels).
//
// Why: from random starts a build must discover each vertex's neighbourhood by chance, and the
// number of rounds that takes grows with the number of separate neighbourhoods (clusters) in
// the data; at 10M rows in 10 000 clusters a random start holds almost no neighbour of the
// same cluster. Likewise random entry points rarely land in a query's cluster. Rows that are
// nearest to the same hub form a cell of a Voronoi partition of the data: the build draws most
// initial neighbours from a vertex's own cell and its second cell, and the search starts from
// the hubs nearest to each query. Nearest hubs are found by one matrix product per chunk of
// rows (tensor cores on the GPU), not by a walk.
//
// The sample is a function of N alone (hub_ids): one row at a hashed position in each stratum
// of consecutive rows, so the search finds the build's hubs without anything stored beside the
// graph, and sorted data (say, class by class) still gets hubs in every stretch.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

#include "../core/params.h"
#include "../core/philox.h"

namespace grnnd {

// Rows per hub, and the fewest hubs worth having: below kMinHubs the data is small enough for
// random starts and entry points, and everything behaves as without hubs.
constexpr int64_t kRowsPerHub = 1000;
constexpr int64_t kMinHubs = 16;
// At most this many hubs (100M rows): the cost of assigning N rows to hubs grows as N x hubs.
constexpr int64_t kMaxHubs = 100000;

int64_t hub_count(int64_t n);

// Hub j of the `count` hubs of n rows: stratum j is rows [j n / count, (j + 1) n / count), and
// the hub sits at a hashed offset in it (Knuth's multiplicative hash, kept below 2^63 since
// j < 2^17), so the strata of a sorted data set do not all contribute their first row.
GRNND_HOST_DEVICE int64_t hub_row(int64_t j, int64_t n, int64_t count) {
  const int64_t begin = j * n / count, length = (j + 1) * n / count - begin;
  const int64_t hashed = (j * int64_t{2654435761}) % (int64_t{1} << 32);
  return begin + hashed % length;
}

// The hubs of n rows: int64 [hub_count(n)] ids, increasing, one in each stratum of n / count rows
// (hub_row for every j, as tensor operations on the device of `options`).
at::Tensor hub_ids(int64_t n, const at::TensorOptions& options);

// hub_row for every j < count: `count` rows of n (count <= n), one in each stratum, as an int64
// tensor on the device of `options`. The hubs, and the build's sample of rows it searches for
// (build_schedule.h, unfound_share).
at::Tensor strata_rows(int64_t n, int64_t count, const at::TensorOptions& options);

// For each row of `rows` [m, D], positions (into `hubs` [h, D]) of its k nearest hubs, nearest
// first: int64 [m, k]. Ranking as the metric ranks: kL2 |r - h|^2, kIP -<r, h>, kCosine
// -<r, h> / |h| (rows already normalised). Lifted rows (inner product built on l2, params.h)
// pass their extra coordinates in rows_lift [m] and hubs_lift [h], else undefined tensors.
// Half-precision rows are multiplied on tensor cores with float32 results.
// Scores are made for chunks of rows of at most max_scores floats. The time goes to writing the
// scores and reading them back, not to the product, but chunks small enough for their scores to
// stay in L2 are slower still (a one-off script on one H100, not kept: 10M x 128 half rows
// against 10 000 hubs, a product and a pass over its scores took 0.32 s at 2^26 floats a chunk,
// 0.42 s at 2^23, 0.66 s at 2^22 and 1.93 s at 2^21; 10M x 1024: 0.58, 0.57, 0.70, 1.61 s).
// A product that selects as it goes saves that traffic (below, nearest_hubs_fused_cuda).
constexpr int64_t kScoreBudget = int64_t{1} << 26;  // 256 MiB
at::Tensor nearest_hubs(const at::Tensor& rows, const at::Tensor& hubs, int64_t k, Metric metric,
                        const at::Tensor& rows_lift = at::Tensor(), const at::Tensor& hubs_lift = at::Tensor(),
                        int64_t max_scores = kScoreBudget);

// On CUDA, nearest_hubs selects from the scores in one kernel (csrc/cuda/hubs_cuda.cu) for k up
// to this many hubs (the entry points of lists up to 256); beyond it at::topk selects. On the CPU
// insert_nearest selects at any k, in the same order (ties to the lower hub). At 128 rather than
// 64, lists of 130 to 256 take the three launches of the gathered hub entries (below) instead of
// the hub ids, a product, the scores' scaling and at::topk's radix select: one H200, a batch of
// 10 000 queries at list 256 against 10 000 hubs (10M rows) spent about 2 ms of a 12.5 ms search
// in that path (benchmarks/README.md, "The hub selection at lists up to 256").
constexpr int64_t kMaxFusedHubK = 128;

// out [m, k] int64 (contiguous, k <= kMaxFusedHubK, k <= h): per row r of dots [m, h] (float32,
// contiguous), the columns c of the k smallest weight[c] * dots[r, c] + bias[c]
// (+ row_lift[r] * lift_coef[c] where row_lift is defined), ascending, the lower column first
// among equal scores.
// With out int32 and hub_rows_of = n instead, each column c is written as the row of hub c of the
// n rows (hub_row(c, n, h)): the entry points themselves, no gather of ids after.
void smallest_scores_cuda(const at::Tensor& dots, const at::Tensor& weight, const at::Tensor& bias,
                          const at::Tensor& row_lift, const at::Tensor& lift_coef, at::Tensor& out,
                          int64_t hub_rows_of = 0);

// On CUDA, half-precision rows (float16, bfloat16; d a multiple of 8 and at most
// kMaxFusedProductDim, 16-byte aligned) whose k nearest hubs are few (k <= kMaxFusedProductK, the
// build's cells) and many enough to fill the GPU skip the score matrix: one kernel multiplies and
// selects (csrc/cuda/hubs_cuda.cu). Same ranking, same order among equal scores; out [m, k] int64
// contiguous; weight, bias, row_lift, lift_coef as in smallest_scores_cuda. On one H100
// (benchmarks/bench_hubs.py): the two nearest of 10 000 hubs for 10M x 128 rows in 0.16 s, where
// the score matrix had taken 0.33 s inside a build (torch.profiler: 0.16 s the product, 0.17 s
// the selection) and plain PyTorch takes 2.24 s. Wider rows gain less, as the product outweighs
// the scores' traffic: 4M x 384 against 4000 hubs 0.060 s against 0.089 s for three hubs through
// the score matrix; at 10M x 1024 the fused kernel took 1.05 s against 0.72 s (cuBLAS multiplies
// faster; a one-off run). Times of the form a + b d per (row, hub) pair put the crossing near
// d = 600, hence the bound.
constexpr int64_t kMaxFusedProductK = 2;
constexpr int64_t kMaxFusedProductDim = 512;
bool fused_nearest_hubs_apply(const at::Tensor& rows, const at::Tensor& hubs, int64_t k);
void nearest_hubs_fused_cuda(const at::Tensor& rows, const at::Tensor& hubs, const at::Tensor& weight,
                             const at::Tensor& bias, const at::Tensor& row_lift, const at::Tensor& lift_coef,
                             at::Tensor& out);

// The build's partition of n rows into the cells of their nearest hub.
struct Cells {
  at::Tensor members;  // int32 [n]: row ids grouped by cell (stable: increasing within a cell)
  at::Tensor begin;    // int32 [hubs + 1]: cell c is members[begin[c] .. begin[c + 1])
  at::Tensor cell;     // int32 [n, 2]: each row's nearest and second-nearest cell
};

// Cells of the rows of x (prepared vectors, lift as in nearest_hubs); undefined tensors when
// hub_count(n) is 0.
Cells partition_cells(const at::Tensor& x, const at::Tensor& lift);

// Cells as raw pointers for the kernels; members is null when there are none.
struct CellView {
  const int32_t* members = nullptr;
  const int32_t* begin = nullptr;
  const int32_t* cell = nullptr;
};

inline CellView cell_view(const Cells& cells) {
  if (!cells.members.defined()) return {};
  return {cells.members.data_ptr<int32_t>(), cells.begin.data_ptr<int32_t>(), cells.cell.data_ptr<int32_t>()};
}

// Initial neighbour number s (of S) of vertex v for the random draw r, on both devices: with
// cells, the first half from v's own cell and the next quarter from its second cell (the
// neighbourhood across the nearest cell border), the last quarter uniform over all n rows, which
// keeps long edges in the start; without cells, all uniform (seed 000).
//
// split (0 < split < n) says the rows are two graphs being merged, [0, split) and [split, n)
// (seed 003's GGM): v then draws only from the other part's rows, in the same cells. Its own
// part's rows went through its own build, and a draw from them would spend the merge's rounds
// finding again what that build found. Members ascend within a cell, so the other part's
// members are a prefix or a suffix of it.
GRNND_HOST_DEVICE int64_t initial_neighbour(const CellView& cells, int64_t v, int s, int initial_degree, uint32_t r,
                                            int64_t n, int64_t split = 0) {
  const bool parts = split > 0 && split < n;
  const int64_t low = parts && v < split ? split : 0, high = parts && v >= split ? split : n;
  const int which = 2 * s < initial_degree ? 0 : (4 * s < 3 * initial_degree ? 1 : -1);
  if (cells.members != nullptr && which >= 0) {
    const int32_t cell = cells.cell[2 * v + which];
    int32_t begin = cells.begin[cell], end = cells.begin[cell + 1];
    if (parts) {
      int32_t first_second = begin, past = end;  // the first member >= split, by binary search
      while (first_second < past) {
        const int32_t mid = first_second + (past - first_second) / 2;
        if (cells.members[mid] < split) {
          first_second = mid + 1;
        } else {
          past = mid;
        }
      }
      (v < split ? begin : end) = first_second;
    }
    // A cell may hold none of the rows wanted (duplicate rows can tie two hubs and leave a
    // second cell empty; a cell may lie within one part): draw uniformly then.
    if (end > begin) return cells.members[begin + random_below(r, static_cast<uint32_t>(end - begin))];
  }
  return low + random_below(r, static_cast<uint32_t>(high - low));
}

// Search entry points: for each query, the ids of its `count` nearest hubs (int32 [q, count],
// fewer columns if there are fewer hubs), or an undefined tensor when the data has no hubs or
// count is 0. `x` and `queries` as the search kernels see them; for cosine `x_normalised` says
// whether x's rows are unit length.
at::Tensor hub_entries(const at::Tensor& x, const at::Tensor& queries, Metric metric, bool x_normalised,
                       int64_t count);

// Entry points of a small batch on CUDA (the search's, hub_entries): one kernel computes each
// query's distance to every hub straight from the rows (hub_row), a second sorts them per query
// in shared memory, where the general path takes some twenty tensor operations (the hub ids,
// their rows and norms, a matrix product, a selection), each a launch and most an allocation;
// a batch of one query waits on launches, not on arithmetic. For at most kMaxDirectHubPairs
// (query, hub) pairs, whose distances read each hub row from L2 a few times, and at most
// kMaxDirectHubs hubs (the sort's 8 bytes a hub of shared memory); a larger batch multiplies on
// tensor cores. Rows and queries: float32, float16 or bfloat16, 16-byte aligned, on the GPU or
// (rows only) in pinned host memory.
constexpr int64_t kMaxDirectHubPairs = int64_t{1} << 18;
constexpr int64_t kMaxDirectHubs = 16384;
bool direct_hub_entries_apply(const at::Tensor& x, const at::Tensor& queries);
at::Tensor direct_hub_entries_cuda(const at::Tensor& x, const at::Tensor& queries, Metric ranking, int64_t count);

// Entry points of a larger batch on CUDA: one kernel gathers the hub rows (hub_row, no hub ids)
// with their score terms (nearest_hubs' weight and bias, from the stored values in float32), a
// matrix product scores the queries, and the selection writes the hubs' row ids
// (smallest_scores_cuda with hub_rows_of): three launches where nearest_hubs on the hub ids takes
// about twenty (the ids, their rows, norms, product, selection, the ids of the columns, int32),
// each with its host cost, which a search waits for before its own kernel starts (the search
// kernel of a batch of 1 000 at list 32 takes 0.41 ms on an H200). One H200, 1M x 384 clustered
// float16 rows (1 000 hubs), before and after in one call (benchmarks/README.md, "Hub entry
// points of larger batches"): a batch of 1 000 at list 32 0.59 -> 0.46 ms a call by the rows,
// 0.45 -> 0.36 ms by int8 codes. Rows and queries of one type (float32, float16 or bfloat16),
// contiguous, the queries on the GPU and the rows there or in pinned host memory; any number of
// pairs and hubs, no alignment needed (the gather reads element by element); count at most
// kMaxFusedHubK.
bool gathered_hub_entries_apply(const at::Tensor& x, const at::Tensor& queries, int64_t count);
// hub_rows [h, d] in x's type on the queries' device, weight and bias [h] float32 (ranking's terms).
void gather_hubs_cuda(const at::Tensor& x, const at::Tensor& queries, Metric ranking, at::Tensor& hub_rows,
                      at::Tensor& weight, at::Tensor& bias);

// A query's nearest hubs dealt out to its independent searches (params.h) like cards: search s
// of S gets columns s, s + S, s + 2S, ... of the table, at most per_search of them, so split
// searches start from different hubs, as they start from different random rows.
struct HubEntries {
  const int32_t* ids = nullptr;  // [q, columns], nearest first
  int columns = 0;
  int per_search = 0;
  int searches = 1;

  // The table column of entry point e of search s, or -1 when that entry point is random.
  GRNND_HOST_DEVICE int column(int e, int s) const {
    const int c = e * searches + s;
    return e < per_search && c < columns ? c : -1;
  }
};

inline HubEntries hub_entries_view(const at::Tensor& table, int per_search, int searches) {
  if (!table.defined()) return {};
  return {table.data_ptr<int32_t>(), static_cast<int>(table.size(1)), per_search, searches};
}

}  // namespace grnnd
