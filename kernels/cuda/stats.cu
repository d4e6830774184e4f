// Per-super-group statistics for DynamiQ's statistics all-reduce: the mean, the sum of squares
// and whether all values are zero (packed into count words), of every 256 values, as BF16 words
// (docs/FORMAT.md), with the bits of the host's DynamiqCodec::local_stats
// (kernels/dynamiq_codec.cc). The host's order is kept exactly: within each group of 16 values a
// sequential sum from +0, then a sequential sum of the 16 group sums from +0; the mean divides by
// the super-group's count of valid values (the last super-group may be partial); both go through
// f32_to_bf16_sat. With --fmad=false, IEEE division and no flush-to-zero on the device (and
// -ffp-contract=off under the emulator) every operation is the host's; the count of non-zero values
// is a small integer, exact in any order.
//
// Work split: a block of 256 threads takes a tile of 16 super-groups (4096 values): it loads the
// tile coalesced into shared memory, then thread t sums group t % 16 of super-group t / 16 and a
// half-warp shuffle sums the 16 group sums in group order; the tile's all-zero flags meet in
// shared memory and a few threads write its count words. Blocks stride over the tiles; a batch
// (a call's codec parts in one launch) numbers the tiles of all its jobs in job order.
#include "kernels/cuda/stats.h"

#include "kernels/bf16.h"
#include "kernels/cuda/block.cuh"
#include "kernels/dynamiq_layout.h"
#include "kernels/dynamiq_math.h"
#include "kernels/dynamiq_range.h"

namespace dq::cuda {
namespace {

constexpr int kTileSuperGroups = kStatsThreads / kGroupsPerSuperGroup;  // 16
constexpr int kTileValues = kTileSuperGroups * kSuperGroup;             // 4096
constexpr int kRowPitch = kGroup + 1;  // one group per row, padded: no bank conflicts
// Blocks of 256 threads an SM keeps resident: 4 caps the registers at 64 a thread (half of an
// sm_80 / sm_90 SM's threads), what the kernels used before the count words were packed.
constexpr int kStatsMinBlocks = 4;
constexpr int kTileRows = kTileValues / kGroup;
static_assert(kStatsThreads == kTileRows, "one thread per group of the tile");

}  // namespace

namespace {

// One tile (16 super-groups) of `count` values at `x`: loaded into `tile`, then summed; the
// whole block, with barriers.
__device__ void stats_tile(const void* x, bool bf16, unsigned long long count, int n_workers,
                           uint16_t* stats, unsigned long long tile_index, float* tile,
                           unsigned char* all_zero) {
  const int t = static_cast<int>(threadIdx.x);
  const unsigned long long n_sg = (count + kSuperGroup - 1) / kSuperGroup;
  const float* x32 = static_cast<const float*>(x);
  const uint16_t* x16 = static_cast<const uint16_t*>(x);
  const unsigned long long first = tile_index * kTileValues;
  DQ_UNROLL
  for (int k = 0; k < kTileValues / kStatsThreads; ++k) {
    const int i = k * kStatsThreads + t;
    const unsigned long long e = first + static_cast<unsigned long long>(i);
    float v = 0.0f;
    if (e < count) v = bf16 ? bf16_to_f32(x16[e]) : x32[e];
    tile[(i / kGroup) * kRowPitch + (i % kGroup)] = v;
  }
  __syncthreads();
  const int g = t % kGroupsPerSuperGroup;
  const unsigned long long sg =
      tile_index * kTileSuperGroups + static_cast<unsigned>(t / kGroupsPerSuperGroup);
  int valid = 0;
  if (sg < n_sg) {
    const unsigned long long left = count - sg * kSuperGroup;
    valid = left < kSuperGroup ? static_cast<int>(left) : kSuperGroup;
  }
  int in_group = valid - g * kGroup;
  in_group = in_group < 0 ? 0 : in_group > kGroup ? kGroup : in_group;
  const float* row = &tile[t * kRowPitch];  // group g of super-group t / 16 is row t
  float group_sum = 0.0f, group_sq = 0.0f;
  float group_non_zero = 0.0f;  // values != 0 in the group (NaN included), at most 16: exact
  for (int k = 0; k < in_group; ++k) {
    const float v = row[k];
    group_sum += v;
    group_sq += v * v;
    group_non_zero += v != 0.0f ? 1.0f : 0.0f;
  }
  const float sum = segment_ordered_sum<kGroupsPerSuperGroup>(group_sum);
  const float sum_sq = segment_ordered_sum<kGroupsPerSuperGroup>(group_sq);
  const float non_zero = segment_ordered_sum<kGroupsPerSuperGroup>(group_non_zero);
  if (g == 0 && sg < n_sg) {
    float mean = sum / static_cast<float>(valid);
    uint16_t energy_word = f32_to_bf16_sat(sum_sq);
    if (!energy_in_window(sum_sq)) {  // far from unit scale (rare): the host's sequential path
      const unsigned long long at = sg * kSuperGroup;
      if (bf16)
        wide_statistics([x16, at](int k) { return bf16_to_f32(x16[at + k]); }, valid, sum_sq, &mean,
                        &energy_word);
      else
        wide_statistics([x32, at](int k) { return x32[at + k]; }, valid, sum_sq, &mean,
                        &energy_word);
    }
    stats[stat_word(sg, kStatMean)] = f32_to_bf16_sat(mean);
    stats[stat_word(sg, kStatEnergy)] = energy_word;
  }
  if (g == 0) all_zero[t / kGroupsPerSuperGroup] = sg < n_sg && non_zero == 0.0f ? 1 : 0;
  __syncthreads();  // the flags are read next, and the tile is overwritten after that
  // The tile's words of all-zero counts (whole words: zero_counts_per_word() divides 16): thread
  // t writes the tile's word t.
  const int per = zero_counts_per_word(n_workers);
  const unsigned long long first_sg =
      tile_index * kTileSuperGroups + static_cast<unsigned long long>(t) * per;
  if (t < kTileSuperGroups / per && first_sg < n_sg) {
    unsigned flags = 0;
    for (int i = 0; i < per; ++i) flags |= static_cast<unsigned>(all_zero[t * per + i]) << i;
    stats[zero_count_word(n_sg, first_sg, n_workers)] = zero_count_word_of(flags, n_workers);
  }
}

__host__ __device__ inline unsigned long long tiles_of(unsigned long long count) {
  const unsigned long long n_sg = (count + kSuperGroup - 1) / kSuperGroup;
  return (n_sg + kTileSuperGroups - 1) / kTileSuperGroups;
}

unsigned grid_for(unsigned long long tiles, int max_blocks) {
  const unsigned long long cap =
      max_blocks > 0 ? static_cast<unsigned long long>(max_blocks) : 1024;
  return static_cast<unsigned>(tiles < cap ? tiles : cap);
}

}  // namespace

__global__ void __launch_bounds__(kStatsThreads, kStatsMinBlocks)
    supergroup_stats_kernel(const void* x, int bf16, unsigned long long count, int n_workers,
                            uint16_t* stats, const unsigned* error) {
  __shared__ float tile[kTileRows * kRowPitch];
  __shared__ unsigned char all_zero[kTileSuperGroups];
  const StepFold fold(error);  // the step's only kernel (step_fold.h)
  // The lane failed before this step: nothing is written. Every thread of the grid reads the same
  // word, which this kernel never writes, before any barrier: the whole block returns.
  if (error != nullptr && step_failed(load_relaxed(error))) return;
  const unsigned long long n_tiles = tiles_of(count);
  for (unsigned long long tile_index = blockIdx.x; tile_index < n_tiles; tile_index += gridDim.x)
    stats_tile(x, bf16 != 0, count, n_workers, stats, tile_index, tile, all_zero);
}

// A batch: the tiles of every job, numbered in job order; a block finds a tile's job by
// bisection over the jobs' first tiles (a few dozen jobs at most a call: log2 steps, from L2).
__global__ void __launch_bounds__(kStatsThreads, kStatsMinBlocks)
    supergroup_stats_batch_kernel(const StatsJob* jobs, int n_jobs, unsigned long long tiles,
                                  const void* base, int bf16, int n_workers,
                                  const unsigned* error) {
  __shared__ float tile[kTileRows * kRowPitch];
  __shared__ unsigned char all_zero[kTileSuperGroups];
  const StepFold fold(error);  // the step's only kernel (step_fold.h)
  if (error != nullptr && step_failed(load_relaxed(error))) return;  // as above: the whole block
  const size_t esize = bf16 ? 2 : 4;
  for (unsigned long long at = blockIdx.x; at < tiles; at += gridDim.x) {
    int lo = 0, hi = n_jobs - 1;  // the last job whose first tile is <= at
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (jobs[mid].first_tile <= at)
        lo = mid;
      else
        hi = mid - 1;
    }
    const StatsJob job = jobs[lo];
    const void* x = static_cast<const unsigned char*>(base) + job.offset * esize;
    stats_tile(x, bf16 != 0, job.count, n_workers, job.stats, at - job.first_tile, tile, all_zero);
  }
}

