// Warp-cooperative building blocks shared by the CUDA kernels (seed 000, section 3.4):
// lane prefixes for ballot compaction, a per-object warp lock, the farthest-entry max-reduce
// and the bounded-set insert of Algorithm 6 (WARP_INSERT).
//
// Every function here is called by all 32 lanes of a warp together, with warp-uniform
// arguments unless a parameter says otherwise.
#pragma once

#include <cstdint>

#include "vectors_cuda.cuh"

namespace grnnd {
namespace cuda {

// Bits of the lanes below this one: with __ballot_sync it gives each lane its slot in a
// compacted list (popc(mask & lanes_below)).
__device__ __forceinline__ unsigned lanes_below(int lane) { return (1u << lane) - 1u; }

// A spin lock per object (a pool, say) taken by a whole warp. Lane 0 takes it and the barrier
// hands it to the other lanes; correct under Volta+ independent thread scheduling because only
// lane 0 spins, and the rest of the warp waits at __syncwarp rather than in the spin loop.
// The fences make what the previous holder wrote visible here (acquire) and what this warp
// wrote visible to the next holder (release). A warp holds at most one lock at a time and does
// no waiting while it holds one, so warps cannot deadlock on these.
__device__ __forceinline__ void warp_lock(int* lock, int lane) {
  if (lane == 0) {
    while (atomicCAS(lock, 0, 1) != 0) __nanosleep(32);
    __threadfence();
  }
  __syncwarp();
}

__device__ __forceinline__ void warp_unlock(int* lock, int lane) {
  __syncwarp();
  if (lane == 0) {
    __threadfence();
    atomicExch(lock, 0);
  }
}

// Index of the largest value in values[0, count): the first one among equal maxima (as
// std::max_element picks), -1 for an empty range. Reads through L2 (__ldcg) because the
// values may have been written by another SM under a lock in this same kernel.
__device__ __forceinline__ int warp_argmax(const float* values, int count, int lane, float* max_out) {
  float best = 0.0f;
  int at = -1;
  for (int i = lane; i < count; i += kWarpSize) {
    const float d = __ldcg(values + i);
    if (at < 0 || d > best) {
      best = d;
      at = i;
    }
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(kFullMask, best, offset);
    const int other_at = __shfl_xor_sync(kFullMask, at, offset);
    if (other_at >= 0 && (at < 0 || other > best || (other == best && other_at < at))) {
      best = other;
      at = other_at;
    }
  }
  *max_out = best;
  return at;
}

// Algorithm 6 (WARP_INSERT) into a bounded set of (key, dist) entries in global memory:
// `keys[0, *count)` with `capacity` slots. Entries compare by `key & id_mask` (the other bits
// are flags the caller keeps in the key). Skip if present (ballot over the set), append if
// there is room, else replace the farthest entry (warp max-reduce) if the newcomer is closer.
// The caller holds the set's lock (warp_lock); only lane 0 writes, and the closing barrier
// orders that write before the warp's next insert into the same set. Returns whether it stored.
__device__ __forceinline__ bool warp_insert_locked(uint32_t* keys, float* dists, int* count_ptr, int capacity,
                                                   uint32_t id_mask, uint32_t key, float dist, int lane) {
  const uint32_t id = key & id_mask;
  const int count = __ldcg(count_ptr);
  bool found = false;
  for (int i = lane; i < count; i += kWarpSize) found |= (__ldcg(keys + i) & id_mask) == id;
  if (__any_sync(kFullMask, found)) return false;
  bool stored = true;
  if (count < capacity) {
    if (lane == 0) {
      keys[count] = key;
      dists[count] = dist;
      *count_ptr = count + 1;
    }
  } else {
    float farthest;
    const int at = warp_argmax(dists, capacity, lane, &farthest);
    stored = dist < farthest;
    if (stored && lane == 0) {
      keys[at] = key;
      dists[at] = dist;
    }
  }
  __syncwarp();
  return stored;
}

// Ranks items 0..count-1 by a strict total order and writes order[rank] = item for every
// rank below `limit`: rank-by-counting, O(count^2 / 32) per lane, which for pools of at most
// kMaxPoolSize entries costs less than the distances the pool is sorted for and needs no
// scratch beyond `order`. `before(j, i)` says whether item j comes before item i; it must be a
// strict total order (break ties by index) so that every rank is taken exactly once.
template <typename Before>
__device__ __forceinline__ void warp_rank_sort(int count, int limit, int* order, int lane, const Before& before) {
  for (int i = lane; i < count; i += kWarpSize) {
    int rank = 0;
    for (int j = 0; j < count; ++j) rank += before(j, i) ? 1 : 0;
    if (rank < limit) order[rank] = i;
  }
  __syncwarp();
}

// Drops the negative entries of list[0, count) in place, keeping the order of the rest
// (ballot compaction); returns the new count.
__device__ __forceinline__ int warp_compact_nonnegative(int* list, int count, int lane) {
  int kept = 0;
  for (int base = 0; base < count; base += kWarpSize) {
    const int j = base + lane;
    const int value = j < count ? list[j] : -1;
    const unsigned mask = __ballot_sync(kFullMask, value >= 0);
    // Every lane has read its entry before any writes: a write lands at or below its reader.
    __syncwarp();
    if (value >= 0) list[kept + __popc(mask & lanes_below(lane))] = value;
    kept += __popc(mask);
  }
  __syncwarp();
  return kept;
}

}  // namespace cuda
}  // namespace grnnd
