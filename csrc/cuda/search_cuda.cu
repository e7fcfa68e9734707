// Batched graph search on the GPU: the twin of csrc/cpu/search_cpu.cpp.
//
// CAGRA's single-CTA search, the design the GPU study (seed 002) found fastest: one thread block
// per query; the best `list_size` nodes seen kept sorted in shared memory (M slots, M = list_size
// rounded up to a power of two); each iteration the `search_width` best not yet expanded nodes
// are expanded, their unvisited neighbours' distances computed by teams of lanes, the new
// candidates sorted and merged into the list with a bitonic network (seed 002, OB 8: sort the
// batch and merge rather than insert one by one); an O(1) open-addressing visited hash in shared
// memory (OB 8: CAGRA's hash, not GGNN's linear scan). Stops when no unexpanded node is left in
// the list or after `max_iters` iterations. Entry points are drawn exactly as the CPU draws them,
// so both walk the same graph from the same start.
//
// Why results never hold a duplicate id although the hash "forgets": the hash is cleared only
// between iterations and then refilled with every id in the list (and in the filtered result
// list), and it is never more than half full, so an insertion always finds the key or a free
// slot. A node in either list is therefore always known; a forgotten node is one that was cut
// from the list earlier, and as the list's worst key only improves it can never re-enter: it
// costs one recomputed distance, nothing else.
//
// Small batches (seed 002, OB 10: a batch of 1-100 queries leaves most SMs idle with one block per
// query): a query is split into several independent searches, one block each, every one with
// its own entry points and a shorter list (params.h, list_per_search); a second kernel merges
// their results. Unlike CAGRA's multi-CTA mode the blocks share no visited set, so they repeat
// some distances, but a query's result depends only on its inputs, never on timing.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <torch/library.h>

#include "../core/checks.h"
#include "../core/codes.h"
#include "../build/hubs.h"
#include "../core/philox.h"
#include "detail/sort_cuda.cuh"
#include "detail/vectors_cuda.cuh"

