// Nearest hubs on the GPU (hubs.h): the selection of the k smallest scores of each row, from a
// chunk of dot products (smallest_scores_cuda) or straight from the rows and hubs, the scores
// never leaving registers (nearest_hubs_fused_cuda).
//
// Why the selection: the build assigns all N rows to their two nearest of N / 1000 hubs, an
// [N, N / 1000] score matrix made chunk by chunk. Scaling it, adding the hub terms and selecting
// with at::topk read and wrote that matrix four times over, and the radix select of at::topk is
// made for large k: at 4M x 384 rows (H100) the scaling and selection took 0.37 s of a 1.9 s
// build, and they grow as N^2. Here each row is read once: a warp per row keeps its k smallest as
// one list across its lanes and inserts only the columns that beat the list's k-th
// (smallest_scores_kernel).
//
// Why the fused product: even read once, the scores are written by the matrix product and read
// back, 4 bytes per (row, hub) pair each way: 10M x 128 float16 rows against 10 000 hubs took
// 0.33 s of a 3.7 s build (0.16 s the product, 0.17 s the selection, one H100), the product
// itself a few hundredths of that. The fused kernel multiplies a tile of 128 rows with a tile of
// 128 hubs on tensor cores (mma.sync m16n8k16, float32 accumulation, as at::mm does for half
// rows) and each thread folds the scores it holds into its rows' k smallest right away.
#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "../build/hubs.h"
#include "detail/mma_cuda.cuh"
#include "detail/sort_cuda.cuh"

