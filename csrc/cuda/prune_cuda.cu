// prune_rows on the GPU: the twin of csrc/cpu/prune_cpu.cpp, the recipe of csrc/build/prune.h with one
// warp (a block of 32 threads) per row. The row's candidates and their distances to the vertex
// sit in shared memory, where a bitonic network sorts them by (distance, key) (sort_cuda.cuh);
// a key is 2 x id, plus 1 unless the candidate is fixed, so repeats are adjacent, the fixed copy
// first, and they are dropped in the same pass that cuts the list. The rule's
// distances are computed by teams of lanes (vectors_cuda.cuh), several kept entries at once, as
// the build's update does. A shrink (shrink_row) sorts nothing: the row keeps its order and the
// newcomers find their places by binary search.
#include <limits>

#include <torch/library.h>

#include "../core/checks.h"
#include "../build/prune.h"
#include "detail/sort_cuda.cuh"
#include "detail/vectors_cuda.cuh"
#include "detail/warp_cuda.cuh"

namespace grnnd {
namespace cuda {
namespace {

struct PruneArgs {
  const int64_t* vertices;    // [m]
  const int64_t* candidates;  // [m, width]
  int64_t width;
  int64_t n;
  int dim;
  Metric metric;
  const float* lift;  // inner product only (prune.h), else null
  int degree;
  int list_size;   // free candidates looked at: kPruneListFactor x degree
  bool rule;
  int64_t fixed;  // leading columns of `candidates` kept whatever the rule says
  bool shrink;    // a row and its newcomers lose only their covered surplus (prune.h, shrink)
  int sort_size;  // keys sorted per row: a power of two >= max(width, 32)
  int32_t* out;   // [m, degree]
};

// Entries of a row's list: list_size free ones and up to `degree` fixed ones (prune.h, step 2).
__host__ __device__ inline int list_capacity(const PruneArgs& a) { return a.list_size + a.degree; }

// Shared memory of a row, in 4-byte words. The rule: sort keys (distance, id), then the kept list
// positions, then a flag per list position. A shrink (ShrinkScratch): the merged list's ids,
// distances and flags, then the row's ids and distances, then the newcomers' ids, distances and
// places.
size_t prune_scratch_bytes(const PruneArgs& a) {
  const int64_t words = a.shrink ? 3 * int64_t{a.sort_size} + 5 * int64_t{a.degree}
                                 : 2 * int64_t{a.sort_size} + a.degree + list_capacity(a);
  return static_cast<size_t>(words) * sizeof(uint32_t);
}

struct ShrinkScratch {
  uint32_t* list_id;
  float* list_dist;  // kUnknown until computed
  int* flag;
  uint32_t* row_id;
  float* row_dist;  // kUnknown until computed
  uint32_t* new_id;
  float* new_dist;
  int* new_place;