namespace grnnd {
namespace cuda {
namespace {

constexpr uint32_t kExpanded = 0x80000000u;  // flag on list ids (above kIdMask): neighbours were visited
constexpr uint32_t kHashFree = 0xffffffffu;
constexpr int kMaxSearchWidth = 32;          // = params.h bound; parents live in one warp's ballot
constexpr int kMaxThreads = 512;
constexpr int kMaxWarpRows = 8;              // warp_iterations holds lists of up to 8 * 32 keys
constexpr int kMaxWarpCandRows = 8;          // and rounds of up to 8 * 32 candidates (width 4, degree 64)
static_assert(kMaxWarpCandRows * 32 == kGpuWidestWarpRound, "the automatic width (params.h) sizes rounds for this loop");
constexpr int kAnyBatchCandRows = 2;         // rounds up to 2 * 32 take it at any batch, wider ones when blocks share SMs
// Chunks of a row in flight per lane in warp_iterations' distances (team_visit). The general loop
// loads code rows the same way; full rows one chunk at a time, as with four the general kernel
// at batch 10 000 ran 67% slower on rows at list 512 and 39% slower with a filter, where the
// coded searches gained 7-15% (registers, presumably; H200, 1M x 384 float16, before the block loop
// sorted only entering candidates; a one-off run, script not kept).
constexpr int kWarpLoopChunksInFlight = 4;
// searches_for_batch: the largest batch it splits (one query per kSplitSmsPerQuery SMs), the
// blocks per SM a split aims at, the fewest searches its cap allows, and the searches at list k.
// Below kLatencyBoundBlocksPerSm blocks per SM a search's time is its chain of iterations, not
// the SM's throughput: such a launch gets more threads a block (pick_threads) and wide rounds
// take the block loop (run_search).
constexpr int kLatencyBoundBlocksPerSm = 4;
constexpr int kSplitSmsPerQuery = 4;
constexpr int kSplitBlocksPerSm = 8;
constexpr int kMinSplit = 8;
constexpr int kSplitSearchesAtK = 4;
// Visited set: open addressing with linear probing over 2^bits slots. Returns true when `key`
// was not there and this call inserted it. Every probe is an atomicCAS (no plain read racing
// another thread's insert), so of concurrent inserts of one key exactly one wins. Terminates
// because the caller keeps the table at most half full.
__device__ __forceinline__ bool hash_insert(uint32_t* table, int bits, uint32_t key, int* count) {
  const uint32_t mask = (1u << bits) - 1u;
  uint32_t slot = (key * 0x9E3779B1u) >> (32 - bits);  // Fibonacci hashing: the high bits mix best
  for (uint32_t probe = 0; probe <= mask; ++probe) {
    const uint32_t prev = atomicCAS(table + slot, kHashFree, key);
    if (prev == kHashFree) {
      atomicAdd(count, 1);
      return true;
    }
    if (prev == key) return false;
    slot = (slot + 1u) & mask;
  }
  return false;  // full table: unreachable at load <= 1/2; treating the key as seen is safe
}

struct SearchArgs {
  const int32_t* graph;
  const uint8_t* codes;    // null, or the rows' codes (codes.h): the traversal reads them, the rows re-rank
  const float* code_grid;  // int8: [2, dim], each dimension's offset, then its step; int4: [dim + cells, dim]
  const float* rotated;    // int4: [Q, dim + cells], the rotated queries, then their cell dots (rotate_queries_kernel)
  int code_cells;          // int4: the grid's cells
  int64_t code_stride;     // bytes per code row (code_row_bytes)
  int code_dims;           // codes per row, padded to a multiple of 16 (int8) or 32 (int4) (code_dims)
  int code_bytes;          // bytes of those codes, the tail not counted
  const bool* allowed;  // null without a filter
  float* out_dists;     // [Q * searches, k]: the results, or each search's part when split
  int64_t* out_ids;
  int32_t* counts;      // null, or [Q]: distances computed per query (summed over its searches)
  uint64_t seed;
  Metric metric;
  int n, dim, degree;
  int k;
  int kept;          // entries the filtered result list keeps: k, or with codes the list's
                     // length, so that the re-rank has as many to choose from as without a filter
  int searches;      // blocks (independent searches) per query
  int list_size;     // entries each search keeps in its list (<= list_cap)
  int list_cap;      // M: power of two
  int result_cap;    // power of two >= k with a filter, else 0
  int cand_cap;      // power of two >= max(M, search_width * degree)
  int hash_bits;
  int warp_rows;     // 2, 4 or 8: rows of the list in warp 0's registers (warp_iterations); 0: block_iterations
  int search_width;
  int max_iters;
  int entries;       // min(list_size, n) entry points per search, chosen as on the CPU: its
  HubEntries hubs;   // share of the query's nearest hubs (hubs.h), the rest random draws
};

// Shared state besides the dynamic arrays.
struct Scalars {
  int n_cand;      // candidates appended this round
  int hash_count;  // keys in the visited hash
  int n_parents;
  int reset;       // clear the hash before expanding
  int n_allowed;   // allowed candidates kept for the result list
  int evaluated;   // distances computed by this block
  int done;        // warp_iterations: no parent left (or max_iters reached)
  int n_entering;  // block_iterations: candidates of this round that can enter the list
  float code_scale;  // with codes: the query's scale and bias (codes.h)
  float code_bias;
  int code_level_sum;  // int4: the sum of the query's levels
  const float* cell_dots;  // int4: the query's t_j, one per cell, in global memory (read through L1)
  uint32_t parents[kMaxSearchWidth];
};

// The search kernels' CODE: what the traversal reads.
constexpr int kUncoded = 0;    // the rows
constexpr int kCodedInt8 = 8;  // 8-bit codes
constexpr int kCodedInt4 = 4;  // 4-bit codes of the rotated rows

// Chunks of a row in flight per lane in block_iterations' distances (kWarpLoopChunksInFlight).
template <int CODE>
constexpr int kBlockLoopChunksInFlight = CODE != kUncoded ? kWarpLoopChunksInFlight : 1;

// The query as the code distances need it (codes.h): its 16-bit terms split into a signed high
// and an unsigned low byte per dimension (shared memory, code_dims each; int4's by
// int4_query_slot), its scale and bias, and for int4 the sum of its levels.
struct CodeQuery {
  const uint8_t* hi;
  const uint8_t* lo;
  float scale;
  float bias;  // int4: with one cell the bias of every row (int4_cell_bias), else the constant it takes
  int level_sum;
  const float* const* cell_dots;  // int4 with cells: where the query's t_j lie (Scalars, shared)
};

// Four byte products added to c: a's bytes signed, b's unsigned.
__device__ __forceinline__ int dot4_signed_unsigned(uint32_t a, uint32_t b, int c) {
  int d;
  asm("dp4a.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Code distance of row u to the query (codes.h) by the TEAM lanes of a team, with 16-byte
// loads of the code row (IN_FLIGHT of them per lane at once, as team_visit_chunks). All lanes
// of the warp call it together; a team without a row passes valid = false and loads nothing.
template <int CODE, int TEAM, int IN_FLIGHT>
__device__ __forceinline__ float team_code_distance(const SearchArgs& a, const CodeQuery& cq, uint32_t u, bool valid,
                                                    int rank) {
  const uint8_t* row = a.codes + static_cast<int64_t>(u) * a.code_stride;
  const uint4* codes = reinterpret_cast<const uint4*>(row);
  const uint4* hi = reinterpret_cast<const uint4*>(cq.hi);
  const uint4* lo = reinterpret_cast<const uint4*>(cq.lo);
  const int chunks = valid ? a.code_bytes / 16 : 0;
  int hi_dot = 0;
  unsigned lo_dot = 0u;
  // int4: the 8 codes of a word, its even dimensions (low nibbles) and its odd ones, against the
  // 8 query terms int4_query_slot put in that order.
  const auto add_int4_word = [&](uint32_t word, uint32_t hi_even, uint32_t hi_odd, uint32_t lo_even,
                                 uint32_t lo_odd) {
    const uint32_t even = word & 0x0f0f0f0fu, odd = (word >> 4) & 0x0f0f0f0fu;
    hi_dot = dot4_signed_unsigned(hi_even, even, hi_dot);
    hi_dot = dot4_signed_unsigned(hi_odd, odd, hi_dot);
    lo_dot = __dp4a(lo_even, even, lo_dot);
    lo_dot = __dp4a(lo_odd, odd, lo_dot);
  };
#pragma unroll 1
  for (int first = rank; first < chunks; first += IN_FLIGHT * TEAM) {
    uint4 c[IN_FLIGHT];
#pragma unroll
    for (int k = 0; k < IN_FLIGHT; ++k) {
      if (first + k * TEAM < chunks) c[k] = __ldg(codes + first + k * TEAM);
    }
#pragma unroll
    for (int k = 0; k < IN_FLIGHT; ++k) {
      const int at = first + k * TEAM;
      if (at < chunks) {
        if constexpr (CODE == kCodedInt8) {
          const uint4 h = hi[at], l = lo[at];
          hi_dot = dot4_signed_unsigned(h.x, c[k].x, hi_dot);
          hi_dot = dot4_signed_unsigned(h.y, c[k].y, hi_dot);
          hi_dot = dot4_signed_unsigned(h.z, c[k].z, hi_dot);
          hi_dot = dot4_signed_unsigned(h.w, c[k].w, hi_dot);
          lo_dot = __dp4a(l.x, c[k].x, lo_dot);
          lo_dot = __dp4a(l.y, c[k].y, lo_dot);
          lo_dot = __dp4a(l.z, c[k].z, lo_dot);
          lo_dot = __dp4a(l.w, c[k].w, lo_dot);
        } else {  // 32 codes a chunk: 32 query terms, two 16-byte loads of each byte array
          const uint4 h0 = hi[2 * at], h1 = hi[2 * at + 1], l0 = lo[2 * at], l1 = lo[2 * at + 1];
          add_int4_word(c[k].x, h0.x, h0.y, l0.x, l0.y);
          add_int4_word(c[k].y, h0.z, h0.w, l0.z, l0.w);
          add_int4_word(c[k].z, h1.x, h1.y, l1.x, l1.y);
          add_int4_word(c[k].w, h1.z, h1.w, l1.z, l1.w);
        }
      }
    }
  }
  hi_dot = team_sum<TEAM>(hi_dot);
  lo_dot = team_sum<TEAM>(lo_dot);
  // The tail is loaded after the sums on purpose: loading int8's norm before the chunks cost the
  // coded search at batch 10 000 3-5% and gained a batch of 1 nothing (H200, 1M x 384 real rows;
  // not profiled).
  const float* tail = reinterpret_cast<const float*>(row + a.code_bytes);
  if constexpr (CODE == kCodedInt8) {
    const float norm = a.metric == Metric::kL2 && valid ? __ldg(tail) : 0.0f;
    return code_distance(hi_dot, static_cast<int32_t>(lo_dot), cq.scale, cq.bias, norm, a.metric);
  } else {  // alpha, K and the cell in one 16-byte load, then the cell's dot
    const uint4 t = valid ? __ldg(reinterpret_cast<const uint4*>(tail)) : make_uint4(0u, 0u, 0u, 0u);
    // One cell: its bias is the query's. More: the row's cell's, from the query's dots where the
    // rotation left them (the pointer waits in shared memory: the warp loop's kernel, bounded to 64
    // registers, has none to spare for it).
    const float bias = a.code_cells == 1 || !valid
                           ? cq.bias
                           : int4_cell_bias(cq.bias, __ldg(*cq.cell_dots + int4_cell_of(t.z, a.code_cells)), a.metric);
    return int4_code_distance(hi_dot, static_cast<int32_t>(lo_dot), cq.level_sum, cq.scale, bias,
                              __uint_as_float(t.x), __uint_as_float(t.y), a.metric);
  }
}

// The exact distance of data row u to the query by the TEAM lanes of a team (same calling rules
// as team_distance); NaN becomes +inf, which would otherwise break the sort order.
template <typename T, int TEAM, int IN_FLIGHT>
__device__ __forceinline__ float exact_distance(const SearchArgs& a, const T* __restrict__ x,
                                                const T* __restrict__ query, uint32_t u, bool valid, int rank) {
  const T* row = x + static_cast<int64_t>(u) * a.dim;
  const int dim = valid ? a.dim : 0;
  const float dist = a.metric == Metric::kCosine
                         ? team_cosine<TEAM, T, /*kUnitA=*/true, IN_FLIGHT>(query, row, dim, rank)
                         : team_distance<TEAM, IN_FLIGHT>(query, row, dim, a.metric, rank);
  return isnan(dist) ? std::numeric_limits<float>::infinity() : dist;
}

// Static shared memory of the kernel (Scalars), rounded up generously: dynamic + static must
// stay within the per-block limit.
constexpr size_t kStaticShared = 1024;
static_assert(sizeof(Scalars) <= kStaticShared, "Scalars outgrew its shared-memory allowance");

// Team-cooperative distances of cand[0, n) to the query into cand_d (seed 002: warp-cooperative
// distance with 16-byte loads; the team size is matched to the row so that short rows do not
// idle most of a warp): from the codes when CODE, else exact. Called by the whole block; no
// barrier inside. IN_FLIGHT: chunks of a row each lane loads at once (team_visit).
template <typename T, int TEAM, int CODE, int IN_FLIGHT = 1>
__device__ __forceinline__ void compute_distances(const SearchArgs& a, const T* __restrict__ x,
                                                  const T* __restrict__ query, const CodeQuery& cq, int n,
                                                  float* cand_d, const uint32_t* cand_i) {
  const int tid = threadIdx.x;
  const int teams = blockDim.x / TEAM, team = tid / TEAM, rank = tid % TEAM;
  const int warp_first_team = (tid / kWarpSize) * (kWarpSize / TEAM);
  for (int base = 0; base < n; base += teams) {
    if (base + warp_first_team >= n) continue;  // warp-uniform: no team of this warp has work
    // Teams without a candidate run the shuffles with an empty row: every lane of a warp must
    // reach team_sum's __shfl_xor_sync.
    const int c = base + team;
    const bool valid = c < n;
    const uint32_t u = valid ? cand_i[c] : 0u;
    float dist;
    if constexpr (CODE != kUncoded) {
      dist = team_code_distance<CODE, TEAM, IN_FLIGHT>(a, cq, u, valid, rank);
      if (isnan(dist)) dist = std::numeric_limits<float>::infinity();
    } else {
      dist = exact_distance<T, TEAM, IN_FLIGHT>(a, x, query, u, valid, rank);
    }
    if (valid && rank == 0) cand_d[c] = dist;
  }
}

// Computes the distances of cand[0, n) (ids already written), sorts them, and merges them into
// the list (and the allowed ones into the result list). Entered after a __syncthreads that
// published cand ids and s.n_cand; returns after one (or at once, with nothing to do).
template <typename T, int TEAM, int CODE>
__device__ void evaluate_and_merge(const SearchArgs& a, const T* __restrict__ x, const T* __restrict__ query,
                                   const CodeQuery& cq, Scalars& s, float* list_d, uint32_t* list_i, float* res_d, uint32_t* res_i,
                                   float* cand_d, uint32_t* cand_i) {
  const int tid = threadIdx.x, lane = tid % kWarpSize;
  const int n = s.n_cand;
  if (n == 0) {  // block-uniform: nothing to merge
    __syncthreads();  // every thread has read s.n_cand before warp 0 resets it for the next round
    return;
  }
  if (tid == 0) s.evaluated += n;  // thread 0 alone writes and reads it
  compute_distances<T, TEAM, CODE, kBlockLoopChunksInFlight<CODE>>(a, x, query, cq, n, cand_d, cand_i);
  __syncthreads();
  // Without a filter only a candidate before the list's last kept key can enter the list (as in
  // warp_iterations), so only those are sorted, and a round none of whose candidates enters
  // (most rounds late in a search) sorts and merges nothing. Each thread holds one candidate in
  // registers across the barrier, so this takes rounds of at most blockDim.x candidates; the
  // survivors' order in cand does not matter, as their keys are distinct and sorted next.
  int sorted = n;
  if (a.allowed == nullptr && n <= static_cast<int>(blockDim.x)) {
    const float worst_d = list_d[a.list_size - 1];
    const uint32_t worst_i = list_i[a.list_size - 1];
    const float cd = tid < n ? cand_d[tid] : 0.0f;
    const uint32_t ci = tid < n ? cand_i[tid] : kEmptyId;
    const bool enters = tid < n && key_less(cd, ci, worst_d, worst_i);
    if (tid == 0) s.n_entering = 0;
    __syncthreads();  // every candidate is read, and the count zeroed, before any survivor moves
    if (enters) {
      const int at = atomicAdd(&s.n_entering, 1);
      cand_d[at] = cd;
      cand_i[at] = ci;
    }
    __syncthreads();
    sorted = s.n_entering;
    if (sorted == 0) {  // block-uniform
      __syncthreads();  // every thread has read s.n_entering and s.n_cand before they change
      return;
    }
  }
  const int n_sort = next_pow2(sorted);  // <= cand_cap, which is a power of two >= n
  for (int c = sorted + tid; c < n_sort; c += blockDim.x) {
    cand_d[c] = std::numeric_limits<float>::infinity();
    cand_i[c] = kEmptyId;
  }
  __syncthreads();
  bitonic<false>(cand_d, cand_i, n_sort);

  // Keep exactly list_size entries, as the CPU list does (M only rounds the storage up).
  merge_sorted(list_d, list_i, a.list_cap, a.list_size, cand_d, cand_i, n_sort);

  if (a.allowed != nullptr) {
    // Every computed node competes for the results if the filter allows it (as on the CPU).
    // Warp 0 compacts the allowed candidates to the front in order, so they stay sorted; only
    // the first `kept` can matter. The list merge above no longer reads cand.
    if (tid < kWarpSize) {
      int kept = 0;
      for (int base = 0; base < n && kept < a.kept; base += kWarpSize) {  // kept is warp-uniform
        const int c = base + lane;
        bool ok = false;
        float d = 0.0f;
        uint32_t u = 0u;
        if (c < n) {
          d = cand_d[c];
          u = cand_i[c];
          ok = a.allowed[u];
        }
        const unsigned bits = __ballot_sync(kFullMask, ok);
        __syncwarp();  // all lanes have read this chunk before any lane overwrites part of it
        const int pos = kept + __popc(bits & ((1u << lane) - 1u));
        if (ok && pos < a.kept) {
          cand_d[pos] = d;
          cand_i[pos] = u;
        }
        kept += __popc(bits);
        __syncwarp();
      }
      if (lane == 0) s.n_allowed = min(kept, a.kept);
    }
    __syncthreads();
    merge_sorted(res_d, res_i, a.result_cap, a.kept, cand_d, cand_i, s.n_allowed);
  }
  __syncthreads();
}

// The iterations in general (any list, round or filter), the block sharing the work: parent
// choice, expansion, distances, sort and merge each take the whole block, with barriers
// between them. Entered after the entry points were merged into the list.
template <typename T, int TEAM, int CODE>
__device__ void block_iterations(const SearchArgs& a, const T* __restrict__ x, const T* __restrict__ query,
                                 const CodeQuery& cq, Scalars& s, float* list_d, uint32_t* list_i, float* res_d, uint32_t* res_i,
                                 float* cand_d, uint32_t* cand_i, uint32_t* table) {
  const int tid = threadIdx.x, lane = tid % kWarpSize;
  const int hash_size = 1 << a.hash_bits, half_table = hash_size / 2;
  for (int iter = 0; a.max_iters == 0 || iter < a.max_iters; ++iter) {
    // Parents: the search_width best unexpanded entries, found by warp 0 with ballots over the
    // sorted list (seed 002, OB 12: widths 1-2 are the useful range, so this is a short scan).
    if (tid < kWarpSize) {
      int found = 0;
      for (int base = 0; base < a.list_size && found < a.search_width; base += kWarpSize) {
        const int i = base + lane;
        const uint32_t id = i < a.list_size ? list_i[i] : kEmptyId;
        const bool open = id != kEmptyId && (id & kExpanded) == 0u;
        const unsigned bits = __ballot_sync(kFullMask, open);
        const int pos = found + __popc(bits & ((1u << lane) - 1u));
        if (open && pos < a.search_width) {
          s.parents[pos] = id;
          list_i[i] = id | kExpanded;
        }
        found = min(found + __popc(bits), a.search_width);
      }
      if (lane == 0) {
        s.n_parents = found;
        s.n_cand = 0;
        // Keep the table at most half full through this round's insertions; after a reset it
        // holds at most list_size + k ids, and the host sized it so that those plus a round fit.
        s.reset = s.hash_count + found * a.degree > half_table;
      }
    }
    __syncthreads();
    const int n_parents = s.n_parents;
    if (n_parents == 0) break;

    if (s.reset) {
      for (int i = tid; i < hash_size; i += blockDim.x) table[i] = kHashFree;
      if (tid == 0) s.hash_count = 0;
      __syncthreads();
      // Refill with the nodes both lists hold, so that none of them can come back as a duplicate.
      for (int i = tid; i < a.list_size; i += blockDim.x) {
        const uint32_t id = list_i[i] & kIdMask;
        if (id != kEmptyId) hash_insert(table, a.hash_bits, id, &s.hash_count);
      }
      for (int i = tid; i < a.result_cap; i += blockDim.x) {
        const uint32_t id = res_i[i];
        if (id != kEmptyId) hash_insert(table, a.hash_bits, id, &s.hash_count);
      }
      __syncthreads();
    }

    // Expand: every neighbour slot of every parent is one thread's work. Ids outside [0, n)
    // (the -1 padding, or a corrupt graph, which the CUDA path does not scan for on the host)
    // are skipped, so no row outside the data is ever read.
    const int total = n_parents * a.degree;
    for (int i = tid; i < total; i += blockDim.x) {
      const int p = i / a.degree, j = i - p * a.degree;
      const uint32_t parent = s.parents[p] & kIdMask;
      const int32_t u = __ldg(a.graph + static_cast<int64_t>(parent) * a.degree + j);
      if (u >= 0 && u < a.n && hash_insert(table, a.hash_bits, static_cast<uint32_t>(u), &s.hash_count)) {
        cand_i[atomicAdd(&s.n_cand, 1)] = static_cast<uint32_t>(u);
      }
    }
    __syncthreads();
    evaluate_and_merge<T, TEAM, CODE>(a, x, query, cq, s, list_d, list_i, res_d, res_i, cand_d, cand_i);
  }
}

// The iterations when one warp can hold the whole list (list_size <= 32 * kMaxWarpRows: ROWS
// keys per lane) and a round's neighbour slots (search_width * degree <= 32 * kMaxWarpCandRows:
// up to eight per lane; the candidates that can enter the list are sorted and merged 32 at a
// time, which keeps the same best keys as one merge of all), without a filter. Warp 0 does
// everything but the distances in registers: parent choice and expansion with ballots, the sort
// of the new candidates and their merge into the list with shuffles. An iteration then has two
// block barriers (candidates published, distances published) instead of about seven, which is
// what a small batch waits on (ncu: barrier stalls dominate). Same algorithm, same expansions
// and the same list as block_iterations.
//
// Between warp 0's two sections the list rests in list_d/list_i, and each section loads the rows
// it needs into registers. Held in registers across the distance phase, where every thread of
// the block needs its own for the loads in flight, the list spilled under the kernel's 64
// registers (ptxas, sm_90: 156-344 bytes at 4 rows; 0-12 now), which cost a search at list 96
// (10 000 queries, int4 codes, H200) 30M local-memory requests and 68% more instructions than at
// list 64 for 32% more distances (ncu). Out of the distance phase, and with lists of 129-256 in
// eight rows instead of the general loop, batches of 10 000 ran 11-20% faster at lists 96-256
// and 1-5% at 16-64 (1M x 384 real rows, H200, benchmarks/README.md). Entered after the entry
// points were merged into list_d/list_i; leaves the final list there, after a __syncthreads.
template <typename T, int TEAM, int CODE, int ROWS>
__device__ void warp_iterations(const SearchArgs& a, const T* __restrict__ x, const T* __restrict__ query,
                                const CodeQuery& cq, Scalars& s, float* list_d, uint32_t* list_i, float* cand_d, uint32_t* cand_i,
                                uint32_t* table) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int tid = threadIdx.x, lane = tid % kWarpSize;
  const unsigned below = (1u << lane) - 1u;
  const int hash_size = 1 << a.hash_bits, half_table = hash_size / 2;
  // Lane l holds positions r * 32 + l of the list; those past list_cap (a list of 32 in two
  // rows) have no slot in shared memory and stay empty.
  const auto in_list = [&](int r) { return r * kWarpSize + lane < a.list_cap; };
  int iter = 0;  // warp 0's count of iterations, as block_iterations counts them
  for (;;) {
    if (tid < kWarpSize) {
      uint32_t id[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) id[r] = in_list(r) ? list_i[r * kWarpSize + lane] : kEmptyId;
      int n = 0;
      bool done = false;
      while (n == 0 && !done) {  // a parent whose neighbours were all seen costs no barrier
        if (a.max_iters != 0 && iter >= a.max_iters) {
          done = true;
          break;
        }
        ++iter;
        // Parents: the first search_width unexpanded entries in list order.
        int found = 0;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const bool open = r * kWarpSize + lane < a.list_size && id[r] != kEmptyId && (id[r] & kExpanded) == 0u;
          const unsigned bits = __ballot_sync(kFullMask, open);
          const int pos = found + __popc(bits & below);
          if (open && pos < a.search_width) {
            s.parents[pos] = id[r];
            id[r] |= kExpanded;
          }
          found = min(found + __popc(bits), a.search_width);
        }
        if (found == 0) {
          done = true;
          break;
        }
        __syncwarp();  // the parents and the hash count are visible to every lane
        // Warp-uniform: the count changes only after the __syncwarp below (or in the expansion).
        if (s.hash_count + found * a.degree > half_table) {  // as block_iterations resets
          __syncwarp();  // every lane has read the count before lane 0 zeroes it
          for (int i = lane; i < hash_size; i += kWarpSize) table[i] = kHashFree;
          if (lane == 0) s.hash_count = 0;
          __syncwarp();
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            if (id[r] != kEmptyId) hash_insert(table, a.hash_bits, id[r] & kIdMask, &s.hash_count);
          }
          __syncwarp();
        }
        // Expand: lane j takes neighbour slots j, 32 + j, ... of the round, all loaded before
        // the first is looked up (one trip to memory per round, not one per 32 slots); new ids
        // are packed in slot order.
        const int slots = found * a.degree;  // <= 32 * kMaxWarpCandRows (host)
        int32_t v[kMaxWarpCandRows];
#pragma unroll
        for (int c = 0; c < kMaxWarpCandRows; ++c) {
          const int slot = c * kWarpSize + lane;
          v[c] = -1;
          if (slot < slots) {
            const int p = slot / a.degree, j = slot - p * a.degree;
            v[c] = __ldg(a.graph + static_cast<int64_t>(s.parents[p] & kIdMask) * a.degree + j);
          }
        }
#pragma unroll
        for (int c = 0; c < kMaxWarpCandRows; ++c) {
          if (c * kWarpSize >= slots) break;  // warp-uniform
          const uint32_t u = static_cast<uint32_t>(v[c]);
          const bool fresh = v[c] >= 0 && v[c] < a.n && hash_insert(table, a.hash_bits, u, &s.hash_count);
          const unsigned bits = __ballot_sync(kFullMask, fresh);
          if (fresh) cand_i[n + __popc(bits & below)] = u;
          n += __popc(bits);
        }
        __syncwarp();  // every lane has read s.parents before the next round may rewrite them
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (in_list(r)) list_i[r * kWarpSize + lane] = id[r];  // the expanded flags
      }
      if (lane == 0) {
        s.n_cand = n;
        s.done = done;
        if (!done) s.evaluated += n;  // thread 0 alone writes and reads it
      }
    }
    __syncthreads();  // candidates (and the list) published
    if (s.done) break;  // block-uniform
    const int n = s.n_cand;
    compute_distances<T, TEAM, CODE, kWarpLoopChunksInFlight>(a, x, query, cq, n, cand_d, cand_i);
    __syncthreads();  // distances published; no warp reads cand, n_cand or done again before the next barrier
    if (tid < kWarpSize) {
      // Only a candidate before the list's last kept key can enter the list; the others are
      // dropped before the sort, and a round none of whose candidates can enter (most rounds
      // late in a search) costs no sort and no merge. The survivors move to the front of cand.
      const int last = a.list_size - 1;  // < list_cap
      const float worst_d = list_d[last];
      const uint32_t worst_i = list_i[last];
      int entering = 0;
      for (int c = 0; c * kWarpSize < n; ++c) {  // warp-uniform
        const int at = c * kWarpSize + lane;
        const float cd = at < n ? cand_d[at] : kInf;
        const uint32_t ci = at < n ? cand_i[at] : kEmptyId;
        const bool enters = at < n && key_less(cd, ci, worst_d, worst_i);
        const unsigned bits = __ballot_sync(kFullMask, enters);
        __syncwarp();  // every lane has read its candidate before any survivor moves down
        if (enters) {
          cand_d[entering + __popc(bits & below)] = cd;
          cand_i[entering + __popc(bits & below)] = ci;
        }
        entering += __popc(bits);
        __syncwarp();
      }
      if (entering > 0) {  // warp-uniform
        float d[ROWS];
        uint32_t id[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          d[r] = in_list(r) ? list_d[r * kWarpSize + lane] : kInf;
          id[r] = in_list(r) ? list_i[r * kWarpSize + lane] : kEmptyId;
        }
        for (int c = 0; c * kWarpSize < entering; ++c) {  // warp-uniform
          const int at = c * kWarpSize + lane;
          float cd = at < entering ? cand_d[at] : kInf;
          uint32_t ci = at < entering ? cand_i[at] : kEmptyId;
          warp_sort32(cd, ci);
          warp_merge<ROWS>(d, id, cd, ci, a.list_size);
        }
        __syncwarp();  // every lane has read the list before any lane rewrites it
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (in_list(r)) {
            list_d[r * kWarpSize + lane] = d[r];
            list_i[r * kWarpSize + lane] = id[r];
          }
        }
      }
      __syncwarp();  // the list is visible to every lane of warp 0 before the next parents
    }
  }
}

// With codes, each block turns its query into the code terms (codes.h) in shared memory: warp 0
// alone, so that the constant is summed in the order the CPU follows (kCodeConstantLanes).
// Published by the caller's next __syncthreads.
template <int CODE, typename T>
__device__ void prepare_code_query(const SearchArgs& a, const T* __restrict__ query, int64_t qi, Scalars& s,
                                   uint8_t* hi, uint8_t* lo) {
  const int lane = threadIdx.x;
  if (lane >= kWarpSize) return;
  // int8: each dimension's offset and step; int4: the first cell's centre, and the rotated query's terms.
  const float* offset = CODE == kCodedInt8 ? a.code_grid : a.code_grid + static_cast<int64_t>(a.dim) * a.dim;
  const float* step = a.code_grid + a.dim;
  const float* rotated = CODE == kCodedInt4 ? a.rotated + qi * (a.dim + a.code_cells) : nullptr;
  const auto term = [&](int d) {
    return CODE == kCodedInt8 ? code_query_term(static_cast<float>(query[d]), offset[d], step[d], a.metric)
                              : rotated[d];
  };
  float largest = 0.0f, constant = 0.0f;
  for (int d = lane; d < a.dim; d += kWarpSize) {
    largest = fmaxf(largest, fabsf(term(d)));
    constant = code_constant_step(constant, static_cast<float>(query[d]), offset[d], a.metric);
  }
  largest = team_max<kWarpSize>(largest);
  constant = team_sum<kWarpSize>(constant);
  const float scale = code_query_scale(largest);
  int level_sum = 0;
  for (int d = lane; d < a.code_dims; d += kWarpSize) {
    const int level = d < a.dim ? code_query_level(term(d), scale) : 0;
    level_sum += level;
    const int64_t slot = CODE == kCodedInt8 ? d : int4_query_slot(d);
    hi[slot] = static_cast<uint8_t>(static_cast<uint32_t>(level >> 8) & 0xffu);
    lo[slot] = static_cast<uint8_t>(static_cast<uint32_t>(level) & 0xffu);
  }
  level_sum = team_sum<kWarpSize>(level_sum);  // integers: any order gives the CPU's sum
  if (lane == 0) {
    s.code_scale = scale;
    s.code_bias = code_bias(constant, a.metric);
    s.code_level_sum = level_sum;
    if constexpr (CODE == kCodedInt4) {
      // The query's dots with the cells follow its rotated terms. A copy in shared memory (4 KB a
      // query with 1 000 cells) ran the search at batch 10 000 2-11% slower at every list than
      // reading them where they lie (fewer resident blocks; two calls on H200s, 1M x 384 real
      // rows, both before the rotation's dots were read in tiles).
      s.cell_dots = rotated + a.dim;
      if (a.code_cells == 1) s.code_bias = int4_cell_bias(s.code_bias, s.cell_dots[0], a.metric);
    }
  }
}

// The re-rank of a coded search: the exact distances of the `count` entries of the final list,
// sorted. The ids are only read (the sort and the output mask the expanded flag), so no lane
// writes what its team's other lanes read. Entered and left after a __syncthreads.
template <typename T, int TEAM>
__device__ void rerank(const SearchArgs& a, const T* __restrict__ x, const T* __restrict__ query, float* best_d,
                       uint32_t* best_i, int count, int cap) {
  const int tid = threadIdx.x;
  const int teams = blockDim.x / TEAM, team = tid / TEAM, rank = tid % TEAM;
  const int warp_first_team = (tid / kWarpSize) * (kWarpSize / TEAM);
  for (int base = 0; base < count; base += teams) {
    if (base + warp_first_team >= count) continue;  // warp-uniform
    const int c = base + team;
    const uint32_t u = c < count ? best_i[c] & kIdMask : kEmptyId;
    const bool valid = u != kEmptyId;
    const float dist = exact_distance<T, TEAM, kWarpLoopChunksInFlight>(a, x, query, u, valid, rank);
    if (c < count && rank == 0) best_d[c] = valid ? dist : std::numeric_limits<float>::infinity();
  }
  __syncthreads();
  bitonic<false>(best_d, best_i, cap);
}

// One search per block. ROWS > 0: the list lives in warp 0's registers (warp_iterations, ROWS
// rows of 32 keys); 0: block_iterations. CODE (kUncoded, kCodedInt8, kCodedInt4): with codes the
// traversal's distances come from them
// and the final list is re-ranked by exact ones. Each variant is a kernel of its own (below), so
// that each is compiled for the registers it needs.
template <typename T, int TEAM, int CODE, int ROWS>
__device__ __forceinline__ void search_block(const T* __restrict__ x, const T* __restrict__ queries,
                                             const SearchArgs& a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Scalars s;
  // The code query first: its arrays are multiples of 16 bytes, so the rest stays aligned.
  uint8_t* code_hi = smem;
  uint8_t* code_lo = code_hi + (CODE != kUncoded ? a.code_dims : 0);
  float* list_d = reinterpret_cast<float*>(code_lo + (CODE != kUncoded ? a.code_dims : 0));
  uint32_t* list_i = reinterpret_cast<uint32_t*>(list_d + a.list_cap);
  float* res_d = reinterpret_cast<float*>(list_i + a.list_cap);
  uint32_t* res_i = reinterpret_cast<uint32_t*>(res_d + a.result_cap);
  float* cand_d = reinterpret_cast<float*>(res_i + a.result_cap);
  uint32_t* cand_i = reinterpret_cast<uint32_t*>(cand_d + a.cand_cap);
  uint32_t* table = cand_i + a.cand_cap;

  const int tid = threadIdx.x;
  const uint32_t qi = blockIdx.x / a.searches, search = blockIdx.x % a.searches;
  const T* query = queries + static_cast<int64_t>(qi) * a.dim;
  const int hash_size = 1 << a.hash_bits;

  for (int i = tid; i < hash_size; i += blockDim.x) table[i] = kHashFree;
  for (int i = tid; i < a.list_cap; i += blockDim.x) {
    list_d[i] = std::numeric_limits<float>::infinity();
    list_i[i] = kEmptyId;
  }
  for (int i = tid; i < a.result_cap; i += blockDim.x) {
    res_d[i] = std::numeric_limits<float>::infinity();
    res_i[i] = kEmptyId;
  }
  if (tid == 0) {
    s.n_cand = 0;
    s.hash_count = 0;
    s.evaluated = 0;
  }
  if constexpr (CODE != kUncoded) prepare_code_query<CODE>(a, query, qi, s, code_hi, code_lo);
  __syncthreads();
  const CodeQuery cq{code_hi, code_lo, CODE != kUncoded ? s.code_scale : 0.0f,
                      CODE != kUncoded ? s.code_bias : 0.0f, CODE != kUncoded ? s.code_level_sum : 0, &s.cell_dots};

  // Entry points: the query's nearest hubs, then the CPU's draws, counter (query, search, e);
  // repeats are dropped by the hash.
  for (int e = tid; e < a.entries; e += blockDim.x) {
    const uint32_t r = random_u32(a.seed, Stream::kEntryPoints, qi, search, static_cast<uint32_t>(e));
    const int hub = a.hubs.column(e, static_cast<int>(search));
    const uint32_t id = hub >= 0 ? static_cast<uint32_t>(a.hubs.ids[static_cast<int64_t>(qi) * a.hubs.columns + hub])
                                 : random_below(r, static_cast<uint32_t>(a.n));
    if (hash_insert(table, a.hash_bits, id, &s.hash_count)) cand_i[atomicAdd(&s.n_cand, 1)] = id;
  }
  __syncthreads();
  evaluate_and_merge<T, TEAM, CODE>(a, x, query, cq, s, list_d, list_i, res_d, res_i, cand_d, cand_i);

  if constexpr (ROWS > 0) {
    warp_iterations<T, TEAM, CODE, ROWS>(a, x, query, cq, s, list_d, list_i, cand_d, cand_i, table);
  } else {
    block_iterations<T, TEAM, CODE>(a, x, query, cq, s, list_d, list_i, res_d, res_i, cand_d, cand_i, table);
  }

  float* best_d = a.allowed != nullptr ? res_d : list_d;
  uint32_t* best_i = a.allowed != nullptr ? res_i : list_i;
  if constexpr (CODE != kUncoded) {
    rerank<T, TEAM>(a, x, query, best_d, best_i, a.allowed != nullptr ? a.kept : a.list_size,
                    a.allowed != nullptr ? a.result_cap : a.list_cap);
  }
  const int64_t out = static_cast<int64_t>(blockIdx.x) * a.k;
  for (int j = tid; j < a.k; j += blockDim.x) {
    const uint32_t id = best_i[j] & kIdMask;
    const bool found = id != kEmptyId;
    a.out_dists[out + j] = found ? best_d[j] : std::numeric_limits<float>::infinity();
    a.out_ids[out + j] = found ? static_cast<int64_t>(id) : -1;
  }
  if (a.counts != nullptr && tid == 0) atomicAdd(a.counts + qi, s.evaluated);
}

// The general loop, with the register budget ptxas picks for kMaxThreads (53-64 registers on sm_90).
template <typename T, int TEAM, int CODE>
__global__ void __launch_bounds__(kMaxThreads)
    search_kernel(const T* __restrict__ x, const T* __restrict__ queries, const SearchArgs a) {
  search_block<T, TEAM, CODE, 0>(x, queries, a);
}

// The warp loop, bounded to 64 registers (two blocks of kMaxThreads per SM): with
// kWarpLoopChunksInFlight chunks in flight ptxas otherwise takes 100-128, which halves the
// resident blocks of a large batch; at 64 it spills a few bytes (ptxas -v, sm_90). The bound is
// the kernel's own: under it the general loop ran 5% slower at list 256 (467K against 490K q/s,
// 1M x 384 float16, H200).
template <typename T, int TEAM, int CODE, int ROWS>
__global__ void __launch_bounds__(kMaxThreads, 2)
    warp_search_kernel(const T* __restrict__ x, const T* __restrict__ queries, const SearchArgs a) {
  search_block<T, TEAM, CODE, ROWS>(x, queries, a);
}

// Merges the `searches` sorted parts of k results of each query into its k best distinct ids, one
// warp per query: lane j holds the head of search j's part, and each step takes the smallest
// head (a butterfly of shuffles) and moves past it every part whose head holds that id. Two
// searches that reached the same node computed the same distance for it (same code, same inputs,
// same lanes), so a node's copies are equal keys and reach the heads together: a step emits one
// distinct id, and k steps (fewer when the parts run out) finish the query. The parts are staged
// in shared memory first, so that a step waits on no global load. A bitonic sort of all the
// parts in one block of 256 threads took about 10 us for 32 searches of 10 (H200, benchmarks/
// results/profile_small_batches_latency_h200_before.txt), most of it its 45 barrier-separated
// stages.
static_assert(kMaxSearches <= kWarpSize, "merge_searches_kernel keeps one part's head per lane");
__global__ void __launch_bounds__(kWarpSize)
    merge_searches_kernel(const float* __restrict__ part_dists, const int64_t* __restrict__ part_ids, int searches,
                          int k, float* __restrict__ out_dists, int64_t* __restrict__ out_ids) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int per_query = searches * k;  // searches <= kMaxSearches = 32 lanes (params.h)
  float* d = reinterpret_cast<float*>(smem);
  uint32_t* id = reinterpret_cast<uint32_t*>(d + per_query);
  const int lane = threadIdx.x;
  const int64_t in = static_cast<int64_t>(blockIdx.x) * per_query, out = static_cast<int64_t>(blockIdx.x) * k;
  for (int i = lane; i < per_query; i += kWarpSize) {
    const int64_t u = part_ids[in + i];
    d[i] = u >= 0 ? part_dists[in + i] : std::numeric_limits<float>::infinity();
    id[i] = u >= 0 ? static_cast<uint32_t>(u) : kEmptyId;
  }
  __syncwarp();
  int at = 0;  // position in this lane's part
  const auto head_d = [&] { return lane < searches && at < k ? d[lane * k + at] : std::numeric_limits<float>::infinity(); };
  const auto head_i = [&] { return lane < searches && at < k ? id[lane * k + at] : kEmptyId; };
  float hd = head_d();
  uint32_t hi = head_i();
  int kept = 0;
  for (; kept < k; ++kept) {
    float best_d = hd;
    uint32_t best_i = hi;
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      const float od = __shfl_xor_sync(kFullMask, best_d, offset);
      const uint32_t oi = __shfl_xor_sync(kFullMask, best_i, offset);
      if (key_less(od, oi, best_d, best_i)) {
        best_d = od;
        best_i = oi;
      }
    }
    if (best_i == kEmptyId) break;  // warp-uniform: every part is spent
    if (lane == 0) {
      out_dists[out + kept] = best_d;
      out_ids[out + kept] = best_i;
    }
    if (hi == best_i) {
      ++at;
      hd = head_d();
      hi = head_i();
    }
  }
  for (int j = kept + lane; j < k; j += kWarpSize) {
    out_dists[out + j] = std::numeric_limits<float>::infinity();
    out_ids[out + j] = -1;
  }
}

