// Host code shared by the CPU and CUDA twins of prune_rows and the builds (prune.h).
#include "prune.h"

namespace grnnd {

at::Tensor inner_product_lift(const at::Tensor& x, Metric metric) {
  if (!lifts_inner_product(metric)) return at::Tensor();
  // Norms reduced in float32 straight from the storage type, without a float32 copy of the data.
  const at::Tensor sq_norms = at::linalg_vector_norm(x, 2, {1}, false, at::kFloat).pow_(2);
  if (sq_norms.numel() == 0) return sq_norms;
  return (sq_norms.max() - sq_norms).clamp_min(0).sqrt().contiguous();
}

}  // namespace grnnd
