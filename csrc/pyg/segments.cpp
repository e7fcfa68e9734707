#include "segments.h"

#include <cmath>

namespace grnnd {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// One copy for CPUs with FMA (chosen when the library loads) and the baseline copy for the rest.
__attribute__((target_clones("fma", "default")))
#endif
float ordered_squared_l2(const float* q, const float* r, int64_t dim) {
  float d = 0.f;
  for (int64_t j = 0; j < dim; ++j) {
    const float diff = q[j] - r[j];
    d = std::fma(diff, diff, d);
  }
  return d;
}

}  // namespace grnnd
