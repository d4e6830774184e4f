// Per-communicator counters, written periodically as JSON or Prometheus text
// (DYNAMIQ_METRICS_FILE, DYNAMIQ_METRICS_INTERVAL_S).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dq::engine {

// Why a call was not compressed (kRerouted when it was).
enum class PassReason : uint8_t {
  kRerouted = 0,
  kDisabled,        // DYNAMIQ_ENABLE=0 or the environment failed to parse
  kNotOptedIn,      // communicator not selected by DYNAMIQ_COMMS / dynamiqCommRegister
  kDtype,           // not FP32/BF16, or excluded by DYNAMIQ_DTYPES
  kOp,              // not SUM/AVG
  kSmall,           // below DYNAMIQ_MIN_BYTES
  kSingleRank,      // communicator of one rank
  kInGroup,         // inside the caller's ncclGroupStart/End
  kCapturing,       // during CUDA graph capture
  kOverBudget,      // too few elements for the budget (the plan would exceed it)
  kSwitchOff,       // A/B control file says off
  kSettingsDiffer,  // ranks disagree on an agreed setting
  kNoDevice,        // no device serves this communicator (NVIDIA's NCCL, CUDA unavailable: no
                    // driver or GPU, or a build without CUDA)
  kFailure,         // some rank could not run the compressed path for this call
  kCollective,      // a collective DYNAMIQ_COLLECTIVES excludes (or an invalid root)
  kCanaryFailed,    // the device's canary differed from the host codec on some rank
  kLarge,           // more elements than the codec's rounding keys index (kMaxElementIndex)
  kCount
};
inline constexpr int kPassReasonCount = static_cast<int>(PassReason::kCount);
const char* reason_name(PassReason r);

// The budget of compressed DynamiQ calls (docs/ENGINE.md section 10): per bucket (a call shape),
// the budget of its latest call; per communicator, the widths and the predicted vNMSE of every
// call whose statistics have been read. A call's statistics are read one call of its bucket
// late (no extra communication, no host synchronisation), so the latest call of each bucket is
// not counted yet.
struct BucketMetrics {
  std::string collective;         // allreduce, reducescatter, reduce
  std::string dtype;              // float32, bfloat16
  uint64_t count = 0;             // elements of the call
  int root = 0;                   // ncclReduce's root (0 otherwise)
  uint64_t calls = 0;             // compressed calls of this bucket
  double budget_bits = 0;         // budget of its latest call, bits per coordinate
  std::string codec = "dynamiq";  // codec of its latest call: dynamiq, or auto's mxfp8/mxfp6
  double predicted_vnmse = -1;    // predicted vNMSE of its latest predicted call; -1: none yet
};
struct BudgetMetrics {
  bool auto_budget = false;            // DYNAMIQ_BITS=auto
  std::string target;                  // DYNAMIQ_TARGET (auto only)
  std::vector<BucketMetrics> buckets;  // at most the engine's bucket limit, in first-use order
  uint64_t widths[4] = {0, 0, 0, 0};   // super-groups of predicted calls at width 2, 4, 8, 16
  uint64_t predicted_calls = 0;        // calls with a prediction
  double predicted_vnmse_sum = 0;      // sum of their predicted vNMSE
  double predicted_vnmse_last = -1;    // the latest one; -1: none yet
  double bits_sum = 0;                 // sum over compressed DynamiQ calls of their budgets
  uint64_t budget_calls = 0;           // compressed DynamiQ calls
  uint64_t mx_calls = 0;               // of which auto sent as MXFP8 or MXFP6 (its fallback)
  // The sampled check (DYNAMIQ_CHECK_EVERY): calls checked, and over their samples the summed
  // squared error and exact energy (their ratio: the sampled vNMSE); the latest call's sampled
  // vNMSE; checks skipped for a non-finite value. Paired: checked calls whose prediction is
  // known, with the sums of their predicted and sampled vNMSE.
  uint64_t checked_calls = 0;
  double checked_sq_error = 0, checked_energy = 0;
  double checked_vnmse_last = -1;
  uint64_t checked_nonfinite = 0;
  uint64_t paired_calls = 0;
  double paired_predicted_sum = 0, paired_sampled_sum = 0;
};

struct CommMetrics {
  int index = 0, rank = 0, size = 0;
  std::string name;
  uint64_t comm_id = 0;  // NCCL's commId of its unique id (0: unknown, a split): names the job
  std::atomic<uint64_t> calls[kPassReasonCount] = {};
  std::atomic<uint64_t> bytes_in{0};     // caller bytes of rerouted calls
  std::atomic<uint64_t> wire_bytes{0};   // bytes this rank sent for rerouted calls (all messages)
  std::atomic<uint64_t> nanoseconds{0};  // time inside rerouted calls
  // Host time eligible calls spent waiting for the control all-reduce a control window back
  // (DYNAMIQ_CONTROL_WINDOW): the device was that many compressed calls behind the host.
  std::atomic<uint64_t> window_wait_nanoseconds{0};
  // Plans made (each a blocking agreement and new buffers), and of them those made again for a
  // shape the cache had evicted (DYNAMIQ_PLAN_CACHE too small for the job's shapes).
  std::atomic<uint64_t> plans_made{0}, replans{0};
  std::atomic<int64_t> held_bytes{0};  // gauge: device/host bytes held by cached plans
  std::atomic<bool> destroyed{false};  // the communicator is gone; its totals stay
  mutable std::mutex budget_mutex;     // guards budget (written by the engine per call)
  BudgetMetrics budget;
};

