// Self-test kernels of the CUDA emulation (emu_kernels.cu): host launchers, each returning the
// launch's error. Under the emulator the pointers are host memory.
#pragma once
#include <cstdint>

#include "kernels/cuda/cuda_compat.h"

namespace dq::cuda::selftest {

// Per block of `threads`: reduced[3b] = sum, [3b+1] = max, [3b+2] = min of in[b*threads ..];
// scanned = exclusive prefix sums within each block; totals[b] = block sum from the scan.
cudaError_t reduce_and_scan(const int* in, int blocks, int threads, int* reduced, int* scanned,
                            int* totals);
// Threads >= `arrive` return before a __syncthreads the others wait at.
cudaError_t early_return(int threads, int arrive);
// Odd and even threads wait at two different __syncthreads (an if/else).
cudaError_t divergent_barrier(int threads);
// Lanes < `lanes` of every warp call a full-mask __shfl_sync; the others exit.
cudaError_t partial_warp_shuffle(int threads, int lanes, int* out);
// out_static[b * threads + t] / out_dynamic[...]: bits of static / dynamic shared memory never
// written, in thread t of block b (two blocks).
cudaError_t read_unwritten_shared(int threads, uint32_t* out_static, uint32_t* out_dynamic);
// Reads static shared int[32] at `index` (a bounds error when index >= 32).
cudaError_t static_shared_index(int index, int* out);
// Reads a dynamic shared float[32] (128 bytes) at `index`.
cudaError_t dynamic_shared_index(int index, float* out);
// Per thread of one block: out[4t..4t+3] = __shfl_sync(v, src), __shfl_up_sync(v, delta),
// __shfl_down_sync(v, delta), __shfl_xor_sync(v, lane_mask), all with `width`; v = 100 + t.
cudaError_t shuffles(int threads, int width, int src, int delta, int lane_mask, int* out);
// Per thread: out[3t..3t+2] = ballot, any, all of pred = (bits >> lane) & 1 over `mask` (only
// the lanes in `mask` call; the others skip).
cudaError_t votes(unsigned bits, unsigned mask, unsigned* out);
// Lanes of `mask` read lane `src` with __shfl_sync (an error when src is outside the mask).
cudaError_t shuffle_lane(unsigned mask, int src, int* out);
// Even lanes call __shfl_sync, odd lanes __ballot_sync.
cudaError_t mismatched_collectives(int* out);
// Every thread of `blocks` x `threads`: atomicAdd(counter, 1), atomicAdd(fsum, 0.5f),
// atomicMax(max, global id), and increments cas_counter through an atomicCAS loop.
cudaError_t atomics(int blocks, int threads, int* counter, float* fsum, int* max,
                    unsigned* cas_counter);
// out[6 * linear id ...]: threadIdx.xyz, blockIdx.xyz for a 3-D block in a 2-D grid; dims[0..5]:
// blockDim.xyz, gridDim.xyz (written by thread 0 of block 0).
cudaError_t indices(dim3 grid, dim3 block, unsigned* out, unsigned* dims);
// `iterations` __syncthreads in a loop, `blocks` x `threads`.
cudaError_t barrier_loop(int blocks, int threads, int iterations);
// `iterations` full-warp __shfl_xor_sync in a loop; out[t] = the final value.
cudaError_t shuffle_loop(int blocks, int threads, int iterations, int* out);
// A launch with `threads` threads and `shared` bytes of dynamic shared memory.
cudaError_t configured(int threads, size_t shared);
// Loads configured()'s kernel (cudaFuncGetAttributes).
cudaError_t load_configured();
// dst[0..n) = src[0..n) (n <= 512), through block_copy_to_shared() and store_global().
cudaError_t copy_through_shared(const uint8_t* src, int n, uint8_t* dst, int threads);
// One 16-byte vector load from src, stored at out, by each of 32 threads.
cudaError_t vector_load(const uint8_t* src, uint4* out);
// Thread 0 of every block of `grid` (32 threads a block) writes the block's linear number
// (x fastest) to ran[*taken] and increments *taken: ran holds the blocks in the order they ran.
cudaError_t block_order(dim3 grid, unsigned* taken, unsigned* ran);
// Block b writes parts[b] = b + 1; the block found last (by_ticket: the last to take *ticket;
// otherwise block blocks - 1, the defect of assuming index order) writes the parts' sum to *total.
// `fences`: bit 0 a __threadfence between a block's part and its ticket, bit 1 one between the
// last ticket and the sum (both are needed; the others are the defect of a missing fence).
cudaError_t hand_off(int blocks, bool by_ticket, unsigned* parts, unsigned* ticket, unsigned* total,
                     int fences = 3);
// words[k] = value for k < n (n at most kMaxRaceThreads): plain stores, one thread a word.
cudaError_t fill_words(unsigned* words, int n, unsigned value);
// Thread 0 sums words[0 .. n) read by load_relaxed() with no fence between, into *sum.
cudaError_t relaxed_reads(const unsigned* words, int n, unsigned* sum);
// A chain: block k (by_ticket: the k-th to take *ticket; otherwise blockIdx.x) waits, at most
// max_polls polls, for done[k - 1], then sets done[k]; *timeouts counts the waits that gave up.
// A poll that misses calls poll_missed() (under the emulation: a kDeadlock fault).
cudaError_t chain(int blocks, bool by_ticket, unsigned max_polls, unsigned* ticket, unsigned* done,
                  unsigned* timeouts);
// Every thread of one block writes its threadIdx.x to ran[*taken[r]] and increments taken[r], in
// three rounds r: at the launch's start, after a __syncthreads and after a __syncwarp. ran holds
// 3 x threads entries: the order the threads ran in each round.
cudaError_t thread_order(int threads, unsigned* taken, unsigned* ran);
// Thread k writes 100 + k to a shared word, then reads its neighbour k + 1's word (mod threads)
// into out[k]; with_barrier puts a __syncthreads between the write and the read. Without it, a
// race: what the neighbour's word holds depends on the order the threads run in.
inline constexpr int kMaxRaceThreads = 256;
cudaError_t neighbour_race(int threads, bool with_barrier, unsigned* out);
// A warp's lanes read their neighbour's shared word after writing their own: ordering 0 nothing
// between, 1 a __syncwarp, 2 only a shuffle.
cudaError_t warp_neighbour(int ordering, unsigned* out);

}  // namespace dq::cuda::selftest
