// prune_rows on the CPU: the twin of csrc/cuda/prune_cuda.cu, the recipe of csrc/prune.h with
// one thread per row.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <torch/library.h>

#include "../checks.h"
#include "../prune.h"
#include "vectors_cpu.h"

namespace grnnd {
namespace cpu {
namespace {

at::Tensor prune_rows_cpu(const at::Tensor& data, const at::Tensor& vertices, const at::Tensor& candidates,
                          int64_t degree, c10::string_view metric_name, bool rule, int64_t fixed, bool shrink) {
  check_prune_inputs(data, vertices, candidates, degree);
  const Metric metric = parse_metric(std::string(metric_name));
  const at::Tensor x = prepare_vectors(data, metric);
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
    list.reserve(c);
    for (int64_t j = 0; j < c; ++j) {
      const int64_t u = cp[r * c + j];
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
    // 3: the rule, then the fill from what it dropped; or, shrinking, the covered surplus.
    std::vector<char> kept(list.size(), 0);
    int64_t count = 0;
    if (shrink) {
      std::fill(kept.begin(), kept.end(), 1);
      int64_t surplus = static_cast<int64_t>(list.size()) - degree;
      for (int64_t j = static_cast<int64_t>(list.size()) - 1; j >= 0 && surplus > 0; --j) {
        bool covered = false;
        for (int64_t w = 0; w < j && !covered && list[j].free; ++w) {
          covered = vectors(list[w].id, list[j].id) < list[j].dist;
        }
        if (covered) {
          kept[j] = 0;
          --surplus;
        }
      }
      for (int64_t j = static_cast<int64_t>(list.size()) - 1; j >= 0 && surplus > 0; --j) {
        if (kept[j] && list[j].free) {
          kept[j] = 0;
          --surplus;
        }
      }
      count = degree;  // no fill; step 4 takes at most `degree`
    }
    // Every fixed entry is kept; the free ones share the places the fixed ones leave.
    int64_t free_places = shrink ? 0 : degree - fixed_in_list;
    for (size_t j = 0; j < list.size() && !shrink; ++j) {
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
    int32_t* row = op + r * degree;
    int64_t at = 0;
    for (size_t j = 0; j < list.size() && at < degree; ++j) {
      if (kept[j]) row[at++] = static_cast<int32_t>(list[j].id);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CPU, m) { m.impl("prune_rows", &prune_rows_cpu); }

}  // namespace cpu
}  // namespace grnnd
