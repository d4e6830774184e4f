// The compression engine of one communicator: a compressed all-reduce built from the codec
// (kernels/), a schedule (topo/), NCCL point-to-point in groups, and one small grouped
// all-reduce of statistics + control words. Plans (codec sizes, this rank's program, buffers)
// are made once per (count, dtype) and cached; the per-call path allocates nothing.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "config/settings.h"
#include "kernels/budget_model.h"
#include "shim/engine/control.h"
#include "shim/engine/control_file.h"
#include "shim/engine/device.h"
#include "shim/engine/metrics.h"
#include "shim/engine/nccl_ops.h"
#include "shim/engine/program.h"
#include "shim/engine/rung_backoff.h"
#include "topo/schedule.h"

namespace dq::engine {

struct CommInfo {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int nranks = 1;
};

struct CallArgs {
  Collective collective = Collective::kAllReduce;
  int root = 0;  // ncclReduce's root
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;  // elements of the send buffer (a reduce-scatter: recvcount x nranks)
  ncclDataType_t dtype = ncclFloat32;
  ncclRedOp_t op = ncclSum;
  cudaStream_t stream = nullptr;
  bool in_group = false;
  bool capturing = false;
};

// Whether `call` uses the caller's receive buffer on rank `rank`: every collective does but
// ncclReduce on a rank other than its root, where NCCL ignores it (NULL or any pointer), and so
// does the engine (only the root finishes a reduce).
inline bool uses_recv_buffer(const CallArgs& call, int rank) {
  return call.collective != Collective::kReduce || rank == call.root;
}

// What screens a call apart from the communicator's state, asked once per call
// (Engine::screen_call) and handed down to every later look at the decision (the interceptor's
// group, buffer and staging checks, Engine::run): the settings' and the arguments' own verdict,
// and the device's answer to whether the caller's stream is being captured. The communicator's
// state (handshake, canary) is applied by Engine::decide, since a handshake inside run() changes
// it.
struct Screening {
  // The first failing of: disabled (settings invalid or DYNAMIQ_ENABLE=0), not opted in, dtype,
  // op, collective, small. kRerouted when none fails.
  PassReason arguments = PassReason::kRerouted;
  bool device_capturing = false;  // Device::capturing of the call's stream
};

// ---- the canary (docs/ENGINE.md section 6) ----------------------------------------------------
// A fixed tensor of kCanaryCount FP32 values per worker (kCanaryWorkers workers, kCanaryChunks
// chunks) through a device's codec steps and through the host codec directly: every worker's
// statistics, the layout, each chunk's leaves (workers 0 and 1), its 2-input fused hop (worker 2)
// and its finish. Finite data: the two must agree byte for byte.
inline constexpr size_t kCanaryCount = 31 * 256 + 93;  // a partial last super-group
inline constexpr int kCanaryWorkers = 3;
inline constexpr int kCanaryChunks = 2;

// Worker `worker`'s canary tensor: super-groups of very different magnitudes (so the layout
// gives widths 2, 4, 8 and 16), one of zeros, nonzero means.
std::vector<float> canary_tensor(int worker);

struct CanaryResult {
  bool ran = false;      // the host codec produced the expected bytes and the device was run
  bool differs = false;  // the device's bytes differ from the host codec's, or a device step failed
  std::string step;      // the first output that differs: "statistics of worker 1", ...
  size_t byte = 0;       // its first differing byte
  unsigned got = 0, expected = 0;
  Status device_status = Status::kOk;  // a device step (or its memory) failed instead
  std::vector<uint8_t> host_layout;    // the host codec's layout (tests read its widths)
  // One line for the warning: what differs, where, the bytes.
  std::string describe() const;
};

// Runs the canary of the codec `spec` on `device`'s stream `stream` and waits for it (one blocking
// wait: a one-time self-test). Device memory is allocated and released here; the device's steps
// report into a mapped error word of the canary's own, never a communicator's.
CanaryResult run_canary(Device* device, const CodecSpec& spec, StreamHandle stream, uint64_t seed);

class Engine {
 public:
  // `settings_valid` false: this rank's environment failed to parse (it still takes part in the
  // agreement, so the other ranks learn it and everyone passes through).
  Engine(const config::Settings& settings, bool settings_valid, CommInfo comm, const NcclOps& ops,
         Device* device, std::shared_ptr<CommMetrics> metrics, bool opted_in);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  enum class State { kPending, kAgreed, kInert };

