// Exact k nearest neighbours on the GPU: the twin of csrc/cpu/knn_cpu.cpp.
//
// The [Q, N] distance matrix is never materialised. Data is streamed in tiles; for each tile the
// inner products of a block of queries with it come from one tensor-core matrix product
// (float16/bfloat16 operands, float32 accumulation and output, through the caching allocator and
// the current stream), and a selection kernel folds the tile into each query's running best
// `keep` candidates, kept in global memory between tiles. Then the survivors are re-ranked with
// directly computed float32 distances, so rounding in ||x||^2 - 2<q, x> cannot reorder or
// distort the reported neighbours.
//
// Selection (one block per query row of the tile): the running best `keep` sit sorted at the
// front of a shared-memory buffer; the block reads the tile row in coalesced 16-byte chunks and
// appends every score below the current keep-th best. When the buffer overflows it is sorted
// with a bitonic network, which also tightens the threshold, and the scores that found no slot
// (still in registers) try again. After the first chunks the threshold is close to final and
// almost nothing passes, so the scan runs at memory speed.
//
// Operand precision: float16 and bfloat16 rows are used as stored, and their products are exact
// in the float32 accumulator. float32 rows are split into a float16 head and the float16 rounding
// of the remainder (after scaling by a power of two, which is exact, to clear float16's range);
// one product over [head, remainder, head] . [head, head, remainder] then recovers <q, x> to
// about 2^-21 of |q||x| instead of float16's 2^-11, which coarse selection needs on data far from
// the origin, where ||x||^2 - 2<q, x> cancels most of its digits.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <torch/library.h>

#include "../core/checks.h"
#include "detail/sort_cuda.cuh"
#include "detail/vectors_cuda.cuh"

