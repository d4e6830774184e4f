// The per-super-group statistics kernel (kernels/cuda/stats.cu): what DynamiQ's
// Codec::local_stats computes on the host, byte for byte, on device buffers.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_compat.h"

namespace dq::cuda {

// Threads per block of the statistics kernel; each block handles 16 super-groups at a time.
constexpr int kStatsThreads = 256;

// Enqueues the statistics of `count` values at `x` (FP32, or BF16 when `bf16`) on `stream`, for
// a sum over `n_workers`: stats[2j] = BF16(mean of super-group j), stats[2j+1] = BF16(its sum of
// squares), and after them the words of all-zero counts (kernels/dynamiq_layout.h: stat_word,
// zero_count_word), for the ceil(count / 256) super-groups, the last one possibly partial:
// stats_words() words in all. `max_blocks` caps the grid
// (0: as many blocks as needed, up to 1024). Returns the launch's error (cudaSuccess when
// count == 0: nothing to do). `error`: the lane's error/flags word in device memory; when it is
// non-zero as the kernel starts, nothing is written (nullptr: no word, always runs). The kernel
// raises no flags of its own.
cudaError_t launch_supergroup_stats(const void* x, bool bf16, size_t count, int n_workers,
                                    uint16_t* stats, cudaStream_t stream, int max_blocks = 0,
                                    const unsigned* error = nullptr);

// One codec part of a batch: `count` values from element `offset` of the call's input (the base
// pointer is the launch's), their statistics at `stats`. `first_tile`: the tiles of 16
// super-groups of the jobs before it (stats_batch_tiles() fills it).
struct StatsJob {
  unsigned long long offset;
  unsigned long long count;
  uint16_t* stats;
  unsigned long long first_tile;
};

// Fills every job's first_tile in order; returns the batch's tiles (the sum of every job's).
unsigned long long stats_batch_tiles(StatsJob* jobs, int n_jobs);

// The statistics of every job of a batch in one launch: what launch_supergroup_stats writes for
// each job's values at base + offset (elements of FP32, or BF16 when `bf16`). `jobs`: the
// n_jobs jobs in device memory, first_tile filled and increasing; `tiles`: what
// stats_batch_tiles() returned. `error` as launch_supergroup_stats.
cudaError_t launch_supergroup_stats_batch(const StatsJob* jobs, int n_jobs,
                                          unsigned long long tiles, const void* base, bool bf16,
                                          int n_workers, cudaStream_t stream, int max_blocks = 0,
                                          const unsigned* error = nullptr);

// Loads every kernel of stats.cu (device set-up; see cudaFuncGetAttributes in EMULATION.md).
cudaError_t load_stats_kernels();

}  // namespace dq::cuda
