// Agreement between the ranks and the host's waits: the handshake, the blocking MAX all-reduce of
// a new plan, the call's control words (read a control window later), and the communicator's sticky
// asynchronous error (docs/ENGINE.md sections 2-4).
#include <algorithm>
#include <chrono>
#include <cstring>

#include "shim/engine/engine_internal.h"

namespace dq::engine {

ncclResult_t Engine::fail_async(uint32_t word) {
  if (broken_ != ncclSuccess) return broken_;
  if (error_source(word) == ErrorSource::kNccl) {
    broken_ = static_cast<ncclResult_t>(error_code(word));
    DQ_WARN(Subsys::kEngine, "dynamiq: rank %d: an enqueued NCCL call failed: %s", comm_.rank,
            ops_.error_string(broken_));
  } else {
    const Status s = static_cast<Status>(error_code(word));
    broken_ = engine_failure(s);
    DQ_WARN(Subsys::kEngine,
            "dynamiq: rank %d: a codec step failed on the device (%s); the communicator "
            "reports it as its asynchronous error",
            comm_.rank, status_name(s));
  }
  return broken_;
}

ncclResult_t Engine::fail_call(Status s) {
  if (broken_ != ncclSuccess) return broken_;
  // A step that failed where it was enqueued (a CUDA device issues NCCL's calls inline) left its
  // cause in the error word: NCCL's own code (ncclRemoteError for a dead peer) over the Status
  // that reported it.
  if (const uint32_t word = error_word_now(); word != 0) return fail_async(word);
  broken_ = engine_failure(s);
  DQ_WARN(Subsys::kEngine,
          "dynamiq: rank %d: a call failed part-way on this rank (%s); the communicator reports "
          "NCCL error %d (%s) from now on",
          comm_.rank, status_name(s), static_cast<int>(broken_), ops_.error_string(broken_));
  return broken_;
}

ncclResult_t Engine::async_error() {
  if (broken_ != ncclSuccess || control_ == nullptr) return broken_;
  if (const ncclResult_t r = rail_async_error(); r != ncclSuccess) return broken_ = r;
  const uint32_t word = error_word_now();
  return word != 0 ? fail_async(word) : ncclSuccess;
}

uint32_t Engine::error_word_now() const {
  return control_ != nullptr ? __atomic_load_n(control_ + error_word_index(), __ATOMIC_ACQUIRE)
                             : 0u;
}

bool Engine::aborting() const {
  return ops_.abort_flag != nullptr && ops_.abort_flag->load(std::memory_order_acquire);
}

// Another thread began aborting the communicator (NVIDIA's NCCL: its real abort comes before the
// engine's teardown, and frees it): the call in progress enqueues nothing more on it and fails
// with ncclInvalidUsage, as every later call does; `when` says where the call noticed.
ncclResult_t Engine::stop_for_abort(const char* when) {
  if (broken_ != ncclSuccess) return broken_;
  broken_ = ncclInvalidUsage;
  DQ_WARN(Subsys::kEngine,
          "dynamiq: rank %d: the communicator is being aborted (noticed %s): this call enqueues "
          "nothing more and returns NCCL error %d (%s)",
          comm_.rank, when, static_cast<int>(broken_), ops_.error_string(broken_));
  return broken_;
}

// Every NCCL call of the engine is issued here, so none is issued once an abort began: what is
// left is the window of the one NCCL call in progress, as for any framework that aborts from a
// watchdog thread, not the engine's whole sequence of calls. The lane's error word makes the
// steps already queued behind it skip.
Status Engine::enqueue_nccl(Lane lane, std::function<ncclResult_t()> calls) {
  if (!aborting()) return device_->nccl(lane, std::move(calls));
  set_error(lane.error, error_word(ErrorSource::kNccl, ncclInvalidUsage));
  stop_for_abort("before an NCCL call");
  return Status::kUnsupported;  // ncclInvalidUsage
}

// The wait is cut into slices of at most kPeerPollMs: between them NCCL's own verdict on the
// communicator is asked. NVIDIA's NCCL reports a peer it found dead (a closed connection, an
// exhausted retry) through ncclCommGetAsyncError while its kernels keep waiting, and a
// communicator's first call (the handshake) or a new size's plan waits inside the caller's NCCL
// call, where no framework watchdog has a work item to time out: without the question such a
// wait would last DYNAMIQ_TIMEOUT_MS (30 min) for a peer NCCL already knew was gone.
ncclResult_t Engine::wait_for_peers(EventHandle e, const char* what) {
  constexpr int64_t kPeerPollMs = 1000;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(settings_.timeout_ms);
  Status s = Status::kTimeout;
  ncclResult_t reported = ncclSuccess;  // NCCL's asynchronous error, once it has one
  for (int64_t left = settings_.timeout_ms;;) {
    s = device_->synchronize_for(e, std::max<int64_t>(1, std::min(left, kPeerPollMs)));
    if (s != Status::kTimeout || aborting() || left <= kPeerPollMs) break;
    ncclResult_t state = ncclSuccess;
    if (ops_.comm_get_async_error != nullptr &&
        ops_.comm_get_async_error(comm_.comm, &state) == ncclSuccess && state != ncclSuccess &&
        state != ncclInProgress) {
      reported = state;
      break;
    }
    left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                 std::chrono::steady_clock::now())
               .count();
  }
  if (aborting()) return stop_for_abort(what);
  if (s == Status::kOk) return ncclSuccess;
  if (reported != ncclSuccess) {
    if (broken_ == ncclSuccess) {
      broken_ = reported;
      DQ_WARN(Subsys::kEngine,
              "dynamiq: rank %d: NCCL reports this communicator failed (%s) while it waited for "
              "%s; the communicator returns that error until it is aborted",
              comm_.rank, ops_.error_string(reported), what);
    }
    return broken_;
  }
  // Work of this communicator may still be queued behind `e`: nothing of it is read, and every
  // later call returns the error until the application aborts the communicator (as it does when
  // NCCL reports a failed peer). kTimeout answers ncclRemoteError, as the CPU NCCL does.
  if (broken_ == ncclSuccess) {
    broken_ = engine_failure(s);
    if (s == Status::kTimeout)
      DQ_WARN(Subsys::kEngine,
              "dynamiq: rank %d: %s did not complete within DYNAMIQ_TIMEOUT_MS = %lld ms (a peer "
              "stopped answering?); the communicator returns NCCL error %d (%s) until it is "
              "aborted",
              comm_.rank, what, static_cast<long long>(settings_.timeout_ms),
              static_cast<int>(broken_), ops_.error_string(broken_));
    else
      DQ_WARN(Subsys::kEngine,
              "dynamiq: rank %d: waiting for %s failed (%s); the communicator "
              "returns NCCL error %d (%s) until it is aborted",
              comm_.rank, what, status_name(s), static_cast<int>(broken_),
              ops_.error_string(broken_));
  }
  return broken_;
}