// Threads per block. A query's iterations are serial and each ends in
// block-wide barriers, so few threads lose little per query while many resident blocks hide
// each other's barrier and memory stalls; a batch that cannot fill the GPU is latency-bound
// instead, and more threads shorten each iteration. Measured on the H200 (1M x 384 float16
// normalised clustered rows, list 64): batch 10 000 ran at 2.03M q/s with 64 threads, 1.67M
// with 128, 1.00M with 256; a batch of 100 took 1.11 ms with 64 threads, 0.80 ms with 128,
// 0.65 ms with 256. Later, with int4 codes at list 32 (search kernel time, a one-off run), a
// batch of 1 took 98 us with 256 threads and 92 us with 512, a batch of 100 121 and 111 us. Long
// lists keep enough threads for the merge network's M/2 compare-exchanges per stage.
int pick_threads(int64_t blocks, int sms, int list_cap, int64_t per_round) {
  const int for_batch = blocks >= 8 * sms                          ? 64
                        : blocks >= kLatencyBoundBlocksPerSm * sms ? 128
                        : blocks >= sms                            ? 256
                                                                   : 512;
  const int for_list = list_cap <= 256 ? 64 : list_cap <= 512 ? 256 : 512;
  // A round wider than the warp loop's goes to the block loop, where every thread expands and
  // loads candidates: 64 threads made a 288-candidate round (6 parents of degree 48) at list 256
  // run at 673K q/s by int4 codes against 901K with 128 and 888K with 256 (params.h,
  // resolve_search_width, has the run).
  const int for_round = per_round > kGpuWidestWarpRound ? 128 : 64;
  return std::max({for_batch, for_list, for_round});
}