namespace grnnd {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;

// (score, column) order: smaller score first, the lower column among equal scores.
__device__ __forceinline__ bool before(float a, int32_t ca, float b, int32_t cb) {
  return a < b || (a == b && ca < cb);
}

// A score as the lists rank it: NaN and +inf (from a non-finite query, which the search rejects
// only after its kernels are queued) become the largest finite float, so that a row still keeps
// k real columns and the ids gathered with them stay in range. One instruction (fminf returns
// the number when one operand is NaN).
__device__ __forceinline__ float rankable(float score) { return fminf(score, FLT_MAX); }

// (score, column) into a list of K kept ascending by `before`.
template <int K>
__device__ __forceinline__ void keep_smallest(float (&best)[K], int32_t (&column)[K], float score, int32_t c) {
  if (!before(score, c, best[K - 1], column[K - 1])) return;
  best[K - 1] = score;
  column[K - 1] = c;
#pragma unroll
  for (int j = K - 1; j > 0; --j) {
    if (before(best[j], column[j], best[j - 1], column[j - 1])) {
      const float s = best[j];
      best[j] = best[j - 1];
      best[j - 1] = s;
      const int32_t u = column[j];
      column[j] = column[j - 1];
      column[j - 1] = u;
    }
  }
}

// The pair (value[s], column[s]) of the lane whose slot s holds `position` of a warp's list
// (position = s * kWarp + lane), broadcast to all lanes; `position` is the same on every lane.
template <int Slots>
__device__ __forceinline__ void pair_at(const float (&value)[Slots], const int32_t (&column)[Slots], int position,
                                        float& v, int32_t& c) {
  float mine = value[0];
  int32_t mine_column = column[0];
#pragma unroll
  for (int s = 1; s < Slots; ++s) {
    if (position / kWarp == s) {  // a register array is indexed by constants only
      mine = value[s];
      mine_column = column[s];
    }
  }
  v = __shfl_sync(0xffffffffu, mine, position % kWarp);
  c = __shfl_sync(0xffffffffu, mine_column, position % kWarp);
}

// (v, c), the same on every lane, into the warp's ascending list: the pairs after it move one
// position up (the last falls off), each taking its predecessor's through a shuffle.
template <int Slots>
__device__ __forceinline__ void insert_pair(float (&value)[Slots], int32_t (&column)[Slots], float v, int32_t c) {
  const int lane = threadIdx.x % kWarp;
  int at = 0;  // pairs before (v, c)
#pragma unroll
  for (int s = 0; s < Slots; ++s) at += __popc(__ballot_sync(0xffffffffu, before(value[s], column[s], v, c)));
  float from_value[Slots];
  int32_t from_column[Slots];
#pragma unroll
  for (int s = 0; s < Slots; ++s) {  // the pair at position - 1: the lane below, or the last lane of the slot below
    from_value[s] = __shfl_up_sync(0xffffffffu, value[s], 1);
    from_column[s] = __shfl_up_sync(0xffffffffu, column[s], 1);
    if (s > 0) {
      const float v_below = __shfl_sync(0xffffffffu, value[s - 1], kWarp - 1);
      const int32_t c_below = __shfl_sync(0xffffffffu, column[s - 1], kWarp - 1);
      if (lane == 0) {
        from_value[s] = v_below;
        from_column[s] = c_below;
      }
    }
  }
#pragma unroll
  for (int s = 0; s < Slots; ++s) {
    const int position = s * kWarp + lane;
    if (position == at) {
      value[s] = v;
      column[s] = c;
    } else if (position > at) {
      value[s] = from_value[s];
      column[s] = from_column[s];
    }
  }
}

constexpr int kRoundsPerLoad = 4;  // rounds of 32 columns whose scores a lane loads before it compares

// out[r, 0..k) = columns of the k smallest weight[c] * dots[r, c] + bias[c]
// (+ row_lift[r] * lift_coef[c] when lifted) over c < h, ascending by (score, column). A warp per
// row keeps the k smallest so far as one list sorted across its lanes (position s * 32 + lane in
// the lane's slot s; Slots * 32 >= k). A round scores 32 columns, one a lane; the few that come
// before the list's k-th pair are inserted one after another (insert_pair), so a round without
// one costs a load, a multiply-add, a comparison and a vote. A row of h columns has about
// k (1 + ln(h / k)) such columns, where per-lane lists of k (the former design) sorted nearly
// every column into a lane's registers. HubRows: hub_rows_out[r, 0..k) gets the rows of those
// hubs of hub_rows_of rows instead (hub_row).
template <int Slots, bool HubRows>
__global__ void __launch_bounds__(kWarp * kWarpsPerBlock)
    smallest_scores_kernel(const float* __restrict__ dots, int64_t m, int32_t h, const float* __restrict__ weight,
                           const float* __restrict__ bias, const float* __restrict__ row_lift,
                           const float* __restrict__ lift_coef, int k, int64_t* __restrict__ out, int64_t hub_rows_of,
                           int32_t* __restrict__ hub_rows_out) {
  const int lane = threadIdx.x % kWarp;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (r >= m) return;  // whole warps leave together
  float value[Slots];
  int32_t column[Slots];
#pragma unroll
  for (int s = 0; s < Slots; ++s) {
    value[s] = INFINITY;
    column[s] = INT32_MAX;
  }
  float bar = INFINITY;  // the list's pair at position k - 1, which a new column must come before
  int32_t bar_column = INT32_MAX;
  const float* row = dots + r * h;
  const float lift = row_lift != nullptr ? row_lift[r] : 0.0f;
  for (int32_t start = 0; start < h; start += kWarp * kRoundsPerLoad) {
    float score[kRoundsPerLoad];
#pragma unroll
    for (int i = 0; i < kRoundsPerLoad; ++i) {
      const int32_t c = start + i * kWarp + lane;
      score[i] = INFINITY;
      if (c < h) {
        float s = fmaf(weight[c], row[c], bias[c]);
        if (row_lift != nullptr) s = fmaf(lift, lift_coef[c], s);
        score[i] = rankable(s);
      }
    }
#pragma unroll
    for (int i = 0; i < kRoundsPerLoad; ++i) {
      const int32_t c = start + i * kWarp + lane;
      unsigned pending = __ballot_sync(0xffffffffu, c < h && before(score[i], c, bar, bar_column));
      while (pending != 0) {
        const int from = __ffs(pending) - 1;
        pending &= pending - 1;
        const float v = __shfl_sync(0xffffffffu, score[i], from);
        const int32_t vc = start + i * kWarp + from;
        if (!before(v, vc, bar, bar_column)) continue;  // an insertion of this round raised the bar
        insert_pair<Slots>(value, column, v, vc);
        pair_at<Slots>(value, column, k - 1, bar, bar_column);
      }
    }
  }
#pragma unroll
  for (int s = 0; s < Slots; ++s) {
    const int position = s * kWarp + lane;
    if (position < k) {
      if constexpr (HubRows) {
        hub_rows_out[r * k + position] = static_cast<int32_t>(hub_row(column[s], hub_rows_of, h));
      } else {
        out[r * k + position] = column[s];
      }
    }
  }
}

template <int Slots>
void launch(const at::Tensor& dots, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& row_lift,
            const at::Tensor& lift_coef, at::Tensor& out, int64_t hub_rows_of) {
  const int64_t m = dots.size(0);
  const unsigned blocks = static_cast<unsigned>((m + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const bool rows_out = hub_rows_of > 0;
  const auto kernel = rows_out ? smallest_scores_kernel<Slots, true> : smallest_scores_kernel<Slots, false>;
  kernel<<<blocks, kWarp * kWarpsPerBlock, 0, c10::cuda::getCurrentCUDAStream(dots.device().index())>>>(
      dots.data_ptr<float>(), m, static_cast<int32_t>(dots.size(1)), weight.data_ptr<float>(), bias.data_ptr<float>(),
      row_lift.defined() ? row_lift.data_ptr<float>() : nullptr,
      lift_coef.defined() ? lift_coef.data_ptr<float>() : nullptr, static_cast<int>(out.size(1)),
      rows_out ? nullptr : out.data_ptr<int64_t>(), hub_rows_of, rows_out ? out.data_ptr<int32_t>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

constexpr int kGatherThreads = 128;

// Row hub_row(j, n, hubs) of x copied to hub_rows[j], a block per hub j, with the hub's terms of
// the ranking's score weight[j] * <q, hub> + bias[j] (nearest_hubs' terms) from its squared norm
// in float32.
template <typename T>
__global__ void __launch_bounds__(kGatherThreads)
    gather_hubs_kernel(const T* __restrict__ x, int64_t n, int dim, int32_t hubs, Metric ranking,
                       T* __restrict__ hub_rows, float* __restrict__ weight, float* __restrict__ bias) {
  const int32_t j = blockIdx.x;
  const T* row = x + hub_row(j, n, hubs) * dim;
  T* out = hub_rows + static_cast<int64_t>(j) * dim;
  float squares = 0.0f;
  for (int c = threadIdx.x; c < dim; c += kGatherThreads) {
    const T v = row[c];
    out[c] = v;
    const float f = static_cast<float>(v);
    squares = fmaf(f, f, squares);
  }
  __shared__ float warp_sums[kGatherThreads / kWarp];
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
  if (threadIdx.x % kWarp == 0) warp_sums[threadIdx.x / kWarp] = squares;
  __syncthreads();
  if (threadIdx.x != 0) return;
  float norm2 = 0.0f;
#pragma unroll
  for (int w = 0; w < kGatherThreads / kWarp; ++w) norm2 += warp_sums[w];
  switch (ranking) {
    case Metric::kL2:
      weight[j] = -2.0f;
      bias[j] = norm2;
      break;
    case Metric::kIP:
      weight[j] = -1.0f;
      bias[j] = 0.0f;
      break;
    case Metric::kCosine:
      weight[j] = -1.0f / fmaxf(sqrtf(norm2), 1e-30f);
      bias[j] = 0.0f;
      break;
  }
}


// ---- The fused product ----------------------------------------------------------------------
//
// A block of 8 warps takes 128 rows and walks all hubs 128 at a time, 32 coordinates a stage,
// with kFusedStages - 1 stages of copies (cp.async) in flight behind the one being multiplied.
// Warp w computes rows 32 (w % 4) .. +32 against hubs 64 (w / 4) .. +64 of the tile: 2 x 8 mma
// tiles of 16 x 8. A thread's accumulators hold rows g, g + 8, g + 16, g + 24 of its warp's 32
// (g = lane / 4) and, of each mma tile, columns 2t and 2t + 1 (t = lane % 4) (PTX ISA, "Matrix
// fragments for mma.m16n8k16"), so each thread keeps the k smallest of the columns it sees for
// each of its four rows; at the end the four lanes of a row and the two warps of a row merge
// theirs.
constexpr int kFusedRows = 128;   // rows a block
constexpr int kFusedHubs = 128;   // hubs a tile
constexpr int kFusedDepth = 32;   // coordinates a stage
constexpr int kFusedStride = kFusedDepth + 8;  // shared row stride in elements: 80 bytes, so
                                               // the fragments' 32-bit loads hit 32 banks
constexpr int kFusedStages = 4;
constexpr int kFusedThreads = 256;
constexpr int kFusedSlots = 4;    // rows a thread holds
constexpr size_t kFusedStageBytes = static_cast<size_t>(kFusedRows + kFusedHubs) * kFusedStride * sizeof(uint16_t);
constexpr size_t kFusedSharedBytes = kFusedStages * kFusedStageBytes;  // 80 KiB: two blocks an SM

// 16 bytes from global to shared memory without passing through registers; zeros where !valid.
__device__ __forceinline__ void copy_16_bytes(void* to, const void* from, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(to));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(from), "r"(valid ? 16 : 0));
#else
  __trap();
#endif
}

__device__ __forceinline__ void copies_committed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most PENDING committed groups of this thread's copies are still in flight.
template <int PENDING>
__device__ __forceinline__ void copies_landed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
#endif
}

// weight, bias (and lift_coef) are padded to whole tiles, the padding's bias +inf (ranked as the
// largest finite score, after every real column, as k <= h): no column past h reaches the output,
// and the epilogue needs no bounds test.
template <typename T, int K, bool LIFT>
__global__ void __launch_bounds__(kFusedThreads, 2)
    fused_nearest_kernel(const T* __restrict__ rows, int64_t m, const T* __restrict__ hubs, int32_t h, int d,
                         const float* __restrict__ weight, const float* __restrict__ bias,
                         const float* __restrict__ row_lift, const float* __restrict__ lift_coef, int k,
                         int64_t* __restrict__ out) {
  static_assert(sizeof(T) == 2, "the fused product takes 16-bit rows");
  // Elements as raw 16-bit words (at::Half and at::BFloat16 have constructors): stage s holds
  // row_tile(s) [kFusedRows][kFusedStride], then hub_tile(s) [kFusedHubs][kFusedStride].
  extern __shared__ __align__(16) uint16_t stage_memory[];
  const auto row_tile = [&](int stage) { return stage_memory + stage * (kFusedStageBytes / sizeof(uint16_t)); };
  const auto hub_tile = [&](int stage) { return row_tile(stage) + kFusedRows * kFusedStride; };
  __shared__ float merge_best[kFusedRows][K];
  __shared__ int32_t merge_column[kFusedRows][K];

  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int g = lane / 4, t = lane % 4;
  const int warp_row = 32 * (warp % 4), warp_hub = 64 * (warp / 4);
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kFusedRows;

  // Stage `it` of the walk: hub tile it / depth_steps, coordinates (it % depth_steps) * 32 on.
  // Each thread copies 2 of the 512 16-byte pieces of each operand; pieces past the rows, the
  // hubs or the coordinates (d is a multiple of 8) are zeros. Past the last stage a thread
  // commits an empty group, so that group i is always stage i.
  const int depth_steps = (d + kFusedDepth - 1) / kFusedDepth;
  const int64_t stages = static_cast<int64_t>((h + kFusedHubs - 1) / kFusedHubs) * depth_steps;
  const auto load_stage = [&](int64_t it) {
    if (it < stages) {
      const int64_t first_hub = (it / depth_steps) * kFusedHubs;
      const int depth = static_cast<int>(it % depth_steps) * kFusedDepth;
      uint16_t* row_to = row_tile(static_cast<int>(it % kFusedStages));
      uint16_t* hub_to = hub_tile(static_cast<int>(it % kFusedStages));
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int piece = tid + i * kFusedThreads;
        const int r = piece / 4, at = (piece % 4) * 8, col = depth + at;
        const int64_t row = first_row + r, hub = first_hub + r;
        const bool row_valid = col < d && row < m, hub_valid = col < d && hub < h;
        copy_16_bytes(row_to + r * kFusedStride + at, row_valid ? rows + row * d + col : rows, row_valid);
        copy_16_bytes(hub_to + r * kFusedStride + at, hub_valid ? hubs + hub * d + col : hubs, hub_valid);
      }
    }
    copies_committed();
  };

  float best[kFusedSlots][K];
  int32_t column[kFusedSlots][K];
  float lift[kFusedSlots];
#pragma unroll
  for (int s = 0; s < kFusedSlots; ++s) {
    const int64_t row = first_row + warp_row + 8 * s + g;
    lift[s] = LIFT && row < m ? row_lift[row] : 0.0f;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      best[s][j] = INFINITY;
      column[s][j] = INT32_MAX;
    }
  }
  float acc[2][8][4];
#pragma unroll
  for (int s = 0; s + 1 < kFusedStages; ++s) load_stage(s);
  for (int64_t it = 0; it < stages; ++it) {
    if (it % depth_steps == 0) {  // a new tile of hubs
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
    }
    // Stage it has landed for every thread, and every warp is done with stage it - 1, whose
    // buffer the copies of stage it + kFusedStages - 1 refill.
    copies_landed<kFusedStages - 2>();
    __syncthreads();
    load_stage(it + kFusedStages - 1);
    const uint16_t* row_from = row_tile(static_cast<int>(it % kFusedStages));
    const uint16_t* hub_from = hub_tile(static_cast<int>(it % kFusedStages));
#pragma unroll
    for (int kk = 0; kk < kFusedDepth; kk += 16) {
      uint32_t a[2][4], b[8][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const uint16_t* top = row_from + (warp_row + 16 * mt + g) * kFusedStride + kk + 2 * t;
        const uint16_t* bottom = top + 8 * kFusedStride;
        a[mt][0] = *reinterpret_cast<const uint32_t*>(top);
        a[mt][1] = *reinterpret_cast<const uint32_t*>(bottom);
        a[mt][2] = *reinterpret_cast<const uint32_t*>(top + 8);
        a[mt][3] = *reinterpret_cast<const uint32_t*>(bottom + 8);
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const uint16_t* hub = hub_from + (warp_hub + 8 * nt + g) * kFusedStride + kk + 2 * t;
        b[nt][0] = *reinterpret_cast<const uint32_t*>(hub);
        b[nt][1] = *reinterpret_cast<const uint32_t*>(hub + 8);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) mma_16x8x16<T>(acc[mt][nt], a[mt], b[nt]);
    }

    if (it % depth_steps == depth_steps - 1) {
      // The tile's dot products are complete: fold them into the rows' lists.
      // A thread meets its columns in increasing order, so a strict comparison keeps the lower
      // column among equal scores, as `before` does.
      const int64_t first_hub = (it / depth_steps) * kFusedHubs + warp_hub + 2 * t;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t c = first_hub + 8 * nt + e;
          const float w = __ldg(weight + c), b0 = __ldg(bias + c), coef = LIFT ? __ldg(lift_coef + c) : 0.0f;
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int s = 2 * mt + half;  // rows g + 8 s of the warp's 32
              float score = fmaf(w, acc[mt][nt][2 * half + e], b0);
              if (LIFT) score = fmaf(lift[s], coef, score);
              score = rankable(score);
              if (score < best[s][K - 1]) keep_smallest<K>(best[s], column[s], score, static_cast<int32_t>(c));
            }
          }
        }
      }
    }
  }

  // The four lanes of a row (t = 0..3) merge their lists, then the two warps of a row.
