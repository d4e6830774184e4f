// The engine of one communicator: its device state, the per-call decision (screening) and the
// call's path from there (docs/ENGINE.md). Its other concerns live beside it: the canary
// (engine_canary.cc), planning (engine_plan.cc), the budget's buckets (engine_budget.cc), the
// sampled check (engine_check.cc), agreement and host waits (engine_agreement.cc), the
// compressed collective's enqueues (engine_enqueue.cc); the switch file in control_file.cc.
#include "shim/engine/engine.h"

#include <chrono>
#include <cstring>

#include "kernels/codec.h"
#include "kernels/host_isa.h"
#include "shim/engine/engine_hierarchy.h"
#include "shim/engine/engine_internal.h"

namespace dq::engine {

topo::Kind choose_topology(const std::string& setting, int nranks) {
  if (setting == "ring") return topo::Kind::kRing;
  if (setting == "butterfly") return topo::Kind::kButterfly;
  const bool pow2 = nranks > 0 && (nranks & (nranks - 1)) == 0;
  return pow2 && nranks >= 4 ? topo::Kind::kButterfly : topo::Kind::kRing;
}

Status Engine::register_opt_in(bool on) {
  if (state_ != State::kPending)
    DQ_FAIL(Status::kInvalidArgument,
            "dynamiqCommRegister: the communicator already ran an all-reduce; register it before "
            "its first ncclAllReduce (on every rank) so that all ranks agree");
  opted_in_ = on;
  return Status::kOk;
}

void Engine::warn_differs(const std::string& what) {
  if (what == warned_differs_) return;
  warned_differs_ = what;
  DQ_WARN(Subsys::kEngine,
          "dynamiq: ranks of communicator (rank %d of %d) disagree on: %s. Compression is OFF for "
          "this communicator: its calls pass through to NCCL. Give every rank the same DYNAMIQ_* "
          "settings.",
          comm_.rank, comm_.nranks, what.c_str());
}

void Engine::count(PassReason reason) {
  if (metrics_ && counts_calls_)
    metrics_->calls[static_cast<int>(reason)].fetch_add(1, std::memory_order_relaxed);
}

bool Engine::read_switch() {
  if (comm_.rank != 0) return true;
  return switch_file_.read();
}

Engine::Engine(const config::Settings& settings, bool settings_valid, CommInfo comm,
               const NcclOps& ops, Device* device, std::shared_ptr<CommMetrics> metrics,
               bool opted_in)
    : settings_(settings),
      settings_valid_(settings_valid),
      comm_(comm),
      ops_(ops),
      device_(device),
      metrics_(std::move(metrics)),
      opted_in_(opted_in),
      kind_(choose_topology(settings.topology, comm.nranks)),
      switch_file_(settings.control_file) {
  parse_budget_target(settings_.target, &target_);     // validated with the settings
  apply_host_isa_setting(settings_.host_isa.c_str());  // before this engine makes a codec
  for (int c = 0; c < kCandidates; ++c) {
    std::string invalid;  // none: the candidates are the budget model's own specs
    parse_codec_spec(candidate_spec(c), &candidate_specs_[c], &invalid);
  }
  if (metrics_) {
    std::lock_guard<std::mutex> lock(metrics_->budget_mutex);
    metrics_->budget.auto_budget = settings_.bits_auto;
    metrics_->budget.target = settings_.bits_auto ? budget_target_name(target_) : "";
  }
  if (device_ != nullptr && setup_device() != Status::kOk) {
    DQ_WARN(Subsys::kEngine,
            "dynamiq: rank %d: cannot set up the %s device (streams, events, control words); "
            "compression is off for this communicator",
            comm_.rank, device_->name());
    teardown_device();
    standby_ = device_;
    device_ = nullptr;
    setup_failed_ = true;
  }
}

Engine::~Engine() {
  release_hierarchy();  // the rail engine and the node steps first: they use this engine's streams
  for (auto& b : buckets_) release_bucket(*b);
  buckets_.clear();
  while (!plans_.empty()) {
    retire(std::move(plans_.back()));
    plans_.pop_back();
  }
  teardown_device();
  if (standby_words_ != nullptr) standby_->release(standby_words_, nullptr);
}

Status Engine::setup_device() {
  DQ_CHECK(device_->create_stream(&comm_stream_));
  DQ_CHECK(device_->create_stream(&compute_stream_));
  for (EventHandle* e : {&ev_start_, &ev_stats_, &ev_reduced_, &ev_comm_done_, &ev_compute_done_})
    DQ_CHECK(device_->create_event(e));
  for (int slot = 0; slot < control_window(); ++slot) {
    EventHandle e = nullptr;
    DQ_CHECK(device_->create_event(&e));
    ev_controls_.push_back(e);
  }
  const size_t control_bytes = static_cast<size_t>(control_block_words(control_window())) * 4;
  void* words = nullptr;
  DQ_CHECK(device_->alloc_mapped(control_bytes, &words));
  control_ = static_cast<uint32_t*>(words);
  std::memset(control_, 0, control_bytes);
  if (settings_.check_every > 0) {
    check_ = std::make_unique<Check>();
    DQ_CHECK(device_->alloc(Check::kBytes, &check_->in));
    DQ_CHECK(device_->alloc(Check::kBytes, &check_->exact));
    DQ_CHECK(device_->alloc_mapped(Check::kBytes, &check_->host_out));
    DQ_CHECK(device_->alloc_mapped(Check::kBytes, &check_->host_exact));
    DQ_CHECK(device_->create_event(&check_->gathered));
    DQ_CHECK(device_->create_event(&check_->done));
  }
  return Status::kOk;
}

void Engine::teardown_device() {
  if (device_ == nullptr) return;
  // Streams first: destroying one waits for its work, so nothing queued still uses the rest.
  if (comm_stream_) device_->destroy_stream(comm_stream_);
  if (compute_stream_) device_->destroy_stream(compute_stream_);
  comm_stream_ = compute_stream_ = nullptr;
  // The streams are drained: the retired plans' host objects go.
  for (RetiredPlan& r : retired_)
    if (r.done != nullptr) device_->destroy_event(r.done);
  retired_.clear();
  for (EventHandle* e : {&ev_start_, &ev_stats_, &ev_reduced_, &ev_comm_done_, &ev_compute_done_})
    if (*e) device_->destroy_event(*e), *e = nullptr;
  for (EventHandle e : ev_controls_) device_->destroy_event(e);
  ev_controls_.clear();
  for (EventHandle e : ev_units_) device_->destroy_event(e);
  ev_units_.clear();
  if (control_) device_->release(control_, nullptr);
  control_ = nullptr;
  if (budget_scratch_) device_->release(budget_scratch_, nullptr);
  budget_scratch_ = nullptr;
  budget_scratch_bytes_ = 0;
  if (check_) {
    for (void* p : {check_->in, check_->exact, check_->host_out, check_->host_exact})
      if (p) device_->release(p, nullptr);
    for (EventHandle e : {check_->gathered, check_->done})
      if (e) device_->destroy_event(e);
    check_.reset();
  }
}

Status Engine::ensure_events(size_t n) {
  while (ev_units_.size() < n) {
    EventHandle e = nullptr;
    DQ_CHECK(device_->create_event(&e));
    ev_units_.push_back(e);
  }
  return Status::kOk;
}

Screening Engine::screen_call(const CallArgs& call) const {
  Screening s;
  if (comm_.nranks < 2) return s;  // decided by that alone
  // A rank whose device could not be set up asks its standby: until the handshake its peers pass
  // captured calls through (and skip the handshake), so it must know a capture as they do.
  if (Device* d = device_ != nullptr ? device_ : standby_; d != nullptr)
    s.device_capturing = d->capturing(call.stream);
  if (device_ == nullptr) return s;  // decided by the rest of decide() alone
  s.arguments = [&] {
    if (!settings_valid_ || !settings_.enable) return PassReason::kDisabled;
    if (!opted_in_) return PassReason::kNotOptedIn;
    size_t esize;
    if (call.dtype == ncclFloat32 && settings_.allow_f32) {
      esize = 4;
    } else if (call.dtype == ncclBfloat16 && settings_.allow_bf16) {
      esize = 2;
    } else {
      return PassReason::kDtype;
    }
    if (call.op != ncclSum && call.op != ncclAvg) return PassReason::kOp;
    const bool allowed =
        (call.collective == Collective::kAllReduce && settings_.allow_all_reduce) ||
        (call.collective == Collective::kReduceScatter && settings_.allow_reduce_scatter) ||
        (call.collective == Collective::kReduce && settings_.allow_reduce && call.root >= 0 &&
         call.root < comm_.nranks);
    if (!allowed) return PassReason::kCollective;
    if (call.count * esize < static_cast<size_t>(settings_.min_bytes) || call.count == 0)
      return PassReason::kSmall;
    // Each rank's part of a reduce-scatter is keyed from a multiple of 256 (its span padded),
    // so the keys reach up to 256 a rank past the count: every draw must stay below
    // kMaxElementIndex, or each hop would refuse its block and fail the call on every rank.
    if (call.count + uint64_t{256} * static_cast<uint64_t>(comm_.nranks) > kMaxElementIndex)
      return PassReason::kLarge;
    return PassReason::kRerouted;
  }();
  return s;
}

PassReason Engine::decide(const CallArgs& call, const Screening& screening) const {
  if (comm_.nranks < 2) return PassReason::kSingleRank;
  const bool capturing = call.capturing || screening.device_capturing;
  // Not agreed yet: the handshake only runs outside a group and outside capture. A rank whose
  // device could not be set up still owes its peers the handshake's stand-in, so inside a group
  // it too holds the call back to the group's end (as its peers do) rather than send it into the
  // group, where it would meet their handshake.
  const bool pending = state_ == State::kPending && (device_ != nullptr || setup_failed_);
  if (device_ == nullptr && !pending) return PassReason::kNoDevice;
  if (state_ == State::kInert)
    return warned_differs_.empty() ? PassReason::kDisabled : PassReason::kSettingsDiffer;
  if (canary_ == Canary::kFailed) return PassReason::kCanaryFailed;
  if (pending) return capturing ? PassReason::kCapturing : PassReason::kInGroup;
  if (screening.arguments != PassReason::kRerouted) return screening.arguments;
  if (call.in_group) return PassReason::kInGroup;
  // A captured graph would freeze the plan, the call number that keys the rounding and the A/B
  // switch, and replay them: captured calls pass through (docs/ENGINE.md section 5).
  if (capturing) return PassReason::kCapturing;
  return PassReason::kRerouted;
}

// The communicator's asynchronous error (a lazy read, no wait); and at its first call outside a
// group or capture, the handshake (or, on a rank whose device could not be set up, its
// device-less stand-in). Nothing here waits for an earlier call: an eligible call does that
// itself (absorb_window), and only for the call a control window back.
ncclResult_t Engine::settle_agreement(const CallArgs& call, const Screening& screening) {
  if (comm_.nranks >= 2 && device_ != nullptr) {
    if (const ncclResult_t r = async_error(); r != ncclSuccess) return r;
    if (state_ == State::kPending && !call.in_group && !call.capturing &&
        !screening.device_capturing)
      if (const ncclResult_t r = handshake(); r != ncclSuccess) return r;
  }
  if (comm_.nranks >= 2 && setup_failed_ && state_ == State::kPending && !call.in_group &&
      !call.capturing && !screening.device_capturing)
    if (const ncclResult_t r = handshake_without_device(call.stream); r != ncclSuccess) return r;
  return ncclSuccess;
}

// A call passed through by the A/B switch still carries its switch word (a stand-alone control
// all-reduce), so switching back on works the same way.
ncclResult_t Engine::pass_switched_off(const CallArgs& call, PassReason* reason) {
  uint64_t wire = 0;
  Status s = device_->record(ev_start_, call.stream);
  if (s == Status::kOk) s = device_->wait(comm_stream_, ev_start_);
  if (s == Status::kOk) s = enqueue_call_control(nullptr, nullptr, {}, nullptr, &wire);
  if (s == Status::kOk) s = device_->record(ev_comm_done_, comm_stream_);
  if (s == Status::kOk) s = device_->wait(call.stream, ev_comm_done_);
  if (s != Status::kOk) return fail_call(s);
  *reason = PassReason::kSwitchOff;
  count(*reason);
  return async_error();
}

// The budget: the fixed one, or auto's choice from this bucket's latest prediction that is
// complete, i.e. made by a call whose control all-reduce absorb_window() has waited for (the
// comm stream ran the prediction before it). Which predictions are complete depends only on the
// count of eligible calls, so every rank reads the same ones. A prediction still in flight is
// read by a later call of the bucket; until then the bucket keeps its choice and makes no new
// one (its job and result are a single buffer).
Engine::BudgetChoice Engine::choose_budget(const CallArgs& call, DType dtype) {
  BudgetChoice choice;
  choice.bucket = settings_.codec == "dynamiq" ? bucket_for(call, dtype) : nullptr;
  choice.bits = settings_.budget_bits;
  choice.spec = settings_.parsed_codec_spec;
  Bucket* bucket = choice.bucket;
  if (bucket == nullptr) return choice;
  if (bucket->stats_pending && bucket->predicted_seq < control_absorbed_) read_bucket(*bucket);
  if (settings_.bits_auto && bucket->rung >= 0) {
    choice.bits = candidate_bits(bucket->rung);
    // The settings' own spec at its own budget; another rung of the same codec; or MX.
    if (candidate_is_mx(bucket->rung)) {
      choice.spec = candidate_specs_[bucket->rung];
    } else if (choice.bits != settings_.budget_bits) {
      choice.spec = candidate_specs_[bucket->rung];
      if (!settings_.correlated) choice.spec.correlated_rounding = false;
    }
    choice.with_stats =
        !candidate_is_mx(bucket->rung) || bucket->calls_since_stats + 1 >= kMxStatisticsEvery;
  }
  return choice;
}

// Everything of a compressed call, from the caller's stream handing over to the engine's streams
// to the caller's stream waiting for both; the sampled check around it when this call is checked.
Status Engine::enqueue_call(Plan& plan, const CallArgs& call, DType dtype, uint64_t call_index,
                            bool with_stats, Bucket* predict, uint64_t* wire) {
  Status s = device_->record(ev_start_, call.stream);
  if (s == Status::kOk) s = device_->wait(comm_stream_, ev_start_);
  if (s == Status::kOk) s = device_->wait(compute_stream_, ev_start_);
  // The sampled check: every DYNAMIQ_CHECK_EVERY-th compressed call, an all-reduce, one check
  // in flight at a time. Every input of this decision is identical on every rank.
  const bool checking = check_ && check_->state == Check::State::kNone &&
                        call.collective == Collective::kAllReduce && call.count >= 256 &&
                        (call_index + 1) % static_cast<uint64_t>(settings_.check_every) == 0;
  if (s == Status::kOk && checking) s = enqueue_check_gather(call, dtype, call_index);
  if (s == Status::kOk) s = enqueue_compressed(plan, call, call_index, with_stats, predict, wire);
  if (s == Status::kOk && checking) s = enqueue_check_finish(call, wire);
  // The caller's stream waits for both engine streams: later work on it (or, on the host device,
  // the caller itself) sees the result. This is the call's last enqueue.
  if (s == Status::kOk) s = device_->record(ev_compute_done_, compute_stream_);
  if (s == Status::kOk) s = device_->record(ev_comm_done_, comm_stream_);
  if (s == Status::kOk) s = device_->wait(call.stream, ev_compute_done_);
  if (s == Status::kOk) s = device_->wait(call.stream, ev_comm_done_);
  return s;
}

// A compressed call completed its enqueues: its bucket's state and budget, and the metrics.
void Engine::account_call(const CallArgs& call, DType dtype, const Plan& plan,
                          const BudgetChoice& choice, bool predicted, uint64_t call_index,
                          uint64_t wire, std::chrono::steady_clock::time_point t0) {
  const auto t_end = std::chrono::steady_clock::now();
  DQ_TRACE(Subsys::kEngine, "dynamiq: call %llu rank %d count %zu: %.2f ms, %llu bytes sent",
           static_cast<unsigned long long>(call_index), comm_.rank, call.count,
           std::chrono::duration<double, std::milli>(t_end - t0).count(),
           static_cast<unsigned long long>(wire));
  count(PassReason::kRerouted);
  note_outcome(PassReason::kRerouted, call);
  if (Bucket* bucket = choice.bucket) {
    if (predicted) {
      bucket->stats_pending = true;
      bucket->predicted_seq = control_sent_ - 1;  // this call's control
      bucket->predicted_call = call_index;
    }
    bucket->calls_since_stats = choice.with_stats ? 0 : bucket->calls_since_stats + 1;
    note_budget(*bucket, plan);
  }
  if (metrics_) {
    metrics_->bytes_in.fetch_add(call.count * dtype_size(dtype), std::memory_order_relaxed);
    metrics_->wire_bytes.fetch_add(wire, std::memory_order_relaxed);
    metrics_->nanoseconds.fetch_add(
        static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(t_end - t0).count()),
        std::memory_order_relaxed);
  }
}

