// GRNND graph build on the GPU: the twin of csrc/cpu/build_cpu.cpp (seed 000, Algorithms 3-6).
//
// One warp per vertex (section 3.4) does what one CPU thread does in update_vertex, in the same
// order and with the same random draws (csrc/core/philox.h), so the two builds differ only through
// the timing of concurrent inserts and float rounding. The four GRNND components map to:
//   1. disordered propagation  -> visit_order (update_order = random | ascending | descending |
//                                 descending_then_random),
//   2. warp-level cooperation  -> team distances, ballot dedupe and max-reduce (warp_cuda.cuh),
//   3. double-buffered pools   -> DevicePools, two [N, R] buffers, `read` flips every round,
//   4. reverse-edge sampling   -> reverse_kernel (reverse_ratio = 0 switches it off).
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>

#include <cuda_runtime_api.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/library.h>

#include "../build/build_schedule.h"
#include "../core/checks.h"
#include "../build/hubs.h"
#include "../build/fill.h"
#include "../core/philox.h"
#include "../build/prune.h"
#include "../build/reachability.h"
#include "detail/mma_cuda.cuh"
#include "detail/vectors_cuda.cuh"
#include "detail/warp_cuda.cuh"

namespace grnnd {
namespace cuda {
namespace {

// A pool slot packs the neighbour id with its "new" flag in the top bit (ids are < 2^31), as
// on the CPU: a pair of two old entries already passed the RNG test and is skipped.
constexpr uint32_t kNewBit = 0x80000000u;
constexpr uint32_t kIdMask = ~kNewBit;
__device__ __forceinline__ int32_t slot_id(uint32_t slot) { return static_cast<int32_t>(slot & kIdMask); }
__device__ __forceinline__ bool slot_is_new(uint32_t slot) { return (slot & kNewBit) != 0; }
__device__ __forceinline__ uint32_t pack_slot(int32_t id, bool is_new) {
  return static_cast<uint32_t>(id) | (is_new ? kNewBit : 0u);
}

// Two warps (two vertices) per block. Warps share nothing but the block's slot on the SM, which
// a block holds until its slowest vertex is done: with eight per block, ncu saw 28 of 40
// possible warps per SM active. The per-warp scratch below stays within the default 48 KiB of
// shared memory per block even at pool_size = kMaxPoolSize.
constexpr int kWarpsPerBlock = 2;
constexpr int kBlockThreads = kWarpsPerBlock * kWarpSize;
// Resident warps per SM update_kernel is compiled for. Without a bound the compiler takes 64
// registers a thread, which fits 32 warps, and ncu showed a latency-bound kernel (21 warps
// active, an instruction every 2.1 cycles per scheduler). At 40 (48 registers, a few bytes
// spilled) the 1M x 384 float16 build took 0.562 s against 0.634 s (H200, eight warps a block);
// two warps a block then took it to 0.506 s, and 48 warps (42 registers) to 0.525 s. Rechecked
// after the inserts left the pair loop (update_kernel), in one run: 48 warps 0.405 s against
// 0.417 s for float16 but 0.673 s against 0.619 s for float32 rows, 32 warps 0.481 s.
constexpr int kUpdateWarpsPerSm = 40;
// Chunks of a row each lane loads before using the first in the build's distances (team_visit).
// More than one made the 1M x 384 float16 build slower (H200): 0.57 s with two or three, 0.61 s
// with four as in the search, against 0.51 s: the pair loop then spills under the register bound
// above. So did two after update_kernel had moved its inserts out of that loop: 0.453 s against
// 0.417 s. Three other ways to the same rows measured slower too, against 0.49 s:
//   - staging the next batch's rows in shared memory with cp.async while the current batch is
//     computed: 0.59 s (not profiled; the shared memory it takes comes out of L1);
//   - tensor-core dot products (mma.m16n8k16, eight rows per warp, |a|^2 + |b|^2 - 2 <a, b>):
//     0.63 s with two chunks in flight, 0.78 s with one;
//   - prefetching the next batch's rows and the next entry's row into L1 (prefetch.global.L1,
//     no registers held): 0.503 s against 0.484 s, descending 0.688 s against 0.657 s;
//   - copying each walked entry's row into the warp's shared memory once, so that its pairs read
//     only the other row: no faster where ncu had seen L2 throughput at 81% of peak and DRAM at
//     49-57% (2M x 1024 float16 zipf_aniso, rounds 3 and 10, L1 hit rate 4-9%), so the kept
//     entries' rows, not the walked one's, are that traffic. Same binary, alternating (one H200):
//     zipf_aniso 1M x 1024 1.059 s against 1.054-1.064 s, 10M x 1024 14.21 s against 14.03 s;
//     1M x 384 blobs 0.439 s against 0.420 s.
// ncu on this kernel: L2 at 61% and SM at 66% of peak, DRAM at 14%, L2 hit rate 84%; neither the
// arithmetic nor the load latency alone bounds it.
constexpr int kBuildChunksInFlight = 1;
// Words of shared scratch per pool slot and warp: slot, dist, key, order, kept, cmp, move,
// move_dist.
constexpr int kScratchWords = 8;
static_assert(kWarpsPerBlock * kScratchWords * kMaxPoolSize * 4 <= 48 * 1024, "scratch exceeds 48 KiB");

// Section 3.5: two fixed [N, R] buffers of (slot, dist) plus counts; buffer `read` holds the
// current pools, `read ^ 1` receives the next ones. One lock word per vertex guards inserts
// into its pool (only one buffer is written by any kernel, so one lock serves both). Each
// buffer's slots and distances are allocations of their own, so that a widening build can free
// them one at a time (widen_pools).
struct DevicePools {
  uint32_t* slots[2];  // [n, capacity] each
  float* dists[2];     // [n, capacity] each
  int* counts;         // [2, n]
  int* locks;          // [n]
  int64_t n;
  int capacity;

  GRNND_HOST_DEVICE uint32_t* slot_buffer(int buf) const { return buf ? slots[1] : slots[0]; }
  GRNND_HOST_DEVICE float* dist_buffer(int buf) const { return buf ? dists[1] : dists[0]; }
  __device__ uint32_t* slots_of(int buf, int64_t v) const { return slot_buffer(buf) + v * capacity; }
  __device__ float* dists_of(int buf, int64_t v) const { return dist_buffer(buf) + v * capacity; }
  __device__ int* count_of(int buf, int64_t v) const { return counts + buf * n + v; }

  // Calls insert_all(insert) under v's lock in buffer `buf`, where insert(slot, dist) is
  // Algorithm 6 into v's pool; the pool's count is read once and stored once. Other warps insert
  // into the same pool concurrently, hence the lock. Returns how many inserts changed the pool.
  template <typename InsertAll>
  __device__ int locked_inserts(int buf, int64_t v, int lane, InsertAll&& insert_all) const {
    warp_lock(locks + v, lane);
    int* count_ptr = count_of(buf, v);
    const int before = __ldcg(count_ptr);
    int count = before, changes = 0;
    insert_all([&](uint32_t slot, float dist) {
      bool changed;
      count = warp_insert_locked(slots_of(buf, v), dists_of(buf, v), count, capacity, kIdMask, slot, dist, lane,
                                 changed);
      changes += changed;
    });
    if (lane == 0 && count != before) *count_ptr = count;
    warp_unlock(locks + v, lane);
    return changes;
  }