#pragma unroll
  for (int s = 0; s < kFusedSlots; ++s) {
#pragma unroll
    for (int offset = 1; offset <= 2; offset *= 2) {
      float theirs[K];
      int32_t their_column[K];
#pragma unroll
      for (int j = 0; j < K; ++j) {
        theirs[j] = __shfl_xor_sync(0xffffffffu, best[s][j], offset);
        their_column[j] = __shfl_xor_sync(0xffffffffu, column[s][j], offset);
      }
#pragma unroll
      for (int j = 0; j < K; ++j) keep_smallest<K>(best[s], column[s], theirs[j], their_column[j]);
    }
  }
  if (warp_hub != 0 && t == 0) {
#pragma unroll
    for (int s = 0; s < kFusedSlots; ++s) {
#pragma unroll
      for (int j = 0; j < K; ++j) {
        merge_best[warp_row + 8 * s + g][j] = best[s][j];
        merge_column[warp_row + 8 * s + g][j] = column[s][j];
      }
    }
  }
  __syncthreads();
  if (warp_hub != 0 || t != 0) return;
#pragma unroll
  for (int s = 0; s < kFusedSlots; ++s) {
    const int r = warp_row + 8 * s + g;
    const int64_t row = first_row + r;
    if (row >= m) continue;
#pragma unroll
    for (int j = 0; j < K; ++j) keep_smallest<K>(best[s], column[s], merge_best[r][j], merge_column[r][j]);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      if (j < k) out[row * k + j] = column[s][j];
    }
  }
}

