// CPU builds of torch ship the c10/cuda headers but not this generated one; the CUDA
// compile check only needs the macro a shared-library build of torch defines.
#define C10_CUDA_BUILD_SHARED_LIBS
