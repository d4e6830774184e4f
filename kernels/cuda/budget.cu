// The budget's prediction (kernels/cuda/budget.h) over the whole grid: per part, the work that
// grows with the part's super-groups runs in as many blocks as it has tiles of them, and only the
// per-candidate terms (a constant) run in one block. Kernels, in stream order:
//  init (one block):   the call's state in the scratch zeroed, the accumulator cleared, the hop
//                      tables copied from the job's mapped memory into the scratch (device memory,
//                      so the blocks below stage them from L2 instead of over the bus);
//  then per part:
//  extent (grid):      the per-key tables zeroed; each super-group's energies (budget_math.h), a
//                      block max of the largest (fixes the fixed-point scale) and of the largest
//                      floor(log2 energy) (the width-key shift), a block count of "not finite";
//                      one 64-bit atomic max / add per block and quantity (a max of non-negative
//                      doubles is a max of their bit patterns);
//  sums (grid):        the per-key sums (integer atomics, whose totals do not depend on their
//                      order; summed per block in a shared-memory table of its keys first) and the
//                      part's unweighted energies (a block sum, then one atomic per block);
//  runs, cumulate (kBudgetKeyRuns blocks): the sums cumulated from the largest key down: each
//                      block's run of keys totalled, then each key's sum from the runs above its
//                      own and a block exclusive scan of its run;
//  part (one block):   one thread per candidate computes its term (a bisection of O(1) steps on
//                      the cumulated sums), thread 0 adds the terms to the call's sums in the
//                      host's order and, after the last part, writes the result (finish_budget).
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

// The geometry of one part, passed by value (the host reads it from the job at enqueue).
struct PartArgs {
  const uint16_t* reduced;  // the part's statistics
  unsigned long long n_elems, n_sg;
  int n_workers;
  uint32_t index, last;  // the part's index; 1 for the call's last part
};

// Where the kernels find the scratch's pieces.
struct Scratch {
  uint64_t* count;
  uint64_t* hop_centred;  // energies weighted by the hop profile
  uint64_t* hop_mean;
  BudgetScratchState* state;
  double* hop;  // linear[n + 1], square[n + 1] when staged (n < kBudgetStagedWorkers)
};

