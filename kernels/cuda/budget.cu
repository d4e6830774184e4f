// The budget's prediction (kernels/cuda/budget.h) over the whole grid, the parts of a wave (up to
// kBudgetWaveParts parts, a row of the grid a part, blockIdx.y) at once, so a call of up to that
// many parts takes a constant number of launches (6) and a larger one 5 more a wave (the waves
// bound the per-key tables' memory): the work that grows with a part's super-groups runs in as
// many blocks as it has tiles of them, and only the per-candidate terms (a constant a part) run in
// one block a part. Kernels, in stream order:
//  init (one block):   the call's state and every part's state in the scratch zeroed, the parts'
//                      geometry and the hop tables copied from the job's mapped memory into the
//                      scratch (device memory, so the blocks below read them from L2 instead of
//                      over the bus);
//  then per wave:
//  extent (grid):      each part's per-key tables zeroed; each super-group's energies
//                      (budget_math.h), a block max of the largest (fixes the part's fixed-point
//                      scale) and of the largest floor(log2 energy) (the width-key shift), a block
//                      count of "not finite"; one 64-bit atomic max / add per block and quantity
//                      (a max of non-negative doubles is a max of their bit patterns);
//  sums (grid):        the per-key sums (integer atomics, whose totals do not depend on their
//                      order; summed per block in a shared-memory table of its keys first) and the
//                      part's unweighted energies (a block sum, then one atomic per block);
//  runs, cumulate (kBudgetKeyRuns blocks a part): the sums cumulated from the largest key down:
//                      each block's run of keys totalled, then each key's sum from the runs above
//                      its own and a block exclusive scan of its run;
//  part (one block a part): one thread per candidate computes its term (a bisection of O(1) steps
//                      on the cumulated sums) into the scratch (every part's terms are kept); the
//                      call's last part block to finish (a ticket after a fence, so no block waits
//                      for another) adds every part's terms in part order, as the host does, and
//                      writes the result (finish_budget).
// Every step is the host's arithmetic on the same values, so the result has the host's bits. The
// hop tables live in shared memory in the grid kernels (dynamic, 16 (n + 1) bytes).
#include "kernels/cuda/budget.h"

#include "kernels/cuda/block.cuh"

namespace dq::cuda {
namespace {

constexpr uint32_t kKeys = kEnergyKeys;
constexpr int kGridThreads = 256;     // threads of a grid kernel's block
constexpr int kMaxGridBlocks = 1024;  // a grid kernel's blocks at most (grid-stride beyond)

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
  uint64_t* tables;  // per part of a wave: count, hop_centred, hop_mean (kKeys + 1 entries each)
};

__device__ __forceinline__ Scratch scratch_of(void* base, uint32_t n_parts) {
  unsigned char* bytes = static_cast<unsigned char*>(base);
  unsigned char* parts = bytes + kBudgetCallBytes;
  unsigned char* terms = parts + n_parts * sizeof(BudgetPartState);
  unsigned char* tables = terms + n_parts * sizeof(PartTerms);
  return Scratch{reinterpret_cast<BudgetCallState*>(bytes),
                 reinterpret_cast<double*>(bytes + sizeof(BudgetCallState)),
                 reinterpret_cast<BudgetPartState*>(parts), reinterpret_cast<PartTerms*>(terms),
                 reinterpret_cast<uint64_t*>(tables)};
}

// The per-key tables of the wave's part in row `slot`.
struct PartTables {
  uint64_t* count;
  uint64_t* hop_centred;  // energies weighted by the hop profile
  uint64_t* hop_mean;
};

__device__ __forceinline__ PartTables tables_of(const Scratch& s, uint32_t slot) {
  uint64_t* t = s.tables + static_cast<size_t>(slot) * 3 * (kKeys + 1);
  return PartTables{t, t + (kKeys + 1), t + 2 * (kKeys + 1)};
}

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
// an earlier kernel), read once by thread 0.
__device__ __forceinline__ bool block_skips(const unsigned* error, const BudgetPartState* part,
                                            unsigned* shared_flag) {
  if (threadIdx.x == 0)
    *shared_flag =
        (error != nullptr && *error != 0) || (part != nullptr && part->bad != 0) ? 1u : 0u;
  __syncthreads();
  return *shared_flag != 0;
}

// The hop tables in shared memory `staged` (2 (n + 1) doubles) when the scratch holds a copy;
// the job's mapped tables otherwise. Ends with a barrier.
__device__ HopProfile stage_hop(const Scratch& s, const HopProfile& mapped, int n_workers,
                                double* staged) {
  const uint32_t entries = static_cast<uint32_t>(n_workers) + 1;
  if (entries > kBudgetStagedWorkers) return mapped;  // every block takes the same branch
  for (uint32_t k = threadIdx.x; k < 2 * entries; k += blockDim.x) staged[k] = s.hop[k];
  __syncthreads();
  return HopProfile{staged, staged + entries};
}

}  // namespace