// Independent searches per query when the caller leaves it to us: none for a batch of more than
// one query per kSplitSmsPerQuery SMs; for a smaller one, by the list size: 4 searches at list k,
// twice as many for each further k/3 of list, up to about kSplitBlocksPerSm blocks per SM (at
// least kMinSplit) and what the merge allows. The list then sets both knobs of a small batch,
// each search's list (list_per_search) and how many run, so the list sweeps one curve from the
// cheapest call to the most accurate one. Measured on the H200 (1M x 384 real embeddings, one
// run before/after, benchmarks/README.md "Width 4 at every GPU batch; searches by the list size"):
// a batch of 1 by int8 codes took 0.092 ms at recall 0.954 with list 10 (4 searches), where 32
// searches at any list took at least 0.113 ms, recall 0.990; at recall 0.99 both rules cost
// alike (0.115 against 0.113-0.114 ms).
// Earlier (batches of 100, list 16, 1M x 384 real embeddings) 10 searches a query ran at 315K q/s,
// recall 0.953, and 21 (16 blocks per SM) at 221K, 0.970: more blocks than the GPU holds at once
// stop paying. With a width of 4 a batch of 100 ran faster unsplit at equal recall (268K q/s at
// 0.991 against 223K at 0.986 for 10 searches, list 64; profile_small_batches.py --sweep).
int searches_for_batch(int64_t queries, int sms, int k, int list_size) {
  if (queries * kSplitSmsPerQuery > sms) return 1;
  const int64_t fill = kSplitBlocksPerSm * static_cast<int64_t>(sms) / std::max<int64_t>(queries, 1);
  const int64_t most = std::min<int64_t>(std::max<int64_t>(fill, kMinSplit), max_searches_for_k(k));
  const double doublings = std::min(3.0 * (list_size - k) / std::max(k, 1), 8.0);
  const int64_t by_list = std::lround(kSplitSearchesAtK * std::exp2(doublings));
  return static_cast<int>(std::clamp<int64_t>(by_list, std::min<int64_t>(kSplitSearchesAtK, most), most));
}

