// The one header a kernel file includes: the CUDA runtime under nvcc, the CPU emulation of the
// execution model otherwise (kernels/cuda/EMULATION.md). Kernels launch only through DQ_LAUNCH
// and take dynamic shared memory only through DQ_DYNAMIC_SHARED, so one source serves both.
#pragma once
#if defined(__CUDACC__)
#include <cuda_runtime.h>

// kernel<<<grid, block, shmem, stream>>>(args...); check cudaGetLastError() afterwards.
#define DQ_LAUNCH(kernel, grid, block, shmem, stream, ...) \
  kernel<<<(grid), (block), (shmem), (stream)>>>(__VA_ARGS__)
// The launch's dynamic shared memory as a T*, 16-byte aligned.
#define DQ_DYNAMIC_SHARED(T, name)                                    \
  extern __shared__ __align__(16) unsigned char dq_dynamic_shared_[]; \
  T* name = reinterpret_cast<T*>(dq_dynamic_shared_)
#define DQ_CUDA_EMULATED 0
#define DQ_UNROLL _Pragma("unroll")
#else
#include "kernels/cuda/emu/emu.h"
#define DQ_CUDA_EMULATED 1
#define DQ_UNROLL
#endif

namespace dq::cuda {
// Warp width as a constant expression (nvcc's warpSize is not one).
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// In a kernel's error/flags word: the word was already non-zero when the step's kernels were
// reached (the lane had failed before), so they write nothing. No kernel raises it for a failure
// of its own. The launch functions whose kernels raise flags from several blocks set it first (a
// one-thread gate kernel) and their kernels test this bit, never "non-zero": a block must not skip
// because another block of the same launch raised a flag a moment earlier.
constexpr unsigned kSkipFlag = 0x80000000u;
}  // namespace dq::cuda
