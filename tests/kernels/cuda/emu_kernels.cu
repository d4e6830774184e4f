// Self-test kernels of the CUDA emulation: each exercises one part of the execution model, or
// breaks one rule on purpose. The same file compiles with nvcc (the nvcc leg of the tests).
#include "tests/kernels/cuda/emu_kernels.h"

#include "kernels/cuda/block.cuh"

namespace dq::cuda::selftest {

__global__ void reduce_scan_kernel(const int* in, int* reduced, int* scanned, int* totals) {
  __shared__ int scratch[kWarp + 1];
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const int v = in[i];
  const int sum = block_reduce(v, SumOp{}, scratch);
  const int max = block_reduce(v, MaxOp{}, scratch);
  const int min = block_reduce(v, MinOp{}, scratch);
  int total = 0;
  scanned[i] = block_exclusive_scan(v, scratch, &total);
  if (threadIdx.x == 0) {
    reduced[3 * blockIdx.x] = sum;
    reduced[3 * blockIdx.x + 1] = max;
    reduced[3 * blockIdx.x + 2] = min;
    totals[blockIdx.x] = total;
  }
}

cudaError_t reduce_and_scan(const int* in, int blocks, int threads, int* reduced, int* scanned,
                            int* totals) {
  DQ_LAUNCH(reduce_scan_kernel, dim3(blocks), dim3(threads), 0, nullptr, in, reduced, scanned,
            totals);
  return cudaGetLastError();
}

__global__ void early_return_kernel(int arrive) {
  if (static_cast<int>(threadIdx.x) >= arrive) return;
  __syncthreads();
}

cudaError_t early_return(int threads, int arrive) {
  DQ_LAUNCH(early_return_kernel, dim3(1), dim3(threads), 0, nullptr, arrive);
  return cudaGetLastError();
}

__global__ void divergent_barrier_kernel(int* sink) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  if (sink) sink[threadIdx.x] = 1;
}

cudaError_t divergent_barrier(int threads) {
  DQ_LAUNCH(divergent_barrier_kernel, dim3(1), dim3(threads), 0, nullptr, nullptr);
  return cudaGetLastError();
}

__global__ void partial_warp_shuffle_kernel(int lanes, int* out) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  if (lane >= lanes) return;
  out[threadIdx.x] = __shfl_sync(kFullMask, static_cast<int>(threadIdx.x), 0);
}

cudaError_t partial_warp_shuffle(int threads, int lanes, int* out) {
  DQ_LAUNCH(partial_warp_shuffle_kernel, dim3(1), dim3(threads), 0, nullptr, lanes, out);
  return cudaGetLastError();
}

__global__ void read_unwritten_kernel(uint32_t* out_static, uint32_t* out_dynamic) {
  __shared__ uint32_t never_written[1024];
  DQ_DYNAMIC_SHARED(uint32_t, dynamic_words);
  const unsigned k = blockIdx.x * blockDim.x + threadIdx.x;  // each block its own words
  out_static[k] = never_written[threadIdx.x];
  out_dynamic[k] = dynamic_words[threadIdx.x];
}

cudaError_t read_unwritten_shared(int threads, uint32_t* out_static, uint32_t* out_dynamic) {
  DQ_LAUNCH(read_unwritten_kernel, dim3(2), dim3(threads), threads * sizeof(uint32_t), nullptr,
            out_static, out_dynamic);
  return cudaGetLastError();
}

__global__ void static_index_kernel(int index, int* out) {
  __shared__ int words[32];
  words[threadIdx.x] = static_cast<int>(threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) *out = words[index];
}

cudaError_t static_shared_index(int index, int* out) {
  DQ_LAUNCH(static_index_kernel, dim3(1), dim3(32), 0, nullptr, index, out);
  return cudaGetLastError();
}

__global__ void dynamic_index_kernel(int index, float* out) {
  DQ_DYNAMIC_SHARED(float, values);
  values[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) *out = values[index];
}

cudaError_t dynamic_shared_index(int index, float* out) {
  DQ_LAUNCH(dynamic_index_kernel, dim3(1), dim3(32), 32 * sizeof(float), nullptr, index, out);
  return cudaGetLastError();
}

