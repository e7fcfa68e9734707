// Batched graph search on the GPU: the twin of csrc/cpu/search_cpu.cpp.
//
// CAGRA's single-CTA search, the design the GPU study (seed 002) found fastest: one thread block
// per query; the best `list_size` nodes seen kept sorted in shared memory (M slots, M = list_size
// rounded up to a power of two); each iteration the `search_width` best not yet expanded nodes
// are expanded, their unvisited neighbours' distances computed by teams of lanes, the new
// candidates sorted and merged into the list with a bitonic network (seed 002, OB 8: sort the
// batch and merge rather than insert one by one); an O(1) open-addressing visited hash in shared
// memory (OB 8: CAGRA's hash, not GGNN's linear scan). Stops when no unexpanded node is left in
// the list or after `max_iters` iterations. Entry points are drawn exactly as the CPU draws them,
// so both walk the same graph from the same start.
//
// Why results never hold a duplicate id although the hash "forgets": the hash is cleared only
// between iterations and then refilled with every id in the list (and in the filtered result
// list), and it is never more than half full, so an insertion always finds the key or a free
// slot. A node in either list is therefore always known; a forgotten node is one that was cut
// from the list earlier, and as the list's worst key only improves it can never re-enter: it
// costs one recomputed distance, nothing else.
//
// Small batches (seed 002, OB 10: a batch of 1-100 queries leaves most SMs idle with one block per
// query): a query is split into several independent searches, one block each, every one with
// its own entry points and a shorter list (params.h, list_per_search); a second kernel merges
// their results. Unlike CAGRA's multi-CTA mode the blocks share no visited set, so they repeat
// some distances, but a query's result depends only on its inputs, never on timing.
//
// This file plans a call (searches, lists, loop, threads, shared memory), checks the queries,
// rotates them for int4 codes and merges split searches; the walk's kernels are in
// search_walk_cuda.cuh, compiled in units of their own.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <torch/library.h>

#include "search_walk_cuda.cuh"

