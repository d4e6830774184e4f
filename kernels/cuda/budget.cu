// The budget's prediction (kernels/cuda/budget.h) over the whole grid, every part of the call at
// once (a row of the grid a part, blockIdx.y, grid-strided past 65,535 parts), so a call takes
// kBudgetLaunches launches whatever its parts: the work that grows with a part's super-groups runs
// in as many blocks as it has tiles of them, and only the per-candidate terms (a constant a part)
// run in one block a part. A part keeps only the keys its super-groups have: a directory of one bit
// per key, and one entry per key present (its count and energies), at the key's rank in
// descending order, so its memory grows with its super-groups, not with the 32,640 keys. Kernels,
// in stream order:
//  init (one block):   the call's state and every part's state in the scratch zeroed, the parts'
//                      geometry and the hop tables copied from the job's mapped memory into the
//                      scratch (device memory, so the blocks below read them from L2 instead of
//                      over the bus), each part's first key entry (a scan of the parts' entries);
//  extent (grid):      each part's directory and key entries zeroed; each super-group's energies
//                      (budget_math.h), a block max of the largest (fixes the part's fixed-point
//                      scale) and of the largest floor(log2 energy) (the width-key shift), a block
//                      count of "not finite"; one 64-bit atomic max / add per block and quantity
//                      (a max of non-negative doubles is a max of their bit patterns);
//  keys (grid):        each super-group's key marked in its part's directory (a block's bits
//                      gathered in shared memory first, then one atomic OR per word it set);
//  sums (grid):        each block ranks the directory's keys (a popcount per 128 keys, scanned),
//                      then the per-key sums at each key's entry (integer atomics, whose totals do
//                      not depend on their order; summed per block in a shared-memory table of its
//                      keys first) and the part's unweighted energies (a block sum, then one
//                      atomic per block);
//  runs, cumulate (kBudgetKeyRuns blocks a part): the entries cumulated from the largest key down:
//                      each block's run of entries totalled, then each entry's sum from the runs
//                      above its own and a block exclusive scan of its run;
//  part (one block a part): one thread per candidate computes its term (a bisection of O(1) steps,
//                      each a directory rank and an entry read) into the scratch (every part's
//                      terms are kept); the call's last part block to finish (a ticket after a
//                      fence, so no block waits for another) adds every part's terms in part
//                      order, as the host does, and writes the result (finish_budget).
// Every step is the host's arithmetic on the same values (a sum over the keys at least k is the
// same integer whether the keys absent are in a table as zeros or not at all), so the result has
// the host's bits. The hop tables live in shared memory in the grid kernels (dynamic, 16 (n + 1)
// bytes).
#include "kernels/cuda/budget.h"

#include "kernels/cuda/block.cuh"

