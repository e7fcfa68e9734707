// Batched graph search on the CPU: the twin of csrc/cuda/search_cuda.cu.
//
// The fixed-size-list greedy search of CAGRA (seed 002): keep the best `list_size` nodes seen,
// each iteration expand the `search_width` best not yet expanded, stop when none is left or
// after `max_iters` iterations. Entry points are the query's nearest hubs (hubs.h) and random
// rows (seeded per query), so disconnected parts of a graph are still reachable. A query
// answered by several searches (params.h) runs them one after another and merges their results.
// With codes (codes.h) the walk ranks by code distances and each search's final list is then
// re-ranked by exact distances to the rows.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include <torch/library.h>

#include "../core/checks.h"
#include "../core/codes.h"
#include "../build/hubs.h"
#include "../core/philox.h"
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
  int capacity() const { return capacity_; }

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

// The rows' codes (codes.h) and one query's terms for them, in the steps the GPU takes
// (search_cuda.cu: rotate_queries_kernel, prepare_code_query, team_code_distance), so that both
// devices compute the same code distances.
class CodeDistances {
 public:
  CodeDistances(const SearchCodes& codes, int64_t dim, Metric metric)
      : rows_(codes.codes.data_ptr<uint8_t>()),
        grid_(codes.grid.data_ptr<float>()),
        kind_(codes.kind),
        stride_(codes.codes.size(1)),
        dim_(dim),
        cells_(kind_ == CodeKind::kInt4 ? codes.grid.size(0) - dim : 0),
        code_dims_(codes.dims),
        code_bytes_(codes.bytes),
        metric_(metric),
        hi_(code_dims_),
        lo_(code_dims_),
        input_(kind_ == CodeKind::kInt4 ? dim : 0),
        chunk_(kind_ == CodeKind::kInt4 ? dim : 0),
        rotated_(kind_ == CodeKind::kInt4 ? dim + cells_ : 0) {}

  void set_query(const float* q) {
    // int8: a grid of offsets and steps; int4: the rotation's rows, then the cells' centres (codes.h).
    const float* offset = kind_ == CodeKind::kInt8 ? grid_ : grid_ + dim_ * dim_;
    const float* step = grid_ + dim_;
    if (kind_ == CodeKind::kInt4) {
      // y by rows of the grid (contiguous reads), then the cell dots t_j; each output sums chunk
      // by chunk of dimensions, as the GPU does (int4_rotation_step).
      std::fill(rotated_.begin(), rotated_.end(), 0.0f);
      for (int64_t d = 0; d < dim_; ++d) input_[d] = int4_rotation_input(q[d], offset[d], metric_);
      for (int64_t first = 0; first < dim_; first += kInt4RotationChunk) {
        const int64_t last = std::min<int64_t>(first + kInt4RotationChunk, dim_);
        std::fill(chunk_.begin(), chunk_.end(), 0.0f);
        for (int64_t d = first; d < last; ++d) {
          const float* rotation = grid_ + d * dim_;
          for (int64_t i = 0; i < dim_; ++i) chunk_[i] = int4_rotation_step(chunk_[i], rotation[i], input_[d]);
        }
        for (int64_t i = 0; i < dim_; ++i) rotated_[i] += chunk_[i];
      }
      for (int64_t j = 0; j < cells_; ++j) {
        const float* cell = offset + j * dim_;
        float dot = 0.0f;
        for (int64_t first = 0; first < dim_; first += kInt4RotationChunk) {
          const int64_t last = std::min<int64_t>(first + kInt4RotationChunk, dim_);
          float sum = 0.0f;
          for (int64_t d = first; d < last; ++d) {
            sum = int4_rotation_step(sum, int4_cell_offset(cell[d], offset[d], metric_), input_[d]);
          }
          dot += sum;
        }
        rotated_[dim_ + j] = dot;
      }
    }
    const auto term = [&](int64_t d) {
      return kind_ == CodeKind::kInt8 ? code_query_term(q[d], offset[d], step[d], metric_) : rotated_[d];
    };
    std::array<float, kCodeConstantLanes> constant{};
    float largest = 0.0f;
    for (int64_t d = 0; d < dim_; ++d) {
      largest = std::fmax(largest, std::fabs(term(d)));
      float& lane = constant[d % kCodeConstantLanes];
      lane = code_constant_step(lane, q[d], offset[d], metric_);
    }
    for (int offset = kCodeConstantLanes / 2; offset > 0; offset /= 2) {  // the shuffles' xor butterfly
      std::array<float, kCodeConstantLanes> next;
      for (int l = 0; l < kCodeConstantLanes; ++l) next[l] = constant[l] + constant[l ^ offset];
      constant = next;
    }
    scale_ = code_query_scale(largest);
    bias_ = code_bias(constant[0], metric_);
    level_sum_ = 0;
    for (int64_t d = 0; d < code_dims_; ++d) {
      const int level = d < dim_ ? code_query_level(term(d), scale_) : 0;
      level_sum_ += level;
      hi_[d] = static_cast<int8_t>(level >> 8);
      lo_[d] = static_cast<uint8_t>(level & 0xff);
    }
  }

