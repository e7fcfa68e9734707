// The search kernels of the walk over the rows, in a unit of their own (search_walk_cuda.cuh).
#include "search_walk_cuda.cuh"

namespace grnnd {
namespace cuda {

GRNND_WALK_INSTANTIATIONS(, kUncoded)

}  // namespace cuda
}  // namespace grnnd
