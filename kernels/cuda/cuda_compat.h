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
#define DQ_NO_UNROLL _Pragma("unroll 1")
#define DQ_UNROLL_2 _Pragma("unroll 2")
#else
#include "kernels/cuda/emu/emu.h"
#define DQ_CUDA_EMULATED 1
#define DQ_UNROLL
#define DQ_NO_UNROLL
#define DQ_UNROLL_2
#endif

namespace dq::cuda {
// Warp width as a constant expression (nvcc's warpSize is not one).
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// In a kernel's error/flags word: the lane had failed before the step, so its kernels write
// nothing. No kernel raises it for a failure of its own. The caller arms the word as the step
// starts: 0, or kSkipFlag (with any other bits) when the lane failed before; the devices do it
// (when they make the step's StepWord, and the previous step's last kernel as it folds,
// step_fold.h), so a step launches no gate kernel of its own. Kernels that raise flags from several
// blocks test this bit, never "non-zero": a block must not skip because another block of the same
// launch raised a flag a moment earlier.
constexpr unsigned kSkipFlag = 0x80000000u;

// v, as a value the compiler must not assume unchanged from an earlier one. Arithmetic on values
// fixed for a whole loop (the 20 round keys Philox derives from the seed, say) is then redone
// where it is used instead of being hoisted out of the loop, where it would hold registers a busy
// loop must then spill to local memory. No instruction under nvcc; the value itself under the
// emulator.
__device__ __forceinline__ uint64_t opaque(uint64_t v) {
#if defined(__CUDA_ARCH__)
  asm volatile("" : "+l"(v));
#endif
  return v;
}
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
#if defined(__CUDA_ARCH__)
  asm volatile("" : "+r"(v));
#endif
  return v;
}

// Global-memory accesses of the kernels: plain (or, for uint4, 16-byte vector) loads and stores
// under nvcc; under the emulation they also add their bytes to the launch's traffic
// (dq::emu::last_counters().global_read / global_written), which tests hold against the least
// traffic a kernel needs. A T* must be aligned to sizeof(T), as CUDA requires.
template <class T>
__device__ __forceinline__ void count_global_load(const T* p) {  // the loads' emulator side
#if DQ_CUDA_EMULATED
  ::dq::emu::check_global_alignment(p, alignof(T));
  ::dq::emu::count_global_read(sizeof(T));
#else
  (void)p;
#endif
}
template <class T>
__device__ __forceinline__ T load_global(const T* p) {
  count_global_load(p);
  return *p;
}
template <class T>
__device__ __forceinline__ void store_global(T* p, T v) {
#if DQ_CUDA_EMULATED
  ::dq::emu::check_global_alignment(p, alignof(T));
  ::dq::emu::count_global_written(sizeof(T));
#endif
  *p = v;
}
// A word other threads, blocks or the host may change while the kernel runs (a step's flags
// word, a ticket count, the lane's error word), read as a relaxed atomic load. A plain read of it
// races with their writes in CUDA's memory model even where the bits tested never change during
// the launch (ThreadSanitizer, the emulator's TSan build, reports it), and a poll's plain load may
// be hoisted out of its loop. Under nvcc a volatile load, which PTX gives relaxed semantics at
// system scope (sm_70 on). Not counted in the traffic (load_global_relaxed() below is).
template <class T>
__device__ __forceinline__ T load_relaxed(const T* p) {
#if DQ_CUDA_EMULATED
  DQ_EMU_NOTE_ATOMIC_READ(p);
  return __atomic_load_n(p, __ATOMIC_RELAXED);
#else
  return *static_cast<const volatile T*>(p);
#endif
}
// load_relaxed(), counted in the traffic like load_global(): a word of a kernel's own data that
// other blocks update atomically while it runs (a ticket, the error word), or that it polls.
template <class T>
__device__ __forceinline__ T load_global_relaxed(const T* p) {
  count_global_load(p);
  return load_relaxed(p);
}
// Its write: a word another block polls (a volatile store under nvcc, relaxed at system scope).
template <class T>
__device__ __forceinline__ void store_relaxed(T* p, T v) {
#if DQ_CUDA_EMULATED
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
  DQ_EMU_NOTE_ATOMIC_WRITE(p);
#else
  *static_cast<volatile T*>(p) = v;
#endif
}
// Atomics on global memory, counted as one read and one write of the word.
#if DQ_CUDA_EMULATED
#define DQ_COUNT_ATOMIC(T)                 \
  ::dq::emu::count_global_read(sizeof(T)); \
  ::dq::emu::count_global_written(sizeof(T))
#else
#define DQ_COUNT_ATOMIC(T) (void)0
#endif
template <class T>
__device__ __forceinline__ T atomic_add_global(T* p, T v) {
  DQ_COUNT_ATOMIC(T);
  return atomicAdd(p, v);
}
template <class T>
__device__ __forceinline__ T atomic_max_global(T* p, T v) {
  DQ_COUNT_ATOMIC(T);
  return atomicMax(p, v);
}
template <class T>
__device__ __forceinline__ T atomic_or_global(T* p, T v) {
  DQ_COUNT_ATOMIC(T);
  return atomicOr(p, v);
}
#undef DQ_COUNT_ATOMIC

// Called by a thread whose poll of a word another block writes found it not ready yet (a wait
// for a block with a lower ticket). On a GPU a pause of about kPollPauseNs before the next poll,
// so the waiting blocks do not keep the word's cache line busy while the blocks they wait for
// update it (words next to it, in a StepWord). Under the emulation
// a fault (kDeadlock, naming the thread, the call site and the block order): blocks run one at a
// time and a thread runs until it reaches a barrier or a warp collective, so nothing can write
// the word while it polls; the block it waits for has not run, and a bounded poll would spin to its
// bound (seconds to minutes of CPU) before it gave up.
#if DQ_CUDA_EMULATED
inline void poll_missed(std::source_location loc = std::source_location::current()) {
  ::dq::emu::detail::poll_missed(loc);
}
#else
constexpr unsigned kPollPauseNs = 64;  // about a tenth of an L2 round trip's latency and more
__device__ __forceinline__ void poll_missed() {
  __nanosleep(kPollPauseNs);
}
#endif
}  // namespace dq::cuda

// A step's flags word and its fold by the step's own kernels (uses kSkipFlag).
#include "kernels/cuda/step_fold.h"  // IWYU pragma: export
