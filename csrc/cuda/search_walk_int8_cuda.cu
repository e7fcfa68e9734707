// The search kernels of the walk over 8-bit codes, in a unit of their own (search_walk_cuda.cuh).
#include "search_walk_cuda.cuh"

namespace grnnd {
namespace cuda {

GRNND_WALK_INSTANTIATIONS(, kCodedInt8)

}  // namespace cuda
}  // namespace grnnd
