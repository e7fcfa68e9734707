// The fill of built rows on the GPU: the twin of csrc/cpu/fill_cpu.cpp, the recipe of csrc/build/fill.h
// with one warp (a block of 32 threads) per row. A row's candidates sit in shared memory as sort
// keys 2 x id + (0 if own, else 1): a bitonic sort by key puts the copies of an id side by side,
// the own one first, and one pass keeps the first of each (as prune_rows dedupes); after the
// distances, a second sort by (distance, key) gives the order the recipe walks in.
#include <limits>

#include <torch/library.h>

#include "../core/checks.h"
#include "../build/fill.h"
#include "detail/sort_cuda.cuh"
#include "detail/vectors_cuda.cuh"
#include "detail/warp_cuda.cuh"

namespace grnnd {
namespace cuda {
namespace {

struct FillArgs {
  const int32_t* in;  // [n, degree], read
  int32_t* out;       // [n, degree], a copy of `in`; short rows are rewritten
  int64_t n;
  int degree;
  int dim;
  Metric metric;      // the metric rows are compared in (l2 when lifted)
  const float* lift;  // inner product only, else null
  int sort_size;      // a power of two >= the most candidates a row can have, and >= 32
};

// Most candidates of a row: c own entries and c * per two-hop ones, per = min(degree,
// max(1, fill_candidates(degree) / c)) with c < degree.
int max_fill_candidates(int degree) { return degree + std::max(degree, fill_candidates(degree)); }

// 16-byte chunks of a candidate's row each lane loads before it uses the first (team_visit_chunks):
// with team_for_row's teams a row of up to 2 KiB arrives in one memory round trip instead of four,
// and the sums are the same whatever the chunks in flight. The fill of a widened build's rows of
// 96 was 1.6 s of the 10.3 s default build of zipf_aniso 10M x 1024 (torch.profiler, one H200);
// ncu on a pass of 1M x 1024 saw its warps stalled 6.6 of every 12.1 cycles on loads, 3.9 of 10.0
// with four in flight. The build then took 10.03-10.08 s against 10.25-10.33 s (alternating, the
// same recall), blobs 1M x 384 the same time (benchmarks/results/build_fill_in_flight_h200.txt).
constexpr int kFillChunksInFlight = 4;

size_t fill_scratch_bytes(const FillArgs& a) {
  return static_cast<size_t>(a.sort_size) * (sizeof(float) + sizeof(uint32_t)) +
         static_cast<size_t>(a.degree) * sizeof(int32_t);
}

template <typename T, int TEAM>
__global__ void __launch_bounds__(kWarpSize) fill_kernel(const T* __restrict__ x, FillArgs a) {
  constexpr int kTeams = kWarpSize / TEAM;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t v = blockIdx.x;
  const int lane = threadIdx.x, team = lane / TEAM, rank = lane % TEAM;
  extern __shared__ uint32_t scratch[];
  float* dist = reinterpret_cast<float*>(scratch);
  uint32_t* key = scratch + a.sort_size;
  int32_t* own = reinterpret_cast<int32_t*>(key + a.sort_size);

  // The row's entries in row order.
  const int32_t* row = a.in + v * a.degree;
  int c = 0;
  for (int base = 0; base < a.degree; base += kWarpSize) {
    const int j = base + lane;
    const int32_t u = j < a.degree ? row[j] : -1;
    const bool valid = u >= 0 && u < a.n;
    const unsigned mask = __ballot_sync(kFullMask, valid);
    if (valid) own[c + __popc(mask & lanes_below(lane))] = u;
    c += __popc(mask);
  }
  __syncwarp();
  if (c == 0 || c >= a.degree) return;  // `out` already holds the row

  // 1. Own entries and two-hop candidates as keys; repeats side by side after the sort by key.
  const int per = min(a.degree, max(1, fill_candidates(a.degree) / c));
  const int total = c + c * per;
  for (int j = lane; j < a.sort_size; j += kWarpSize) {
    uint32_t k = kEmptyId;
    if (j < c) {
      k = 2u * static_cast<uint32_t>(own[j]);
    } else if (j < total) {
      const int q = j - c;
      const int32_t w = a.in[static_cast<int64_t>(own[q / per]) * a.degree + q % per];
      if (w >= 0 && w < a.n && w != v) k = 2u * static_cast<uint32_t>(w) + 1u;
    }
    key[j] = k;
    dist[j] = k == kEmptyId ? kInf : 0.0f;
  }
  __syncwarp();
  bitonic<false>(dist, key, a.sort_size);
  // The first copy of each id, compacted in place: a chunk's entries are all read before any
  // of its writes, and writes land at or below the entry read.
  int count = 0;
  uint32_t before = 0xffffffffu;
  for (int base = 0; base < a.sort_size; base += kWarpSize) {
    const uint32_t u = key[base + lane];
    uint32_t previous = __shfl_up_sync(kFullMask, u, 1);
    if (lane == 0) previous = before;
    before = __shfl_sync(kFullMask, u, kWarpSize - 1);
    const bool fresh = u != kEmptyId && (u >> 1) != (previous >> 1);
    const unsigned mask = __ballot_sync(kFullMask, fresh);
    __syncwarp();
    if (fresh) key[count + __popc(mask & lanes_below(lane))] = u;
    count += __popc(mask);
    __syncwarp();
  }
  for (int j = count + lane; j < a.sort_size; j += kWarpSize) {
    key[j] = kEmptyId;
    dist[j] = kInf;
  }
  __syncwarp();

  // 2. Distances of the distinct candidates, then the order of step 3.
  for (int g0 = 0; g0 < count; g0 += kTeams) {
    const int g = g0 + team;
    const bool valid = g < count;
    const float d = rows_distance<TEAM, kFillChunksInFlight>(x, a.dim, a.metric, a.lift, v, valid ? key[g] >> 1 : v,
                                                             valid, rank);
    if (valid && rank == 0) dist[g] = d;
  }
  __syncwarp();
  bitonic<false>(dist, key, a.sort_size);

  // 3-4. Every own entry and the nearest degree - c others, in that order, -1 padded.
  int32_t* filled = a.out + v * a.degree;
  const int room = a.degree - c;
  int written = 0, others = 0;
  for (int base = 0; base < count; base += kWarpSize) {
    const int j = base + lane;
    const bool valid = j < count;
    const bool other = valid && (key[j] & 1u) != 0;
    const unsigned other_mask = __ballot_sync(kFullMask, other);
    const bool take = valid && (!other || others + __popc(other_mask & lanes_below(lane)) < room);
    const unsigned take_mask = __ballot_sync(kFullMask, take);
    if (take) filled[written + __popc(take_mask & lanes_below(lane))] = static_cast<int32_t>(key[j] >> 1);
    written += __popc(take_mask);
    others += __popc(other_mask);
  }
  for (int j = written + lane; j < a.degree; j += kWarpSize) filled[j] = -1;
}

template <typename T, int TEAM>
void launch(const at::Tensor& x, const FillArgs& a, cudaStream_t stream) {
  fill_kernel<T, TEAM><<<static_cast<unsigned>(a.n), kWarpSize, fill_scratch_bytes(a), stream>>>(x.data_ptr<T>(), a);
  check_launch();
}

}  // namespace
}  // namespace cuda

at::Tensor fill_rows_cuda(at::Tensor graph, const at::Tensor& x, const at::Tensor& lift, Metric metric) {
  const int64_t n = graph.size(0);
  TORCH_CHECK_VALUE(n <= kMaxFillRows, "build: at most ", kMaxFillRows, " rows on the GPU, got ", n);
  // Two graphs at a time: the one a pass reads and the one it writes (a build hands its graph
  // over, so that its rows of 96 after a widening do not hold three: 1 152 bytes a row, above
  // the wider pools' 1 024).
  at::Tensor filled = graph.contiguous();
  graph = at::Tensor();
  if (n == 0) return filled;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(filled.device().index());
  const int degree = static_cast<int>(filled.size(1));
  for (int pass = 0; pass < kFillPasses; ++pass) {
    at::Tensor next = filled.clone();
    const cuda::FillArgs a{filled.data_ptr<int32_t>(),
                           next.data_ptr<int32_t>(),
                           n,
                           degree,
                           static_cast<int>(x.size(1)),
                           lift.defined() ? Metric::kL2 : metric,
                           lift.defined() ? lift.data_ptr<float>() : nullptr,
                           cuda::next_pow2(std::max(cuda::max_fill_candidates(degree), cuda::kWarpSize))};
    GRNND_DISPATCH_STORAGE(x.scalar_type(), "grnnd_fill_rows_cuda", [&] {
      if constexpr (std::is_same_v<scalar_t, double>) {
        TORCH_CHECK(false, "build: float64 storage reached the CUDA fill (prepare_vectors narrows it)");
      } else {
        switch (cuda::team_for_row(x.size(1) * x.element_size())) {
          case 4:
            cuda::launch<scalar_t, 4>(x, a, stream);
            break;
          case 8:
            cuda::launch<scalar_t, 8>(x, a, stream);
            break;
          case 16:
            cuda::launch<scalar_t, 16>(x, a, stream);
            break;
          default:
            cuda::launch<scalar_t, 32>(x, a, stream);
            break;
        }
      }
    });
    filled = std::move(next);
  }
  return filled;
}

}  // namespace grnnd