namespace grnnd {
namespace cuda {
namespace {

// searches_for_batch: the largest batch it splits (one query per kSplitSmsPerQuery SMs), the
// blocks per SM a split aims at, the fewest searches its cap allows, and the searches at list k.
// Below kLatencyBoundBlocksPerSm blocks per SM a search's time is its chain of iterations, not
// the SM's throughput: such a launch gets more threads a block (pick_threads) and wide rounds
// take the block loop (run_search).
constexpr int kLatencyBoundBlocksPerSm = 4;
constexpr int kSplitSmsPerQuery = 4;
constexpr int kSplitBlocksPerSm = 8;
constexpr int kMinSplit = 8;
constexpr int kSplitSearchesAtK = 4;

// Merges the `searches` sorted parts of k results of each query into its k best distinct ids, one
// warp per query: lane j holds the head of search j's part, and each step takes the smallest
// head (a butterfly of shuffles) and moves past it every part whose head holds that id. Two
// searches that reached the same node computed the same distance for it (same code, same inputs,
// same lanes), so a node's copies are equal keys and reach the heads together: a step emits one
// distinct id, and k steps (fewer when the parts run out) finish the query. The parts are staged
// in shared memory first, so that a step waits on no global load. A bitonic sort of all the
// parts in one block of 256 threads took about 10 us for 32 searches of 10 (H200, benchmarks/
// results/profile_small_batches_latency_h200_before.txt), most of it its 45 barrier-separated
// stages.
static_assert(kMaxSearches <= kWarpSize, "merge_searches_kernel keeps one part's head per lane");
__global__ void __launch_bounds__(kWarpSize)
    merge_searches_kernel(const float* __restrict__ part_dists, const int64_t* __restrict__ part_ids, int searches,
                          int k, float* __restrict__ out_dists, int64_t* __restrict__ out_ids) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int per_query = searches * k;  // searches <= kMaxSearches = 32 lanes (params.h)
  float* d = reinterpret_cast<float*>(smem);
  uint32_t* id = reinterpret_cast<uint32_t*>(d + per_query);
  const int lane = threadIdx.x;
  const int64_t in = static_cast<int64_t>(blockIdx.x) * per_query, out = static_cast<int64_t>(blockIdx.x) * k;
  for (int i = lane; i < per_query; i += kWarpSize) {
    const int64_t u = part_ids[in + i];
    d[i] = u >= 0 ? part_dists[in + i] : std::numeric_limits<float>::infinity();
    id[i] = u >= 0 ? static_cast<uint32_t>(u) : kEmptyId;
  }
  __syncwarp();
  int at = 0;  // position in this lane's part
  const auto head_d = [&] { return lane < searches && at < k ? d[lane * k + at] : std::numeric_limits<float>::infinity(); };
  const auto head_i = [&] { return lane < searches && at < k ? id[lane * k + at] : kEmptyId; };
  float hd = head_d();
  uint32_t hi = head_i();
  int kept = 0;
  for (; kept < k; ++kept) {
    float best_d = hd;
    uint32_t best_i = hi;
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      const float od = __shfl_xor_sync(kFullMask, best_d, offset);
      const uint32_t oi = __shfl_xor_sync(kFullMask, best_i, offset);
      if (key_less(od, oi, best_d, best_i)) {
        best_d = od;
        best_i = oi;
      }
    }
    if (best_i == kEmptyId) break;  // warp-uniform: every part is spent
    if (lane == 0) {
      out_dists[out + kept] = best_d;
      out_ids[out + kept] = best_i;
    }
    if (hi == best_i) {
      ++at;
      hd = head_d();
      hi = head_i();
    }
  }
  for (int j = kept + lane; j < k; j += kWarpSize) {
    out_dists[out + j] = std::numeric_limits<float>::infinity();
    out_ids[out + j] = -1;
  }
}

// Threads per block. A query's iterations are serial and each ends in
// block-wide barriers, so few threads lose little per query while many resident blocks hide
// each other's barrier and memory stalls; a batch that cannot fill the GPU is latency-bound
// instead, and more threads shorten each iteration. Measured on the H200 (1M x 384 float16
// normalised clustered rows, list 64): batch 10 000 ran at 2.03M q/s with 64 threads, 1.67M
// with 128, 1.00M with 256; a batch of 100 took 1.11 ms with 64 threads, 0.80 ms with 128,
// 0.65 ms with 256. Later, with int4 codes at list 32 (search kernel time, a one-off run), a
// batch of 1 took 98 us with 256 threads and 92 us with 512, a batch of 100 121 and 111 us. Long
// lists keep enough threads for the merge network's M/2 compare-exchanges per stage.
int pick_threads(int64_t blocks, int sms, int list_cap, int64_t per_round) {
  const int for_batch = blocks >= 8 * sms                          ? 64
                        : blocks >= kLatencyBoundBlocksPerSm * sms ? 128
                        : blocks >= sms                            ? 256
                                                                   : 512;
  const int for_list = list_cap <= 256 ? 64 : list_cap <= 512 ? 256 : 512;
  // A round wider than the warp loop's goes to the block loop, where every thread expands and
  // loads candidates: 64 threads made a 288-candidate round (6 parents of degree 48) at list 256
  // run at 673K q/s by int4 codes against 901K with 128 and 888K with 256 (params.h,
  // resolve_search_width, has the run).
  const int for_round = per_round > kGpuWidestWarpRound ? 128 : 64;
  return std::max({for_batch, for_list, for_round});
}

// Independent searches per query when the caller leaves it to us: none for a batch of more than
// one query per kSplitSmsPerQuery SMs; for a smaller one, by the list size: 4 searches at list k,
// twice as many for each further k/3 of list, up to about kSplitBlocksPerSm blocks per SM (at
// least kMinSplit) and what the merge allows. The list then sets both knobs of a small batch,
// each search's list (list_per_search) and how many run, so the list sweeps one curve from the
// cheapest call to the most accurate one. Measured on the H200 (1M x 384 real embeddings, one
// run before/after, benchmarks/README.md "Width 4 at every GPU batch; searches by the list size"):
// a batch of 1 by int8 codes took 0.092 ms at recall 0.954 with list 10 (4 searches), where 32
// searches at any list took at least 0.113 ms, recall 0.990; at recall 0.99 both rules cost
// alike (0.115 against 0.113-0.114 ms).
// Earlier (batches of 100, list 16, 1M x 384 real embeddings) 10 searches a query ran at 315K q/s,
// recall 0.953, and 21 (16 blocks per SM) at 221K, 0.970: more blocks than the GPU holds at once
// stop paying. With a width of 4 a batch of 100 ran faster unsplit at equal recall (268K q/s at
// 0.991 against 223K at 0.986 for 10 searches, list 64; profile_small_batches.py --sweep).
int searches_for_batch(int64_t queries, int sms, int k, int list_size) {
  if (queries * kSplitSmsPerQuery > sms) return 1;
  const int64_t fill = kSplitBlocksPerSm * static_cast<int64_t>(sms) / std::max<int64_t>(queries, 1);
  const int64_t most = std::min<int64_t>(std::max<int64_t>(fill, kMinSplit), max_searches_for_k(k));
  const double doublings = std::min(3.0 * (list_size - k) / std::max(k, 1), 8.0);
  const int64_t by_list = std::lround(kSplitSearchesAtK * std::exp2(doublings));
  return static_cast<int>(std::clamp<int64_t>(by_list, std::min<int64_t>(kSplitSearchesAtK, most), most));
}

// The team of the code distances (both loops): the smallest whose lanes each load at most
// kWarpLoopChunksInFlight chunks of a code row, so that a row is one round trip and a warp
// takes as many rows at once as that allows. It differs from team_for_row only for rows of 129
// to 256 bytes (4 lanes, not 8): on the H200 (1M x 384 real rows, batch 10 000, lists 32-96) the
// 192-byte int4 rows ran 15-27% faster with 4 lanes than with 8 at the same recall (2.21M against
// 1.93M q/s at list 64; a one-off comparison in one process with the team forced, script not
// kept), while 384-byte int8 rows ran alike with 4 or 8. benchmarks/README.md ("Searching by
// 4-bit codes") has the committed before/after run. Full rows keep team_for_row: rows of that
// length were not measured with 4. The block loop took these teams later: with a filter at batch
// 10 000 (int4, list 64) it ran 3.94 ms against 4.38 ms with 8 lanes, and alike at small batches
// (a one-off run).
int code_team(int64_t row_bytes) {
  const int64_t chunks = (row_bytes + 15) / 16;
  int team = 4;
  while (team < kWarpSize && chunks > static_cast<int64_t>(team) * kWarpLoopChunksInFlight) team *= 2;
  return team;
}

size_t shared_bytes(const SearchArgs& a, int hash_bits) {
  return (a.codes != nullptr ? 2 * static_cast<size_t>(a.code_dims) : 0) +
         sizeof(float) * 2 * (static_cast<size_t>(a.list_cap) + a.result_cap + a.cand_cap) +
         sizeof(uint32_t) * (size_t{1} << hash_bits);
}

int log2_of(int64_t pow2) {
  int b = 0;
  while ((int64_t{1} << b) < pow2) ++b;
  return b;
}

// Lowest row of `rows` (count elements of rows of `dim`) that holds a NaN or Inf, found per
// block: block b writes its lowest such row, or `rows_count` if none, to block_first[b], which
// lies in pinned host memory (stores straight to the host: no fill before, no copy after).
template <typename scalar_t>
__global__ void first_non_finite_row_kernel(const scalar_t* rows, int64_t count, int64_t dim, int64_t rows_count,
                                            int64_t* block_first) {
  __shared__ unsigned long long first;
  if (threadIdx.x == 0) first = static_cast<unsigned long long>(rows_count);
  __syncthreads();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    if (!isfinite(static_cast<double>(rows[i]))) atomicMin(&first, static_cast<unsigned long long>(i / dim));
  }
  __syncthreads();
  if (threadIdx.x == 0) block_first[blockIdx.x] = static_cast<int64_t>(first);
}

