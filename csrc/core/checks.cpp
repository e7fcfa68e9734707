#include "checks.h"

#include "codes.h"
#include "params.h"
#include "../build/prune.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <mutex>

#include <c10/util/intrusive_ptr.h>

#ifdef GRNND_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace grnnd {

bool contents_readable(const at::Tensor& t) {
#ifdef GRNND_WITH_CUDA
  if (t.is_cuda()) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(t.device().index()).stream(), &status));
    return status == cudaStreamCaptureStatusNone;
  }
#endif
  return !t.is_meta();
}

namespace {

// Graphs whose ids were found in range, so that a graph searched many times is scanned once (the
// scan reads N * degree ids and, on CUDA, waits for the result). An entry holds its graph weakly:
// the TensorImpl's address cannot be reused while the entry lives, and a graph that was freed
// never matches. Any in-place write through torch bumps the version and forces a new scan.
struct CheckedGraph {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  const void* ids;
  int64_t version;
  int64_t n;
};

class CheckedGraphs {
 public:
  bool contains(const at::Tensor& graph, int64_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const CheckedGraph& e : entries_) {
      if (!e.impl.expired() && e.impl._unsafe_get_target() == graph.unsafeGetTensorImpl() &&
          e.ids == graph.const_data_ptr() && e.version == graph._version() && e.n == n) {
        return true;
      }
    }
    return false;
  }

  void add(const at::Tensor& graph, int64_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (entries_.size() == kCapacity) entries_.pop_front();
    entries_.push_back({c10::weak_intrusive_ptr<c10::TensorImpl>(graph.getIntrusivePtr()), graph.const_data_ptr(),
                        graph._version(), n});
  }

 private:
  static constexpr size_t kCapacity = 16;  // graphs searched in turn (several indexes, shards)
  std::mutex mutex_;
  std::deque<CheckedGraph> entries_;
};

CheckedGraphs& checked_graphs() {
  static CheckedGraphs graphs;
  return graphs;
}

void check_graph_ids(const at::Tensor& graph, int64_t n) {
  if (graph.numel() == 0 || !contents_readable(graph) || checked_graphs().contains(graph, n)) return;
  const auto [lo, hi] = at::aminmax(graph);
  const int64_t min_id = lo.item<int64_t>(), max_id = hi.item<int64_t>();
  TORCH_CHECK_VALUE(min_id >= -1 && max_id < n, "graph: ids must lie in [0, ", n, ") with -1 as padding, found ",
                    min_id < -1 ? min_id : max_id, "; was it built on other data?");
  checked_graphs().add(graph, n);
}

}  // namespace

void check_points(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 2, name, ": expected a 2-D tensor [n, dim], got ", t.dim(), "-D with shape ",
                    t.sizes());
  const auto type = t.scalar_type();
  TORCH_CHECK_TYPE(type == at::kFloat || type == at::kHalf || type == at::kBFloat16 || type == at::kDouble, name,
                   ": expected float32, float16, bfloat16 or float64, got ", type);
  TORCH_CHECK_VALUE(t.size(0) >= 1, name, ": expected at least one row, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.size(1) >= 1, name, ": expected at least one column, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.size(0) < std::numeric_limits<int32_t>::max(), name,
                    ": expected fewer than 2^31 - 1 rows (ids are int32), got ", t.size(0));
}

void check_finite(const at::Tensor& t, const char* name) {
  if (!contents_readable(t)) return;
  // A NaN or Inf makes its row's float32 sum non-finite, so only the rows whose sum is not
  // finite need an element-wise look (a finite row can still overflow float32 in the sum).
  // This costs one float per row instead of a bool per element.
  const at::Tensor suspects = at::logical_not(at::isfinite(t.sum(1, /*keepdim=*/false, at::kFloat)));
  if (!suspects.any().item<bool>()) return;
  const at::Tensor rows = suspects.nonzero().select(1, 0);
  const at::Tensor bad = at::logical_not(at::isfinite(t.index_select(0, rows))).any(1);
  if (bad.any().item<bool>()) {
    fail_non_finite(name, rows.masked_select(bad)[0].item<int64_t>());
  }
}

