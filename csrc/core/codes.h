// Compact codes of the data rows: what the search's traversal reads instead of the rows
// (DESIGN.md, "Search at the memory limit"). Two kinds: 8-bit scalar codes ("int8") and 4-bit
// codes of the randomly rotated rows with a per-row scale ("int4", below the int8 part). The CPU and CUDA searches share every formula here,
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

// The kinds of codes, told apart by the shape of their grid (code_kind_of).
enum class CodeKind { kInt8, kInt4 };

// Codes per row, padded so that a row is a whole number of 16-byte loads: 16 bytes hold 16 int8
// codes or 32 int4 codes.
GRNND_HOST_DEVICE int64_t code_dims(int64_t dim, CodeKind kind = CodeKind::kInt8) {
  return kind == CodeKind::kInt8 ? (dim + 15) / 16 * 16 : (dim + 31) / 32 * 32;
}

// Bytes of a row's codes, the tail not counted.
GRNND_HOST_DEVICE int64_t code_bytes(int64_t dim, CodeKind kind) {
  return kind == CodeKind::kInt8 ? code_dims(dim, kind) : code_dims(dim, kind) / 2;
}

// Bytes of one code row: its codes, then a 16-byte tail where the kind needs one (int8: the
// row's norm term under l2; int4: its alpha, K and cell under every metric). int4 rows that keep
// fewer coordinates are narrower (int4_row_bytes_fit).
GRNND_HOST_DEVICE int64_t code_row_bytes(int64_t dim, Metric metric, CodeKind kind = CodeKind::kInt8) {
  const bool tail = kind == CodeKind::kInt4 || metric == Metric::kL2;
  return code_bytes(dim, kind) + (tail ? 16 : 0);
}

// The most cells an int4 grid holds (below): a query keeps a dot per cell, 4 bytes each.
constexpr int64_t kMaxInt4Cells = 4096;