namespace dq::cuda {
namespace {

constexpr uint32_t kKeys = kEnergyKeys;
constexpr int kGridThreads = 256;         // threads of a grid kernel's block
constexpr int kMaxGridBlocks = 1024;      // a grid kernel's blocks at most (grid-stride beyond)
constexpr uint32_t kMaxGridRows = 65535;  // gridDim.y at most (CUDA's limit; parts stride beyond)

// The tables are uint64_t (the host's type); CUDA's 64-bit atomics take unsigned long long.
static_assert(sizeof(unsigned long long) == sizeof(uint64_t), "64-bit atomics");
__device__ __forceinline__ unsigned long long* as_ull(uint64_t* p) {
  return reinterpret_cast<unsigned long long*>(p);
}

// Where the kernels find the scratch's pieces (kernels/cuda/budget.h, budget_scratch_bytes).
struct Scratch {
  BudgetCallState* call;
  double* hop;  // linear[n + 1], square[n + 1] when staged (n < kBudgetStagedWorkers)
  BudgetPartState* parts;
  PartTerms* terms;
  uint32_t* directories;  // kBudgetKeyWords a part
  uint64_t* entries;      // per key entry: count, hop_centred, hop_mean
};

__device__ __forceinline__ Scratch scratch_of(void* base, uint32_t n_parts) {
  unsigned char* bytes = static_cast<unsigned char*>(base);
  unsigned char* parts = bytes + kBudgetCallBytes;
  unsigned char* terms = parts + n_parts * sizeof(BudgetPartState);
  unsigned char* directories = terms + n_parts * sizeof(PartTerms);
  unsigned char* entries = directories + static_cast<size_t>(n_parts) * kBudgetKeyWords * 4;
  return Scratch{reinterpret_cast<BudgetCallState*>(bytes),
                 reinterpret_cast<double*>(bytes + sizeof(BudgetCallState)),
                 reinterpret_cast<BudgetPartState*>(parts),
                 reinterpret_cast<PartTerms*>(terms),
                 reinterpret_cast<uint32_t*>(directories),
                 reinterpret_cast<uint64_t*>(entries)};
}

// A part's key directory and its key entries (3 words an entry).
struct PartKeys {
  uint32_t* directory;
  uint64_t* entries;
};

__device__ __forceinline__ PartKeys keys_of(const Scratch& s, uint32_t part) {
  return PartKeys{s.directories + static_cast<size_t>(part) * kBudgetKeyWords,
                  s.entries + 3 * s.parts[part].entries_at};
}

// The directory ranked in groups of 4 words (128 keys): how many keys are set below each group.
constexpr uint32_t kGroupWords = 4;
constexpr uint32_t kKeyGroups = (kBudgetKeyWords + kGroupWords - 1) / kGroupWords;

// Fills below[kKeyGroups] (shared memory) from `directory`; returns the keys set in all (every
// thread). A collective of the block; ends with a barrier.
__device__ uint32_t rank_groups(const uint32_t* directory, uint32_t* below,
                                unsigned long long* scratch_u) {
  const uint32_t per = (kKeyGroups + blockDim.x - 1) / blockDim.x;
  const uint32_t first = threadIdx.x * per;
  const uint32_t end = first + per < kKeyGroups ? first + per : kKeyGroups;
  uint32_t own = 0;
  for (uint32_t w = first * kGroupWords; w < end * kGroupWords && w < kBudgetKeyWords; ++w)
    own += static_cast<uint32_t>(__popc(load_global(directory + w)));
  unsigned long long total = 0;
  uint32_t at = static_cast<uint32_t>(
      block_exclusive_scan(static_cast<unsigned long long>(own), scratch_u, &total));
  for (uint32_t g = first; g < end; ++g) {
    below[g] = at;
    for (uint32_t w = g * kGroupWords; w < (g + 1) * kGroupWords && w < kBudgetKeyWords; ++w)
      at += static_cast<uint32_t>(__popc(load_global(directory + w)));
  }
  __syncthreads();
  return static_cast<uint32_t>(total);
}

// How many keys below `key` (< kKeys) the directory has.
__device__ __forceinline__ uint32_t keys_below(const uint32_t* directory, const uint32_t* below,
                                               uint32_t key) {
  const uint32_t word = key >> 5;
  uint32_t r = below[word / kGroupWords];
  for (uint32_t w = word / kGroupWords * kGroupWords; w < word; ++w)
    r += static_cast<uint32_t>(__popc(load_global(directory + w)));
  return r +
         static_cast<uint32_t>(__popc(load_global(directory + word) & ((1u << (key & 31)) - 1u)));
}

// A part's cumulated sums as the budget's arithmetic reads them (budget_math.h's BudgetSums, for
// the keys present only): entry q holds the sums over the keys at least the q-th largest present.
struct PartSums {
  const uint32_t* directory;
  const uint32_t* below;  // rank_groups()
  const uint64_t* entries;
  uint32_t distinct;
  uint64_t centred, mean;
  double unit;
  __device__ KeySums at_least(uint32_t k) const {
    if (k >= kKeys) return KeySums{};
    const uint32_t lower = keys_below(directory, below, k);
    if (lower >= distinct) return KeySums{};
    const uint64_t* e = entries + 3 * static_cast<size_t>(distinct - 1 - lower);
    return KeySums{load_global(e), load_global(e + 1), load_global(e + 2)};
  }
};

// A block's distinct keys of one sweep (at most kGridThreads) in an open-addressing table of twice
// as many slots, so a probe always ends; kEmptySlot: a free slot.
constexpr uint32_t kKeySlots = 2 * kGridThreads;
constexpr uint32_t kEmptySlot = 0xffffffffu;
static_assert(kKeySlots == 1u << 9, "key_slot's hash takes 9 bits");

// The slot of `key`, claimed if new (linear probing from a multiplicative hash).
__device__ __forceinline__ uint32_t key_slot(uint32_t* slot_key, uint32_t key) {
  uint32_t k = (key * 2654435761u) >> 23;  // 9 bits: kKeySlots = 512
  for (uint32_t probe = 0; probe < kKeySlots; ++probe) {
    const uint32_t was = atomicCAS(&slot_key[k], kEmptySlot, key);
    if (was == kEmptySlot || was == key) return k;
    k = (k + 1) % kKeySlots;
  }
  return k;  // never reached: the table is at most half full
}

// One decision for the whole block: the error word (which another stream's kernels may raise
// meanwhile) and, with `part`, whether that part has a statistic that is not finite (written by
// an earlier kernel), read once by thread 0. Ends with a barrier, so the flag can be reused.
__device__ __forceinline__ bool block_skips(const unsigned* error, const BudgetPartState* part,
                                            unsigned* shared_flag) {
  if (threadIdx.x == 0)
    *shared_flag =
        (error != nullptr && load_relaxed(error) != 0) || (part != nullptr && part->bad != 0) ? 1u
                                                                                              : 0u;
  __syncthreads();
  const bool skips = *shared_flag != 0;
  __syncthreads();
  return skips;
}

// The hop tables in shared memory `staged` (2 (n + 1) doubles) when the scratch holds a copy;
// the job's mapped tables otherwise. Ends with a barrier.
__device__ HopProfile stage_hop(const Scratch& s, const HopProfile& mapped, int n_workers,
                                double* staged) {
  const uint32_t entries = static_cast<uint32_t>(n_workers) + 1;
  if (entries > kBudgetStagedWorkers) return mapped;  // every block takes the same branch
  for (uint32_t k = threadIdx.x; k < 2 * entries; k += blockDim.x)
    staged[k] = load_global(s.hop + k);
  __syncthreads();
  return HopProfile{staged, staged + entries};
}

// This block's super-groups of a part: from `first`, every `step`.
struct GridSweep {
  unsigned long long first, step;
};
__device__ __forceinline__ GridSweep grid_sweep() {
  return GridSweep{static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x,
                   static_cast<unsigned long long>(gridDim.x) * blockDim.x};
}

// Super-group j's energies (budget_math.h) from its statistics words, loaded here.
__device__ __forceinline__ bool energy_of(const uint16_t* stats, unsigned long long j,
                                          unsigned long long n_sg, unsigned long long n_elems,
                                          int n_workers, const HopProfile& hop, int shift,
                                          SupergroupEnergy* e) {
  SupergroupStatWords words;
  words.mean = load_global(stats + stat_word(j, kStatMean));
  words.energy = load_global(stats + stat_word(j, kStatEnergy));
  words.all_zero =
      summed_all_zero(load_global(stats + zero_count_word(n_sg, j, n_workers)), j, n_workers);
  return supergroup_energy(words, j, n_sg, n_elems, n_workers, hop, shift, e);
}

// The width-key shift of a part whose extent is known.
__device__ __forceinline__ int part_shift(const BudgetPartState& st) {
  const unsigned long long largest = st.largest;
  return width_key_shift(largest == 0 ? INT32_MIN : static_cast<int>(largest) - 2048);
}

}  // namespace

__global__ void __launch_bounds__(kGridThreads)
    budget_init_kernel(const BudgetJob* job_in, void* scratch, BudgetResult* out,
                       const unsigned* error, uint32_t n_parts) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  __shared__ unsigned skip;
  if (block_skips(error, nullptr, &skip)) return;
  const Scratch s = scratch_of(scratch, n_parts);
  const BudgetJob& job = *job_in;
  const uint32_t entries = static_cast<uint32_t>(job.n_workers) + 1;
  if (entries <= kBudgetStagedWorkers)
    for (uint32_t k = threadIdx.x; k < entries; k += blockDim.x) {
      store_global(s.hop + k, load_global(job.hop.linear + k));
      store_global(s.hop + entries + k, load_global(job.hop.square + k));
    }
  // The parts' key entries one after another, in part order (the same trips in every thread).
  unsigned long long entries_at = 0;
  for (uint32_t first = 0; first < n_parts; first += blockDim.x) {
    const uint32_t i = first + threadIdx.x;
    BudgetPartState st;
    if (i < n_parts) {
      const BudgetPartJob& part = job.parts[i];
      st.n_elems = part.count;
      st.n_sg = (part.count + 255) / 256;
      st.stats_offset = part.stats_offset;
      for (int c = 0; c < kCandidates; ++c) st.fits[c] = part.fits[c];
    }
    const unsigned long long own = i < n_parts ? budget_key_entries(st.n_elems) : 0;
    unsigned long long total = 0;
    st.entries_at = entries_at + block_exclusive_scan(own, scratch_u, &total);
    if (i < n_parts) store_global(s.parts + i, st);
    entries_at += total;
  }
  if (threadIdx.x == 0) {
    *s.call = BudgetCallState{};
    if (n_parts == 0) finish_budget(job, s.call->acc, out);
  }
}