// The finiteness check of the queries, split around the search: the constructor queues a kernel
// that finds the first non-finite row and writes its answer to pinned host memory, finish() waits
// for that kernel alone (not for the search queued after it) and raises. So a search returns
// while its kernels still run, and a caller can queue more work (a collective, a merge) behind
// them. One launch: a fill before it and a copy after it were two more, each a few microseconds
// of a batch of one. Skipped under CUDA-graph capture (contents_readable); the search orders NaN
// distances last either way.
class QueryCheck {
 public:
  QueryCheck(const at::Tensor& queries, cudaStream_t stream) {
    if (!contents_readable(queries)) return;
    const at::Tensor rows = queries.contiguous();
    rows_ = rows.size(0);
    const int64_t count = rows.numel();
    if (count == 0) return;
    const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, kMaxBlocks));
    host_first_ = at::empty({blocks}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    void* device_first = nullptr;
    C10_CUDA_CHECK(cudaHostGetDevicePointer(&device_first, host_first_.data_ptr(), 0));
    GRNND_DISPATCH_STORAGE(rows.scalar_type(), "first_non_finite_row", [&] {
      first_non_finite_row_kernel<scalar_t><<<blocks, 256, 0, stream>>>(rows.data_ptr<scalar_t>(), count, rows.size(1),
                                                                        rows_, static_cast<int64_t*>(device_first));
    });
    check_launch();
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&written_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(written_, stream));
  }

  QueryCheck(const QueryCheck&) = delete;
  QueryCheck& operator=(const QueryCheck&) = delete;

  // The kernel writes host memory the allocator knows nothing of: it must have finished before
  // that memory is freed, also when the search raised before finish().
  ~QueryCheck() {
    if (written_ == nullptr) return;
    C10_CUDA_CHECK_WARN(cudaEventSynchronize(written_));
    C10_CUDA_CHECK_WARN(cudaEventDestroy(written_));
  }

  void finish() const {
    if (written_ == nullptr) return;
    C10_CUDA_CHECK(cudaEventSynchronize(written_));
    const int64_t* first = host_first_.data_ptr<int64_t>();
    const int64_t row = *std::min_element(first, first + host_first_.numel());
    if (row < rows_) fail_non_finite("queries", row);
  }

 private:
  static constexpr int64_t kMaxBlocks = 1024;
  at::Tensor host_first_;  // pinned: each block's lowest non-finite row (rows_ if none)
  cudaEvent_t written_ = nullptr;  // recorded after the kernel that writes host_first_
  int64_t rows_ = 0;
};