  float to(int64_t row) const {
    const uint8_t* codes = rows_ + row * stride_;
    int32_t hi_dot = 0, lo_dot = 0;
    float dist;
    if (kind_ == CodeKind::kInt8) {
      for (int64_t d = 0; d < code_dims_; ++d) {
        hi_dot += static_cast<int32_t>(hi_[d]) * codes[d];
        lo_dot += static_cast<int32_t>(lo_[d]) * codes[d];
      }
      float norm = 0.0f;
      if (metric_ == Metric::kL2) std::memcpy(&norm, codes + code_bytes_, sizeof(float));
      dist = code_distance(hi_dot, lo_dot, scale_, bias_, norm, metric_);
    } else {
      for (int64_t d = 0; d < code_dims_; ++d) {
        const int32_t u = (codes[d / 2] >> (4 * (d % 2))) & 0xf;
        hi_dot += static_cast<int32_t>(hi_[d]) * u;
        lo_dot += static_cast<int32_t>(lo_[d]) * u;
      }
      float alpha, k;
      uint32_t cell;
      std::memcpy(&alpha, codes + code_bytes_, sizeof(float));
      std::memcpy(&k, codes + code_bytes_ + sizeof(float), sizeof(float));
      std::memcpy(&cell, codes + code_bytes_ + 2 * sizeof(float), sizeof(uint32_t));
      const float bias = int4_cell_bias(bias_, rotated_[dim_ + int4_cell_of(cell, cells_)], metric_);
      dist = int4_code_distance(hi_dot, lo_dot, level_sum_, scale_, bias, alpha, k, metric_);
    }
    return std::isnan(dist) ? std::numeric_limits<float>::infinity() : dist;
  }

  void prefetch(int64_t row) const {
    const char* p = reinterpret_cast<const char*>(rows_ + row * stride_);
    for (int64_t off = 0; off < stride_; off += 64) __builtin_prefetch(p + off);
  }

 private:
  const uint8_t* rows_;
  const float* grid_;
  CodeKind kind_;
  int64_t stride_, dim_, cells_, code_dims_, code_bytes_;
  Metric metric_;
  std::vector<int8_t> hi_;   // the query's levels by dimension (the GPU keeps int4's by slot)
  std::vector<uint8_t> lo_;
  std::vector<float> input_;    // int4: u, the query as the rotation and the cell dots take it
  std::vector<float> chunk_;    // int4: the rotation's sums over the current chunk of dimensions
  std::vector<float> rotated_;  // int4: y, the rotated query, then its dot t_j with each cell
  float scale_ = 1.0f, bias_ = 0.0f;
  int32_t level_sum_ = 0;
};

// One thread's scratch for searching, reused across its queries.
class Searcher {
 public:
  // kept: allowed entries the result list keeps (k; with codes the list's length, for the re-rank).
  Searcher(int64_t n, int list_size, int kept) : visited_(n), list_(list_size), results_(kept) {}

