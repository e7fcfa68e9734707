// 8-bit scalar codes of the data rows: what the search's traversal reads instead of the rows
// (DESIGN.md, "Search at the memory limit"). The CPU and CUDA searches share every formula here,
// so both walk the graph by the same code distances and re-rank with the same exact ones.
//
// A search on 1M x 384 float16 rows at list 64 reads about 2 800 rows per query: 2.2 MB, which
// is what bounds it. A code row is one byte a dimension, half a float16 row.
//
// Encoding (torch_grnnd/codes.py): per dimension d an offset o_d and a step s_d (the rows' range
// over 255), the code c_d = round((x_d - o_d) / s_d) in [0, 255]; the decoded row is
// x~_d = o_d + s_d c_d. Cosine rows are encoded once normalised, so the traversal's cosine is an
// inner product of the normalised query with decoded rows. The layout of a code row:
//   [code_dims(D) bytes: c_0 .. c_{D-1}, zero padded to a multiple of 16]
//   [l2 only, 16 bytes: float32 |s (.) c|^2, the squared norm of the decoded row less its
//    offset, then 12 bytes of padding, so that rows stay 16-byte aligned for vector loads]
//
// Distance of a query q to a code row, with a_d = u_d s_d (u = q - o for l2, q otherwise):
//   l2:     |u|^2 - 2 <a, c> + |s (.) c|^2   (= |q - x~|^2)
//   ip:     -<q, o> - <a, c>                  (= -<q, x~>)
//   cosine: 1 - <q, o> - <a, c>               (q normalised)
// <a, c> is computed in integers: a is quantised per query to 16 bits, A_d = round(a_d / scale)
// with scale = max |a_d| / 32767, split into a signed high byte and an unsigned low byte
// (A = 256 hi + lo), so <a, c> = scale (256 <hi, c> + <lo, c>), two 4-way byte dot products
// (dp4a on the GPU) per 4 dimensions. Integer sums do not depend on their order, so both
// devices get the same sums; the query quantisation adds about 2^-15 of max |a_d| per dimension,
// far below the codes' own rounding (half a step).
#pragma once

#include <cmath>
#include <cstdint>

#include "params.h"
#include "philox.h"  // GRNND_HOST_DEVICE

namespace grnnd {

// Codes per dimension, padded so that a row is a whole number of 16-byte loads.
GRNND_HOST_DEVICE int64_t code_dims(int64_t dim) { return (dim + 15) / 16 * 16; }

// Bytes of one code row: its codes, then for l2 the row's norm term in a 16-byte tail.
GRNND_HOST_DEVICE int64_t code_row_bytes(int64_t dim, Metric metric) {
  return code_dims(dim) + (metric == Metric::kL2 ? 16 : 0);
}

// Largest |A_d| of the query's 16-bit terms; with hi in [-128, 127] and lo in [0, 255].
constexpr int kCodeQueryLevels = 32767;

// Largest dimension the codes take: <lo, c> <= 255 * 255 * dim must fit an int32.
constexpr int64_t kMaxCodeDim = 32768;

// Query term a_d of dimension d.
GRNND_HOST_DEVICE float code_query_term(float q, float offset, float step, Metric metric) {
  return (metric == Metric::kL2 ? q - offset : q) * step;
}

// The query's constant, accumulated over d in the devices' shared order (code_query_constant):
// |u|^2 for l2, <q, o> otherwise. Fused explicitly so that no compiler contracts it differently.
GRNND_HOST_DEVICE float code_constant_step(float acc, float q, float offset, Metric metric) {
  if (metric == Metric::kL2) {
    const float u = q - offset;
    return fmaf(u, u, acc);
  }
  return fmaf(q, offset, acc);
}

// The constant term of the query's distances from code_constant_step's sum.
GRNND_HOST_DEVICE float code_bias(float sum, Metric metric) {
  return metric == Metric::kL2 ? sum : metric == Metric::kIP ? -sum : 1.0f - sum;
}

GRNND_HOST_DEVICE float code_query_scale(float largest_term) {
  return largest_term > 0.0f ? largest_term / static_cast<float>(kCodeQueryLevels) : 1.0f;
}

// A_d, clamped (rounding cannot pass the largest term, but a NaN query must not overflow).
GRNND_HOST_DEVICE int code_query_level(float term, float scale) {
  const float level = rintf(term / scale);
  return level >= static_cast<float>(kCodeQueryLevels)    ? kCodeQueryLevels
         : level <= -static_cast<float>(kCodeQueryLevels) ? -kCodeQueryLevels
         : level == level                                 ? static_cast<int>(level)
                                                          : 0;
}

// The distance from the integer sums <hi, c> and <lo, c>, the query's scale and bias, and the
// row's norm term (l2). The products and sums are rounded one at a time on both devices.
GRNND_HOST_DEVICE float code_distance(int32_t hi_dot, int32_t lo_dot, float scale, float bias, float row_norm,
                                      Metric metric) {
  const float sum = static_cast<float>(static_cast<int64_t>(hi_dot) * 256 + lo_dot);
#if defined(__CUDA_ARCH__)
  const float dot = __fmul_rn(sum, scale);
  return metric == Metric::kL2 ? __fadd_rn(__fsub_rn(bias, __fmul_rn(2.0f, dot)), row_norm) : __fsub_rn(bias, dot);
#else
  const float dot = sum * scale;
  return metric == Metric::kL2 ? (bias - 2.0f * dot) + row_norm : bias - dot;
#endif
}

// Lanes of a warp each accumulate the constant over d = lane, lane + 32, ...; the 32 partial
// sums are then added in xor-butterfly order (offsets 16, 8, 4, 2, 1), as the GPU's shuffles
// add them. The CPU runs the same steps, so both get the same constant.
constexpr int kCodeConstantLanes = 32;

}  // namespace grnnd