  __device__ ShrinkScratch(uint32_t* s, const PruneArgs& a)
      : list_id(s),
        list_dist(reinterpret_cast<float*>(s + a.sort_size)),
        flag(reinterpret_cast<int*>(s + 2 * a.sort_size)),
        row_id(s + 3 * a.sort_size),
        row_dist(reinterpret_cast<float*>(s + 3 * a.sort_size + a.degree)),
        new_id(s + 3 * a.sort_size + 2 * a.degree),
        new_dist(reinterpret_cast<float*>(s + 3 * a.sort_size + 3 * a.degree)),
        new_place(reinterpret_cast<int*>(s + 3 * a.sort_size + 4 * a.degree)) {}
};

// The build's distance between rows u and w (prune.h), by the lanes of the calling team, each
// lane's chunks of both rows loaded before any is used (4 in flight, as the search loads them).
//
// Why, with 32 blocks (warps) per SM below: the kernel waits on row loads. ncu of the shrink in
// a 1% add to 1M x 384 float16 rows (H100, 213k rows): 9.8 ms, 57% of the cycles between a
// warp's instructions waiting on L1TEX, 0.61 eligible warps a scheduler, 80 registers holding it
// to 24 warps an SM, L2 hit rate 19%. One chunk at a time, a 768-byte row costs three round
// trips per distance. With both changes the ten 1% adds of a clustered 1M x 384 index took
// 16.4-20.2 ms against 20.8-25.5 ms (one process, one H100, a one-off script; the bounds alone
// 18.6-24.5 ms).
template <int TEAM, typename T>
__device__ __forceinline__ float prune_distance(const T* __restrict__ x, const PruneArgs& a, int64_t u, int64_t w,
                                                bool valid, int rank) {
  return rows_distance<TEAM, 4>(x, a.dim, a.metric, a.lift, u, w, valid, rank);
}

// A distance not computed yet (distances are never NaN: add and build refuse NaN rows).
__device__ __forceinline__ float unknown_distance() { return __int_as_float(0x7fffffff); }

// Step 6 of a shrink, step 4 of the rule: the entries whose flag is set, in list order, -1 padded
// (id_of(j): the id of list entry j).
template <typename IdOf>
__device__ __forceinline__ void write_kept(int32_t* row, int degree, int count, const int* flag, IdOf id_of) {
  const int lane = threadIdx.x;
  int written = 0;
  for (int base = 0; base < count; base += kWarpSize) {
    const int j = base + lane;
    const bool take = j < count && flag[j];
    const unsigned mask = __ballot_sync(kFullMask, take);
    const int at = written + __popc(mask & lanes_below(lane));
    if (take && at < degree) row[at] = static_cast<int32_t>(id_of(j));
    written += __popc(mask);
  }
  for (int j = min(written, degree) + lane; j < degree; j += kWarpSize) row[j] = -1;
}

// ---- The shrink of prune.h for vertex v, one warp: the row's entries keep their order, and only
// the distances the newcomers' places and the surplus need are computed. One function a step. ----

struct RowAndNewcomers {
  int row;         // c: the row's entries kept in s.row_id
  int newcomers;   // m: the newcomers in s.new_id
};

// 1. The row's entries in their order; newcomers: the other columns' ids that are not in the
// row, nor v, nor a repeat of an earlier column, the first `degree` of them.
__device__ __forceinline__ RowAndNewcomers gather_row_and_newcomers(const PruneArgs& a, int64_t v,
                                                                    const ShrinkScratch& s) {
  const int lane = threadIdx.x;
  const int degree = a.degree;
  const int64_t* cand = a.candidates + static_cast<int64_t>(blockIdx.x) * a.width;
  const int row_width = static_cast<int>(min(a.width, int64_t{degree}));
  int c = 0;
  for (int base = 0; base < row_width; base += kWarpSize) {
    const int j = base + lane;
    const int64_t w = j < row_width ? cand[j] : -1;
    const bool take = w >= 0 && w < a.n && w != v;
    const unsigned mask = __ballot_sync(kFullMask, take);
    if (take) {
      const int at = c + __popc(mask & lanes_below(lane));
      s.row_id[at] = static_cast<uint32_t>(w);
      s.row_dist[at] = unknown_distance();
    }
    c += __popc(mask);
  }
  __syncwarp();
  int m = 0;
  for (int base = row_width; base < a.width && m < degree; base += kWarpSize) {
    const int j = base + lane;
    const int64_t w = j < a.width ? cand[j] : -1;
    bool take = w >= 0 && w < a.n && w != v;
    for (int i = 0; take && i < c; ++i) take = s.row_id[i] != static_cast<uint32_t>(w);
    for (int i = row_width; take && i < j; ++i) take = cand[i] != w;
    const unsigned mask = __ballot_sync(kFullMask, take);
    const int at = m + __popc(mask & lanes_below(lane));
    if (take && at < degree) s.new_id[at] = static_cast<uint32_t>(w);
    m = min(degree, m + __popc(mask));
  }
  __syncwarp();
  return {c, m};
}

// 2. The newcomers' distances to v, then the newcomers by (distance, id).
template <typename T, int TEAM>
__device__ __forceinline__ void rank_newcomers(const T* __restrict__ x, const PruneArgs& a, int64_t v,
                                               const ShrinkScratch& s, int m) {
  constexpr int kTeams = kWarpSize / TEAM;
  const int lane = threadIdx.x, team = lane / TEAM, rank = lane % TEAM;
  for (int k0 = 0; k0 < m; k0 += kTeams) {
    const int k = k0 + team;
    const bool valid = k < m;
    const float d = prune_distance<TEAM>(x, a, v, valid ? s.new_id[k] : v, valid, rank);
    if (valid && rank == 0) s.new_dist[k] = d;
  }
  __syncwarp();
  for (int k = lane; k < m; k += kWarpSize) {
    const float d = s.new_dist[k];
    const uint32_t id = s.new_id[k];
    int before = 0;
    for (int i = 0; i < m; ++i) before += s.new_dist[i] < d || (s.new_dist[i] == d && s.new_id[i] < id);
    s.list_id[before] = id;
    s.list_dist[before] = d;
  }
  __syncwarp();
  for (int k = lane; k < m; k += kWarpSize) {
    s.new_id[k] = s.list_id[k];
    s.new_dist[k] = s.list_dist[k];
  }
  __syncwarp();
}

// 3. Each newcomer's place: a binary search over the row's distances, a team per newcomer, the
// distances shared between the teams as they are computed.
template <typename T, int TEAM>
__device__ __forceinline__ void place_newcomers(const T* __restrict__ x, const PruneArgs& a, int64_t v,
                                                const ShrinkScratch& s, int c, int m) {
  constexpr int kTeams = kWarpSize / TEAM;
  const int lane = threadIdx.x, team = lane / TEAM, rank = lane % TEAM;
  const int steps = 32 - __clz(c);  // the most halvings of [0, c)
  for (int k0 = 0; k0 < m; k0 += kTeams) {
    const int k = k0 + team;
    const float d = k < m ? s.new_dist[k] : 0.0f;
    int lo = 0, hi = k < m ? c : 0;
    for (int step = 0; step < steps; ++step) {
      const bool searching = lo < hi;
      const int mid = (lo + hi) >> 1;
      float d_mid = searching ? s.row_dist[mid] : 0.0f;
      const bool compute = searching && isnan(d_mid);  // the same for a team's lanes
      const float computed = prune_distance<TEAM>(x, a, v, compute ? s.row_id[mid] : v, compute, rank);
      __syncwarp();
      if (compute) {
        d_mid = computed;
        if (rank == 0) s.row_dist[mid] = computed;
      }
      if (searching) {
        if (d_mid <= d) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      __syncwarp();
    }
    if (k < m && rank == 0) s.new_place[k] = lo;
  }
  __syncwarp();
  if (lane == 0) {  // places never fall behind a nearer newcomer's (a row out of order could)
    for (int k = 1; k < m; ++k) s.new_place[k] = max(s.new_place[k], s.new_place[k - 1]);
  }
  __syncwarp();
}

// 4. The merged list: each newcomer before the row entry at its place, after the newcomers
// placed there before it. Returns its length.
__device__ __forceinline__ int merge_newcomers(const ShrinkScratch& s, int c, int m) {
  const int lane = threadIdx.x;
  const int count = c + m;
  for (int i = lane; i < c; i += kWarpSize) {
    int newcomers_before = 0;
    for (int k = 0; k < m; ++k) newcomers_before += s.new_place[k] <= i;
    s.list_id[i + newcomers_before] = s.row_id[i];
    s.list_dist[i + newcomers_before] = s.row_dist[i];
  }
  __syncwarp();
  for (int k = lane; k < m; k += kWarpSize) {
    const int at = s.new_place[k] + k;
    s.list_id[at] = s.new_id[k];
    s.list_dist[at] = s.new_dist[k];
  }
  for (int j = lane; j < count; j += kWarpSize) s.flag[j] = 1;
  __syncwarp();
  return count;
}

// 5. The surplus: from the farthest entry towards the nearest, a covered one goes; then the
// farthest that are left, while too many remain.
template <typename T, int TEAM>
__device__ __forceinline__ void drop_surplus(const T* __restrict__ x, const PruneArgs& a, int64_t v,
                                             const ShrinkScratch& s, int count) {
  constexpr int kTeams = kWarpSize / TEAM;
  const int lane = threadIdx.x, team = lane / TEAM, rank = lane % TEAM;
  int surplus = count - a.degree;
  for (int j = count - 1; j >= 0 && surplus > 0; --j) {  // warp-uniform
    const uint32_t u = s.list_id[j];
    float d_vu = s.list_dist[j];
    if (isnan(d_vu)) d_vu = __shfl_sync(kFullMask, prune_distance<TEAM>(x, a, v, u, team == 0, rank), 0);
    bool covered = false;
    for (int g0 = 0; !covered && g0 < j; g0 += kTeams) {
      const int g = g0 + team;
      const bool valid = g < j;
      const float d_wu = prune_distance<TEAM>(x, a, u, valid ? s.list_id[g] : u, valid, rank);
      covered = __any_sync(kFullMask, valid && rank == 0 && d_wu < d_vu);
    }
    if (covered) {
      if (lane == 0) s.flag[j] = 0;
      --surplus;
    }
  }
  __syncwarp();
  if (lane == 0) {
    for (int j = count - 1; j >= 0 && surplus > 0; --j) {
      if (s.flag[j]) {
        s.flag[j] = 0;
        --surplus;
      }
    }
  }
  __syncwarp();
}

template <typename T, int TEAM>
__device__ void shrink_row(const T* __restrict__ x, const PruneArgs& a, int64_t v, int32_t* row, uint32_t* scratch) {
  const ShrinkScratch s(scratch, a);
  const RowAndNewcomers found = gather_row_and_newcomers(a, v, s);
  rank_newcomers<T, TEAM>(x, a, v, s, found.newcomers);
  place_newcomers<T, TEAM>(x, a, v, s, found.row, found.newcomers);
  const int count = merge_newcomers(s, found.row, found.newcomers);
  drop_surplus<T, TEAM>(x, a, v, s, count);
  write_kept(row, a.degree, count, s.flag, [&](int j) { return s.list_id[j]; });  // 6.
}

// ---- The rule of prune.h for vertex v (steps 1-4), one warp. ----

struct RuleScratch {
  float* dist;
  uint32_t* id;  // sort keys: 2 x id, + 1 unless fixed
  int* kept;     // list positions of the kept entries, in order
  int* flag;     // per list position: kept

  __device__ RuleScratch(uint32_t* s, const PruneArgs& a)
      : dist(reinterpret_cast<float*>(s)),
        id(s + a.sort_size),
        kept(reinterpret_cast<int*>(s + 2 * a.sort_size)),
        flag(reinterpret_cast<int*>(s + 2 * a.sort_size) + a.degree) {}
};

// 1. Candidates and their distances to v, sorted; everything else sorts last as (inf, kEmptyId).
template <typename T, int TEAM>
__device__ __forceinline__ void sort_candidates(const T* __restrict__ x, const PruneArgs& a, int64_t v,
                                                const RuleScratch& s) {
  constexpr int kTeams = kWarpSize / TEAM;
  const int lane = threadIdx.x, team = lane / TEAM, rank = lane % TEAM;
  const int64_t* cand = a.candidates + static_cast<int64_t>(blockIdx.x) * a.width;
  for (int j = lane; j < a.sort_size; j += kWarpSize) {
    uint32_t key = kEmptyId;  // odd, and above every real key (n < 2^30 - 1)
    if (j < a.width) {
      const int64_t w = cand[j];
      if (w >= 0 && w < a.n && w != v) key = static_cast<uint32_t>(2 * w + (j < a.fixed ? 0 : 1));
    }
    s.id[j] = key;
    s.dist[j] = std::numeric_limits<float>::infinity();
  }
  for (int j = lane; j < list_capacity(a); j += kWarpSize) s.flag[j] = 0;
  __syncwarp();
  for (int g0 = 0; g0 < a.width; g0 += kTeams) {
    const int g = g0 + team;
    const bool valid = g < a.width && s.id[g] != kEmptyId;
    const float d = prune_distance<TEAM>(x, a, v, valid ? s.id[g] >> 1 : v, valid, rank);
    if (valid && rank == 0) s.dist[g] = d;
  }
  __syncthreads();
  bitonic<false>(s.dist, s.id, a.sort_size);
}

struct ListCounts {
  int entries;       // the list's length
  int fixed_listed;  // of them fixed
};

// 2. Repeats are adjacent now: keep the first of each (the fixed one where there is one), the
// nearest list_size free ones and `degree` fixed ones, compacted in place.
// A chunk's entries are all read before any of its writes, and writes land at or below the
// entry read, so no entry is overwritten before it is read.
__device__ __forceinline__ ListCounts compact_list(const PruneArgs& a, const RuleScratch& s) {
  const int lane = threadIdx.x;
  int count = 0, free_count = 0;
  int fixed_count = a.fixed > 0 ? 0 : a.degree;  // no fixed column: that quota is full
  uint32_t before = 0xffffffffu;  // the key ahead of the chunk, as it was before compaction
  for (int base = 0; base < a.sort_size && (free_count < a.list_size || fixed_count < a.degree);
       base += kWarpSize) {
    const uint32_t u = s.id[base + lane];
    const float d = s.dist[base + lane];
    uint32_t previous = __shfl_up_sync(kFullMask, u, 1);
    if (lane == 0) previous = before;
    before = __shfl_sync(kFullMask, u, kWarpSize - 1);
    const bool fresh = u != kEmptyId && (u >> 1) != (previous >> 1);
    const bool is_free = (u & 1u) != 0;
    const unsigned below = lanes_below(lane);
    const unsigned free_mask = __ballot_sync(kFullMask, fresh && is_free);
    const unsigned fixed_mask = __ballot_sync(kFullMask, fresh && !is_free);
    const bool take = fresh && (is_free ? free_count + __popc(free_mask & below) < a.list_size
                                        : fixed_count + __popc(fixed_mask & below) < a.degree);
    const unsigned take_mask = __ballot_sync(kFullMask, take);
    const int at = count + __popc(take_mask & below);
    __syncwarp();
    if (take) {
      s.id[at] = u;
      s.dist[at] = d;
    }
    count += __popc(take_mask);
    free_count = min(a.list_size, free_count + __popc(free_mask));
    fixed_count = min(a.degree, fixed_count + __popc(fixed_mask));
    __syncwarp();
    if (__any_sync(kFullMask, u == kEmptyId)) break;  // the empty keys sort last
  }
  return {count, a.fixed > 0 ? fixed_count : 0};
}

// 3. The rule in list order (every fixed entry kept, the free ones in the places left beside
// them), then the fill from the entries it dropped.
template <typename T, int TEAM>
__device__ __forceinline__ void apply_rule(const T* __restrict__ x, const PruneArgs& a, const RuleScratch& s,
                                           ListCounts list) {
  constexpr int kTeams = kWarpSize / TEAM;
  const int lane = threadIdx.x, team = lane / TEAM, rank = lane % TEAM;
  int kept_count = 0;
  int free_places = a.degree - list.fixed_listed;
  for (int j = 0; j < list.entries; ++j) {  // warp-uniform
    const uint32_t u = s.id[j] >> 1;
    const bool free = (s.id[j] & 1u) != 0;
    if (free && free_places == 0) continue;
    const float d_vu = s.dist[j];
    bool keep = true;
    for (int g0 = 0; a.rule && free && keep && g0 < kept_count; g0 += kTeams) {
      const int g = g0 + team;
      const bool valid = g < kept_count;
      const float d_wu = prune_distance<TEAM>(x, a, u, valid ? s.id[s.kept[g]] >> 1 : u, valid, rank);
      keep = !__any_sync(kFullMask, valid && rank == 0 && d_wu < d_vu);
    }
    if (keep) {
      if (lane == 0) {
        s.kept[kept_count] = j;
        s.flag[j] = 1;
      }
      ++kept_count;
      free_places -= free;
      __syncwarp();
    }
  }
  if (lane == 0) {
    for (int j = 0; j < list.entries && kept_count < a.degree; ++j) {
      if (!s.flag[j]) {
        s.flag[j] = 1;
        ++kept_count;
      }
    }
  }
  __syncwarp();
}

template <typename T, int TEAM>
__device__ __forceinline__ void prune_row(const T* __restrict__ x, const PruneArgs& a, int64_t v, int32_t* row,
                                          uint32_t* scratch) {
  const RuleScratch s(scratch, a);
  sort_candidates<T, TEAM>(x, a, v, s);
  const ListCounts list = compact_list(a, s);
  apply_rule<T, TEAM>(x, a, s, list);
  write_kept(row, a.degree, list.entries, s.flag, [&](int j) { return s.id[j] >> 1; });  // 4.
}

template <typename T, int TEAM>
__global__ void __launch_bounds__(kWarpSize, 32) prune_kernel(const T* __restrict__ x, PruneArgs a) {
  extern __shared__ uint32_t scratch[];
  int32_t* row = a.out + static_cast<int64_t>(blockIdx.x) * a.degree;
  const int64_t v = a.vertices[blockIdx.x];
  if (v < 0 || v >= a.n) {  // checked on the host unless the stream is being captured
    for (int j = threadIdx.x; j < a.degree; j += kWarpSize) row[j] = -1;
    return;
  }
  if (a.shrink) {
    shrink_row<T, TEAM>(x, a, v, row, scratch);
  } else {
    prune_row<T, TEAM>(x, a, v, row, scratch);
  }
}

template <typename T, int TEAM>
void launch(const at::Tensor& x, const PruneArgs& a, int64_t m, cudaStream_t stream) {
  prune_kernel<T, TEAM><<<static_cast<unsigned>(m), kWarpSize, prune_scratch_bytes(a), stream>>>(
      x.data_ptr<T>(), a);
  check_launch();
}

at::Tensor prune_rows_cuda(const at::Tensor& data, const at::Tensor& vertices, const at::Tensor& candidates,
                           int64_t degree, c10::string_view metric_name, bool rule, int64_t fixed, bool shrink) {
  check_prune_inputs(data, vertices, candidates, degree, fixed, shrink);
  const c10::cuda::CUDAGuard guard(data.device());
  const Metric metric = parse_metric(std::string(metric_name));
  const at::Tensor x = prepare_vectors(data, metric);
  const at::Tensor lift = inner_product_lift(x, metric);
  const at::Tensor cand = candidates.to(at::kLong).contiguous();
  const at::Tensor verts = vertices.contiguous();
  const int64_t m = verts.size(0);
  at::Tensor out = at::empty({m, degree}, vertices.options().dtype(at::kInt));
  if (m == 0) return out;
  const PruneArgs a{verts.data_ptr<int64_t>(),
                    cand.data_ptr<int64_t>(),
                    cand.size(1),
                    x.size(0),
                    static_cast<int>(x.size(1)),
                    lift.defined() ? Metric::kL2 : metric,
                    lift.defined() ? lift.data_ptr<float>() : nullptr,
                    static_cast<int>(degree),
                    static_cast<int>(kPruneListFactor * degree),
                    rule,
                    fixed,
                    shrink,
                    next_pow2(static_cast<int>(std::max<int64_t>(cand.size(1), kWarpSize))),
                    out.data_ptr<int32_t>()};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(data.device().index());
  GRNND_DISPATCH_STORAGE(x.scalar_type(), "grnnd_prune_rows_cuda", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "prune_rows: float64 storage reached the CUDA kernel (prepare_vectors narrows it)");
    } else {
      switch (team_for_row(x.size(1) * x.element_size())) {
        case 4:
          launch<scalar_t, 4>(x, a, m, stream);
          break;
        case 8:
          launch<scalar_t, 8>(x, a, m, stream);
          break;
        case 16:
          launch<scalar_t, 16>(x, a, m, stream);
          break;
        default:
          launch<scalar_t, 32>(x, a, m, stream);
          break;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CUDA, m) { m.impl("prune_rows", &prune_rows_cuda); }

}  // namespace cuda
}  // namespace grnnd
