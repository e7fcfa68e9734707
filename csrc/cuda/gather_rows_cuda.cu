// gather_rows on the GPU: the twin of csrc/cpu/gather_rows_cpu.cpp. Rows already on the device
// are index_select's; rows in pinned host memory are read by a kernel through unified
// addressing (the host pointer is valid on the device), a warp per row in 16-byte words where
// the row allows, so the only copy over the bus is of the rows named, and no host thread
// gathers them first.
#include <torch/library.h>

#include "../core/checks.h"
#include "detail/vectors_cuda.cuh"
#include "detail/warp_cuda.cuh"

namespace grnnd {
namespace cuda {
namespace {

constexpr int kGatherWarps = 8;  // warps a block
constexpr int kWordsInFlight = 4;  // a lane's loads issued before any store: host reads take microseconds

template <typename Word>
__global__ void __launch_bounds__(kGatherWarps * kWarpSize)
    gather_rows_kernel(const Word* __restrict__ data, const int64_t* __restrict__ ids, int64_t m, int64_t words,
                       Word* __restrict__ out) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kGatherWarps;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kGatherWarps + threadIdx.x / kWarpSize; r < m; r += warps) {
    const Word* from = data + ids[r] * words;
    Word* to = out + r * words;
    for (int64_t j0 = lane; j0 < words; j0 += kWordsInFlight * kWarpSize) {
      Word w[kWordsInFlight];
#pragma unroll
      for (int i = 0; i < kWordsInFlight; ++i) {
        const int64_t j = j0 + i * kWarpSize;
        if (j < words) w[i] = from[j];
      }
#pragma unroll
      for (int i = 0; i < kWordsInFlight; ++i) {
        const int64_t j = j0 + i * kWarpSize;
        if (j < words) to[j] = w[i];
      }
    }
  }
}

template <typename Word>
void launch(const void* data, const at::Tensor& ids, int64_t row_bytes, at::Tensor& out, cudaStream_t stream) {
  const int64_t m = ids.numel(), words = row_bytes / static_cast<int64_t>(sizeof(Word));
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ids.device().index()));
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(m, kGatherWarps), 16LL * sms));
  gather_rows_kernel<Word><<<blocks, kGatherWarps * kWarpSize, 0, stream>>>(
      static_cast<const Word*>(data), ids.data_ptr<int64_t>(), m, words, static_cast<Word*>(out.data_ptr()));
  check_launch();
}

at::Tensor gather_rows_cuda(const at::Tensor& data, const at::Tensor& ids) {
  check_gather_rows(data, ids);
  TORCH_CHECK_VALUE(ids.is_cuda(), "ids: expected a CUDA tensor when data is on a GPU or read from one, got ",
                    ids.device());
  if (data.is_cuda()) {
    check_same_device(data, "data", ids, "ids");
    return data.index_select(0, ids);
  }
  TORCH_CHECK_VALUE(data.device().is_cpu(), "data: expected a CPU or CUDA tensor, got ", data.device());
  const c10::cuda::CUDAGuard guard(ids.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(ids.device().index()).stream();
  const at::Tensor rows = data.contiguous();  // pinned rows are contiguous as pinned: no copy
  at::Tensor out = at::empty({ids.numel(), rows.size(1)}, rows.options().device(ids.device()));
  if (ids.numel() == 0 || rows.size(1) == 0) return out;
  const void* from = device_address_of_host_rows(rows);
  const at::Tensor i = ids.contiguous();
  const int64_t row_bytes = rows.size(1) * static_cast<int64_t>(rows.element_size());
  const auto aligned = [&](int64_t word) {
    return row_bytes % word == 0 && reinterpret_cast<uintptr_t>(from) % word == 0 &&
           reinterpret_cast<uintptr_t>(out.data_ptr()) % word == 0;
  };
  if (aligned(16)) {
    launch<int4>(from, i, row_bytes, out, stream);
  } else if (aligned(8)) {
    launch<int2>(from, i, row_bytes, out, stream);
  } else if (aligned(4)) {
    launch<int>(from, i, row_bytes, out, stream);
  } else if (aligned(2)) {
    launch<int16_t>(from, i, row_bytes, out, stream);
  } else {
    launch<int8_t>(from, i, row_bytes, out, stream);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CUDA, m) { m.impl("gather_rows", &gather_rows_cuda); }

}  // namespace cuda
}  // namespace grnnd
