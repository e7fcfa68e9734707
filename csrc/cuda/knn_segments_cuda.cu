// Exact k nearest neighbours within segments on the GPU: the twin of
// csrc/cpu/knn_segments_cpu.cpp, for batches of many small examples in one launch (PyTorch
// Geometric's point clouds and graphs; torch_grnnd/pyg.py).
//
// One thread per query, kQueries consecutive queries per block. PyG sorts batch_y, so a block's
// queries fall in one example or two: the block walks the union of their row ranges in tiles of
// kTileRows rows staged in shared memory, where every lane of a warp reads the same row at once
// (a broadcast), and each thread keeps the candidates of its own example only. An unsorted
// batch_y gives the same results; only the union, and so the work, grows. x's examples come as
// ptr or as PyG's sorted batch vector; a query finds its rows in the latter by two binary
// searches (segments.h), so the caller makes no ptr before the launch.
//
// The best k of each query: for k <= 32, sorted in registers (K = 8, 16, 24 or 32 slots, filled
// by an unrolled insertion that never indexes a register array at run time); for larger k, in
// the query's output row, as the CPU keeps them. Both insert a candidate behind those at an
// equal distance, and candidates arrive in row order, so ties go to the lower row. Distances add
// the squared differences in dimension order, each in one fused multiply-add (add_square), the
// CPU kernel's exact arithmetic: both kernels return the same neighbours and bit for bit the
// same distances.
//
// Candidates that beat a query's k-th best wait in a short queue in shared memory and are
// inserted when some thread of the warp has filled its queue. Inserting each accepted candidate
// at once meant a warp ran the insertion at almost every row: late in a scan each thread
// accepts few rows, but one of 32 threads nearly always does, and the insertion (some 150
// instructions for 24 slots) then cost most of a d = 64 distance. The queue holds candidates
// checked against a k-th best that may since have improved; the insertion checks again.
//
// Measured on an H100, 32 clouds x 1024 points, k = 21, the op alone (benchmarks/profile_pyg.py):
// d = 64 0.61 ms before the queue, 0.50 ms with it, 0.43 ms with the fused add as well; d = 3
// 0.28 ms (then a warp-per-query kernel) -> 0.21 ms. One-off timings of the op (not a
// script in benchmarks/): the queued scan also beat that warp per query (lanes scanning 32 rows
// at once) at 512 to 4096 points an example (0.14 / 0.21 / 0.33 / 0.54 ms against 0.16 / 0.23 /
// 0.34 / 0.56 ms at 512 / 1024 / 2048 / 4096), so that kernel is gone; splitting a query's rows
// over 2 or 4 threads (lists merged at the end) made d = 8 to 128 slower (d = 64: 0.74 and 1.14
// ms against 0.61 ms, before the queue and the fused add); with the queue, rows in groups of 8,
// blocks of 32 or 128 queries and queues of 8 or 32 were no faster. ncu of the d = 64 kernel
// with the queue: 163 registers a thread, 1.9 warps a scheduler, 0.64 instructions issued a cycle.
//
// A tile's rows are read into registers while the tile before is scanned, as float4 where the
// rows allow (benchmarks/profile_pyg.py, one H100, the op alone against the kernel before in
// the same run): d = 64 0.41 ms against 0.48, d = 100 0.73 against 0.86, d = 8 0.24 against
// 0.32, d = 3 0.19 against 0.22; 8 clouds x 16 384 points, d = 64: 17.1 against 17.3 ms.
// Splitting a query's dimensions over four lanes (four times the warps, each lane a list of
// its own over a quarter of the rows, merged at the end; the CPU's sum in the same four
// parts) was slower at every d: at d = 64, 0.58 ms against 0.43 (32 x 1024) and 24.4 against
// 16.7 ms (8 x 16 384); ncu counted 335M instructions against 234M, the lists' insertions
// most of the difference.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <limits>

#include <torch/library.h>

#include "../core/checks.h"
#include "../pyg/grid.h"
#include "detail/top_k_cuda.cuh"
#include "detail/vectors_cuda.cuh"