// The team of the code distances (both loops): the smallest whose lanes each load at most
// kWarpLoopChunksInFlight chunks of a code row, so that a row is one round trip and a warp
// takes as many rows at once as that allows. It differs from team_for_row only for rows of 129
// to 256 bytes (4 lanes, not 8): on the H200 (1M x 384 real rows, batch 10 000, lists 32-96) the
// 192-byte int4 rows ran 15-27% faster with 4 lanes than with 8 at the same recall (2.21M against
// 1.93M q/s at list 64; a one-off comparison in one process with the team forced, script not
// kept), while 384-byte int8 rows ran alike with 4 or 8. benchmarks/README.md ("Searching by
// 4-bit codes") has the committed before/after run. Full rows keep team_for_row: rows of that
// length were not measured with 4. The block loop took these teams later: with a filter at batch
// 10 000 (int4, list 64) it ran 3.94 ms against 4.38 ms with 8 lanes, and alike at small batches
// (a one-off run).
int code_team(int64_t row_bytes) {
  const int64_t chunks = (row_bytes + 15) / 16;
  int team = 4;
  while (team < kWarpSize && chunks > static_cast<int64_t>(team) * kWarpLoopChunksInFlight) team *= 2;
  return team;
}

size_t shared_bytes(const SearchArgs& a, int hash_bits) {
  return (a.codes != nullptr ? 2 * static_cast<size_t>(a.code_dims) : 0) +
         sizeof(float) * 2 * (static_cast<size_t>(a.list_cap) + a.result_cap + a.cand_cap) +
         sizeof(uint32_t) * (size_t{1} << hash_bits);
}