__global__ void shuffles_kernel(int width, int src, int delta, int lane_mask, int* out) {
  const int t = static_cast<int>(threadIdx.x);
  const int v = 100 + t;
  out[4 * t] = __shfl_sync(kFullMask, v, src, width);
  out[4 * t + 1] = __shfl_up_sync(kFullMask, v, static_cast<unsigned>(delta), width);
  out[4 * t + 2] = __shfl_down_sync(kFullMask, v, static_cast<unsigned>(delta), width);
  out[4 * t + 3] = __shfl_xor_sync(kFullMask, v, lane_mask, width);
}

cudaError_t shuffles(int threads, int width, int src, int delta, int lane_mask, int* out) {
  DQ_LAUNCH(shuffles_kernel, dim3(1), dim3(threads), 0, nullptr, width, src, delta, lane_mask, out);
  return cudaGetLastError();
}

__global__ void votes_kernel(unsigned bits, unsigned mask, unsigned* out) {
  const unsigned lane = threadIdx.x % kWarp;
  if (!((mask >> lane) & 1u)) return;
  const int pred = static_cast<int>((bits >> lane) & 1u);
  out[3 * threadIdx.x] = __ballot_sync(mask, pred);
  out[3 * threadIdx.x + 1] = static_cast<unsigned>(__any_sync(mask, pred));
  out[3 * threadIdx.x + 2] = static_cast<unsigned>(__all_sync(mask, pred));
}

cudaError_t votes(unsigned bits, unsigned mask, unsigned* out) {
  DQ_LAUNCH(votes_kernel, dim3(1), dim3(kWarp), 0, nullptr, bits, mask, out);
  return cudaGetLastError();
}

__global__ void shuffle_lane_kernel(unsigned mask, int src, int* out) {
  const unsigned lane = threadIdx.x % kWarp;
  if (!((mask >> lane) & 1u)) return;
  out[threadIdx.x] = __shfl_sync(mask, static_cast<int>(lane) * 10, src);
}

cudaError_t shuffle_lane(unsigned mask, int src, int* out) {
  DQ_LAUNCH(shuffle_lane_kernel, dim3(1), dim3(kWarp), 0, nullptr, mask, src, out);
  return cudaGetLastError();
}

__global__ void mismatched_kernel(int* out) {
  if (threadIdx.x % 2 == 0)
    out[threadIdx.x] = __shfl_sync(kFullMask, 1, 0);
  else
    out[threadIdx.x] = static_cast<int>(__ballot_sync(kFullMask, 1));
}

cudaError_t mismatched_collectives(int* out) {
  DQ_LAUNCH(mismatched_kernel, dim3(1), dim3(kWarp), 0, nullptr, out);
  return cudaGetLastError();
}

__global__ void atomics_kernel(int* counter, float* fsum, int* max, unsigned* cas_counter) {
  const int id = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  atomicAdd(counter, 1);
  atomicAdd(fsum, 0.5f);
  atomicMax(max, id);
  // Not a plain read of the word first: other threads' atomics race with it (ThreadSanitizer
  // reports it); the first CAS returns what the word holds.
  unsigned seen = 0;
  for (;;) {
    const unsigned before = atomicCAS(cas_counter, seen, seen + 1u);
    if (before == seen) break;
    seen = before;
  }
}

cudaError_t atomics(int blocks, int threads, int* counter, float* fsum, int* max,
                    unsigned* cas_counter) {
  DQ_LAUNCH(atomics_kernel, dim3(blocks), dim3(threads), 0, nullptr, counter, fsum, max,
            cas_counter);
  return cudaGetLastError();
}

__global__ void indices_kernel(unsigned* out, unsigned* dims) {
  const unsigned block = blockIdx.y * gridDim.x + blockIdx.x;
  const unsigned thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  unsigned* o = out + 6 * (block * blockDim.x * blockDim.y * blockDim.z + thread);
  o[0] = threadIdx.x;
  o[1] = threadIdx.y;
  o[2] = threadIdx.z;
  o[3] = blockIdx.x;
  o[4] = blockIdx.y;
  o[5] = blockIdx.z;
  if (block == 0 && thread == 0) {
    dims[0] = blockDim.x;
    dims[1] = blockDim.y;
    dims[2] = blockDim.z;
    dims[3] = gridDim.x;
    dims[4] = gridDim.y;
    dims[5] = gridDim.z;
  }
}

cudaError_t indices(dim3 grid, dim3 block, unsigned* out, unsigned* dims) {
  DQ_LAUNCH(indices_kernel, grid, block, 0, nullptr, out, dims);
  return cudaGetLastError();
}