void fail_non_finite(const char* name, int64_t row) {
  TORCH_CHECK_VALUE(false, name, ": expected finite values, row ", row, " holds NaN or Inf");
}

void check_same_device(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK_VALUE(a.device() == b.device(), a_name, " is on ", a.device(), " but ", b_name, " is on ", b.device(),
                    "; move them to the same device");
}

void check_gather_rows(const at::Tensor& data, const at::Tensor& ids) {
  TORCH_CHECK_VALUE(data.dim() == 2, "data: expected a matrix [n, dim], got ", data.dim(), " dims");
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids: expected int64 [m], got ",
                    ids.scalar_type(), " with ", ids.dim(), " dims");
  if (ids.numel() > 0 && contents_readable(ids)) {
    const auto [low, high] = at::aminmax(ids);
    const int64_t lo = low.item<int64_t>(), hi = high.item<int64_t>();
    TORCH_CHECK_INDEX(lo >= 0 && hi < data.size(0), "ids: expected ids in [0, ", data.size(0), "), got ",
                      lo < 0 ? lo : hi);
  }
}

void check_same_dim(const at::Tensor& data, const at::Tensor& queries) {
  TORCH_CHECK_VALUE(queries.size(1) == data.size(1), "queries: expected dim ", data.size(1),
                    " to match data, got ", queries.size(1));
}

void check_k(int64_t k, int64_t n, const char* what) {
  TORCH_CHECK_VALUE(k >= 1 && k <= n, "k: expected 1 <= k <= ", n, " (", what, "), got ", k);
}

void check_graph(const at::Tensor& graph, const at::Tensor& data) {
  TORCH_CHECK_VALUE(graph.dim() == 2, "graph: expected a 2-D tensor [n, degree], got shape ", graph.sizes());
  TORCH_CHECK_TYPE(graph.scalar_type() == at::kInt, "graph: expected int32 (as build returns), got ",
                   graph.scalar_type());
  TORCH_CHECK_VALUE(graph.size(0) == data.size(0), "graph: has ", graph.size(0), " rows but data has ", data.size(0),
                    "; was it built on other data?");
  TORCH_CHECK_VALUE(graph.size(1) >= 1, "graph: expected at least one column, got shape ", graph.sizes());
}

void check_filter(const c10::optional<at::Tensor>& filter, const at::Tensor& data) {
  if (!filter.has_value()) return;
  const at::Tensor& f = *filter;
  TORCH_CHECK_TYPE(f.scalar_type() == at::kBool, "filter: expected a bool tensor, got ", f.scalar_type());
  TORCH_CHECK_VALUE(f.dim() == 1 && f.size(0) == data.size(0), "filter: expected shape [", data.size(0),
                    "] (one flag per data row), got ", f.sizes());
}

void check_search_data_device(const at::Tensor& data, const at::Tensor& queries) {
  if (queries.is_cuda() && data.device().is_cpu()) {
    TORCH_CHECK_VALUE(data.is_pinned(), "data: rows on the CPU are searched from a GPU only from pinned memory; "
                      "pass data.pin_memory() (or move the rows to the GPU)");
    return;
  }
  check_same_device(data, "data", queries, "queries");
}

void check_build_inputs(const at::Tensor& data) {
  check_points(data, "data");
  check_finite(data, "data");
}

at::Tensor check_pair_codes(const c10::optional<at::Tensor>& codes, double scale, const at::Tensor& data,
                            Metric metric) {
  if (!codes.has_value() || !codes->defined()) return at::Tensor();
  const at::Tensor& t = *codes;
  TORCH_CHECK_VALUE(metric == Metric::kL2 || metric == Metric::kCosine,
                    "pair_code_rows: the build takes pair distances from codes under l2 and cosine only");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kByte, "pair_code_rows: expected uint8, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == data.size(0) && t.size(1) % 16 == 0 && t.size(1) >= data.size(1) &&
                        t.size(1) <= kMaxPairCodeStride,
                    "pair_code_rows: expected shape [", data.size(0), ", stride] with stride a multiple of 16 from ",
                    data.size(1), " to ", kMaxPairCodeStride, ", got ", t.sizes());
  check_same_device(data, "data", t, "pair_code_rows");
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0, "pair_code_scale: expected a positive finite step squared, got ",
                    scale);
  // Rows are read 16 bytes at a time: a view that starts off that boundary is copied.
  const at::Tensor rows = t.contiguous();
  return reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0 ? rows : rows.clone();
}