namespace {

// Where a grid kernel's hop tables come from: the job's mapped ones, staged into `staged` (shared
// memory) when the scratch holds a copy; none for the kernels over key entries.
struct HopSource {
  HopProfile mapped;
  int n_workers = 0;
  double* staged = nullptr;
};

// The grid kernels' part loop: fn(s, part, hop) for this block's row's part, then every
// gridDim.y-th, with a barrier after each (their shared memory is reused); nothing when the
// lane's error word is set.
template <class PartFn>
__device__ __forceinline__ void for_each_row_part(void* scratch, uint32_t n_parts,
                                                  const unsigned* error, const HopSource& source,
                                                  unsigned* skip, PartFn fn) {
  if (block_skips(error, nullptr, skip)) return;
  const Scratch s = scratch_of(scratch, n_parts);
  const HopProfile hop = source.staged != nullptr
                             ? stage_hop(s, source.mapped, source.n_workers, source.staged)
                             : source.mapped;
  for (uint32_t part = blockIdx.y; part < n_parts; part += gridDim.y) {
    fn(s, part, hop);
    __syncthreads();
  }
}

__device__ void extent_of_part(const Scratch& s, uint32_t part, const HopProfile& hop,
                               int n_workers, const uint16_t* reduced,
                               unsigned long long* scratch_u, double* scratch_d) {
  BudgetPartState& ps = s.parts[part];
  const PartKeys keys = keys_of(s, part);
  const GridSweep g = grid_sweep();
  const unsigned long long n_sg = ps.n_sg, n_elems = ps.n_elems;
  for (unsigned long long k = g.first; k < kBudgetKeyWords; k += g.step)
    store_global(keys.directory + k, 0u);
  const unsigned long long n_entries = budget_key_entries(n_elems);
  for (unsigned long long q = g.first; q < n_entries; q += g.step)
    for (int a = 0; a < 3; ++a) store_global(keys.entries + 3 * q + a, uint64_t{0});
  const uint16_t* stats = reduced + ps.stats_offset;
  double local_max = 0;
  unsigned long long bad = 0, largest = 0;  // floor(log2 energy) + 2048; 0: none
  SupergroupEnergy e;
  for (unsigned long long j = g.first; j < n_sg; j += g.step) {
    if (!energy_of(stats, j, n_sg, n_elems, n_workers, hop, 0, &e)) {
      bad = 1;
      continue;
    }
    const double v = largest_energy(e);
    local_max = local_max < v ? v : local_max;
    if (e.energy > 0.0) {
      const unsigned long long l2 = static_cast<unsigned long long>(floor_log2(e.energy) + 2048);
      largest = largest < l2 ? l2 : largest;
    }
  }
  local_max = block_reduce(local_max, MaxOp(), scratch_d);
  largest = block_reduce(largest, MaxOp(), scratch_u);
  bad = block_reduce(bad, SumOp(), scratch_u);
  if (threadIdx.x == 0) {
    // Non-negative doubles order as their bit patterns.
    atomic_max_global(&ps.max_bits, static_cast<unsigned long long>(f64_bits_of(local_max)));
    atomic_max_global(&ps.largest, largest);
    if (bad != 0) atomic_add_global(&ps.bad, bad);
  }
}

}  // namespace

