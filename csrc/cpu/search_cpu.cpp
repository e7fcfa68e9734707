// Batched graph search on the CPU: the twin of csrc/cuda/search_cuda.cu.
//
// The fixed-size-list greedy search of CAGRA (seed 002): keep the best `list_size` nodes seen,
// each iteration expand the `search_width` best not yet expanded, stop when none is left or
// after `max_iters` iterations. Entry points are random (seeded per query), so disconnected
// parts of a graph are still reachable.
#include <algorithm>
#include <limits>
#include <vector>

#include <torch/library.h>

#include "../checks.h"
#include "../philox.h"
#include "vectors_cpu.h"

namespace grnnd {
namespace cpu {
namespace {

struct Candidate {
  float dist;
  int32_t id;
  bool expanded;
};

inline bool closer(const Candidate& a, const Candidate& b) {
  return a.dist < b.dist || (a.dist == b.dist && a.id < b.id);
}

// The best `capacity` candidates seen so far, ascending.
class SortedList {
 public:
  explicit SortedList(int capacity) : capacity_(capacity) { items_.reserve(capacity + 1); }
  void clear() { items_.clear(); }
  bool full() const { return static_cast<int>(items_.size()) == capacity_; }
  bool admits(float dist) const { return !full() || dist < items_.back().dist; }
  void insert(Candidate c) {
    if (!admits(c.dist)) return;
    items_.insert(std::upper_bound(items_.begin(), items_.end(), c, closer), c);
    if (static_cast<int>(items_.size()) > capacity_) items_.pop_back();
  }
  std::vector<Candidate>& items() { return items_; }

 private:
  int capacity_;
  std::vector<Candidate> items_;
};

// Per-thread visited marks: a stamp per node, bumped per query, so nothing is cleared.
class Visited {
 public:
  explicit Visited(int64_t n) : stamp_(n, 0) {}
  void next_query() {
    if (++current_ == 0) {  // wrapped around: old stamps could collide
      std::fill(stamp_.begin(), stamp_.end(), 0);
      current_ = 1;
    }
  }
  bool test_and_set(int64_t i) {
    if (stamp_[i] == current_) return true;
    stamp_[i] = current_;
    return false;
  }

 private:
  std::vector<uint32_t> stamp_;
  uint32_t current_ = 0;
};

std::tuple<at::Tensor, at::Tensor> search_cpu(const at::Tensor& data, const at::Tensor& graph,
                                              const at::Tensor& queries, int64_t k, int64_t list_size,
                                              int64_t search_width, int64_t max_iters, c10::string_view metric,
                                              int64_t seed, const c10::optional<at::Tensor>& filter) {
  check_search_inputs(data, graph, queries, k, filter, /*read_contents=*/true);
  const SearchParams p = make_search_params(k, list_size, search_width, max_iters, std::string(metric), seed);

  const int64_t n = data.size(0), nq = queries.size(0), degree = graph.size(1);
  const at::Tensor x = prepare_vectors(data, p.metric), q = prepare_vectors(queries, p.metric);
  const VectorSet vectors{x.data_ptr<float>(), x.size(1), p.metric};
  const at::Tensor g = graph.contiguous();
  const int32_t* adjacency = g.data_ptr<int32_t>();
  const at::Tensor allowed_t = filter.has_value() ? filter->contiguous() : at::Tensor();
  const bool* allowed = filter.has_value() ? allowed_t.data_ptr<bool>() : nullptr;
  const int entries = static_cast<int>(std::min<int64_t>(p.list_size, n));

  at::Tensor out_dists = at::full({nq, p.k}, std::numeric_limits<float>::infinity(), queries.options().dtype(at::kFloat));
  at::Tensor out_ids = at::full({nq, p.k}, -1, queries.options().dtype(at::kLong));
  float* dist_out = out_dists.data_ptr<float>();
  int64_t* id_out = out_ids.data_ptr<int64_t>();

  at::parallel_for(0, nq, 16, [&](int64_t begin, int64_t end) {
    Visited visited(n);
    SortedList list(p.list_size), results(p.k);
    std::vector<int32_t> parents, fresh;
    for (int64_t qi = begin; qi < end; ++qi) {
      const float* query = q.data_ptr<float>() + qi * q.size(1);
      visited.next_query();
      list.clear();
      results.clear();
      // With a filter, every node whose distance is computed competes for the results,
      // allowed or not it still steers the traversal through `list`.
      auto consider = [&](int32_t id) {
        const float d = vectors.to(query, id);
        list.insert({d, id, false});
        if (allowed != nullptr && allowed[id]) results.insert({d, id, true});
      };
      fresh.clear();
      for (int e = 0; e < entries; ++e) {
        const uint32_t r = random_u32(p.seed, Stream::kEntryPoints, static_cast<uint32_t>(qi), 0, e);
        const int32_t id = static_cast<int32_t>(random_below(r, static_cast<uint32_t>(n)));
        if (!visited.test_and_set(id)) {
          vectors.prefetch(id);
          fresh.push_back(id);
        }
      }
      for (const int32_t id : fresh) consider(id);
      for (int iter = 0; p.max_iters == 0 || iter < p.max_iters; ++iter) {
        parents.clear();
        for (Candidate& c : list.items()) {
          if (!c.expanded) {
            c.expanded = true;
            parents.push_back(c.id);
            if (static_cast<int>(parents.size()) == p.search_width) break;
          }
        }
        if (parents.empty()) break;
        fresh.clear();
        for (const int32_t parent : parents) {
          const int32_t* row = adjacency + static_cast<int64_t>(parent) * degree;
          for (int64_t j = 0; j < degree && row[j] >= 0; ++j) {
            if (!visited.test_and_set(row[j])) {
              vectors.prefetch(row[j]);
              fresh.push_back(row[j]);
            }
          }
        }
        for (const int32_t id : fresh) consider(id);
      }
      const std::vector<Candidate>& best = allowed != nullptr ? results.items() : list.items();
      const int found = std::min<int>(p.k, static_cast<int>(best.size()));
      for (int j = 0; j < found; ++j) {
        dist_out[qi * p.k + j] = best[j].dist;
        id_out[qi * p.k + j] = best[j].id;
      }
    }
  });
  return {out_dists, out_ids};
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CPU, m) { m.impl("search", &search_cpu); }

}  // namespace cpu
}  // namespace grnnd
