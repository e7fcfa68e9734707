// prune_rows on the CPU: the twin of csrc/cuda/prune_cuda.cu, the recipe of csrc/build/prune.h with
// one thread per row.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <torch/library.h>

#include "../core/checks.h"
#include "../build/prune.h"
#include "vectors_cpu.h"

namespace grnnd {
namespace cpu {
namespace {

// ---- The shrink of prune.h for vertex v: the row keeps its order, and d(v, u) is computed only
// where a newcomer's binary search or the surplus needs it. One function a step, as the CUDA
// twin's (prune_cuda.cu). ----

struct ShrinkEntry {
  int64_t id;
  float dist;  // NaN until computed
};

constexpr float kUnknownDistance = std::numeric_limits<float>::quiet_NaN();

float distance_to(const VectorSet& vectors, int64_t v, ShrinkEntry& e) {
  if (std::isnan(e.dist)) e.dist = vectors(v, e.id);
  return e.dist;
}

// S1. The row in its order (own); the newcomers, ranked by (distance, id).
void gather_row_and_newcomers(const VectorSet& vectors, int64_t v, const int64_t* cand, int64_t width, int64_t n,
                              int64_t degree, std::vector<ShrinkEntry>& own, std::vector<ShrinkEntry>& newcomers) {
  const int64_t row_width = std::min(width, degree);
  for (int64_t j = 0; j < row_width; ++j) {
    if (cand[j] >= 0 && cand[j] < n && cand[j] != v) own.push_back({cand[j], kUnknownDistance});
  }
  for (int64_t j = row_width; j < width && static_cast<int64_t>(newcomers.size()) < degree; ++j) {
    const int64_t w = cand[j];
    bool take = w >= 0 && w < n && w != v;
    for (size_t i = 0; take && i < own.size(); ++i) take = own[i].id != w;
    for (int64_t i = row_width; take && i < j; ++i) take = cand[i] != w;
    if (take) newcomers.push_back({w, vectors(v, w)});
  }
  std::sort(newcomers.begin(), newcomers.end(), [](const ShrinkEntry& a, const ShrinkEntry& b) {
    return a.dist < b.dist || (a.dist == b.dist && a.id < b.id);
  });
}

// S2. Each newcomer's place by binary search over the row's distances, never behind the place of
// a nearer newcomer.
std::vector<int64_t> place_newcomers(const VectorSet& vectors, int64_t v, std::vector<ShrinkEntry>& own,
                                     const std::vector<ShrinkEntry>& newcomers) {
  std::vector<int64_t> place(newcomers.size());
  for (size_t k = 0; k < newcomers.size(); ++k) {
    int64_t lo = 0, hi = static_cast<int64_t>(own.size());
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (distance_to(vectors, v, own[mid]) <= newcomers[k].dist) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    place[k] = k > 0 ? std::max(lo, place[k - 1]) : lo;
  }
  return place;
}

// S3. The list: each newcomer before the row entry at its place, after the newcomers placed there
// before it.
std::vector<ShrinkEntry> merge_newcomers(const std::vector<ShrinkEntry>& own, const std::vector<ShrinkEntry>& newcomers,
                                         const std::vector<int64_t>& place) {
  std::vector<ShrinkEntry> list;
  list.reserve(own.size() + newcomers.size());
  for (size_t i = 0, k = 0; i <= own.size(); ++i) {
    for (; k < newcomers.size() && place[k] <= static_cast<int64_t>(i); ++k) list.push_back(newcomers[k]);
    if (i < own.size()) list.push_back(own[i]);
  }
  return list;
}

// S4. The surplus over `degree`: covered entries first, from the farthest, then the farthest left.
// Returns a kept flag per list entry.
std::vector<char> drop_surplus(const VectorSet& vectors, int64_t v, std::vector<ShrinkEntry>& list, int64_t degree) {
  std::vector<char> kept(list.size(), 1);
  int64_t surplus = static_cast<int64_t>(list.size()) - degree;
  for (int64_t j = static_cast<int64_t>(list.size()) - 1; j >= 0 && surplus > 0; --j) {
    const float d_vu = distance_to(vectors, v, list[j]);
    bool covered = false;
    for (int64_t w = 0; w < j && !covered; ++w) covered = vectors(list[w].id, list[j].id) < d_vu;
    if (covered) {
      kept[j] = 0;
      --surplus;
    }
  }
  for (int64_t j = static_cast<int64_t>(list.size()) - 1; j >= 0 && surplus > 0; --j) {
    if (kept[j]) {
      kept[j] = 0;
      --surplus;
    }
  }
  return kept;
}

void shrink_row(const VectorSet& vectors, int64_t v, const int64_t* cand, int64_t width, int64_t n, int64_t degree,
                int32_t* row) {
  std::vector<ShrinkEntry> own, newcomers;
  gather_row_and_newcomers(vectors, v, cand, width, n, degree, own, newcomers);
  const std::vector<int64_t> place = place_newcomers(vectors, v, own, newcomers);
  std::vector<ShrinkEntry> list = merge_newcomers(own, newcomers, place);
  const std::vector<char> kept = drop_surplus(vectors, v, list, degree);
  // S5. Kept entries in list order (the row was filled with -1).
  int64_t at = 0;
  for (size_t j = 0; j < list.size() && at < degree; ++j) {
    if (kept[j]) row[at++] = static_cast<int32_t>(list[j].id);
  }
}

// The rule of prune.h for vertex v (steps 1-4), over its `width` candidates `cand`, of which the
// first `fixed` are kept whatever the rule says.
void prune_row(const VectorSet& vectors, int64_t v, const int64_t* cand, int64_t width, int64_t n, int64_t degree,
               int64_t list_size, int64_t fixed, bool rule, int32_t* row) {
  // 1-2: the distinct candidates by (distance, id); of two copies of an id the fixed one
  // (free = 0) sorts first and stays.
  struct Candidate {
    float dist;
    int64_t id;
    int free;
    bool operator<(const Candidate& o) const {
      return dist < o.dist || (dist == o.dist && (id < o.id || (id == o.id && free < o.free)));
    }
  };
  std::vector<Candidate> list;
  list.reserve(width);
  for (int64_t j = 0; j < width; ++j) {
    const int64_t u = cand[j];
    if (u >= 0 && u < n && u != v) list.push_back({vectors(v, u), u, j < fixed ? 0 : 1});
  }
  std::sort(list.begin(), list.end());
  list.erase(std::unique(list.begin(), list.end(),
                         [](const Candidate& a, const Candidate& b) { return a.id == b.id; }),
             list.end());
  // The list: the nearest `degree` fixed ones and the nearest list_size free ones, in order.
  int64_t fixed_in_list = 0, free_in_list = 0;
  size_t listed = 0;
  for (const Candidate& e : list) {
    if (e.free ? free_in_list < list_size : fixed_in_list < degree) {
      (e.free ? free_in_list : fixed_in_list) += 1;
      list[listed++] = e;
    }
  }
  list.resize(listed);
  // 3: the rule, then the fill from what it dropped.
  std::vector<char> kept(list.size(), 0);
  int64_t count = 0;
  // Every fixed entry is kept; the free ones share the places the fixed ones leave.
  int64_t free_places = degree - fixed_in_list;
  for (size_t j = 0; j < list.size(); ++j) {
    if (list[j].free && free_places == 0) continue;
    bool keep = true;
    for (size_t w = 0; w < j && keep && rule && list[j].free; ++w) {
      keep = !(kept[w] && vectors(list[w].id, list[j].id) < list[j].dist);
    }
    kept[j] = keep;
    count += keep;
    free_places -= keep && list[j].free;
  }
  for (size_t j = 0; j < list.size() && count < degree; ++j) {
    if (!kept[j]) {
      kept[j] = 1;
      ++count;
    }
  }
  // 4: kept entries in list order.
  int64_t at = 0;
  for (size_t j = 0; j < list.size() && at < degree; ++j) {
    if (kept[j]) row[at++] = static_cast<int32_t>(list[j].id);
  }
}

at::Tensor prune_rows_cpu(const at::Tensor& data, const at::Tensor& vertices, const at::Tensor& candidates,
                          int64_t degree, c10::string_view metric_name, bool rule, int64_t fixed, bool shrink) {
  check_prune_inputs(data, vertices, candidates, degree, fixed, shrink);
  const Metric metric = parse_metric(std::string(metric_name));
  const at::Tensor x = prepare_build_vectors(data, metric);
  VectorSet vectors{x.data_ptr<float>(), x.size(1), metric};
  const at::Tensor lift = inner_product_lift(x, metric);
  if (lift.defined()) vectors.lift = lift.data_ptr<float>();
  const at::Tensor cand = candidates.to(at::kLong).contiguous();
  const at::Tensor verts = vertices.contiguous();
  const int64_t m = verts.size(0), c = cand.size(1), n = x.size(0);
  const int64_t list_size = kPruneListFactor * degree;
  at::Tensor out = at::full({m, degree}, -1, vertices.options().dtype(at::kInt));
  const int64_t* vp = verts.data_ptr<int64_t>();
  const int64_t* cp = cand.data_ptr<int64_t>();
  int32_t* op = out.data_ptr<int32_t>();

  parallel_dynamic(m, 16, [&](int64_t r) {
    const int64_t v = vp[r];
    int32_t* row = op + r * degree;
    if (shrink) {
      shrink_row(vectors, v, cp + r * c, c, n, degree, row);
    } else {
      prune_row(vectors, v, cp + r * c, c, n, degree, list_size, fixed, rule, row);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CPU, m) { m.impl("prune_rows", &prune_rows_cpu); }

}  // namespace cpu
}  // namespace grnnd
