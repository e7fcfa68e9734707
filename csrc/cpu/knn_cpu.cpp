// Exact k nearest neighbours on the CPU: the twin of csrc/cuda/knn_cuda.cu.
//
// Distances of a query block against a data block come from one matrix product (BLAS), the
// best `k + margin` per query survive a running selection, and the survivors are re-ranked
// with directly computed float32 distances, so rounding in ||x||^2 - 2<q, x> + ||q||^2 cannot
// reorder or distort the reported neighbours.
#include <algorithm>
#include <limits>
#include <queue>
#include <vector>

#include <torch/library.h>

#include "../core/checks.h"
#include "vectors_cpu.h"

namespace grnnd {
namespace cpu {
namespace {

constexpr int64_t kQueryBlock = 1024;
constexpr int64_t kDataBlock = 8192;

// Extra candidates kept past k for the exact re-rank; covers reorderings by matmul rounding.
int64_t rerank_margin(int64_t k) { return std::max<int64_t>(8, k / 4); }

std::tuple<at::Tensor, at::Tensor> knn_cpu(const at::Tensor& data, const at::Tensor& queries, int64_t k,
                                           c10::string_view metric_name) {
  check_knn_inputs(data, queries, k);
  const Metric metric = parse_metric(std::string(metric_name));

  const int64_t n = data.size(0), nq = queries.size(0);
  const int64_t keep = std::min(n, k + rerank_margin(k));
  const at::Tensor x = prepare_vectors(data, metric), q = prepare_vectors(queries, metric);
  const VectorSet vectors{x.data_ptr<float>(), x.size(1), metric};
  // For l2 the ranking score ||x||^2 - 2<q, x> drops the per-query constant ||q||^2.
  const at::Tensor x_sq = metric == Metric::kL2 ? x.pow(2).sum(1) : at::Tensor();

  at::Tensor out_dists = at::empty({nq, k}, queries.options().dtype(at::kFloat));
  at::Tensor out_ids = at::empty({nq, k}, queries.options().dtype(at::kLong));
  float* dist_out = out_dists.data_ptr<float>();
  int64_t* id_out = out_ids.data_ptr<int64_t>();

  using Scored = std::pair<float, int64_t>;  // max-heap on (score, id): top() is the worst kept
  for (int64_t q0 = 0; q0 < nq; q0 += kQueryBlock) {
    const int64_t qb = std::min(kQueryBlock, nq - q0);
    std::vector<std::vector<Scored>> heaps(qb);
    for (auto& h : heaps) h.reserve(keep + 1);
    for (int64_t d0 = 0; d0 < n; d0 += kDataBlock) {
      const int64_t db = std::min(kDataBlock, n - d0);
      at::Tensor scores = at::mm(q.narrow(0, q0, qb), x.narrow(0, d0, db).t()).neg_();
      if (metric == Metric::kL2) scores.mul_(2).add_(x_sq.narrow(0, d0, db).unsqueeze(0));
      scores = scores.contiguous();
      const float* s = scores.data_ptr<float>();
      at::parallel_for(0, qb, 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          auto& heap = heaps[i];
          const float* row = s + i * db;
          for (int64_t j = 0; j < db; ++j) {
            const Scored c{row[j], d0 + j};
            if (static_cast<int64_t>(heap.size()) < keep) {
              heap.push_back(c);
              std::push_heap(heap.begin(), heap.end());
            } else if (c < heap.front()) {
              std::pop_heap(heap.begin(), heap.end());
              heap.back() = c;
              std::push_heap(heap.begin(), heap.end());
            }
          }
        }
      });
    }
    at::parallel_for(0, qb, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float* query = q.data_ptr<float>() + (q0 + i) * q.size(1);
        auto& heap = heaps[i];
        for (auto& c : heap) c.first = vectors.to(query, c.second);
        std::partial_sort(heap.begin(), heap.begin() + k, heap.end());
        for (int64_t j = 0; j < k; ++j) {
          dist_out[(q0 + i) * k + j] = heap[j].first;
          id_out[(q0 + i) * k + j] = heap[j].second;
        }
      }
    });
  }
  return {out_dists, out_ids};
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CPU, m) { m.impl("knn", &knn_cpu); }

}  // namespace cpu
}  // namespace grnnd