// The kind whose grid has `grid_rows` rows for rows of `dim`: int8 grids are [2, dim] (offsets,
// steps), int4 grids [dim + C, dim] (the rotation, then C cell centres, below); int4 needs
// dim >= 2, so the shapes never meet. -1: neither.
inline int code_kind_of(int64_t grid_rows, int64_t dim) {
  if (grid_rows == 2) return static_cast<int>(CodeKind::kInt8);
  if (dim >= 2 && grid_rows > dim && grid_rows - dim <= kMaxInt4Cells) return static_cast<int>(CodeKind::kInt4);
  return -1;
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

// ---- int4: 4-bit codes of the rotated rows, each about its cell's centre (after RaBitQ and
// IVF-RaBitQ, seeds/README.md) ----
//
// Encoding (torch_grnnd/codes.py): a random orthogonal matrix P (fixed seed) and C >= 1 cell
// centres c_0 .. c_{C-1} (k-means of the rows; cosine rows once normalised). A row x of cell j
// (its nearest centre) is coded by r = P e, e = x - c_j: with a step t_x of its own,
// u_d = clamp(round(r_d / t_x + 7.5), 0, 15), so v = u - 7.5 lies on a grid symmetric about 0;
// t_x is the step, of a few tried, whose v points closest to r's direction. Rotated, every
// coordinate carries about the same share of the row, so one step per row fits them all.
//
// Estimate: <e, w> ~ alpha <v, P w> with alpha = |r|^2 / <v, r>, RaBitQ's estimator: exact for
// w = e, and in that paper's analysis unbiased over random rotations. Its error grows with
// |e| |w|, so it is applied to w = q - c_j, the query about the row's own centre: rows of one
// tight cluster are told apart by their small e, not lost in the cluster's offset from one
// global centre (on clustered rows recall at a short list fell 0.1-0.2 with a single centre).
// With y = P (q - c_0) under l2 and y = P q otherwise, W_j = c_j - c_0 under l2 and c_j
// otherwise, and the query's cell dots t_j = <q - c_0, W_j> (l2) or <q, W_j>:
//   l2:     |q - x|^2 = |q - c_0|^2 - 2 t_j + K - 2 alpha <v, y>,  K = |W_j|^2 + |r|^2 + 2 alpha <v, P W_j>
//   ip:     -<q, x>   = -t_j + K - alpha <v, y>,                   K = alpha <v, P c_j> - <c_j, e>
//   cosine: 1 - <q, x> = 1 - t_j + K - alpha <v, y>                (q normalised)
// so a row keeps one float K beside alpha, and the query computes y and its C dots once
// (int4_rotation_step) and looks up t_j per row. y is quantised as for int8 (16-bit
// levels A_d, split into bytes) and <v, A> = <u, A> - 7.5 sum A is computed in integers, as
// e = 2 <u, A> - 15 sum A, so <v, y> ~ scale e / 2.
//
// Layout of a row: [code_dims / 2 bytes: byte j holds u_{2j} in its low and u_{2j+1} in its high
// nibble, zero padded] [16 bytes: float32 alpha, float32 K, int32 cell j, 4 bytes of padding].
// The grid: float32 [D + C, D], rows 0..D-1 the rotation transposed (row d holds P's column d,
// so that y = u @ grid[:D] for a row vector u), rows D..D+C-1 the centres. With C = 1 and l2 this
// is the single-centre layout of earlier versions, whose codes it reads unchanged (W_0 = 0,
// K = |r|^2, cell 0); earlier ip and cosine codes had no K and are coded again on loading.
//
// Fewer coordinates: where the residuals e leave almost nothing on their last principal axes,
// P is those axes' leading D' (a multiple of 32 below code_dims(D)) turned by a random rotation
// among themselves, and the grid's rotation columns past D' are zero; a row then holds D' / 2
// bytes of codes, so y's terms past D' are 0 and never read. The part of <e, w> on the axes left
// out is taken as 0, and under l2 K holds the whole |e|^2 in place of |r|^2. The search learns D'
// from the width of the code rows (int4_row_bytes_fit); it does not read the grid to check that
// the two agree (a host synchronisation per call), torch_grnnd.Codes does.

constexpr float kInt4HalfRange = 7.5f;  // v = u - 7.5, u in [0, 15]
constexpr int64_t kInt4TailBytes = 16;   // alpha, K, the cell, padding

// Whether int4 code rows of `width` bytes fit rows of `dim`: a tail and whole 16-byte chunks of
// codes (32 coordinates each), every coordinate's or fewer (above).
inline bool int4_row_bytes_fit(int64_t width, int64_t dim) {
  const int64_t bytes = width - kInt4TailBytes;
  return bytes >= 16 && bytes % 16 == 0 && bytes <= code_bytes(dim, CodeKind::kInt4);
}

// Where the query keeps the term of dimension d: each 4-byte word of codes holds 8 dimensions,
// the even ones in its low nibbles and the odd ones in its high nibbles, so a word's 8 terms are
// stored even dimensions first (masking the word's low or high nibbles gives 4 bytes that line
// up with 4 terms).
GRNND_HOST_DEVICE int64_t int4_query_slot(int64_t d) {
  const int64_t in_word = d % 8;
  return d - in_word + (in_word % 2) * 4 + in_word / 2;
}

// One step of y_i = sum_d grid[d][i] u_d, or of the cell dot t_j = sum_d W_jd u_d (u_d = q_d - c_0d
// under l2, q_d otherwise). Both devices sum in the same order: over the dimensions of each chunk
// of kInt4RotationChunk (from d = 0) in order, then the chunks' sums in order, so that the GPU
// may sum a query's chunks in parallel (rotate_queries, search_cuda.cu).
GRNND_HOST_DEVICE float int4_rotation_step(float acc, float rotation, float u) { return fmaf(rotation, u, acc); }
constexpr int kInt4RotationChunk = 32;

GRNND_HOST_DEVICE float int4_rotation_input(float q, float centre, Metric metric) {
  return metric == Metric::kL2 ? q - centre : q;
}

// W_jd from the grid's centres c_jd and c_0d.
GRNND_HOST_DEVICE float int4_cell_offset(float cell, float first_cell, Metric metric) {
  return metric == Metric::kL2 ? cell - first_cell : cell;
}

// The row's cell, clamped into the grid (a damaged code row must not read outside the dots).
GRNND_HOST_DEVICE uint32_t int4_cell_of(uint32_t stored, int64_t cells) {
  return stored < static_cast<uint64_t>(cells) ? stored : static_cast<uint32_t>(cells - 1);
}

// The constant of a query's distances to rows of cell j: |q - c_0|^2 - 2 t_j (l2; `constant` is
// |q - c_0|^2, code_bias's), -t_j (ip) or 1 - t_j (cosine). 2 t_j is exact, so one rounding.
GRNND_HOST_DEVICE float int4_cell_bias(float constant, float cell_dot, Metric metric) {
#if defined(__CUDA_ARCH__)
  return metric == Metric::kL2 ? __fsub_rn(constant, 2.0f * cell_dot)
         : metric == Metric::kIP ? -cell_dot
                                 : __fsub_rn(1.0f, cell_dot);
#else
  return metric == Metric::kL2 ? constant - 2.0f * cell_dot : metric == Metric::kIP ? -cell_dot : 1.0f - cell_dot;
#endif
}

// The distance from the integer sums <hi, u>, <lo, u> and sum A, the query's scale, the bias of
// the row's cell (int4_cell_bias), and the row's alpha and K. Rounded one step at a time on both
// devices.
GRNND_HOST_DEVICE float int4_code_distance(int32_t hi_dot, int32_t lo_dot, int32_t level_sum, float scale,
                                           float bias, float alpha, float k, Metric metric) {
  const int64_t dot = static_cast<int64_t>(hi_dot) * 256 + lo_dot;
  const float e = static_cast<float>(2 * dot - 15 * static_cast<int64_t>(level_sum));
  const float half_scale = 0.5f * scale;  // exact
#if defined(__CUDA_ARCH__)
  const float inner = __fmul_rn(__fmul_rn(e, half_scale), alpha);
  return __fadd_rn(__fsub_rn(bias, metric == Metric::kL2 ? __fmul_rn(2.0f, inner) : inner), k);
#else
  const float inner = (e * half_scale) * alpha;
  return (bias - (metric == Metric::kL2 ? 2.0f * inner : inner)) + k;
#endif
}

}  // namespace grnnd
