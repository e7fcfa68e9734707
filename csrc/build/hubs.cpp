// Hubs (hubs.h): the sample, nearest hubs by matrix products, the build's cells and the
// search's entry points. Plain ATen, so the CPU and CUDA kernels share one implementation.
#include "hubs.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "../pyg/segments.h"

namespace grnnd {

int64_t hub_count(int64_t n) {
  const int64_t count = n / kRowsPerHub;
  return count < kMinHubs ? 0 : std::min(count, kMaxHubs);
}

at::Tensor hub_ids(int64_t n, const at::TensorOptions& options) { return strata_rows(n, hub_count(n), options); }

at::Tensor strata_rows(int64_t n, int64_t count, const at::TensorOptions& options) {
  const at::Tensor j = at::arange(count, options.dtype(at::kLong));
  // hub_row, element-wise (so that it stays capturable in a CUDA graph: no copy from the host).
  const at::Tensor begin = at::floor_divide(j * n, count);
  const at::Tensor length = at::floor_divide((j + 1) * n, count) - begin;
  const at::Tensor hashed = at::remainder(j * int64_t{2654435761}, int64_t{1} << 32);
  return begin + at::remainder(hashed, length);
}

namespace {

// <rows, hubs> as float32 [m, h]: half-precision rows go through tensor cores with float32
// results (no overflow of large dot products in half precision).
at::Tensor dot_products(const at::Tensor& rows, const at::Tensor& hubs_t) {
  const bool half = rows.scalar_type() == at::kHalf || rows.scalar_type() == at::kBFloat16;
  if (half && rows.is_cuda()) return at::mm(rows, hubs_t, at::kFloat);
  return at::mm(rows.to(at::kFloat), hubs_t.to(at::kFloat));
}

// Columns of the k smallest of each row of CPU float32 scores [m, h], ascending by (score,
// column): the CUDA selection's order, ties to the lower column (smallest_scores_cuda), which
// at::topk leaves open. NaN and +inf rank as the largest finite float, as there, so every column
// can go in (insert_nearest, the exact kernels' best k).
at::Tensor smallest_columns_cpu(const at::Tensor& scores, int64_t k) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.dim() == 2,
              "smallest_columns_cpu: expected float32 CPU scores [m, h]");
  const at::Tensor contiguous = scores.contiguous();
  const int64_t m = contiguous.size(0), h = contiguous.size(1);
  at::Tensor out = at::empty({m, k}, contiguous.options().dtype(at::kLong));
  const float* data = contiguous.data_ptr<float>();
  int64_t* columns = out.data_ptr<int64_t>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> best(static_cast<size_t>(k));
    for (int64_t r = begin; r < end; ++r) {
      int64_t* kept = columns + r * k;
      std::fill(best.begin(), best.end(), INFINITY);
      std::fill(kept, kept + k, int64_t{-1});
      const float* row = data + r * h;
      for (int64_t c = 0; c < h; ++c) insert_nearest(best.data(), kept, k, std::fmin(row[c], FLT_MAX), c);
    }
  });
  return out;
}

}  // namespace