ncclResult_t Engine::run(const CallArgs& call, const Screening& screening, PassReason* reason) {
  const auto t0 = std::chrono::steady_clock::now();
  *reason = PassReason::kSingleRank;
  if (broken_ != ncclSuccess) return broken_;
  if (aborting()) return stop_for_abort("as the call started");
  // Under graph capture nothing else may happen first: absorbing the previous call queries an
  // event and reads host words, and a query during a capture is refused by CUDA and invalidates
  // the capture. A captured call passes through untouched; the previous call is absorbed by the
  // next call outside capture.
  if (call.capturing || screening.device_capturing) {
    *reason = decide(call, screening);
    count(*reason);
    return ncclSuccess;
  }
  if (const ncclResult_t r = settle_agreement(call, screening); r != ncclSuccess) return r;
  *reason = decide(call, screening);
  if (*reason != PassReason::kRerouted) {
    count(*reason);
    note_outcome(*reason, call);
    return ncclSuccess;
  }
  if (hierarchy_) return run_two_level(call, reason);  // agreed at the handshake
  // From here on every rank takes the same branch: the switch was agreed a control window ago,
  // plans are agreed when made.
  if (const ncclResult_t r = absorb_window(); r != ncclSuccess) return r;
  pack_call_control(comm_.rank == 0, read_switch(), call_send_slot());
  if (!switch_agreed_) {
    const ncclResult_t r = pass_switched_off(call, reason);
    if (*reason == PassReason::kSwitchOff) note_outcome(*reason, call);
    return r;
  }
  const DType dtype = call.dtype == ncclFloat32 ? DType::kF32 : DType::kBF16;
  const BudgetChoice choice = choose_budget(call, dtype);
  ncclResult_t nccl_failure;
  Plan* plan = plan_for(call, dtype, choice.bits, choice.spec, choice.bucket, &nccl_failure);
  if (nccl_failure != ncclSuccess) return nccl_failure;
  if (plan == nullptr || !plan->fits) {
    *reason = canary_ == Canary::kFailed ? PassReason::kCanaryFailed
              : plan == nullptr          ? PassReason::kFailure
                                         : PassReason::kOverBudget;
    count(*reason);
    note_outcome(*reason, call);
    return ncclSuccess;
  }
  const uint64_t call_index = (shared_call_seq_ != nullptr ? *shared_call_seq_ : call_seq_)++;
  // The job of this call's prediction, in mapped memory before the call's first enqueue.
  Bucket* predict = choice.bucket != nullptr && choice.with_stats &&
                            !choice.bucket->stats_pending && stage_budget(*choice.bucket, *plan)
                        ? choice.bucket
                        : nullptr;
  uint64_t wire = 0;
  if (const Status s =
          enqueue_call(*plan, call, dtype, call_index, choice.with_stats, predict, &wire);
      s != Status::kOk) {
    if (aborting()) return stop_for_abort("while enqueueing");
    DQ_WARN(Subsys::kEngine, "dynamiq: rank %d: enqueueing call %llu failed: %s", comm_.rank,
            static_cast<unsigned long long>(call_index), status_name(s));
    return fail_call(s);
  }
  // A lazy read after the last enqueue: on the host device the call is complete, so a failure in
  // it is reported now; on a GPU it shows here or on a later call.
  if (const ncclResult_t r = async_error(); r != ncclSuccess) return r;
  account_call(call, dtype, *plan, choice, predict != nullptr, call_index, wire, t0);
  return ncclSuccess;
}

}  // namespace dq::engine