namespace grnnd {
namespace cuda {
namespace {

constexpr int kQueries = 64;   // threads per block, one query each
constexpr int kTileRows = 32;  // candidate rows per shared-memory tile
constexpr int kRowGroup = 4;   // rows whose distances are computed before any is inserted
constexpr int kWideChunk = 64;  // dimensions per pass of the widest variant
constexpr int kMaxRegisterK = 32;
constexpr int kQueue = 16;  // queued candidates per query; flushed before a row group can overflow it

// The best K in registers, equal distances in the order rows are scanned (top_k_cuda.cuh).
template <int K>
using RegisterBest = RegisterTopK<K, /*ROW_TIES=*/false>;

// The best k kept in the output row itself (initialised to +inf / -1), for k > kMaxRegisterK.
struct RowBest {
  float* d;
  int64_t* i;
  int k;
  float worst_;  // d[k - 1], kept in a register

  // A thread past the last query has no row: it gets worst = -inf and so never inserts.
  __device__ void init() { worst_ = d != nullptr ? d[k - 1] : -std::numeric_limits<float>::infinity(); }

  __device__ __forceinline__ float worst() const { return worst_; }

  __device__ __forceinline__ void insert(float dist, int32_t row) {
    if (!(dist < worst_)) return;
    int p = k - 1;
    for (; p > 0 && d[p - 1] > dist; --p) {
      d[p] = d[p - 1];
      i[p] = i[p - 1];
    }
    d[p] = dist;
    i[p] = row;
    worst_ = d[k - 1];
  }

  __device__ void store(float*, int64_t*, int) const {}
};

struct SegmentArgs {
  const float* x;        // [nx, dim]
  const float* y;        // [ny, dim]
  const int64_t* ptr;    // [examples + 1], or null where x's examples come as batch_x
  const int64_t* batch_x;  // [nx] ascending, or null where they come as ptr
  const int64_t* batch;  // [ny]
  int64_t nx, ny, examples;
  int dim, k;
  bool rows_aligned;  // dim % 4 == 0 and x 16-byte aligned: rows are read as float4
  float* out_d;    // [ny, k]; +inf filled for RowBest
  int64_t* out_i;  // [ny, k]; -1 filled for RowBest