  // The whole rerouting decision and, when it says so, the compressed collective (all-reduce,
  // reduce-scatter or reduce), enqueued on
  // the device in stream order. On return *reason says whether the call was compressed
  // (kRerouted) or must now be passed through by the caller (nothing was written to recv). A
  // non-success result is an NCCL failure, or the communicator's asynchronous error.
  //
  // Blocking steps (the only ones): the handshake at the first call outside a group or capture
  // (a MAX all-reduce of the control words: settings, opt-in), and the agreement of each new
  // plan (a MAX of every rank's planning failure). Everything else the host must know (the A/B
  // switch, any rank's device error) travels in the words of each eligible call and is applied
  // one eligible call later (docs/ENGINE.md section 3).
  //
  // `screening` is screen_call(call), asked once for the call; `call` may since have been marked
  // in a group or capturing, or point at staged copies of its buffers.
  ncclResult_t run(const CallArgs& call, const Screening& screening, PassReason* reason);
  ncclResult_t run(const CallArgs& call, PassReason* reason) {
    return run(call, screen_call(call), reason);
  }

  // The communicator's asynchronous error (ncclCommGetAsyncError semantics): a failure found in
  // data or in an enqueued NCCL call, read lazily from the device's error word. Sticky.
  ncclResult_t async_error();

  // A flag another thread sets when it aborts the communicator: on NVIDIA's NCCL the real abort
  // comes before the engine's teardown (shim/engine/interceptor.cc), and a call that was waiting
  // then enqueues nothing more on the aborted communicator. Must outlive the engine.
  // Kept in the NCCL table, whose settled() polls stop at it too (and whose copies the rail
  // engines get).
  void watch_abort(const std::atomic<bool>* aborted) { ops_.abort_flag = aborted; }

  // ncclCommRevoke, or ncclCommShrink with NCCL_SHRINK_ABORT, on the application's communicator
  // (whose own operations the real call ends): revokes the node and rail communicators this
  // engine made, so that their operations in flight end too and the teardown that follows waits
  // for nothing stuck on a dead peer, and has the teardown abort them. Safe from any thread while
  // a call runs; a second call does nothing. With an NCCL before 2.28 (no ncclCommRevoke) only the
  // latter: on a device whose aborts end its queued NCCL work (a GPU) the teardown aborts them
  // before its waits, elsewhere its waits stay bounded by DYNAMIQ_TIMEOUT_MS.
  void revoke_own_communicators();

  // The part of the decision that does not depend on the communicator's state: ask once per call.
  Screening screen_call(const CallArgs& call) const;
  // The decision from the call's arguments (`screening`, and the call's group and capture flags)
  // and this communicator's agreed state alone, in the order of docs/ENGINE.md section 2.
  PassReason decide(const CallArgs& call, const Screening& screening) const;
  // This rank in the communicator.
  int rank() const { return comm_.rank; }
  // Explicit opt-in (dynamiqCommRegister): only before the handshake, so it cannot diverge.
  Status register_opt_in(bool on);

  // What the decision line (docs/ENGINE.md section 2) names the communicator by: `label` (index,
  // name, color, rank/size, NCCL's comm pointer and hashes) and what opted it in or out
  // (`opt_in`: "DYNAMIQ_COMMS term all", "dynamiqCommRegister(comm, 0)", ...).
  void describe_comm(std::string label, std::string opt_in);
  // A rank-local reason this rank must not compress (an NCCL version outside the supported
  // range): it takes part in the handshake as a rank with invalid settings, so every rank of the
  // communicator passes through. Before the first call.
  void block_locally(std::string why);
  // The decision line of a communicator that never handshakes (one rank, no device): logged by
  // the interceptor when it makes the engine.
  void log_decision_without_handshake(const std::string& why) const;

