// The fill of built rows on the CPU: the twin of csrc/cuda/fill_cuda.cu, the recipe of
// csrc/build/fill.h with one thread per row.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "../build/fill.h"
#include "vectors_cpu.h"

namespace grnnd {
namespace {

struct Candidate {
  float dist;
  int32_t id;
  bool own;
};

// One pass: reads `graph`, returns the filled copy.
at::Tensor fill_pass(const at::Tensor& graph, const cpu::VectorSet& vectors) {
  const int64_t n = graph.size(0), degree = graph.size(1);
  at::Tensor out = graph.clone();
  const int32_t* in = graph.data_ptr<int32_t>();
  int32_t* rows = out.data_ptr<int32_t>();
  cpu::parallel_dynamic(n, 64, [&](int64_t v) {
    const int32_t* row = in + v * degree;
    thread_local std::vector<Candidate> list;
    list.clear();
    for (int64_t j = 0; j < degree; ++j) {
      if (row[j] >= 0 && row[j] < n) list.push_back({0.0f, row[j], true});
    }
    const int64_t own = static_cast<int64_t>(list.size());
    if (own == 0 || own >= degree) return;
    // 1. Two-hop candidates, then one copy of each id (the own one where there is one).
    const int64_t per =
        std::min<int64_t>(degree, std::max<int64_t>(1, fill_candidates(static_cast<int>(degree)) / own));
    for (int64_t j = 0; j < own; ++j) {
      const int32_t* hop = in + static_cast<int64_t>(list[j].id) * degree;
      for (int64_t t = 0; t < per; ++t) {
        if (hop[t] >= 0 && hop[t] < n && hop[t] != v) list.push_back({0.0f, hop[t], false});
      }
    }
    std::sort(list.begin(), list.end(),
              [](const Candidate& a, const Candidate& b) { return a.id < b.id || (a.id == b.id && a.own > b.own); });
    list.erase(std::unique(list.begin(), list.end(), [](const Candidate& a, const Candidate& b) { return a.id == b.id; }),
               list.end());
    // 2-3. Distances, then own entries and the nearest others by (distance, id).
    // The candidates' rows are scattered over the data: loads announced a few candidates
    // ahead overlap with the distances in between (vectors_cpu.h, prefetch).
    constexpr size_t kAhead = 4;
    for (size_t i = 0; i < std::min(kAhead, list.size()); ++i) vectors.prefetch(list[i].id);
    for (size_t i = 0; i < list.size(); ++i) {
      if (i + kAhead < list.size()) vectors.prefetch(list[i + kAhead].id);
      list[i].dist = vectors(v, list[i].id);
    }
    std::sort(list.begin(), list.end(),
              [](const Candidate& a, const Candidate& b) { return a.dist < b.dist || (a.dist == b.dist && a.id < b.id); });
    int32_t* filled = rows + v * degree;
    int64_t written = 0, others = 0;
    for (const Candidate& c : list) {
      if (!c.own && others >= degree - own) continue;
      others += c.own ? 0 : 1;
      filled[written++] = c.id;
    }
    std::fill(filled + written, filled + degree, -1);
  });
  return out;
}

}  // namespace

at::Tensor fill_rows_cpu(at::Tensor graph, const at::Tensor& x, const at::Tensor& lift, Metric metric) {
  cpu::VectorSet vectors{x.data_ptr<float>(), x.size(1), metric};
  if (lift.defined()) vectors.lift = lift.data_ptr<float>();
  at::Tensor filled = graph.contiguous();
  for (int pass = 0; pass < kFillPasses; ++pass) filled = fill_pass(filled, vectors);
  return filled;
}

}  // namespace grnnd
