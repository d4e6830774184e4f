// The error-targeted budget's prediction on the device (DYNAMIQ_BITS=auto; docs/ENGINE.md, "The
// budget: a fixed one, or an error target"): kernels/budget_math.h's arithmetic in a few kernels,
// with the bits of the host's run_budget_job() (kernels/budget_model.h), so a GPU chooses the next
// call's budget from the reduced statistics without the host reading them.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/budget_math.h"
#include "kernels/cuda/cuda_compat.h"

namespace dq::cuda {

// The per-key kernels: blocks of kBudgetRunThreads threads, kBudgetKeysPerThread consecutive keys
// a thread, kBudgetKeyRuns blocks.
constexpr uint32_t kBudgetRunThreads = 256, kBudgetKeysPerThread = 4;
constexpr uint32_t kBudgetKeyRuns = (kEnergyKeys + kBudgetRunThreads * kBudgetKeysPerThread - 1) /
                                    (kBudgetRunThreads * kBudgetKeysPerThread);
// Hop-table entries (n_workers + 1) the kernels stage in device and shared memory (2 tables of
// doubles: 32 KiB of shared memory at most); beyond, they read the job's mapped tables.
constexpr uint32_t kBudgetStagedWorkers = 2049;

// The call's running state in the scratch, after the per-key tables: one part's extent (the
// largest energy as its bit pattern, the largest floor(log2 energy) + 2048, the count of
// non-finite super-groups), its unweighted fixed-point energies, its key runs' totals (count and
// the two energies), whether the call has ended, and the call's sums over its parts.
struct BudgetScratchState {
  unsigned long long max_bits = 0, largest = 0, bad = 0;
  unsigned long long total_centred = 0, total_mean = 0;
  unsigned long long runs[3][kBudgetKeyRuns] = {};
  unsigned long long stop = 0;
  BudgetAccumulator acc;
};

// Device memory the kernels work in: per key, the count and the two fixed-point energies
// (kEnergyKeys + 1 entries each), reused part after part; the call's state; the staged hop tables.
constexpr size_t budget_scratch_bytes() {
  return kBudgetScratchBytes + sizeof(BudgetScratchState) +
         2 * kBudgetStagedWorkers * sizeof(double);
}

// Enqueues the prediction of a call on `stream`: for each of job->n_parts parts in order, its
// statistics at reduced + stats_offset (device memory, kStatsWordsPerSupergroup BF16 words per
// super-group) summarised in `scratch` (budget_scratch_bytes() of device memory) and added to the
// call's sums; then
// *out (memory the host reads, e.g. mapped) as run_budget_job() writes it: kBudgetPredicted with
// the prediction, or kBudgetNoPrediction when a statistic is not finite. `job`, the parts and the
// hop tables it points to: memory the device reads (mapped), unchanged until the kernels completed;
// the host reads job->n_parts, the parts' counts and offsets here (mapped memory is host memory),
// to size each part's grid. 1 + 5 n_parts launches.
// `error`: the lane's error word; when non-zero as a kernel starts, that kernel and (the word only
// ever gains flags) every later one write nothing (nullptr: no word). The kernels raise no flag of
// their own.
cudaError_t launch_budget(const BudgetJob* job, const uint16_t* reduced, void* scratch,
                          BudgetResult* out, const unsigned* error, cudaStream_t stream);

// Loads every kernel of budget.cu (device set-up; see cudaFuncGetAttributes in EMULATION.md).
cudaError_t load_budget_kernels();

}  // namespace dq::cuda
