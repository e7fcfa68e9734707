// Input validation shared by every kernel, so CPU and CUDA reject the same inputs with the
// same messages. Each message names the argument and says what was expected. Defined once in
// checks.cpp (compiled by the host compiler) rather than inline in every CPU and CUDA unit.
#pragma once

#include <ATen/ATen.h>

#include "codes.h"
#include "params.h"
#include "../pyg/segments.h"

namespace grnnd {

// A matrix of vectors, one per row: `data`, `queries`.
void check_points(const at::Tensor& t, const char* name);

// NaN/Inf rows make every distance comparison meaningless; name the first offending row.
// Reads the whole tensor (one reduction, and on CUDA one host synchronisation); skipped where
// contents are not readable.
void check_finite(const at::Tensor& t, const char* name);

// The error both check_finite and the CUDA search (which finds the row in its own kernel) raise.
[[noreturn]] void fail_non_finite(const char* name, int64_t row);

void check_same_device(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name);

void check_same_dim(const at::Tensor& data, const at::Tensor& queries);

void check_k(int64_t k, int64_t n, const char* what);

// Whether the checks that read a tensor's values (finite rows, graph ids) may run: always on the
// CPU; on CUDA unless the current stream is being captured into a CUDA graph, where the host
// cannot wait for a result. Captured searches rely on the kernels' own bounds (they skip ids
// outside [0, n) and order NaN distances last).
bool contents_readable(const at::Tensor& t);

// gather_rows' inputs: data a matrix of rows, ids int64 [m] in [0, n) (read unless captured).
void check_gather_rows(const at::Tensor& data, const at::Tensor& ids);

// A graph as `build` returns it: int32 [n, degree], -1 as padding; its shape and type.
void check_graph(const at::Tensor& graph, const at::Tensor& data);

// A boolean mask over data ids: true = may be returned; its shape and type.
void check_filter(const c10::optional<at::Tensor>& filter, const at::Tensor& data);

// The search's data rows lie on the queries' device or, for a search on a GPU, in pinned host
// memory, which the kernel reads through unified addressing (an index larger than the GPU).
void check_search_data_device(const at::Tensor& data, const at::Tensor& queries);

// What each op accepts, in one place for all its kernels and devices.
void check_build_inputs(const at::Tensor& data);
// The one-byte codes a build's update rounds take their pair distances from, or none: uint8
// [n, stride] on data's device, stride a multiple of 16 of at least dim (zeros past dim), code
// = round((x - offset) / step) with one step for every dimension, and `scale` that step squared,
// so that d(a, b) = scale * sum over dimensions of (code_a - code_b)^2 (pair_code_distance). l2
// and cosine (the codes of the unit rows, half that scale: 1 - cos is half the squared distance
// of unit rows), at most kMaxPairCodeStride bytes a row (the sum stays in 32 bits). Returned
// contiguous, or undefined when none are given.
constexpr int64_t kMaxPairCodeStride = 65536;
at::Tensor check_pair_codes(const c10::optional<at::Tensor>& codes, double scale, const at::Tensor& data,
                            Metric metric);
void check_search_inputs(const at::Tensor& data, const at::Tensor& graph, const at::Tensor& queries, int64_t k,
                         const c10::optional<at::Tensor>& filter);
// The codes a search traverses by (csrc/core/codes.h), or neither tensor: codes uint8
// [n, code_row_bytes(dim, metric, kind)] and code_grid float32, [2, dim] for int8 (offsets,
// steps) or [dim + C, dim] for int4 (rotation, C cell centres), on the queries' device; returned
// contiguous and 16-byte aligned (copied where they are not).
struct SearchCodes {
  at::Tensor codes;  // undefined: the traversal reads the rows
  at::Tensor grid;
  CodeKind kind = CodeKind::kInt8;
  int64_t dims = 0;   // codes per row, padding included: code_dims(dim), or int4's coordinates kept (codes.h)
  int64_t bytes = 0;  // bytes of those codes, the tail not counted
};
SearchCodes check_search_codes(const c10::optional<at::Tensor>& codes, const c10::optional<at::Tensor>& code_grid,
                               const at::Tensor& data, const at::Tensor& queries, Metric metric);
// The search's checks that read tensor values, after every argument check: graph ids in [-1, n)
// (scanned once per graph and version, CheckedGraphs in checks.cpp) and, on the CPU, finite
// queries. Skipped where contents are not readable.
void check_search_contents(const at::Tensor& data, const at::Tensor& graph, const at::Tensor& queries);
// The op fill's (and connect's) data and graph: a search's checks of both, contents included.
void check_fill_inputs(const at::Tensor& data, const at::Tensor& graph);
void check_knn_inputs(const at::Tensor& data, const at::Tensor& queries, int64_t k);
// knn_segments' examples of x in the form the caller gave them (grnnd.cpp): ptr [examples + 1],
// or a sorted batch vector [nx] and the number of examples.
struct SegmentsOfX {
  at::Tensor ptr;    // int64 [examples + 1], contiguous; undefined when given as batch_x
  at::Tensor batch;  // int64 [nx], contiguous; undefined when given as ptr_x
  int64_t examples;

  // ptr, made from batch where that is the form given (a search, no host synchronisation).
  at::Tensor as_ptr() const;
};

// knn_segments: float32 x [nx, D] and y [ny, D] (either may be empty), int64 batch_y [ny], and
// x's examples as exactly one of int64 ptr_x [examples + 1] or batch_x [nx] (with `examples`,
// -1: read from batch_x, one host synchronisation), all on one device. Values are not read
// otherwise: the kernels clamp them (segments.h).
SegmentsOfX check_knn_segments_inputs(const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& ptr_x,
                                      const at::Tensor& batch_y, int64_t k, const c10::optional<at::Tensor>& batch_x,
                                      int64_t examples);

// segment_edges' inputs: knn_segments' (dists, ids), float32 and int64 [queries, k] on one
// device, and most >= -1. Returns the filter they ask for.
EdgeFilter check_segment_edges_inputs(const at::Tensor& dists, const at::Tensor& ids,
                                      const c10::optional<double>& max_distance, bool drop_self, int64_t most);
// prune_rows (prune.h): data [n, D], int64 vertices [m] in [0, n) (read where contents are
// readable), int32/int64 candidates [m, c] with c <= kMaxPruneCandidates (any values: those
// outside [0, n) are no candidates), 1 <= degree <= kMaxPoolSize, fixed >= 0, and 0 with shrink.
void check_prune_inputs(const at::Tensor& data, const at::Tensor& vertices, const at::Tensor& candidates,
                        int64_t degree, int64_t fixed, bool shrink);

}  // namespace grnnd