// int4 codes: y = P u of every query and its dots t_j with the cells (codes.h; u = q - c_0 under
// l2, q otherwise), each summed chunk by chunk of dimensions as the CPU sums it
// (int4_rotation_step). Two kernels, by the batch.
//
// rotate_queries_kernel, for batches of at least kRotateOneQueryBelow queries: a block takes
// kRotateQueries queries and kRotateThreads outputs, one a thread, so that the grid is read once
// per 16 queries; the queries are staged in shared memory kRotateDims dimensions at a time. The
// rotation's outputs read the grid's row d at the block's outputs (coalesced). A cell's offsets
// lie along its centre's row: the block stages them kCellTileDims dimensions at a time, a warp
// reading a row's dimensions together, in a transposed tile each output then reads down. Read
// along the rows by each thread, they held a batch of 10 000 queries with 1 000 cells to 3.37M
// q/s at list 16 against 4.64M with the tiles (H200, 1M x 384 real rows).
//
// rotate_query_chunks_kernel, for smaller batches: a block takes one query and 32 outputs, one a
// lane, and its warps sum different chunks at once (a query's outputs are too few to fill the GPU
// one a thread: each would wait on a chain of dim loads). A warp loads the whole chunk of its
// lane's column or centre row before the first product, so a chunk costs one trip to memory;
// warp 0 adds the chunks' sums in order. One query a block reading whole columns took 14 us
// with one cell (a one-off run) and 35 us with 1 000 (benchmarks/results/
// profile_small_batches_latency_h200_before.txt; a batch of 1 on an H200, 384 dimensions).
constexpr int kRotateThreads = 128, kRotateDims = 128, kCellTileDims = 32, kRotateQueries = 16;
constexpr int kChunkWarps = 8;
static_assert(kRotateDims % kInt4RotationChunk == 0 && kCellTileDims == kInt4RotationChunk,
              "rotate_queries_kernel's stages must end where the chunks end");