void check_search_inputs(const at::Tensor& data, const at::Tensor& graph, const at::Tensor& queries, int64_t k,
                         const c10::optional<at::Tensor>& filter) {
  check_points(data, "data");
  check_points(queries, "queries");
  check_search_data_device(data, queries);
  check_same_dim(data, queries);
  check_k(k, data.size(0), "number of data rows");
  check_filter(filter, data);
  check_graph(graph, data);
  // The graph and the filter are read on the search's device, the queries'.
  if (filter.has_value()) check_same_device(queries, "queries", *filter, "filter");
  check_same_device(queries, "queries", graph, "graph");
}

SearchCodes check_search_codes(const c10::optional<at::Tensor>& codes, const c10::optional<at::Tensor>& code_grid,
                               const at::Tensor& data, const at::Tensor& queries, Metric metric) {
  TORCH_CHECK_VALUE(codes.has_value() == code_grid.has_value(), "codes and code_grid: expected both or neither, got ",
                    codes.has_value() ? "codes alone" : "code_grid alone");
  if (!codes.has_value()) return {};
  const int64_t n = data.size(0), dim = data.size(1);
  TORCH_CHECK_VALUE(dim <= kMaxCodeDim, "codes: expected data of at most ", kMaxCodeDim, " dimensions, got ", dim);
  // The grid's shape says the kind (code_kind_of), so it is checked first.
  TORCH_CHECK_TYPE(code_grid->scalar_type() == at::kFloat, "code_grid: expected float32, got ",
                   code_grid->scalar_type());
  const int kind = code_grid->dim() == 2 && code_grid->size(1) == dim ? code_kind_of(code_grid->size(0), dim) : -1;
  TORCH_CHECK_VALUE(kind >= 0, "code_grid: expected shape [2, ", dim, "] (int8: offsets and steps) or [", dim,
                    " + C, ", dim, "] with 1 <= C <= ", kMaxInt4Cells, " (int4: rotation and cell centres), got ",
                    code_grid->sizes());
  const CodeKind code_kind = static_cast<CodeKind>(kind);
  const int64_t row_bytes = code_row_bytes(dim, metric, code_kind);
  TORCH_CHECK_TYPE(codes->scalar_type() == at::kByte, "codes: expected uint8, got ", codes->scalar_type());
  // int4 codes may keep fewer coordinates than the rows have, in groups of 32 (codes.h), so
  // their width says how many; int8 codes keep every dimension.
  const int64_t width = codes->dim() == 2 ? codes->size(1) : -1;
  const bool fits = code_kind == CodeKind::kInt8 ? width == row_bytes
                                                  : int4_row_bytes_fit(width, dim);
  TORCH_CHECK_VALUE(codes->dim() == 2 && codes->size(0) == n && fits, "codes: expected shape [", n, ", ", row_bytes,
                    "] (the ", code_kind == CodeKind::kInt8 ? "int8" : "int4",
                    " codes of data's rows for this metric, torch_grnnd.encode",
                    code_kind == CodeKind::kInt4 ? "; or a width of 16 + 16 m below it, int4 codes of fewer coordinates"
                                                 : "",
                    "), got ", codes->sizes());
  check_same_device(queries, "queries", *codes, "codes");
  check_same_device(queries, "queries", *code_grid, "code_grid");
  at::Tensor rows = codes->contiguous();
  if (reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 != 0) rows = rows.clone();  // 16-byte loads
  const int64_t bytes = code_kind == CodeKind::kInt8 ? code_bytes(dim, code_kind) : width - kInt4TailBytes;
  return {rows, code_grid->contiguous(), code_kind, code_kind == CodeKind::kInt8 ? code_dims(dim) : 2 * bytes, bytes};
}

