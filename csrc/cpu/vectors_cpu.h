// Vectors and distances for the CPU kernels.
//
// Storage may be float16/bfloat16/float64; the CPU kernels work on one float32 copy so the
// inner loops are plain float arithmetic the compiler vectorises. Cosine rows are normalised
// once here, after which cosine is 1 + (negative inner product).
#pragma once

#include <atomic>
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "../core/params.h"

namespace grnnd {
namespace cpu {

// float32, contiguous, and unit-norm rows for cosine.
inline at::Tensor prepare_vectors(const at::Tensor& x, Metric metric) {
  at::Tensor out = x.to(at::kFloat).contiguous();
  if (metric == Metric::kCosine) {
    // A zero row has no direction; leaving it zero gives it distance 1 to everything.
    out = out / out.norm(2, 1, true).clamp_min(1e-30);
  }
  return out;
}

// The rows the build, its repair and prune_rows compare: prepare_vectors' rows, except that
// cosine rows of float16 or bfloat16 storage are rounded to that storage once normalised, as
// the CUDA kernels keep them (csrc/cuda/detail/vectors_cuda.cuh, prepare_vectors). Why: a build draws
// its start from the cells of each row's nearest hubs, and a row that lands in another cell
// shifts the draws of every row drawing from that cell; with rows normalised in float32 here and
// rounded on the GPU, 0.19 of 50 000 clustered float16 rows drew alike on the two devices (one
// H100), against 0.99998 for the same rows under l2.
inline at::Tensor prepare_build_vectors(const at::Tensor& x, Metric metric) {
  const bool half = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  if (metric != Metric::kCosine || !half) return prepare_vectors(x, metric);
  return prepare_vectors(x, metric).to(x.scalar_type()).to(at::kFloat).contiguous();
}

// The distance loops (csrc/cpu/distances_cpu.cpp). Each keeps 32 partial sums, lane l adding the
// terms of dimensions l, l + 32, ...; the lanes are then added in one fixed order. The copy for
// CPUs with AVX2 is chosen when the library loads and holds the lanes in four 8-wide registers,
// the baseline copy in eight 4-wide ones: the same additions in the same order, so results do not
// depend on the machine. Why: with one 8-float accumulator the compiler emitted scalar adds and
// shuffles, and the build spent about 60% of its time in that loop (text100k, perf).
float dot(const float* a, const float* b, int dim);
float squared_l2(const float* a, const float* b, int dim);

inline float distance(const float* a, const float* b, int dim, Metric metric) {
  switch (metric) {
    case Metric::kL2:
      return squared_l2(a, b, dim);
    case Metric::kIP:
      return -dot(a, b, dim);
    case Metric::kCosine:
      return 1.0f - dot(a, b, dim);
  }
  return 0.0f;
}

// d(a, b) of two rows' one-byte codes of `stride` bytes (csrc/core/checks.h, check_pair_codes):
// scale times the sum of squared code differences, summed exactly in 32 bits and then rounded
// to float32 once, as the CUDA build's teams sum them (pair_code_distance in
// csrc/cuda/build_cuda.cu), so the two devices take the same distance for every pair.
inline float pair_code_distance(const uint8_t* a, const uint8_t* b, int64_t stride, float scale) {
  uint32_t sum = 0;
  for (int64_t i = 0; i < stride; ++i) {
    const int difference = static_cast<int>(a[i]) - static_cast<int>(b[i]);
    sum += static_cast<uint32_t>(difference * difference);
  }
  return static_cast<float>(sum) * scale;
}

// Rows of a prepared [n, dim] float32 matrix, with the metric bound in.
struct VectorSet {
  const float* base;
  int64_t dim;
  Metric metric;
  // Optional extra coordinate per row (see inner_product_lift); when set, distances between
  // rows are squared Euclidean in the lifted space.
  const float* lift = nullptr;
  // Optional one-byte codes of the rows (check_pair_codes): when set, a build's update rounds
  // take their pair distances from them (pair).
  const uint8_t* codes = nullptr;
  int64_t code_stride = 0;
  float code_scale = 0.0f;

  const float* row(int64_t i) const { return base + i * dim; }
  float operator()(int64_t i, int64_t j) const {
    if (lift != nullptr) {
      const float t = lift[i] - lift[j];
      return squared_l2(row(i), row(j), static_cast<int>(dim)) + t * t;
    }
    return distance(row(i), row(j), static_cast<int>(dim), metric);
  }
  float to(const float* q, int64_t j) const { return distance(q, row(j), static_cast<int>(dim), metric); }
  // The distance of a pair the update rounds compare: from the codes where there are some.
  float pair(int64_t i, int64_t j) const {
    if (codes == nullptr) return (*this)(i, j);
    return pair_code_distance(codes + i * code_stride, codes + j * code_stride, code_stride, code_scale);
  }

  // Graph walks read rows in random order, so the loops are bound by memory latency, not
  // arithmetic: announcing the rows about to be read lets their loads overlap.
  void prefetch(int64_t i) const {
    const char* p = reinterpret_cast<const char*>(row(i));
    const int64_t bytes = dim * static_cast<int64_t>(sizeof(float));
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
  }
  // The bytes pair(i, j) reads of row i.
  void prefetch_pair(int64_t i) const {
    if (codes == nullptr) return prefetch(i);
    const char* p = reinterpret_cast<const char*>(codes + i * code_stride);
    for (int64_t off = 0; off < code_stride; off += 64) __builtin_prefetch(p + off);
  }
};

// parallel_for with dynamic chunks: per-vertex work in a build varies a lot, and static
// splitting leaves threads idle at the end of every round.
template <typename F>
void parallel_dynamic(int64_t n, int64_t chunk, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
  at::parallel_for(0, std::max<int64_t>(workers, 1), 1, [&](int64_t, int64_t) {
    for (int64_t begin; (begin = next.fetch_add(chunk)) < n;) {
      const int64_t end = std::min(n, begin + chunk);
      for (int64_t i = begin; i < end; ++i) fn(i);
    }
  });
}

}  // namespace cpu
}  // namespace grnnd