__global__ void barrier_loop_kernel(int iterations) {
  for (int i = 0; i < iterations; ++i) __syncthreads();
}

cudaError_t barrier_loop(int blocks, int threads, int iterations) {
  DQ_LAUNCH(barrier_loop_kernel, dim3(blocks), dim3(threads), 0, nullptr, iterations);
  return cudaGetLastError();
}

__global__ void shuffle_loop_kernel(int iterations, int* out) {
  // Unsigned: the sums wrap on purpose (signed overflow is undefined; UBSan reported it).
  unsigned v = threadIdx.x;
  for (int i = 0; i < iterations; ++i) v += __shfl_xor_sync(kFullMask, v, 1 + i % 31);
  out[blockIdx.x * blockDim.x + threadIdx.x] = static_cast<int>(v);
}

cudaError_t shuffle_loop(int blocks, int threads, int iterations, int* out) {
  DQ_LAUNCH(shuffle_loop_kernel, dim3(blocks), dim3(threads), 0, nullptr, iterations, out);
  return cudaGetLastError();
}

__global__ void configured_kernel() {}

cudaError_t configured(int threads, size_t shared) {
  DQ_LAUNCH(configured_kernel, dim3(1), dim3(threads), shared, nullptr);
  return cudaGetLastError();
}

cudaError_t load_configured() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, configured_kernel);
}

__global__ void copy_through_shared_kernel(const uint8_t* src, int n, uint8_t* dst) {
  __shared__ uint4 stage[(512 + 15 + 15) / 16];
  const uint8_t* copy = block_copy_to_shared(src, n, stage);
  __syncthreads();
  for (int b = static_cast<int>(threadIdx.x); b < n; b += static_cast<int>(blockDim.x))
    store_global(dst + b, copy[b]);
}

// Every thread loads (each is checked for alignment); one stores, since 32 stores of one word are a
// race even when they store the same value.
__global__ void vector_load_kernel(const uint8_t* src, uint4* out) {
  const uint4 v = load_global(reinterpret_cast<const uint4*>(src));
  if (threadIdx.x == 0) store_global(out, v);
}

cudaError_t vector_load(const uint8_t* src, uint4* out) {
  DQ_LAUNCH(vector_load_kernel, dim3(1), dim3(32), 0, nullptr, src, out);
  return cudaGetLastError();
}

cudaError_t copy_through_shared(const uint8_t* src, int n, uint8_t* dst, int threads) {
  DQ_LAUNCH(copy_through_shared_kernel, dim3(1), dim3(threads), 0, nullptr, src, n, dst);
  return cudaGetLastError();
}

__global__ void block_order_kernel(unsigned* taken, unsigned* ran) {
  if (threadIdx.x != 0) return;
  ran[atomicAdd(taken, 1u)] = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
}

cudaError_t block_order(dim3 grid, unsigned* taken, unsigned* ran) {
  DQ_LAUNCH(block_order_kernel, grid, dim3(32), 0, nullptr, taken, ran);
  return cudaGetLastError();
}

__global__ void hand_off_kernel(int by_ticket, int fences, unsigned* parts, unsigned* ticket,
                                unsigned* total) {
  if (threadIdx.x != 0) return;
  parts[blockIdx.x] = blockIdx.x + 1;
  if (fences & 1) __threadfence();  // this block's part before its ticket
  const bool last = by_ticket != 0 ? atomicAdd(ticket, 1u) + 1 == gridDim.x
                                   : blockIdx.x == gridDim.x - 1;  // the defect under test
  if (!last) return;
  if (fences & 2) __threadfence();  // the ticket before the others' parts
  unsigned sum = 0;
  for (unsigned b = 0; b < gridDim.x; ++b) sum += parts[b];
  *total = sum;
}

cudaError_t hand_off(int blocks, bool by_ticket, unsigned* parts, unsigned* ticket, unsigned* total,
                     int fences) {
  DQ_LAUNCH(hand_off_kernel, dim3(blocks), dim3(32), 0, nullptr, by_ticket ? 1 : 0, fences, parts,
            ticket, total);
  return cudaGetLastError();
}