at::Tensor nearest_hubs(const at::Tensor& rows, const at::Tensor& hubs, int64_t k, Metric metric,
                        const at::Tensor& rows_lift, const at::Tensor& hubs_lift, int64_t max_scores) {
  const int64_t m = rows.size(0), h = hubs.size(0);
  k = std::min(k, h);
  // score(r, hub) = weight[hub] * <r, hub> + bias[hub] (+ the lift term), smaller is nearer;
  // terms that depend on the row alone do not change its ranking and are left out.
  const at::Tensor hubs_f = hubs.to(at::kFloat);
  at::Tensor weight, bias;
  switch (metric) {
    case Metric::kL2: {
      weight = at::full({h}, -2.0f, hubs_f.options());
      bias = hubs_f.pow(2).sum(1);
      if (hubs_lift.defined()) bias = bias + hubs_lift.pow(2);
      break;
    }
    case Metric::kIP:
      weight = at::full({h}, -1.0f, hubs_f.options());
      bias = at::zeros({h}, hubs_f.options());
      break;
    case Metric::kCosine:
      weight = -hubs_f.norm(2, {1}).clamp_min(1e-30).reciprocal();
      bias = at::zeros({h}, hubs_f.options());
      break;
  }
  const at::Tensor hubs_t = hubs.t();
  // The lift term is rows_lift[r] * lift_coef[hub].
  const at::Tensor lift_coef = hubs_lift.defined() ? (-2.0f * hubs_lift.to(at::kFloat)).contiguous() : at::Tensor();
  at::Tensor out = at::empty({m, k}, rows.options().dtype(at::kLong));
#ifdef GRNND_WITH_CUDA
  if (m > 0 && fused_nearest_hubs_apply(rows, hubs, k)) {
    // It pads the hub terms to whole tiles and takes every term to contiguous float32 itself.
    nearest_hubs_fused_cuda(rows, hubs, weight, bias, rows_lift, lift_coef, out);
    return out;
  }
#endif
  const int64_t chunk = std::max<int64_t>(1, max_scores / std::max<int64_t>(h, 1));
  for (int64_t start = 0; start < m; start += chunk) {
    const int64_t end = std::min(m, start + chunk);
    const at::Tensor row_lift = rows_lift.defined() ? rows_lift.slice(0, start, end).to(at::kFloat).contiguous()
                                                    : at::Tensor();
    at::Tensor scores = dot_products(rows.slice(0, start, end), hubs_t);
#ifdef GRNND_WITH_CUDA
    if (scores.is_cuda() && k <= kMaxFusedHubK) {
      at::Tensor part = out.slice(0, start, end);  // rows of a contiguous [m, k]: contiguous
      smallest_scores_cuda(scores, weight, bias, row_lift, lift_coef, part);
      continue;
    }
#endif
    scores.mul_(weight).add_(bias);
    if (row_lift.defined()) scores.addmm_(row_lift.unsqueeze(1), lift_coef.unsqueeze(0));
    out.slice(0, start, end)
        .copy_(scores.is_cuda() ? std::get<1>(at::topk(scores, k, 1, /*largest=*/false, /*sorted=*/true))
                                : smallest_columns_cpu(scores, k));
  }
  return out;
}

Cells partition_cells(const at::Tensor& x, const at::Tensor& lift) {
  const int64_t n = x.size(0);
  const int64_t count = hub_count(n);
  if (count == 0) return {};
  const at::Tensor hubs = hub_ids(n, x.options());
  const at::Tensor hubs_lift = lift.defined() ? lift.index_select(0, hubs) : at::Tensor();
  // The build's distances are l2 (lifted for inner product; cosine rows are unit length).
  // The scores' scratch is freed before the build allocates its pools; kept to 128 bytes a row
  // (a sixth of the default pools), it never raises the build's peak above them.
  const int64_t max_scores = std::clamp<int64_t>(n * 32, int64_t{1} << 20, kScoreBudget);
  const at::Tensor nearest = nearest_hubs(x, x.index_select(0, hubs), 2, Metric::kL2, lift, hubs_lift, max_scores);
  const at::Tensor first = nearest.select(1, 0).contiguous();
  const at::Tensor sizes = at::bincount(first, {}, count);
  Cells cells;
  cells.members = std::get<1>(at::sort(first, /*stable=*/true, /*dim=*/0, /*descending=*/false)).to(at::kInt);
  cells.begin = at::cat({at::zeros({1}, sizes.options()), sizes.cumsum(0)}).to(at::kInt);
  cells.cell = nearest.to(at::kInt).contiguous();
  return cells;
}