  // The canary of this communicator: not run (yet, or never: a device that needs none, such as
  // the host device), agreed passed, or agreed failed (on some rank: every call passes through).
  enum class Canary { kNotRun, kPassed, kFailed };
  Canary canary() const { return canary_; }

 private:
  struct Plan;
  // What a plan is made for, and so found by: a call shape and the budget's codec.
  struct PlanShape {
    Collective collective;
    int root;
    size_t count;
    DType dtype;
    double bits;
    CodecSpec spec;
    bool operator==(const PlanShape&) const = default;
  };
  struct Bucket;
  struct Check;
  Status setup_device();
  void teardown_device();
  // A plan of the codec `spec` at `bits` (its budget, the cache key with it).
  Plan* plan_for(const CallArgs& call, DType dtype, double bits, const CodecSpec& spec,
                 Bucket* bucket, ncclResult_t* nccl_failure);
  std::unique_ptr<Plan> build_plan(const CallArgs& call, DType dtype, double bits,
                                   const CodecSpec& spec, Status* status);
  // build_plan's steps: the blocks and their codec parts; the plan's device memory.
  Status cut_blocks(const CallArgs& call, Plan& p);
  int sub_blocks_for(Collective collective, size_t count, int n_chunks) const;
  Status allocate_plan(Plan& p);
  Status prepare_part_steps(Plan& p);
  // This rank's canary verdict at the communicator's first plan (not run afterwards, nor on a
  // device that needs none); then the agreed verdict into canary_.
  CanaryResult run_canaries();
  void settle_canary(const CanaryResult& canary, bool any_failed);
  // The budget (docs/ENGINE.md section 10). A bucket is a call shape (collective, root, count,
  // dtype) of a DynamiQ communicator: the same on every rank, and the same across iterations.
  Bucket* bucket_for(const CallArgs& call, DType dtype);
  // Its part geometry and its prediction's job (every rung's plan) and result, in mapped memory;
  // at the bucket's first plan, whose agreement carries a failure here.
  Status init_bucket(Bucket& b, const Plan& p);
  Status reserve_budget_scratch(uint32_t n_parts, uint64_t key_entries);
  void release_bucket(Bucket& b);
  // A plan at the bucket's rung failed on some rank (a bucket set up before): the default next,
  // and that rung avoided for a while (Bucket::backoff).
  void avoid_failed_rung(Bucket& b);
  // The plan `p` a call of `b` is about to use, into the job of its prediction; false when the
  // plan's parts are not the bucket's (no prediction for that call).
  bool stage_budget(Bucket& b, const Plan& p);
  // The prediction from the bucket's latest call (complete: the host waited for a later control
  // all-reduce on the same stream): that call's widths and predicted vNMSE into the metrics, and
  // with DYNAMIQ_BITS=auto the rung of this call.
  void read_bucket(Bucket& b);
  // A compressed call of `b` was enqueued with plan `p`: its budget into the metrics, and the
  // INFO summary every DYNAMIQ_SUMMARY_CALLS calls.
  void note_budget(Bucket& b, const Plan& p);
  // The metrics entry of bucket `b` (its call shape), or null. Caller holds the budget mutex.
  static BucketMetrics* bucket_metrics(BudgetMetrics& m, const Bucket& b);
  // The schedule a collective runs on: a reduce-scatter needs one chunk ending at every rank, so
  // a butterfly of a rank count that is not a power of two runs it on the ring.
  topo::Kind kind_for(Collective collective) const;
  void retire(std::unique_ptr<Plan> plan);
  // Retired plans' host objects (codecs, prepared steps), kept until the engine's streams have
  // passed `done`: the host device runs queued steps with references to them.
  struct RetiredPlan {
    std::unique_ptr<Plan> plan;
    EventHandle done = nullptr;  // nullptr: kept until the streams are drained at teardown
  };
  void reap_retired();
  void remember_evicted(const Plan& p);
  void note_plan_miss(const PlanShape& shape);
  // One MAX all-reduce of `n` words through the control block, waited for on the host.
  ncclResult_t blocking_max(const uint32_t* in, uint32_t* out, int n);
  // A host wait for `e`, recorded after work that involves peers (`what` names it), bounded by
  // DYNAMIQ_TIMEOUT_MS; a failure or timeout makes the communicator's error sticky.
  ncclResult_t wait_for_peers(EventHandle e, const char* what);
  // watch_abort()'s flag, and what a call does once it is set.
  bool aborting() const;
  ncclResult_t stop_for_abort(const char* when);
  // Device::nccl, unless an abort began (then nothing is issued).
  Status enqueue_nccl(Lane lane, std::function<ncclResult_t()> calls);
  ncclResult_t handshake();
  ncclResult_t handshake_without_device(cudaStream_t stream);
  // Before an eligible call sends its control words: the words of the call control_window()
  // eligible calls back (the slot this call reuses), waited for if still in flight.
  ncclResult_t absorb_window();
  int control_window() const { return static_cast<int>(settings_.control_window); }
  uint32_t* call_send_slot();  // the words the next eligible call sends
  // run()'s steps, in order.
  ncclResult_t settle_agreement(const CallArgs& call, const Screening& screening);
  ncclResult_t pass_switched_off(const CallArgs& call, PassReason* reason);
  // A call's budget: its bucket (a DynamiQ communicator's), bits and codec spec, and whether it
  // computes statistics (an MX fallback only every kMxStatisticsEvery calls).
  struct BudgetChoice {
    Bucket* bucket = nullptr;
    double bits = 0;
    CodecSpec spec;
    bool with_stats = true;
  };
  BudgetChoice choose_budget(const CallArgs& call, DType dtype);
  Status enqueue_call(Plan& plan, const CallArgs& call, DType dtype, uint64_t call_index,
                      bool with_stats, Bucket* predict, uint64_t* wire);
  void account_call(const CallArgs& call, DType dtype, const Plan& plan, const BudgetChoice& choice,
                    bool predicted, uint64_t call_index, uint64_t wire,
                    std::chrono::steady_clock::time_point t0);
  // A run of statistics words the all-reduce sums alike: BF16 words, or (bytes) unsigned 8-bit
  // lanes, two a word (Codec::stats_byte_sum_words()).
  struct StatsSpan {
    size_t first = 0, words = 0;
    bool bytes = false;
  };
  // spans: the statistics to all-reduce with the control words, in one NCCL group (none: the
  // control words alone). predict: the bucket whose prediction is made from the reduced
  // statistics (its job staged), or null. reduced: an event recorded once the statistics are
  // reduced, before the prediction (the layouts wait for it, not for the prediction), or null.
  Status enqueue_call_control(const uint16_t* stats_local, uint16_t* stats_reduced,
                              const std::vector<StatsSpan>& spans, Bucket* predict,
                              uint64_t* wire_bytes, EventHandle reduced = nullptr);
  // with_stats false: an MX fallback call that skips its statistics (kMxStatisticsEvery).
  Status enqueue_compressed(Plan& plan, const CallArgs& call, uint64_t call_index, bool with_stats,
                            Bucket* predict, uint64_t* wire_bytes);
  Status enqueue_compute(Plan& plan, int block, int stage, const CallArgs& call,
                         uint64_t call_index);
  Status enqueue_comm(Plan& plan, int block, int stage, uint64_t* wire_bytes);
  Status ensure_events(size_t n);
  ncclResult_t fail_async(uint32_t word);
  // The lanes' error word as it is now (0: no step failed; also 0 without control words).
  uint32_t error_word_now() const;
  // A call that failed on this rank after it began: its peers go on with theirs, so this
  // communicator's NCCL calls no longer pair up across the ranks. The failure is the
  // communicator's from now on (every later call and its asynchronous error), as NCCL's own are.
  ncclResult_t fail_call(Status s);
  void warn_differs(const std::string& what);
  // The A/B switch as rank 0 reads it (control file); always on for other ranks.
  bool read_switch();
  // Counts one call under `reason` in this communicator's metrics.
  void count(PassReason reason);
  // A call of this communicator passed through for `reason` (counted): the reason's first such
  // call logged at INFO (per communicator), and the first kQuietCalls calls after the handshake
  // watched: all of them passed through for their size or type gives one WARN. A compressed
  // call (kRerouted) ends the watch.
  void note_outcome(PassReason reason, const CallArgs& call);
  // The decision line, after the handshake's words were read.
  void log_decision(const ControlDecision& d) const;
  std::string call_reason_text(PassReason reason, const CallArgs& call) const;
  std::string compressed_text() const;
  // The sampled check (DYNAMIQ_CHECK_EVERY, docs/ENGINE.md section 10): enqueued around a
  // compressed all-reduce (`gather` before its codec steps, `finish` after), read on the host
  // after the control wait of a later call whose comm stream waited for it; paired with the
  // checked call's prediction when its bucket reads that call's statistics.
  Status enqueue_check_gather(const CallArgs& call, DType dtype, uint64_t call_index);
  Status enqueue_check_finish(const CallArgs& call, uint64_t* wire_bytes);
  void read_check();
  void pair_check();
  // The two-level schedule (engine_hierarchy.cc, engine_two_level.cc; docs/ENGINE.md section
  // 11): set up at the handshake, then every compressed call of the communicator runs on it.
  struct Hierarchy;
  ncclResult_t gather_host_hashes(std::vector<uint64_t>* hashes, bool* all_capable);
  ncclResult_t setup_hierarchy();
  void release_hierarchy();
  ncclResult_t rail_async_error();
  ncclResult_t ensure_shard(size_t bytes, bool* ok);
  int hierarchy_nodes() const;
  ncclResult_t run_two_level(const CallArgs& call, PassReason* reason);
  size_t piece_elements(DType dtype) const;
  Status enqueue_piece(const CallArgs& call, size_t p, size_t first, size_t n, ncclResult_t* rail,
                       PassReason* rail_reason);
  ncclResult_t run_two_level_all_reduce(const CallArgs& call, PassReason* reason);
  Status enqueue_node_reduce(const CallArgs& call, Lane lane);
  CallArgs rail_call(const CallArgs& call) const;
  Status enqueue_rail_exact(const CallArgs& rc, int engine, Lane lane);
  Status enqueue_node_gather(const CallArgs& call, Lane lane);