int log2_of(int64_t pow2) {
  int b = 0;
  while ((int64_t{1} << b) < pow2) ++b;
  return b;
}

template <typename T, int TEAM, int CODE>
void launch(const T* x, const at::Tensor& q, const SearchArgs& a, int threads, size_t smem, cudaStream_t stream) {
  auto kernel = a.warp_rows == 2   ? warp_search_kernel<T, TEAM, CODE, 2>
                : a.warp_rows == 4 ? warp_search_kernel<T, TEAM, CODE, 4>
                : a.warp_rows == 8 ? warp_search_kernel<T, TEAM, CODE, 8>
                                   : search_kernel<T, TEAM, CODE>;
  if (smem + kStaticShared > 48 * 1024) {
    // Above the default 48 KiB (static + dynamic) the kernel must opt in; a host-side
    // attribute, no sync, so it is also allowed while a CUDA graph is being captured.
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  const unsigned blocks = static_cast<unsigned>(q.size(0) * a.searches);
  kernel<<<blocks, threads, smem, stream>>>(x, q.data_ptr<T>(), a);
  check_launch();
}

// Lowest row of `rows` (count elements of rows of `dim`) that holds a NaN or Inf, found per
// block: block b writes its lowest such row, or `rows_count` if none, to block_first[b], which
// lies in pinned host memory (stores straight to the host: no fill before, no copy after).
template <typename scalar_t>
__global__ void first_non_finite_row_kernel(const scalar_t* rows, int64_t count, int64_t dim, int64_t rows_count,
                                            int64_t* block_first) {
  __shared__ unsigned long long first;
  if (threadIdx.x == 0) first = static_cast<unsigned long long>(rows_count);
  __syncthreads();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    if (!isfinite(static_cast<double>(rows[i]))) atomicMin(&first, static_cast<unsigned long long>(i / dim));
  }
  __syncthreads();
  if (threadIdx.x == 0) block_first[blockIdx.x] = static_cast<int64_t>(first);
}

// The finiteness check of the queries, split around the search: the constructor queues a kernel
// that finds the first non-finite row and writes its answer to pinned host memory, finish() waits
// for that kernel alone (not for the search queued after it) and raises. So a search returns
// while its kernels still run, and a caller can queue more work (a collective, a merge) behind
// them. One launch: a fill before it and a copy after it were two more, each a few microseconds
// of a batch of one. Skipped under CUDA-graph capture (contents_readable); the search orders NaN
// distances last either way.
class QueryCheck {
 public:
  QueryCheck(const at::Tensor& queries, cudaStream_t stream) {
    if (!contents_readable(queries)) return;
    const at::Tensor rows = queries.contiguous();
    rows_ = rows.size(0);
    const int64_t count = rows.numel();
    if (count == 0) return;
    const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, kMaxBlocks));
    host_first_ = at::empty({blocks}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    void* device_first = nullptr;
    C10_CUDA_CHECK(cudaHostGetDevicePointer(&device_first, host_first_.data_ptr(), 0));
    GRNND_DISPATCH_STORAGE(rows.scalar_type(), "first_non_finite_row", [&] {
      first_non_finite_row_kernel<scalar_t><<<blocks, 256, 0, stream>>>(rows.data_ptr<scalar_t>(), count, rows.size(1),
                                                                        rows_, static_cast<int64_t*>(device_first));
    });
    check_launch();
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&written_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(written_, stream));
  }

  QueryCheck(const QueryCheck&) = delete;
  QueryCheck& operator=(const QueryCheck&) = delete;

  // The kernel writes host memory the allocator knows nothing of: it must have finished before
  // that memory is freed, also when the search raised before finish().
  ~QueryCheck() {
    if (written_ == nullptr) return;
    C10_CUDA_CHECK_WARN(cudaEventSynchronize(written_));
    C10_CUDA_CHECK_WARN(cudaEventDestroy(written_));
  }

  void finish() const {
    if (written_ == nullptr) return;
    C10_CUDA_CHECK(cudaEventSynchronize(written_));
    const int64_t* first = host_first_.data_ptr<int64_t>();
    const int64_t row = *std::min_element(first, first + host_first_.numel());
    if (row < rows_) fail_non_finite("queries", row);
  }

 private:
  static constexpr int64_t kMaxBlocks = 1024;
  at::Tensor host_first_;  // pinned: each block's lowest non-finite row (rows_ if none)
  cudaEvent_t written_ = nullptr;  // recorded after the kernel that writes host_first_
  int64_t rows_ = 0;
};

// int4 codes: y = P u of every query and its dots t_j with the cells (codes.h; u = q - c_0 under
// l2, q otherwise), each summed chunk by chunk of dimensions as the CPU sums it
// (int4_rotation_step). Two kernels, by the batch.
//
// rotate_queries_kernel, for batches of at least kRotateOneQueryBelow queries: a block takes
// kRotateQueries queries and kRotateThreads outputs, one a thread, so that the grid is read once
// per 16 queries; the queries are staged in shared memory kRotateDims dimensions at a time. The
// rotation's outputs read the grid's row d at the block's outputs (coalesced). A cell's offsets
// lie along its centre's row: the block stages them kCellTileDims dimensions at a time, a warp
// reading a row's dimensions together, in a transposed tile each output then reads down. Read
// along the rows by each thread, they held a batch of 10 000 queries with 1 000 cells to 3.37M
// q/s at list 16 against 4.64M with the tiles (H200, 1M x 384 real rows).
//
// rotate_query_chunks_kernel, for smaller batches: a block takes one query and 32 outputs, one a
// lane, and its warps sum different chunks at once (a query's outputs are too few to fill the GPU
// one a thread: each would wait on a chain of dim loads). A warp loads the whole chunk of its
// lane's column or centre row before the first product, so a chunk costs one trip to memory;
// warp 0 adds the chunks' sums in order. One query a block reading whole columns took 14 us
// with one cell (a one-off run) and 35 us with 1 000 (benchmarks/results/
// profile_small_batches_latency_h200_before.txt; a batch of 1 on an H200, 384 dimensions).
constexpr int kRotateThreads = 128, kRotateDims = 128, kCellTileDims = 32, kRotateQueries = 16;
constexpr int kChunkWarps = 8;
static_assert(kRotateDims % kInt4RotationChunk == 0 && kCellTileDims == kInt4RotationChunk,
              "rotate_queries_kernel's stages must end where the chunks end");