__global__ void __launch_bounds__(kGridThreads)
    budget_init_kernel(const BudgetJob* job_in, void* scratch, BudgetResult* out,
                       const unsigned* error, uint32_t n_parts) {
  __shared__ unsigned skip;
  if (block_skips(error, nullptr, &skip)) return;
  const Scratch s = scratch_of(scratch, n_parts);
  const BudgetJob& job = *job_in;
  const uint32_t entries = static_cast<uint32_t>(job.n_workers) + 1;
  if (entries <= kBudgetStagedWorkers)
    for (uint32_t k = threadIdx.x; k < entries; k += blockDim.x) {
      s.hop[k] = job.hop.linear[k];
      s.hop[entries + k] = job.hop.square[k];
    }
  for (uint32_t i = threadIdx.x; i < n_parts; i += blockDim.x) {
    const BudgetPartJob& part = job.parts[i];
    BudgetPartState st;
    st.n_elems = part.count;
    st.n_sg = (part.count + 255) / 256;
    st.stats_offset = part.stats_offset;
    s.parts[i] = st;
  }
  if (threadIdx.x == 0) {
    *s.call = BudgetCallState{};
    if (n_parts == 0) finish_budget(job, s.call->acc, out);
  }
}

__global__ void __launch_bounds__(kGridThreads)
    budget_extent_kernel(HopProfile mapped, int n_workers, const uint16_t* reduced, void* scratch,
                         uint32_t n_parts, uint32_t first_part, const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  __shared__ double scratch_d[kWarp + 1];
  __shared__ unsigned skip;
  DQ_DYNAMIC_SHARED(double, staged);
  if (block_skips(error, nullptr, &skip)) return;
  const Scratch s = scratch_of(scratch, n_parts);
  BudgetPartState& ps = s.parts[first_part + blockIdx.y];
  const PartTables tab = tables_of(s, blockIdx.y);
  const uint32_t t = threadIdx.x;
  const unsigned long long first = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + t;
  const unsigned long long step = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long k = first; k <= kKeys; k += step)
    tab.count[k] = tab.hop_centred[k] = tab.hop_mean[k] = 0;
  const HopProfile hop = stage_hop(s, mapped, n_workers, staged);
  const uint16_t* stats = reduced + ps.stats_offset;
  const unsigned long long n_sg = ps.n_sg, n_elems = ps.n_elems;
  double local_max = 0;
  unsigned long long bad = 0, largest = 0;  // floor(log2 energy) + 2048; 0: none
  SupergroupEnergy e;
  for (unsigned long long j = first; j < n_sg; j += step) {
    if (!supergroup_energy(stats, j, n_sg, n_elems, n_workers, hop, 0, &e)) {
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
  if (t == 0) {
    // Non-negative doubles order as their bit patterns.
    atomicMax(&ps.max_bits, static_cast<unsigned long long>(f64_bits_of(local_max)));
    atomicMax(&ps.largest, largest);
    if (bad != 0) atomicAdd(&ps.bad, bad);
  }
}

__global__ void __launch_bounds__(kGridThreads)
    budget_sums_kernel(HopProfile mapped, int n_workers, const uint16_t* reduced, void* scratch,
                       uint32_t n_parts, uint32_t first_part, const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  // The block's per-key sums (count, hop_centred, hop_mean) before the global atomics.
  __shared__ uint32_t slot_key[kKeySlots];
  __shared__ unsigned long long slot_sum[3 * kKeySlots];
  __shared__ unsigned skip;
  DQ_DYNAMIC_SHARED(double, staged);
  const Scratch s = scratch_of(scratch, n_parts);
  BudgetPartState& st = s.parts[first_part + blockIdx.y];
  // A part with a statistic that is not finite has no sums (the part kernel ends the call).
  if (block_skips(error, &st, &skip)) return;
  const PartTables tab = tables_of(s, blockIdx.y);
  const HopProfile hop = stage_hop(s, mapped, n_workers, staged);
  const uint16_t* stats = reduced + st.stats_offset;
  const unsigned long long n_sg = st.n_sg, n_elems = st.n_elems;
  const double max_value = f64_of_bits(st.max_bits);
  const unsigned long long largest = st.largest;
  const int shift = width_key_shift(largest == 0 ? INT32_MIN : static_cast<int>(largest) - 2048);
  const double scale = fixed_point_scale(max_value, n_sg);
  const unsigned long long first =
      static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const unsigned long long step = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (uint32_t k = threadIdx.x; k < kKeySlots; k += blockDim.x) slot_key[k] = kEmptySlot;
  for (uint32_t k = threadIdx.x; k < 3 * kKeySlots; k += blockDim.x) slot_sum[k] = 0;
  unsigned long long own_centred = 0, own_mean = 0;
  SupergroupEnergy e;
  // The same trips in every thread of the block: a sweep of the grid, then the block's keys
  // flushed (at most blockDim.x distinct keys a sweep).
  for (unsigned long long at = first - threadIdx.x; at < n_sg; at += step) {
    __syncthreads();  // the slots are empty
    const unsigned long long j = at + threadIdx.x;
    if (j < n_sg) {
      supergroup_energy(stats, j, n_sg, n_elems, n_workers, hop, shift, &e);
      const uint32_t k = key_slot(slot_key, e.key);
      atomicAdd(&slot_sum[k], 1ull);
      atomicAdd(&slot_sum[kKeySlots + k],
                static_cast<unsigned long long>(to_fixed_point(e.hop_centred, scale)));
      atomicAdd(&slot_sum[2 * kKeySlots + k],
                static_cast<unsigned long long>(to_fixed_point(e.hop_mean, scale)));
      own_centred += to_fixed_point(e.centred, scale);
      own_mean += to_fixed_point(e.mean, scale);
    }
    __syncthreads();
    for (uint32_t k = threadIdx.x; k < kKeySlots; k += blockDim.x) {
      const uint32_t key = slot_key[k];
      if (key == kEmptySlot) continue;
      atomicAdd(as_ull(&tab.count[key]), slot_sum[k]);
      atomicAdd(as_ull(&tab.hop_centred[key]), slot_sum[kKeySlots + k]);
      atomicAdd(as_ull(&tab.hop_mean[key]), slot_sum[2 * kKeySlots + k]);
      slot_key[k] = kEmptySlot;
      slot_sum[k] = slot_sum[kKeySlots + k] = slot_sum[2 * kKeySlots + k] = 0;
    }
  }
  own_centred = block_reduce(own_centred, SumOp(), scratch_u);
  own_mean = block_reduce(own_mean, SumOp(), scratch_u);
  if (threadIdx.x == 0) {
    atomicAdd(&st.total_centred, own_centred);
    atomicAdd(&st.total_mean, own_mean);
  }
}

namespace {

// The key at descending position q (q = 0: the largest key); 0 past the keys.
__device__ __forceinline__ unsigned long long key_at(const uint64_t* tab, uint32_t q) {
  return q < kKeys ? tab[kKeys - 1 - q] : 0ull;
}

}  // namespace

// The sum of the kKeysPerThread consecutive keys (descending) of this thread's.
__device__ __forceinline__ unsigned long long thread_keys(const uint64_t* tab) {
  const uint32_t q = (blockIdx.x * blockDim.x + threadIdx.x) * kBudgetKeysPerThread;
  unsigned long long sum = 0;
  for (uint32_t i = 0; i < kBudgetKeysPerThread; ++i) sum += key_at(tab, q + i);
  return sum;
}

// The per-key sums of each part cumulated from the largest key down, over kBudgetKeyRuns blocks
// of kBudgetRunThreads threads of kBudgetKeysPerThread keys each (descending) a part: first each
// run's totals,
__global__ void __launch_bounds__(kBudgetRunThreads)
    budget_runs_kernel(void* scratch, uint32_t n_parts, uint32_t first_part,
                       const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  __shared__ unsigned skip;
  const Scratch s = scratch_of(scratch, n_parts);
  BudgetPartState& st = s.parts[first_part + blockIdx.y];
  if (block_skips(error, &st, &skip)) return;
  const PartTables p = tables_of(s, blockIdx.y);
  const uint64_t* tab[3] = {p.count, p.hop_centred, p.hop_mean};
  for (int a = 0; a < 3; ++a) {
    const unsigned long long total = block_reduce(thread_keys(tab[a]), SumOp(), scratch_u);
    if (threadIdx.x == 0) st.runs[a][blockIdx.x] = total;
  }
}

// then each key's sum from the runs above its own and a block scan of its run.
__global__ void __launch_bounds__(kBudgetRunThreads)
    budget_cumulate_kernel(void* scratch, uint32_t n_parts, uint32_t first_part,
                           const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  __shared__ unsigned skip;
  const Scratch s = scratch_of(scratch, n_parts);
  const BudgetPartState& st = s.parts[first_part + blockIdx.y];
  if (block_skips(error, &st, &skip)) return;
  const PartTables p = tables_of(s, blockIdx.y);
  const uint32_t q = (blockIdx.x * blockDim.x + threadIdx.x) * kBudgetKeysPerThread;
  for (int a = 0; a < 3; ++a) {
    uint64_t* tab = a == 0 ? p.count : a == 1 ? p.hop_centred : p.hop_mean;
    unsigned long long above = 0;
    for (uint32_t r = threadIdx.x; r < blockIdx.x; r += blockDim.x) above += st.runs[a][r];
    above = block_reduce(above, SumOp(), scratch_u);
    unsigned long long at = above + block_exclusive_scan(thread_keys(tab), scratch_u,
                                                         static_cast<unsigned long long*>(nullptr));
    for (uint32_t i = 0; i < kBudgetKeysPerThread && q + i < kKeys; ++i) {
      at += tab[kKeys - 1 - (q + i)];
      tab[kKeys - 1 - (q + i)] = at;
    }
  }
}

// One thread per candidate and one for the energy, the target and the plan used.
constexpr int kPartThreads = (kCandidates + 1 + kWarp - 1) / kWarp * kWarp;

namespace {

// Run by one thread, after every part's terms are in the scratch: the parts' terms added in part
// order (the host's), then the result; a part with a statistic that is not finite: no prediction.
__device__ void finish_call(const BudgetJob& job, const Scratch& s, uint32_t n_parts,
                            BudgetResult* out) {
  BudgetAccumulator& acc = s.call->acc;  // zeroed by the set-up kernel
  for (uint32_t i = 0; i < n_parts; ++i) {
    if (s.parts[i].bad != 0) {
      out->state = kBudgetNoPrediction;
      return;
    }
    add_part(job, job.parts[i], s.terms[i], &acc);
  }
  finish_budget(job, acc, out);
}

}  // namespace

__global__ void __launch_bounds__(kPartThreads)
    budget_part_kernel(const BudgetJob* job_in, void* scratch, uint32_t n_parts,
                       uint32_t first_part, BudgetResult* out, const unsigned* error) {
  __shared__ unsigned skip;
  if (block_skips(error, nullptr, &skip)) return;
  const uint32_t i = first_part + blockIdx.x;
  const Scratch s = scratch_of(scratch, n_parts);
  const BudgetPartState& st = s.parts[i];
  const uint32_t t = threadIdx.x;
  const BudgetJob& job = *job_in;
  PartTerms& terms = s.terms[i];
  if (st.bad == 0) {  // written by an earlier kernel: the same in every thread
    if (t == 0) terms = PartTerms{};
    __syncthreads();
    const double scale = fixed_point_scale(f64_of_bits(st.max_bits), st.n_sg);
    const PartTables tab = tables_of(s, blockIdx.x);
    const BudgetSums sums{tab.count,        tab.hop_centred, tab.hop_mean,
                          st.total_centred, st.total_mean,   1.0 / scale};
    const int c = static_cast<int>(t);
    if (c == kCandidates || (c < kCandidates && job.auto_budget))
      part_term(job, job.parts[i], sums, c, &terms);
  }
  __syncthreads();
  // The last part block to get here (of the last wave: earlier waves completed before it started)
  // adds the terms: a ticket taken after this part's terms are visible to the whole device, so no
  // block ever waits for another (no co-residency needed).
  if (t == 0) {
    __threadfence();
    const unsigned long long ticket = atomicAdd(&s.call->parts_done, 1ull);
    if (ticket + 1 == n_parts) {
      __threadfence();  // every part's terms are visible
      finish_call(job, s, n_parts, out);
    }
  }
}

cudaError_t launch_budget(const BudgetJob* job, const uint16_t* reduced, void* scratch,
                          size_t scratch_bytes, BudgetResult* out, const unsigned* error,
                          cudaStream_t stream) {
  if (job == nullptr || scratch == nullptr || out == nullptr) return cudaErrorInvalidValue;
  // The job is mapped memory the host wrote before this call: its geometry is read here, so the
  // grids fit the parts' super-groups.
  const uint32_t n_parts = job->n_parts;
  if (n_parts > kBudgetMaxParts || scratch_bytes < budget_scratch_bytes(n_parts))
    return cudaErrorInvalidValue;
  const int n_workers = job->n_workers;
  const size_t staged_bytes = static_cast<uint32_t>(n_workers) + 1 <= kBudgetStagedWorkers
                                  ? 2 * (static_cast<size_t>(n_workers) + 1) * sizeof(double)
                                  : 0;
  DQ_LAUNCH(budget_init_kernel, dim3(1), dim3(kGridThreads), 0, stream, job, scratch, out, error,
            n_parts);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (n_parts == 0) return cudaSuccess;
  // A row of blocks a part, as many as the largest part has tiles (parts of a call differ by one
  // block's remainder at most); at least a few blocks to zero the tables (grid-stride).
  unsigned long long tiles = 8;
  for (uint32_t i = 0; i < n_parts; ++i) {
    const unsigned long long n_sg = (job->parts[i].count + 255) / 256;
    const unsigned long long part_tiles = (n_sg + kGridThreads - 1) / kGridThreads;
    tiles = part_tiles > tiles ? part_tiles : tiles;
  }
  const unsigned blocks = static_cast<unsigned>(tiles < kMaxGridBlocks ? tiles : kMaxGridBlocks);
  // Waves of up to kBudgetWaveParts parts, each wave's tables in the same rows of the scratch.
  for (uint32_t first = 0; first < n_parts; first += kBudgetWaveParts) {
    const uint32_t wave = n_parts - first < kBudgetWaveParts ? n_parts - first : kBudgetWaveParts;
    DQ_LAUNCH(budget_extent_kernel, dim3(blocks, wave), dim3(kGridThreads), staged_bytes, stream,
              job->hop, n_workers, reduced, scratch, n_parts, first, error);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    DQ_LAUNCH(budget_sums_kernel, dim3(blocks, wave), dim3(kGridThreads), staged_bytes, stream,
              job->hop, n_workers, reduced, scratch, n_parts, first, error);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    DQ_LAUNCH(budget_runs_kernel, dim3(kBudgetKeyRuns, wave), dim3(kBudgetRunThreads), 0, stream,
              scratch, n_parts, first, error);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    DQ_LAUNCH(budget_cumulate_kernel, dim3(kBudgetKeyRuns, wave), dim3(kBudgetRunThreads), 0,
              stream, scratch, n_parts, first, error);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    DQ_LAUNCH(budget_part_kernel, dim3(wave), dim3(kPartThreads), 0, stream, job, scratch, n_parts,
              first, out, error);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// Every kernel of this file loaded now (the attributes query loads its module): at device set-up,
// never first mid-call.
cudaError_t load_budget_kernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_init_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_extent_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_sums_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_runs_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_cumulate_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_part_kernel);
  return e;
}

}  // namespace dq::cuda
