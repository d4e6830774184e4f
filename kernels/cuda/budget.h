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

// The kernels over a part's key entries (runs, cumulate): blocks of kBudgetRunThreads threads,
// kBudgetKeysPerThread consecutive entries a thread, kBudgetKeyRuns blocks a part (enough for one
// entry per key, kEnergyKeys).
constexpr uint32_t kBudgetRunThreads = 256, kBudgetKeysPerThread = 4;
constexpr uint32_t kBudgetKeyRuns = (kEnergyKeys + kBudgetRunThreads * kBudgetKeysPerThread - 1) /
                                    (kBudgetRunThreads * kBudgetKeysPerThread);
// Hop-table entries (n_workers + 1) the kernels stage in device and shared memory (2 tables of
// doubles: 32 KiB of shared memory at most); beyond, they read the job's mapped tables.
constexpr uint32_t kBudgetStagedWorkers = 2049;
// A part's key directory: one bit per key, set when one of its super-groups has that key.
constexpr uint32_t kBudgetKeyWords = (kEnergyKeys + 31) / 32;

// One part's running state in the scratch: its geometry and which candidates fit (copied from the
// job by the set-up kernel, so the grid kernels read device memory, not the mapped job) and where
// its key entries start; its extent (the largest energy as its bit pattern, the largest floor(log2
// energy) + 2048, the count of non-finite super-groups); how many distinct keys it has; its
// unweighted fixed-point energies and its key runs' totals (count and the two energies).
struct BudgetPartState {
  unsigned long long n_elems = 0, n_sg = 0, stats_offset = 0, entries_at = 0;
  uint8_t fits[(kCandidates + 7) / 8 * 8] = {};  // the job's, for the call's sum of terms
  unsigned long long max_bits = 0, largest = 0, bad = 0, distinct = 0;
  unsigned long long total_centred = 0, total_mean = 0;
  unsigned long long runs[3][kBudgetKeyRuns] = {};
};

// The call's state: how many parts' terms are done (the last part block to finish adds them all,
// in part order, into `acc`).
struct BudgetCallState {
  unsigned long long parts_done = 0;
  BudgetAccumulator acc;
};

// Device memory the kernels work in, for a call of `n_parts` parts whose budget_key_entries()
// add up to `key_entries`: the call's state and the staged hop tables; per part its state, its
// terms and its key directory (5.5 KB); per key entry the cumulated count and two fixed-point
// energies (24 B). Every part of a call is summarised at once, in a constant number of launches,
// in memory that grows with the call's super-groups (a key entry per super-group at most), not
// with its parts times the keys: a dense table per part would be 0.75 MiB. Multiples of 8 bytes.
constexpr size_t kBudgetCallBytes =
    sizeof(BudgetCallState) + 2 * kBudgetStagedWorkers * sizeof(double);
constexpr size_t kBudgetPartBytes =
    sizeof(BudgetPartState) + sizeof(PartTerms) + kBudgetKeyWords * sizeof(uint32_t);
constexpr size_t kBudgetEntryBytes = 3 * sizeof(uint64_t);
static_assert(kBudgetCallBytes % 8 == 0 && kBudgetPartBytes % 8 == 0, "8-byte alignment");
static_assert(sizeof(BudgetPartState) % 8 == 0 && sizeof(PartTerms) % 8 == 0, "8-byte alignment");
constexpr size_t budget_scratch_bytes(uint32_t n_parts, uint64_t key_entries) {
  return kBudgetCallBytes + static_cast<size_t>(n_parts) * kBudgetPartBytes +
         static_cast<size_t>(key_entries) * kBudgetEntryBytes;
}
// The same, from a job's parts (host-readable memory).
size_t budget_scratch_bytes(const BudgetJob& job);
// The parts one call may have.
constexpr uint32_t kBudgetMaxParts = 1u << 24;

// The launches of a call's prediction, whatever its parts: a set-up kernel, then extent, keys,
// sums, runs, cumulate and the per-part terms.
constexpr uint64_t kBudgetLaunches = 7;

// Enqueues the prediction of a call on `stream`: job->n_parts parts at once, each from its
// statistics at reduced + stats_offset (device memory, stats_words() BF16 words) summarised in
// `scratch` (`scratch_bytes` of device memory, at least budget_scratch_bytes(*job):
// cudaErrorInvalidValue otherwise), the parts' terms added in part order; then *out (memory the
// host reads, e.g. mapped) as run_budget_job() writes it: kBudgetPredicted with the prediction, or
// kBudgetNoPrediction when a statistic is not finite. `job`, the parts and the hop tables it
// points to: memory the device reads (mapped), unchanged until the kernels completed; the host
// reads job->n_parts and the parts' counts here (mapped memory is host memory), to size the grids
// and check the scratch. kBudgetLaunches launches.
// `error`: the lane's error word; when non-zero as a kernel starts, that kernel and (the word only
// ever gains flags) every later one write nothing (nullptr: no word). The kernels raise no flag of
// their own.
cudaError_t launch_budget(const BudgetJob* job, const uint16_t* reduced, void* scratch,
                          size_t scratch_bytes, BudgetResult* out, const unsigned* error,
                          cudaStream_t stream);

// Loads every kernel of budget.cu (device set-up; see cudaFuncGetAttributes in EMULATION.md).
cudaError_t load_budget_kernels();

}  // namespace dq::cuda