__global__ void __launch_bounds__(kGridThreads)
    budget_extent_kernel(HopProfile mapped, int n_workers, const uint16_t* reduced, void* scratch,
                         uint32_t n_parts, const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  __shared__ double scratch_d[kWarp + 1];
  __shared__ unsigned skip;
  DQ_DYNAMIC_SHARED(double, staged);
  for_each_row_part(scratch, n_parts, error, HopSource{mapped, n_workers, staged}, &skip,
                    [&](const Scratch& s, uint32_t part, const HopProfile& hop) {
                      extent_of_part(s, part, hop, n_workers, reduced, scratch_u, scratch_d);
                    });
}

namespace {

__device__ void mark_keys_of_part(const Scratch& s, uint32_t part, const HopProfile& hop,
                                  int n_workers, const uint16_t* reduced, uint32_t* block_bits,
                                  unsigned* skip) {
  const BudgetPartState& st = s.parts[part];
  if (block_skips(nullptr, &st, skip)) return;  // the sums kernel skips it too
  const PartKeys keys = keys_of(s, part);
  for (uint32_t w = threadIdx.x; w < kBudgetKeyWords; w += blockDim.x) block_bits[w] = 0;
  __syncthreads();
  const uint16_t* stats = reduced + st.stats_offset;
  const unsigned long long n_sg = st.n_sg, n_elems = st.n_elems;
  const int shift = part_shift(st);
  const GridSweep g = grid_sweep();
  SupergroupEnergy e;
  for (unsigned long long j = g.first; j < n_sg; j += g.step) {
    energy_of(stats, j, n_sg, n_elems, n_workers, hop, shift, &e);
    atomicOr(&block_bits[e.key >> 5], 1u << (e.key & 31));
  }
  __syncthreads();
  for (uint32_t w = threadIdx.x; w < kBudgetKeyWords; w += blockDim.x)
    if (block_bits[w] != 0) atomic_or_global(keys.directory + w, block_bits[w]);
}

}  // namespace

