// GRNND graph build on the CPU: the twin of csrc/cuda/build_cuda.cu (seed 000, Algorithms 3-6).
//
// Per vertex, a warp on the GPU and a thread here do the same thing in the same order, drawing
// the same random numbers (csrc/core/philox.h), so the two builds differ only through the timing of
// concurrent inserts and float rounding.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <utility>
#include <vector>

#include <torch/library.h>

#include "../build/build_schedule.h"
#include "../core/checks.h"
#include "../build/hubs.h"
#include "../build/fill.h"
#include "../core/philox.h"
#include "../build/prune.h"
#include "../build/reachability.h"
#include "vectors_cpu.h"

namespace grnnd {
namespace cpu {
namespace {

// A pool slot packs the neighbour id with its "new" flag in the top bit (ids are < 2^31).
// New entries arrived since the vertex last evaluated its pool; a pair of two old entries was
// already compared and passed the RNG test, so it is skipped (RNN-Descent's new/old trick).
constexpr uint32_t kNewBit = 0x80000000u;
inline int32_t slot_id(uint32_t slot) { return static_cast<int32_t>(slot & ~kNewBit); }
inline bool slot_is_new(uint32_t slot) { return (slot & kNewBit) != 0; }

// Fixed-capacity double-buffered pools (section 3.5): buffer `read` holds the current
// candidate sets, buffer `read ^ 1` receives the next ones; a round swaps them.
class Pools {
 public:
  Pools(int64_t n, int capacity)
      : n_(n), capacity_(capacity), locks_(new std::atomic<uint8_t>[n]) {
    for (int b = 0; b < 2; ++b) {
      slots_[b].resize(n * capacity);
      dists_[b].resize(n * capacity);
      counts_[b].assign(n, 0);
    }
    for (int64_t i = 0; i < n; ++i) locks_[i].store(0, std::memory_order_relaxed);
  }

  int capacity() const { return capacity_; }
  int count(int buf, int64_t v) const { return counts_[buf][v]; }
  const uint32_t* slots(int buf, int64_t v) const { return slots_[buf].data() + v * capacity_; }
  const float* dists(int buf, int64_t v) const { return dists_[buf].data() + v * capacity_; }
  void clear(int buf) { std::fill(counts_[buf].begin(), counts_[buf].end(), 0); }

  // The cache lines an insert into v's pool will touch, requested ahead of it.
  void prefetch(int buf, int64_t v) const {
    const char* slot = reinterpret_cast<const char*>(slots_[buf].data() + v * capacity_);
    const char* dist = reinterpret_cast<const char*>(dists_[buf].data() + v * capacity_);
    const int64_t bytes = capacity_ * static_cast<int64_t>(sizeof(uint32_t));
    for (int64_t off = 0; off < bytes; off += 64) {
      __builtin_prefetch(slot + off, 1);
      __builtin_prefetch(dist + off, 1);
    }
    __builtin_prefetch(counts_[buf].data() + v, 1);
    __builtin_prefetch(&locks_[v], 1);
  }

  // Pools of `capacity` entries a row (more than now) holding what buffer `read` holds, in
  // buffer 0; buffer 1 is written by the next round.
  void widen(int read, int capacity) {
    std::vector<uint32_t> slots(n_ * capacity);
    std::vector<float> dists(n_ * capacity);
    for (int64_t v = 0; v < n_; ++v) {
      std::copy_n(slots_[read].data() + v * capacity_, capacity_, slots.data() + v * capacity);
      std::copy_n(dists_[read].data() + v * capacity_, capacity_, dists.data() + v * capacity);
    }
    counts_[0] = counts_[read];
    slots_[0] = std::move(slots);
    dists_[0] = std::move(dists);
    slots_[1].assign(n_ * capacity, 0);
    dists_[1].assign(n_ * capacity, 0.0f);
    capacity_ = capacity;
  }

  void copy(int from, int to) {
    slots_[to] = slots_[from];
    dists_[to] = dists_[from];
    counts_[to] = counts_[from];
  }