ncclResult_t Engine::blocking_max(const uint32_t* in, uint32_t* out, int n) {
  uint32_t* send = control_ + scratch_send_word();
  uint32_t* recv = control_ + scratch_recv_word();
  std::memcpy(send, in, static_cast<size_t>(n) * 4);
  const Lane lane{comm_stream_, control_ + error_word_index()};
  const NcclOps ops = ops_;
  ncclComm_t comm = comm_.comm;
  auto stream = static_cast<cudaStream_t>(comm_stream_);
  const int64_t timeout_ms = settings_.timeout_ms;
  Status s = enqueue_nccl(lane, [=] {
    return ops.settled(
        comm, ops.all_reduce(send, recv, static_cast<size_t>(n), ncclUint32, ncclMax, comm, stream),
        timeout_ms);
  });
  if (s == Status::kOk) s = device_->record(ev_comm_done_, comm_stream_);
  // As any call's failure: sticky, and NCCL's own code where a device that issues NCCL's calls
  // inline left it in the error word (ncclRemoteError for a dead peer, not ncclSystemError).
  if (s != Status::kOk) return fail_call(s);
  if (const ncclResult_t r = wait_for_peers(ev_comm_done_, "a blocking control all-reduce");
      r != ncclSuccess)
    return r;
  if (const ncclResult_t r = async_error(); r != ncclSuccess) return r;
  std::memcpy(out, recv, static_cast<size_t>(n) * 4);
  return ncclSuccess;
}