__device__ __forceinline__ Scratch scratch_of(void* base) {
  uint64_t* tables = static_cast<uint64_t*>(base);
  unsigned char* bytes = static_cast<unsigned char*>(base);
  return Scratch{
      tables, tables + (kKeys + 1), tables + 2 * (kKeys + 1),
      reinterpret_cast<BudgetScratchState*>(bytes + kBudgetScratchBytes),
      reinterpret_cast<double*>(bytes + kBudgetScratchBytes + sizeof(BudgetScratchState))};
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
// meanwhile) and the call's stop flag, read once by thread 0.
__device__ __forceinline__ bool block_skips(const unsigned* error, const BudgetScratchState* st,
                                            unsigned* shared_flag) {
  if (threadIdx.x == 0)
    *shared_flag = (error != nullptr && *error != 0) || (st != nullptr && st->stop != 0) ? 1u : 0u;
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

__global__ void __launch_bounds__(32)
    budget_init_kernel(const BudgetJob* job_in, void* scratch, BudgetResult* out,
                       const unsigned* error, uint32_t n_parts) {
  __shared__ unsigned skip;
  if (block_skips(error, nullptr, &skip)) return;
  const Scratch s = scratch_of(scratch);
  const BudgetJob& job = *job_in;
  const uint32_t entries = static_cast<uint32_t>(job.n_workers) + 1;
  if (entries <= kBudgetStagedWorkers)
    for (uint32_t k = threadIdx.x; k < entries; k += blockDim.x) {
      s.hop[k] = job.hop.linear[k];
      s.hop[entries + k] = job.hop.square[k];
    }
  if (threadIdx.x == 0) {
    *s.state = BudgetScratchState{};
    if (n_parts == 0) finish_budget(job, s.state->acc, out);
  }
}

__global__ void __launch_bounds__(kGridThreads)
    budget_extent_kernel(PartArgs a, HopProfile mapped, void* scratch, const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  __shared__ double scratch_d[kWarp + 1];
  __shared__ unsigned skip;
  DQ_DYNAMIC_SHARED(double, staged);
  const Scratch s = scratch_of(scratch);
  if (block_skips(error, s.state, &skip)) return;
  const uint32_t t = threadIdx.x;
  const unsigned long long first = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + t;
  const unsigned long long step = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long k = first; k <= kKeys; k += step)
    s.count[k] = s.hop_centred[k] = s.hop_mean[k] = 0;
  const HopProfile hop = stage_hop(s, mapped, a.n_workers, staged);
  double local_max = 0;
  unsigned long long bad = 0, largest = 0;  // floor(log2 energy) + 2048; 0: none
  SupergroupEnergy e;
  for (unsigned long long j = first; j < a.n_sg; j += step) {
    if (!supergroup_energy(a.reduced, j, a.n_sg, a.n_elems, a.n_workers, hop, 0, &e)) {
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
    atomicMax(&s.state->max_bits, static_cast<unsigned long long>(f64_bits_of(local_max)));
    atomicMax(&s.state->largest, largest);
    if (bad != 0) atomicAdd(&s.state->bad, bad);
  }
}

__global__ void __launch_bounds__(kGridThreads)
    budget_sums_kernel(PartArgs a, HopProfile mapped, void* scratch, const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  // The block's per-key sums (count, hop_centred, hop_mean) before the global atomics.
  __shared__ uint32_t slot_key[kKeySlots];
  __shared__ unsigned long long slot_sum[3 * kKeySlots];
  __shared__ unsigned skip;
  DQ_DYNAMIC_SHARED(double, staged);
  const Scratch s = scratch_of(scratch);
  if (block_skips(error, s.state, &skip)) return;
  BudgetScratchState& st = *s.state;
  // A part with a statistic that is not finite has no sums (the part kernel ends the call).
  if (st.bad != 0) return;  // written by the previous kernel: the same in every thread
  const HopProfile hop = stage_hop(s, mapped, a.n_workers, staged);
  const double max_value = f64_of_bits(st.max_bits);
  const unsigned long long largest = st.largest;
  const int shift = width_key_shift(largest == 0 ? INT32_MIN : static_cast<int>(largest) - 2048);
  const double scale = fixed_point_scale(max_value, a.n_sg);
  const unsigned long long first =
      static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const unsigned long long step = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (uint32_t k = threadIdx.x; k < kKeySlots; k += blockDim.x) slot_key[k] = kEmptySlot;
  for (uint32_t k = threadIdx.x; k < 3 * kKeySlots; k += blockDim.x) slot_sum[k] = 0;
  unsigned long long own_centred = 0, own_mean = 0;
  SupergroupEnergy e;
  // The same trips in every thread of the block: a sweep of the grid, then the block's keys
  // flushed (at most blockDim.x distinct keys a sweep).
  for (unsigned long long at = first - threadIdx.x; at < a.n_sg; at += step) {
    __syncthreads();  // the slots are empty
    const unsigned long long j = at + threadIdx.x;
    if (j < a.n_sg) {
      supergroup_energy(a.reduced, j, a.n_sg, a.n_elems, a.n_workers, hop, shift, &e);
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
      atomicAdd(as_ull(&s.count[key]), slot_sum[k]);
      atomicAdd(as_ull(&s.hop_centred[key]), slot_sum[kKeySlots + k]);
      atomicAdd(as_ull(&s.hop_mean[key]), slot_sum[2 * kKeySlots + k]);
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

// The per-key sums cumulated from the largest key down, over kBudgetKeyRuns blocks of
// kBudgetRunThreads threads of kBudgetKeysPerThread keys each (descending): first each run's
// totals,
__global__ void __launch_bounds__(kBudgetRunThreads)
    budget_runs_kernel(void* scratch, const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  __shared__ unsigned skip;
  const Scratch s = scratch_of(scratch);
  if (block_skips(error, s.state, &skip)) return;
  if (s.state->bad != 0) return;  // written by an earlier kernel: the same in every thread
  const uint64_t* tab[3] = {s.count, s.hop_centred, s.hop_mean};
  for (int a = 0; a < 3; ++a) {
    const unsigned long long total = block_reduce(thread_keys(tab[a]), SumOp(), scratch_u);
    if (threadIdx.x == 0) s.state->runs[a][blockIdx.x] = total;
  }
}

// then each key's sum from the runs above its own and a block scan of its run.
__global__ void __launch_bounds__(kBudgetRunThreads)
    budget_cumulate_kernel(void* scratch, const unsigned* error) {
  __shared__ unsigned long long scratch_u[kWarp + 1];
  __shared__ unsigned skip;
  const Scratch s = scratch_of(scratch);
  if (block_skips(error, s.state, &skip)) return;
  if (s.state->bad != 0) return;  // written by an earlier kernel: the same in every thread
  const uint32_t q = (blockIdx.x * blockDim.x + threadIdx.x) * kBudgetKeysPerThread;
  for (int a = 0; a < 3; ++a) {
    uint64_t* tab = a == 0 ? s.count : a == 1 ? s.hop_centred : s.hop_mean;
    unsigned long long above = 0;
    for (uint32_t r = threadIdx.x; r < blockIdx.x; r += blockDim.x) above += s.state->runs[a][r];
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

__global__ void __launch_bounds__(kPartThreads)
    budget_part_kernel(const BudgetJob* job_in, PartArgs a, void* scratch, BudgetResult* out,
                       const unsigned* error) {
  // Raw storage: a __shared__ object cannot have a constructor; thread 0 assigns it.
  __shared__ double terms_raw[(sizeof(PartTerms) + 7) / 8];
  __shared__ unsigned skip;
  const Scratch s = scratch_of(scratch);
  if (block_skips(error, s.state, &skip)) return;
  PartTerms& terms = *reinterpret_cast<PartTerms*>(terms_raw);
  BudgetScratchState& st = *s.state;
  const uint32_t t = threadIdx.x;
  const BudgetJob& job = *job_in;
  const BudgetPartJob& part = job.parts[a.index];
  if (st.bad != 0) {  // written by an earlier kernel: the same in every thread
    if (t == 0) {
      out->state = kBudgetNoPrediction;
      st.stop = 1;
    }
    return;
  }
  if (t == 0) terms = PartTerms{};
  __syncthreads();
  const double scale = fixed_point_scale(f64_of_bits(st.max_bits), a.n_sg);
  const BudgetSums sums{s.count,          s.hop_centred, s.hop_mean,
                        st.total_centred, st.total_mean, 1.0 / scale};
  const int c = static_cast<int>(t);
  if (c == kCandidates || (c < kCandidates && job.auto_budget))
    part_term(job, part, sums, c, &terms);
  __syncthreads();
  if (t == 0) {
    add_part(job, part, terms, &st.acc);
    if (a.last != 0) finish_budget(job, st.acc, out);
    // The next part's extent kernel accumulates into these.
    st.max_bits = st.largest = st.bad = st.total_centred = st.total_mean = 0;
  }
}

cudaError_t launch_budget(const BudgetJob* job, const uint16_t* reduced, void* scratch,
                          BudgetResult* out, const unsigned* error, cudaStream_t stream) {
  if (job == nullptr || scratch == nullptr || out == nullptr) return cudaErrorInvalidValue;
  // The job is mapped memory the host wrote before this call: its geometry is read here, so each
  // part's grid fits its super-groups.
  const uint32_t n_parts = job->n_parts;
  const int n_workers = job->n_workers;
  const size_t staged_bytes = static_cast<uint32_t>(n_workers) + 1 <= kBudgetStagedWorkers
                                  ? 2 * (static_cast<size_t>(n_workers) + 1) * sizeof(double)
                                  : 0;
  DQ_LAUNCH(budget_init_kernel, dim3(1), dim3(32), 0, stream, job, scratch, out, error, n_parts);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  for (uint32_t i = 0; i < n_parts; ++i) {
    const BudgetPartJob& part = job->parts[i];
    PartArgs a{reduced + part.stats_offset, part.count, (part.count + 255) / 256, n_workers, i,
               i + 1 == n_parts ? 1u : 0u};
    const unsigned long long tiles = (a.n_sg + kGridThreads - 1) / kGridThreads;
    // At least a few blocks to zero the tables (grid-stride).
    const unsigned long long want = tiles > 8 ? tiles : 8;
    const unsigned blocks = static_cast<unsigned>(want < kMaxGridBlocks ? want : kMaxGridBlocks);
    DQ_LAUNCH(budget_extent_kernel, dim3(blocks), dim3(kGridThreads), staged_bytes, stream, a,
              job->hop, scratch, error);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    DQ_LAUNCH(budget_sums_kernel, dim3(blocks), dim3(kGridThreads), staged_bytes, stream, a,
              job->hop, scratch, error);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    DQ_LAUNCH(budget_runs_kernel, dim3(kBudgetKeyRuns), dim3(kBudgetRunThreads), 0, stream, scratch,
              error);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    DQ_LAUNCH(budget_cumulate_kernel, dim3(kBudgetKeyRuns), dim3(kBudgetRunThreads), 0, stream,
              scratch, error);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    DQ_LAUNCH(budget_part_kernel, dim3(1), dim3(kPartThreads), 0, stream, job, a, scratch, out,
              error);
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