  // Algorithm 6 (WARP_INSERT): skip if present, append if room, else replace the farthest
  // entry when the newcomer is closer. Other threads insert into the same pool concurrently,
  // so the pool of `v` is locked for the duration. Returns whether the pool changed.
  bool insert(int buf, int64_t v, int32_t id, float dist, bool is_new) {
    while (locks_[v].exchange(1, std::memory_order_acquire)) {
    }
    uint32_t* slot = slots_[buf].data() + v * capacity_;
    float* dist_of = dists_[buf].data() + v * capacity_;
    int& count = counts_[buf][v];
    // One pass over the whole pool without an early exit, which the compiler vectorises.
    uint32_t present = 0;
    for (int i = 0; i < count; ++i) present |= (slot[i] & ~kNewBit) == static_cast<uint32_t>(id);
    bool changed = false;
    if (!present) {
      const uint32_t packed = static_cast<uint32_t>(id) | (is_new ? kNewBit : 0u);
      if (count < capacity_) {
        slot[count] = packed;
        dist_of[count] = dist;
        ++count;
        changed = true;
      } else {
        // The largest distance first (a vectorised pass), then where it is.
        float largest = dist_of[0];
        for (int i = 1; i < capacity_; ++i) largest = dist_of[i] > largest ? dist_of[i] : largest;
        if (dist < largest) {
          const int far = static_cast<int>(std::find(dist_of, dist_of + capacity_, largest) - dist_of);
          slot[far] = packed;
          dist_of[far] = dist;
          changed = true;
        }
      }
    }
    locks_[v].store(0, std::memory_order_release);
    return changed;
  }