void check_search_contents(const at::Tensor& data, const at::Tensor& graph, const at::Tensor& queries) {
  check_graph_ids(graph, data.size(0));
  // The CUDA search finds non-finite query rows in a kernel of its own and reads the answer once,
  // after the search is queued (search_cuda.cu, QueryCheck): one host synchronisation per call
  // and no reduction chain in front of the search.
  if (!queries.is_cuda()) check_finite(queries, "queries");
}

void check_fill_inputs(const at::Tensor& data, const at::Tensor& graph) {
  check_search_inputs(data, graph, data, 1, c10::nullopt);
  // No build makes wider rows, and the fill's shared memory grows with the width (fill_cuda.cu).
  TORCH_CHECK_VALUE(graph.size(1) <= kMaxPoolSize, "graph: expected at most ", kMaxPoolSize,
                    " columns (the largest degree a build makes), got ", graph.size(1));
  check_search_contents(data, graph, data);
}

void check_knn_inputs(const at::Tensor& data, const at::Tensor& queries, int64_t k) {
  check_points(data, "data");
  check_points(queries, "queries");
  check_same_device(data, "data", queries, "queries");
  check_same_dim(data, queries);
  check_k(k, data.size(0), "number of data rows");
  TORCH_CHECK_VALUE(k <= kMaxKnnK, "k: expected at most ", kMaxKnnK, " for exact knn, got ", k);
  check_finite(data, "data");
  check_finite(queries, "queries");
}

SegmentsOfX check_knn_segments_inputs(const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& ptr_x,
                                      const at::Tensor& batch_y, int64_t k, const c10::optional<at::Tensor>& batch_x,
                                      int64_t examples) {
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{x, "x"}, {y, "y"}}) {
    TORCH_CHECK_VALUE(t.dim() == 2, name, ": expected a 2-D tensor [n, dim], got shape ", t.sizes());
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, ": expected float32, got ", t.scalar_type());
  }
  TORCH_CHECK_VALUE(x.size(1) == y.size(1), "y: expected dim ", x.size(1), " to match x, got ", y.size(1));
  TORCH_CHECK_VALUE(x.size(0) < std::numeric_limits<int32_t>::max(), "x: expected fewer than 2^31 - 1 rows");
  TORCH_CHECK_VALUE(ptr_x.has_value() != batch_x.has_value(),
                    "knn_segments: expected x's examples as exactly one of ptr_x and batch_x, got ",
                    ptr_x.has_value() ? "both" : "neither");
  TORCH_CHECK_TYPE(batch_y.scalar_type() == at::kLong, "batch_y: expected int64, got ", batch_y.scalar_type());
  TORCH_CHECK_VALUE(batch_y.dim() == 1 && batch_y.size(0) == y.size(0), "batch_y: expected shape [", y.size(0),
                    "] (one example index per row of y), got ", batch_y.sizes());
  check_same_device(x, "x", y, "y");
  check_same_device(x, "x", batch_y, "batch_y");
  TORCH_CHECK_VALUE(k >= 1, "k: expected >= 1, got ", k);
  SegmentsOfX segments;
  if (ptr_x.has_value()) {
    const at::Tensor& ptr = *ptr_x;
    TORCH_CHECK_TYPE(ptr.scalar_type() == at::kLong, "ptr_x: expected int64, got ", ptr.scalar_type());
    TORCH_CHECK_VALUE(ptr.dim() == 1 && ptr.size(0) >= 2, "ptr_x: expected shape [examples + 1], got ", ptr.sizes());
    TORCH_CHECK_VALUE(examples == -1 || examples == ptr.size(0) - 1, "examples: expected -1 or ", ptr.size(0) - 1,
                      " (ptr_x's), got ", examples);
    check_same_device(x, "x", ptr, "ptr_x");
    segments.ptr = ptr.contiguous();
    segments.examples = ptr.size(0) - 1;
    return segments;
  }
  const at::Tensor& batch = *batch_x;
  TORCH_CHECK_TYPE(batch.scalar_type() == at::kLong, "batch_x: expected int64, got ", batch.scalar_type());
  TORCH_CHECK_VALUE(batch.dim() == 1 && batch.size(0) == x.size(0), "batch_x: expected shape [", x.size(0),
                    "] (one example index per row of x, ascending), got ", batch.sizes());
  TORCH_CHECK_VALUE(examples >= -1, "examples: expected >= 0 (or -1: read from batch_x), got ", examples);
  check_same_device(x, "x", batch, "batch_x");
  segments.batch = batch.contiguous();
  segments.examples = examples >= 0 ? examples
                      : batch.numel() == 0 ? 0
                                           : std::max<int64_t>(0, batch.max().item<int64_t>() + 1);
  return segments;
}