template <typename T>
__global__ void __launch_bounds__(kRotateThreads)
    rotate_queries_kernel(const T* __restrict__ queries, int64_t nq, int dim, int cells,
                          const float* __restrict__ grid, Metric metric, float* __restrict__ out) {
  __shared__ float staged[kRotateQueries][kRotateDims];
  __shared__ float tile[kCellTileDims][kRotateThreads + 1];  // [dimension][output]; +1: no bank conflicts
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRotateQueries;
  const int count = static_cast<int>(std::min<int64_t>(kRotateQueries, nq - first));
  const int first_output = blockIdx.y * kRotateThreads;
  const int i = first_output + threadIdx.x;
  const int outputs = dim + cells;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const float* centre = grid + static_cast<int64_t>(dim) * dim;  // c_0, then the other cells
  const bool has_cells = first_output + kRotateThreads > dim;     // the same for the whole block
  float acc[kRotateQueries] = {};
  for (int d0 = 0; d0 < dim; d0 += kRotateDims) {
    const int width = dim - d0 < kRotateDims ? dim - d0 : kRotateDims;
    __syncthreads();  // the previous tiles are read
    for (int e = threadIdx.x; e < kRotateQueries * kRotateDims; e += kRotateThreads) {
      const int k = e / kRotateDims, d = e % kRotateDims;
      staged[k][d] = k < count && d < width
                         ? int4_rotation_input(static_cast<float>(queries[(first + k) * dim + d0 + d]),
                                               centre[d0 + d], metric)
                         : 0.0f;
    }
    __syncthreads();
    if (i < dim) {
      for (int c = 0; c < width; c += kInt4RotationChunk) {
        const int chunk_end = std::min(width, c + kInt4RotationChunk);
        float sum[kRotateQueries] = {};
        for (int d = c; d < chunk_end; ++d) {
          const float r = grid[static_cast<int64_t>(d0 + d) * dim + i];
#pragma unroll
          for (int k = 0; k < kRotateQueries; ++k) sum[k] = int4_rotation_step(sum[k], r, staged[k][d]);
        }
#pragma unroll
        for (int k = 0; k < kRotateQueries; ++k) acc[k] += sum[k];
      }
    }
    if (!has_cells) continue;
    for (int t0 = 0; t0 < width; t0 += kCellTileDims) {  // a tile is a chunk
      const int tile_width = width - t0 < kCellTileDims ? width - t0 : kCellTileDims;
      __syncthreads();  // the previous tile is read
      for (int o = warp; o < kRotateThreads; o += kRotateThreads / kWarpSize) {
        const int cell = first_output + o - dim;
        const int d = d0 + t0 + lane;
        tile[lane][o] = cell >= 0 && cell < cells && lane < tile_width
                            ? int4_cell_offset(centre[static_cast<int64_t>(cell) * dim + d], centre[d], metric)
                            : 0.0f;
      }
      __syncthreads();
      if (i >= dim && i < outputs) {
        float sum[kRotateQueries] = {};
        for (int d = 0; d < tile_width; ++d) {
          const float w = tile[d][threadIdx.x];
#pragma unroll
          for (int k = 0; k < kRotateQueries; ++k) sum[k] = int4_rotation_step(sum[k], w, staged[k][t0 + d]);
        }
#pragma unroll
        for (int k = 0; k < kRotateQueries; ++k) acc[k] += sum[k];
      }
    }
  }
  if (i < outputs) {
#pragma unroll
    for (int k = 0; k < kRotateQueries; ++k) {
      if (k < count) out[(first + k) * outputs + i] = acc[k];
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kChunkWarps * kWarpSize)
    rotate_query_chunks_kernel(const T* __restrict__ queries, int dim, int cells, const float* __restrict__ grid,
                               Metric metric, float* __restrict__ out) {
  __shared__ float sums[kChunkWarps][kWarpSize];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t q = blockIdx.x;
  const int outputs = dim + cells;
  const int o = static_cast<int>(blockIdx.y) * kWarpSize + lane;  // this lane's output
  const float* centre = grid + static_cast<int64_t>(dim) * dim;   // c_0, then the other cells
  const T* query = queries + q * dim;
  const int chunks = (dim + kInt4RotationChunk - 1) / kInt4RotationChunk;
  float acc = 0.0f;  // warp 0's
  for (int round = 0; round < chunks; round += kChunkWarps) {
    const int c = round + warp;
    if (c < chunks) {  // warp-uniform
      const int first = c * kInt4RotationChunk;
      const int width = dim - first < kInt4RotationChunk ? dim - first : kInt4RotationChunk;
      // Lane l holds dimension first + l of c_0 and of u; the products take them by shuffles.
      const float c0 = lane < width ? centre[first + lane] : 0.0f;
      const float u = lane < width ? int4_rotation_input(static_cast<float>(query[first + lane]), c0, metric) : 0.0f;
      float w[kInt4RotationChunk];
#pragma unroll
      for (int d = 0; d < kInt4RotationChunk; ++d) {
        w[d] = 0.0f;
        if (d < width && o < outputs) {
          w[d] = o < dim ? grid[static_cast<int64_t>(first + d) * dim + o]
                         : centre[static_cast<int64_t>(o - dim) * dim + first + d];
        }
      }
      float sum = 0.0f;
#pragma unroll
      for (int d = 0; d < kInt4RotationChunk; ++d) {
        const float ud = __shfl_sync(kFullMask, u, d);
        const float cd = __shfl_sync(kFullMask, c0, d);
        if (d < width) sum = int4_rotation_step(sum, o < dim ? w[d] : int4_cell_offset(w[d], cd, metric), ud);
      }
      sums[warp][lane] = sum;
    }
    __syncthreads();
    if (warp == 0) {
      for (int k = 0; k < kChunkWarps && round + k < chunks; ++k) acc += sums[k][lane];
    }
    __syncthreads();  // the sums are read before the next round writes them
  }
  if (warp == 0 && o < outputs) out[q * outputs + o] = acc;
}

// Batches below this many queries take rotate_query_chunks_kernel.
constexpr int64_t kRotateOneQueryBelow = 64;

template <typename T>
at::Tensor rotate_queries(const at::Tensor& q, const at::Tensor& grid, Metric metric, cudaStream_t stream) {
  const int64_t nq = q.size(0);
  const int dim = static_cast<int>(q.size(1));
  const int cells = static_cast<int>(grid.size(0)) - dim;
  at::Tensor out = at::empty({nq, dim + cells}, q.options().dtype(at::kFloat));
  if (nq < kRotateOneQueryBelow) {
    const unsigned column_blocks = static_cast<unsigned>((dim + cells + kWarpSize - 1) / kWarpSize);
    rotate_query_chunks_kernel<T><<<dim3(static_cast<unsigned>(nq), column_blocks), kChunkWarps * kWarpSize, 0,
                                    stream>>>(q.data_ptr<T>(), dim, cells, grid.data_ptr<float>(), metric,
                                              out.data_ptr<float>());
  } else {
    const unsigned column_blocks = static_cast<unsigned>((dim + cells + kRotateThreads - 1) / kRotateThreads);
    rotate_queries_kernel<T>
        <<<dim3(static_cast<unsigned>((nq + kRotateQueries - 1) / kRotateQueries), column_blocks), kRotateThreads,
           0, stream>>>(q.data_ptr<T>(), nq, dim, cells, grid.data_ptr<float>(), metric, out.data_ptr<float>());
  }
  check_launch();
  return out;
}

// How a call's searches are laid out, from the shapes and settings alone: the SearchArgs sizes
// (searches a query, lists, caps, the loop, the visited hash; the code rows' pointers), the block
// size, the shared memory and the lanes a row takes. run_search adds the pointers of the tensors
// it makes.
struct SearchPlan {
  SearchArgs a{};
  int threads = 0;
  size_t smem = 0;
  int team = 0;
};

SearchPlan plan_search(const at::Tensor& data, const at::Tensor& graph, const at::Tensor& queries, bool filtered,
                       const SearchCodes& codes, const SearchParams& p, int64_t row_bytes) {
  const int64_t n = data.size(0), nq = queries.size(0), degree = graph.size(1);
  TORCH_CHECK_VALUE(nq <= std::numeric_limits<int32_t>::max(), "queries: expected fewer than 2^31 rows, got ", nq);
  int device = queries.device().index(), optin = 0, sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  SearchPlan plan;
  SearchArgs& a = plan.a;
  if (codes.codes.defined()) {
    a.codes = codes.codes.data_ptr<uint8_t>();
    a.code_grid = codes.grid.data_ptr<float>();
    a.code_stride = codes.codes.size(1);
    a.code_dims = static_cast<int>(code_dims(data.size(1), codes.kind));
    a.code_bytes = static_cast<int>(code_bytes(data.size(1), codes.kind));
    a.code_cells = codes.kind == CodeKind::kInt4 ? static_cast<int>(codes.grid.size(0) - data.size(1)) : 0;
  }
  a.seed = p.seed;
  a.metric = p.metric;
  a.n = static_cast<int>(n);
  a.dim = static_cast<int>(data.size(1));
  a.degree = static_cast<int>(degree);
  a.k = p.k;
  a.searches = p.searches > 0 ? p.searches : searches_for_batch(nq, sms, p.k, p.list_size);
  TORCH_CHECK_VALUE(nq * a.searches <= std::numeric_limits<int32_t>::max(), "queries * searches: expected fewer ",
                    "than 2^31 searches per call, got ", nq, " * ", a.searches);
  a.list_size = list_per_search(p.list_size, p.k, a.searches);
  a.list_cap = next_pow2(a.list_size);
  const int width = resolve_search_width(p.search_width, /*on_gpu=*/true, degree, a.list_size);
  TORCH_CHECK_VALUE(width <= kMaxSearchWidth, "search_width: expected <= ", kMaxSearchWidth);
  const int64_t per_round = static_cast<int64_t>(width) * degree;
  TORCH_CHECK_VALUE(per_round <= (1 << 16), "search_width * graph degree: the CUDA search expands at most 65536 ",
                    "neighbours per iteration, got ", width, " * ", degree);
  // With codes a filtered search keeps as many allowed entries as the list for the re-rank.
  a.kept = a.codes != nullptr ? std::max(p.k, a.list_size) : p.k;
  a.result_cap = filtered ? next_pow2(a.kept) : 0;
  a.cand_cap = std::max(a.list_cap, next_pow2(static_cast<int>(per_round)));
  a.search_width = width;
  a.max_iters = p.max_iters;
  // Rounds wider than two slots a lane take the warp loop only when the blocks are many. With few
  // blocks per SM, warp 0's serial expansion, sort and merge are the chain a search waits on, and
  // the block loop (every thread expanding and loading rows, only the candidates that can enter
  // the list sorted) is faster. Search kernel time on one H200 (1M x 384 normalised clustered
  // float16 rows, int4 codes, list 32; one-off runs with the choices forced, script not kept;
  // benchmarks/README.md has the committed before/after): a batch of 1 (32 blocks of 512
  // threads) 159 us in the warp loop against 131 us in the block loop, before that loop sorted
  // only the entering candidates; with it, a batch of 10 (320 blocks of 256) 218 against 120 us,
  // while a batch of 1 000 (1 000 blocks) took 304 us in the warp loop (128 threads) against
  // 402 us in the block loop (256).
  const int64_t blocks = nq * a.searches;
  const bool warp_fits = !filtered && a.list_cap <= kMaxWarpRows * kWarpSize &&
                         per_round <= kMaxWarpCandRows * kWarpSize &&
                         (per_round <= kAnyBatchCandRows * kWarpSize || blocks >= kLatencyBoundBlocksPerSm * sms);
  // Two rows at least: a one-row variant spilled registers (ptxas, sm_90) and would add a kernel
  // per storage type and team for lists of at most 32.
  a.warp_rows = warp_fits ? std::max(2, a.list_cap / kWarpSize) : 0;  // list_cap is a power of two
  a.entries = static_cast<int>(std::min<int64_t>(a.list_size, n));

  // Visited hash: must hold list + results + one round at load <= 1/2 (the no-duplicate
  // argument at the top); 4x that, at least 2048 slots, so resets (which forget visited nodes
  // and cost recomputed distances) stay rare. Falls back to the 2x minimum if shared memory is short.
  const size_t limit = static_cast<size_t>(optin) - kStaticShared;
  const int64_t must_hold = static_cast<int64_t>(a.list_size) + (filtered ? a.kept : 0) + per_round;
  a.hash_bits = log2_of(std::max<int64_t>(4 * must_hold, 2048));
  if (shared_bytes(a, a.hash_bits) > limit) a.hash_bits = log2_of(2 * must_hold);
  plan.smem = shared_bytes(a, a.hash_bits);
  TORCH_CHECK_VALUE(plan.smem <= limit, "search: list_size ", a.list_size, ", search_width ", width,
                    " and graph degree ", degree, " need ", plan.smem, " bytes of shared memory per query on the GPU, ",
                    "which has ", limit, "; lower list_size or search_width");

  plan.threads = pick_threads(blocks, sms, a.list_cap, per_round);
  // The team fits the rows the traversal reads: the codes where there are codes.
  plan.team = a.codes != nullptr ? code_team(a.code_bytes) : team_for_row(row_bytes);
  return plan;
}

// Runs the search of every query (checked, parsed arguments); with `counts` defined, also adds
// up the distances each query computed there.
std::tuple<at::Tensor, at::Tensor> run_search(const at::Tensor& data, const at::Tensor& graph,
                                              const at::Tensor& queries, const c10::optional<at::Tensor>& filter,
                                              const SearchCodes& codes, const SearchParams& p,
                                              const at::Tensor& counts) {
  // The search runs on the queries' GPU; the data rows may also lie in pinned host memory there
  // (check_search_data_device), read by the kernel row by row through unified addressing.
  const c10::cuda::CUDAGuard guard(queries.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(queries.device().index()).stream();

  // Cosine: only the queries are normalised; the data rows' norms are folded into the distance
  // (team_cosine), so no [N, D] copy is made per call.
  const at::Tensor x = prepare_vectors(data, p.metric == Metric::kCosine ? Metric::kL2 : p.metric);
  // Host rows are read where they lie: a narrowed (float64) or realigned copy would be pageable.
  TORCH_CHECK_VALUE(x.is_cuda() || x.data_ptr() == data.data_ptr(), "data: host rows searched from a GPU must be ",
                    "float32, float16 or bfloat16, contiguous and 16-byte aligned, got ", data.scalar_type(),
                    " with strides ", data.strides());
  const void* rows = x.is_cuda() ? x.data_ptr() : device_address_of_host_rows(x);
  const at::Tensor q = prepare_vectors(queries.to(x.scalar_type()), p.metric);
  const at::Tensor g = graph.contiguous();
  const at::Tensor allowed = filter.has_value() ? filter->contiguous() : at::Tensor();
  const QueryCheck query_check(queries, stream);

  SearchPlan plan = plan_search(data, graph, queries, filter.has_value(), codes, p,
                                x.size(1) * static_cast<int64_t>(x.element_size()));
  SearchArgs& a = plan.a;
  const int64_t n = data.size(0), nq = queries.size(0);
  a.graph = g.data_ptr<int32_t>();
  a.counts = counts.defined() ? counts.data_ptr<int32_t>() : nullptr;
  a.allowed = filter.has_value() ? allowed.data_ptr<bool>() : nullptr;
  // Cosine rows are not normalised here (team_cosine divides by their norms).
  const int per_search = hub_entries_for_list(p.hub_entries, a.entries);
  const at::Tensor hub_table = hub_entries(x, q, p.metric, /*x_normalised=*/false, per_search * a.searches);
  a.hubs = hub_entries_view(hub_table, per_search, a.searches);
  // The hub distances of the entry points count too (one matrix product row per query).
  if (counts.defined() && a.hubs.columns > 0) counts.add_(static_cast<int32_t>(hub_count(n)));

  at::Tensor out_dists = at::empty({nq, p.k}, queries.options().dtype(at::kFloat));
  at::Tensor out_ids = at::empty({nq, p.k}, queries.options().dtype(at::kLong));
  if (nq == 0) return {out_dists, out_ids};  // an empty grid is no valid launch
  // Split queries write each search's k best to a workspace the merge reads.
  const at::Tensor part_dists = a.searches > 1 ? at::empty({nq * a.searches, p.k}, out_dists.options()) : out_dists;
  const at::Tensor part_ids = a.searches > 1 ? at::empty({nq * a.searches, p.k}, out_ids.options()) : out_ids;
  a.out_dists = part_dists.data_ptr<float>();
  a.out_ids = part_ids.data_ptr<int64_t>();

  const int threads = plan.threads, team = plan.team;
  const size_t smem = plan.smem;
  at::Tensor rotated;  // int4: the rotated queries and their cell dots
  GRNND_DISPATCH_STORAGE(x.scalar_type(), "search_cuda", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "search_cuda: float64 storage should have been narrowed by prepare_vectors");
    } else {
      const auto* x_rows = static_cast<const scalar_t*>(rows);
      const auto launch_for = [&](auto code) {
        constexpr int kCode = decltype(code)::value;
        switch (team) {
          case 4: launch<scalar_t, 4, kCode>(x_rows, q, a, threads, smem, stream); break;
          case 8: launch<scalar_t, 8, kCode>(x_rows, q, a, threads, smem, stream); break;
          case 16: launch<scalar_t, 16, kCode>(x_rows, q, a, threads, smem, stream); break;
          default: launch<scalar_t, 32, kCode>(x_rows, q, a, threads, smem, stream); break;
        }
      };
      if (a.codes == nullptr) {
        launch_for(std::integral_constant<int, kUncoded>{});
      } else if (codes.kind == CodeKind::kInt8) {
        launch_for(std::integral_constant<int, kCodedInt8>{});
      } else {
        // The rotated queries live until the search kernel, queued behind this, has read them
        // (the caching allocator reuses their block only for work queued later on the stream).
        rotated = rotate_queries<scalar_t>(q, codes.grid, a.metric, stream);
        a.rotated = rotated.data_ptr<float>();
        launch_for(std::integral_constant<int, kCodedInt4>{});
      }
    }
  });
  if (a.searches > 1) {
    const int per_query = a.searches * p.k;  // <= kMaxMergeKeys (params.h)
    const size_t merge_smem = (sizeof(float) + sizeof(uint32_t)) * static_cast<size_t>(per_query);
    merge_searches_kernel<<<static_cast<unsigned>(nq), kWarpSize, merge_smem, stream>>>(
        part_dists.data_ptr<float>(), part_ids.data_ptr<int64_t>(), a.searches, p.k, out_dists.data_ptr<float>(),
        out_ids.data_ptr<int64_t>());
    check_launch();
  }
  query_check.finish();
  return {out_dists, out_ids};
}