__global__ void __launch_bounds__(kGridThreads)
    budget_keys_kernel(HopProfile mapped, int n_workers, const uint16_t* reduced, void* scratch,
                       uint32_t n_parts, const unsigned* error) {
  // The bits a block sets, gathered before the global atomics.
  __shared__ uint32_t block_bits[kBudgetKeyWords];
  __shared__ unsigned skip;
  DQ_DYNAMIC_SHARED(double, staged);
  for_each_row_part(scratch, n_parts, error, HopSource{mapped, n_workers, staged}, &skip,
                    [&](const Scratch& s, uint32_t part, const HopProfile& hop) {
                      mark_keys_of_part(s, part, hop, n_workers, reduced, block_bits, &skip);
                    });
}

namespace {

// The shared memory of a sums block: its per-key sums (count, hop_centred, hop_mean) before the
// global atomics, and the directory's ranks.
struct SumsShared {
  uint32_t slot_key[kKeySlots];
  unsigned long long slot_sum[3 * kKeySlots];
  uint32_t below[kKeyGroups];
};

// Without an opt-in (cudaFuncAttributeMaxDynamicSharedMemorySize) a block's static and dynamic
// shared memory together may not pass 48 KiB. The kernels that stage the hop tables (dynamic, up
// to 2 kBudgetStagedWorkers doubles) stay under it with their static arrays, or their launches
// would fail from about 2,000 ranks on; 64 bytes left for the alignment between the arrays.
constexpr size_t kMostStagedBytes = 2 * size_t{kBudgetStagedWorkers} * sizeof(double);
constexpr size_t kSharedWithoutOptIn = 48 * 1024 - 64;
static_assert(sizeof(unsigned long long) * (kWarp + 1) + sizeof(SumsShared) + sizeof(unsigned) +
                      kMostStagedBytes <=
                  kSharedWithoutOptIn,
              "budget_sums_kernel: static and staged shared memory over 48 KiB");
static_assert((sizeof(unsigned long long) + sizeof(double)) * (kWarp + 1) + sizeof(unsigned) +
                      kMostStagedBytes <=
                  kSharedWithoutOptIn,
              "budget_extent_kernel: static and staged shared memory over 48 KiB");
static_assert(sizeof(uint32_t) * kBudgetKeyWords + sizeof(unsigned) + kMostStagedBytes <=
                  kSharedWithoutOptIn,
              "budget_keys_kernel: static and staged shared memory over 48 KiB");

__device__ void sums_of_part(const Scratch& s, uint32_t part, const HopProfile& hop, int n_workers,
                             const uint16_t* reduced, SumsShared& sh, unsigned long long* scratch_u,
                             unsigned* skip) {
  BudgetPartState& st = s.parts[part];
  // A part with a statistic that is not finite has no sums (the part kernel ends the call).
  if (block_skips(nullptr, &st, skip)) return;
  const PartKeys keys = keys_of(s, part);
  const uint32_t distinct = rank_groups(keys.directory, sh.below, scratch_u);
  if (blockIdx.x == 0 && threadIdx.x == 0) st.distinct = distinct;
  const uint16_t* stats = reduced + st.stats_offset;
  const unsigned long long n_sg = st.n_sg, n_elems = st.n_elems;
  const int shift = part_shift(st);
  const double scale = fixed_point_scale(f64_of_bits(st.max_bits), n_sg);
  const GridSweep g = grid_sweep();
  for (uint32_t k = threadIdx.x; k < kKeySlots; k += blockDim.x) sh.slot_key[k] = kEmptySlot;
  for (uint32_t k = threadIdx.x; k < 3 * kKeySlots; k += blockDim.x) sh.slot_sum[k] = 0;
  unsigned long long own_centred = 0, own_mean = 0;
  SupergroupEnergy e;
  // The same trips in every thread of the block: a sweep of the grid, then the block's keys
  // flushed (at most blockDim.x distinct keys a sweep).
  for (unsigned long long at = g.first - threadIdx.x; at < n_sg; at += g.step) {
    __syncthreads();  // the slots are empty
    const unsigned long long j = at + threadIdx.x;
    if (j < n_sg) {
      energy_of(stats, j, n_sg, n_elems, n_workers, hop, shift, &e);
      const uint32_t k = key_slot(sh.slot_key, e.key);
      atomicAdd(&sh.slot_sum[k], 1ull);
      atomicAdd(&sh.slot_sum[kKeySlots + k],
                static_cast<unsigned long long>(to_fixed_point(e.hop_centred, scale)));
      atomicAdd(&sh.slot_sum[2 * kKeySlots + k],
                static_cast<unsigned long long>(to_fixed_point(e.hop_mean, scale)));
      own_centred += to_fixed_point(e.centred, scale);
      own_mean += to_fixed_point(e.mean, scale);
    }
    __syncthreads();
    for (uint32_t k = threadIdx.x; k < kKeySlots; k += blockDim.x) {
      const uint32_t key = sh.slot_key[k];
      if (key == kEmptySlot) continue;
      // The key's entry: its rank from the largest key down.
      const uint32_t q = distinct - 1 - keys_below(keys.directory, sh.below, key);
      uint64_t* entry = keys.entries + 3 * q;
      atomic_add_global(as_ull(&entry[0]), sh.slot_sum[k]);
      atomic_add_global(as_ull(&entry[1]), sh.slot_sum[kKeySlots + k]);
      atomic_add_global(as_ull(&entry[2]), sh.slot_sum[2 * kKeySlots + k]);
      sh.slot_key[k] = kEmptySlot;
      sh.slot_sum[k] = sh.slot_sum[kKeySlots + k] = sh.slot_sum[2 * kKeySlots + k] = 0;
    }
  }
  own_centred = block_reduce(own_centred, SumOp(), scratch_u);
  own_mean = block_reduce(own_mean, SumOp(), scratch_u);
  if (threadIdx.x == 0) {
    atomic_add_global(&st.total_centred, own_centred);
    atomic_add_global(&st.total_mean, own_mean);
  }
}

}  // namespace