  // One insert, the lock held for it only; whether it changed the pool.
  __device__ bool insert(int buf, int64_t v, int32_t id, float dist, bool is_new, int lane) const {
    return locked_inserts(buf, v, lane, [&](auto&& insert) { insert(pack_slot(id, is_new), dist); }) > 0;
  }

  // The m entries entry(k) -> (slot, dist), k = 0 .. m - 1, of distinct ids, into v's pool in
  // buffer `buf` with the outcome of m inserts in that order: an id already in the pool is
  // skipped, the others are appended. Where they all fit, that is one membership test a lane
  // against the pool's ids (copied into `present`, capacity words of the warp's shared memory)
  // and one store each; only where the pool would overflow, and inserts start replacing its
  // farthest entries, do they run one at a time. Each of those reads the whole pool through L2
  // under the lock, and a vertex's survivors, inserted so, were what kept a round of settled
  // pools from being cheap.
  template <typename Entry>
  __device__ void insert_distinct(int buf, int64_t v, int m, uint32_t* present, int lane, const Entry& entry) const {
    warp_lock(locks + v, lane);
    int* count_ptr = count_of(buf, v);
    const int before = __ldcg(count_ptr);
    uint32_t* slot_out = slots_of(buf, v);
    float* dist_out = dists_of(buf, v);
    for (int i = lane; i < before; i += kWarpSize) present[i] = __ldcg(slot_out + i) & kIdMask;
    __syncwarp();
    const auto absent = [&](uint32_t slot) {
      const uint32_t id = slot & kIdMask;
      for (int i = 0; i < before; ++i) {
        if (present[i] == id) return false;
      }
      return true;
    };
    int fresh = 0;
    for (int base = 0; base < m; base += kWarpSize) {
      uint32_t slot = 0;
      float dist = 0.0f;
      if (base + lane < m) entry(base + lane, slot, dist);
      fresh += __popc(__ballot_sync(kFullMask, base + lane < m && absent(slot)));
    }
    if (before + fresh <= capacity) {
      int count = before;
      for (int base = 0; base < m; base += kWarpSize) {
        uint32_t slot = 0;
        float dist = 0.0f;
        if (base + lane < m) entry(base + lane, slot, dist);
        const bool append = base + lane < m && absent(slot);
        const unsigned mask = __ballot_sync(kFullMask, append);
        if (append) {
          const int at = count + __popc(mask & lanes_below(lane));
          slot_out[at] = slot;
          dist_out[at] = dist;
        }
        count += __popc(mask);
      }
      if (lane == 0 && count != before) *count_ptr = count;
    } else {
      int count = before;
      for (int k = 0; k < m; ++k) {
        uint32_t slot;
        float dist;
        entry(k, slot, dist);
        bool changed;
        count = warp_insert_locked(slot_out, dist_out, count, capacity, kIdMask, slot, dist, lane, changed);
      }
      if (lane == 0 && count != before) *count_ptr = count;
    }
    warp_unlock(locks + v, lane);
  }
};

struct BuildArgs {
  int64_t n;
  int dim;
  Metric metric;      // the metric distances between rows are computed in (l2 when lifted)
  const float* lift;  // inner product only: the extra coordinate of each row (params.h), else null
  UpdateOrder update_order;
  uint64_t seed;
  CellView cells;  // where initial neighbours are drawn (hubs.h); empty: uniformly
  Split split;     // where a merge's second graph or a growing graph's new rows start (build_schedule.h)
  int* changes;    // [n]: the pool entries each vertex's redirects changed in the last round
  // One-byte codes of the rows (check_pair_codes) the update rounds take their pair distances
  // from, or null: rows of code_stride bytes, d = code_scale * the sum of squared differences.
  const uint8_t* codes;
  int64_t code_stride;
  float code_scale;
};

// d(a, b) between two rows as the CPU's VectorSet computes it (up to the rounding of
// team_distance's HALF_DIFFERENCE), by the TEAM lanes of the calling team: the metric's
// distance, or for inner product the squared Euclidean distance in the space lifted by one
// coordinate (params.h, lifts_inner_product). A team without a pair passes
// valid = false and gets a meaningless value without loading anything.
template <int TEAM, typename T>
__device__ __forceinline__ float row_distance(const T* __restrict__ x, const BuildArgs& args, int64_t a, int64_t b,
                                              bool valid, int rank) {
  return rows_distance<TEAM, kBuildChunksInFlight, /*HALF_DIFFERENCE=*/true>(x, args.dim, args.metric, args.lift, a,
                                                                            b, valid, rank);
}

// d(a, b) from the rows' one-byte codes, by the TEAM lanes of the calling team, and the same
// float as the CPU's pair_code_distance (csrc/cpu/vectors_cpu.h): each lane sums its 16-byte
// chunks' squared byte differences exactly, four bytes an instruction pair (__vabsdiffu4, then
// __dp4a of the differences with themselves), the team adds the lanes' sums, and the total is
// rounded to float32 once and scaled. Half the bytes of float16 rows and about a fifth of their
// instructions a dimension. valid = false as in row_distance.
template <int TEAM>
__device__ __forceinline__ float pair_code_distance(const BuildArgs& args, int64_t a, int64_t b, bool valid,
                                                    int rank) {
  uint32_t sum = 0;
  if (valid) {
    const uint4* row_a = reinterpret_cast<const uint4*>(args.codes + a * args.code_stride);
    const uint4* row_b = reinterpret_cast<const uint4*>(args.codes + b * args.code_stride);
    const int chunks = static_cast<int>(args.code_stride / 16);
    for (int c = rank; c < chunks; c += TEAM) {
      const uint4 u = __ldg(row_a + c), w = __ldg(row_b + c);
      const uint32_t d0 = __vabsdiffu4(u.x, w.x), d1 = __vabsdiffu4(u.y, w.y);
      const uint32_t d2 = __vabsdiffu4(u.z, w.z), d3 = __vabsdiffu4(u.w, w.w);
      sum = __dp4a(d0, d0, sum);
      sum = __dp4a(d1, d1, sum);
      sum = __dp4a(d2, d2, sum);
      sum = __dp4a(d3, d3, sum);
    }
  }
  for (int offset = TEAM / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
  return static_cast<float>(sum) * args.code_scale;
}

// A warp's share of the block's dynamic shared memory: its copy of the read pool and the
// lists update_vertex keeps in std::vectors on the CPU.
struct WarpScratch {
  uint32_t* slot;  // read pool: packed slots
  float* dist;     // read pool: d(v, slot)
  uint32_t* key;   // random sort keys (update), candidate ids (initialise)
  int* order;      // visit order: pool indices
  int* kept;       // pool indices kept so far, in visit order
  int* cmp;        // positions in `kept` that the current entry must be compared with
  uint32_t* move;  // redirects decided so far: target and moved entry's pool indices (pack_move)
  float* move_dist;  // d(target, moved) of each redirect
};

__device__ __forceinline__ WarpScratch warp_scratch(int capacity) {
  extern __shared__ uint32_t scratch[];
  uint32_t* base = scratch + static_cast<int64_t>(threadIdx.x / kWarpSize) * kScratchWords * capacity;
  return {base,
          reinterpret_cast<float*>(base + capacity),
          base + 2 * capacity,
          reinterpret_cast<int*>(base + 3 * capacity),
          reinterpret_cast<int*>(base + 4 * capacity),
          reinterpret_cast<int*>(base + 5 * capacity),
          base + 6 * capacity,
          reinterpret_cast<float*>(base + 7 * capacity)};
}

// A redirect as two pool indices (< kMaxPoolSize): the entry moved to (high half) and the entry
// that moves (low half).
__device__ __forceinline__ uint32_t pack_move(int target, int moved) {
  return static_cast<uint32_t>(target) << 16 | static_cast<uint32_t>(moved);
}

size_t scratch_bytes(int capacity) {
  return static_cast<size_t>(kWarpsPerBlock) * kScratchWords * capacity * sizeof(uint32_t);
}

// The read pool of v into shared memory. Nothing writes buffer `buf` while it is read.
__device__ __forceinline__ int load_pool(const DevicePools& pools, int buf, int64_t v, const WarpScratch& s,
                                         int lane) {
  const int count = *pools.count_of(buf, v);
  const uint32_t* slot = pools.slots_of(buf, v);
  const float* dist = pools.dists_of(buf, v);
  for (int i = lane; i < count; i += kWarpSize) {
    s.slot[i] = slot[i];
    s.dist[i] = dist[i];
  }
  __syncwarp();
  return count;
}

__device__ __forceinline__ int64_t warp_vertex() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
}

// The start's entries among themselves through their Gram matrix. A merge starts each row from
// the entries of its own graph's row that the rule keeps among themselves (keep_uncovered): up
// to 32 entries walked one at a time, each compared with the ones kept before it. Computed a
// distance at a time by teams of lanes, that walk made a merge's start an instruction-bound
// kernel (ncu, 2M x 128 float16 halves, one H100: SM throughput 63%, L1 hit rate 60%), and
// copying the rows into shared memory first only lowered its occupancy (0.047 s against 0.034 s).
// The products of all the entries' pairs cost 8 mma a lane per 16 coordinates instead, and each
// step of the walk reads its distances from shared memory, a kept entry a lane. Same process,
// one H100: the start of a merge of clustered 10M x 128 float16 halves 111 ms against 176 ms
// (the merge 1.96 s against 2.03 s, recall@10 at list 64 0.9948 against 0.9950), of 1M x 384
// halves 25 ms against 41 ms (0.26 s against 0.28 s). The walk stays for float32 rows, rows not
// of whole 16-byte chunks and more than kGramEntries entries.
constexpr int kGramEntries = 32;  // entries the product covers: two 16-row tiles
// Words a row of the matrix takes in shared memory. One more than a row holds, so that the eight
// rows (g) whose values a fragment's lanes store at once start in different banks.
constexpr int kGramStride = kGramEntries + 1;

// Whether the start takes the Gram path: 16-bit rows of whole 16-byte chunks, at most
// kGramEntries init entries, a GPU with mma.
template <typename T>
bool start_takes_gram(int dim, int init_columns, int device) {
  constexpr bool kHalf = std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>;
  return kHalf && init_columns > 0 && init_columns <= kGramEntries && dim % 8 == 0 && has_tensor_core_mma(device);
}

size_t gram_bytes() { return static_cast<size_t>(kWarpsPerBlock) * kGramEntries * kGramStride * sizeof(float); }

// The warp's matrix, after the block's WarpScratch.
__device__ __forceinline__ float* warp_gram(int capacity) {
  extern __shared__ uint32_t scratch[];
  float* first = reinterpret_cast<float*>(scratch + static_cast<int64_t>(kWarpsPerBlock) * kScratchWords * capacity);
  return first + static_cast<int64_t>(threadIdx.x / kWarpSize) * kGramEntries * kGramStride;
}

// gram[i][j] = <x_a, x_b> for the rows a, b of entries i, j of s.slot[0, count) (count <=
// kGramEntries; rows past count are zeros), and s.dist[i] = d(v, a) for each entry, the build's
// distance (row_distance's, its terms summed in another order). Each lane reads, for the rows
// g + 8 i (g = lane / 4, i = 0..3), the words at coordinates 2t and 2t + 8 of every 16 (t = lane %
// 4): both fragments of a product of the rows with themselves (mma_cuda.cuh), so no lane reads a
// value twice; with v's words at the same coordinates it sums its share of each d(v, a).
// Computing d(v, a) from the same loads, rather than a team's distance at a time before the
// product, reads each entry's row once instead of twice: a merge of clustered 10M x 128 float16
// halves (one H100, same process, alternating) started in 107 ms against 129 ms and took 2.00 s
// against 2.02 s, recall@10 at list 64 0.9948 both.
template <typename T>
__device__ void entry_gram(const T* __restrict__ x, const BuildArgs& args, int64_t v, const WarpScratch& s, int count,
                           float* gram, int lane) {
  if constexpr (std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>) {
    using Pair = std::conditional_t<std::is_same_v<T, at::Half>, __half2, __nv_bfloat162>;
    const int dim = args.dim;
    const bool l2 = args.metric == Metric::kL2;
    const int g = lane / 4, t = lane % 4;
    const uint32_t* row[4];
    bool valid[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      valid[i] = g + 8 * i < count;
      row[i] = reinterpret_cast<const uint32_t*>(x + (valid[i] ? static_cast<int64_t>(s.slot[g + 8 * i]) * dim : 0));
    }
    const uint32_t* v_row = reinterpret_cast<const uint32_t*>(x + v * dim);
    float acc[2][4][4] = {};
    float to_v[4] = {};  // this lane's terms of d(v, a) for its four rows
    const auto add_terms = [&](float& sum, uint32_t a_word, uint32_t v_word) {
      const Pair a_pair = *reinterpret_cast<const Pair*>(&a_word);
      const Pair v_pair = *reinterpret_cast<const Pair*>(&v_word);
      if (l2) {  // as team_distance's HALF_DIFFERENCE
        const float2 d = pair_to_float2(__hsub2(v_pair, a_pair));
        sum += d.x * d.x;
        sum += d.y * d.y;
      } else {
        const float2 a2 = pair_to_float2(a_pair), v2 = pair_to_float2(v_pair);
        sum += -v2.x * a2.x;
        sum += -v2.y * a2.y;
      }
    };
#pragma unroll 2
    for (int k = 0; k < dim; k += 16) {
      const bool high = k + 8 < dim;  // dim is a multiple of 8; the last 8 may stand alone
      uint32_t low_word[4], high_word[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        low_word[i] = valid[i] ? __ldg(row[i] + k / 2 + t) : 0u;
        high_word[i] = valid[i] && high ? __ldg(row[i] + k / 2 + 4 + t) : 0u;
      }
      const uint32_t v_low = __ldg(v_row + k / 2 + t);
      const uint32_t v_high = high ? __ldg(v_row + k / 2 + 4 + t) : 0u;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        add_terms(to_v[i], low_word[i], v_low);
        add_terms(to_v[i], high_word[i], v_high);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const uint32_t a[4] = {low_word[2 * mt], low_word[2 * mt + 1], high_word[2 * mt], high_word[2 * mt + 1]};
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const uint32_t b[2] = {low_word[nt], high_word[nt]};
          mma_16x8x16<T>(acc[mt][nt], a, b);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        float* top = gram + (16 * mt + g) * kGramStride + 8 * nt + 2 * t;
        top[0] = acc[mt][nt][0];
        top[1] = acc[mt][nt][1];
        top[8 * kGramStride] = acc[mt][nt][2];
        top[8 * kGramStride + 1] = acc[mt][nt][3];
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float sum = team_sum<4>(to_v[i]);
      if (t == 0 && valid[i]) {
        float d = args.metric == Metric::kCosine ? 1.0f + sum : sum;
        if (args.lift != nullptr) {
          const float lifted = args.lift[v] - args.lift[s.slot[g + 8 * i]];
          d += lifted * lifted;
        }
        s.dist[g + 8 * i] = d;
      }
    }
    __syncwarp();
  }
}

// The build's distance between entries i and j from their Gram matrix: |a|^2 + |b|^2 - 2 <a, b>
// (plus the lift's term for inner product), or 1 - <a, b> for cosine's unit rows.
__device__ __forceinline__ float gram_distance(const float* gram, const BuildArgs& args, const WarpScratch& s,
                                               int i, int j) {
  const float dot = gram[i * kGramStride + j];
  if (args.metric == Metric::kCosine) return 1.0f - dot;
  float d = gram[i * kGramStride + i] + gram[j * kGramStride + j] - 2.0f * dot;
  if (args.lift != nullptr) {
    const float t = args.lift[s.slot[i]] - args.lift[s.slot[j]];
    d += t * t;
  }
  return d;
}

// The entries s.slot[0, count) (distances to v in s.dist) that the rule keeps among themselves,
// as the CPU's initialise finds them: walked nearest first, an entry goes when a kept one is
// closer to it than v is. Compacts s.slot and s.dist in place, in their order; returns how many
// stay. With `gram` (entry_gram of the entries, count <= kGramEntries) each lane tests one kept
// entry; else each team computes one distance of a batch, and the batch decides for the warp.
template <typename T, int TEAM>
__device__ int keep_uncovered(const T* __restrict__ x, const BuildArgs& args, const WarpScratch& s, int count,
                              const float* gram, int lane) {
  constexpr int kTeams = kWarpSize / TEAM;
  const int team = lane / TEAM, rank = lane % TEAM;
  warp_rank_sort(count, count, s.order, lane,
                 [&](int j, int i) { return s.dist[j] < s.dist[i] || (s.dist[j] == s.dist[i] && j < i); });
  int kept_count = 0;
  for (int step = 0; step < count; ++step) {
    const int j = s.order[step];
    const int64_t a = s.slot[j];
    const float d_va = s.dist[j];
    bool covered = false;
    if (gram != nullptr) {
      const bool valid = lane < kept_count;
      covered = __any_sync(kFullMask, valid && gram_distance(gram, args, s, j, s.kept[lane]) < d_va);
    }
    for (int g0 = 0; gram == nullptr && g0 < kept_count && !covered; g0 += kTeams) {
      const int g = g0 + team;
      const bool valid = g < kept_count;
      const int64_t b = valid ? s.slot[s.kept[g]] : a;
      const float d_ab = row_distance<TEAM>(x, args, a, b, valid, rank);
      covered = __any_sync(kFullMask, valid && d_ab < d_va);
    }
    if (!covered) {
      if (lane == 0) s.kept[kept_count] = j;
      ++kept_count;
      __syncwarp();
    }
  }
  for (int i = lane; i < count; i += kWarpSize) s.cmp[i] = 0;
  __syncwarp();
  for (int k = lane; k < kept_count; k += kWarpSize) s.cmp[s.kept[k]] = 1;
  __syncwarp();
  int stay = 0;
  for (int base = 0; base < count; base += kWarpSize) {
    const int j = base + lane;
    const bool keep = j < count && s.cmp[j] != 0;
    const uint32_t slot = keep ? s.slot[j] : 0u;
    const float dist = keep ? s.dist[j] : 0.0f;
    const unsigned mask = __ballot_sync(kFullMask, keep);
    __syncwarp();  // every lane has read its entry before any writes: a write lands at or below its reader
    if (keep) {
      const int at = stay + __popc(mask & lanes_below(lane));
      s.slot[at] = slot;
      s.dist[at] = dist;
    }
    stay += __popc(mask);
  }
  __syncwarp();
  return stay;
}

// Line 4 of Algorithm 3: S distinct neighbours (fewer for a growing graph's rows, Split), the
// CPU's draws (initial_neighbour; self and repeats are dropped in draw order), after the entries
// of `init` where given that the rule keeps among themselves, as old ones (build_schedule.h,
// start_entries): the pool matches the CPU's slot for slot.
template <typename T, int TEAM>
__global__ void __launch_bounds__(kBlockThreads)
    initialise_kernel(const T* __restrict__ x, DevicePools pools, BuildArgs args, int initial_degree,
                      const int32_t* __restrict__ init, int init_columns, bool gram_start) {
  constexpr int kTeams = kWarpSize / TEAM;
  const int64_t v = warp_vertex();
  if (v >= pools.n) return;
  const int lane = threadIdx.x % kWarpSize, team = lane / TEAM, rank = lane % TEAM;
  const WarpScratch s = warp_scratch(pools.capacity);
  const int draws = args.split.draws(v, initial_degree);
  for (int t = lane; t < draws; t += kWarpSize) {
    const uint32_t r = random_u32(args.seed, Stream::kInitialNeighbours, static_cast<uint32_t>(v), 0, t);
    s.key[t] = static_cast<uint32_t>(
        initial_neighbour(args.cells, v, t, initial_degree, r, args.n, args.split.draws_from(v)));
  }
  // A candidate joins unless it is v, outside the data, or already in the pool; entries are
  // taken in order, 32 at a time, each behind the ones of lower lanes.
  int count = 0;
  const auto append = [&](uint32_t u, bool candidate) {
    bool fresh = candidate && u != static_cast<uint32_t>(v) && u < static_cast<uint64_t>(args.n);
    for (int j = 0; j < count && fresh; ++j) fresh = s.slot[j] != u;
    const unsigned same = __match_any_sync(kFullMask, fresh ? u : 0xffffffffu);
    fresh = fresh && (same & lanes_below(lane)) == 0;
    const unsigned mask = __ballot_sync(kFullMask, fresh);
    if (fresh) s.slot[count + __popc(mask & lanes_below(lane))] = u;
    count += __popc(mask);
    __syncwarp();
  };
  // d(v, u) of entries first to last of s.slot into s.dist (the teams' distances).
  const auto distances = [&](int first, int last) {
    for (int g0 = first; g0 < last; g0 += kTeams) {
      const int g = g0 + team;
      const bool valid = g < last;
      const float d = row_distance<TEAM>(x, args, v, valid ? s.slot[g] : v, valid, rank);
      if (valid && rank == 0) s.dist[g] = d;
    }
    __syncwarp();
  };
  const int columns = args.split.new_row(v) ? 0 : init_columns;
  for (int base = 0; base < columns; base += kWarpSize) {
    const int c = base + lane;
    const int32_t u = c < columns ? init[v * init_columns + c] : -1;
    append(static_cast<uint32_t>(u), u >= 0);
  }
  if (count > 0) {
    float* gram = gram_start ? warp_gram(pools.capacity) : nullptr;
    if (gram != nullptr) {
      entry_gram(x, args, v, s, count, gram, lane);  // the distances to v too
    } else {
      distances(0, count);
    }
    count = keep_uncovered<T, TEAM>(x, args, s, count, gram, lane);
  }
  const int old_count = count;
  for (int base = 0; base < draws; base += kWarpSize) {
    const int t = base + lane;
    append(t < draws ? s.key[t] : 0u, t < draws);
  }
  distances(old_count, count);
  uint32_t* slot = pools.slots_of(0, v);
  float* dist = pools.dists_of(0, v);
  for (int g = lane; g < count; g += kWarpSize) {
    slot[g] = pack_slot(static_cast<int32_t>(s.slot[g]), g >= old_count);
    dist[g] = s.dist[g];
  }
  if (lane == 0) *pools.count_of(0, v) = count;
}

// Component 1 (section 3.3 and the Figure 7 ablation): the order in which v walks its pool.
// Same keys and tie-breaks as visit_order on the CPU.
__device__ __forceinline__ void visit_order(const WarpScratch& s, int count, int64_t v, uint32_t round,
                                            const BuildArgs& args, int lane) {
  if (count <= kRegisterSortMax) {  // the same orders as 64-bit keys: (sort key, pool index)
    warp_register_sort(count, s.order, lane, [&](int i) {
      uint32_t high;
      switch (args.update_order) {
        case UpdateOrder::kAscending:
          high = ordered_bits(s.dist[i]);
          break;
        case UpdateOrder::kDescending:
          high = ~ordered_bits(s.dist[i]);
          break;
        default:
          high = random_u32(args.seed, Stream::kVisitOrder, static_cast<uint32_t>(v), round, i);
      }
      return static_cast<uint64_t>(high) << 32 | static_cast<uint32_t>(i);
    });
    return;
  }
  switch (args.update_order) {
    case UpdateOrder::kRandom:
    case UpdateOrder::kDescendingThenRandom:  // resolved per outer iteration (order_for_iteration)
      for (int i = lane; i < count; i += kWarpSize) {
        s.key[i] = random_u32(args.seed, Stream::kVisitOrder, static_cast<uint32_t>(v), round, i);
      }
      __syncwarp();
      warp_rank_sort(count, count, s.order, lane,
                     [&](int j, int i) { return s.key[j] < s.key[i] || (s.key[j] == s.key[i] && j < i); });
      break;
    case UpdateOrder::kAscending:
      warp_rank_sort(count, count, s.order, lane,
                     [&](int j, int i) { return s.dist[j] < s.dist[i] || (s.dist[j] == s.dist[i] && j < i); });
      break;
    case UpdateOrder::kDescending:
      warp_rank_sort(count, count, s.order, lane,
                     [&](int j, int i) { return s.dist[j] > s.dist[i] || (s.dist[j] == s.dist[i] && j < i); });
      break;
  }
}

// Algorithm 4 for one vertex per warp, with update_vertex's exact outcome: walk the pool in
// visit order; test each entry a against the entries kept so far with the RNG rule (eq. 2).
// When a and a kept b are closer to each other than the farther of them is to v, the farther
// one goes (as new) to the closer one's next pool and leaves v's. Survivors go to v's next pool
// as old entries.
//
// The CPU compares a with the kept entries one at a time and stops at the first one that takes
// a. Here the warp's teams compute kTeams of those distances at once and each team applies the
// rule to its own, the batch resolved in kept order by two ballots; the next batch is only
// computed if a is still kept, so at most kTeams - 1 distances are spent past the CPU's stop.
// CODES: the pairs' distances come from args.codes (pair_code_distance), a kernel of its own so
// that the rows' kernel stays as it was: with a run-time choice between the two in the pair loop
// the default builds of 1 024-d float16 rows ran 5-21% slower (H200).
template <typename T, int TEAM, bool CODES>
__global__ void __launch_bounds__(kBlockThreads, kUpdateWarpsPerSm / kWarpsPerBlock)
    update_kernel(const T* __restrict__ x, DevicePools pools, BuildArgs args, int read, uint32_t round) {
  constexpr int kTeams = kWarpSize / TEAM;
  const int64_t v = warp_vertex();
  if (v >= pools.n) return;
  const int lane = threadIdx.x % kWarpSize, team = lane / TEAM, rank = lane % TEAM;
  const int write = read ^ 1;
  const WarpScratch s = warp_scratch(pools.capacity);
  const int count = load_pool(pools, read, v, s, lane);
  visit_order(s, count, v, round, args, lane);

  // Until the walk meets its first new entry, every entry is old and so is every kept one: no
  // pair is compared and each is kept. That prefix is taken at once, and a settled pool (no
  // new entry) skips the walk.
  int first_new = count;
  for (int base = 0; base < count; base += kWarpSize) {
    const int step = base + lane;
    const unsigned mask = __ballot_sync(kFullMask, step < count && slot_is_new(s.slot[s.order[step]]));
    if (mask != 0) {
      first_new = base + __ffs(mask) - 1;
      break;
    }
  }
  for (int k = lane; k < first_new; k += kWarpSize) s.kept[k] = s.order[k];
  __syncwarp();
  int kept_count = first_new, moves = 0;
  for (int step = first_new; step < count; ++step) {
    const int i = s.order[step];
    const int32_t a = slot_id(s.slot[i]);
    const bool a_new = slot_is_new(s.slot[i]);
    const float d_va = s.dist[i];
    // Kept entries a must be tested against (compares_pair): all of them if a is new, else the
    // new ones; in a merge, only pairs across its two graphs.
    int compared = 0;
    for (int base = 0; base < kept_count; base += kWarpSize) {
      const int j = base + lane;
      const uint32_t b_slot = j < kept_count ? s.slot[s.kept[j]] : 0u;
      const bool need = j < kept_count && compares_pair(a, a_new, slot_id(b_slot), slot_is_new(b_slot), args.split);
      const unsigned mask = __ballot_sync(kFullMask, need);
      if (need) s.cmp[compared + __popc(mask & lanes_below(lane))] = j;
      compared += __popc(mask);
    }
    __syncwarp();

    // Each team tests its pair with the rule, and the batch's outcome is that of testing the
    // pairs in team order: the pairs that hold up to the first one that moves a each move their
    // farther entry, and the rest are not reached. Deciding them a team each, rather than the
    // whole warp repeating one pair's test after another, gives the same moves in the same order.
    bool keep = true, erased = false;
    for (int g0 = 0; g0 < compared && keep; g0 += kTeams) {
      const int g = g0 + team;
      const bool valid = g < compared;
      const int j = valid ? s.cmp[g] : 0;
      const int b_index = valid ? s.kept[j] : 0;
      const int64_t b = valid ? slot_id(s.slot[b_index]) : a;
      float d_ab;  // on every lane of the team
      if constexpr (CODES) {
        d_ab = pair_code_distance<TEAM>(args, a, b, valid, rank);
      } else {
        d_ab = row_distance<TEAM>(x, args, a, b, valid, rank);
      }
      const float d_vb = s.dist[b_index];
      // The farther one moves to the closer one: a to b, or b to a (b then leaves `kept`).
      const bool holds = valid && d_ab < fmaxf(d_va, d_vb);
      const bool a_moves = d_va >= d_vb;
      const bool leader = rank == 0;
      const unsigned held = __ballot_sync(kFullMask, leader && holds);
      const unsigned stops = __ballot_sync(kFullMask, leader && holds && a_moves);
      const unsigned first_stop = stops & (0u - stops);
      const unsigned reached = first_stop != 0 ? held & (first_stop | (first_stop - 1u)) : held;
      if (reached == 0) continue;
      __syncwarp();  // every lane has read s.kept[j] before a leader erases it
      if (leader && (reached >> lane & 1u) != 0) {
        const int at = moves + __popc(reached & lanes_below(lane));
        s.move[at] = a_moves ? pack_move(b_index, i) : pack_move(i, b_index);
        s.move_dist[at] = d_ab;
        if (!a_moves) s.kept[j] = -1;
      }
      moves += __popc(reached);
      erased = erased || (reached & ~first_stop) != 0;
      keep = first_stop == 0;
    }
    __syncwarp();
    if (erased) kept_count = warp_compact_nonnegative(s.kept, kept_count, lane);
    if (keep) {
      if (lane == 0) s.kept[kept_count] = i;
      ++kept_count;
    }
    __syncwarp();
  }

  // The redirects, as new entries, into the next pools of their targets. The CPU inserts each as
  // it is decided; the walk above reads only buffer `read`, so deciding them all first changes
  // nothing but when other warps see them (one of the interleavings concurrent inserts allow
  // anyway). It keeps the lock and insert code out of the pair loop, whose spills under the
  // register bound fell from 158 to 62 bytes of loads: in one run on the H200 (1M x 384 float16
  // real embeddings) the default build took 0.417 s against 0.483 s with the inserts inside the
  // loop, the descending one 0.563 s against 0.663 s.
  int changes = 0;
  for (int m = 0; m < moves; ++m) {
    const uint32_t packed = s.move[m];
    changes += pools.insert(write, slot_id(s.slot[packed >> 16]), slot_id(s.slot[packed & 0xffffu]),
                            s.move_dist[m], true, lane);
  }
  if (lane == 0) args.changes[v] = changes;

  // Survivors into v's own next pool as old entries: one lock for all of them (other warps'
  // inserts land before or after the batch, which is one of the CPU's possible interleavings).
  // The sort keys are spent, so their words hold the pool's ids for the membership tests.
  pools.insert_distinct(write, v, kept_count, s.key, lane, [&](int k, uint32_t& slot, float& dist) {
    const int i = s.kept[k];
    slot = pack_slot(slot_id(s.slot[i]), false);
    dist = s.dist[i];
  });
}

// Component 4 (section 3.6): v offers itself as a new neighbour to its ceil(rho * |N_v|)
// closest neighbours. Reads buffer `read`; buffer `read ^ 1` already holds a copy of it.
__global__ void __launch_bounds__(kBlockThreads) reverse_kernel(DevicePools pools, int read, double ratio) {
  const int64_t v = warp_vertex();
  if (v >= pools.n) return;
  const int lane = threadIdx.x % kWarpSize;
  const WarpScratch s = warp_scratch(pools.capacity);
  const int count = load_pool(pools, read, v, s, lane);
  const int sampled = static_cast<int>(ceil(ratio * count));
  if (sampled == 0) return;
  warp_rank_sort(count, sampled, s.order, lane,
                 [&](int j, int i) { return s.dist[j] < s.dist[i] || (s.dist[j] == s.dist[i] && j < i); });
  for (int r = 0; r < sampled; ++r) {
    const int i = s.order[r];
    pools.insert(read ^ 1, slot_id(s.slot[i]), static_cast<int32_t>(v), s.dist[i], true, lane);
  }
}

// Each row: the pool sorted by (distance, id), cut to `degree`, -1 padded.
__global__ void __launch_bounds__(kBlockThreads)
    finalise_kernel(DevicePools pools, int read, int degree, int32_t* __restrict__ graph) {
  const int64_t v = warp_vertex();
  if (v >= pools.n) return;
  const int lane = threadIdx.x % kWarpSize;
  const WarpScratch s = warp_scratch(pools.capacity);
  const int count = load_pool(pools, read, v, s, lane);
  const int kept = min(count, degree);
  warp_rank_sort(count, kept, s.order, lane, [&](int j, int i) {
    return s.dist[j] < s.dist[i] || (s.dist[j] == s.dist[i] && slot_id(s.slot[j]) < slot_id(s.slot[i]));
  });
  int32_t* row = graph + v * degree;
  for (int r = lane; r < degree; r += kWarpSize) row[r] = r < kept ? slot_id(s.slot[s.order[r]]) : -1;
}

// "12.3 MiB" / "4.5 GiB" for error messages.
std::string human_bytes(int64_t bytes) {
  const bool gib = bytes >= (int64_t{1} << 30);
  char text[64];
  std::snprintf(text, sizeof(text), "%.1f %s", static_cast<double>(bytes) / (gib ? 1 << 30 : 1 << 20),
                gib ? "GiB" : "MiB");
  return text;
}

// Free memory on the current device: the driver's free plus what the caching allocator holds
// reserved but unused (it hands that out before asking the driver).
int64_t free_device_bytes(c10::DeviceIndex device) {
  size_t free_bytes = 0, total_bytes = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  int64_t cached = 0;
  try {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
    const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    cached = stats.reserved_bytes[aggregate].current - stats.allocated_bytes[aggregate].current;
  } catch (const c10::Error&) {
    cached = 0;  // an allocator backend without stats: the driver's number alone
  }
  return static_cast<int64_t>(free_bytes) + std::max<int64_t>(cached, 0);
}

// The pools' buffers as tensors: slots (int32 holding the uint32 slots) and distances of buffers
// 0 and 1, [N, capacity] each; a widening build replaces them (widen_pools).
struct PoolBuffers {
  at::Tensor slots[2];
  at::Tensor dists[2];
};

// Pools of `capacity` entries a row holding what buffer `read` holds, in buffer 0 (buffer 1 is
// written by the next round); `read` becomes 0. The spare buffer goes first and each old
// allocation as soon as it is copied, so the build never holds more than its wider pools:
// 2 x N x capacity x 8 bytes, what a build of that pool size from the start holds. Returns false,
// changing nothing, where the GPU has not the memory they add: the build goes on at its width.
bool widen_pools(PoolBuffers& buffers, DevicePools& pools, int& read, int capacity, cudaStream_t stream) {
  const int64_t n = pools.n;
  const int64_t added = 2 * n * (capacity - pools.capacity) * static_cast<int64_t>(sizeof(uint32_t) + sizeof(float));
  if (added > free_device_bytes(buffers.slots[0].device().index())) return false;
  auto wider = [&](at::Tensor& old) {
    at::Tensor wide = at::zeros({n, capacity}, old.options());
    wide.narrow(1, 0, pools.capacity).copy_(old);
    old = at::Tensor();
    return wide;
  };
  try {
    const int spare = read ^ 1;
    buffers.slots[spare] = buffers.dists[spare] = at::Tensor();
    at::Tensor slots = wider(buffers.slots[read]);
    at::Tensor dists = wider(buffers.dists[read]);
    buffers.slots[0] = slots;
    buffers.dists[0] = dists;
    buffers.slots[1] = at::zeros({n, capacity}, slots.options());
    buffers.dists[1] = at::zeros({n, capacity}, dists.options());
  } catch (const c10::OutOfMemoryError& e) {
    // The driver had room but the allocator refused, after the old buffers went: nothing to go on with.
    TORCH_CHECK_WITH(OutOfMemoryError, false, "build: widening its pools to ", capacity, " entries a row needs ",
                     human_bytes(2 * n * capacity * 8), " of GPU memory on ", buffers.slots[0].device(),
                     ", which the allocator could not provide; build with widen=False. The allocator: ",
                     e.what_without_backtrace());
  }
  if (read != 0) {
    C10_CUDA_CHECK(cudaMemcpyAsync(pools.counts, pools.counts + n, n * sizeof(int), cudaMemcpyDeviceToDevice,
                                   stream));
  }
  for (int b = 0; b < 2; ++b) {
    pools.slots[b] = reinterpret_cast<uint32_t*>(buffers.slots[b].data_ptr<int>());
    pools.dists[b] = buffers.dists[b].data_ptr<float>();
  }
  pools.capacity = capacity;
  read = 0;
  return true;
}

// The build's measures (build_schedule.h) of this build's data under its metric: a graph's unfound
// share (unfound_share) and the rows' neighbourhood_dimensions.
struct Measures {
  std::function<double(const at::Tensor& graph)> unfound_of;
  std::function<double()> neighbourhood_dimensions;
};

// Runs the build; returns its rows, [N, min(degree, R)] int32 ids: a view into the spare buffer
// of `buffers.slots` (see finalise). A widening build (build_schedule.h, kWidenShare) replaces
// `buffers` and widens `p`.
template <typename T, int TEAM>
at::Tensor run_build(const T* x, DevicePools pools, const BuildArgs& args, BuildParams& p, const at::Tensor& changes,
                     const at::Tensor& init, PoolBuffers& buffers, const Measures& measures,
                     cudaStream_t stream) {
  const int64_t n = pools.n;
  const unsigned blocks = static_cast<unsigned>(ceil_div(n, kWarpsPerBlock));
  size_t shared = scratch_bytes(pools.capacity);
  size_t buffer_slots = static_cast<size_t>(n) * pools.capacity;
  // The pair codes' teams: half the rows' lanes, which is team_for_row of the codes' bytes for
  // float16 and bfloat16 rows (a code row is half theirs), so a lane loads as many 16-byte chunks
  // as on the rows and a warp computes twice the pairs at once. One H200, pair-code builds,
  // alternating with teams as large as the rows': blobs 1M x 1024 0.55-0.58 s against 0.65-0.66
  // s, zipf 1M x 384 0.329 s against 0.356 s, zipf_aniso 10M x 1024 6.54 s against 7.82 s, the
  // same recall (the sums are exact integers whatever the team).
  constexpr int kCodeTeam = TEAM > 4 ? TEAM / 2 : 4;

  const int init_columns = init.defined() ? static_cast<int>(init.size(1)) : 0;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const bool gram_start = start_takes_gram<T>(args.dim, init_columns, device);
  initialise_kernel<T, TEAM><<<blocks, kBlockThreads, shared + (gram_start ? gram_bytes() : 0), stream>>>(
      x, pools, args, p.initial_degree, init.defined() ? init.data_ptr<int32_t>() : nullptr, init_columns,
      gram_start);
  check_launch();
  int read = 0;
  auto update = [&](UpdateOrder order, uint32_t round, bool count) -> int64_t {
    BuildArgs iteration = args;
    iteration.update_order = order;
    C10_CUDA_CHECK(cudaMemsetAsync(pools.counts + (read ^ 1) * n, 0, n * sizeof(int), stream));
    if (args.codes != nullptr) {
      update_kernel<T, kCodeTeam, true><<<blocks, kBlockThreads, shared, stream>>>(x, pools, iteration, read,
                                                                                   round);
    } else {
      update_kernel<T, TEAM, false><<<blocks, kBlockThreads, shared, stream>>>(x, pools, iteration, read, round);
    }
    check_launch();
    read ^= 1;
    // The one host synchronisation of a round, only when convergence or progress needs it.
    return count ? changes.sum(at::kLong).item<int64_t>() : 0;
  };
  auto reverse = [&] {
    const int write = read ^ 1;
    C10_CUDA_CHECK(cudaMemcpyAsync(pools.slot_buffer(write), pools.slot_buffer(read), buffer_slots * sizeof(uint32_t),
                                   cudaMemcpyDeviceToDevice, stream));
    C10_CUDA_CHECK(cudaMemcpyAsync(pools.dist_buffer(write), pools.dist_buffer(read), buffer_slots * sizeof(float),
                                   cudaMemcpyDeviceToDevice, stream));
    C10_CUDA_CHECK(cudaMemcpyAsync(pools.counts + write * n, pools.counts + read * n, n * sizeof(int),
                                   cudaMemcpyDeviceToDevice, stream));
    reverse_kernel<<<blocks, kBlockThreads, shared, stream>>>(pools, read, p.reverse_ratio);
    check_launch();
    read ^= 1;
  };
  // The rows go into the spare buffer's slots, [N, R] int32 holding [N, min(degree, R)], so
  // the graph needs no memory of its own while the pools are alive. Between outer iterations
  // the next round overwrites them.
  auto finalise = [&] {
    const int pooled = std::min(p.degree, p.pool_size);
    finalise_kernel<<<blocks, kBlockThreads, shared, stream>>>(
        pools, read, pooled, reinterpret_cast<int32_t*>(pools.slot_buffer(read ^ 1)));
    check_launch();
    return buffers.slots[read ^ 1].view(-1).narrow(0, 0, n * pooled).view({n, pooled});
  };
  auto unfound = [&] { return measures.unfound_of(finalise()); };
  auto widen = [&](int wide_pool_size) {
    if (!widen_pools(buffers, pools, read, wide_pool_size, stream)) return false;
    shared = scratch_bytes(pools.capacity);
    buffer_slots = static_cast<size_t>(n) * pools.capacity;
    return true;
  };
  run_schedule(p, counted_rows(args.split, n), init.defined(), update, reverse, unfound,
               measures.neighbourhood_dimensions, widen);
  return finalise();
}

template <typename T>
at::Tensor dispatch_team(const at::Tensor& x, const DevicePools& pools, const BuildArgs& args, BuildParams& p,
                         const at::Tensor& changes, const at::Tensor& init, PoolBuffers& buffers,
                         const Measures& measures, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, double>) {
    TORCH_CHECK(false, "build: float64 storage reached the CUDA kernel (prepare_vectors narrows it)");
    return at::Tensor();
  } else {
    const T* base = x.data_ptr<T>();
    switch (team_for_row(x.size(1) * x.element_size())) {
      case 4:
        return run_build<T, 4>(base, pools, args, p, changes, init, buffers, measures, stream);
      case 8:
        return run_build<T, 8>(base, pools, args, p, changes, init, buffers, measures, stream);
      case 16:
        return run_build<T, 16>(base, pools, args, p, changes, init, buffers, measures, stream);
      default:
        return run_build<T, 32>(base, pools, args, p, changes, init, buffers, measures, stream);
    }
  }
}

at::Tensor build_cuda(const at::Tensor& data, int64_t degree, int64_t initial_degree, int64_t pool_size,
                      int64_t outer_iters, int64_t inner_iters, double reverse_ratio, c10::string_view update_order,
                      c10::string_view metric, int64_t seed, double delta, c10::string_view start,
                      const c10::optional<at::Tensor>& init, int64_t init_split, c10::string_view init_mode,
                      const c10::optional<at::Tensor>& pair_code_rows, double pair_code_scale, bool widen) {
  check_build_inputs(data);
  const c10::cuda::CUDAGuard guard(data.device());
  BuildParams p = make_build_params(degree, initial_degree, pool_size, outer_iters, inner_iters, reverse_ratio,
                                    std::string(update_order), std::string(metric), seed, delta, std::string(start),
                                    widen);
  const at::Tensor codes = check_pair_codes(pair_code_rows, pair_code_scale, data, p.metric);
  const int64_t n = data.size(0);
  const at::Tensor init_entries = start_entries(init, data, p);
  const at::Tensor x = prepare_vectors(data, p.metric);
  // Inner product is built on lifted l2 exactly as on the CPU (params.h, lifts_inner_product).
  const at::Tensor lift = inner_product_lift(x, p.metric);
  // Everything the rounds use, allocated once before the first kernel (section 3.5: no
  // allocation in the loop): 2 x [N, R] slots and distances, 2 x [N] counts, [N] locks, [N]
  // change counts; and the start's cells (12 bytes a row). The pools' rows are written into
  // the spare slots and copied into the [N, degree] graph once the distances are freed, so it
  // adds nothing to the peak. Checked before the cells are made: finding them costs time in proportion to N x hubs.
  const int64_t capacity = p.pool_size;
  const int64_t needed = 2 * n * capacity * static_cast<int64_t>(sizeof(uint32_t) + sizeof(float)) +
                         4 * n * static_cast<int64_t>(sizeof(int)) +
                         (p.start == Start::kHubs ? 3 * n * static_cast<int64_t>(sizeof(int32_t)) : 0);
  const int64_t available = free_device_bytes(data.device().index());
  TORCH_CHECK_WITH(OutOfMemoryError, needed <= available, "build: needs ", human_bytes(needed), " of GPU memory on ",
                   data.device(), " for its pools (2 x N x pool_size x 8 bytes with N = ", n, ", pool_size = ",
                   capacity, "), but only ", human_bytes(available),
                   " are free; lower pool_size or build on fewer rows at a time");
  // The cells' scratch (a chunk of scores) is freed before the pools are allocated.
  const Cells cells = p.start == Start::kHubs ? partition_cells(x, lift) : Cells{};
  const at::TensorOptions on_device = at::TensorOptions().device(data.device());
  PoolBuffers buffers;
  at::Tensor counts, locks, changes;
  try {
    // Zeroed, not empty: a reverse step copies whole buffers, the unused tail of every row too,
    // and a copy of never-written memory is what initcheck reports (a memset of a few ms at 10M).
    for (int b = 0; b < 2; ++b) {
      buffers.slots[b] = at::zeros({n, capacity}, on_device.dtype(at::kInt));
      buffers.dists[b] = at::zeros({n, capacity}, on_device.dtype(at::kFloat));
    }
    counts = at::empty({2, n}, on_device.dtype(at::kInt));
    locks = at::zeros({n}, on_device.dtype(at::kInt));
    changes = at::zeros({n}, on_device.dtype(at::kInt));
  } catch (const c10::OutOfMemoryError& e) {
    // The driver had room but the allocator refused (a per-process memory fraction, say): its
    // own message says how much it could still give.
    TORCH_CHECK_WITH(OutOfMemoryError, false, "build: needs ", human_bytes(needed), " of GPU memory on ", data.device(),
                     " for its pools (N = ", n, ", pool_size = ", capacity,
                     "), which the allocator could not provide; lower pool_size or build on fewer rows at a time. ",
                     "The allocator: ", e.what_without_backtrace());
  }

  const DevicePools pools{{reinterpret_cast<uint32_t*>(buffers.slots[0].data_ptr<int>()),
                           reinterpret_cast<uint32_t*>(buffers.slots[1].data_ptr<int>())},
                          {buffers.dists[0].data_ptr<float>(), buffers.dists[1].data_ptr<float>()},
                          counts.data_ptr<int>(),
                          locks.data_ptr<int>(),
                          n,
                          p.pool_size};
  const BuildArgs args{n,
                       static_cast<int>(x.size(1)),
                       lift.defined() ? Metric::kL2 : p.metric,
                       lift.defined() ? lift.data_ptr<float>() : nullptr,
                       p.update_order,
                       p.seed,
                       cell_view(cells),
                       start_split(init_split, init_mode, n, p),
                       changes.data_ptr<int>(),
                       codes.defined() ? codes.data_ptr<uint8_t>() : nullptr,
                       codes.defined() ? codes.size(1) : 0,
                       static_cast<float>(pair_code_scale)};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(data.device().index());
  const Measures measures{[&](const at::Tensor& graph) { return unfound_share(data, graph, metric); },
                          [&] { return neighbourhood_dimensions(data, metric); }};
  at::Tensor pooled_rows;  // a view into buffers.slots
  GRNND_DISPATCH_STORAGE(x.scalar_type(), "grnnd_build_cuda", [&] {
    pooled_rows = dispatch_team<scalar_t>(x, pools, args, p, changes, init_entries, buffers, measures, stream);
  });
  // The distances go first, so the graph's copy takes their place rather than new memory.
  buffers.dists[0] = buffers.dists[1] = counts = locks = changes = at::Tensor();
  // A degree above the pool gets its further places from the fill; their memory takes the place
  // of the freed distances, below the peak of the rounds. p.degree is the wide one where the
  // build widened.
  at::Tensor graph = at::full({n, p.degree}, -1, pooled_rows.options());
  graph.narrow(1, 0, pooled_rows.size(1)).copy_(pooled_rows);
  pooled_rows = at::Tensor();
  buffers.slots[0] = buffers.slots[1] = at::Tensor();
  graph = fill_rows_cuda(std::move(graph), x, lift, p.metric);
  connect_unreachable(graph, data, metric, x, lift);
  return graph;
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CUDA, m) {
  m.impl("build", &build_cuda);
  m.impl("connect", [](const at::Tensor& data, const at::Tensor& graph, c10::string_view metric) {
    const c10::cuda::CUDAGuard guard(data.device());
    return connected_copy(data, graph, metric, prepare_vectors(data, parse_metric(std::string(metric))));
  });
  m.impl("fill", [](const at::Tensor& data, const at::Tensor& graph, c10::string_view metric) {
    check_fill_inputs(data, graph);
    const c10::cuda::CUDAGuard guard(data.device());
    const Metric m = parse_metric(std::string(metric));
    const at::Tensor x = prepare_vectors(data, m);
    return fill_rows_cuda(graph, x, inner_product_lift(x, m), m);
  });
}

}  // namespace cuda
}  // namespace grnnd
