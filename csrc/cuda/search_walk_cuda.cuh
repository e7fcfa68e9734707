// The search kernels (the walk over the graph; the design is at the top of search_cuda.cu) and
// launch_walk, which picks and launches one of them. Each kind of walk (kUncoded, kCodedInt8,
// kCodedInt4) is compiled in a translation unit of its own, search_walk_{rows,int8,int4}_cuda.cu,
// so that a parallel build compiles them side by side: in one unit these kernels (4 loops x 4
// teams x 3 storage types a kind) were the extension's longest compile by far. search_cuda.cu,
// which plans a search, includes this header for SearchArgs and calls launch_walk without
// instantiating a kernel. nvcc keeps a kernel template's launch stub in the unit that
// instantiates it, so the kernels and their launches stay together in those units.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../core/checks.h"
#include "../core/codes.h"
#include "../build/hubs.h"
#include "../core/philox.h"
#include "detail/sort_cuda.cuh"
#include "detail/vectors_cuda.cuh"

namespace grnnd {
namespace cuda {

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
  int code_dims;           // codes per row, padded to a multiple of 16 (int8) or 32 (int4) (SearchCodes::dims)
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

// Launches the walk of every search of the queries q over the rows x: the kernel of a.warp_rows
// (0: the general loop) with `team` lanes a row, `threads` a block and `smem` bytes of dynamic
// shared memory.
template <typename T, int CODE>
void launch_walk(const T* x, const at::Tensor& q, const SearchArgs& a, int team, int threads, size_t smem,
                 cudaStream_t stream) {
  switch (team) {
    case 4: launch<T, 4, CODE>(x, q, a, threads, smem, stream); break;
    case 8: launch<T, 8, CODE>(x, q, a, threads, smem, stream); break;
    case 16: launch<T, 16, CODE>(x, q, a, threads, smem, stream); break;
    default: launch<T, 32, CODE>(x, q, a, threads, smem, stream); break;
  }
}

// launch_walk of one CODE for every storage type the search takes: declared (PREFIX extern) in
// every unit that includes this header, defined (PREFIX empty) in the unit of that CODE alone.
#define GRNND_WALK_INSTANTIATIONS(PREFIX, CODE)                                                                  \
  PREFIX template void launch_walk<float, CODE>(const float*, const at::Tensor&, const SearchArgs&, int, int,     \
                                                size_t, cudaStream_t);                                           \
  PREFIX template void launch_walk<at::Half, CODE>(const at::Half*, const at::Tensor&, const SearchArgs&, int,    \
                                                   int, size_t, cudaStream_t);                                   \
  PREFIX template void launch_walk<at::BFloat16, CODE>(const at::BFloat16*, const at::Tensor&, const SearchArgs&, \
                                                       int, int, size_t, cudaStream_t);

GRNND_WALK_INSTANTIATIONS(extern, kUncoded)
GRNND_WALK_INSTANTIATIONS(extern, kCodedInt8)
GRNND_WALK_INSTANTIATIONS(extern, kCodedInt4)

}  // namespace cuda
}  // namespace grnnd