// What tells this process's metrics apart from another job's on the same node, and what it runs.
struct ProcessLabels {
  std::string job;  // DYNAMIQ_JOB_ID, SLURM_JOB_ID, TORCHELASTIC_RUN_ID (not torchrun's "none"),
                    // PBS_JOBID, LSB_JOBID, JOB_ID; empty when none is set
  std::string host;
  int pid = 0;
  std::string version, revision, nccl;  // dynamiq_build_info's labels
  // Also dynamiq_build_info's: the host codec's path ("scalar", "avx2", "avx512") and the vector
  // paths this CPU has that failed their start-up check (comma list; kernels/host_isa.h): a
  // node whose codec fell back to a slower path shows on a dashboard, not only in its log.
  std::string host_path, host_paths_refused;
  double now_s = 0;        // the write's Unix time; 0: the clock's
  int launcher_rank = -1;  // the process's rank in the job (launcher_rank(), common/log.h); -1
                           // where the launcher set none
  int launcher_size = -1;  // that launcher's job size; -1 unset
};
ProcessLabels process_labels();
// Sets host_path and host_paths_refused from the process's selection now: a forced
// DYNAMIQ_HOST_ISA is applied when an engine is made, which may be after the first write.
void fill_host_path(ProcessLabels* labels);
// The metrics file's text: Prometheus exposition format as the node exporter's textfile collector
// reads it (HELP, TYPE, no job or instance label, no sample timestamps; one label set on every
// sample) or JSON (written by a JSON library).
std::string metrics_render(const std::vector<std::shared_ptr<CommMetrics>>& comms,
                           const ProcessLabels& labels, bool prometheus);

// DYNAMIQ_METRICS_FILE's pattern made a path: a directory (ending in /) gets the file name
// dynamiq-%j-%h-%r.prom; then %j job, %h host, %r rank, %p pid, %% a percent sign (others stay).
std::string metrics_expand_path(const std::string& pattern, const std::string& job,
                                const std::string& host, int rank, int pid);
// The rank in the file's name (%r), unique among the job's processes: the launcher's
// (labels.launcher_rank) unless a communicator is larger than the launcher's job (processes it did
// not start: each a worker one of its tasks spawned), else the process's rank in the largest
// communicator registered (the first of that size: a job's world communicator where it has one),
// else the pid (a write before any communicator, as dynamiq.counters(): a name no other process
// takes, since the write that renames the file removes the one before). Not the rank in the first
// communicator: with tensor or pipeline parallelism that may be a data-parallel group's, the same
// in every process of a node, which would then all write one file.
int metrics_file_rank(const ProcessLabels& labels,
                      const std::vector<std::shared_ptr<CommMetrics>>& comms);
// %j: the launcher's job id (labels.job), else "nccl-<commId>" of the first communicator made
// from a unique id (the same on every rank, new in every job), else "pid-<pid>".
std::string metrics_job_name(const ProcessLabels& labels,
                             const std::vector<std::shared_ptr<CommMetrics>>& comms);

// Registers a communicator's counters with the process-wide writer. Unregistering marks them
// destroyed and writes the file once more; they stay in every later write, and the file is
// written again at exit (so a job's final totals survive its communicators).
// The first registration with a metrics file set installs the final write on SIGTERM and SIGINT
// (metrics_signal.cc).
std::shared_ptr<CommMetrics> metrics_register(int index, const std::string& name, int rank,
                                              int size, uint64_t comm_id = 0);
void metrics_unregister(const std::shared_ptr<CommMetrics>& m);
// Rewrites the file if the interval has elapsed (cheap otherwise: one clock read), on the writer
// thread where there is one (metrics_request_write): never a wait on the file system here.
void metrics_tick();
// Rewrites the file now: false when it could not be written (a warning said why).
bool metrics_flush();
// The metrics file the next write goes to (DYNAMIQ_METRICS_FILE expanded as the writes expand it:
// %j, %h, %r, %p, a directory's name); "" when none is configured.
std::string metrics_path_now();
// Installs the SIGTERM/SIGINT handlers that write the file once more before the handler that
// was there before runs (once per process; metrics_signal.cc).
void metrics_install_signal_write();
// Hands a write to that handler's writer thread, which makes it soon: false where there is no
// such thread (none could start, none is needed, a forked child), and the caller writes itself.
bool metrics_request_write();

}  // namespace dq::engine
