// Portability macro for arithmetic shared by the host implementation and the CUDA kernels.
#pragma once
#if defined(__CUDACC__)
#define DQ_HD __host__ __device__ __forceinline__
#else
#define DQ_HD inline __attribute__((always_inline))
#endif