__global__ void chain_kernel(int by_ticket, unsigned max_polls, unsigned* ticket, unsigned* done,
                             unsigned* timeouts) {
  if (threadIdx.x != 0) return;
  const unsigned k = by_ticket != 0 ? atomicAdd(ticket, 1u) : blockIdx.x;
  if (k > 0) {
    unsigned poll = 0;
    for (; load_relaxed(done + k - 1) == 0 && poll < max_polls; ++poll) poll_missed();
    if (poll == max_polls) atomicAdd(timeouts, 1u);  // the bounded wait gave up
  }
  __threadfence();
  store_relaxed(done + k, 1u);
}

// words[k] = value for k < n, one thread a word (one block).
__global__ void fill_words_kernel(unsigned* words, int n, unsigned value) {
  if (static_cast<int>(threadIdx.x) < n) words[threadIdx.x] = value;
}

cudaError_t fill_words(unsigned* words, int n, unsigned value) {
  DQ_LAUNCH(fill_words_kernel, dim3(1), dim3(kMaxRaceThreads), 0, nullptr, words, n, value);
  return cudaGetLastError();
}

// Thread 0 reads words[0 .. n) with relaxed atomic loads, no fence between, and writes their sum.
__global__ void relaxed_reads_kernel(const unsigned* words, int n, unsigned* sum) {
  if (threadIdx.x != 0) return;
  unsigned s = 0;
  for (int i = 0; i < n; ++i) s += load_relaxed(words + i);
  *sum = s;
}

cudaError_t relaxed_reads(const unsigned* words, int n, unsigned* sum) {
  DQ_LAUNCH(relaxed_reads_kernel, dim3(1), dim3(32), 0, nullptr, words, n, sum);
  return cudaGetLastError();
}

cudaError_t chain(int blocks, bool by_ticket, unsigned max_polls, unsigned* ticket, unsigned* done,
                  unsigned* timeouts) {
  DQ_LAUNCH(chain_kernel, dim3(blocks), dim3(32), 0, nullptr, by_ticket ? 1 : 0, max_polls, ticket,
            done, timeouts);
  return cudaGetLastError();
}

__global__ void thread_order_kernel(unsigned* taken, unsigned* ran) {
  const unsigned k = threadIdx.x, n = blockDim.x;
  ran[atomicAdd(&taken[0], 1u)] = k;  // the launch's first round
  __syncthreads();
  ran[n + atomicAdd(&taken[1], 1u)] = k;  // after a barrier
  __syncwarp();
  ran[2 * n + atomicAdd(&taken[2], 1u)] = k;  // after each warp's __syncwarp
}

cudaError_t thread_order(int threads, unsigned* taken, unsigned* ran) {
  DQ_LAUNCH(thread_order_kernel, dim3(1), dim3(threads), 0, nullptr, taken, ran);
  return cudaGetLastError();
}

__global__ void neighbour_race_kernel(int with_barrier, unsigned* out) {
  __shared__ unsigned s[kMaxRaceThreads];
  const unsigned k = threadIdx.x, n = blockDim.x;
  s[k] = k;
  __syncthreads();
  s[k] = 100 + k;
  if (with_barrier != 0) __syncthreads();  // the same in every thread
  out[k] = s[(k + 1) % n];                 // without the barrier: a race with thread k + 1
}

cudaError_t neighbour_race(int threads, bool with_barrier, unsigned* out) {
  if (threads < 1 || threads > kMaxRaceThreads) return cudaErrorInvalidValue;
  DQ_LAUNCH(neighbour_race_kernel, dim3(1), dim3(threads), 0, nullptr, with_barrier ? 1 : 0, out);
  return cudaGetLastError();
}

// Each lane writes its shared word, then reads its neighbour's: ordered by a __syncwarp
// (ordering 1), or not (0), or only by a shuffle, which exchanges a value and orders no memory (2).
__global__ void warp_neighbour_kernel(int ordering, unsigned* out) {
  __shared__ unsigned s[kWarp];
  const unsigned lane = threadIdx.x;
  s[lane] = 100 + lane;
  unsigned partner = lane ^ 1u;
  if (ordering == 1) __syncwarp();
  if (ordering == 2) partner = __shfl_xor_sync(kFullMask, lane, 1);
  out[lane] = s[(lane + 1) % kWarp] + (partner ^ lane ^ 1u);  // (partner ^ lane ^ 1) is 0
}

cudaError_t warp_neighbour(int ordering, unsigned* out) {
  DQ_LAUNCH(warp_neighbour_kernel, dim3(1), dim3(kWarp), 0, nullptr, ordering, out);
  return cudaGetLastError();
}

}  // namespace dq::cuda::selftest
