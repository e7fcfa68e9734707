// The search kernels of the walk over 4-bit codes of the rotated rows, in a unit of their own (search_walk_cuda.cuh).
#include "search_walk_cuda.cuh"

namespace grnnd {
namespace cuda {

GRNND_WALK_INSTANTIATIONS(, kCodedInt4)

}  // namespace cuda
}  // namespace grnnd