// At least 4 blocks a SM (64 registers a thread, 50% occupancy): without a floor ptxas stops at 48
// registers and spills.
constexpr int kSumsBlocksPerSm = 4;

__global__ void __launch_bounds__(kGridThreads, kSumsBlocksPerSm)
    budget_sums_kernel(HopProfile mapped, int n_workers, const uint16_t* reduced, void* scratch,
                       uint32_t n_parts, const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  __shared__ SumsShared sh;
  __shared__ unsigned skip;
  DQ_DYNAMIC_SHARED(double, staged);
  for_each_row_part(scratch, n_parts, error, HopSource{mapped, n_workers, staged}, &skip,
                    [&](const Scratch& s, uint32_t part, const HopProfile& hop) {
                      sums_of_part(s, part, hop, n_workers, reduced, sh, scratch_u, &skip);
                    });
}

namespace {

// The sum of this thread's kBudgetKeysPerThread consecutive entries (descending keys) of
// quantity `a` (0 count, 1 hop_centred, 2 hop_mean); 0 past the part's `distinct` entries.
__device__ __forceinline__ unsigned long long thread_entries(const uint64_t* entries,
                                                             uint32_t distinct, int a) {
  const uint32_t q = (blockIdx.x * blockDim.x + threadIdx.x) * kBudgetKeysPerThread;
  unsigned long long sum = 0;
  for (uint32_t i = 0; i < kBudgetKeysPerThread && q + i < distinct; ++i)
    sum += load_global(entries + 3 * static_cast<size_t>(q + i) + a);
  return sum;
}

// Whether this block of a runs / cumulate row has entries of the part: a whole-block decision.
__device__ __forceinline__ bool run_has_entries(const BudgetPartState& st) {
  return static_cast<unsigned long long>(blockIdx.x) * blockDim.x * kBudgetKeysPerThread <
         st.distinct;
}

__device__ void runs_of_part(const Scratch& s, uint32_t part, unsigned long long* scratch_u,
                             unsigned* skip) {
  BudgetPartState& st = s.parts[part];
  if (block_skips(nullptr, &st, skip) || !run_has_entries(st)) return;
  const PartKeys keys = keys_of(s, part);
  const uint32_t distinct = static_cast<uint32_t>(st.distinct);
  for (int a = 0; a < 3; ++a) {
    const unsigned long long total =
        block_reduce(thread_entries(keys.entries, distinct, a), SumOp(), scratch_u);
    if (threadIdx.x == 0) store_global(&st.runs[a][blockIdx.x], total);
  }
}

__device__ void cumulate_part(const Scratch& s, uint32_t part, unsigned long long* scratch_u,
                              unsigned* skip) {
  const BudgetPartState& st = s.parts[part];
  if (block_skips(nullptr, &st, skip) || !run_has_entries(st)) return;
  const PartKeys keys = keys_of(s, part);
  const uint32_t distinct = static_cast<uint32_t>(st.distinct);
  const uint32_t q = (blockIdx.x * blockDim.x + threadIdx.x) * kBudgetKeysPerThread;
  for (int a = 0; a < 3; ++a) {
    unsigned long long above = 0;
    for (uint32_t r = threadIdx.x; r < blockIdx.x; r += blockDim.x)
      above += load_global(&st.runs[a][r]);
    above = block_reduce(above, SumOp(), scratch_u);
    unsigned long long at =
        above + block_exclusive_scan(thread_entries(keys.entries, distinct, a), scratch_u,
                                     static_cast<unsigned long long*>(nullptr));
    for (uint32_t i = 0; i < kBudgetKeysPerThread && q + i < distinct; ++i) {
      uint64_t* entry = keys.entries + 3 * static_cast<size_t>(q + i) + a;
      at += load_global(entry);
      store_global(entry, static_cast<uint64_t>(at));
    }
  }
}

}  // namespace