  __device__ SegmentRange rows_of(int64_t example) const {
    return ptr != nullptr ? segment_range(ptr, examples, nx, example)
                          : segment_range_in_batch(batch_x, nx, examples, example);
  }
};

// kDimChunk: dimensions staged per pass (a multiple of 4); the query's share of them sits in
// registers. Best: RegisterBest<K> or RowBest.
template <int kDimChunk, typename Best>
__global__ void __launch_bounds__(kQueries) knn_segments_kernel(SegmentArgs a) {
  static_assert(kDimChunk % 4 == 0, "tile rows are read as float4");
  static_assert(kTileRows % kRowGroup == 0, "tiles are walked in groups of rows");
  // Only the widest variant meets rows of more than one pass; it keeps each thread's sums of the
  // passes so far per tile row (a column per thread: no bank conflicts).
  constexpr bool kPasses = kDimChunk == kWideChunk;
  __shared__ float4 tile[kTileRows][kDimChunk / 4];
  __shared__ float partial[kPasses ? kTileRows : 1][kQueries];
  __shared__ float queue_d[kQueue][kQueries];
  __shared__ int32_t queue_i[kQueue][kQueries];
  __shared__ unsigned long long s_begin, s_end;
  const int64_t query = static_cast<int64_t>(blockIdx.x) * kQueries + threadIdx.x;
  const SegmentRange own =
      query < a.ny ? a.rows_of(a.batch[query]) : SegmentRange{0, 0};

  if (threadIdx.x == 0) {
    s_begin = ULLONG_MAX;
    s_end = 0;
  }
  __syncthreads();
  if (own.end > own.begin) {
    atomicMin(&s_begin, static_cast<unsigned long long>(own.begin));
    atomicMax(&s_end, static_cast<unsigned long long>(own.end));
  }
  __syncthreads();
  // No thread of the block has a candidate (block-uniform): the loop below does not run, and
  // every query stores an empty list.
  const bool any_rows = s_begin < s_end;
  const int64_t begin = any_rows ? static_cast<int64_t>(s_begin) : 0, end = any_rows ? static_cast<int64_t>(s_end) : 0;

  Best best;
  if constexpr (std::is_same_v<Best, RowBest>) {
    best.d = query < a.ny ? a.out_d + query * a.k : nullptr;
    best.i = query < a.ny ? a.out_i + query * a.k : nullptr;
    best.k = a.k;
  }
  best.init();

  const float* q_row = a.y + (query < a.ny ? query : 0) * a.dim;
  const bool one_pass = a.dim <= kDimChunk;
  float q[kDimChunk];
  auto load_query = [&](int j0) {
#pragma unroll
    for (int j = 0; j < kDimChunk; ++j) q[j] = j0 + j < a.dim ? q_row[j0 + j] : 0.0f;
  };
  if (one_pass) load_query(0);
  int queued = 0;
  auto flush = [&]() {
    for (int c = 0; c < queued; ++c) best.insert(queue_d[c][threadIdx.x], queue_i[c][threadIdx.x]);
    queued = 0;
  };

  // The tiles' passes in order, each read from memory into registers (`next`) while the one
  // before is being scanned, then stored to shared memory: the loads' latency hides behind the
  // scan. Rows of a multiple of 4 floats at a 16-byte aligned address are read as float4.
  constexpr int kTile4 = kTileRows * kDimChunk / 4;  // float4 slots of a tile
  constexpr int kStaged = (kTile4 + kQueries - 1) / kQueries;
  float4 next[kStaged];
  auto fetch = [&](int64_t t0, int j0) {
#pragma unroll
    for (int s = 0; s < kStaged; ++s) {
      const int e4 = threadIdx.x + s * kQueries;
      const int64_t row = t0 + e4 / (kDimChunk / 4);
      const int j = j0 + 4 * (e4 % (kDimChunk / 4));
      const float* from = a.x + row * a.dim + j;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (e4 < kTile4 && row < end && j < a.dim) {
        if (a.rows_aligned) {
          v = __ldg(reinterpret_cast<const float4*>(from));
        } else {
          v.x = __ldg(from);
          if (j + 1 < a.dim) v.y = __ldg(from + 1);
          if (j + 2 < a.dim) v.z = __ldg(from + 2);
          if (j + 3 < a.dim) v.w = __ldg(from + 3);
        }
      }
      next[s] = v;
    }
  };
  if (begin < end) fetch(begin, 0);

  for (int64_t t0 = begin; t0 < end; t0 += kTileRows) {
    const int rows_here = static_cast<int>(std::min<int64_t>(kTileRows, end - t0));
    for (int j0 = 0; j0 < a.dim; j0 += kDimChunk) {
      if (!one_pass) load_query(j0);
      __syncthreads();  // the previous pass is done reading the tile
#pragma unroll
      for (int s = 0; s < kStaged; ++s) {
        const int e4 = threadIdx.x + s * kQueries;
        if (e4 < kTile4) tile[e4 / (kDimChunk / 4)][e4 % (kDimChunk / 4)] = next[s];
      }
      __syncthreads();
      if (j0 + kDimChunk < a.dim) {
        fetch(t0, j0 + kDimChunk);
      } else if (t0 + kTileRows < end) {
        fetch(t0 + kTileRows, 0);
      }
      const bool first = j0 == 0, last = j0 + kDimChunk >= a.dim;
      // A group of rows at a time: their distances are independent chains the scheduler can
      // interleave. Padding adds (0 - 0)^2 = +0 after the real dimensions, which leaves each sum
      // as it was; rows past rows_here are outside every thread's example.
      for (int r0 = 0; r0 < rows_here; r0 += kRowGroup) {
        float d[kRowGroup];
#pragma unroll
        for (int g = 0; g < kRowGroup; ++g) {
          d[g] = first ? 0.0f : partial[kPasses ? r0 + g : 0][threadIdx.x];
#pragma unroll
          for (int j = 0; j < kDimChunk / 4; ++j) {
            const float4 v = tile[r0 + g][j];
            d[g] = add_square(d[g], q[4 * j], v.x);
            d[g] = add_square(d[g], q[4 * j + 1], v.y);
            d[g] = add_square(d[g], q[4 * j + 2], v.z);
            d[g] = add_square(d[g], q[4 * j + 3], v.w);
          }
        }
        if (!last) {
#pragma unroll
          for (int g = 0; g < kRowGroup; ++g) partial[kPasses ? r0 + g : 0][threadIdx.x] = d[g];
          continue;
        }
        // Most candidates lose to the current k-th best; the rest are queued, in row order.
#pragma unroll
        for (int g = 0; g < kRowGroup; ++g) {
          const int64_t row = t0 + r0 + g;
          if (row >= own.begin && row < own.end && d[g] < best.worst()) {
            queue_d[queued][threadIdx.x] = d[g];
            queue_i[queued][threadIdx.x] = static_cast<int32_t>(row);
            ++queued;
          }
        }
        if (__any_sync(kFullMask, queued > kQueue - kRowGroup)) flush();
      }
    }
  }
  flush();
  if (query < a.ny) best.store(a.out_d + query * a.k, a.out_i + query * a.k, a.k);
}

template <int kDimChunk>
void launch_for_k(const SegmentArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((args.ny + kQueries - 1) / kQueries));
  if (args.k <= 8) {
    knn_segments_kernel<kDimChunk, RegisterBest<8>><<<grid, kQueries, 0, stream>>>(args);
  } else if (args.k <= 16) {
    knn_segments_kernel<kDimChunk, RegisterBest<16>><<<grid, kQueries, 0, stream>>>(args);
  } else if (args.k <= 24) {  // k = 20 (DGCNN) and knn_graph's k + 1 for k = 16
    knn_segments_kernel<kDimChunk, RegisterBest<24>><<<grid, kQueries, 0, stream>>>(args);
  } else if (args.k <= kMaxRegisterK) {
    knn_segments_kernel<kDimChunk, RegisterBest<kMaxRegisterK>><<<grid, kQueries, 0, stream>>>(args);
  } else {
    knn_segments_kernel<kDimChunk, RowBest><<<grid, kQueries, 0, stream>>>(args);
  }
  check_launch();
}

std::tuple<at::Tensor, at::Tensor> knn_segments_cuda(const at::Tensor& x, const at::Tensor& y,
                                                     const c10::optional<at::Tensor>& ptr_x, const at::Tensor& batch_y,
                                                     int64_t k, c10::string_view method,
                                                     const c10::optional<at::Tensor>& batch_x, int64_t examples) {
  const SegmentsOfX segments = check_knn_segments_inputs(x, y, ptr_x, batch_y, k, batch_x, examples);
  TORCH_CHECK_VALUE(k < std::numeric_limits<int>::max(), "k: expected fewer than 2^31 - 1, got ", k);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const at::Tensor xs = x.contiguous(), ys = y.contiguous();
  const at::Tensor batch = batch_y.contiguous();
  if (ys.size(0) > 0 && xs.size(0) > 0 && use_grid(std::string(method), xs, segments.examples, k)) {
    const Grid grid = make_grid(xs, segments.as_ptr());
    if (grid.valid) return knn_grid_cuda(grid, ys, batch, segments.examples, k);
    TORCH_CHECK_VALUE(method != "grid", "knn_segments: method=\"grid\" needs ascending ptr_x");
  }
  // The register lists store all k slots of every query, padding included; a list kept in the
  // output row (k > kMaxRegisterK) starts from the padding. Two fills fewer on the common path.
  const bool kernel_fills = k <= kMaxRegisterK && ys.size(0) > 0 && xs.size(0) > 0;
  at::Tensor out_d = kernel_fills ? at::empty({ys.size(0), k}, ys.options())
                                  : at::full({ys.size(0), k}, std::numeric_limits<float>::infinity(), ys.options());
  at::Tensor out_i = kernel_fills ? at::empty({ys.size(0), k}, ys.options().dtype(at::kLong))
                                  : at::full({ys.size(0), k}, -1, ys.options().dtype(at::kLong));
  if (ys.size(0) == 0 || xs.size(0) == 0) return {out_d, out_i};

  SegmentArgs args;
  args.x = xs.data_ptr<float>();
  args.y = ys.data_ptr<float>();
  // x's examples as given: no ptr is made from a batch vector (segments.h, segment_range_in_batch).
  args.ptr = segments.ptr.defined() ? segments.ptr.data_ptr<int64_t>() : nullptr;
  args.batch_x = segments.batch.defined() ? segments.batch.data_ptr<int64_t>() : nullptr;
  args.batch = batch.data_ptr<int64_t>();
  args.nx = xs.size(0);
  args.ny = ys.size(0);
  args.examples = segments.examples;
  args.dim = static_cast<int>(xs.size(1));
  args.k = static_cast<int>(k);
  args.rows_aligned = args.dim % 4 == 0 && reinterpret_cast<uintptr_t>(args.x) % 16 == 0;
  args.out_d = out_d.data_ptr<float>();
  args.out_i = out_i.data_ptr<int64_t>();
  // Point clouds (3 to 6 coordinates), small features, and wide features in passes of 64.
  if (args.dim <= 4) {
    launch_for_k<4>(args, stream);
  } else if (args.dim <= 16) {
    launch_for_k<16>(args, stream);
  } else {
    launch_for_k<kWideChunk>(args, stream);
  }
  return {out_d, out_i};
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CUDA, m) { m.impl("knn_segments", &knn_segments_cuda); }

}  // namespace cuda
}  // namespace grnnd
