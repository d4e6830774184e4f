// Warp- and block-level reductions and scans on shuffles and shared memory, for 1-D blocks whose
// size is a multiple of 32 (at most 1024). Written for both builds (nvcc and the emulator); no CUB,
// no cooperative groups. Every function here is a collective: all threads of the block (or all
// 32 lanes of the warp) must call it at the same place.
#pragma once
#include <cstdint>

#include "kernels/cuda/cuda_compat.h"

namespace dq::cuda {

struct SumOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a < b ? b : a;
  }
};
struct MinOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return b < a ? b : a;
  }
};

// Sum over the Width lanes of each aligned segment in lane order, starting from +0:
// ((0 + v[0]) + v[1]) + ... + v[Width-1]. Every lane of the segment gets the same bits, which
// are those of the sequential loop on the host (the order the statistics must keep).
template <int Width>
__device__ __forceinline__ float segment_ordered_sum(float v) {
  float s = 0.0f;
  DQ_UNROLL
  for (int k = 0; k < Width; ++k) s += __shfl_sync(kFullMask, v, k, Width);
  return s;
}

// op over the 32 lanes (butterfly): every lane gets it. For associative, commutative ops whose
// result does not depend on order (integers, max, min); never for a float sum that must match
// the host's bits.
template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
  DQ_UNROLL
  for (int offset = kWarp / 2; offset > 0; offset >>= 1)
    v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Inclusive prefix op over the lanes in lane order.
template <class T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = static_cast<int>(threadIdx.x) & (kWarp - 1);
  DQ_UNROLL
  for (int d = 1; d < kWarp; d <<= 1) {
    const T up = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

// op over every thread of the block: within each warp by warp_reduce, then over the warps in
// warp order by thread 0. Every thread gets the result. `scratch`: shared memory of at least
// kWarp + 1 elements, free again when this returns (it ends with a barrier).
template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T* scratch) {
  const int lane = static_cast<int>(threadIdx.x) & (kWarp - 1);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int n_warps = static_cast<int>(blockDim.x) / kWarp;
  v = warp_reduce(v, op);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    T r = scratch[0];
    for (int i = 1; i < n_warps; ++i) r = op(r, scratch[i]);
    scratch[kWarp] = r;
  }
  __syncthreads();
  const T result = scratch[kWarp];
  __syncthreads();
  return result;
}

// Exclusive prefix sum over the block in threadIdx.x order (integers); *total, when not null,
// gets the whole block's sum in every thread. `scratch`: shared memory of at least kWarp + 1
// elements, free again when this returns.
template <class T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* scratch, T* total) {
  const int lane = static_cast<int>(threadIdx.x) & (kWarp - 1);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int n_warps = static_cast<int>(blockDim.x) / kWarp;
  const T inclusive = warp_inclusive_scan(v);
  if (lane == kWarp - 1) scratch[warp] = inclusive;
  __syncthreads();
  if (threadIdx.x == 0) {
    T running = T(0);
    for (int i = 0; i < n_warps; ++i) {
      const T w = scratch[i];
      scratch[i] = running;
      running += w;
    }
    scratch[kWarp] = running;
  }
  __syncthreads();
  const T result = scratch[warp] + (inclusive - v);
  if (total) *total = scratch[kWarp];
  __syncthreads();
  return result;
}

// Copies n bytes of global memory at src (any alignment) into the shared buffer `stage` (16-byte
// aligned, at least n + 15 bytes) at src's offset modulo 16: the aligned middle moves in 16-byte
// vector loads and stores, the unaligned head and tail byte by byte, every byte read once.
// Returns where the copy starts in `stage`. The `size` threads ranked 0 .. size-1 (`rank`: this
// thread's) share the copy and call it with the same arguments; put a barrier between it and
// any read of the copy.
__device__ __forceinline__ const uint8_t* group_copy_to_shared(const uint8_t* src, int n,
                                                               uint4* stage, int rank, int size) {
  const int misalign = static_cast<int>(reinterpret_cast<uintptr_t>(src) & 15u);
  uint8_t* dst = reinterpret_cast<uint8_t*>(stage) + misalign;
  int head = (16 - misalign) & 15;
  if (head > n) head = n;
  const int vectors = (n - head) / 16;
  DQ_NO_UNROLL  // the head and tail: at most 15 bytes each
      for (int b = rank; b < head; b += size) dst[b] = load_global(src + b);
  const uint4* from = reinterpret_cast<const uint4*>(src + head);
  uint4* to = reinterpret_cast<uint4*>(dst + head);
  DQ_UNROLL_2  // two 16-byte loads in flight a thread, no more: registers
      for (int v = rank; v < vectors; v += size) to[v] = load_global(from + v);
  DQ_NO_UNROLL
  for (int b = head + 16 * vectors + rank; b < n; b += size) dst[b] = load_global(src + b);
  return dst;
}

// group_copy_to_shared() by the whole (1-D) block.
__device__ __forceinline__ const uint8_t* block_copy_to_shared(const uint8_t* src, int n,
                                                               uint4* stage) {
  return group_copy_to_shared(src, n, stage, static_cast<int>(threadIdx.x),
                              static_cast<int>(blockDim.x));
}

}  // namespace dq::cuda