// The entries of each part cumulated from the largest key down, over kBudgetKeyRuns blocks of
// kBudgetRunThreads threads of kBudgetKeysPerThread entries each a part: first each run's totals,
__global__ void __launch_bounds__(kBudgetRunThreads)
    budget_runs_kernel(void* scratch, uint32_t n_parts, const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  __shared__ unsigned skip;
  for_each_row_part(scratch, n_parts, error, HopSource{}, &skip,
                    [&](const Scratch& s, uint32_t part, const HopProfile&) {
                      runs_of_part(s, part, scratch_u, &skip);
                    });
}

// then each entry's sum from the runs above its own and a block scan of its run.
__global__ void __launch_bounds__(kBudgetRunThreads)
    budget_cumulate_kernel(void* scratch, uint32_t n_parts, const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  __shared__ unsigned skip;
  for_each_row_part(scratch, n_parts, error, HopSource{}, &skip,
                    [&](const Scratch& s, uint32_t part, const HopProfile&) {
                      cumulate_part(s, part, scratch_u, &skip);
                    });
}

// One thread per candidate and one for the energy, the target and the plan used.
constexpr int kPartThreads = (kCandidates + 1 + kWarp - 1) / kWarp * kWarp;

namespace {

// Run by the whole last part block, after every part's terms are in the scratch: a part with a
// statistic that is not finite: no prediction; else the parts' terms added in part order (the
// host's), a thread per sum (the common sums, then each candidate's: add_part()'s bits), then the
// result.
__device__ void finish_call(const BudgetJob& job, const Scratch& s, uint32_t n_parts,
                            BudgetResult* out, unsigned long long* scratch_u) {
  unsigned long long bad = 0;
  for (uint32_t i = threadIdx.x; i < n_parts; i += blockDim.x) bad += s.parts[i].bad != 0 ? 1 : 0;
  if (block_reduce(bad, SumOp(), scratch_u) != 0) {
    if (threadIdx.x == 0) out->state = kBudgetNoPrediction;
    return;
  }
  BudgetAccumulator& acc = s.call->acc;  // zeroed by the set-up kernel
  const int c = static_cast<int>(threadIdx.x);
  if (c == kCandidates) {
    for (uint32_t i = 0; i < n_parts; ++i) add_part_common(job, s.terms[i], &acc);
  } else if (c < kCandidates && job.auto_budget) {
    for (uint32_t i = 0; i < n_parts; ++i)
      add_part_candidate(s.terms[i], c, s.parts[i].fits[c], i == 0, &acc);
  }
  __syncthreads();
  if (threadIdx.x == 0) finish_budget(job, acc, out);
}

}  // namespace

__global__ void __launch_bounds__(kPartThreads)
    budget_part_kernel(const BudgetJob* job_in, void* scratch, uint32_t n_parts, BudgetResult* out,
                       const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  __shared__ uint32_t below[kKeyGroups];
  __shared__ unsigned skip;
  if (block_skips(error, nullptr, &skip)) return;
  const uint32_t i = blockIdx.x;
  const Scratch s = scratch_of(scratch, n_parts);
  const BudgetPartState& st = s.parts[i];
  const uint32_t t = threadIdx.x;
  const BudgetJob& job = *job_in;
  PartTerms& terms = s.terms[i];
  if (st.bad == 0) {  // written by an earlier kernel: the same in every thread
    if (t == 0) terms = PartTerms{};
    const PartKeys keys = keys_of(s, i);
    rank_groups(keys.directory, below, scratch_u);  // ends with a barrier
    const PartSums sums{keys.directory,
                        below,
                        keys.entries,
                        static_cast<uint32_t>(st.distinct),
                        st.total_centred,
                        st.total_mean,
                        1.0 / fixed_point_scale(f64_of_bits(st.max_bits), st.n_sg)};
    const int c = static_cast<int>(t);
    if (c == kCandidates || (c < kCandidates && job.auto_budget))
      part_term(job, job.parts[i], sums, c, &terms);
  }
  __threadfence();  // each thread's terms, before the ticket
  __syncthreads();
  // The last part block to get here adds the terms: a ticket taken after this part's terms are
  // visible to the whole device, so no block ever waits for another (no co-residency needed).
  if (t == 0) {
    skip = atomic_add_global(&s.call->parts_done, 1ull) + 1 == n_parts ? 0u : 1u;
    __threadfence();  // with the last ticket: every part's terms are visible
  }
  __syncthreads();
  if (skip == 0) finish_call(job, s, n_parts, out, scratch_u);
}

