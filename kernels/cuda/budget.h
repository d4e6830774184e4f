// The error-targeted budget's prediction on the device (DYNAMIQ_BITS=auto; docs/ENGINE.md, "The
// budget: a fixed one, or an error target"): kernels/budget_math.h's arithmetic as one kernel,
// with the bits of the host's run_budget_job() (kernels/budget_model.h), so a GPU chooses the next
// call's budget from the reduced statistics without the host reading them.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/budget_math.h"
#include "kernels/cuda/cuda_compat.h"

namespace dq::cuda {

// Threads of the kernel's one block.
constexpr int kBudgetThreads = 512;

// Device memory the kernel works in: per key, the count and the two fixed-point energies
// (kEnergyKeys + 1 entries each), reused part after part.
constexpr size_t budget_scratch_bytes() {
  return kBudgetScratchBytes;
}

// Enqueues the prediction of a call on `stream`: for each of job->n_parts parts in order, its
// statistics at reduced + stats_offset (device memory, kStatsWordsPerSupergroup BF16 words per
// super-group) summarised in `scratch` (budget_scratch_bytes() of device memory) and added to the
// call's sums; then
// *out (memory the host reads, e.g. mapped) as run_budget_job() writes it: kBudgetPredicted with
// the prediction, or kBudgetNoPrediction when a statistic is not finite. `job`, the parts and the
// hop tables it points to: memory the device reads (mapped), unchanged until the kernel completed.
// `error`: the lane's error word; when non-zero as the kernel starts, nothing is written (nullptr:
// no word). The kernel raises no flag of its own.
cudaError_t launch_budget(const BudgetJob* job, const uint16_t* reduced, void* scratch,
                          BudgetResult* out, const unsigned* error, cudaStream_t stream);

// Loads every kernel of budget.cu (device set-up; see cudaFuncGetAttributes in EMULATION.md).
cudaError_t load_budget_kernels();

}  // namespace dq::cuda
