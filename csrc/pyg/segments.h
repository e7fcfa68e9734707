// Examples stored back to back, PyTorch Geometric's batching: the rows of example b are
// ptr[b] .. ptr[b + 1]. Host and device code alike may locate an example's rows with it.
#pragma once

#include <cstdint>

#include <c10/macros/Macros.h>

namespace grnnd {

struct SegmentRange {
  int64_t begin, end;
};

// The rows of `example`, clamped to [0, rows]; none for an example outside [0, examples). No
// value of ptr or example makes a kernel read outside the data.
C10_HOST_DEVICE inline SegmentRange segment_range(const int64_t* ptr, int64_t examples, int64_t rows,
                                                   int64_t example) {
  if (example < 0 || example >= examples) return {0, 0};
  int64_t begin = ptr[example], end = ptr[example + 1];
  begin = begin < 0 ? 0 : (begin > rows ? rows : begin);
  end = end < begin ? begin : (end > rows ? rows : end);
  return {begin, end};
}

// The rows of `example` when x's examples are given by a sorted batch vector (batch_x [rows],
// PyG's form) instead of ptr: from its first row of `example` to its first row of example + 1,
// found by binary search. An example outside [0, examples), or with no row, has none.
// What lets a kernel take batch_x as it comes, with no ptr made before it (one launch and the
// host time of two torch calls fewer: knn_segments_cuda.cu). An unsorted batch_x gives ranges
// inside [0, rows), never a read outside them.
C10_HOST_DEVICE inline int64_t first_row_at_least(const int64_t* batch_x, int64_t rows, int64_t example) {
  int64_t low = 0, high = rows;
  while (low < high) {
    const int64_t mid = low + (high - low) / 2;
    if (batch_x[mid] < example) {
      low = mid + 1;
    } else {
      high = mid;
    }
  }
  return low;
}

C10_HOST_DEVICE inline SegmentRange segment_range_in_batch(const int64_t* batch_x, int64_t rows, int64_t examples,
                                                            int64_t example) {
  if (example < 0 || example >= examples) return {0, 0};
  const int64_t begin = first_row_at_least(batch_x, rows, example);
  const int64_t end = first_row_at_least(batch_x, rows, example + 1);
  return {begin, end < begin ? begin : end};
}

// The exact CPU kernels' best k of a query (and the CPU's nearest hubs, csrc/build/hubs.cpp),
// ascending by (distance, row): (d, row) goes in if it comes before the k-th, entries after it
// move up one slot. Candidates in row order then keep the lower row of a tie, and candidates in
// any other order end the same. Empty slots are
// (+inf, -1): every finite distance goes before them, an infinite one never does.
C10_HOST_DEVICE inline void insert_nearest(float* best_d, int64_t* best_i, int64_t k, float d, int64_t row) {
  const auto before = [&](int64_t p) { return d < best_d[p] || (d == best_d[p] && row < best_i[p]); };
  if (!before(k - 1)) return;
  int64_t p = k - 1;
  for (; p > 0 && before(p - 1); --p) {
    best_d[p] = best_d[p - 1];
    best_i[p] = best_i[p - 1];
  }
  best_d[p] = d;
  best_i[p] = row;
}

// Which entries of knn_segments' results [queries, k] become edges (the segment_edges op): a
// found row (id >= 0), nearer than max_distance when there is one (radius), and not the query's
// own row when drop_self (a graph of x with itself, without loops).
struct EdgeFilter {
  float max_distance;
  bool has_max_distance, drop_self;
  int64_t most;  // entries a row keeps at most, the first ones the filter keeps

  C10_HOST_DEVICE bool keep(int64_t query, int64_t id, float dist) const {
    return id >= 0 && (!has_max_distance || dist < max_distance) && !(drop_self && id == query);
  }
};

// The CPU kernels' distance: (q - r)^2 summed in dimension order, each square added in one
// fused multiply-add, as the CUDA kernels' add_square rounds it (vectors_cuda.cuh). Defined in
// segments.cpp, where x86 builds get a clone for CPUs with FMA instructions (the baseline
// build has none, and std::fma without them is a library call per dimension).
float ordered_squared_l2(const float* q, const float* r, int64_t dim);

}  // namespace grnnd
