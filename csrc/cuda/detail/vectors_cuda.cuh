// Vectors and distances for the CUDA kernels: one place for storage types, 16-byte loads and
// team-cooperative distances (seed 000, Algorithm 5; seed 002 on team sizes).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../../core/params.h"

namespace grnnd {
namespace cuda {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;

// Storage the kernels read directly: float32, float16, bfloat16. float64 is narrowed to
// float32 once (the search itself is float32 anyway); cosine rows are normalised once, in
// their storage type, so cosine becomes 1 - <x, y>. The result is contiguous and starts on a
// 16-byte boundary, as team_distance's 16-byte loads need (a view into a larger tensor may
// start anywhere, and is then copied).
//
// Cosine rows are normalised a block of kNormaliseElements at a time into the one copy: done on
// the whole, its float32 steps took 10 bytes an element beside the rows (100 GB for 10M x 1 024
// float16 rows), far past the copy that memory.bytes_per_row counts. A block's two float32
// steps take 32 MB: blocks of 2^26 elements took 512 MB whatever the rows, which builds within
// a small budget felt (shards of about 33 000 x 1 024 float16 rows built under cosine peaked at
// 381-400 MiB, under l2 at 73-97 MiB; one H200).
constexpr int64_t kNormaliseElements = int64_t(1) << 22;  // 16 MB a float32 step

inline at::Tensor prepare_vectors(const at::Tensor& x, Metric metric) {
  at::Tensor out = x.scalar_type() == at::kDouble ? x.to(at::kFloat) : x;
  if (metric == Metric::kCosine) {
    at::Tensor unit = at::empty(out.sizes(), out.options());  // contiguous
    const int64_t rows = out.size(0);
    const int64_t block = std::max<int64_t>(1, kNormaliseElements / std::max<int64_t>(1, out.size(1)));
    for (int64_t start = 0; start < rows; start += block) {
      const at::Tensor part = out.narrow(0, start, std::min(block, rows - start)).to(at::kFloat);
      unit.narrow(0, start, part.size(0)).copy_(part / part.norm(2, 1, true).clamp_min(1e-30));
    }
    out = unit;
  }
  out = out.contiguous();
  return reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 ? out : out.clone();
}

// The device's address of the pinned host rows of `data` (the same pointer under unified
// addressing), or an error that says how to make the rows readable: kernels read such rows over
// the bus, row by row, without a copy of the whole.
inline const void* device_address_of_host_rows(const at::Tensor& data) {
  cudaPointerAttributes attributes{};
  C10_CUDA_CHECK(cudaPointerGetAttributes(&attributes, data.data_ptr()));
  TORCH_CHECK_VALUE(attributes.type == cudaMemoryTypeHost && attributes.devicePointer != nullptr,
                    "data: rows on the CPU are read from a GPU only from pinned memory; pass data.pin_memory() "
                    "(or move the rows to the GPU)");
  return attributes.devicePointer;
}

// Runs `__VA_ARGS__` with `scalar_t` bound to the storage type of a prepared tensor.
#define GRNND_DISPATCH_STORAGE(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

// Sum over the TEAM consecutive lanes that share a team; every lane of the team gets the sum.
template <int TEAM, typename V>
__device__ __forceinline__ V team_sum(V v) {
#pragma unroll
  for (int offset = TEAM / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

template <int TEAM>
__device__ __forceinline__ float team_max(float v) {
#pragma unroll
  for (int offset = TEAM / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Calls visit_chunk(ra, rb) with every pair of 16-byte chunks of rows a and b that lane `rank`
// of a TEAM-lane team owns, or visit(x, y) with the float values of every element pair it owns
// when the rows are not read in chunks; the team's lanes together cover the rows (`dim`
// elements). Rows whose size is a multiple of 16 bytes (and 16-byte aligned, as prepared tensors
// are) are read with 16-byte loads, anything else element by element. Chunks and elements are
// visited in the same order whatever IN_FLIGHT is, so sums do not depend on it.
//
// IN_FLIGHT: 16-byte chunks of b a lane loads before it uses the first (a is the row the caller
// reuses, an L1 hit). With 1, each chunk is used as it arrives, and ncu showed a distance
// waiting one memory round trip per chunk: three for a 768-byte row at teams of 16. team_for_row
// gives a lane at most 4 chunks of a row of up to 1024 bytes, so 4 makes such a row one round
// trip. Measured on the H200 (1M x 384 float16 real rows): the search at batch 10 000 and list
// 64 went from 1.88M to 2.13M q/s, but the build slowed from 0.51 s to 0.61 s (its 48-register
// budget then spilled in the pair loop), so the build keeps 1.
template <int TEAM, int IN_FLIGHT, typename T, typename VisitChunk, typename Visit>
__device__ __forceinline__ void team_visit_chunks(const T* a, const T* b, int dim, int rank, VisitChunk&& visit_chunk,
                                                  Visit&& visit) {
  constexpr int kPerChunk = 16 / sizeof(T);
  if (dim % kPerChunk == 0) {
    const uint4* va = reinterpret_cast<const uint4*>(a);
    const uint4* vb = reinterpret_cast<const uint4*>(b);
    const int chunks = dim / kPerChunk;
    if constexpr (IN_FLIGHT == 1) {
      for (int c = rank; c < chunks; c += TEAM) visit_chunk(__ldg(va + c), __ldg(vb + c));
    } else {
#pragma unroll 1
      for (int first = rank; first < chunks; first += IN_FLIGHT * TEAM) {
        uint4 rb[IN_FLIGHT];
#pragma unroll
        for (int k = 0; k < IN_FLIGHT; ++k) {
          if (first + k * TEAM < chunks) rb[k] = __ldg(vb + first + k * TEAM);
        }
#pragma unroll
        for (int k = 0; k < IN_FLIGHT; ++k) {
          if (first + k * TEAM < chunks) visit_chunk(__ldg(va + first + k * TEAM), rb[k]);
        }
      }
    }
  } else {
    for (int e = rank; e < dim; e += TEAM) visit(static_cast<float>(a[e]), static_cast<float>(b[e]));
  }
}

// Calls visit(x, y) with the float values of the element pairs of two 16-byte chunks, in order.
template <typename T, typename Visit>
__device__ __forceinline__ void visit_chunk_elements(const uint4& ra, const uint4& rb, Visit&& visit) {
  const T* ea = reinterpret_cast<const T*>(&ra);
  const T* eb = reinterpret_cast<const T*>(&rb);
#pragma unroll
  for (int e = 0; e < static_cast<int>(16 / sizeof(T)); ++e) visit(static_cast<float>(ea[e]), static_cast<float>(eb[e]));
}

// team_visit_chunks with every chunk pair unpacked into its element pairs, in order.
template <int TEAM, int IN_FLIGHT, typename T, typename Visit>
__device__ __forceinline__ void team_visit(const T* a, const T* b, int dim, int rank, Visit&& visit) {
  team_visit_chunks<TEAM, IN_FLIGHT>(
      a, b, dim, rank, [&](const uint4& ra, const uint4& rb) { visit_chunk_elements<T>(ra, rb, visit); }, visit);
}

__device__ __forceinline__ float2 pair_to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 pair_to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }

// Distance between rows a and b of `dim` elements, computed by the TEAM lanes of the calling
// team (`rank` = lane index within the team); all of them get the result. All 32 lanes of the
// warp must call this together. IN_FLIGHT as in team_visit.
//
// HALF_DIFFERENCE (float16 and bfloat16 rows, l2): each pair of elements is subtracted in the
// storage type (one HSUB2 for two elements) and only the difference is widened to float32 and
// squared, instead of widening both elements and subtracting in float32. The difference is
// rounded to the storage type, so each squared term, and so the distance, moves by at most about
// 2^-10 (float16) or 2^-7 (bfloat16) of itself, and elements further apart than the type's
// largest value give inf. The build, whose distances only rank candidates against each other,
// takes it: on the H200 (1M x 384 real sentence embeddings, same run) the float16 build went
// from 0.484 s to 0.468 s, the descending one from 0.657 s to 0.631 s and the bfloat16 build
// from 0.494 s to 0.474 s, with the same search recall. The search returns its distances and
// keeps both elements exact.
template <int TEAM, int IN_FLIGHT = 1, bool HALF_DIFFERENCE = false, typename T>
__device__ __forceinline__ float team_distance(const T* a, const T* b, int dim, Metric metric, int rank) {
  const bool l2 = metric == Metric::kL2;
  float acc = 0.0f;
  const auto visit = [&](float x, float y) {
    if (l2) {
      const float t = x - y;
      acc += t * t;
    } else {
      acc += -x * y;
    }
  };
  if constexpr (HALF_DIFFERENCE && (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>)) {
    using Pair = std::conditional_t<std::is_same_v<T, c10::Half>, __half2, __nv_bfloat162>;
    team_visit_chunks<TEAM, IN_FLIGHT>(
        a, b, dim, rank,
        [&](const uint4& ra, const uint4& rb) {
          const Pair* ha = reinterpret_cast<const Pair*>(&ra);
          const Pair* hb = reinterpret_cast<const Pair*>(&rb);
          if (l2) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 t = pair_to_float2(__hsub2(ha[e], hb[e]));
              acc += t.x * t.x;
              acc += t.y * t.y;
            }
          } else {
            visit_chunk_elements<T>(ra, rb, visit);
          }
        },
        visit);
  } else {
    team_visit<TEAM, IN_FLIGHT>(a, b, dim, rank, visit);
  }
  const float s = team_sum<TEAM>(acc);
  return metric == Metric::kCosine ? 1.0f + s : s;
}

// The build's distance between rows a and b of the prepared [n, dim] rows x, by the TEAM lanes of
// the calling team (same calling rules as team_distance): the metric's distance, or for inner
// product (lift != null) squared l2 in the space lifted by one coordinate per row (params.h,
// lifts_inner_product). A team without a pair passes valid = false and gets a meaningless value
// without loading anything. The build, prune_rows and the fill share it, so they rank alike.
template <int TEAM, int IN_FLIGHT = 1, bool HALF_DIFFERENCE = false, typename T>
__device__ __forceinline__ float rows_distance(const T* __restrict__ x, int dim, Metric metric, const float* lift,
                                               int64_t a, int64_t b, bool valid, int rank) {
  float d = team_distance<TEAM, IN_FLIGHT, HALF_DIFFERENCE>(x + a * dim, x + b * dim, valid ? dim : 0, metric, rank);
  if (lift != nullptr && valid) {
    const float t = lift[a] - lift[b];
    d += t * t;
  }
  return d;
}

// Lanes per distance (a team), by row size in bytes, for the build and the search alike:
// enough lanes that each issues at most about four 16-byte loads per row and no more, so that a
// warp computes several distances of short rows at once. It depends on the row alone, never on
// the batch or block size, so results do not either. Measured on the H200 (1M x 384 float16 real
// rows, 768 bytes): the build with teams of 16 (two distances per warp, three loads per lane)
// took 0.634 s against 0.828 s with whole-warp teams (1.5 loads per lane, one distance per
// warp); teams of 8 were slower again (0.537 s against 0.506 s, after the occupancy changes in
// build_cuda.cu). For the search, teams of 8 on these rows (plus an L2 prefetch of each list
// entrant's adjacency row) gave batch 10 000 at list 64 1.71M q/s against 1.76M, batch 1 at
// list 16 0.204 ms against 0.198 ms; not kept.
inline int team_for_row(int64_t row_bytes) {
  if (row_bytes <= 128) return 4;
  if (row_bytes <= 512) return 8;
  if (row_bytes <= 1024) return 16;
  return 32;
}

// The exact kernels' per-dimension step, d += (q - r)^2 with the square added in one fused
// multiply-add: the rounding of the CPU's ordered_squared_l2 (segments.h), so the knn_segments
// kernels of both devices return bit for bit the same distances. Two instructions a dimension
// where an unfused add takes three (the d = 64 scan is bound by them).
__device__ __forceinline__ float add_square(float d, float q, float r) {
  const float diff = __fsub_rn(q, r);
  return __fmaf_rn(diff, diff, d);
}

inline void check_launch() { C10_CUDA_KERNEL_LAUNCH_CHECK(); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Cosine distance 1 - <a, b> / (|a| |b|) between raw rows, by the TEAM lanes of the calling
// team; same calling rules as team_distance. With kUnitA the caller promises
// |a| = 1 and its norm is not accumulated: the search normalises its few queries up front and
// so needs no normalised copy of the data (no [N, D] pass and allocation per call). The dot
// product and the norms come from the same 16-byte loads. A zero row is at distance 1, as on
// the CPU.
template <int TEAM, typename T, bool kUnitA = false, int IN_FLIGHT = 1>
__device__ __forceinline__ float team_cosine(const T* a, const T* b, int dim, int rank) {
  float dot = 0.0f, norm2_a = 0.0f, norm2_b = 0.0f;
  team_visit<TEAM, IN_FLIGHT>(a, b, dim, rank, [&](float x, float y) {
    dot += x * y;
    norm2_b += y * y;
    if (!kUnitA) norm2_a += x * x;
  });
  dot = team_sum<TEAM>(dot);
  norm2_b = team_sum<TEAM>(norm2_b);
  const float norm_a = kUnitA ? 1.0f : fmaxf(sqrtf(team_sum<TEAM>(norm2_a)), 1e-30f);
  return 1.0f - dot / (norm_a * fmaxf(sqrtf(norm2_b), 1e-30f));
}

}  // namespace cuda
}  // namespace grnnd