cudaError_t launch_supergroup_stats(const void* x, bool bf16, size_t count, int n_workers,
                                    uint16_t* stats, cudaStream_t stream, int max_blocks,
                                    const unsigned* error) {
  if (count == 0) return cudaSuccess;
  if (x == nullptr || stats == nullptr || n_workers < 1) return cudaErrorInvalidValue;
  DQ_LAUNCH(supergroup_stats_kernel, dim3(grid_for(tiles_of(count), max_blocks)),
            dim3(kStatsThreads), 0, stream, x, bf16 ? 1 : 0, static_cast<unsigned long long>(count),
            n_workers, stats, error);
  return cudaGetLastError();
}

unsigned long long stats_batch_tiles(StatsJob* jobs, int n_jobs) {
  unsigned long long tiles = 0;
  for (int i = 0; i < n_jobs; ++i) {
    jobs[i].first_tile = tiles;
    tiles += tiles_of(jobs[i].count);
  }
  return tiles;
}

cudaError_t launch_supergroup_stats_batch(const StatsJob* jobs, int n_jobs,
                                          unsigned long long tiles, const void* base, bool bf16,
                                          int n_workers, cudaStream_t stream, int max_blocks,
                                          const unsigned* error) {
  if (tiles == 0) return cudaSuccess;
  if (jobs == nullptr || n_jobs < 1 || base == nullptr || n_workers < 1)
    return cudaErrorInvalidValue;
  DQ_LAUNCH(supergroup_stats_batch_kernel, dim3(grid_for(tiles, max_blocks)), dim3(kStatsThreads),
            0, stream, jobs, n_jobs, tiles, base, bf16 ? 1 : 0, n_workers, error);
  return cudaGetLastError();
}

// Every kernel of this file loaded now (the attributes query loads its module): at device set-up,
// never first mid-call.
cudaError_t load_stats_kernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, supergroup_stats_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, supergroup_stats_batch_kernel);
  return e;
}

}  // namespace dq::cuda