namespace grnnd {
namespace cuda {
namespace {

constexpr int kSelectThreads = 256;
constexpr int kVectorsPerThread = 2;  // 16-byte loads in flight per thread and chunk
constexpr int kScoresPerThread = 4 * kVectorsPerThread;
constexpr int kChunk = kSelectThreads * kScoresPerThread;
constexpr int64_t kTileScores = int64_t{1} << 27;  // 512 MiB of float32 products per tile
// Tiles a multiple of this many data rows: off-size products ran at under half the tensor-core
// rate on the H200 (10000 x 6708 x 384: 170 TFLOP/s; 10000 x 32768 x 384: 436 TFLOP/s).
constexpr int64_t kTileRowMultiple = 256;
constexpr int64_t kMaxQueryBlock = 16384;
constexpr int kRerankThreads = 256;

// Candidates kept past k for the exact re-rank: covers reorderings by the coarse scores' rounding.
int64_t rerank_margin(int64_t k) { return std::max<int64_t>(16, k / 4); }

struct SelectArgs {
  const float* products;  // [rows, n_cols] inner products of this query block with this data tile
  const float* row_term;  // per data row: ||x||^2 for l2, 1/|x| for cosine; null for ip
  Metric metric;
  const float* scale;     // device scalar that undoes the operand scaling, or null
  float* best_d;          // [rows, keep] running best scores of each query, ascending
  uint32_t* best_i;       // [rows, keep] their data ids (kEmptyId before the first tile)
  int64_t col0;           // id of the tile's first data row (a multiple of 4)
  int n_cols;
  int keep;
};

// Sorts the buffer's first `count` keys (the rest padded empty) so its best `keep` are at the
// front, and returns the new threshold. Called by the whole block after a barrier that
// published the appended keys.
__device__ float compact(float* d, uint32_t* id, int count, int keep, int* append_at) {
  const int n = next_pow2(count);
  for (int j = count + threadIdx.x; j < n; j += blockDim.x) {
    d[j] = std::numeric_limits<float>::infinity();
    id[j] = kEmptyId;
  }
  __syncthreads();
  bitonic<false>(d, id, n);
  if (threadIdx.x == 0) *append_at = keep;
  __syncthreads();
  return d[keep - 1];
}

// Ranking score of a data row from its inner product with the query: l2 drops the per-query
// ||q||^2, cosine the constant 1 (the query is unit).
__device__ __forceinline__ float rank_score(float dot, float row_term, Metric metric) {
  return metric == Metric::kL2 ? row_term - 2.0f * dot : metric == Metric::kCosine ? -dot * row_term : -dot;
}

// kVec: rows start on 16-byte boundaries (n_cols % 4 == 0), so each thread loads float4s.
template <int kCap, bool kVec>
__global__ void __launch_bounds__(kSelectThreads) select_tile_kernel(SelectArgs a) {
  __shared__ float s_d[kCap];
  __shared__ uint32_t s_i[kCap];
  __shared__ int s_append_at;  // next free slot; only touched atomically while scanning
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  float* best_d = a.best_d + row * a.keep;
  uint32_t* best_i = a.best_i + row * a.keep;
  for (int j = tid; j < a.keep; j += kSelectThreads) {
    s_d[j] = best_d[j];
    s_i[j] = best_i[j];
  }
  if (tid == 0) s_append_at = a.keep;
  __syncthreads();
  float threshold = s_d[a.keep - 1];
  const float scale = a.scale != nullptr ? *a.scale : 1.0f;
  const float* products = a.products + row * a.n_cols;
  const float* row_term = a.row_term != nullptr ? a.row_term + a.col0 : nullptr;

  for (int base = 0; base < a.n_cols; base += kChunk) {
    // Thread t holds columns base + 4t + 1024v + {0..3}, v < kVectorsPerThread.
    float score[kScoresPerThread];
#pragma unroll
    for (int v = 0; v < kVectorsPerThread; ++v) {
      const int j = base + 4 * tid + 4 * kSelectThreads * v;
      float dot[4], term[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (kVec && j + 3 < a.n_cols) {
        const float4 p = *reinterpret_cast<const float4*>(products + j);
        dot[0] = p.x, dot[1] = p.y, dot[2] = p.z, dot[3] = p.w;
        if (row_term != nullptr) {
          const float4 t = __ldg(reinterpret_cast<const float4*>(row_term + j));
          term[0] = t.x, term[1] = t.y, term[2] = t.z, term[3] = t.w;
        }
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool in = j + e < a.n_cols;
          dot[e] = in ? products[j + e] : 0.0f;
          if (row_term != nullptr && in) term[e] = __ldg(row_term + j + e);
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        score[4 * v + e] = j + e < a.n_cols ? rank_score(dot[e] * scale, term[e], a.metric)
                                            : std::numeric_limits<float>::infinity();
      }
    }
    unsigned pending = 0;
#pragma unroll
    for (int e = 0; e < kScoresPerThread; ++e) pending |= unsigned{score[e] < threshold} << e;
    if (!__syncthreads_or(pending)) continue;  // the common case once the threshold has settled
    while (true) {
#pragma unroll
      for (int e = 0; e < kScoresPerThread; ++e) {
        if (!((pending >> e) & 1u)) continue;
        if (score[e] >= threshold) {
          pending &= ~(1u << e);
          continue;
        }
        const int slot = atomicAdd(&s_append_at, 1);
        if (slot < kCap) {
          const int v = e / 4, j = base + 4 * tid + 4 * kSelectThreads * v + e % 4;
          s_d[slot] = score[e];
          s_i[slot] = static_cast<uint32_t>(a.col0 + j);
          pending &= ~(1u << e);
        }
      }
      if (!__syncthreads_or(pending)) break;
      // Some scores found the buffer full: every slot was claimed and written before the
      // barrier, so sort all kCap, then retry the rest against the tighter threshold.
      threshold = compact(s_d, s_i, kCap, a.keep, &s_append_at);
    }
  }
  __syncthreads();  // also orders the last appends before this read
  const int count = min(s_append_at, kCap);
  if (count > a.keep) compact(s_d, s_i, count, a.keep, &s_append_at);
  for (int j = tid; j < a.keep; j += kSelectThreads) {
    best_d[j] = s_d[j];
    best_i[j] = s_i[j];
  }
}

// Exact float32 distances of each query to its `keep` candidates, sorted; the best k are written.
// One block per query; dynamic shared memory holds `cap` (a power of two >= keep) keys.
template <typename T>
__global__ void __launch_bounds__(kRerankThreads)
    rerank_kernel(const T* __restrict__ x, const T* __restrict__ q, const uint32_t* __restrict__ cand, int keep,
                  int cap, int dim, Metric metric, int k, float* out_d, int64_t* out_i) {
  extern __shared__ unsigned char shared_raw[];
  float* s_d = reinterpret_cast<float*>(shared_raw);
  uint32_t* s_i = reinterpret_cast<uint32_t*>(s_d + cap);
  const int64_t row = blockIdx.x;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const T* query = q + row * dim;
  for (int j = warp; j < cap; j += kRerankThreads / kWarpSize) {  // warp-uniform loop
    const uint32_t id = j < keep ? cand[row * keep + j] : kEmptyId;
    float dist = std::numeric_limits<float>::infinity();
    if (id != kEmptyId) {
      const T* row_x = x + int64_t{id} * dim;
      dist = metric == Metric::kCosine ? team_cosine<kWarpSize>(query, row_x, dim, lane)
                                       : team_distance<kWarpSize>(query, row_x, dim, metric, lane);
    }
    if (lane == 0) {
      s_d[j] = dist;
      s_i[j] = id;
    }
  }
  __syncthreads();
  bitonic<false>(s_d, s_i, cap);
  for (int j = threadIdx.x; j < k; j += kRerankThreads) {
    out_d[row * k + j] = s_d[j];
    out_i[row * k + j] = s_i[j] == kEmptyId ? -1 : int64_t{s_i[j]};
  }
}

// 2^round(-log2(max |x|)): brings the largest magnitude near 1, well inside float16's range.
// The max-norm reduction reads x once, without an |x| temporary the size of the data.
at::Tensor unit_scale(const at::Tensor& x) {
  const at::Tensor largest = at::linalg_vector_norm(x, std::numeric_limits<double>::infinity(), {}, false, at::kFloat);
  return at::exp2(at::round(at::log2(largest.clamp_min(1e-30f))).neg());
}

// The tensor-core operand for rows of `x` (see the top of the file): float16/bfloat16 as stored;
// float32 as [head, remainder, head] (queries) or [head, head, remainder] (data) in float16.
at::Tensor product_operand(const at::Tensor& x, const at::Tensor& scale, bool is_query) {
  if (x.scalar_type() != at::kFloat) return x;
  const at::Tensor scaled = x.mul(scale);
  const at::Tensor head = scaled.to(at::kHalf);
  const at::Tensor rest = scaled.sub(head.to(at::kFloat)).to(at::kHalf);
  return is_query ? at::cat({head, rest, head}, 1) : at::cat({head, head, rest}, 1);
}

template <int kCap>
void launch_select(const SelectArgs& args, int rows, cudaStream_t stream) {
  if (args.n_cols % 4 == 0) {
    select_tile_kernel<kCap, true><<<rows, kSelectThreads, 0, stream>>>(args);
  } else {
    select_tile_kernel<kCap, false><<<rows, kSelectThreads, 0, stream>>>(args);
  }
  check_launch();
}

// The buffer holds the running best and at least as many new candidates again.
void launch_select(const SelectArgs& args, int rows, cudaStream_t stream) {
  if (2 * args.keep <= 512) {
    launch_select<512>(args, rows, stream);
  } else {
    TORCH_INTERNAL_ASSERT(2 * args.keep <= 4096, "knn: selection buffer too small for keep = ", args.keep);
    launch_select<4096>(args, rows, stream);
  }
}

std::tuple<at::Tensor, at::Tensor> knn_cuda(const at::Tensor& data, const at::Tensor& queries, int64_t k,
                                            c10::string_view metric_name) {
  check_knn_inputs(data, queries, k);
  const Metric metric = parse_metric(std::string(metric_name));
  const c10::cuda::CUDAGuard guard(data.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(data.get_device());

  // Raw rows for the re-rank (cosine included, so it sees exactly what the CPU normalises in
  // float32); the product pass uses unit queries and folds 1/|x| into the score instead of
  // normalising a copy of the data.
  const at::Tensor x = prepare_vectors(data, Metric::kL2);
  const at::Tensor q = prepare_vectors(queries.to(x.scalar_type()), Metric::kL2);
  const at::Tensor q_unit = metric == Metric::kCosine ? prepare_vectors(q, Metric::kCosine) : q;
  const int64_t n = x.size(0), nq = q.size(0), dim = x.size(1);
  const int keep = static_cast<int>(std::min(n, k + rerank_margin(k)));

  const auto f32 = x.options().dtype(at::kFloat);
  const bool scaled = x.scalar_type() == at::kFloat;
  const at::Tensor x_scale = scaled ? unit_scale(x) : at::Tensor();
  const at::Tensor q_scale = scaled ? unit_scale(q_unit) : at::Tensor();
  const at::Tensor undo_scale = scaled ? (x_scale * q_scale).reciprocal().to(at::kFloat) : at::Tensor();
  const at::Tensor q_operand = product_operand(q_unit, q_scale, /*is_query=*/true);
  at::Tensor row_term;
  if (metric != Metric::kIP) {
    const at::Tensor norms = at::linalg_vector_norm(x, 2, {1}, false, at::kFloat);  // float32 sums, no copy
    row_term = metric == Metric::kL2 ? norms.square() : norms.clamp_min(1e-30f).reciprocal();
  }

  at::Tensor best_d = at::full({nq, keep}, std::numeric_limits<float>::infinity(), f32);
  at::Tensor best_i = at::full({nq, keep}, static_cast<int64_t>(kEmptyId), x.options().dtype(at::kInt));

  const int64_t query_block = std::min(nq, kMaxQueryBlock);
  // Every tile but the last also gets 16-byte aligned product rows (a multiple of 4 columns).
  const int64_t data_tile =
      std::min(n, std::max(kTileRowMultiple, kTileScores / query_block / kTileRowMultiple * kTileRowMultiple));
  at::Tensor products = at::empty({query_block * data_tile}, f32);

  for (int64_t d0 = 0; d0 < n; d0 += data_tile) {
    const int64_t db = std::min(data_tile, n - d0);
    const at::Tensor x_operand = product_operand(x.narrow(0, d0, db), x_scale, /*is_query=*/false);
    for (int64_t q0 = 0; q0 < nq; q0 += query_block) {
      const int64_t qb = std::min(query_block, nq - q0);
      at::Tensor tile = products.narrow(0, 0, qb * db).view({qb, db});
      at::mm_out(tile, q_operand.narrow(0, q0, qb), x_operand.t(), at::kFloat);
      SelectArgs args;
      args.products = tile.data_ptr<float>();
      args.row_term = row_term.defined() ? row_term.data_ptr<float>() : nullptr;
      args.metric = metric;
      args.scale = scaled ? undo_scale.data_ptr<float>() : nullptr;
      args.best_d = best_d.data_ptr<float>() + q0 * keep;
      args.best_i = reinterpret_cast<uint32_t*>(best_i.data_ptr<int32_t>()) + q0 * keep;
      args.col0 = d0;
      args.n_cols = static_cast<int>(db);
      args.keep = keep;
      launch_select(args, static_cast<int>(qb), stream);
    }
  }

  at::Tensor out_d = at::empty({nq, k}, f32);
  at::Tensor out_i = at::empty({nq, k}, x.options().dtype(at::kLong));
  const int cap = next_pow2(keep);
  const size_t shared = static_cast<size_t>(cap) * (sizeof(float) + sizeof(uint32_t));
  GRNND_DISPATCH_STORAGE(x.scalar_type(), "knn_cuda", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "knn_cuda: float64 storage should have been narrowed by prepare_vectors");
    } else {
      rerank_kernel<scalar_t><<<nq, kRerankThreads, shared, stream>>>(
          x.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
          reinterpret_cast<const uint32_t*>(best_i.data_ptr<int32_t>()), keep, cap, static_cast<int>(dim), metric,
          static_cast<int>(k), out_d.data_ptr<float>(), out_i.data_ptr<int64_t>());
      check_launch();
    }
  });
  return {out_d, out_i};
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CUDA, m) { m.impl("knn", &knn_cuda); }

}  // namespace cuda
}  // namespace grnnd