size_t budget_scratch_bytes(const BudgetJob& job) {
  uint64_t entries = 0;
  for (uint32_t i = 0; i < job.n_parts; ++i) entries += budget_key_entries(job.parts[i].count);
  return budget_scratch_bytes(job.n_parts, entries);
}

cudaError_t launch_budget(const BudgetJob* job, const uint16_t* reduced, void* scratch,
                          size_t scratch_bytes, BudgetResult* out, const unsigned* error,
                          cudaStream_t stream) {
  if (job == nullptr || scratch == nullptr || out == nullptr) return cudaErrorInvalidValue;
  // The job is mapped memory the host wrote before this call: its geometry is read here, so the
  // grids fit the parts' super-groups and the scratch is known to hold every part's keys.
  const uint32_t n_parts = job->n_parts;
  if (n_parts > kBudgetMaxParts) return cudaErrorInvalidValue;
  // One pass over the parts: their key entries (the scratch must hold them) and a row of blocks
  // a part, as many as the largest part has tiles (parts of a call differ by one block's
  // remainder at most); at least 4, so the directory (1,020 words) is zeroed in a sweep.
  uint64_t entries = 0;
  unsigned long long tiles = 4;
  for (uint32_t i = 0; i < n_parts; ++i) {
    entries += budget_key_entries(job->parts[i].count);
    const unsigned long long n_sg = (job->parts[i].count + 255) / 256;
    const unsigned long long part_tiles = (n_sg + kGridThreads - 1) / kGridThreads;
    tiles = part_tiles > tiles ? part_tiles : tiles;
  }
  if (scratch_bytes < budget_scratch_bytes(n_parts, entries)) return cudaErrorInvalidValue;
  const int n_workers = job->n_workers;
  const size_t staged_bytes = static_cast<uint32_t>(n_workers) + 1 <= kBudgetStagedWorkers
                                  ? 2 * (static_cast<size_t>(n_workers) + 1) * sizeof(double)
                                  : 0;
  DQ_LAUNCH(budget_init_kernel, dim3(1), dim3(kGridThreads), 0, stream, job, scratch, out, error,
            n_parts);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (n_parts == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(tiles < kMaxGridBlocks ? tiles : kMaxGridBlocks);
  const unsigned rows = n_parts < kMaxGridRows ? n_parts : kMaxGridRows;
  DQ_LAUNCH(budget_extent_kernel, dim3(blocks, rows), dim3(kGridThreads), staged_bytes, stream,
            job->hop, n_workers, reduced, scratch, n_parts, error);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  DQ_LAUNCH(budget_keys_kernel, dim3(blocks, rows), dim3(kGridThreads), staged_bytes, stream,
            job->hop, n_workers, reduced, scratch, n_parts, error);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  DQ_LAUNCH(budget_sums_kernel, dim3(blocks, rows), dim3(kGridThreads), staged_bytes, stream,
            job->hop, n_workers, reduced, scratch, n_parts, error);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  DQ_LAUNCH(budget_runs_kernel, dim3(kBudgetKeyRuns, rows), dim3(kBudgetRunThreads), 0, stream,
            scratch, n_parts, error);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  DQ_LAUNCH(budget_cumulate_kernel, dim3(kBudgetKeyRuns, rows), dim3(kBudgetRunThreads), 0, stream,
            scratch, n_parts, error);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  DQ_LAUNCH(budget_part_kernel, dim3(n_parts), dim3(kPartThreads), 0, stream, job, scratch, n_parts,
            out, error);
  return cudaGetLastError();
}

// Every kernel of this file loaded now (the attributes query loads its module): at device set-up,
// never first mid-call.
cudaError_t load_budget_kernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_init_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_extent_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_keys_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_sums_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_runs_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_cumulate_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_part_kernel);
  return e;
}

}  // namespace dq::cuda
