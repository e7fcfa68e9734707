// Input validation shared by every kernel, so CPU and CUDA reject the same inputs with the
// same messages. Each message names the argument and says what was expected. Defined once in
// checks.cpp (compiled by the host compiler) rather than inline in every CPU and CUDA unit.
#pragma once

#include <ATen/ATen.h>

namespace grnnd {

// A matrix of vectors, one per row: `data`, `queries`.
void check_points(const at::Tensor& t, const char* name);

// NaN/Inf rows make every distance comparison meaningless; name the first offending row.
// Reads the whole tensor (and synchronises on CUDA), so callers use it outside hot paths.
void check_finite(const at::Tensor& t, const char* name);

void check_same_device(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name);

void check_same_dim(const at::Tensor& data, const at::Tensor& queries);

void check_k(int64_t k, int64_t n, const char* what);

// A graph as `build` returns it: int32 [n, degree], ids in [0, n), -1 as padding.
// `check_ids` scans the ids (a host synchronisation on CUDA).
void check_graph(const at::Tensor& graph, const at::Tensor& data, bool check_ids);

// A boolean mask over data ids: true = may be returned.
void check_filter(const c10::optional<at::Tensor>& filter, const at::Tensor& data);

// What each op accepts, in one place for all its kernels. `read_contents` adds the checks
// that scan the tensors (finite queries, graph ids in range), which the CUDA search skips.
void check_build_inputs(const at::Tensor& data);
void check_search_inputs(const at::Tensor& data, const at::Tensor& graph, const at::Tensor& queries, int64_t k,
                         const c10::optional<at::Tensor>& filter, bool read_contents);
void check_knn_inputs(const at::Tensor& data, const at::Tensor& queries, int64_t k);

}  // namespace grnnd
