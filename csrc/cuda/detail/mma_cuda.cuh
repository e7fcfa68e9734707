// Tensor-core products of 16-bit rows for the kernels that multiply rows with rows: the nearest
// hubs (hubs_cuda.cu) and the Gram matrix of a build's start entries (build_cuda.cu).
#pragma once

#include <cstdint>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

namespace grnnd {
namespace cuda {

// c += a b for one 16 x 8 tile, 16 deep, float32 accumulation (mma.sync.m16n8k16). With
// g = lane / 4 and t = lane % 4 (PTX ISA, "Matrix fragments for mma.m16n8k16"), a thread holds
// a = {A[g][2t..2t+1], A[g + 8][2t..], A[g][2t + 8..], A[g + 8][2t + 8..]} (two 16-bit values a
// word), b = {B[2t..2t+1][g], B[2t + 8..][g]} and c = {C[g][2t], C[g][2t + 1], C[g + 8][2t],
// C[g + 8][2t + 1]}. T is at::Half or at::BFloat16.
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>, "mma takes 16-bit rows");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, at::Half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  __trap();  // hosts launch kernels that use it on compute capability 8.0 and above only
#endif
}

// Whether `device` runs mma_16x8x16 (compute capability 8.0 and above).
inline bool has_tensor_core_mma(int device) {
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 8;
}

}  // namespace cuda
}  // namespace grnnd