// The checks that read tensor contents (finite queries, graph ids in range) synchronise the host
// once per call and are skipped under CUDA-graph capture (contents_readable); the kernel skips
// out-of-range graph ids and orders NaN distances last either way, so no input reads out of bounds.
std::tuple<at::Tensor, at::Tensor> search_cuda(const at::Tensor& data, const at::Tensor& graph,
                                               const at::Tensor& queries, int64_t k, int64_t list_size,
                                               int64_t search_width, int64_t max_iters, c10::string_view metric,
                                               int64_t seed, const c10::optional<at::Tensor>& filter,
                                               int64_t searches, int64_t hub_entries,
                                               const c10::optional<at::Tensor>& codes,
                                               const c10::optional<at::Tensor>& code_grid) {
  check_search_inputs(data, graph, queries, k, filter);
  const SearchParams p =
      make_search_params(k, list_size, search_width, max_iters, std::string(metric), seed, searches, hub_entries);
  const SearchCodes search_codes = check_search_codes(codes, code_grid, data, queries, p.metric);
  check_search_contents(data, graph, queries);
  return run_search(data, graph, queries, filter, search_codes, p, at::Tensor());
}

at::Tensor search_distance_counts_cuda(const at::Tensor& data, const at::Tensor& graph, const at::Tensor& queries,
                                       int64_t k, int64_t list_size, int64_t search_width, int64_t max_iters,
                                       c10::string_view metric, int64_t seed,
                                       const c10::optional<at::Tensor>& filter, int64_t searches,
                                       int64_t hub_entries, const c10::optional<at::Tensor>& codes,
                                       const c10::optional<at::Tensor>& code_grid) {
  check_search_inputs(data, graph, queries, k, filter);
  const SearchParams p =
      make_search_params(k, list_size, search_width, max_iters, std::string(metric), seed, searches, hub_entries);
  const SearchCodes search_codes = check_search_codes(codes, code_grid, data, queries, p.metric);
  check_search_contents(data, graph, queries);
  at::Tensor counts = at::zeros({queries.size(0)}, queries.options().dtype(at::kInt));
  run_search(data, graph, queries, filter, search_codes, p, counts);
  return counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(grnnd, CUDA, m) {
  m.impl("search", &search_cuda);
  m.impl("search_distance_counts", &search_distance_counts_cuda);
}

}  // namespace cuda
}  // namespace grnnd