  config::Settings settings_;
  bool settings_valid_;
  CommInfo comm_;
  NcclOps ops_;
  Device* device_;
  std::shared_ptr<CommMetrics> metrics_;
  bool opted_in_ = false;
  State state_ = State::kPending;
  topo::Kind kind_;
  uint64_t call_seq_ = 0;  // compressed calls so far (identical on every rank): keys the rounding
  // A two-level schedule's rail engines: the counter they share instead (Hierarchy::rail_calls),
  // so their calls are numbered in the order they are made, as one engine would number them.
  uint64_t* shared_call_seq_ = nullptr;
  // A two-level schedule's rail engine: recorded on the compute stream once a compressed call's
  // layouts are built (its statistics all-reduced, its widths allocated), so the caller's engine
  // can hold its next node step back until then (enqueue_piece). Owned by the caller's engine.
  EventHandle layouts_done_ = nullptr;
  std::string warned_differs_;
  std::string label_ = "?", opt_in_why_;  // describe_comm()
  std::string local_block_;               // block_locally()
  uint32_t noted_reasons_ = 0;            // bit per PassReason: its first call was logged
  // The watch of the first calls after the handshake: calls seen, of them passed for size or
  // for type; ended (or its warning given).
  int quiet_seen_ = 0, quiet_small_ = 0, quiet_dtype_ = 0;
  bool quiet_done_ = false;
  Canary canary_ = Canary::kNotRun;
  bool canary_agreed_ = false;  // the canary's verdict was agreed (at the first plan made)
  std::list<std::unique_ptr<Plan>> plans_;  // most recently used first
  // The shapes of recently evicted plans (remember_evicted), and the plans made again for them.
  std::deque<PlanShape> evicted_;
  // Shapes whose plan could not be made (agreed on every rank): the calls of the shape its
  // back-off skips pass through without another attempt (rung_backoff.h), so a plan that always
  // fails (device memory short, more ranks than a schedule holds) costs an attempt, its blocking
  // agreement and its warning now and then, not each call.
  struct FailedShape {
    PlanShape shape;
    Backoff backoff;
  };
  static constexpr size_t kFailedShapesKept = 16;
  std::deque<FailedShape> failed_shapes_;  // most recently failed first
  uint64_t replans_ = 0;
  std::vector<RetiredPlan> retired_;            // retire(), reap_retired()
  std::list<std::unique_ptr<Bucket>> buckets_;  // most recently used first
  std::unique_ptr<Check> check_;                // DYNAMIQ_CHECK_EVERY > 0 only
  BudgetTarget target_;                         // DYNAMIQ_TARGET, parsed
  CodecSpec candidate_specs_[kCandidates];      // auto's candidates (candidate_spec), parsed once
  // The hop profile of each topology's schedule (kernels/budget_model.h), made once: O(n^2).
  std::vector<std::pair<topo::Kind, HopTables>> hop_tables_;
  // The INFO summary's window: compressed DynamiQ calls since the last summary line.
  struct Window {
    uint64_t calls = 0, predicted = 0, mx_calls = 0, checked = 0;
    double checked_sq_error = 0, checked_energy = 0;
    double bits = 0, vnmse = 0;
    uint64_t widths[4] = {0, 0, 0, 0};
  } window_;

