// Nearest hubs from a chunk of dot products on the GPU (hubs.h, smallest_scores_cuda): the
// score of every (row, hub) pair and the selection of the k smallest per row in one pass.
//
// Why: the build assigns all N rows to their two nearest of N / 1000 hubs, an [N, N / 1000]
// score matrix made chunk by chunk. Scaling it, adding the hub terms and selecting with
// at::topk read and wrote that matrix four times over, and the radix select of at::topk is made
// for large k: at 4M x 384 rows (H100) the scaling and selection took 0.37 s of a 1.9 s build,
// and they grow as N^2. Here each row is read once: a warp per row, each lane keeping the k
// smallest of its columns in registers, then k warp-wide minimum reductions merge the lanes.
#include <cstdint>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../hubs.h"

namespace grnnd {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;

// (score, column) order: smaller score first, the lower column among equal scores.
__device__ __forceinline__ bool before(float a, int32_t ca, float b, int32_t cb) {
  return a < b || (a == b && ca < cb);
}

// out[r, 0..k) = columns of the k smallest weight[c] * dots[r, c] + bias[c]
// (+ row_lift[r] * lift_coef[c] when lifted) over c < h, ascending. K >= k, a compile-time bound
// that keeps each lane's list in registers.
template <int K>
__global__ void __launch_bounds__(kWarp * kWarpsPerBlock)
    smallest_scores_kernel(const float* __restrict__ dots, int64_t m, int32_t h, const float* __restrict__ weight,
                           const float* __restrict__ bias, const float* __restrict__ row_lift,
                           const float* __restrict__ lift_coef, int k, int64_t* __restrict__ out) {
  const int lane = threadIdx.x % kWarp;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (r >= m) return;  // whole warps leave together
  float best[K];
  int32_t column[K];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    best[j] = INFINITY;
    column[j] = INT32_MAX;
  }
  const float* row = dots + r * h;
  const float lift = row_lift != nullptr ? row_lift[r] : 0.0f;
  for (int32_t c = lane; c < h; c += kWarp) {
    float score = fmaf(weight[c], row[c], bias[c]);
    if (row_lift != nullptr) score = fmaf(lift, lift_coef[c], score);
    if (!before(score, c, best[K - 1], column[K - 1])) continue;
    best[K - 1] = score;
    column[K - 1] = c;
#pragma unroll
    for (int j = K - 1; j > 0; --j) {
      if (before(best[j], column[j], best[j - 1], column[j - 1])) {
        const float t = best[j];
        best[j] = best[j - 1];
        best[j - 1] = t;
        const int32_t u = column[j];
        column[j] = column[j - 1];
        column[j - 1] = u;
      }
    }
  }
  // Merge: k times, the warp's smallest head is taken and its lane moves on to its next entry.
  // A column lives in one lane only, so exactly one lane owns the winner.
  for (int i = 0; i < k; ++i) {
    float value = best[0];
    int32_t col = column[0];
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      const float v = __shfl_xor_sync(0xffffffffu, value, offset);
      const int32_t c = __shfl_xor_sync(0xffffffffu, col, offset);
      if (before(v, c, value, col)) {
        value = v;
        col = c;
      }
    }
    if (lane == 0) out[r * k + i] = col;
    if (column[0] == col) {
#pragma unroll
      for (int j = 0; j + 1 < K; ++j) {
        best[j] = best[j + 1];
        column[j] = column[j + 1];
      }
      best[K - 1] = INFINITY;
      column[K - 1] = INT32_MAX;
    }
  }
}

template <int K>
void launch(const at::Tensor& dots, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& row_lift,
            const at::Tensor& lift_coef, at::Tensor& out) {
  const int64_t m = dots.size(0);
  const unsigned blocks = static_cast<unsigned>((m + kWarpsPerBlock - 1) / kWarpsPerBlock);
  smallest_scores_kernel<K><<<blocks, kWarp * kWarpsPerBlock, 0, c10::cuda::getCurrentCUDAStream(dots.device().index())>>>(
      dots.data_ptr<float>(), m, static_cast<int32_t>(dots.size(1)), weight.data_ptr<float>(), bias.data_ptr<float>(),
      row_lift.defined() ? row_lift.data_ptr<float>() : nullptr,
      lift_coef.defined() ? lift_coef.data_ptr<float>() : nullptr, static_cast<int>(out.size(1)),
      out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda

void smallest_scores_cuda(const at::Tensor& dots, const at::Tensor& weight, const at::Tensor& bias,
                          const at::Tensor& row_lift, const at::Tensor& lift_coef, at::Tensor& out) {
  TORCH_CHECK(dots.is_cuda() && dots.scalar_type() == at::kFloat && dots.is_contiguous() && dots.dim() == 2,
              "smallest_scores_cuda: expected contiguous float32 CUDA dot products");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == dots.size(0) && out.size(1) >= 1 &&
                  out.size(1) <= kMaxFusedHubK && out.size(1) <= dots.size(1) && dots.size(1) < INT32_MAX,
              "smallest_scores_cuda: bad output shape ", out.sizes(), " for ", dots.sizes());
  if (dots.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(dots.device());
  const int64_t k = out.size(1);
  if (k <= 2) {
    cuda::launch<2>(dots, weight, bias, row_lift, lift_coef, out);
  } else if (k <= 8) {
    cuda::launch<8>(dots, weight, bias, row_lift, lift_coef, out);
  } else if (k <= 32) {
    cuda::launch<32>(dots, weight, bias, row_lift, lift_coef, out);
  } else {
    cuda::launch<kMaxFusedHubK>(dots, weight, bias, row_lift, lift_coef, out);
  }
}

}  // namespace grnnd