  // Search number `search` of query `qi`: entry points are its share of the query's nearest hubs
  // (HubEntries), then draws from counter (qi, search, e), as on the GPU. Returns its best nodes
  // ascending (the allowed ones when `allowed` is set) and adds the distances it computed to
  // `evaluated`. With `codes` (set to this query) the walk computes code distances, and its best
  // nodes are then re-ranked by exact ones.
  const std::vector<Candidate>& run(const VectorSet& vectors, const float* query, const CodeDistances* codes,
                                    const int32_t* adjacency, int64_t degree, const bool* allowed,
                                    const SearchParams& p, int64_t n, const HubEntries& hubs, uint32_t qi,
                                    uint32_t search, int64_t& evaluated) {
    visited_.next_query();
    list_.clear();
    results_.clear();
    // With a filter, every node whose distance is computed competes for the results; allowed
    // or not, it still steers the traversal through the list.
    auto consider_fresh = [&] {
      evaluated += static_cast<int64_t>(fresh_.size());
      for (const int32_t id : fresh_) {
        const float d = codes != nullptr ? codes->to(id) : vectors.to(query, id);
        list_.insert({d, id, false});
        if (allowed != nullptr && allowed[id]) results_.insert({d, id, true});
      }
    };
    fresh_.clear();
    const int entries = static_cast<int>(std::min<int64_t>(list_.capacity(), n));
    for (int e = 0; e < entries; ++e) {
      const uint32_t r = random_u32(p.seed, Stream::kEntryPoints, qi, search, static_cast<uint32_t>(e));
      const int hub = hubs.column(e, static_cast<int>(search));
      const int32_t id = hub >= 0 ? hubs.ids[static_cast<int64_t>(qi) * hubs.columns + hub]
                                  : static_cast<int32_t>(random_below(r, static_cast<uint32_t>(n)));
      if (!visited_.test_and_set(id)) {
        prefetch(vectors, codes, id);
        fresh_.push_back(id);
      }
    }
    consider_fresh();
    for (int iter = 0; p.max_iters == 0 || iter < p.max_iters; ++iter) {
      parents_.clear();
      for (Candidate& c : list_.items()) {
        if (!c.expanded) {
          c.expanded = true;
          parents_.push_back(c.id);
          if (static_cast<int>(parents_.size()) == p.search_width) break;
        }
      }
      if (parents_.empty()) break;
      fresh_.clear();
      for (const int32_t parent : parents_) {
        const int32_t* row = adjacency + static_cast<int64_t>(parent) * degree;
        for (int64_t j = 0; j < degree && row[j] >= 0; ++j) {
          // An id past the data is skipped, as the CUDA kernel does: the id scan of check_graph
          // does not see a write that bypassed torch (through .numpy(), say).
          if (row[j] >= n) continue;
          if (!visited_.test_and_set(row[j])) {
            prefetch(vectors, codes, row[j]);
            fresh_.push_back(row[j]);
          }
        }
      }
      consider_fresh();
    }
    std::vector<Candidate>& best = allowed != nullptr ? results_.items() : list_.items();
    if (codes != nullptr) {
      for (Candidate& c : best) c.dist = exact_distance(vectors, query, c.id);
      std::sort(best.begin(), best.end(), closer);
    }
    return best;
  }

 private:
  static void prefetch(const VectorSet& vectors, const CodeDistances* codes, int64_t id) {
    if (codes != nullptr) {
      codes->prefetch(id);
    } else {
      vectors.prefetch(id);
    }
  }

  // The search's exact distance, NaN ordered last as on the GPU.
  static float exact_distance(const VectorSet& vectors, const float* query, int64_t id) {
    const float d = vectors.to(query, id);
    return std::isnan(d) ? std::numeric_limits<float>::infinity() : d;
  }

  Visited visited_;
  SortedList list_, results_;
  std::vector<int32_t> parents_, fresh_;
};