  // Device state: two engine streams (NCCL calls in order on one, codec steps on the other),
  // events, and the mapped control block (words the host writes before a call's first enqueue
  // and reads DYNAMIQ_CONTROL_WINDOW eligible calls later, the error word).
  StreamHandle comm_stream_ = nullptr, compute_stream_ = nullptr;
  EventHandle ev_start_ = nullptr, ev_stats_ = nullptr, ev_reduced_ = nullptr,
              ev_comm_done_ = nullptr, ev_compute_done_ = nullptr;
  std::vector<EventHandle> ev_controls_;  // a control window's slots: recorded after its words
  std::vector<EventHandle> ev_units_;     // two per (stage, block): computed, sent
  uint32_t* control_ = nullptr;           // mapped words, see ControlBlock
  // Device memory of the budget's kernels (CUDA devices): sized by init_bucket for the bucket that
  // needs the most so far (Device::budget_scratch_bytes: its parts and their super-groups), shared
  // by every bucket (the comm stream runs one prediction at a time).
  void* budget_scratch_ = nullptr;
  size_t budget_scratch_bytes_ = 0;
  // Call controls enqueued (the next one's sequence number), and read: every control below
  // control_absorbed_ is complete and its words were read. The host waits only when
  // control_window() are in flight.
  uint64_t control_sent_ = 0, control_absorbed_ = 0;
  bool switch_agreed_ = true;             // the A/B switch every rank applies now
  ncclResult_t broken_ = ncclSuccess;     // sticky asynchronous error
  bool setup_failed_ = false;             // the device could not be set up on this rank
  Device* standby_ = nullptr;             // setup_failed_: that device, for the handshake's words
  void* standby_words_ = nullptr;         // its mapped memory holding them (kept to the end)
  SwitchFile switch_file_;                // DYNAMIQ_CONTROL_FILE (read by rank 0 only)
  std::unique_ptr<Hierarchy> hierarchy_;  // null: the flat schedule
  // The communicators the engine made (hierarchy_'s), published for revoke_own_communicators()
  // on another thread; the mutex keeps a revoke and their destruction apart.
  std::mutex own_comms_mutex_;
  std::vector<ncclComm_t> own_comms_;
  bool own_comms_revoked_ = false;
  // False in a two-level schedule's rail engine: the caller's call is counted once, by the
  // engine it was made on, though its pieces are several rail calls.
  bool counts_calls_ = true;
  // A two-level schedule's rail engine: an all-reduce block runs as up to this many sub-blocks
  // sharing one codec part (Plan::Block), so one budget spans the block while its hops pipeline
  // (sub_blocks_for).
  int sub_blocks_ = 1;
};

// Chooses the schedule for `nranks` under DYNAMIQ_TOPO.
topo::Kind choose_topology(const std::string& setting, int nranks);

}  // namespace dq::engine
