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

}  // namespace grnnd
