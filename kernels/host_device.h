// KEEL_HOST_DEVICE marks the small inline functions that the CPU reference and the CUDA kernels
// share, so both compute the same thing from one definition.
#pragma once

#if defined(__CUDACC__)
#define KEEL_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KEEL_HOST_DEVICE inline
#endif