 private:
  int64_t n_;
  int capacity_;
  std::vector<uint32_t> slots_[2];
  std::vector<float> dists_[2];
  std::vector<int> counts_[2];
  std::unique_ptr<std::atomic<uint8_t>[]> locks_;
};

// The distinct entries of `row` (columns ids, -1 padded) other than v, in row order, that the
// rule keeps among themselves, with their distances to v: walked nearest first, an entry goes
// when a kept one is closer to it than v is. The twin of keep_uncovered in build_cuda.cu.
void keep_uncovered(const VectorSet& vectors, int64_t n, int64_t v, const int32_t* row, int64_t columns,
                    std::vector<int32_t>& ids, std::vector<float>& dists) {
  thread_local std::vector<int> order, kept;
  thread_local std::vector<char> keep;
  ids.clear();
  dists.clear();
  for (int64_t c = 0; c < columns; ++c) {
    const int32_t u = row[c];
    if (u < 0 || u >= n || u == v || std::find(ids.begin(), ids.end(), u) != ids.end()) continue;
    ids.push_back(u);
    dists.push_back(vectors(v, u));
  }
  const int count = static_cast<int>(ids.size());
  order.resize(count);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return dists[a] < dists[b] || (dists[a] == dists[b] && a < b); });
  keep.assign(count, 0);
  kept.clear();
  for (const int j : order) {
    const bool covered = std::any_of(kept.begin(), kept.end(),
                                     [&](int i) { return vectors(ids[i], ids[j]) < dists[j]; });
    if (!covered) {
      kept.push_back(j);
      keep[j] = 1;
    }
  }
  int stay = 0;
  for (int j = 0; j < count; ++j) {
    if (!keep[j]) continue;
    ids[stay] = ids[j];
    dists[stay] = dists[j];
    ++stay;
  }
  ids.resize(stay);
  dists.resize(stay);
}

// Line 4 of Algorithm 3: S random distinct neighbours (self and repeats are dropped, so a
// vertex may start with slightly fewer), drawn where start_cell (params.h, hubs.h) says; after
// the entries of `init` where given that the rule keeps among themselves, as old ones
// (build_schedule.h, start_entries); a merge's draws come from the other graph's rows, and a
// growing graph's rows draw fewer, from the new rows (Split).
void initialise(const VectorSet& vectors, int64_t n, const BuildParams& p, const Cells& cells, const at::Tensor& init,
                const Split& split, Pools& pools) {
  const CellView view = cell_view(cells);
  const int64_t columns = init.defined() ? init.size(1) : 0;
  const int32_t* start = init.defined() ? init.data_ptr<int32_t>() : nullptr;
  parallel_dynamic(n, 256, [&](int64_t v) {
    if (columns > 0 && !split.new_row(v)) {
      thread_local std::vector<int32_t> ids;
      thread_local std::vector<float> dists;
      keep_uncovered(vectors, n, v, start + v * columns, columns, ids, dists);
      for (size_t j = 0; j < ids.size(); ++j) pools.insert(0, v, ids[j], dists[j], false);
    }
    const int draws = split.draws(v, p.initial_degree);
    for (int s = 0; s < draws; ++s) {
      const uint32_t r = random_u32(p.seed, Stream::kInitialNeighbours, static_cast<uint32_t>(v), 0, s);
      const int64_t u = initial_neighbour(view, v, s, p.initial_degree, r, n, split.draws_from(v));
      if (u != v) pools.insert(0, v, static_cast<int32_t>(u), vectors(v, u), true);
    }
  });
}

// The order in which vertex v visits its pool this round (section 3.3 and the Figure 7 ablation).
void visit_order(const Pools& pools, int buf, int64_t v, uint32_t round, const BuildParams& p,
                 std::vector<int>& order, std::vector<uint32_t>& keys) {
  const int count = pools.count(buf, v);
  const float* dist = pools.dists(buf, v);
  order.resize(count);
  std::iota(order.begin(), order.end(), 0);
  switch (p.update_order) {
    case UpdateOrder::kRandom:
    case UpdateOrder::kDescendingThenRandom:  // resolved per outer iteration (order_for_iteration)
      keys.resize(count);
      for (int i = 0; i < count; ++i) {
        keys[i] = random_u32(p.seed, Stream::kVisitOrder, static_cast<uint32_t>(v), round, i);
      }
      std::sort(order.begin(), order.end(), [&](int a, int b) { return keys[a] < keys[b] || (keys[a] == keys[b] && a < b); });
      break;
    case UpdateOrder::kAscending:
      std::sort(order.begin(), order.end(), [&](int a, int b) { return dist[a] < dist[b] || (dist[a] == dist[b] && a < b); });
      break;
    case UpdateOrder::kDescending:
      std::sort(order.begin(), order.end(), [&](int a, int b) { return dist[a] > dist[b] || (dist[a] == dist[b] && a < b); });
      break;
  }
}

// Algorithm 4 for one vertex: walk the pool in `order`; each entry is tested against the
// entries kept so far (the pairs compares_pair names) with the relative-neighbourhood rule
// (eq. 2): when two neighbours are closer to each other than the farther one is to v, the
// farther one is handed to the closer one's next pool and dropped from v's. What survives goes
// to v's next pool as old entries. Returns how many of the handed-over entries changed a pool
// (the convergence measure).
//
// The hand-overs are decided first and inserted after, as the CUDA kernel does: the walk reads
// only buffer `read`, so the pools end the same (an insert keeps the pool's best entries, in
// whatever order they come), and the target pools, scattered over memory, are prefetched while
// the walk goes on instead of each insert waiting for its own.
struct HandOver {
  int32_t to, id;
  float dist;
};

int update_vertex(const VectorSet& vectors, Pools& pools, int read, int64_t v, uint32_t round,
                  const BuildParams& p, const Split& split, std::vector<int>& order, std::vector<uint32_t>& keys,
                  std::vector<int>& kept, std::vector<HandOver>& moves) {
  const int write = read ^ 1;
  const uint32_t* slot = pools.slots(read, v);
  const float* dist = pools.dists(read, v);
  visit_order(pools, read, v, round, p, order, keys);
  for (int i = 0; i < pools.count(read, v); ++i) vectors.prefetch_pair(slot_id(slot[i]));
  kept.clear();
  moves.clear();
  for (const int i : order) {
    const int32_t a = slot_id(slot[i]);
    bool keep = true;
    for (size_t j = 0; j < kept.size();) {
      const int b_index = kept[j];
      const int32_t b = slot_id(slot[b_index]);
      if (!compares_pair(a, slot_is_new(slot[i]), b, slot_is_new(slot[b_index]), split)) {
        ++j;
        continue;
      }
      const float d_ab = vectors.pair(a, b);
      if (d_ab < std::max(dist[i], dist[b_index])) {
        if (dist[i] >= dist[b_index]) {  // a is the farther one: it moves to b
          moves.push_back({b, a, d_ab});
          pools.prefetch(write, b);
          keep = false;
          break;
        }
        moves.push_back({a, b, d_ab});  // b is the farther one: it moves to a
        pools.prefetch(write, a);
        kept.erase(kept.begin() + j);
        continue;
      }
      ++j;
    }
    if (keep) kept.push_back(i);
  }
  int changes = 0;
  for (const HandOver& m : moves) changes += pools.insert(write, m.to, m.id, m.dist, true);
  for (const int i : kept) pools.insert(write, v, slot_id(slot[i]), dist[i], false);
  return changes;
}

// Section 3.6: v offers itself as a new neighbour to its ceil(rho * |N_v|) closest neighbours.
// Reads buffer `read`, writes into a copy of it in the other buffer.
void sample_reverse_edges(int64_t n, Pools& pools, int read, const BuildParams& p) {
  const int write = read ^ 1;
  pools.copy(read, write);
  parallel_dynamic(n, 256, [&](int64_t v) {
    const int count = pools.count(read, v);
    const int sampled = static_cast<int>(std::ceil(p.reverse_ratio * count));
    if (sampled == 0) return;
    const uint32_t* slot = pools.slots(read, v);
    const float* dist = pools.dists(read, v);
    std::vector<int> closest(count);
    std::iota(closest.begin(), closest.end(), 0);
    std::partial_sort(closest.begin(), closest.begin() + sampled, closest.end(),
                      [&](int a, int b) { return dist[a] < dist[b] || (dist[a] == dist[b] && a < b); });
    for (int j = 0; j < sampled; ++j) {
      pools.insert(write, slot_id(slot[closest[j]]), static_cast<int32_t>(v), dist[closest[j]], true);
    }
  });
}

at::Tensor build_cpu(const at::Tensor& data, int64_t degree, int64_t initial_degree, int64_t pool_size,
                     int64_t outer_iters, int64_t inner_iters, double reverse_ratio, c10::string_view update_order,
                     c10::string_view metric, int64_t seed, double delta, c10::string_view start,
                     const c10::optional<at::Tensor>& init, int64_t init_split, c10::string_view init_mode,
                     const c10::optional<at::Tensor>& pair_code_rows, double pair_code_scale, bool widen) {
  check_build_inputs(data);
  BuildParams p = make_build_params(degree, initial_degree, pool_size, outer_iters, inner_iters, reverse_ratio,
                                    std::string(update_order), std::string(metric), seed, delta, std::string(start),
                                    widen);
  const at::Tensor codes = check_pair_codes(pair_code_rows, pair_code_scale, data, p.metric);
  const int64_t n = data.size(0);
  const at::Tensor x = prepare_build_vectors(data, p.metric);
  VectorSet vectors{x.data_ptr<float>(), x.size(1), p.metric};
  const at::Tensor lift = inner_product_lift(x, p.metric);
  if (lift.defined()) vectors.lift = lift.data_ptr<float>();
  if (codes.defined()) {
    vectors.codes = codes.data_ptr<uint8_t>();
    vectors.code_stride = codes.size(1);
    vectors.code_scale = static_cast<float>(pair_code_scale);
  }

  Pools pools(n, p.pool_size);
  const Split split = start_split(init_split, init_mode, n, p);
  const at::Tensor init_entries = start_entries(init, data, p);
  initialise(vectors, n, p, p.start == Start::kHubs ? partition_cells(x, lift) : Cells{}, init_entries, split, pools);
  int read = 0;
  // The pools as a graph: each pool sorted by distance, cut to `degree`, -1 padded. The build's
  // result before its fill, and what the unfound share is measured on between outer iterations.
  auto pools_graph = [&] {
    at::Tensor graph = at::full({n, p.degree}, -1, data.options().dtype(at::kInt).device(at::kCPU));
    int32_t* out = graph.data_ptr<int32_t>();
    at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
      std::vector<int> order;
      for (int64_t v = begin; v < end; ++v) {
        const int count = pools.count(read, v);
        const uint32_t* slot = pools.slots(read, v);
        const float* dist = pools.dists(read, v);
        order.resize(count);
        std::iota(order.begin(), order.end(), 0);
        const int kept = std::min(count, p.degree);
        std::partial_sort(order.begin(), order.begin() + kept, order.end(), [&](int a, int b) {
          return dist[a] < dist[b] || (dist[a] == dist[b] && slot_id(slot[a]) < slot_id(slot[b]));
        });
        for (int j = 0; j < kept; ++j) out[v * p.degree + j] = slot_id(slot[order[j]]);
      }
    });
    return graph;
  };
  run_schedule(
      p, counted_rows(split, n), init_entries.defined(),
      [&](UpdateOrder order, uint32_t round, bool /*count: free here*/) {
        BuildParams iteration = p;
        iteration.update_order = order;
        pools.clear(read ^ 1);
        std::atomic<int64_t> changes{0};
        parallel_dynamic(n, 64, [&](int64_t v) {
          thread_local std::vector<int> order_of, kept;
          thread_local std::vector<HandOver> moves;
          thread_local std::vector<uint32_t> keys;
          const int changed =
              update_vertex(vectors, pools, read, v, round, iteration, split, order_of, keys, kept, moves);
          if (changed > 0) changes.fetch_add(changed, std::memory_order_relaxed);
        });
        read ^= 1;
        return changes.load();
      },
      [&] {
        sample_reverse_edges(n, pools, read, p);
        read ^= 1;
      },
      [&] { return unfound_share(data, pools_graph(), metric); },
      [&] { return neighbourhood_dimensions(data, metric); },
      [&](int wide_pool_size) {
        pools.widen(read, wide_pool_size);
        read = 0;
        return true;
      });

  at::Tensor graph = fill_rows_cpu(pools_graph(), x, lift, p.metric);
  connect_unreachable(graph, data, metric, x, lift);
  return graph;
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CPU, m) {
  m.impl("build", &build_cpu);
  m.impl("connect", [](const at::Tensor& data, const at::Tensor& graph, c10::string_view metric) {
    return connected_copy(data, graph, metric, prepare_build_vectors(data, parse_metric(std::string(metric))));
  });
  m.impl("fill", [](const at::Tensor& data, const at::Tensor& graph, c10::string_view metric) {
    check_fill_inputs(data, graph);
    const Metric m = parse_metric(std::string(metric));
    const at::Tensor x = prepare_build_vectors(data, m);
    return fill_rows_cpu(graph, x, inner_product_lift(x, m), m);
  });
}

}  // namespace cpu
}  // namespace grnnd
