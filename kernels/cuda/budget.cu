// The budget's prediction as one block (kernels/cuda/budget.h). Per part, in phases separated by
// barriers:
//  1. zero the per-key tables;
//  2. each super-group's energies (budget_math.h): a block max of the largest (order does not
//     matter for a max) fixes the fixed-point scale, a block OR of "not finite" ends the job;
//  3. the per-key sums: integer atomics, whose totals do not depend on their order (the part's
//     unweighted energies: a block sum of integers);
//  4. the sums cumulated from the largest key down: each thread owns a run of consecutive keys,
//     a block exclusive scan of the runs' totals gives each run its start;
//  5. one thread per candidate (and one for the energy, the target and the plan used) computes
//     its term of the part; thread 0 adds the terms to the call's sums in the host's order.
// Finally thread 0 writes the result (finish_budget). Every step is the host's arithmetic on the
// same values, so the result has the host's bits.
#include "kernels/cuda/budget.h"

#include "kernels/cuda/block.cuh"

namespace dq::cuda {
namespace {

constexpr uint32_t kKeys = kEnergyKeys;
// Keys per thread in phase 4: the kKeys keys in runs of equal length (the last threads' runs
// may be short or empty).
constexpr uint32_t kRun = (kKeys + kBudgetThreads - 1) / kBudgetThreads;

// The tables are uint64_t (the host's type); CUDA's 64-bit atomics take unsigned long long.
static_assert(sizeof(unsigned long long) == sizeof(uint64_t), "64-bit atomics");
__device__ __forceinline__ unsigned long long* as_ull(uint64_t* p) {
  return reinterpret_cast<unsigned long long*>(p);
}

}  // namespace

__global__ void __launch_bounds__(kBudgetThreads)
    budget_kernel(const BudgetJob* job_in, const uint16_t* reduced, uint64_t* tables,
                  BudgetResult* out, const unsigned* error) {
  __shared__ unsigned long long scratch[kWarp + 1];
  __shared__ double scratch_d[kWarp + 1];
  // Raw storage: a __shared__ object cannot have a constructor; thread 0 assigns it.
  __shared__ double terms_raw[(sizeof(PartTerms) + 7) / 8];
  __shared__ double acc_raw[(sizeof(BudgetAccumulator) + 7) / 8];
  __shared__ unsigned skip;
  PartTerms& terms = *reinterpret_cast<PartTerms*>(terms_raw);
  BudgetAccumulator& acc = *reinterpret_cast<BudgetAccumulator*>(acc_raw);
  const uint32_t t = threadIdx.x, nt = blockDim.x;
  // The error word may be raised meanwhile by the other stream's kernels: one read, shared, so
  // the whole block takes the same branch before any barrier.
  if (t == 0) skip = error != nullptr && *error != 0 ? 1u : 0u;
  __syncthreads();
  if (skip != 0) return;
  const BudgetJob job = *job_in;
  uint64_t* count = tables;
  uint64_t* hop_centred = tables + (kKeys + 1);  // energies weighted by the hop profile
  uint64_t* hop_mean = tables + 2 * (kKeys + 1);
  if (t == 0) acc = BudgetAccumulator{};
  bool finite = true;
  for (uint32_t i = 0; i < job.n_parts && finite; ++i) {  // the same trips in every thread
    const BudgetPartJob* part = job.parts + i;
    const unsigned long long n_elems = part->count;
    const unsigned long long n_sg = (n_elems + 255) / 256;
    const uint16_t* r = reduced + part->stats_offset;
    // 1.
    for (uint32_t k = t; k <= kKeys; k += nt) count[k] = hop_centred[k] = hop_mean[k] = 0;
    // 2.
    double local_max = 0;
    unsigned long long bad = 0, largest = 0;  // floor(log2 energy) + 2048; 0: none
    SupergroupEnergy e;
    for (unsigned long long j = t; j < n_sg; j += nt) {
      if (!supergroup_energy(r, j, n_sg, n_elems, job.n_workers, job.hop, 0, &e)) {
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
    const double max_value = block_reduce(local_max, MaxOp(), scratch_d);
    largest = block_reduce(largest, MaxOp(), scratch);
    const int shift = width_key_shift(largest == 0 ? INT32_MIN : static_cast<int>(largest) - 2048);
    finite = block_reduce(bad, SumOp(), scratch) == 0;  // every thread: the same value
    if (!finite) break;
    // 3. (block_reduce ended with a barrier: the tables are zero)
    const double scale = fixed_point_scale(max_value, n_sg);
    unsigned long long own_centred = 0, own_mean = 0;
    for (unsigned long long j = t; j < n_sg; j += nt) {
      supergroup_energy(r, j, n_sg, n_elems, job.n_workers, job.hop, shift, &e);
      atomicAdd(as_ull(&count[e.key]), 1ull);
      atomicAdd(as_ull(&hop_centred[e.key]),
                static_cast<unsigned long long>(to_fixed_point(e.hop_centred, scale)));
      atomicAdd(as_ull(&hop_mean[e.key]),
                static_cast<unsigned long long>(to_fixed_point(e.hop_mean, scale)));
      own_centred += to_fixed_point(e.centred, scale);
      own_mean += to_fixed_point(e.mean, scale);
    }
    // block_reduce ends with a barrier: the atomics are done when it returns.
    const unsigned long long total_centred = block_reduce(own_centred, SumOp(), scratch);
    const unsigned long long total_mean = block_reduce(own_mean, SumOp(), scratch);
    // 4. Thread t owns the keys at descending positions [t kRun, (t + 1) kRun).
    const uint32_t begin = t * kRun < kKeys ? t * kRun : kKeys;
    const uint32_t end = begin + kRun < kKeys ? begin + kRun : kKeys;
    uint64_t* tab[3] = {count, hop_centred, hop_mean};
    unsigned long long run[3] = {0, 0, 0};
    for (uint32_t q = begin; q < end; ++q)
      for (int a = 0; a < 3; ++a) run[a] += tab[a][kKeys - 1 - q];
    for (int a = 0; a < 3; ++a) {
      unsigned long long above =
          block_exclusive_scan(run[a], scratch, static_cast<unsigned long long*>(nullptr));
      for (uint32_t q = begin; q < end; ++q) {
        above += tab[a][kKeys - 1 - q];
        tab[a][kKeys - 1 - q] = above;
      }
    }
    __syncthreads();
    // 5.
    if (t == 0) terms = PartTerms{};
    __syncthreads();
    const BudgetSums sums{count, hop_centred, hop_mean, total_centred, total_mean, 1.0 / scale};
    const int c = static_cast<int>(t);
    if (c == kCandidates || (c < kCandidates && job.auto_budget))
      part_term(job, *part, sums, c, &terms);
    __syncthreads();
    if (t == 0) add_part(job, *part, terms, &acc);
    __syncthreads();  // the tables are reused by the next part
  }
  if (t == 0) {
    if (finite)
      finish_budget(job, acc, out);
    else
      out->state = kBudgetNoPrediction;
  }
}

cudaError_t launch_budget(const BudgetJob* job, const uint16_t* reduced, void* scratch,
                          BudgetResult* out, const unsigned* error, cudaStream_t stream) {
  if (job == nullptr || scratch == nullptr || out == nullptr) return cudaErrorInvalidValue;
  DQ_LAUNCH(budget_kernel, dim3(1), dim3(kBudgetThreads), 0, stream, job, reduced,
            static_cast<uint64_t*>(scratch), out, error);
  return cudaGetLastError();
}

// Every kernel of this file loaded now (the attributes query loads its module): at device set-up,
// never first mid-call.
cudaError_t load_budget_kernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, budget_kernel);
  return e;
}

}  // namespace dq::cuda