template <typename T, int K, bool LIFT>
void launch_fused(const at::Tensor& rows, const at::Tensor& hubs, const at::Tensor& weight, const at::Tensor& bias,
                  const at::Tensor& row_lift, const at::Tensor& lift_coef, at::Tensor& out) {
  const int64_t m = rows.size(0);
  const unsigned blocks = static_cast<unsigned>((m + kFusedRows - 1) / kFusedRows);
  const auto kernel = fused_nearest_kernel<T, K, LIFT>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kFusedSharedBytes)));
  kernel<<<blocks, kFusedThreads, kFusedSharedBytes, c10::cuda::getCurrentCUDAStream(rows.device().index())>>>(
      rows.data_ptr<T>(), m, hubs.data_ptr<T>(), static_cast<int32_t>(hubs.size(0)), static_cast<int>(rows.size(1)),
      weight.data_ptr<float>(), bias.data_ptr<float>(), LIFT ? row_lift.data_ptr<float>() : nullptr,
      LIFT ? lift_coef.data_ptr<float>() : nullptr, static_cast<int>(out.size(1)), out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int K>
void launch_fused_lifted_or_not(const at::Tensor& rows, const at::Tensor& hubs, const at::Tensor& weight,
                                const at::Tensor& bias, const at::Tensor& row_lift, const at::Tensor& lift_coef,
                                at::Tensor& out) {
  if (row_lift.defined()) {
    launch_fused<T, K, true>(rows, hubs, weight, bias, row_lift, lift_coef, out);
  } else {
    launch_fused<T, K, false>(rows, hubs, weight, bias, row_lift, lift_coef, out);
  }
}

// Queries whose distances to one hub a warp computes in turn: the hub row is read from L2 once
// and from L1 after that, the queries are few and stay in L1.
constexpr int kDirectQueriesPerWarp = 8;

// dists[q, j] = the ranking's distance from query q to hub j (row hub_row(j, n, hubs) of x); a
// warp per hub and group of queries. NaN (a non-finite query) becomes +inf, so the sort stays
// a total order.
template <typename T>
__global__ void __launch_bounds__(kWarp * kWarpsPerBlock)
    hub_distances_kernel(const T* __restrict__ x, int64_t n, int dim, int32_t hubs, const T* __restrict__ queries,
                         int64_t nq, Metric ranking, float* __restrict__ dists) {
  const int lane = threadIdx.x % kWarp;
  const int32_t j = static_cast<int32_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (j >= hubs) return;  // whole warps leave together
  const T* hub = x + hub_row(j, n, hubs) * dim;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kDirectQueriesPerWarp;
  const int64_t last = first + kDirectQueriesPerWarp < nq ? first + kDirectQueriesPerWarp : nq;
  for (int64_t q = first; q < last; ++q) {
    const T* query = queries + q * dim;
    // Cosine ranks by <q, hub> / |hub| (the queries' norms do not change a query's order).
    const float d = ranking == Metric::kCosine ? team_cosine<kWarp, T, /*kUnitA=*/true>(query, hub, dim, lane)
                                               : team_distance<kWarp>(query, hub, dim, ranking, lane);
    if (lane == 0) dists[q * hubs + j] = isnan(d) ? INFINITY : d;
  }
}

// out[q, 0..count) = the row ids of query q's `count` nearest hubs, nearest first (the lower hub
// first among equal distances, as nearest_hubs orders them): one block per query sorts its
// distances in shared memory.
__global__ void __launch_bounds__(1024)
    nearest_hub_rows_kernel(const float* __restrict__ dists, int64_t n, int32_t hubs, int count,
                            int32_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int n_sort = next_pow2(hubs);
  float* d = reinterpret_cast<float*>(smem);
  uint32_t* id = reinterpret_cast<uint32_t*>(d + n_sort);
  const int64_t q = blockIdx.x;
  for (int i = threadIdx.x; i < n_sort; i += blockDim.x) {
    d[i] = i < hubs ? dists[q * hubs + i] : INFINITY;
    id[i] = i < hubs ? static_cast<uint32_t>(i) : kEmptyId;
  }
  __syncthreads();
  bitonic<false>(d, id, n_sort);
  for (int c = threadIdx.x; c < count; c += blockDim.x) {
    out[q * count + c] = static_cast<int32_t>(hub_row(id[c], n, hubs));
  }
}

}  // namespace
}  // namespace cuda