template <typename T>
__global__ void __launch_bounds__(kRotateThreads)
    rotate_queries_kernel(const T* __restrict__ queries, int64_t nq, int dim, int cells,
                          const float* __restrict__ grid, Metric metric, float* __restrict__ out) {
  __shared__ float staged[kRotateQueries][kRotateDims];
  __shared__ float tile[kCellTileDims][kRotateThreads + 1];  // [dimension][output]; +1: no bank conflicts
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRotateQueries;
  const int count = static_cast<int>(std::min<int64_t>(kRotateQueries, nq - first));
  const int first_output = blockIdx.y * kRotateThreads;
  const int i = first_output + threadIdx.x;
  const int outputs = dim + cells;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const float* centre = grid + static_cast<int64_t>(dim) * dim;  // c_0, then the other cells
  const bool has_cells = first_output + kRotateThreads > dim;     // the same for the whole block
  float acc[kRotateQueries] = {};
  for (int d0 = 0; d0 < dim; d0 += kRotateDims) {
    const int width = dim - d0 < kRotateDims ? dim - d0 : kRotateDims;
    __syncthreads();  // the previous tiles are read
    for (int e = threadIdx.x; e < kRotateQueries * kRotateDims; e += kRotateThreads) {
      const int k = e / kRotateDims, d = e % kRotateDims;
      staged[k][d] = k < count && d < width
                         ? int4_rotation_input(static_cast<float>(queries[(first + k) * dim + d0 + d]),
                                               centre[d0 + d], metric)
                         : 0.0f;
    }
    __syncthreads();
    if (i < dim) {
      for (int c = 0; c < width; c += kInt4RotationChunk) {
        const int chunk_end = std::min(width, c + kInt4RotationChunk);
        float sum[kRotateQueries] = {};
        for (int d = c; d < chunk_end; ++d) {
          const float r = grid[static_cast<int64_t>(d0 + d) * dim + i];
#pragma unroll
          for (int k = 0; k < kRotateQueries; ++k) sum[k] = int4_rotation_step(sum[k], r, staged[k][d]);
        }
#pragma unroll
        for (int k = 0; k < kRotateQueries; ++k) acc[k] += sum[k];
      }
    }
    if (!has_cells) continue;
    for (int t0 = 0; t0 < width; t0 += kCellTileDims) {  // a tile is a chunk
      const int tile_width = width - t0 < kCellTileDims ? width - t0 : kCellTileDims;
      __syncthreads();  // the previous tile is read
      for (int o = warp; o < kRotateThreads; o += kRotateThreads / kWarpSize) {
        const int cell = first_output + o - dim;
        const int d = d0 + t0 + lane;
        tile[lane][o] = cell >= 0 && cell < cells && lane < tile_width
                            ? int4_cell_offset(centre[static_cast<int64_t>(cell) * dim + d], centre[d], metric)
                            : 0.0f;
      }
      __syncthreads();
      if (i >= dim && i < outputs) {
        float sum[kRotateQueries] = {};
        for (int d = 0; d < tile_width; ++d) {
          const float w = tile[d][threadIdx.x];
#pragma unroll
          for (int k = 0; k < kRotateQueries; ++k) sum[k] = int4_rotation_step(sum[k], w, staged[k][t0 + d]);
        }
#pragma unroll
        for (int k = 0; k < kRotateQueries; ++k) acc[k] += sum[k];
      }
    }
  }
  if (i < outputs) {
#pragma unroll
    for (int k = 0; k < kRotateQueries; ++k) {
      if (k < count) out[(first + k) * outputs + i] = acc[k];
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kChunkWarps * kWarpSize)
    rotate_query_chunks_kernel(const T* __restrict__ queries, int dim, int cells, const float* __restrict__ grid,
                               Metric metric, float* __restrict__ out) {
  __shared__ float sums[kChunkWarps][kWarpSize];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t q = blockIdx.x;
  const int outputs = dim + cells;
  const int o = static_cast<int>(blockIdx.y) * kWarpSize + lane;  // this lane's output
  const float* centre = grid + static_cast<int64_t>(dim) * dim;   // c_0, then the other cells
  const T* query = queries + q * dim;
  const int chunks = (dim + kInt4RotationChunk - 1) / kInt4RotationChunk;
  float acc = 0.0f;  // warp 0's
  for (int round = 0; round < chunks; round += kChunkWarps) {
    const int c = round + warp;
    if (c < chunks) {  // warp-uniform
      const int first = c * kInt4RotationChunk;
      const int width = dim - first < kInt4RotationChunk ? dim - first : kInt4RotationChunk;
      // Lane l holds dimension first + l of c_0 and of u; the products take them by shuffles.
      const float c0 = lane < width ? centre[first + lane] : 0.0f;
      const float u = lane < width ? int4_rotation_input(static_cast<float>(query[first + lane]), c0, metric) : 0.0f;
      float w[kInt4RotationChunk];
#pragma unroll
      for (int d = 0; d < kInt4RotationChunk; ++d) {
        w[d] = 0.0f;
        if (d < width && o < outputs) {
          w[d] = o < dim ? grid[static_cast<int64_t>(first + d) * dim + o]
                         : centre[static_cast<int64_t>(o - dim) * dim + first + d];
        }
      }
      float sum = 0.0f;
#pragma unroll
      for (int d = 0; d < kInt4RotationChunk; ++d) {
        const float ud = __shfl_sync(kFullMask, u, d);
        const float cd = __shfl_sync(kFullMask, c0, d);
        if (d < width) sum = int4_rotation_step(sum, o < dim ? w[d] : int4_cell_offset(w[d], cd, metric), ud);
      }
      sums[warp][lane] = sum;
    }
    __syncthreads();
    if (warp == 0) {
      for (int k = 0; k < kChunkWarps && round + k < chunks; ++k) acc += sums[k][lane];
    }
    __syncthreads();  // the sums are read before the next round writes them
  }
  if (warp == 0 && o < outputs) out[q * outputs + o] = acc;
}

// Batches below this many queries take rotate_query_chunks_kernel.
constexpr int64_t kRotateOneQueryBelow = 64;

template <typename T>
at::Tensor rotate_queries(const at::Tensor& q, const at::Tensor& grid, Metric metric, cudaStream_t stream) {
  const int64_t nq = q.size(0);
  const int dim = static_cast<int>(q.size(1));
  const int cells = static_cast<int>(grid.size(0)) - dim;
  at::Tensor out = at::empty({nq, dim + cells}, q.options().dtype(at::kFloat));
  if (nq < kRotateOneQueryBelow) {
    const unsigned column_blocks = static_cast<unsigned>((dim + cells + kWarpSize - 1) / kWarpSize);
    rotate_query_chunks_kernel<T><<<dim3(static_cast<unsigned>(nq), column_blocks), kChunkWarps * kWarpSize, 0,
                                    stream>>>(q.data_ptr<T>(), dim, cells, grid.data_ptr<float>(), metric,
                                              out.data_ptr<float>());
  } else {
    const unsigned column_blocks = static_cast<unsigned>((dim + cells + kRotateThreads - 1) / kRotateThreads);
    rotate_queries_kernel<T>
        <<<dim3(static_cast<unsigned>((nq + kRotateQueries - 1) / kRotateQueries), column_blocks), kRotateThreads,
           0, stream>>>(q.data_ptr<T>(), nq, dim, cells, grid.data_ptr<float>(), metric, out.data_ptr<float>());
  }
  check_launch();
  return out;
}

// How a call's searches are laid out, from the shapes and settings alone: the SearchArgs sizes
// (searches a query, lists, caps, the loop, the visited hash; the code rows' pointers), the block
// size, the shared memory and the lanes a row takes. run_search adds the pointers of the tensors
// it makes.
struct SearchPlan {
  SearchArgs a{};
  int threads = 0;
  size_t smem = 0;
  int team = 0;
};

SearchPlan plan_search(const at::Tensor& data, const at::Tensor& graph, const at::Tensor& queries, bool filtered,
                       const SearchCodes& codes, const SearchParams& p, int64_t row_bytes) {
  const int64_t n = data.size(0), nq = queries.size(0), degree = graph.size(1);
  TORCH_CHECK_VALUE(nq <= std::numeric_limits<int32_t>::max(), "queries: expected fewer than 2^31 rows, got ", nq);
  int device = queries.device().index(), optin = 0, sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  SearchPlan plan;
  SearchArgs& a = plan.a;
  if (codes.codes.defined()) {
    a.codes = codes.codes.data_ptr<uint8_t>();
    a.code_grid = codes.grid.data_ptr<float>();
    a.code_stride = codes.codes.size(1);
    a.code_dims = static_cast<int>(codes.dims);
    a.code_bytes = static_cast<int>(codes.bytes);
    a.code_cells = codes.kind == CodeKind::kInt4 ? static_cast<int>(codes.grid.size(0) - data.size(1)) : 0;
  }
  a.seed = p.seed;
  a.metric = p.metric;
  a.n = static_cast<int>(n);
  a.dim = static_cast<int>(data.size(1));
  a.degree = static_cast<int>(degree);
  a.k = p.k;
  a.searches = p.searches > 0 ? p.searches : searches_for_batch(nq, sms, p.k, p.list_size);
  TORCH_CHECK_VALUE(nq * a.searches <= std::numeric_limits<int32_t>::max(), "queries * searches: expected fewer ",
                    "than 2^31 searches per call, got ", nq, " * ", a.searches);
  a.list_size = list_per_search(p.list_size, p.k, a.searches);
  a.list_cap = next_pow2(a.list_size);
  const int width = resolve_search_width(p.search_width, /*on_gpu=*/true, degree, a.list_size);
  TORCH_CHECK_VALUE(width <= kMaxSearchWidth, "search_width: expected <= ", kMaxSearchWidth);
  const int64_t per_round = static_cast<int64_t>(width) * degree;
  TORCH_CHECK_VALUE(per_round <= (1 << 16), "search_width * graph degree: the CUDA search expands at most 65536 ",
                    "neighbours per iteration, got ", width, " * ", degree);
  // With codes a filtered search keeps as many allowed entries as the list for the re-rank.
  a.kept = a.codes != nullptr ? std::max(p.k, a.list_size) : p.k;
  a.result_cap = filtered ? next_pow2(a.kept) : 0;
  a.cand_cap = std::max(a.list_cap, next_pow2(static_cast<int>(per_round)));
  a.search_width = width;
  a.max_iters = p.max_iters;
  // Rounds wider than two slots a lane take the warp loop only when the blocks are many. With few
  // blocks per SM, warp 0's serial expansion, sort and merge are the chain a search waits on, and
  // the block loop (every thread expanding and loading rows, only the candidates that can enter
  // the list sorted) is faster. Search kernel time on one H200 (1M x 384 normalised clustered
  // float16 rows, int4 codes, list 32; one-off runs with the choices forced, script not kept;
  // benchmarks/README.md has the committed before/after): a batch of 1 (32 blocks of 512
  // threads) 159 us in the warp loop against 131 us in the block loop, before that loop sorted
  // only the entering candidates; with it, a batch of 10 (320 blocks of 256) 218 against 120 us,
  // while a batch of 1 000 (1 000 blocks) took 304 us in the warp loop (128 threads) against
  // 402 us in the block loop (256).
  const int64_t blocks = nq * a.searches;
  const bool warp_fits = !filtered && a.list_cap <= kMaxWarpRows * kWarpSize &&
                         per_round <= kMaxWarpCandRows * kWarpSize &&
                         (per_round <= kAnyBatchCandRows * kWarpSize || blocks >= kLatencyBoundBlocksPerSm * sms);
  // Two rows at least: a one-row variant spilled registers (ptxas, sm_90) and would add a kernel
  // per storage type and team for lists of at most 32.
  a.warp_rows = warp_fits ? std::max(2, a.list_cap / kWarpSize) : 0;  // list_cap is a power of two
  a.entries = static_cast<int>(std::min<int64_t>(a.list_size, n));

  // Visited hash: must hold list + results + one round at load <= 1/2 (the no-duplicate
  // argument at the top); 4x that, at least 2048 slots, so resets (which forget visited nodes
  // and cost recomputed distances) stay rare. Falls back to the 2x minimum if shared memory is short.
  const size_t limit = static_cast<size_t>(optin) - kStaticShared;
  const int64_t must_hold = static_cast<int64_t>(a.list_size) + (filtered ? a.kept : 0) + per_round;
  a.hash_bits = log2_of(std::max<int64_t>(4 * must_hold, 2048));
  if (shared_bytes(a, a.hash_bits) > limit) a.hash_bits = log2_of(2 * must_hold);
  plan.smem = shared_bytes(a, a.hash_bits);
  TORCH_CHECK_VALUE(plan.smem <= limit, "search: list_size ", a.list_size, ", search_width ", width,
                    " and graph degree ", degree, " need ", plan.smem, " bytes of shared memory per query on the GPU, ",
                    "which has ", limit, "; lower list_size or search_width");

  plan.threads = pick_threads(blocks, sms, a.list_cap, per_round);
  // The team fits the rows the traversal reads: the codes where there are codes.
  plan.team = a.codes != nullptr ? code_team(a.code_bytes) : team_for_row(row_bytes);
  return plan;
}

// Runs the search of every query (checked, parsed arguments); with `counts` defined, also adds
// up the distances each query computed there.
std::tuple<at::Tensor, at::Tensor> run_search(const at::Tensor& data, const at::Tensor& graph,
                                              const at::Tensor& queries, const c10::optional<at::Tensor>& filter,
                                              const SearchCodes& codes, const SearchParams& p,
                                              const at::Tensor& counts) {
  // The search runs on the queries' GPU; the data rows may also lie in pinned host memory there
  // (check_search_data_device), read by the kernel row by row through unified addressing.
  const c10::cuda::CUDAGuard guard(queries.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(queries.device().index()).stream();

  // Cosine: only the queries are normalised; the data rows' norms are folded into the distance
  // (team_cosine), so no [N, D] copy is made per call.
  const at::Tensor x = prepare_vectors(data, p.metric == Metric::kCosine ? Metric::kL2 : p.metric);
  // Host rows are read where they lie: a narrowed (float64) or realigned copy would be pageable.
  TORCH_CHECK_VALUE(x.is_cuda() || x.data_ptr() == data.data_ptr(), "data: host rows searched from a GPU must be ",
                    "float32, float16 or bfloat16, contiguous and 16-byte aligned, got ", data.scalar_type(),
                    " with strides ", data.strides());
  const void* rows = x.is_cuda() ? x.data_ptr() : device_address_of_host_rows(x);
  const at::Tensor q = prepare_vectors(queries.to(x.scalar_type()), p.metric);
  const at::Tensor g = graph.contiguous();
  const at::Tensor allowed = filter.has_value() ? filter->contiguous() : at::Tensor();
  const QueryCheck query_check(queries, stream);

  SearchPlan plan = plan_search(data, graph, queries, filter.has_value(), codes, p,
                                x.size(1) * static_cast<int64_t>(x.element_size()));
  SearchArgs& a = plan.a;
  const int64_t n = data.size(0), nq = queries.size(0);
  a.graph = g.data_ptr<int32_t>();
  a.counts = counts.defined() ? counts.data_ptr<int32_t>() : nullptr;
  a.allowed = filter.has_value() ? allowed.data_ptr<bool>() : nullptr;
  // Cosine rows are not normalised here (team_cosine divides by their norms).
  const int per_search = hub_entries_for_list(p.hub_entries, a.entries);
  const at::Tensor hub_table = hub_entries(x, q, p.metric, /*x_normalised=*/false, per_search * a.searches);
  a.hubs = hub_entries_view(hub_table, per_search, a.searches);
  // The hub distances of the entry points count too (one matrix product row per query).
  if (counts.defined() && a.hubs.columns > 0) counts.add_(static_cast<int32_t>(hub_count(n)));

  at::Tensor out_dists = at::empty({nq, p.k}, queries.options().dtype(at::kFloat));
  at::Tensor out_ids = at::empty({nq, p.k}, queries.options().dtype(at::kLong));
  if (nq == 0) return {out_dists, out_ids};  // an empty grid is no valid launch
  // Split queries write each search's k best to a workspace the merge reads.
  const at::Tensor part_dists = a.searches > 1 ? at::empty({nq * a.searches, p.k}, out_dists.options()) : out_dists;
  const at::Tensor part_ids = a.searches > 1 ? at::empty({nq * a.searches, p.k}, out_ids.options()) : out_ids;
  a.out_dists = part_dists.data_ptr<float>();
  a.out_ids = part_ids.data_ptr<int64_t>();

  const int threads = plan.threads, team = plan.team;
  const size_t smem = plan.smem;
  at::Tensor rotated;  // int4: the rotated queries and their cell dots
  // A generic lambda, so that its float64 branch is discarded uncompiled (prepare_vectors narrows
  // float64): in the dispatch's own lambda, no template, it compiled every search kernel for
  // float64 too, 48 kernels no call could reach.
  const auto launch_storage = [&](const auto* x_rows) {
    using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(x_rows)>>;
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "search_cuda: float64 storage should have been narrowed by prepare_vectors");
    } else {
      const auto launch_for = [&](auto code) {
        launch_walk<scalar_t, decltype(code)::value>(x_rows, q, a, team, threads, smem, stream);
      };
      if (a.codes == nullptr) {
        launch_for(std::integral_constant<int, kUncoded>{});
      } else if (codes.kind == CodeKind::kInt8) {
        launch_for(std::integral_constant<int, kCodedInt8>{});
      } else {
        // The rotated queries live until the search kernel, queued behind this, has read them
        // (the caching allocator reuses their block only for work queued later on the stream).
        rotated = rotate_queries<scalar_t>(q, codes.grid, a.metric, stream);
        a.rotated = rotated.data_ptr<float>();
        launch_for(std::integral_constant<int, kCodedInt4>{});
      }
    }
  };
  GRNND_DISPATCH_STORAGE(x.scalar_type(), "search_cuda", [&] { launch_storage(static_cast<const scalar_t*>(rows)); });
  if (a.searches > 1) {
    const int per_query = a.searches * p.k;  // <= kMaxMergeKeys (params.h)
    const size_t merge_smem = (sizeof(float) + sizeof(uint32_t)) * static_cast<size_t>(per_query);
    merge_searches_kernel<<<static_cast<unsigned>(nq), kWarpSize, merge_smem, stream>>>(
        part_dists.data_ptr<float>(), part_ids.data_ptr<int64_t>(), a.searches, p.k, out_dists.data_ptr<float>(),
        out_ids.data_ptr<int64_t>());
    check_launch();
  }
  query_check.finish();
  return {out_dists, out_ids};
}

// The checks that read tensor contents (finite queries, graph ids in range) synchronise the host
// once per call and are skipped under CUDA-graph capture (contents_readable); the kernel skips
// out-of-range graph ids and orders NaN distances last either way, so no input reads out of bounds.
std::tuple<at::Tensor, at::Tensor> search_cuda(const at::Tensor& data, const at::Tensor& graph,
                                               const at::Tensor& queries, int64_t k, int64_t list_size,
                                               int64_t search_width, int64_t max_iters, c10::string_view metric,
                                               int64_t seed, const c10::optional<at::Tensor>& filter,
                                               int64_t searches, int64_t hub_entries,
                                               const c10::optional<at::Tensor>& codes,
                                               const c10::optional<at::Tensor>& code_grid) {
  check_search_inputs(data, graph, queries, k, filter);
  const SearchParams p =
      make_search_params(k, list_size, search_width, max_iters, std::string(metric), seed, searches, hub_entries);
  const SearchCodes search_codes = check_search_codes(codes, code_grid, data, queries, p.metric);
  check_search_contents(data, graph, queries);
  return run_search(data, graph, queries, filter, search_codes, p, at::Tensor());
}

at::Tensor search_distance_counts_cuda(const at::Tensor& data, const at::Tensor& graph, const at::Tensor& queries,
                                       int64_t k, int64_t list_size, int64_t search_width, int64_t max_iters,
                                       c10::string_view metric, int64_t seed,
                                       const c10::optional<at::Tensor>& filter, int64_t searches,
                                       int64_t hub_entries, const c10::optional<at::Tensor>& codes,
                                       const c10::optional<at::Tensor>& code_grid) {
  check_search_inputs(data, graph, queries, k, filter);
  const SearchParams p =
      make_search_params(k, list_size, search_width, max_iters, std::string(metric), seed, searches, hub_entries);
  const SearchCodes search_codes = check_search_codes(codes, code_grid, data, queries, p.metric);
  check_search_contents(data, graph, queries);
  at::Tensor counts = at::zeros({queries.size(0)}, queries.options().dtype(at::kInt));
  run_search(data, graph, queries, filter, search_codes, p, counts);
  return counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CUDA, m) {
  m.impl("search", &search_cuda);
  m.impl("search_distance_counts", &search_distance_counts_cuda);
}

}  // namespace cuda
}  // namespace grnnd