at::Tensor SegmentsOfX::as_ptr() const {
  if (ptr.defined()) return ptr;
  return at::searchsorted(batch, at::arange(examples + 1, batch.options()));
}

EdgeFilter check_segment_edges_inputs(const at::Tensor& dists, const at::Tensor& ids,
                                      const c10::optional<double>& max_distance, bool drop_self, int64_t most) {
  TORCH_CHECK_VALUE(most >= -1, "most: expected -1 (every kept entry) or a number of entries >= 0, got ", most);
  TORCH_CHECK_TYPE(dists.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong,
                   "dists, ids: expected float32 and int64 (knn_segments' results), got ", dists.scalar_type(),
                   " and ", ids.scalar_type());
  TORCH_CHECK_VALUE(ids.dim() == 2 && dists.sizes() == ids.sizes(),
                    "dists, ids: expected two tensors of one shape [queries, k], got ", dists.sizes(), " and ",
                    ids.sizes());
  check_same_device(ids, "ids", dists, "dists");
  TORCH_CHECK_VALUE(!max_distance.has_value() || !std::isnan(*max_distance), "max_distance: expected a number, got nan");
  return EdgeFilter{static_cast<float>(max_distance.value_or(0.0)), max_distance.has_value(), drop_self,
                    most < 0 ? std::numeric_limits<int64_t>::max() : most};
}

void check_prune_inputs(const at::Tensor& data, const at::Tensor& vertices, const at::Tensor& candidates,
                        int64_t degree, int64_t fixed, bool shrink) {
  check_points(data, "data");
  TORCH_CHECK_TYPE(vertices.scalar_type() == at::kLong, "vertices: expected int64, got ", vertices.scalar_type());
  TORCH_CHECK_TYPE(candidates.scalar_type() == at::kLong || candidates.scalar_type() == at::kInt,
                   "candidates: expected int32 or int64, got ", candidates.scalar_type());
  TORCH_CHECK_VALUE(vertices.dim() == 1, "vertices: expected shape [m], got ", vertices.sizes());
  TORCH_CHECK_VALUE(candidates.dim() == 2 && candidates.size(0) == vertices.size(0), "candidates: expected shape [",
                    vertices.size(0), ", c] (a row per vertex), got ", candidates.sizes());
  TORCH_CHECK_VALUE(candidates.size(1) <= kMaxPruneCandidates, "candidates: at most ", kMaxPruneCandidates,
                    " per vertex, got ", candidates.size(1));
  TORCH_CHECK_VALUE(degree >= 1 && degree <= kMaxPoolSize, "degree: expected 1 .. ", kMaxPoolSize, ", got ", degree);
  TORCH_CHECK_VALUE(fixed >= 0, "fixed: expected a number of columns >= 0, got ", fixed);
  TORCH_CHECK_VALUE(!shrink || fixed == 0, "fixed: a shrink keeps no column whatever the rule says (its first ",
                    "`degree` columns are the row); expected 0, got ", fixed);
  TORCH_CHECK_VALUE(data.size(0) < (int64_t{1} << 30) - 1, "data: prune_rows takes fewer than 2^30 - 1 rows");
  check_same_device(data, "data", vertices, "vertices");
  check_same_device(data, "data", candidates, "candidates");
  if (vertices.numel() > 0 && contents_readable(vertices)) {
    const auto [lo, hi] = at::aminmax(vertices);
    const int64_t low = lo.item<int64_t>(), high = hi.item<int64_t>();
    TORCH_CHECK_VALUE(low >= 0 && high < data.size(0), "vertices: expected ids in [0, ", data.size(0), "), found ",
                      low < 0 ? low : high);
  }
}

}  // namespace grnnd