ncclResult_t Engine::handshake() {
  LocalControl local{&settings_, settings_valid_, opted_in_, comm_.rank == 0, read_switch(), false};
  std::vector<uint32_t> words(control_words()), reduced(control_words());
  pack_control(local, words.data());
  const ncclResult_t r = blocking_max(words.data(), reduced.data(), control_words());
  if (r != ncclSuccess) {
    DQ_WARN(Subsys::kEngine, "dynamiq: handshake all-reduce failed: %s", ops_.error_string(r));
    return r;
  }
  const ControlDecision d = decide_control(reduced.data());
  if (!d.agreed) {
    warn_differs(d.differs);
    state_ = State::kInert;
  } else {
    state_ = d.settings_enabled ? State::kAgreed : State::kInert;
  }
  switch_agreed_ = d.switch_on;
  // Only a communicator every rank opted in gets the two-level schedule's communicators (4
  // splits, streams, rail engines): one nobody opted in (a pipeline group DYNAMIQ_COMMS leaves
  // out) passes every call through and would never use them. d.enabled is agreed, so every rank
  // splits or none.
  if (state_ == State::kAgreed && d.enabled)
    if (const ncclResult_t r2 = setup_hierarchy(); r2 != ncclSuccess) return r2;
  log_decision(d);
  return ncclSuccess;
}

// A rank whose device could not be set up still answers its peers' handshake, with invalid
// settings, so that every rank passes the communicator's calls through (rather than its peers
// waiting in a handshake it never joins), through the real NCCL on the caller's stream. The words
// lie in mapped memory of the device whose set-up failed, which NVIDIA's NCCL can read and write
// (never pageable host memory), kept for the engine's life: the rank never reads the result, so
// it never waits for it. Without even that memory it cannot take part: the call fails, and its
// peers' handshake ends at DYNAMIQ_TIMEOUT_MS.
ncclResult_t Engine::handshake_without_device(cudaStream_t stream) {
  LocalControl local{&settings_, false, opted_in_, comm_.rank == 0, true, false};
  const size_t n = static_cast<size_t>(control_words());
  // Either failure is sticky, as every failure of the handshake: its peers' handshake failed or
  // took this rank's words, so a later stand-in, or a later pass-through, would meet their next
  // collective instead (another size and type: a hang or a corrupted sum).
  if (standby_words_ == nullptr &&
      (standby_ == nullptr || standby_->alloc_mapped(2 * n * 4, &standby_words_) != Status::kOk)) {
    standby_words_ = nullptr;
    state_ = State::kInert;
    DQ_WARN(Subsys::kEngine,
            "dynamiq: rank %d: no device memory for the handshake's words; this rank cannot take "
            "part, and its peers' handshake fails at DYNAMIQ_TIMEOUT_MS",
            comm_.rank);
    return broken_ = ncclSystemError;
  }
  auto* send = static_cast<uint32_t*>(standby_words_);
  pack_control(local, send);
  const ncclResult_t r = ops_.settled(
      comm_.comm, ops_.all_reduce(send, send + n, n, ncclUint32, ncclMax, comm_.comm, stream),
      settings_.timeout_ms);
  if (r != ncclSuccess) {
    state_ = State::kInert;
    DQ_WARN(Subsys::kEngine,
            "dynamiq: rank %d: the handshake's all-reduce failed (NCCL error %d, %s); this "
            "communicator's calls fail from now on",
            comm_.rank, static_cast<int>(r), ops_.error_string(r));
    return broken_ = r;
  }
  state_ = State::kInert;
  log_decision_without_handshake(
      "this rank could not set up its device (see its WARN line); every rank passes through");
  return ncclSuccess;
}

uint32_t* Engine::call_send_slot() {
  return control_ + call_send_word(static_cast<int>(control_sent_ % control_window()));
}