bool direct_hub_entries_apply(const at::Tensor& x, const at::Tensor& queries) {
  const int64_t hubs = hub_count(x.size(0));
  if (!queries.is_cuda() || hubs == 0 || hubs > kMaxDirectHubs || queries.size(0) * hubs > kMaxDirectHubPairs) {
    return false;
  }
  const auto type = x.scalar_type();
  if ((type != at::kFloat && type != at::kHalf && type != at::kBFloat16) || queries.scalar_type() != type) return false;
  // The distances read 16-byte chunks of rows that are a whole number of chunks long.
  return x.is_contiguous() && queries.is_contiguous() && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(queries.data_ptr()) % 16 == 0;
}

at::Tensor direct_hub_entries_cuda(const at::Tensor& x, const at::Tensor& queries, Metric ranking, int64_t count) {
  TORCH_CHECK(direct_hub_entries_apply(x, queries) && count >= 1,
              "direct_hub_entries_cuda: called outside direct_hub_entries_apply");
  const c10::cuda::CUDAGuard guard(queries.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(queries.device().index()).stream();
  const int64_t n = x.size(0), nq = queries.size(0), dim = x.size(1);
  const auto hubs = static_cast<int32_t>(hub_count(n));
  count = std::min<int64_t>(count, hubs);
  // Host rows (a GPU search of pinned rows) are read where they lie, through unified addressing.
  const void* rows = x.is_cuda() ? x.data_ptr() : cuda::device_address_of_host_rows(x);
  const at::Tensor dists = at::empty({nq, hubs}, queries.options().dtype(at::kFloat));
  at::Tensor out = at::empty({nq, count}, queries.options().dtype(at::kInt));
  if (nq == 0) return out;
  const dim3 grid(static_cast<unsigned>((hubs + cuda::kWarpsPerBlock - 1) / cuda::kWarpsPerBlock),
                  static_cast<unsigned>((nq + cuda::kDirectQueriesPerWarp - 1) / cuda::kDirectQueriesPerWarp));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hub_distances", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      cuda::hub_distances_kernel<scalar_t><<<grid, cuda::kWarp * cuda::kWarpsPerBlock, 0, stream>>>(
          static_cast<const scalar_t*>(rows), n, static_cast<int>(dim), hubs, queries.data_ptr<scalar_t>(), nq,
          ranking, dists.data_ptr<float>());
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int n_sort = cuda::next_pow2(hubs);
  const size_t smem = (sizeof(float) + sizeof(uint32_t)) * static_cast<size_t>(n_sort);
  if (smem > 48 * 1024) {
    // A host-side attribute, no sync: allowed while a CUDA graph is being captured.
    C10_CUDA_CHECK(cudaFuncSetAttribute(cuda::nearest_hub_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  const int threads = std::min(1024, std::max(cuda::kWarp, n_sort / 2));
  cuda::nearest_hub_rows_kernel<<<static_cast<unsigned>(nq), threads, smem, stream>>>(
      dists.data_ptr<float>(), n, hubs, static_cast<int>(count), out.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

bool gathered_hub_entries_apply(const at::Tensor& x, const at::Tensor& queries, int64_t count) {
  const int64_t hubs = hub_count(x.size(0));
  if (!queries.is_cuda() || hubs == 0 || std::min(count, hubs) > kMaxFusedHubK || hubs >= INT32_MAX) return false;
  const auto type = x.scalar_type();
  if ((type != at::kFloat && type != at::kHalf && type != at::kBFloat16) || queries.scalar_type() != type) return false;
  return x.is_contiguous() && queries.is_contiguous() && (x.is_cuda() || x.is_pinned());
}

void gather_hubs_cuda(const at::Tensor& x, const at::Tensor& queries, Metric ranking, at::Tensor& hub_rows,
                      at::Tensor& weight, at::Tensor& bias) {
  TORCH_CHECK(gathered_hub_entries_apply(x, queries, 1), "gather_hubs_cuda: called outside gathered_hub_entries_apply");
  const c10::cuda::CUDAGuard guard(queries.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(queries.device().index()).stream();
  const int64_t n = x.size(0), dim = x.size(1);
  const auto hubs = static_cast<int32_t>(hub_count(n));
  hub_rows = at::empty({hubs, dim}, queries.options());
  weight = at::empty({hubs}, queries.options().dtype(at::kFloat));
  bias = at::empty({hubs}, queries.options().dtype(at::kFloat));
  // Host rows (a GPU search of pinned rows) are read where they lie, through unified addressing.
  const void* rows = x.is_cuda() ? x.data_ptr() : cuda::device_address_of_host_rows(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gather_hubs", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      cuda::gather_hubs_kernel<scalar_t><<<static_cast<unsigned>(hubs), cuda::kGatherThreads, 0, stream>>>(
          static_cast<const scalar_t*>(rows), n, static_cast<int>(dim), hubs, ranking, hub_rows.data_ptr<scalar_t>(),
          weight.data_ptr<float>(), bias.data_ptr<float>());
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void smallest_scores_cuda(const at::Tensor& dots, const at::Tensor& weight, const at::Tensor& bias,
                          const at::Tensor& row_lift, const at::Tensor& lift_coef, at::Tensor& out,
                          int64_t hub_rows_of) {
  TORCH_CHECK(dots.is_cuda() && dots.scalar_type() == at::kFloat && dots.is_contiguous() && dots.dim() == 2,
              "smallest_scores_cuda: expected contiguous float32 CUDA dot products");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == dots.size(0) && out.size(1) >= 1 &&
                  out.size(1) <= kMaxFusedHubK && out.size(1) <= dots.size(1) && dots.size(1) <= INT32_MAX / 2,
              "smallest_scores_cuda: bad output shape ", out.sizes(), " for ", dots.sizes());
  TORCH_CHECK(out.scalar_type() == (hub_rows_of > 0 ? at::kInt : at::kLong) &&
                  (hub_rows_of <= 0 || hub_count(hub_rows_of) == dots.size(1)),
              "smallest_scores_cuda: expected int64 columns, or int32 hub rows of as many hubs as columns");
  if (dots.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(dots.device());
  const int64_t k = out.size(1);
  static_assert(kMaxFusedHubK <= 4 * cuda::kWarp, "four slots a lane hold the longest list");
  if (k <= cuda::kWarp) {
    cuda::launch<1>(dots, weight, bias, row_lift, lift_coef, out, hub_rows_of);
  } else if (k <= 2 * cuda::kWarp) {
    cuda::launch<2>(dots, weight, bias, row_lift, lift_coef, out, hub_rows_of);
  } else {
    cuda::launch<4>(dots, weight, bias, row_lift, lift_coef, out, hub_rows_of);
  }
}

bool fused_nearest_hubs_apply(const at::Tensor& rows, const at::Tensor& hubs, int64_t k) {
  const auto type = rows.scalar_type();
  if (!rows.is_cuda() || (type != at::kHalf && type != at::kBFloat16) || hubs.scalar_type() != type) return false;
  if (k > kMaxFusedProductK || rows.size(1) % 8 != 0 || rows.size(1) > kMaxFusedProductDim) return false;
  if (!rows.is_contiguous() || !hubs.is_contiguous()) return false;
  if (reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 != 0 || reinterpret_cast<uintptr_t>(hubs.data_ptr()) % 16 != 0)
    return false;
  if (hubs.size(0) >= INT32_MAX || rows.size(1) >= INT32_MAX) return false;
  const c10::cuda::CUDAGuard guard(rows.device());
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, rows.device().index()));
  // A block takes 128 rows and every hub: a batch of a few thousand queries would leave most
  // SMs idle, where a matrix product and the selection keep them all busy.
  const int64_t blocks = (rows.size(0) + cuda::kFusedRows - 1) / cuda::kFusedRows;
  return blocks >= 2 * static_cast<int64_t>(sms) && cuda::has_tensor_core_mma(rows.device().index());
}

void nearest_hubs_fused_cuda(const at::Tensor& rows, const at::Tensor& hubs, const at::Tensor& weight,
                             const at::Tensor& bias, const at::Tensor& row_lift, const at::Tensor& lift_coef,
                             at::Tensor& out) {
  TORCH_CHECK(fused_nearest_hubs_apply(rows, hubs, out.size(1)) && out.is_contiguous() &&
                  out.size(0) == rows.size(0) && out.size(1) >= 1 && out.size(1) <= hubs.size(0),
              "nearest_hubs_fused_cuda: called outside fused_nearest_hubs_apply or with a bad output ", out.sizes());
  TORCH_CHECK(row_lift.defined() == lift_coef.defined(), "nearest_hubs_fused_cuda: a lift needs both its terms");
  const c10::cuda::CUDAGuard guard(rows.device());
  // The hub terms padded to whole tiles (the kernel's columns past h score +inf).
  const int64_t h = hubs.size(0), padding = (cuda::kFusedHubs - h % cuda::kFusedHubs) % cuda::kFusedHubs;
  const auto padded = [&](const at::Tensor& terms, double value) {
    return at::constant_pad_nd(terms.to(at::kFloat).contiguous(), {0, padding}, value).contiguous();
  };
  const at::Tensor w = padded(weight, 0.0), b = padded(bias, INFINITY);
  const at::Tensor coef = lift_coef.defined() ? padded(lift_coef, 0.0) : at::Tensor();
  const at::Tensor lift = row_lift.defined() ? row_lift.to(at::kFloat).contiguous() : at::Tensor();
  const bool one = out.size(1) == 1;
  if (rows.scalar_type() == at::kHalf) {
    one ? cuda::launch_fused_lifted_or_not<at::Half, 1>(rows, hubs, w, b, lift, coef, out)
        : cuda::launch_fused_lifted_or_not<at::Half, kMaxFusedProductK>(rows, hubs, w, b, lift, coef, out);
  } else {
    one ? cuda::launch_fused_lifted_or_not<at::BFloat16, 1>(rows, hubs, w, b, lift, coef, out)
        : cuda::launch_fused_lifted_or_not<at::BFloat16, kMaxFusedProductK>(rows, hubs, w, b, lift, coef, out);
  }
}

}  // namespace grnnd