// Runs the search of every query; fills the results, or with `counts` set only the number of
// distances each query computed.
void run_search(const at::Tensor& data, const at::Tensor& graph, const at::Tensor& queries,
                const c10::optional<at::Tensor>& filter, const SearchCodes& codes, const SearchParams& p,
                float* dist_out, int64_t* id_out, int32_t* counts) {
  const int64_t n = data.size(0), nq = queries.size(0), degree = graph.size(1);
  const at::Tensor x = prepare_vectors(data, p.metric), q = prepare_vectors(queries, p.metric);
  const VectorSet vectors{x.data_ptr<float>(), x.size(1), p.metric};
  const at::Tensor g = graph.contiguous();
  const int32_t* adjacency = g.data_ptr<int32_t>();
  const at::Tensor allowed_t = filter.has_value() ? filter->contiguous() : at::Tensor();
  const bool* allowed = filter.has_value() ? allowed_t.data_ptr<bool>() : nullptr;
  // One core already runs one query at full speed, so the CPU splits a query only when asked.
  const int searches = std::max(p.searches, 1);
  const int list = list_per_search(p.list_size, p.k, searches);
  // The rows are unit length under cosine here (prepare_vectors).
  const int per_search = hub_entries_for_list(p.hub_entries, static_cast<int>(std::min<int64_t>(list, n)));
  const at::Tensor hub_table = hub_entries(x, q, p.metric, /*x_normalised=*/true, per_search * searches);
  const HubEntries hubs = hub_entries_view(hub_table, per_search, searches);

  const bool coded = codes.codes.defined();
  at::parallel_for(0, nq, 16, [&](int64_t begin, int64_t end) {
    Searcher searcher(n, list, coded ? std::max(p.k, list) : p.k);
    std::optional<CodeDistances> code_distances;
    if (coded) code_distances.emplace(codes, x.size(1), p.metric);
    std::vector<Candidate> merged;
    for (int64_t qi = begin; qi < end; ++qi) {
      const float* query = q.data_ptr<float>() + qi * q.size(1);
      if (coded) code_distances->set_query(query);
      int64_t evaluated = 0;
      merged.clear();
      for (int s = 0; s < searches; ++s) {
        const std::vector<Candidate>& best =
            searcher.run(vectors, query, coded ? &*code_distances : nullptr, adjacency, degree, allowed, p, n,
                         hubs, static_cast<uint32_t>(qi), static_cast<uint32_t>(s), evaluated);
        merged.insert(merged.end(), best.begin(), best.begin() + std::min<size_t>(p.k, best.size()));
      }
      if (counts != nullptr) {
        // The hub distances of the entry points count too (one matrix product row per query).
        if (hubs.columns > 0) evaluated += hub_count(n);
        counts[qi] = static_cast<int32_t>(std::min<int64_t>(evaluated, std::numeric_limits<int32_t>::max()));
        continue;
      }
      // Several searches may have found the same node, with the same distance: equal keys end
      // up adjacent, and only the first is kept.
      std::sort(merged.begin(), merged.end(), closer);
      int found = 0;
      for (size_t i = 0; i < merged.size() && found < p.k; ++i) {
        if (i > 0 && merged[i].id == merged[i - 1].id) continue;
        dist_out[qi * p.k + found] = merged[i].dist;
        id_out[qi * p.k + found] = merged[i].id;
        ++found;
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> search_cpu(const at::Tensor& data, const at::Tensor& graph,
                                              const at::Tensor& queries, int64_t k, int64_t list_size,
                                              int64_t search_width, int64_t max_iters, c10::string_view metric,
                                              int64_t seed, const c10::optional<at::Tensor>& filter,
                                              int64_t searches, int64_t hub_entries,
                                              const c10::optional<at::Tensor>& codes,
                                              const c10::optional<at::Tensor>& code_grid) {
  check_search_inputs(data, graph, queries, k, filter);
  SearchParams p =
      make_search_params(k, list_size, search_width, max_iters, std::string(metric), seed, searches, hub_entries);
  p.search_width = resolve_search_width(p.search_width, /*on_gpu=*/false, graph.size(1), p.list_size);
  const SearchCodes search_codes = check_search_codes(codes, code_grid, data, queries, p.metric);
  check_search_contents(data, graph, queries);
  at::Tensor out_dists =
      at::full({queries.size(0), p.k}, std::numeric_limits<float>::infinity(), queries.options().dtype(at::kFloat));
  at::Tensor out_ids = at::full({queries.size(0), p.k}, -1, queries.options().dtype(at::kLong));
  run_search(data, graph, queries, filter, search_codes, p, out_dists.data_ptr<float>(), out_ids.data_ptr<int64_t>(),
             nullptr);
  return {out_dists, out_ids};
}

at::Tensor search_distance_counts_cpu(const at::Tensor& data, const at::Tensor& graph, const at::Tensor& queries,
                                      int64_t k, int64_t list_size, int64_t search_width, int64_t max_iters,
                                      c10::string_view metric, int64_t seed,
                                      const c10::optional<at::Tensor>& filter, int64_t searches,
                                      int64_t hub_entries, const c10::optional<at::Tensor>& codes,
                                      const c10::optional<at::Tensor>& code_grid) {
  check_search_inputs(data, graph, queries, k, filter);
  SearchParams p =
      make_search_params(k, list_size, search_width, max_iters, std::string(metric), seed, searches, hub_entries);
  p.search_width = resolve_search_width(p.search_width, /*on_gpu=*/false, graph.size(1), p.list_size);
  const SearchCodes search_codes = check_search_codes(codes, code_grid, data, queries, p.metric);
  check_search_contents(data, graph, queries);
  at::Tensor counts = at::zeros({queries.size(0)}, queries.options().dtype(at::kInt));
  run_search(data, graph, queries, filter, search_codes, p, nullptr, nullptr, counts.data_ptr<int32_t>());
  return counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CPU, m) {
  m.impl("search", &search_cpu);
  m.impl("search_distance_counts", &search_distance_counts_cpu);
}

}  // namespace cpu
}  // namespace grnnd