// The control window: eligible call k sends its words in slot k % W (W = DYNAMIQ_CONTROL_WINDOW)
// and applies the A/B switch that call k - W agreed (the handshake's for k < W). So before it
// sends, the host reads call k - W's words, waiting for that call's control all-reduce only if it
// is still in flight: up to W compressed calls are in flight (enqueued, not complete), and a call
// whose window is not full never waits. Which words a call reads depends only on k, so every rank
// takes the same switch; a bucket's prediction (choose_budget) and the sampled check are read
// once their call's control is absorbed, by the same rule.
ncclResult_t Engine::absorb_window() {
  const int window = control_window();
  while (control_sent_ - control_absorbed_ >= static_cast<uint64_t>(window)) {
    const int slot = static_cast<int>(control_absorbed_ % static_cast<uint64_t>(window));
    const auto t0 = std::chrono::steady_clock::now();
    const ncclResult_t r =
        wait_for_peers(ev_controls_[slot], "the control all-reduce a window of calls back");
    if (metrics_)
      metrics_->window_wait_nanoseconds.fetch_add(
          static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::steady_clock::now() - t0)
                                    .count()),
          std::memory_order_relaxed);
    if (r != ncclSuccess) return r;
    const bool on = decide_call_switch(control_ + call_recv_word(slot, window));
    if (on != switch_agreed_)
      DQ_INFO(Subsys::kEngine, "dynamiq: rank %d: the A/B switch turns compression %s", comm_.rank,
              on ? "on" : "off");
    switch_agreed_ = on;
    ++control_absorbed_;
    // That control came after the comm stream waited for an armed check: it is complete.
    if (check_ && check_->state == Check::State::kArmed && check_->armed_seq < control_absorbed_)
      read_check();
  }
  return async_error();
}

Status Engine::enqueue_call_control(const uint16_t* stats_local, uint16_t* stats_reduced,
                                    const std::vector<StatsSpan>& spans, Bucket* predict,
                                    uint64_t* wire_bytes, EventHandle reduced) {
  size_t stats_words = 0;
  for (const StatsSpan& s : spans) stats_words += s.words;
  const int slot = static_cast<int>(control_sent_ % static_cast<uint64_t>(control_window()));
  uint32_t* send = control_ + call_send_word(slot);
  uint32_t* recv = control_ + call_recv_word(slot, control_window());
  const Lane lane{comm_stream_, control_ + error_word_index()};
  const NcclOps ops = ops_;
  ncclComm_t comm = comm_.comm;
  auto stream = static_cast<cudaStream_t>(comm_stream_);
  const int64_t timeout_ms = settings_.timeout_ms;
  // A check enqueued by an earlier call: this control event comes after it, so the host's wait
  // for this event (or a later one) finds the check's copies complete. No host wait here.
  const bool arm = check_ && check_->state == Check::State::kEnqueued;
  if (arm) DQ_CHECK(device_->wait(comm_stream_, check_->done));
  DQ_CHECK(enqueue_nccl(lane, [=] {
    ncclResult_t r = ops.group_start();
    // One all-reduce a span: BF16 words, or the all-zero counts' bytes as unsigned integers.
    for (const StatsSpan& s : spans) {
      if (r != ncclSuccess) break;
      r = s.bytes ? ops.all_reduce(stats_local + s.first, stats_reduced + s.first, 2 * s.words,
                                   ncclUint8, ncclSum, comm, stream)
                  : ops.all_reduce(stats_local + s.first, stats_reduced + s.first, s.words,
                                   ncclBfloat16, ncclSum, comm, stream);
    }
    if (r == ncclSuccess)
      r = ops.all_reduce(send, recv, kCallControlWords, ncclUint32, ncclMax, comm, stream);
    const ncclResult_t end = ops.settled(comm, ops.group_end(), timeout_ms);
    return r == ncclSuccess ? end : r;
  }));
  // The layouts need the reduced statistics only, not the prediction below: their event first.
  if (reduced != nullptr) DQ_CHECK(device_->record(reduced, comm_stream_));
  // The budget's prediction from the reduced statistics, on the device, before the control
  // event: the host reads it once it has waited for this event or a later one (absorb_window).
  // The host never reads the statistics.
  if (predict != nullptr && stats_words > 0)
    DQ_CHECK(device_->predict_budget(predict->job, stats_reduced, budget_scratch_,
                                     budget_scratch_bytes_, predict->result, lane));
  DQ_CHECK(device_->record(ev_controls_[slot], comm_stream_));
  if (arm) {
    check_->state = Check::State::kArmed;
    check_->armed_seq = control_sent_;
  }
  ++control_sent_;
  // As a ring all-reduce sends them: 2 (n-1)/n of the words.
  const size_t n = static_cast<size_t>(comm_.nranks);
  *wire_bytes += (2 * stats_words * 2 + kCallControlWords * 4) * (n - 1) / n;
  return Status::kOk;
}

}  // namespace dq::engine