namespace {

// Rows `hubs` of x on the hubs' device. A GPU search of pinned host rows (checks.h,
// check_search_data_device) has the GPU read them through unified addressing (gather_rows'
// CUDA kernel, called through the dispatcher so that a CPU-only build links without it).
at::Tensor hub_rows(const at::Tensor& x, const at::Tensor& hubs) {
  if (x.device() == hubs.device()) return x.index_select(0, hubs);
  static const auto gather_rows = c10::Dispatcher::singleton()
                                      .findSchemaOrThrow("grnnd::gather_rows", "")
                                      .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return gather_rows.call(x, hubs);
}

#ifdef GRNND_WITH_CUDA
// hub_entries of a batch past the direct kernels' reach (hubs.h, gathered_hub_entries_apply).
at::Tensor gathered_hub_entries(const at::Tensor& x, const at::Tensor& queries, Metric ranking, int64_t count) {
  at::Tensor gathered, weight, bias;
  gather_hubs_cuda(x, queries, ranking, gathered, weight, bias);
  const int64_t n = x.size(0), m = queries.size(0), h = gathered.size(0), k = std::min(count, h);
  if (fused_nearest_hubs_apply(queries, gathered, k)) {  // one or two hubs of a batch that fills the GPU
    at::Tensor columns = at::empty({m, k}, queries.options().dtype(at::kLong));
    nearest_hubs_fused_cuda(queries, gathered, weight, bias, at::Tensor(), at::Tensor(), columns);
    return hub_ids(n, queries.options()).index_select(0, columns.flatten()).view_as(columns).to(at::kInt).contiguous();
  }
  at::Tensor out = at::empty({m, k}, queries.options().dtype(at::kInt));
  const at::Tensor gathered_t = gathered.t();
  const int64_t chunk = std::max<int64_t>(1, kScoreBudget / h);
  for (int64_t start = 0; start < m; start += chunk) {
    at::Tensor part = out.slice(0, start, std::min(m, start + chunk));  // rows of a contiguous [m, k]
    smallest_scores_cuda(dot_products(queries.slice(0, start, start + part.size(0)), gathered_t), weight, bias,
                         at::Tensor(), at::Tensor(), part, /*hub_rows_of=*/n);
  }
  return out;
}
#endif

}  // namespace

at::Tensor hub_entries(const at::Tensor& x, const at::Tensor& queries, Metric metric, bool x_normalised,
                       int64_t count) {
  const int64_t n = x.size(0);
  if (hub_count(n) == 0 || count <= 0 || queries.size(0) == 0) return at::Tensor();
  // Unit rows rank by -<q, hub> under cosine as under inner product.
  const Metric ranking = metric == Metric::kCosine && x_normalised ? Metric::kIP : metric;
#ifdef GRNND_WITH_CUDA
  // Before hub_ids: the direct and gathered kernels find the hub rows themselves (hub_row).
  if (direct_hub_entries_apply(x, queries)) return direct_hub_entries_cuda(x, queries, ranking, count);
  if (gathered_hub_entries_apply(x, queries, count)) return gathered_hub_entries(x, queries, ranking, count);
#endif
  const at::Tensor hubs = hub_ids(n, queries.options());
  const at::Tensor nearest = nearest_hubs(queries, hub_rows(x, hubs), count, ranking);
  return hubs.index_select(0, nearest.flatten()).view_as(nearest).to(at::kInt).contiguous();
}

namespace {

at::Tensor nearest_hubs_op(const at::Tensor& data, const at::Tensor& queries, int64_t k, c10::string_view metric) {
  TORCH_CHECK_VALUE(data.dim() == 2 && queries.dim() == 2 && data.size(1) == queries.size(1),
                    "nearest_hubs: expected data [n, d] and queries [q, d], got ", data.sizes(), " and ",
                    queries.sizes());
  TORCH_CHECK_VALUE(data.device() == queries.device() && data.scalar_type() == queries.scalar_type(),
                    "nearest_hubs: expected data and queries on one device with one dtype, got ", data.device(), " ",
                    data.scalar_type(), " and ", queries.device(), " ", queries.scalar_type());
  TORCH_CHECK_VALUE(at::isFloatingType(data.scalar_type()), "nearest_hubs: expected floating-point rows, got ",
                    data.scalar_type());
  TORCH_CHECK_VALUE(k >= 1, "nearest_hubs: expected k >= 1, got ", k);
  const at::Tensor table = hub_entries(data.contiguous(), queries.contiguous(), parse_metric(std::string(metric)),
                                       /*x_normalised=*/false, k);
  if (!table.defined()) return at::empty({queries.size(0), 0}, queries.options().dtype(at::kLong));
  return table.to(at::kLong);
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CompositeExplicitAutograd, m) {
  m.impl("hub_ids", [](const at::Tensor& data) { return hub_ids(data.size(0), data.options()); });
  m.impl("nearest_hubs", &nearest_hubs_op);
}

}  // namespace grnnd
