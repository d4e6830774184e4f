// The engine itself (no shim) on forked rank processes over the CPU NCCL, with devices a test
// controls. Usage: engine_multirank SCENARIO NRANKS [TOPO]. Exit 0 pass, 1 fail.
//   audit       the audited host device records no host access to device memory between a
//               call's first enqueue and its last, and its results equal the plain host
//               device's byte for byte (both dtypes, both ops, multi-block calls)
//   alloc_fail  rank 1's first plan allocation fails: every rank passes that call through
//               (no hang, exact), and the next call is compressed on every rank
//   budget_scratch_fail  the same with only the budget's scratch failing (a CUDA device's)
//   event_fail  the same with only the events between its streams failing (made with the plan,
//               not at the call, after its control all-reduce was enqueued)
//   blocks      two pipeline blocks holding identical data round differently, so do two calls on
//               the same input, and so do three reduce-scatter blocks (errors uncorrelated)
//   collectives reduce-scatter and reduce (every root), FP32/BF16, SUM/AVG, in and out of place:
//               compressed on every rank, each rank's output near the exact sum, the same
//               bytes when the same call is repeated on a fresh engine (same seed)
//   setup_fail  rank 1's device cannot create streams: every rank passes through, no hang; a
//               first call inside a group is held back to the group's end on every rank
//   budget      exactly DYNAMIQ_MIN_BYTES is compressed, 4 bytes less is not; bytes sent per rank
//               against the budget
//   not_opted_in  DYNAMIQ_COMMS=none: calls count as not_opted_in (not disabled)
//   plan_cache  DYNAMIQ_PLAN_CACHE 2 and 3 with 3 call shapes in turn: every call re-plans, or
//               only the first round; the metrics count it; the outputs are the same bytes
//   corrupt     rank 1 corrupts the payloads it sends: the receiver finds it in data (device
//               error word), and every rank's call fails within the timeout; none succeeds
//   auto        DYNAMIQ_BITS=auto, two buckets called 5 times each: a bucket's first call takes 5
//               bits, every rank chooses the same budgets, a loose target gives 3 bits and an
//               unreachable one 8, a NaN
//               call leaves the next call at 5 bits, and each call's predicted vNMSE is within
//               [0.5, 2] of its measured one; on dense data (one scale everywhere) the MXFP8
//               target sends the bucket as MXFP8 after its first call, with the statistics
//               of every 8th call only, and its error is MXFP8's
//   auto_target DYNAMIQ_BITS=auto with a vNMSE target 1/1.25 of the 4.5-bit budget's predicted
//               vNMSE on the same input: auto chooses more than 4.5 bits, and the chosen rung's
//               predicted vNMSE is within the target
//   check       DYNAMIQ_CHECK_EVERY=2: every other all-reduce is checked against an exact
//               all-reduce of 64 super-groups; the sampled vNMSE is near the measured one and
//               the predicted one, outputs are the bytes of the same calls without the check,
//               in place too, and a NaN call's check counts as non-finite
//   split_settles  two-level (2 fake nodes): splits that answer ncclInProgress (a non-blocking
//               parent) and settle after some polls give the two-level schedule, both where the
//               child's handle comes at once and is polled (the CPU NCCL's way) and where it is
//               written only once the parent's polls report the split done (NVIDIA's); a split
//               that never settles on rank 1 costs one DYNAMIQ_TIMEOUT_MS, then every rank runs
//               flat and aborts its node and rail communicators; results exact in every case
//   byte_counts from 16 ranks, each part's statistics all-reduced as BF16 words and its all-zero
//               counts as bytes (ncclUint8) right after them; below, one BF16 all-reduce; the
//               result near the sum on data whose odd super-groups are one rank's alone
//   rail_overlap  two-level (2 x 2 fake nodes), an all-reduce in 4 pieces: piece 1's statistics
//               all-reduce is issued while piece 0's first rail message is held back (the two rail
//               engines); the call's result near the exact sum
//   teardown_order  two-level (2 x 2 fake nodes): without ncclCommRevoke an aborted engine on a
//               device whose aborts end its queued NCCL work (a GPU's answer) aborts its four
//               split communicators before any wait, on the host device's answer only after the
//               rail engines' waits; with one it revokes them before any wait on either; a
//               healthy one destroys them
//   enqueue_fail  rank 1's device fails part-way through a compressed call: that call fails, and
//               every later one on rank 1 fails at once with the same error, issuing nothing
//   nccl_code_kept  every rank's device reports NCCL's ncclRemoteError for a call it issued inline
//               (a cached plan's call, the handshake, a new plan's agreement): that call, the next
//               and the asynchronous error are it (not ncclSystemError)
//   auto_plan_fail  DYNAMIQ_BITS=auto: a new rung's plan fails on rank 1; every rank passes the
//               call through, and the bucket's later calls still follow its predictions
//   auto_plan_fail_always  the same, rank 1 failing every new plan: the bucket's default plan
//               carries its calls, the failed rung tried again at growing intervals
//   shard_alloc_fail  two-level (2 x 2 fake nodes): rank 1's shard allocation fails at the first
//               call: every rank passes it through, and every rank compresses the next one
//   two_level_in_progress  two-level (2 x 2 fake nodes), every communicator non-blocking (each
//               call and group end answers ncclInProgress; a call before it settles is refused):
//               all-reduce with a tail, reduce-scatter and reduce compressed and near the sum
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/nccl_api.h"
#include "config/settings.h"
#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "kernels/dynamiq_layout.h"
#include "shim/engine/engine.h"
#include "tests/common/engine_test_util.h"
#include "tests/common/rank_harness.h"
#include "tests/common/test_data.h"

namespace {

using dq::engine::CallArgs;
using dq::engine::Device;
using dq::engine::Engine;
using dq::engine::PassReason;

using dq::test::call_of;
using dq::test::cpu_nccl_ops;
using dq::test::settings_for;

// One FP32 SUM all-reduce of `in` into `out` (its size) through a fresh engine on the host
// device, with `ops`; the engine is gone when it returns.
ncclResult_t all_reduce_once(const dq::config::Settings& settings, const dq::engine::NcclOps& ops,
                             ncclComm_t comm, int rank, int n, const std::vector<float>& in,
                             std::vector<float>* out, PassReason* reason) {
  Engine engine(settings, true, {comm, rank, n}, ops, dq::engine::host_device(), nullptr, true);
  CallArgs args = call_of(in.data(), out->data(), in.size());
  return engine.run(args, reason);
}

// Forks n ranks, each with `comms` communicators; returns their exit codes (124: hang, killed;
// 125: killed after another rank failed).
std::vector<int> run_ranks(int n, int comms, const std::function<int(int, ncclComm_t*)>& body,
                           int timeout_s) {
  dq::test::RankOptions opt;
  opt.timeout_s = timeout_s;
  const auto exits = dq::test::run_ranks<ncclUniqueId>(
      n, comms, ncclGetUniqueId, opt, [&](int r, const ncclUniqueId* ids) {
        std::vector<ncclComm_t> c(comms);
        for (int k = 0; k < comms; ++k)
          if (ncclCommInitRank(&c[k], n, ids[k], r) != ncclSuccess) return 97;
        return body(r, c.data());
      });
  std::vector<int> codes;
  for (const auto& e : exits) codes.push_back(e.code());
  return codes;
}

bool all_zero(const std::vector<int>& codes, const char* what) {
  bool ok = true;
  for (size_t r = 0; r < codes.size(); ++r)
    if (codes[r] != 0) {
      std::fprintf(stderr, "FAIL: %s: rank %zu exited with %d%s\n", what, r, codes[r],
                   codes[r] == 124   ? " (hang: killed at the deadline)"
                   : codes[r] == 125 ? " (killed: another rank failed)"
                                     : "");
      ok = false;
    }
  return ok;
}

// True when `h` is the same on every rank: MAX of (h, ~h) gives max and ~min.

float gradient_value(int rank, size_t i) {
  // Smooth per-rank data with varied magnitudes, like a gradient bucket.
  const double x = static_cast<double>(i);
  return static_cast<float>(std::sin(0.001 * x + rank) * (1.0 + 4.0 * std::cos(0.00003 * x)));
}

std::vector<unsigned char> make_input(int rank, size_t count, bool bf16) {
  std::vector<unsigned char> in(count * (bf16 ? 2 : 4));
  for (size_t i = 0; i < count; ++i) {
    const float v = gradient_value(rank, i);
    if (bf16) {
      const uint16_t b = dq::f32_to_bf16_rne(v);
      std::memcpy(&in[i * 2], &b, 2);
    } else {
      std::memcpy(&in[i * 4], &v, 4);
    }
  }
  return in;
}

// ---- audit ------------------------------------------------------------------------------------
int scenario_audit(int n, const std::string& topo) {
  const auto settings = settings_for(
      {{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_TOPO", topo}, {"DYNAMIQ_BLOCK_BYTES", "256K"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    std::unique_ptr<Device> audited = dq::engine::make_audited_host_device();
    const dq::engine::NcclOps ops = cpu_nccl_ops();
    Engine plain(settings, true, {comms[0], rank, n}, ops, dq::engine::host_device(), nullptr,
                 true);
    Engine checked(settings, true, {comms[1], rank, n}, ops, audited.get(), nullptr, true);
    constexpr size_t kCount = 600000 + 77;  // several 256 KiB blocks, a partial super-group
    int call = 0;
    for (int bf16 = 0; bf16 < 2; ++bf16)
      for (int avg = 0; avg < 2; ++avg, ++call) {
        const auto in = make_input(rank, kCount, bf16);
        std::vector<unsigned char> out_plain(in.size(), 0xCD), out_checked(in.size(), 0xEF);
        CallArgs args;
        args.count = kCount;
        args.dtype = bf16 ? ncclBfloat16 : ncclFloat32;
        args.op = avg ? ncclAvg : ncclSum;
        PassReason rp, rc;
        args.send = in.data();
        args.recv = out_plain.data();
        CHECK_OR(10, plain.run(args, &rp) == ncclSuccess, "rank %d call %d: plain", rank, call);
        args.recv = out_checked.data();
        CHECK_OR(11, checked.run(args, &rc) == ncclSuccess, "rank %d call %d: audited", rank, call);
        CHECK_OR(12, rp == PassReason::kRerouted && rc == PassReason::kRerouted,
                 "rank %d call %d: not compressed (%s / %s)", rank, call,
                 dq::engine::reason_name(rp), dq::engine::reason_name(rc));
        CHECK_OR(13, out_plain == out_checked,
                 "rank %d call %d: the audited device's result differs from the host device's",
                 rank, call);
        CHECK_OR(14, dq::test::same_bytes_everywhere(comms[0], out_plain.data(), out_plain.size()),
                 "rank %d call %d: results differ across ranks", rank, call);
      }
    const uint64_t accesses = dq::engine::audited_host_accesses(audited.get());
    CHECK_OR(15, accesses == 0,
             "rank %d: %llu host access(es) to device memory between a call's first and last "
             "enqueue",
             rank, static_cast<unsigned long long>(accesses));
    std::fprintf(stderr, "rank %d: 4 calls, audited bytes equal plain bytes, 0 host accesses\n",
                 rank);
    return 0;
  };
  if (!all_zero(run_ranks(n, 2, body, 300), "audit")) return 1;
  std::printf("audit %s %d ranks: no host access inside a call; audited == plain bytes\n",
              topo.c_str(), n);
  return 0;
}

// ---- allocation failure on one rank -------------------------------------------------------
// The host device, but alloc fails while `failing` is set (or, while `failing_scratch` is set,
// for the budget's scratch alone: the bytes budget_scratch_bytes() asks, when
// `scratch_bytes_per_part` makes it ask some, as a CUDA device does), and every hop's output
// header is overwritten (in stream order) while `corrupting` is set.
class FailingDevice final : public Device {
 public:
  explicit FailingDevice(Device* inner) : inner_(inner) {}
  bool failing = false;
  bool failing_scratch = false;
  size_t scratch_bytes_per_part = 0;
  size_t scratch_asked = 0;  // the bytes of the latest budget_scratch_bytes()
  int failed_allocs = 0;
  bool corrupting = false;
  bool no_streams = false;
  bool stalled = false;   // synchronize_for: the bound elapses, as on a GPU whose peer hangs
  int64_t bound_ms = -1;  // the bound the engine last gave synchronize_for
  int bounded_waits = 0;
  std::function<void()> during_bounded_wait;  // run inside each synchronize_for, when set
  std::function<void()> before_nccl;          // run before each NCCL enqueue, when set
  int finish_delay_ms = 0;                    // each finish of chunk 0 queued behind a sleep
  int nccl_enqueues = 0;
  // batches_layouts() answers this (a CUDA device's true); the engine's order of enqueued
  // layouts and hops: the layout each names (in enqueue order, which is the compute stream's).
  bool batched_layouts = false;
  struct Enqueued {
    bool layout;  // else a hop
    const void* layout_memory;
  };
  std::vector<Enqueued> enqueued;
  const char* name() const override { return "failing host"; }
  bool batches_layouts() const override { return batched_layouts; }
  // abort_ends_queued_nccl_work() answers this (a CUDA device's true).
  bool aborts_end_work = false;
  bool abort_ends_queued_nccl_work() const override { return aborts_end_work; }
  // Called with "wait" at each stream destroy and bounded wait, when set.
  std::function<void(const char*)> on_wait;
  size_t fail_bytes = 0;  // allocations of exactly this size fail while fail_times > 0
  int fail_times = 0;
  dq::Status alloc(size_t bytes, void** out) override {
    if (fail_times > 0 && bytes == fail_bytes) {
      --fail_times;
      ++failed_allocs;
      return dq::Status::kOutOfMemory;
    }
    if (failing || (failing_scratch && scratch_asked != 0 && bytes == scratch_asked)) {
      ++failed_allocs;
      return dq::Status::kOutOfMemory;
    }
    return inner_->alloc(bytes, out);
  }
  size_t budget_scratch_bytes(uint32_t n_parts, uint64_t /*key_entries*/) const override {
    // A distinctive size no other allocation of these tests has (an odd number of bytes).
    const size_t bytes = scratch_bytes_per_part == 0 ? 0 : scratch_bytes_per_part * n_parts + 1;
    const_cast<FailingDevice*>(this)->scratch_asked = bytes;
    return bytes;
  }
  dq::Status alloc_mapped(size_t bytes, void** out) override {
    return inner_->alloc_mapped(bytes, out);
  }
  void release(void* p, dq::engine::StreamHandle s) override { inner_->release(p, s); }
  dq::Status create_stream(dq::engine::StreamHandle* s) override {
    if (no_streams) return dq::Status::kSystemError;
    return inner_->create_stream(s);
  }
  void destroy_stream(dq::engine::StreamHandle s) override {
    if (on_wait) on_wait("wait");  // destroying a stream waits for its work
    inner_->destroy_stream(s);
  }
  bool failing_events = false;  // create_event() fails (as cudaEventCreate may)
  int failed_events = 0;
  dq::Status create_event(dq::engine::EventHandle* e) override {
    if (failing_events) {
      ++failed_events;
      return dq::Status::kSystemError;
    }
    return inner_->create_event(e);
  }
  void destroy_event(dq::engine::EventHandle e) override { inner_->destroy_event(e); }
  bool failing_records = false;  // record() fails (as a CUDA event record may)
  dq::Status record(dq::engine::EventHandle e, dq::engine::StreamHandle s) override {
    if (failing_records) return dq::Status::kSystemError;
    return inner_->record(e, s);
  }
  dq::Status wait(dq::engine::StreamHandle s, dq::engine::EventHandle e) override {
    return inner_->wait(s, e);
  }
  dq::Status synchronize(dq::engine::EventHandle e) override { return inner_->synchronize(e); }
  bool query(dq::engine::EventHandle e) override { return inner_->query(e); }
  dq::Status synchronize_for(dq::engine::EventHandle e, int64_t timeout_ms) override {
    bound_ms = timeout_ms;
    ++bounded_waits;
    if (on_wait) on_wait("wait");
    if (during_bounded_wait) during_bounded_wait();
    // Not stalled: unbounded, so a slow start on a loaded machine never trips the short bound
    // this test sets (the host device honours it too).
    if (!stalled) return inner_->synchronize(e);
    // What the CUDA device answers when NVIDIA's NCCL never completes a peer's part.
    std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
    return dq::Status::kTimeout;
  }
  bool capturing(dq::engine::StreamHandle s) const override { return inner_->capturing(s); }
  std::unique_ptr<dq::engine::PreparedCodec> prepare(const dq::Codec& c) override {
    return inner_->prepare(c);
  }
  dq::Status local_stats(const dq::engine::PreparedCodec& c, const dq::ConstTensor& x, uint16_t* st,
                         dq::engine::Lane l) override {
    return inner_->local_stats(c, x, st, l);
  }
  dq::Status build_layout(const dq::engine::PreparedCodec& c, const uint16_t* r, uint64_t call,
                          void* layout, dq::engine::Lane l) override {
    enqueued.push_back({true, layout});
    return inner_->build_layout(c, r, call, layout, l);
  }
  dq::Status hop(const dq::engine::PreparedCodec& c, const void* layout, int chunk,
                 const dq::ConstTensor& own, const dq::ByteView* in, int n_in, uint8_t* out,
                 const dq::RoundingKey& key, dq::engine::Lane l) override {
    enqueued.push_back({false, layout});
    const dq::Status s = inner_->hop(c, layout, chunk, own, in, n_in, out, key, l);
    static const unsigned char kGarbage[16] = {0xde, 0xad, 0xbe, 0xef, 1, 2,  3,  4,
                                               5,    6,    7,    8,    9, 10, 11, 12};
    if (s != dq::Status::kOk || !corrupting) return s;
    return inner_->copy(out, kGarbage, sizeof kGarbage, l);
  }
  dq::Status finish(const dq::engine::PreparedCodec& c, const void* layout, int chunk,
                    dq::ByteView in, void* out, dq::DType t, dq::ReduceOp op, int n,
                    dq::engine::Lane l) override {
    if (finish_delay_ms > 0 && chunk == 0) {  // a sleep queued before it on its stream
      const int ms = finish_delay_ms;
      inner_->nccl(dq::engine::Lane{l.stream, nullptr}, [ms] {
        std::this_thread::sleep_for(std::chrono::milliseconds(ms));
        return ncclSuccess;
      });
    }
    return inner_->finish(c, layout, chunk, in, out, t, op, n, l);
  }
  dq::Status copy(void* d, const void* s, size_t b, dq::engine::Lane l) override {
    return inner_->copy(d, s, b, l);
  }
  dq::Status predict_budget(const dq::BudgetJob* j, const uint16_t* r, void* scratch, size_t bytes,
                            dq::BudgetResult* out, dq::engine::Lane l) override {
    return inner_->predict_budget(j, r, scratch, bytes, out, l);
  }
  // Set: the next NCCL enqueue fails as a CUDA device's does when NCCL refuses a call it issues
  // inline (a peer found dead): the code in the lane's error word, kSystemError returned.
  ncclResult_t inline_nccl_failure = ncclSuccess;
  dq::Status nccl(dq::engine::Lane l, std::function<ncclResult_t()> calls) override {
    ++nccl_enqueues;
    if (before_nccl) before_nccl();
    if (inline_nccl_failure != ncclSuccess) {
      dq::engine::set_error(
          l.error, dq::engine::error_word(dq::engine::ErrorSource::kNccl, inline_nccl_failure));
      inline_nccl_failure = ncclSuccess;
      return dq::Status::kSystemError;
    }
    return inner_->nccl(l, std::move(calls));
  }

 private:
  Device* inner_;
};

// What fails on rank 1 at its first plan: the plan's buffers; only the budget's scratch (device
// memory a bucket's first plan reserves); only the events its calls record between the streams.
// Each is agreed with the plan all the same.
enum class PlanFault { kBuffers, kBudgetScratch, kEvents };
int scenario_alloc_fail(int n, PlanFault fault) {
  const bool budget_scratch = fault == PlanFault::kBudgetScratch;
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    FailingDevice device(dq::engine::host_device());
    if (budget_scratch) device.scratch_bytes_per_part = 4096;
    Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), &device, nullptr, true);
    constexpr size_t kCount = 1 << 20;
    std::vector<float> in(kCount), out(kCount);
    for (size_t i = 0; i < kCount; ++i)
      in[i] = static_cast<float>(static_cast<int>((i * 7 + rank * 13) % 97) - 48);
    std::string reasons;
    // Rank 1 would fail calls 0 and 1; after the agreed failure of call 0 the next call of the
    // shape passes through without an attempt (its plan is not tried again at once), so call 1
    // fails nothing and call 2 retries and compresses.
    for (int call = 0; call < 3; ++call) {
      (fault == PlanFault::kEvents ? device.failing_events
       : budget_scratch            ? device.failing_scratch
                                   : device.failing) = rank == 1 && call <= 1;
      CallArgs args = call_of(in.data(), out.data(), kCount);
      PassReason reason;
      CHECK_OR(20, engine.run(args, &reason) == ncclSuccess, "rank %d call %d: error", rank, call);
      if (reason != PassReason::kRerouted) {
        // What the shim does: pass the call through to NCCL.
        CHECK_OR(21,
                 ncclAllReduce(in.data(), out.data(), kCount, ncclFloat32, ncclSum, comms[0],
                               nullptr) == ncclSuccess,
                 "rank %d call %d: pass-through failed", rank, call);
        for (size_t i = 0; i < kCount; ++i) {
          float exact = 0;
          for (int r = 0; r < n; ++r)
            exact += static_cast<float>(static_cast<int>((i * 7 + r * 13) % 97) - 48);
          CHECK_OR(22, out[i] == exact, "rank %d call %d: element %zu = %g, exact %g", rank, call,
                   i, out[i], exact);
        }
      }
      reasons += dq::engine::reason_name(reason);
      reasons += ' ';
    }
    CHECK_OR(23, dq::test::same_bytes_everywhere(comms[0], reasons.data(), reasons.size()),
             "rank %d: outcomes differ across ranks (mine: %s)", rank, reasons.c_str());
    const std::string failure = dq::engine::reason_name(PassReason::kFailure);
    const std::string expect =
        failure + " " + failure + " " + dq::engine::reason_name(PassReason::kRerouted) + " ";
    CHECK_OR(24, reasons == expect, "rank %d: outcomes '%s', expected '%s'", rank, reasons.c_str(),
             expect.c_str());
    // The failure came from what the scenario fails (and from nothing else).
    // (Events: the failed plan's retirement asks for one more.)
    const int failed = fault == PlanFault::kEvents ? device.failed_events : device.failed_allocs;
    CHECK_OR(25,
             rank == 1 ? failed == 1 || (failed >= 1 && fault == PlanFault::kEvents) : failed == 0,
             "rank %d: %d allocations or events failed", rank, failed);
    return 0;
  };
  if (!all_zero(run_ranks(n, 1, body, 120), "alloc_fail")) return 1;
  // A shape whose bucket was set up before (its first plan made, then evicted by another shape
  // with one plan cached) backs off the same way: the default budget has no rung to avoid.
  auto evicted_body = [&](int rank, ncclComm_t* comms) -> int {
    const auto one_plan = settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_PLAN_CACHE", "1"}});
    FailingDevice device(dq::engine::host_device());
    Engine engine(one_plan, true, {comms[0], rank, n}, cpu_nccl_ops(), &device, nullptr, true);
    constexpr size_t kA = 1 << 20, kB = 3 << 18;
    std::vector<float> in(kA, 1.0f), out(kA);
    std::string reasons;
    // A, B (evicts A's plan), then A three times with rank 1's allocations failing twice.
    const size_t counts[] = {kA, kB, kA, kA, kA};
    for (int call = 0; call < 5; ++call) {
      device.failing = rank == 1 && (call == 2 || call == 3);
      CallArgs args = call_of(in.data(), out.data(), counts[call]);
      PassReason reason;
      CHECK_OR(26, engine.run(args, &reason) == ncclSuccess, "rank %d call %d: error", rank, call);
      if (reason != PassReason::kRerouted)
        CHECK_OR(27,
                 ncclAllReduce(in.data(), out.data(), counts[call], ncclFloat32, ncclSum, comms[0],
                               nullptr) == ncclSuccess,
                 "rank %d call %d: pass-through failed", rank, call);
      reasons += dq::engine::reason_name(reason);
      reasons += ' ';
    }
    const std::string r = dq::engine::reason_name(PassReason::kRerouted);
    const std::string f = dq::engine::reason_name(PassReason::kFailure);
    const std::string expect = r + " " + r + " " + f + " " + f + " " + r + " ";
    CHECK_OR(28, reasons == expect && device.failed_allocs == (rank == 1 ? 1 : 0),
             "rank %d: outcomes '%s' with %d failed allocations, expected '%s' with %d", rank,
             reasons.c_str(), device.failed_allocs, expect.c_str(), rank == 1 ? 1 : 0);
    return 0;
  };
  if (fault == PlanFault::kBuffers && !all_zero(run_ranks(n, 1, evicted_body, 120), "alloc_fail"))
    return 1;
  std::printf(
      "alloc_fail %d ranks: rank 1's failed %s passed through on every rank, the next call "
      "without an attempt, then every rank compressed\n",
      n,
      fault == PlanFault::kEvents ? "events"
      : budget_scratch            ? "budget scratch"
                                  : "plan");
  return 0;
}

// NCCL's verdict on the communicator, as the engine asks it while it waits: NCCL's own, or
// ncclRemoteError once set (NVIDIA's NCCL reports a peer it found dead while its kernels keep
// waiting).
std::atomic<bool> g_nccl_reports_failure{false};
ncclResult_t async_error_reporting(ncclComm_t comm, ncclResult_t* state) {
  if (g_nccl_reports_failure.load()) {
    *state = ncclRemoteError;
    return ncclSuccess;
  }
  return ncclCommGetAsyncError(comm, state);
}

// ---- a host wait that outlives DYNAMIQ_TIMEOUT_MS ---------------------------------------------
// Every rank's device answers the wait of call W (below) with kTimeout after the bound (as the
// CUDA device does when a peer stopped answering): that call returns ncclRemoteError after about
// DYNAMIQ_TIMEOUT_MS, never hangs, and every later call returns the same error at once (the
// communicator is broken until the application aborts it); the bound given is the setting's.
// The host waits for an eligible call's control all-reduce only when the call a control window
// later (DYNAMIQ_CONTROL_WINDOW, W) reuses its slot: after the first call (handshake and plan),
// calls 1..W-1 never wait, and call W waits for call 0's. That wait is the one stalled here.
int scenario_stalled_wait(int n) {
  constexpr int64_t kTimeoutMs = 400;
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_TIMEOUT_MS", "400"}});
  const int window = static_cast<int>(settings.control_window);
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    FailingDevice device(dq::engine::host_device());
    Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), &device, nullptr, true);
    constexpr size_t kCount = 1 << 20;
    std::vector<float> in(kCount, 1.0f), out(kCount);
    for (int call = 0; call < window + 3; ++call) {
      device.stalled = call == window;
      CallArgs args = call_of(in.data(), out.data(), kCount);
      PassReason reason;
      const int waits = device.bounded_waits;
      const auto t0 = std::chrono::steady_clock::now();
      const ncclResult_t r = engine.run(args, &reason);
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (call < window) {
        CHECK_OR(60, r == ncclSuccess && reason == PassReason::kRerouted, "rank %d call %d: %d, %s",
                 rank, call, static_cast<int>(r), dq::engine::reason_name(reason));
        CHECK_OR(61, device.bound_ms == kTimeoutMs,
                 "rank %d: bound %lld ms, not DYNAMIQ_TIMEOUT_MS", rank,
                 static_cast<long long>(device.bound_ms));
        CHECK_OR(68, call == 0 || device.bounded_waits == waits,
                 "rank %d call %d: waited with its control window not full", rank, call);
      } else if (call == window) {
        CHECK_OR(62, r == ncclRemoteError && device.bounded_waits == waits + 1,
                 "rank %d: the timed-out wait returned %d, not ncclRemoteError", rank,
                 static_cast<int>(r));
        CHECK_OR(63, ms >= kTimeoutMs && ms < kTimeoutMs + 5000, "rank %d: returned after %.0f ms",
                 rank, ms);
      } else {
        CHECK_OR(64, r == ncclRemoteError && ms < kTimeoutMs,
                 "rank %d call %d: %d after %.0f ms, not the sticky ncclRemoteError at once", rank,
                 call, static_cast<int>(r), ms);
        CHECK_OR(65, device.bounded_waits == waits, "rank %d call %d: waited again", rank, call);
      }
    }
    return 0;
  };
  if (!all_zero(run_ranks(n, 1, body, 120), "stalled_wait")) return 1;
  // The same stalled wait under a long bound (20 s) while NCCL reports the communicator failed:
  // the wait asks NCCL between slices of a second, so it ends within about one with NCCL's error
  // (sticky), not at the bound.
  auto reported_body = [&](int rank, ncclComm_t* comms) -> int {
    const auto long_bound =
        settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_TIMEOUT_MS", "20000"}});
    FailingDevice device(dq::engine::host_device());
    dq::engine::NcclOps ops = cpu_nccl_ops();
    ops.comm_get_async_error = async_error_reporting;
    Engine engine(long_bound, true, {comms[0], rank, n}, ops, &device, nullptr, true);
    constexpr size_t kCount = 1 << 20;
    std::vector<float> in(kCount, 1.0f), out(kCount);
    CallArgs args = call_of(in.data(), out.data(), kCount);
    PassReason reason;
    for (int call = 0; call < window; ++call)
      CHECK_OR(56, engine.run(args, &reason) == ncclSuccess && reason == PassReason::kRerouted,
               "rank %d call %d: failed before the stall", rank, call);
    device.stalled = true;
    g_nccl_reports_failure.store(true);
    const auto t0 = std::chrono::steady_clock::now();
    const ncclResult_t r = engine.run(args, &reason);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    CHECK_OR(57, r == ncclRemoteError && ms < 5000,
             "rank %d: the stalled wait returned %d after %.0f ms (NCCL reported the "
             "communicator failed; the bound is 20 s)",
             rank, static_cast<int>(r), ms);
    CHECK_OR(58, engine.run(args, &reason) == ncclRemoteError, "rank %d: the error is not sticky",
             rank);
    return 0;
  };
  if (!all_zero(run_ranks(n, 1, reported_body, 120), "stalled_wait reported")) return 1;
  // The communicator aborted by another thread (ncclCommAbort on NVIDIA's NCCL comes before the
  // engine's teardown, and frees it): while call W waits; before call 1 starts; while call 1 is
  // enqueueing (inside its second NCCL enqueue). Once the engine sees it, the call enqueues no
  // further NCCL call, writes no output and returns ncclInvalidUsage, and so does every later
  // call, without waiting.
  enum class Abort { kDuringWait, kBeforeStart, kDuringEnqueue };
  auto aborted_body = [&](int rank, ncclComm_t* comms) -> int {
    constexpr size_t kCount = 1 << 20;
    std::vector<float> in(kCount, 1.0f), out(kCount, -1.0f);
    CallArgs args = call_of(in.data(), out.data(), kCount);
    for (const Abort mode : {Abort::kDuringWait, Abort::kBeforeStart, Abort::kDuringEnqueue}) {
      std::atomic<bool> aborted{false};
      FailingDevice device(dq::engine::host_device());
      Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), &device, nullptr, true);
      engine.watch_abort(&aborted);
      const int abort_at = mode == Abort::kDuringWait ? window : 1;
      for (int call = 0; call < abort_at + 2; ++call) {
        const int enqueues = device.nccl_enqueues;
        if (call == abort_at && mode == Abort::kDuringWait)
          device.during_bounded_wait = [&] { aborted = true; };
        if (call == abort_at && mode == Abort::kBeforeStart) aborted = true;
        if (call == abort_at && mode == Abort::kDuringEnqueue)
          device.before_nccl = [&] {
            if (device.nccl_enqueues == enqueues + 2) aborted = true;
          };
        const int waits = device.bounded_waits;
        PassReason reason;
        const ncclResult_t r = engine.run(args, &reason);
        const char* how = mode == Abort::kDuringWait    ? "during its wait"
                          : mode == Abort::kBeforeStart ? "before it"
                                                        : "during its enqueue";
        if (call < abort_at) {
          CHECK_OR(
              66,
              r == ncclSuccess && reason == PassReason::kRerouted && std::fabs(out[0] - n) < 0.5,
              "rank %d: call %d: %d, %s, out[0] %g", rank, call, static_cast<int>(r),
              dq::engine::reason_name(reason), out[0]);
          std::fill(out.begin(), out.end(), -1.0f);
          continue;
        }
        CHECK_OR(67, r == ncclInvalidUsage && out[0] == -1.0f,
                 "rank %d call %d: %d after the abort (%s), out[0] %g", rank, call,
                 static_cast<int>(r), how, out[0]);
        const bool waited = mode == Abort::kDuringWait && call == abort_at;
        CHECK_OR(69, device.bounded_waits == waits + (waited ? 1 : 0),
                 "rank %d call %d: %d waits after the abort (%s)", rank, call,
                 device.bounded_waits - waits, how);
        // The NCCL enqueues the call made: during its enqueue, the one in progress when the flag
        // was set and none after; otherwise none at all (a wait comes before any).
        const int made = device.nccl_enqueues - enqueues;
        const bool in_progress = mode == Abort::kDuringEnqueue && call == abort_at;
        CHECK_OR(70, made == (in_progress ? 2 : 0),
                 "rank %d call %d: %d NCCL enqueues after the abort (%s)", rank, call, made, how);
      }
    }
    return 0;
  };
  if (!all_zero(run_ranks(n, 1, aborted_body, 120), "aborted")) return 1;
  std::printf(
      "stalled_wait %d ranks: calls 1..%d did not wait, call %d's timed-out wait returned "
      "ncclRemoteError, and so did every later call at once; once an abort began (during a "
      "wait, before a call, during its enqueue) no NCCL call was issued and every call returned "
      "ncclInvalidUsage\n",
      n, window - 1, window);
  return 0;
}

// ---- reduce-scatter and reduce -----------------------------------------------------------------
// Runs one compressed collective on a fresh engine and returns the relative squared error of
// this rank's output against the exact sum (FP64) over the elements it receives.
int one_collective(int n, int rank, ncclComm_t comm, dq::engine::Collective collective, int root,
                   bool bf16, bool avg, bool in_place, size_t recvcount,
                   std::vector<unsigned char>* out_bytes, double* rel_err) {
  const auto settings = settings_for(
      {{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_BLOCK_BYTES", "1M"}, {"DYNAMIQ_MIN_BYTES", "0"}});
  Engine engine(settings, true, {comm, rank, n}, cpu_nccl_ops(), dq::engine::host_device(), nullptr,
                true);
  const bool scatter = collective == dq::engine::Collective::kReduceScatter;
  const size_t count = scatter ? recvcount * n : recvcount;
  const size_t esize = bf16 ? 2 : 4;
  std::vector<unsigned char> in = make_input(rank, count, bf16);
  std::vector<unsigned char> out(in_place ? 0 : (scatter ? recvcount : count) * esize, 0xCD);
  CallArgs args;
  args.collective = collective;
  args.root = root;
  args.send = in.data();
  args.recv = in_place ? in.data() + (scatter ? rank * recvcount * esize : 0) : out.data();
  args.count = count;
  args.dtype = bf16 ? ncclBfloat16 : ncclFloat32;
  args.op = avg ? ncclAvg : ncclSum;
  PassReason reason;
  if (engine.run(args, &reason) != ncclSuccess) return 50;
  if (reason != PassReason::kRerouted) return 51;
  const bool receives = scatter || rank == root;
  // A reduce leaves a non-root rank's receive buffer alone, as NCCL does (which also lets that
  // buffer be NULL or unusable: dq::engine::uses_recv_buffer).
  if (!receives && !in_place)
    for (unsigned char b : out)
      if (b != 0xCD) return 56;
  if (receives != dq::engine::uses_recv_buffer(args, rank)) return 57;
  const size_t first = scatter ? rank * recvcount : 0, n_out = scatter ? recvcount : count;
  const auto* got = static_cast<const unsigned char*>(args.recv);
  double num = 0, den = 0;
  for (size_t i = 0; receives && i < n_out; ++i) {
    double exact = 0;
    for (int w = 0; w < n; ++w) {
      const float v = gradient_value(w, first + i);
      exact += bf16 ? dq::bf16_to_f32(dq::f32_to_bf16_rne(v)) : v;
    }
    if (avg) exact /= n;
    float g;
    if (bf16) {
      uint16_t h;
      std::memcpy(&h, got + 2 * i, 2);
      g = dq::bf16_to_f32(h);
    } else {
      std::memcpy(&g, got + 4 * i, 4);
    }
    num += (g - exact) * (g - exact);
    den += exact * exact;
  }
  *rel_err = receives ? num / den : 0.0;
  out_bytes->assign(got, got + (receives ? n_out * esize : 0));
  return 0;
}

// The codec's rounding keys index at most kMaxElementIndex elements, and a reduce-scatter's
// rank parts are keyed from multiples of 256: a call whose keys would reach past it passes
// through as `large` on every rank (each hop would refuse its block and fail the call), one
// element fewer is compressed. Screening only: no buffer is touched.
int screen_large(int n, int rank, ncclComm_t comm) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_MIN_BYTES", "0"}});
  Engine engine(settings, true, {comm, rank, n}, cpu_nccl_ops(), dq::engine::host_device(), nullptr,
                true);
  const uint64_t most = dq::kMaxElementIndex - uint64_t{256} * static_cast<uint64_t>(n);
  for (const auto c : {dq::engine::Collective::kAllReduce, dq::engine::Collective::kReduceScatter,
                       dq::engine::Collective::kReduce}) {
    CallArgs args;
    args.collective = c;
    args.count = most;
    const PassReason fits = engine.screen_call(args).arguments;
    CHECK_OR(54, fits == PassReason::kRerouted, "rank %d, %s of %llu elements: %s", rank,
             dq::engine::collective_name(c), static_cast<unsigned long long>(args.count),
             dq::engine::reason_name(fits));
    args.count = most + 1;
    const PassReason over = engine.screen_call(args).arguments;
    CHECK_OR(55, over == PassReason::kLarge, "rank %d, %s of %llu elements: %s", rank,
             dq::engine::collective_name(c), static_cast<unsigned long long>(args.count),
             dq::engine::reason_name(over));
  }
  return 0;
}

int scenario_collectives(int n) {
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    if (const int rc = screen_large(n, rank, comms[0]); rc != 0) return rc;
    constexpr size_t kRecv = 300001;  // odd: rank blocks start off super-group boundaries
    int k = 0;
    for (int scatter = 1; scatter >= 0; --scatter)
      for (int root = 0; root < (scatter ? 1 : n); ++root)
        for (int variant = 0; variant < 4; ++variant, ++k) {
          const bool bf16 = variant & 1, avg = variant & 2, in_place = (k % 3) == 0;
          const auto c =
              scatter ? dq::engine::Collective::kReduceScatter : dq::engine::Collective::kReduce;
          std::vector<unsigned char> first, again;
          double err = 0, err_again = 0;
          int rc =
              one_collective(n, rank, comms[0], c, root, bf16, avg, in_place, kRecv, &first, &err);
          if (rc == 0)
            rc = one_collective(n, rank, comms[0], c, root, bf16, avg, in_place, kRecv, &again,
                                &err_again);
          CHECK_OR(rc, rc == 0, "rank %d case %d: %s failed or passed through", rank, k,
                   dq::engine::collective_name(c));
          CHECK_OR(52, first == again, "rank %d case %d: repeated call gave different bytes", rank,
                   k);
          // DynamiQ 5 bits on smooth data: about 1e-3; a wrong block, order or scale gives ~1.
          CHECK_OR(53, err < 3e-2, "rank %d case %d (%s root %d bf16 %d avg %d): error %.3e", rank,
                   k, dq::engine::collective_name(c), root, bf16, avg, err);
          if (rank == 0 && variant == 0)
            std::printf("%s root %d: relative error %.3e\n", dq::engine::collective_name(c), root,
                        err);
        }
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 600), "collectives") ? 0 : 1;
}

// ---- a malformed payload --------------------------------------------------------------------
int scenario_corrupt(int n) {
  constexpr int kTimeoutMs = 3000;
  setenv("DYNAMIQ_CPU_NCCL_TIMEOUT_MS", std::to_string(kTimeoutMs).c_str(), 1);
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_TOPO", "ring"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    FailingDevice device(dq::engine::host_device());
    Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), &device, nullptr, true);
    constexpr size_t kCount = 1 << 20;
    std::vector<float> in(kCount), out(kCount, 0.0f);
    for (size_t i = 0; i < kCount; ++i) in[i] = gradient_value(rank, i);
    CallArgs args = call_of(in.data(), out.data(), kCount);
    PassReason reason;
    // One clean call first: the engine works on this data.
    CHECK_OR(40, engine.run(args, &reason) == ncclSuccess && reason == PassReason::kRerouted,
             "rank %d: the clean call failed", rank);
    device.corrupting = rank == 1;
    const auto t0 = std::chrono::steady_clock::now();
    const ncclResult_t r = engine.run(args, &reason);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK_OR(41, r != ncclSuccess, "rank %d: the corrupted call returned success", rank);
    CHECK_OR(42, engine.async_error() == r, "rank %d: async error %d, call returned %d", rank,
             static_cast<int>(engine.async_error()), static_cast<int>(r));
    // Sticky, as NCCL's asynchronous errors: the next call reports it at once.
    CHECK_OR(43, engine.run(args, &reason) == r, "rank %d: the error is not sticky", rank);
    std::fprintf(stderr, "rank %d: failed with %s after %.1f s\n", rank, ncclGetErrorString(r), s);
    // Within the timeout plus a margin for the cascade (each rank's wait is bounded on its own).
    CHECK_OR(44, s < 4.0 * kTimeoutMs / 1000.0, "rank %d: took %.1f s to fail", rank, s);
    return 0;
  };
  if (!all_zero(run_ranks(n, 1, body, 120), "corrupt")) return 1;
  std::printf("corrupt %d ranks: every rank's call failed, none returned a result\n", n);
  return 0;
}

// ---- the layouts' order ---------------------------------------------------------------------
// Four 1 MiB pipeline blocks, on a device that lays out each part in a step of its own (the host)
// and on one that batches them (a CUDA device's answer). Batched: every layout before the first
// hop. Not: each block's layout just before its own first hop, so the first block's messages do
// not wait for the other blocks' layouts. Either way every hop after its own layout, each layout
// once a call, and the same bytes.
int scenario_layout_order(int n) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_BLOCK_BYTES", "1M"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    constexpr size_t kCount = 4 * (1 << 20) / 4;
    std::vector<float> in(kCount);
    for (size_t i = 0; i < kCount; ++i) in[i] = gradient_value(rank, i);
    std::vector<float> out[2] = {std::vector<float>(kCount), std::vector<float>(kCount)};
    for (int batched = 0; batched < 2; ++batched) {
      FailingDevice device(dq::engine::host_device());
      device.batched_layouts = batched == 1;
      Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), &device, nullptr, true);
      CallArgs args = call_of(in.data(), out[batched].data(), kCount);
      PassReason reason;
      CHECK_OR(100, engine.run(args, &reason) == ncclSuccess && reason == PassReason::kRerouted,
               "rank %d: the call failed or passed through (%s)", rank,
               dq::engine::reason_name(reason));
      std::vector<const void*> laid_out;  // in order
      size_t first_hop = device.enqueued.size();
      for (size_t i = 0; i < device.enqueued.size(); ++i) {
        const FailingDevice::Enqueued& e = device.enqueued[i];
        const bool known =
            std::find(laid_out.begin(), laid_out.end(), e.layout_memory) != laid_out.end();
        if (e.layout) {
          CHECK_OR(102, !known, "rank %d: a layout enqueued twice in one call", rank);
          laid_out.push_back(e.layout_memory);
        } else {
          CHECK_OR(103, known, "rank %d: step %zu, a hop, enqueued before its layout", rank, i);
          first_hop = std::min(first_hop, i);
        }
      }
      CHECK_OR(104, laid_out.size() == 4, "rank %d: %zu layouts, 4 blocks", rank, laid_out.size());
      // Batched: the layouts are steps 0-3. Not: block 0's layout, then its hops, then block 1's.
      const bool all_first = first_hop == laid_out.size();
      CHECK_OR(105, all_first == (batched == 1),
               "rank %d: %s layouts, yet %s before the first hop (step %zu)", rank,
               batched ? "batched" : "per-block", all_first ? "all" : "not all", first_hop);
      if (!batched)
        for (size_t i = 0, seen = 0; i < device.enqueued.size(); ++i)
          if (device.enqueued[i].layout) {
            CHECK_OR(106, i == 0 || !device.enqueued[i - 1].layout,
                     "rank %d: layouts %zu and %zu enqueued back to back", rank, seen - 1, seen);
            ++seen;
          }
    }
    CHECK_OR(107, std::memcmp(out[0].data(), out[1].data(), kCount * sizeof(float)) == 0,
             "rank %d: per-block layouts give other bytes than batched ones", rank);
    return 0;
  };
  if (!all_zero(run_ranks(n, 1, body, 120), "layout_order")) return 1;
  std::printf("layout order %d ranks: batched before every hop, else each before its block's\n", n);
  return 0;
}

// ---- a device that cannot be set up on one rank
// ---------------------------------------------------
int setup_fail_body(const dq::config::Settings& settings, int n, int rank, ncclComm_t comm,
                    bool thread_fault) {
  FailingDevice device(dq::engine::host_device());
  device.no_streams = rank == 1 && !thread_fault;
  if (rank == 1 && thread_fault) dq::engine::host_stream_starts_before_failure(0);
  Engine engine(settings, true, {comm, rank, n}, cpu_nccl_ops(), &device, nullptr, true);
  dq::engine::host_stream_starts_before_failure(-1);
  constexpr size_t kCount = 1 << 20;
  std::vector<float> in(kCount, static_cast<float>(rank + 1)), out(kCount, 0.0f);
  for (int call = 0; call < 2; ++call) {
    CallArgs args = call_of(in.data(), out.data(), kCount);
    if (call == 0) {
      // Inside a caller's group, before the handshake, the interceptor holds a call back to the
      // group's end when the engine answers kInGroup, and runs it through the engine there (as
      // below). Every rank must hold it, rank 1 included: sent into the group, its all-reduce
      // would meet its peers' handshake.
      const PassReason grouped = engine.decide(args, engine.screen_call(args));
      CHECK_OR(64, grouped == PassReason::kInGroup, "rank %d: a grouped first call: %s", rank,
               dq::engine::reason_name(grouped));
    }
    PassReason reason;
    CHECK_OR(60, engine.run(args, &reason) == ncclSuccess, "rank %d call %d: error", rank, call);
    CHECK_OR(61, reason != PassReason::kRerouted, "rank %d call %d: compressed", rank, call);
    CHECK_OR(62,
             ncclAllReduce(in.data(), out.data(), kCount, ncclFloat32, ncclSum, comm, nullptr) ==
                 ncclSuccess,
             "rank %d call %d: pass-through failed", rank, call);
    CHECK_OR(63, out[0] == static_cast<float>(n * (n + 1) / 2) && out[kCount - 1] == out[0],
             "rank %d call %d: pass-through result %g", rank, call, out[0]);
  }
  return 0;
}

// Twice, a communicator each: the device refuses streams; the host device's stream threads fail
// to start (std::system_error, as at a thread limit).
int scenario_setup_fail(int n) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    for (int thread_fault = 0; thread_fault < 2; ++thread_fault)
      if (const int rc = setup_fail_body(settings, n, rank, comms[thread_fault], thread_fault))
        return rc;
    return 0;
  };
  if (!all_zero(run_ranks(n, 2, body, 120), "setup_fail")) return 1;
  std::printf(
      "setup_fail %d ranks: rank 1 without streams, then without stream threads; every rank "
      "passed through, exact\n",
      n);
  return 0;
}

// ---- the budget on the wire, and the size floor -------------------------------------------------
// Exactly DYNAMIQ_MIN_BYTES is compressed, 4 bytes less is not; what a rank sends for a compressed
// call is the budget: 2 (n-1)/n copies of b/8 bytes per value, statistics and headers included.
int scenario_budget(int n, const std::string& topo) {
  const auto settings =
      settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_MIN_BYTES", "1M"}, {"DYNAMIQ_TOPO", topo}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    auto metrics = std::make_shared<dq::engine::CommMetrics>();
    Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), dq::engine::host_device(),
                  metrics, true);
    std::vector<float> in(4 << 20), out(4 << 20);
    for (size_t i = 0; i < in.size(); ++i) in[i] = gradient_value(rank, i);
    CallArgs args;
    args.send = in.data();
    args.recv = out.data();
    PassReason reason;
    for (size_t count : {size_t{1} << 18, (size_t{1} << 18) - 1}) {  // 1 MiB of FP32, and less
      args.count = count;
      CHECK_OR(80, engine.run(args, &reason) == ncclSuccess, "rank %d: error", rank);
      const PassReason expect = count == (1u << 18) ? PassReason::kRerouted : PassReason::kSmall;
      CHECK_OR(81, reason == expect, "rank %d: %zu bytes: %s, expected %s", rank, count * 4,
               dq::engine::reason_name(reason), dq::engine::reason_name(expect));
    }
    const uint64_t before = metrics->wire_bytes.load();
    args.count = in.size();
    CHECK_OR(82, engine.run(args, &reason) == ncclSuccess && reason == PassReason::kRerouted,
             "rank %d: the 16 MiB call was not compressed", rank);
    const double sent = static_cast<double>(metrics->wire_bytes.load() - before);
    const double budget = 2.0 * (n - 1) / n * 5.0 / 8.0 * static_cast<double>(in.size());
    CHECK_OR(83, sent <= budget + 64 && sent >= 0.97 * budget,
             "rank %d: sent %.0f bytes for a budget of %.0f (5 bits, 2 (n-1)/n copies)", rank, sent,
             budget);
    if (rank == 0)
      std::printf("budget %s %d ranks: sent %.0f bytes, budget %.0f (%.4f)\n", topo.c_str(), n,
                  sent, budget, sent / budget);
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 120), "budget") ? 0 : 1;
}

// ---- a communicator no rank opted in ------------------------------------------------------------
int scenario_not_opted_in(int n) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_COMMS", "none"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), dq::engine::host_device(),
                  nullptr, false);
    std::vector<float> in(1 << 20, 1.0f), out(1 << 20);
    CallArgs args = call_of(in.data(), out.data(), in.size());
    PassReason reason;
    CHECK_OR(70, engine.run(args, &reason) == ncclSuccess, "rank %d: error", rank);
    CHECK_OR(71, reason == PassReason::kNotOptedIn, "rank %d: counted as %s, not not_opted_in",
             rank, dq::engine::reason_name(reason));
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 60), "not_opted_in") ? 0 : 1;
}

// ---- the plan cache (DYNAMIQ_PLAN_CACHE) ----------------------------------------------------
// Three call shapes in turn, three rounds: with a cache of 2 every call misses (9 plans made, the
// last 6 made again after their eviction), with a cache of 3 only the first round makes plans.
// Re-planning changes no byte: every call's output equals the roomy cache's, on every rank. And a
// cache of 1 with the calls on a stream of the device and each call's finish held back 200 ms: a
// call returns before its finish ran, and the next call evicts that plan, whose host objects
// (codecs) the queued finish still uses (kept until the streams pass it: ASan in CI).
int scenario_plan_cache(int n) {
  const size_t counts[3] = {size_t{3} << 16, size_t{5} << 16, size_t{7} << 16};
  constexpr int kRounds = 3;
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    std::vector<std::vector<float>> outputs[3];
    for (int mode = 0; mode < 3; ++mode) {
      const bool roomy = mode == 1, queued = mode == 2;
      const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                          {"DYNAMIQ_MIN_BYTES", "0"},
                                          {"DYNAMIQ_PLAN_CACHE", roomy    ? "3"
                                                                 : queued ? "1"
                                                                          : "2"}});
      auto metrics = std::make_shared<dq::engine::CommMetrics>();
      FailingDevice device(dq::engine::host_device());
      device.finish_delay_ms = queued ? 200 : 0;
      Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), &device, metrics, true);
      dq::engine::StreamHandle stream = nullptr;
      dq::engine::EventHandle drained = nullptr;
      if (queued)
        CHECK_OR(134,
                 device.create_stream(&stream) == dq::Status::kOk &&
                     device.create_event(&drained) == dq::Status::kOk,
                 "rank %d: no stream", rank);
      std::vector<std::vector<unsigned char>> inputs;  // read by queued steps: kept to the end
      for (int round = 0; round < kRounds; ++round)
        for (size_t count : counts) {
          inputs.push_back(make_input(rank + round, count, false));
          std::vector<float> out(count);
          CallArgs args = call_of(inputs.back().data(), out.data(), count);
          args.stream = static_cast<cudaStream_t>(stream);
          PassReason reason;
          CHECK_OR(130, engine.run(args, &reason) == ncclSuccess && reason == PassReason::kRerouted,
                   "rank %d: cache %s, round %d, %zu elements: not compressed (%s)", rank,
                   roomy    ? "3"
                   : queued ? "1"
                            : "2",
                   round, count, dq::engine::reason_name(reason));
          if (!queued)
            CHECK_OR(131, dq::test::same_bytes_everywhere(comms[0], out.data(), count * 4),
                     "rank %d: results differ between ranks", rank);
          outputs[mode].push_back(std::move(out));  // the buffer moves with it
        }
      if (queued) {
        CHECK_OR(135,
                 device.record(drained, stream) == dq::Status::kOk &&
                     device.synchronize(drained) == dq::Status::kOk,
                 "rank %d: the stream did not drain", rank);
        device.destroy_event(drained);
        device.destroy_stream(stream);
      }
      const uint64_t made = metrics->plans_made.load(), again = metrics->replans.load();
      const uint64_t want_made = roomy ? 3 : 3 * kRounds;
      const uint64_t want_again = roomy ? 0 : 3 * kRounds - 3;
      CHECK_OR(132, made == want_made && again == want_again,
               "rank %d: cache %s: %llu plans made, %llu again (expected %llu and %llu)", rank,
               roomy    ? "3"
               : queued ? "1"
                        : "2",
               static_cast<unsigned long long>(made), static_cast<unsigned long long>(again),
               static_cast<unsigned long long>(want_made),
               static_cast<unsigned long long>(want_again));
    }
    for (size_t k = 0; k < outputs[0].size(); ++k)
      for (int mode : {0, 2})
        CHECK_OR(133,
                 std::memcmp(outputs[mode][k].data(), outputs[1][k].data(),
                             outputs[1][k].size() * 4) == 0,
                 "rank %d: call %zu: re-planning%s changed the output", rank, k,
                 mode == 2 ? " with the finish steps still queued" : "");
    if (rank == 0)
      std::printf(
          "plan_cache: 3 shapes x %d rounds: cache 2 made %d plans (%d again), cache 3 made 3; "
          "outputs identical, also with every finish still queued when its plan was evicted\n",
          kRounds, 3 * kRounds, 3 * kRounds - 3);
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 120), "plan_cache") ? 0 : 1;
}

// ---- rounding draws: across blocks, across calls ------------------------------------------
// Elements of `a` and `b` (n each) that differ.
size_t count_differing(const float* a, const float* b, size_t n) {
  size_t differ = 0;
  for (size_t i = 0; i < n; ++i) differ += a[i] != b[i];
  return differ;
}

// Pearson correlation of the errors of two output ranges against the same exact values.
double error_correlation(const float* a, const float* b, const double* exact, size_t n) {
  double sa = 0, sb = 0, saa = 0, sbb = 0, sab = 0;
  for (size_t i = 0; i < n; ++i) {
    const double ea = a[i] - exact[i], eb = b[i] - exact[i];
    sa += ea;
    sb += eb;
    saa += ea * ea;
    sbb += eb * eb;
    sab += ea * eb;
  }
  const double m = static_cast<double>(n);
  const double cov = sab / m - (sa / m) * (sb / m);
  const double va = saa / m - (sa / m) * (sa / m), vb = sbb / m - (sb / m) * (sb / m);
  return va > 0 && vb > 0 ? cov / std::sqrt(va * vb) : 1.0;
}

// Two pipeline blocks of one all-reduce holding the same data, then the same input in two
// consecutive calls: independent draws round almost every element differently somewhere along its
// hops (draws shared by the blocks, or by the calls, give identical outputs).
int blocks_and_calls(int n, int rank, ncclComm_t comm) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_BLOCK_BYTES", "1M"}});
  Engine engine(settings, true, {comm, rank, n}, cpu_nccl_ops(), dq::engine::host_device(), nullptr,
                true);
  constexpr size_t kBlock = (1 << 20) / 4;  // elements per 1 MiB FP32 block
  std::vector<float> in(2 * kBlock), out(2 * kBlock), again(2 * kBlock);
  for (size_t i = 0; i < kBlock; ++i) in[i] = in[kBlock + i] = gradient_value(rank, i);
  CallArgs args = call_of(in.data(), out.data(), in.size());
  PassReason reason;
  CHECK_OR(30, engine.run(args, &reason) == ncclSuccess, "rank %d: error", rank);
  CHECK_OR(31, reason == PassReason::kRerouted, "rank %d: not compressed (%s)", rank,
           dq::engine::reason_name(reason));
  const size_t differ = count_differing(out.data(), out.data() + kBlock, kBlock);
  CHECK_OR(32, differ > kBlock / 2,
           "rank %d: only %zu of %zu elements differ between two blocks holding the same data "
           "(the blocks reuse each other's rounding draws)",
           rank, differ, kBlock);
  args.recv = again.data();
  CHECK_OR(33, engine.run(args, &reason) == ncclSuccess && reason == PassReason::kRerouted,
           "rank %d: the second call failed or passed through (%s)", rank,
           dq::engine::reason_name(reason));
  const size_t calls_differ = count_differing(out.data(), again.data(), out.size());
  CHECK_OR(34, calls_differ > out.size() / 2,
           "rank %d: only %zu of %zu elements differ between two calls on the same input (the "
           "calls reuse each other's rounding draws: the call number does not key them)",
           rank, calls_differ, out.size());
  if (rank == 0)
    std::printf(
        "blocks: %zu of %zu elements differ between identical blocks; calls: %zu of %zu differ "
        "between two calls on the same input\n",
        differ, kBlock, calls_differ, out.size());
  return 0;
}

// A reduce-scatter of three 1 MiB pipeline blocks (each a 256 KiB slice of every rank block),
// every block of a rank block holding the same data: each pair of blocks rounds most elements
// differently, and their errors against the exact sum are uncorrelated.
int scatter_blocks(int n, int rank, ncclComm_t comm) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_BLOCK_BYTES", "1M"}});
  Engine engine(settings, true, {comm, rank, n}, cpu_nccl_ops(), dq::engine::host_device(), nullptr,
                true);
  constexpr int kBlocks = 3;
  // A block's elements per rank block: how the engine cuts DYNAMIQ_BLOCK_BYTES for n ranks.
  const size_t slice = (1 << 20) / 4 / static_cast<size_t>(n) / 256 * 256;
  const size_t span = kBlocks * slice;  // a rank block
  auto value = [&](int r, int owner, size_t i) { return gradient_value(r + 7 * owner, i); };
  std::vector<float> in(span * n), out(span);
  for (int owner = 0; owner < n; ++owner)
    for (int b = 0; b < kBlocks; ++b)
      for (size_t i = 0; i < slice; ++i) in[owner * span + b * slice + i] = value(rank, owner, i);
  std::vector<double> exact(slice);
  for (size_t i = 0; i < slice; ++i)
    for (int r = 0; r < n; ++r) exact[i] += value(r, rank, i);
  CallArgs args;
  args.collective = dq::engine::Collective::kReduceScatter;
  args.send = in.data();
  args.recv = out.data();
  args.count = in.size();
  PassReason reason;
  CHECK_OR(35, engine.run(args, &reason) == ncclSuccess && reason == PassReason::kRerouted,
           "rank %d: the reduce-scatter failed or passed through (%s)", rank,
           dq::engine::reason_name(reason));
  for (int a = 0; a < kBlocks; ++a)
    for (int b = a + 1; b < kBlocks; ++b) {
      const float* x = out.data() + a * slice;
      const float* y = out.data() + b * slice;
      const size_t differ = count_differing(x, y, slice);
      const double corr = error_correlation(x, y, exact.data(), slice);
      CHECK_OR(36, differ > slice / 2 && std::fabs(corr) < 0.2,
               "rank %d: reduce-scatter blocks %d and %d holding the same data: %zu of %zu "
               "elements differ, error correlation %.3f (the blocks share rounding draws)",
               rank, a, b, differ, slice, corr);
      if (rank == 0)
        std::printf(
            "reduce-scatter blocks %d and %d: %zu of %zu elements differ, error "
            "correlation %.4f\n",
            a, b, differ, slice, corr);
    }
  return 0;
}

int scenario_blocks(int n) {
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    if (const int rc = blocks_and_calls(n, rank, comms[0]); rc != 0) return rc;
    return scatter_blocks(n, rank, comms[0]);
  };
  return all_zero(run_ranks(n, 1, body, 120), "blocks") ? 0 : 1;
}

// ---- block_floor: blocks no smaller than their chunk messages' floor ---------------------------
// The smallest DYNAMIQ_BLOCK_BYTES (256 KiB) on a ring of n >= 5 ranks: 65,536 FP32 values a
// block, under the 64 super-groups of each of n chunk messages a plan needs to compress
// (chunks_large_enough), and a reduce-scatter's slice of 65,536 / n values under one message's 64.
// Cut at the setting, every block, and so every such call, passed through (kOverBudget) however
// large; the blocks are raised to the floor, and the calls compress.
int block_floor_body(int n, int rank, ncclComm_t comm) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_TOPO", "ring"},
                                      {"DYNAMIQ_MIN_BYTES", "0"},
                                      {"DYNAMIQ_BLOCK_BYTES", "256K"}});
  Engine engine(settings, true, {comm, rank, n}, cpu_nccl_ops(), dq::engine::host_device(), nullptr,
                true);
  // Ranks' values that do not cancel in the sum (gradient_value's phases spread over 6 ranks do).
  auto value = [](int r, size_t i) { return gradient_value(0, i) * (1.0f + 0.25f * r); };
  for (const bool scatter : {false, true}) {
    const size_t span = 4 * 65536;  // an all-reduce's values, a reduce-scatter's rank block
    const size_t count = scatter ? span * static_cast<size_t>(n) : span;
    std::vector<float> in(count), out(span);
    for (size_t i = 0; i < count; ++i) in[i] = value(rank, i);
    CallArgs args = call_of(in.data(), out.data(), count);
    if (scatter) args.collective = dq::engine::Collective::kReduceScatter;
    PassReason reason = PassReason::kRerouted;
    CHECK_OR(40, engine.run(args, &reason) == ncclSuccess, "rank %d: %s failed", rank,
             scatter ? "the reduce-scatter" : "the all-reduce");
    CHECK_OR(41, reason == PassReason::kRerouted,
             "rank %d: the %s of %zu values at 256 KiB blocks on %d ranks passed through (%s)",
             rank, scatter ? "reduce-scatter" : "all-reduce", count, n,
             dq::engine::reason_name(reason));
    double error = 0, energy = 0;
    const size_t first = scatter ? static_cast<size_t>(rank) * span : 0;
    for (size_t i = 0; i < span; ++i) {
      double exact = 0;
      for (int r = 0; r < n; ++r) exact += value(r, first + i);
      error += (out[i] - exact) * (out[i] - exact);
      energy += exact * exact;
    }
    CHECK_OR(42, error <= 0.05 * energy, "rank %d: %s vNMSE %.3g", rank,
             scatter ? "reduce-scatter" : "all-reduce", error / energy);
    if (rank == 0)
      std::printf("%s of %zu values, 256 KiB blocks, ring of %d: compressed, vNMSE %.3g\n",
                  scatter ? "reduce-scatter" : "all-reduce", count, n, error / energy);
  }
  return 0;
}

int scenario_block_floor(int n) {
  auto body = [&](int rank, ncclComm_t* comms) { return block_floor_body(n, rank, comms[0]); };
  return all_zero(run_ranks(n, 1, body, 120), "block_floor") ? 0 : 1;
}

// ---- DYNAMIQ_BITS=auto (docs/ENGINE.md section 10) ----------------------------------------------
// Gradient-like data for the budget model: per rank, independent bell-shaped deviations (a sum
// of four uniforms) around a small common part, with super-group scales spread over 2^0..2^8
// (the locality DynamiQ's widths exploit). The model assumes independent deviations across
// ranks; the smooth gradient_value() above is correlated across ranks, which it overpredicts.
// dense: one scale everywhere (no locality), where DynamiQ needs more bits than MXFP8.
float noisy_value(int rank, size_t i, bool dense = false) {
  auto uniform = [](uint64_t key) {
    return static_cast<double>(dq::test::splitmix(key) >> 11) * 0x1.0p-53;
  };
  const uint64_t base = (static_cast<uint64_t>(rank) + 1) << 40;
  double bell = -2.0;
  for (uint64_t k = 0; k < 4; ++k) bell += uniform(base + 4 * i + k);
  const double scale = dense ? 1.0 : std::exp2(8.0 * uniform(0xabcdefull + i / 256));
  return static_cast<float>(scale * (bell * 1.7 + 0.3 * std::sin(0.01 * static_cast<double>(i))));
}

// ---- byte_counts: the statistics' all-reduces from 16 ranks -----------------------------------
// From 16 to 255 ranks DynamiQ's all-zero counts are bytes summed as unsigned 8-bit integers
// (docs/FORMAT.md): each part's statistics go out as a BF16 all-reduce of its mean and energy
// words and a ncclUint8 one of its count bytes, right after them in the same buffer; below 16
// ranks one BF16 all-reduce takes every part's words. Recorded here (the rank's process alone
// calls it: a forked rank), checked against the parts' geometry; the result must be near the sum
// on data whose odd super-groups are one rank's alone (the high byte of each count word counts).
struct LoggedAllReduce {
  const void* send;
  size_t count;
  ncclDataType_t type;
};
std::vector<LoggedAllReduce> g_all_reduces;
ncclResult_t logged_all_reduce(const void* s, void* r, size_t c, ncclDataType_t t, ncclRedOp_t o,
                               ncclComm_t comm, cudaStream_t st) {
  g_all_reduces.push_back({s, c, t});
  return ncclAllReduce(s, r, c, t, o, comm, st);
}

float one_owner_value(int rank, int n, size_t i) {
  const size_t j = i / 256;
  if (j % 2 == 1 && static_cast<size_t>(rank) != (j / 2) % static_cast<size_t>(n)) return 0.0f;
  return noisy_value(rank, i);
}

int scenario_byte_counts(int n) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_MIN_BYTES", "0"},
                                      {"DYNAMIQ_TOPO", "ring"},
                                      {"DYNAMIQ_BLOCK_BYTES", "1M"}});
  // Two pipeline blocks: 262,144 values and the remainder, 1,024 and 1,025 super-groups (at 16
  // ranks 64 a chunk message, the floor; an odd count leaves the last count word half used).
  constexpr size_t kCount = 2 * 262144 + 40;
  const size_t part_counts[2] = {262144, kCount - 262144};
  const bool bytes = dq::zero_counts_are_bytes(n);
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    dq::engine::NcclOps ops = cpu_nccl_ops();
    ops.all_reduce = logged_all_reduce;
    std::vector<float> in(kCount), out(kCount);
    for (size_t i = 0; i < kCount; ++i) in[i] = one_owner_value(rank, n, i);
    PassReason reason;
    g_all_reduces.clear();
    const ncclResult_t r = all_reduce_once(settings, ops, comms[0], rank, n, in, &out, &reason);
    CHECK_OR(90, r == ncclSuccess && reason == PassReason::kRerouted, "rank %d: %d, reason %d",
             rank, static_cast<int>(r), static_cast<int>(reason));
    // The statistics' all-reduces: the BF16 and byte ones of the call's control group.
    std::vector<LoggedAllReduce> stats;
    for (const LoggedAllReduce& a : g_all_reduces)
      if (a.type == ncclBfloat16 || a.type == ncclUint8) stats.push_back(a);
    size_t words = 0;
    for (size_t c : part_counts) words += dq::stats_words((c + 255) / 256, n);
    if (!bytes) {
      CHECK_OR(91, stats.size() == 1 && stats[0].type == ncclBfloat16 && stats[0].count == words,
               "rank %d: %zu statistics all-reduces (first of %zu), one BF16 of %zu words wanted",
               rank, stats.size(), stats.empty() ? size_t{0} : stats[0].count, words);
    } else {
      CHECK_OR(92, stats.size() == 4, "rank %d: %zu statistics all-reduces, 4 wanted", rank,
               stats.size());
      for (int p = 0; p < 2; ++p) {
        const size_t n_sg = (part_counts[p] + 255) / 256;
        const LoggedAllReduce& pairs = stats[2 * p];
        const LoggedAllReduce& counts = stats[2 * p + 1];
        CHECK_OR(93, pairs.type == ncclBfloat16 && pairs.count == 2 * n_sg,
                 "rank %d part %d: BF16 all-reduce of %zu words, %zu wanted", rank, p, pairs.count,
                 2 * n_sg);
        CHECK_OR(94,
                 counts.type == ncclUint8 &&
                     counts.count == 2 * dq::stats_byte_sum_words(n_sg, n) &&
                     counts.send == static_cast<const uint16_t*>(pairs.send) + 2 * n_sg,
                 "rank %d part %d: the count bytes' all-reduce (type %d, %zu elements) is not "
                 "the %zu bytes (ncclUint8) after the part's BF16 words",
                 rank, p, static_cast<int>(counts.type), counts.count,
                 2 * dq::stats_byte_sum_words(n_sg, n));
      }
    }
    double error = 0, energy = 0;
    for (size_t i = 0; i < kCount; ++i) {
      double want = 0;
      for (int w = 0; w < n; ++w) want += one_owner_value(w, n, i);
      error += (out[i] - want) * (out[i] - want);
      energy += want * want;
    }
    CHECK_OR(95, error < 0.05 * energy, "rank %d: vNMSE %g", rank, error / energy);
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 300), "byte_counts") ? 0 : 1;
}

int scenario_auto(int n) {
  constexpr int kMaxCalls = 10;
  const size_t sizes[2] = {size_t{1} << 19, size_t{3} << 18};  // 2 MiB and 3 MiB of FP32
  for (const char* run : {"mxfp8", "vnmse:1", "vnmse:1e-7", "mxfp8 dense"}) {
    const std::string target = std::string(run).substr(0, std::string(run).find(' '));
    const bool loose = target == "vnmse:1";
    const bool strict = target == "vnmse:1e-7";
    const bool dense = std::string(run) == "mxfp8 dense";
    // Dense: long enough for the MX fallback's statistics call (the 9th) and its reading.
    const int kCalls = dense ? kMaxCalls : 5;
    // A control window of 1: each call reads its bucket's previous prediction (at the default
    // window a bucket's calls within one window share the oldest: engine_run_ahead).
    const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                        {"DYNAMIQ_BITS", "auto"},
                                        {"DYNAMIQ_TARGET", target},
                                        {"DYNAMIQ_TOPO", "ring"},
                                        {"DYNAMIQ_CONTROL_WINDOW", "1"}});
    auto body = [&](int rank, ncclComm_t* comms) -> int {
      auto metrics = std::make_shared<dq::engine::CommMetrics>();
      Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), dq::engine::host_device(),
                    metrics, true);
      auto bucket = [&](size_t count) {
        std::lock_guard<std::mutex> lock(metrics->budget_mutex);
        for (const auto& b : metrics->budget.buckets)
          if (b.count == count) return b;
        return dq::engine::BucketMetrics{};
      };
      std::vector<double> budgets;
      double measured[2][kMaxCalls] = {};
      bool with_stats[2][kMaxCalls] = {};
      for (int k = 0; k < kCalls; ++k)
        for (int s = 0; s < 2; ++s) {
          const size_t count = sizes[s];
          // The data moves from call to call by whole super-groups: statistics alike, not equal.
          const size_t shift = static_cast<size_t>(k) * 31 * 256;
          std::vector<float> in(count), out(count);
          for (size_t i = 0; i < count; ++i) in[i] = noisy_value(rank, i + shift, dense);
          // Rank 1 holds a NaN: no prediction next (not in the dense run, which counts calls).
          const bool poisoned = s == 0 && k == 2 && !dense;
          if (poisoned && rank == 1) in[100] = NAN;
          CallArgs args = call_of(in.data(), out.data(), count);
          PassReason reason;
          CHECK_OR(90, engine.run(args, &reason) == ncclSuccess && reason == PassReason::kRerouted,
                   "rank %d: call %d of %zu elements not compressed (%s)", rank, k, count,
                   dq::engine::reason_name(reason));
          const dq::engine::BucketMetrics b = bucket(count);
          budgets.push_back(b.budget_bits);
          // An MX call carries the statistics every 8th call (the 9th of the bucket here).
          with_stats[s][k] = b.codec == "dynamiq" || k == 8;
          if (dense)
            CHECK_OR(97,
                     k == 0 ? b.budget_bits == 5.0 && b.codec == "dynamiq"
                            : b.budget_bits == 8.25 && b.codec == "mxfp8",
                     "rank %d: dense call %d of bucket %zu: %s at %g bits, not %s", rank, k, count,
                     b.codec.c_str(), b.budget_bits, k == 0 ? "dynamiq at 5" : "mxfp8");
          else if (k == 0 || (s == 0 && k == 3))
            CHECK_OR(91, b.budget_bits == 5.0,
                     "rank %d: %s call %d of bucket %zu took %g bits, not the fixed default 5",
                     rank, k == 0 ? "the first" : "after a NaN,", k, count, b.budget_bits);
          else if (loose)
            CHECK_OR(92, b.budget_bits == 3.0, "rank %d: vnmse:1 gave %g bits, not 3", rank,
                     b.budget_bits);
          else if (strict)
            CHECK_OR(93, b.budget_bits == 8.0, "rank %d: vnmse:1e-7 gave %g bits, not 8", rank,
                     b.budget_bits);
          else
            CHECK_OR(93,
                     b.budget_bits >= 3.0 && b.budget_bits <= 8.0 &&
                         std::floor(2 * b.budget_bits) == 2 * b.budget_bits,
                     "rank %d: mxfp8 gave %g bits, not a rung of 3, 3.5, ..., 8", rank,
                     b.budget_bits);
          double err = 0, energy = 0;
          for (size_t i = 0; i < count && !poisoned; ++i) {
            double exact = 0;
            for (int r = 0; r < n; ++r) exact += noisy_value(r, i + shift, dense);
            err += (out[i] - exact) * (out[i] - exact);
            energy += exact * exact;
          }
          measured[s][k] = poisoned ? -1 : err / energy;
          // This call read the previous call's statistics: that call's prediction.
          if (k > 0 && measured[s][k - 1] > 0 && with_stats[s][k - 1]) {
            const double ratio = b.predicted_vnmse / measured[s][k - 1];
            CHECK_OR(94, ratio >= 0.5 && ratio <= 2.0,
                     "rank %d: bucket %zu call %d: predicted vNMSE %.3g, measured %.3g", rank,
                     count, k - 1, b.predicted_vnmse, measured[s][k - 1]);
            if (rank == 0)
              std::printf("auto %s bucket %zu call %d: %g bits, predicted %.3g, measured %.3g\n",
                          run, count, k - 1, budgets[budgets.size() - 3], b.predicted_vnmse,
                          measured[s][k - 1]);
          }
          CHECK_OR(95, dq::test::same_bytes_everywhere(comms[0], out.data(), count * 4),
                   "rank %d: results differ between ranks", rank);
        }
      CHECK_OR(96, dq::test::same_bytes_everywhere(comms[0], budgets.data(), budgets.size() * 8),
               "rank %d: ranks chose different budgets", rank);
      if (dense) {
        // The fallback is MXFP8's error, below the 5-bit first call's; its statistics calls
        // were 1 in 8 (the counters: 2 buckets x 9 MX calls, 2 x 2 predicted calls).
        for (int s = 0; s < 2; ++s)
          for (int k = 1; k < kCalls; ++k)
            CHECK_OR(98, measured[s][k] < measured[s][0] / 4,
                     "rank %d: bucket %zu: MX call %d vNMSE %.3g, the 5-bit call's %.3g", rank,
                     sizes[s], k, measured[s][k], measured[s][0]);
        std::lock_guard<std::mutex> lock(metrics->budget_mutex);
        CHECK_OR(99, metrics->budget.mx_calls == 18 && metrics->budget.predicted_calls == 4,
                 "rank %d: %llu MX calls, %llu predicted calls (expected 18 and 4)", rank,
                 static_cast<unsigned long long>(metrics->budget.mx_calls),
                 static_cast<unsigned long long>(metrics->budget.predicted_calls));
      }
      return 0;
    };
    if (!all_zero(run_ranks(n, 1, body, 240), run)) return 1;
  }
  return 0;
}

// ---- auto's choice against its target ----------------------------------------------------------
// The same input in every call, so every call's statistics, and so every prediction, are the
// same. The fixed 4.5- and 5-bit budgets' predicted vNMSE (P4.5, P5) set the target T = P4.5 /
// 1.25: the 4.5-bit rung misses it by 25%, so auto must choose more bits (5 when P5 <= T), and the
// chosen rung's own predicted vNMSE must be within T. A choice that accepted an error up to 1.5 T
// takes 4.5 bits.
double predicted_after_calls(int n, int rank, ncclComm_t comm, const dq::config::Settings& settings,
                             const std::vector<float>& in, int calls, double* bits) {
  auto metrics = std::make_shared<dq::engine::CommMetrics>();
  Engine engine(settings, true, {comm, rank, n}, cpu_nccl_ops(), dq::engine::host_device(), metrics,
                true);
  std::vector<float> out(in.size());
  CallArgs args = call_of(in.data(), out.data(), in.size());
  PassReason reason;
  for (int k = 0; k < calls; ++k) {
    if (engine.run(args, &reason) != ncclSuccess || reason != PassReason::kRerouted) return -2;
    std::lock_guard<std::mutex> lock(metrics->budget_mutex);
    // The budget of the second-to-last call: the one whose prediction the last call read.
    if (k == calls - 2) *bits = metrics->budget.buckets.at(0).budget_bits;
  }
  std::lock_guard<std::mutex> lock(metrics->budget_mutex);
  return metrics->budget.buckets.at(0).predicted_vnmse;
}

int scenario_auto_target(int n) {
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    std::vector<float> in(size_t{1} << 19);
    for (size_t i = 0; i < in.size(); ++i) in[i] = noisy_value(rank, i);
    auto settings = [](const std::string& bits, const std::string& target) {
      // A control window of 1: each call reads the previous call's prediction. A fixed budget
      // takes no target (empty: unset), which steers only auto.
      return settings_for({{"DYNAMIQ_ENABLE", "1"},
                           {"DYNAMIQ_TOPO", "ring"},
                           {"DYNAMIQ_BITS", bits},
                           {"DYNAMIQ_TARGET", target},
                           {"DYNAMIQ_CONTROL_WINDOW", "1"}});
    };
    double bits45 = 0, bits5 = 0, chosen = 0;
    const double p45 =
        predicted_after_calls(n, rank, comms[0], settings("4.5", ""), in, 2, &bits45);
    const double p5 = predicted_after_calls(n, rank, comms[0], settings("5", ""), in, 2, &bits5);
    CHECK_OR(120, p45 > 0 && p5 > 0 && bits45 == 4.5 && bits5 == 5,
             "rank %d: fixed budgets: predicted %g at %g bits, %g at %g bits", rank, p45, bits45,
             p5, bits5);
    char target[64];
    std::snprintf(target, sizeof target, "vnmse:%.6e", p45 / 1.25);
    const double t = std::strtod(target + 6, nullptr);
    // Call 0 takes the fixed default; call 1 the rung chosen from call 0's statistics; call 2
    // reads call 1's prediction.
    const double p =
        predicted_after_calls(n, rank, comms[0], settings("auto", target), in, 3, &chosen);
    CHECK_OR(121, chosen > 4.5 && p > 0 && p <= t,
             "rank %d: target %s (P4.5 / 1.25): auto chose %g bits, whose predicted vNMSE %.4g "
             "exceeds the target %.4g (P4.5 %.4g, P5 %.4g)",
             rank, target, chosen, p, t, p45, p5);
    CHECK_OR(122, p5 > t || chosen == 5,
             "rank %d: P5 %.4g meets the target %.4g, but auto chose %g bits", rank, p5, t, chosen);
    if (rank == 0)
      std::printf("auto_target: P4.5 %.4g, P5 %.4g; target %.4g: chose %g bits, predicted %.4g\n",
                  p45, p5, t, chosen, p);
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 240), "auto_target") ? 0 : 1;
}

// ---- the sampled check (DYNAMIQ_CHECK_EVERY)
// ------------------------------------------------------
int scenario_check(int n) {
  constexpr int kCalls = 12;
  constexpr size_t kCount = size_t{1} << 19;  // 2 MiB of FP32: 2,048 super-groups
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    std::vector<std::vector<float>> outputs[2];
    std::shared_ptr<dq::engine::CommMetrics> checked_metrics;
    double measured_sum = 0;
    int measured_calls = 0;
    for (int with_check = 0; with_check < 2; ++with_check) {
      // A control window of 1: a check is read two calls after its own (armed by the next
      // call's control, absorbed by the one after).
      const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                          {"DYNAMIQ_TOPO", "ring"},
                                          {"DYNAMIQ_CHECK_EVERY", with_check ? "2" : "0"},
                                          {"DYNAMIQ_CONTROL_WINDOW", "1"}});
      auto metrics = std::make_shared<dq::engine::CommMetrics>();
      Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), dq::engine::host_device(),
                    metrics, true);
      for (int k = 0; k < kCalls; ++k) {
        const size_t shift = static_cast<size_t>(k) * 31 * 256;
        std::vector<float> in(kCount), out(kCount);
        for (size_t i = 0; i < kCount; ++i) in[i] = noisy_value(rank, i + shift);
        // Call 9 (checked: the odd calls are) holds a NaN in every super-group on rank 2, so
        // every sampled one is non-finite.
        for (size_t i = 0; k == 9 && rank == 2 && i < kCount; i += 256) in[i] = NAN;
        const bool in_place = k % 4 == 3;  // checked calls in place too
        CallArgs args = call_of(in.data(), in_place ? in.data() : out.data(), kCount);
        PassReason reason;
        CHECK_OR(110, engine.run(args, &reason) == ncclSuccess && reason == PassReason::kRerouted,
                 "rank %d: check %d call %d not compressed (%s)", rank, with_check, k,
                 dq::engine::reason_name(reason));
        outputs[with_check].push_back(in_place ? in : out);
        if (with_check && k != 9) {
          double err = 0, energy = 0;
          const std::vector<float>& got = outputs[1].back();
          for (size_t i = 0; i < kCount; ++i) {
            double exact = 0;
            for (int r = 0; r < n; ++r) exact += noisy_value(r, i + shift);
            err += (got[i] - exact) * (got[i] - exact);
            energy += exact * exact;
          }
          measured_sum += err / energy;
          ++measured_calls;
        }
      }
      // Two more calls so the last check (call 11) is read: armed by one, read by the next.
      std::vector<float> in(kCount, 1.0f), out(kCount);
      CallArgs args = call_of(in.data(), out.data(), kCount);
      PassReason reason;
      for (int k = 0; k < 2; ++k)
        CHECK_OR(111, engine.run(args, &reason) == ncclSuccess, "rank %d: tail call", rank);
      if (with_check) checked_metrics = metrics;
    }
    // The check changes no output byte (its own all-reduce is separate; the rounding keys are
    // the calls').
    for (int k = 0; k < kCalls; ++k)
      CHECK_OR(112, std::memcmp(outputs[0][k].data(), outputs[1][k].data(), kCount * 4) == 0,
               "rank %d: call %d: the output differs with the check on", rank, k);
    std::lock_guard<std::mutex> lock(checked_metrics->budget_mutex);
    const dq::engine::BudgetMetrics& m = checked_metrics->budget;
    const double measured = measured_sum / measured_calls;
    const double sampled = m.checked_sq_error / m.checked_energy;
    // Calls 1, 3, 5, 7, 11 checked and read; 9 is non-finite; 13 (the tail's second) not read.
    CHECK_OR(113, m.checked_calls == 5 && m.checked_nonfinite == 1,
             "rank %d: %llu checks read, %llu non-finite (expected 5 and 1)", rank,
             static_cast<unsigned long long>(m.checked_calls),
             static_cast<unsigned long long>(m.checked_nonfinite));
    CHECK_OR(114, sampled > 0.5 * measured && sampled < 2.0 * measured,
             "rank %d: sampled vNMSE %.4g, measured over the whole calls %.4g", rank, sampled,
             measured);
    // Paired with the prediction of the same calls (the bucket's next call reads it): calls 1,
    // 3, 5, 7 and 11 (call 9's statistics are not finite: no prediction).
    CHECK_OR(115, m.paired_calls == 5, "rank %d: %llu checked calls paired with their prediction",
             rank, static_cast<unsigned long long>(m.paired_calls));
    const double ratio = m.paired_sampled_sum / m.paired_predicted_sum;
    CHECK_OR(116, ratio > 0.5 && ratio < 2.0,
             "rank %d: sampled / predicted vNMSE over paired calls %.3g", rank, ratio);
    CHECK_OR(117, dq::test::same_bytes_everywhere(comms[0], &m.checked_sq_error, 8),
             "rank %d: the checks differ between ranks", rank);
    if (rank == 0)
      std::printf(
          "check: %llu checks, sampled vNMSE %.4g, measured %.4g, paired %llu: "
          "sampled/predicted %.3f\n",
          static_cast<unsigned long long>(m.checked_calls), sampled, measured,
          static_cast<unsigned long long>(m.paired_calls), ratio);
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 240), "check") ? 0 : 1;
}

// ---- two-level scenarios (split_settles, rail_overlap) -------------------------------------
// Rank `rank` on fake node rank / 2 (NCCL_HOSTID: `prefix` and the node number), with small
// integers as input: value i is (i + rank) % 7, so the exact sum over n ranks is known.
void join_fake_node(const std::string& prefix, int rank) {
  setenv("NCCL_HOSTID", (prefix + std::to_string(rank / 2)).c_str(), 1);
}
std::vector<float> small_integers(int rank, size_t count) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>((i + rank) % 7);
  return v;
}
double small_integers_sum(size_t i, int n) {
  double sum = 0;
  for (int q = 0; q < n; ++q) sum += static_cast<double>((i + q) % 7);
  return sum;
}
// One FP32 SUM all-reduce of this rank's small integers `in` through `engine` into `out` (their
// size); *worst: the largest distance of an output from the exact sum over n ranks.
ncclResult_t all_reduce_small_integers(Engine& engine, const std::vector<float>& in,
                                       std::vector<float>* out, int n, PassReason* reason,
                                       double* worst) {
  CallArgs args = call_of(in.data(), out->data(), in.size());
  const ncclResult_t r = engine.run(args, reason);
  *worst = 0;
  for (size_t i = 0; i < in.size(); ++i)
    *worst = std::max(*worst, std::fabs((*out)[i] - small_integers_sum(i, n)));
  return r;
}

// ---- split_settles -------------------------------------------------------------------------
// The split answers ncclInProgress (after making the communicator: the CPU NCCL's splits are
// synchronous) and the child settles after kSplitPolls polls, or, for g_stuck_rank's first split,
// never. Each rank is its own process: these globals are per rank.
constexpr int kSplitPolls = 5;
int g_stuck_rank = -1, g_split_rank = -1;
std::map<ncclComm_t, int> g_polls_left;  // per child; -1: never settles
std::atomic<int> g_splits{0}, g_aborts{0}, g_destroys{0}, g_reduce_scatters{0};

ncclResult_t in_progress_split(ncclComm_t parent, int color, int key, ncclComm_t* child,
                               ncclConfig_t* config) {
  if (config == nullptr || config->blocking != 0) return ncclInvalidUsage;  // must not block
  const ncclResult_t r = ncclCommSplit(parent, color, key, child, config);
  if (r != ncclSuccess) return r;
  const bool stuck = g_split_rank == g_stuck_rank && g_splits.load() == 0;
  g_polls_left[*child] = stuck ? -1 : kSplitPolls;
  g_splits.fetch_add(1);
  return ncclInProgress;
}
ncclResult_t polled_async_error(ncclComm_t comm, ncclResult_t* state) {
  const auto it = g_polls_left.find(comm);
  if (it == g_polls_left.end() || it->second == 0) return ncclCommGetAsyncError(comm, state);
  if (it->second > 0) --it->second;
  *state = ncclInProgress;
  return ncclSuccess;
}
// NVIDIA's NCCL under a non-blocking parent: the split answers ncclInProgress with the handle
// still NULL (whatever the child's config says) and writes it once the split is done, which the
// parent's ncclCommGetAsyncError reports: here after kSplitPolls polls of the parent.
struct ParentSplit {
  ncclComm_t* handle;
  ncclComm_t made;
  int polls_left;
};
std::map<ncclComm_t, ParentSplit> g_parent_splits;  // per parent: its split in progress
ncclResult_t parent_settled_split(ncclComm_t parent, int color, int key, ncclComm_t* child,
                                  ncclConfig_t* config) {
  if (g_parent_splits.count(parent) != 0) return ncclInvalidArgument;  // one at a time
  ncclComm_t made = nullptr;
  const ncclResult_t r = ncclCommSplit(parent, color, key, &made, config);
  if (r != ncclSuccess) return r;
  *child = nullptr;
  g_parent_splits[parent] = ParentSplit{child, made, kSplitPolls};
  g_splits.fetch_add(1);
  return ncclInProgress;
}
ncclResult_t parent_polled_async_error(ncclComm_t comm, ncclResult_t* state) {
  const auto it = g_parent_splits.find(comm);
  if (it == g_parent_splits.end()) return ncclCommGetAsyncError(comm, state);
  if (it->second.polls_left-- > 0) {
    *state = ncclInProgress;
    return ncclSuccess;
  }
  *it->second.handle = it->second.made;
  g_parent_splits.erase(it);
  return ncclCommGetAsyncError(comm, state);
}

ncclResult_t counted_abort(ncclComm_t comm) {
  g_aborts.fetch_add(1);
  return ncclCommAbort(comm);
}
ncclResult_t counted_destroy(ncclComm_t comm) {
  g_destroys.fetch_add(1);
  return ncclCommDestroy(comm);
}
ncclResult_t counted_reduce_scatter(const void* s, void* r, size_t n, ncclDataType_t t,
                                    ncclRedOp_t op, ncclComm_t c, cudaStream_t st) {
  g_reduce_scatters.fetch_add(1);
  return ncclReduceScatter(s, r, n, t, op, c, st);
}

int split_settles_case(int n, int stuck_rank, bool handle_when_done = false) {
  constexpr int64_t kTimeoutMs = 800;
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_HIERARCHY", "node"},
                                      {"DYNAMIQ_MIN_BYTES", "0"},
                                      {"DYNAMIQ_TIMEOUT_MS", std::to_string(kTimeoutMs)}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    join_fake_node("split-node", rank);
    g_stuck_rank = stuck_rank;
    g_split_rank = rank;
    dq::engine::NcclOps ops = cpu_nccl_ops();
    ops.comm_split = handle_when_done ? parent_settled_split : in_progress_split;
    ops.comm_get_async_error = handle_when_done ? parent_polled_async_error : polled_async_error;
    ops.comm_abort = counted_abort;
    ops.comm_destroy = counted_destroy;
    ops.reduce_scatter = counted_reduce_scatter;
    constexpr size_t kCount = 1 << 18;
    const std::vector<float> in = small_integers(rank, kCount);
    std::vector<float> out(kCount);
    const auto t0 = std::chrono::steady_clock::now();
    {
      Engine engine(settings, true, {comms[0], rank, n}, ops, dq::engine::host_device(), nullptr,
                    true);
      for (int call = 0; call < 2; ++call) {
        PassReason reason;
        double worst = 0;
        const ncclResult_t r = all_reduce_small_integers(engine, in, &out, n, &reason, &worst);
        CHECK_OR(70, r == ncclSuccess, "rank %d call %d: %d", rank, call, static_cast<int>(r));
        // Small integers: every schedule's sum is exact or close to it (5 bits).
        CHECK_OR(71, worst < 3.0, "rank %d call %d: off by %g", rank, call, worst);
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // The split communicators: the node one, the two rail engines' and the all-gathers'.
    constexpr int kSplits = 4;
    if (stuck_rank < 0) {
      CHECK_OR(72,
               g_reduce_scatters.load() > 0 && g_aborts.load() == 0 && g_destroys.load() == kSplits,
               "rank %d: settled splits: %d node reduce-scatters (two-level wanted), %d aborts, "
               "%d destroys (%d wanted)",
               rank, g_reduce_scatters.load(), g_aborts.load(), g_destroys.load(), kSplits);
    } else {
      CHECK_OR(
          73, g_reduce_scatters.load() == 0 && g_aborts.load() == kSplits && g_destroys.load() == 0,
          "rank %d: a split never settled: %d node reduce-scatters (flat wanted), %d aborts "
          "(%d wanted), %d destroys",
          rank, g_reduce_scatters.load(), g_aborts.load(), kSplits, g_destroys.load());
      CHECK_OR(74, s < 30.0, "rank %d: %.1f s with one stuck split (timeout %lld ms)", rank, s,
               static_cast<long long>(kTimeoutMs));
    }
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 120), stuck_rank < 0 ? "split_settles" : "split_stuck") ? 0
                                                                                                : 1;
}

// An abort of the communicator (its watchdog's ncclCommAbort) begins while the first split is
// in NCCL: no further split is issued on the parent, which the abort may free; the call fails.
std::atomic<bool> g_split_abort{false};
ncclResult_t aborting_split(ncclComm_t parent, int color, int key, ncclComm_t* child,
                            ncclConfig_t* config) {
  g_splits.fetch_add(1);
  g_split_abort = true;
  return ncclCommSplit(parent, color, key, child, config);
}

int split_abort_case(int n) {
  const auto settings = settings_for(
      {{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_HIERARCHY", "node"}, {"DYNAMIQ_MIN_BYTES", "0"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    join_fake_node("split-abort-node", rank);
    dq::engine::NcclOps ops = cpu_nccl_ops();
    ops.comm_split = aborting_split;
    ops.comm_abort = counted_abort;
    const std::vector<float> in = small_integers(rank, 1 << 16);
    std::vector<float> out(in.size());
    Engine engine(settings, true, {comms[0], rank, n}, ops, dq::engine::host_device(), nullptr,
                  true);
    engine.watch_abort(&g_split_abort);
    PassReason reason;
    double worst = 0;
    const ncclResult_t r = all_reduce_small_integers(engine, in, &out, n, &reason, &worst);
    CHECK_OR(75, r != ncclSuccess, "rank %d: the call succeeded while its communicator aborted",
             rank);
    CHECK_OR(76, g_splits.load() == 1, "rank %d: %d splits issued, 1 wanted (an abort began in it)",
             rank, g_splits.load());
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 120), "split_abort") ? 0 : 1;
}

// A communicator nobody opted in (DYNAMIQ_COMMS excluding it, as for a pipeline group) on two
// fake nodes: it passes every call through, and makes none of the two-level schedule's node and
// rail communicators (4 splits, their streams and rail engines) it would never use.
ncclResult_t counted_split(ncclComm_t parent, int color, int key, ncclComm_t* child,
                           ncclConfig_t* config) {
  g_splits.fetch_add(1);
  return ncclCommSplit(parent, color, key, child, config);
}
int not_opted_in_case(int n) {
  const auto settings = settings_for(
      {{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_HIERARCHY", "node"}, {"DYNAMIQ_MIN_BYTES", "0"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    join_fake_node("not-opted-in-node", rank);
    dq::engine::NcclOps ops = cpu_nccl_ops();
    ops.comm_split = counted_split;
    const std::vector<float> in = small_integers(rank, 1 << 16);
    std::vector<float> out(in.size());
    Engine engine(settings, true, {comms[0], rank, n}, ops, dq::engine::host_device(), nullptr,
                  /*opted_in=*/false);
    for (int call = 0; call < 2; ++call) {
      PassReason reason = PassReason::kRerouted;
      CallArgs args = call_of(in.data(), out.data(), in.size());
      CHECK_OR(77, engine.run(args, &reason) == ncclSuccess, "rank %d: call %d failed", rank, call);
      CHECK_OR(78, reason == PassReason::kNotOptedIn, "rank %d: call %d: reason %s", rank, call,
               dq::engine::reason_name(reason));
    }
    CHECK_OR(79, g_splits.load() == 0,
             "rank %d: %d splits for a communicator nobody opted in (the two-level schedule's "
             "communicators, never used)",
             rank, g_splits.load());
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 120), "not_opted_in two-level") ? 0 : 1;
}

int scenario_split_settles(int n) {
  if (const int rc = not_opted_in_case(n)) return rc;
  if (const int rc = split_abort_case(n)) return rc;
  if (const int rc = split_settles_case(n, -1)) return rc;
  if (const int rc = split_settles_case(n, -1, /*handle_when_done=*/true)) return rc;
  return split_settles_case(n, 1);
}

// ---- enqueue_fail --------------------------------------------------------------------------
// Rank 1's device fails an event record part-way through a compressed call, after some of the
// call's NCCL calls were issued. That call fails there, and so does every later call on that
// rank, at once and without issuing anything: its NCCL calls would pair with its peers' calls of
// the failed one. The peers' call fails at the timeout (rank 1's messages never come).
int scenario_enqueue_fail(int n) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_TIMEOUT_MS", "3000"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    // The buffers outlive the engine: the failed call's steps queued before the failure still
    // run on the device's streams (as a GPU's do), until the engine's teardown drains them.
    constexpr size_t kCount = 1 << 20;
    std::vector<float> in(kCount, static_cast<float>(rank + 1)), out(kCount);
    FailingDevice device(dq::engine::host_device());
    Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), &device, nullptr, true);
    CallArgs args = call_of(in.data(), out.data(), kCount);
    PassReason reason;
    // The handshake and the plan's agreement first: a compressed call on every rank.
    CHECK_OR(120, engine.run(args, &reason) == ncclSuccess && reason == PassReason::kRerouted,
             "rank %d: the first call", rank);
    int issued = 0;
    if (rank == 1)
      device.before_nccl = [&] {
        if (++issued == 2) device.failing_records = true;
      };
    const ncclResult_t failed = engine.run(args, &reason);
    if (rank != 1) return 0;  // failed at the timeout, or not: either way no hang
    CHECK_OR(121, failed != ncclSuccess, "rank 1: the call whose record failed succeeded");
    device.failing_records = false;
    const int before = device.nccl_enqueues;
    const ncclResult_t next = engine.run(args, &reason);
    CHECK_OR(122, next == failed && device.nccl_enqueues == before,
             "rank 1: the call after the failed one: %s, %d NCCL calls issued (%s and none "
             "expected)",
             ncclGetErrorString(next), device.nccl_enqueues - before, ncclGetErrorString(failed));
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 120), "enqueue_fail") ? 0 : 1;
}

// ---- nccl_code_kept ------------------------------------------------------------------------
// Every rank's device reports that NCCL refused a call it issued with ncclRemoteError (as a CUDA
// device does, which issues NCCL's calls inline): that call and every later one on the
// communicator, and its asynchronous error, are NCCL's own code, not the ncclSystemError the
// device's Status maps to (which a watchdog reading ncclCommGetAsyncError would take for a local
// fault). At three places, a communicator each: a compressed call of a cached plan; the
// handshake (the first call); a new plan's agreement (the first call of a new size).
int scenario_nccl_code_kept(int n) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_TIMEOUT_MS", "3000"}});
  enum Where { kCachedPlan, kHandshake, kNewPlan, kPlaces };
  const char* const names[kPlaces] = {"a cached plan's call", "the handshake",
                                      "a new plan's agreement"};
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    constexpr size_t kCount = 1 << 20;
    std::vector<float> in(kCount, static_cast<float>(rank + 1)), out(kCount);
    for (int where = 0; where < kPlaces; ++where) {
      FailingDevice device(dq::engine::host_device());
      Engine engine(settings, true, {comms[where], rank, n}, cpu_nccl_ops(), &device, nullptr,
                    true);
      CallArgs args = call_of(in.data(), out.data(), kCount);
      PassReason reason;
      if (where != kHandshake) {
        CHECK_OR(130, engine.run(args, &reason) == ncclSuccess && reason == PassReason::kRerouted,
                 "rank %d: the first call", rank);
        if (where == kNewPlan) args.count = kCount / 2;
      }
      device.inline_nccl_failure = ncclRemoteError;
      const ncclResult_t failed = engine.run(args, &reason);
      const ncclResult_t next = engine.run(args, &reason);
      const ncclResult_t async = engine.async_error();
      CHECK_OR(131,
               failed == ncclRemoteError && next == ncclRemoteError && async == ncclRemoteError,
               "rank %d, at %s: the failed call returned %s, the next %s, the asynchronous error "
               "%s (NCCL's ncclRemoteError expected)",
               rank, names[where], ncclGetErrorString(failed), ncclGetErrorString(next),
               ncclGetErrorString(async));
    }
    return 0;
  };
  return all_zero(run_ranks(n, kPlaces, body, 120), "nccl_code_kept") ? 0 : 1;
}

// ---- auto_plan_fail ------------------------------------------------------------------------
// DYNAMIQ_BITS=auto with a loose target (3 bits once predicted), a control window of 1: the
// bucket's first call plans 5 bits and sets the bucket up; at the second, the 3-bit plan's
// allocation fails on rank 1, and every rank passes that call through. The bucket must stay set
// up (its 5-bit plan is cached, so nothing would set it up again): a later call takes 3 bits.
int scenario_auto_plan_fail(int n) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_BITS", "auto"},
                                      {"DYNAMIQ_TARGET", "vnmse:1"},
                                      {"DYNAMIQ_TOPO", "ring"},
                                      {"DYNAMIQ_CONTROL_WINDOW", "1"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    auto metrics = std::make_shared<dq::engine::CommMetrics>();
    FailingDevice device(dq::engine::host_device());
    Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), &device, metrics, true);
    constexpr size_t kCount = size_t{1} << 19;
    std::string bits;
    for (int k = 0; k < 5; ++k) {
      std::vector<float> in(kCount), out(kCount);
      for (size_t i = 0; i < kCount; ++i) in[i] = noisy_value(rank, i + 31 * 256 * k, false);
      device.failing = rank == 1 && k == 1;
      CallArgs args = call_of(in.data(), out.data(), kCount);
      PassReason reason;
      CHECK_OR(110, engine.run(args, &reason) == ncclSuccess, "rank %d call %d: error", rank, k);
      const PassReason expect = k == 1 ? PassReason::kFailure : PassReason::kRerouted;
      CHECK_OR(111, reason == expect, "rank %d call %d: %s, %s expected", rank, k,
               dq::engine::reason_name(reason), dq::engine::reason_name(expect));
      if (reason != PassReason::kRerouted) continue;
      std::lock_guard<std::mutex> lock(metrics->budget_mutex);
      for (const auto& b : metrics->budget.buckets)
        if (b.count == kCount) bits += std::to_string(static_cast<int>(b.budget_bits));
    }
    // Call 0 at the default 5 bits; after the failed plan, the bucket's predictions again.
    CHECK_OR(112, bits.size() == 4 && bits[0] == '5' && bits.back() == '3',
             "rank %d: the compressed calls' bits %s: 5 first, 3 at the end expected", rank,
             bits.c_str());
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 120), "auto_plan_fail") ? 0 : 1;
}

// ---- auto_plan_fail_always -----------------------------------------------------------------
// As auto_plan_fail, but rank 1 can make no new plan from call 1 on (lasting memory pressure): the
// bucket keeps its cached default plan, so its calls are compressed at 5 bits between the tries of
// the predicted rung, which come at growing intervals (without that, every call after the first
// passed through, for good: the failed rung stayed the bucket's choice and nothing predicted
// again).
int scenario_auto_plan_fail_always(int n) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_BITS", "auto"},
                                      {"DYNAMIQ_TARGET", "vnmse:1"},
                                      {"DYNAMIQ_TOPO", "ring"},
                                      {"DYNAMIQ_CONTROL_WINDOW", "1"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    FailingDevice device(dq::engine::host_device());
    Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), &device, nullptr, true);
    constexpr size_t kCount = size_t{1} << 19;
    constexpr int kCalls = 16;
    std::string reasons;  // R rerouted, F failure
    for (int k = 0; k < kCalls; ++k) {
      std::vector<float> in(kCount), out(kCount);
      for (size_t i = 0; i < kCount; ++i) in[i] = noisy_value(rank, i + 31 * 256 * k, false);
      device.failing = rank == 1 && k >= 1;
      CallArgs args = call_of(in.data(), out.data(), kCount);
      PassReason reason;
      CHECK_OR(120, engine.run(args, &reason) == ncclSuccess, "rank %d call %d: error", rank, k);
      CHECK_OR(121, reason == PassReason::kRerouted || reason == PassReason::kFailure,
               "rank %d call %d: %s", rank, k, dq::engine::reason_name(reason));
      reasons += reason == PassReason::kRerouted ? 'R' : 'F';
    }
    const long failures = std::count(reasons.begin(), reasons.end(), 'F');
    // The rung is tried again (more than one failure), at growing intervals (at most 4 in 16).
    CHECK_OR(122, reasons[0] == 'R' && reasons[1] == 'F' && failures >= 2 && failures <= 4,
             "rank %d: calls %s (R compressed, F a failed plan)", rank, reasons.c_str());
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 120), "auto_plan_fail_always") ? 0 : 1;
}

// ---- shard_alloc_fail ----------------------------------------------------------------------
// Two-level (2 x 2 fake nodes): the shard buffer's allocation fails on rank 1 alone at the first
// call. Every rank passes that call through, and the next call of the same shape grows the shard
// again on every rank (none kept the buffer the others lack): compressed, near the sum.
int scenario_shard_alloc_fail(int n) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_HIERARCHY", "node"},
                                      {"DYNAMIQ_MIN_BYTES", "0"},
                                      {"DYNAMIQ_TIMEOUT_MS", "3000"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    join_fake_node("shard-node", rank);
    constexpr size_t kCount = (1 << 18) + 6;  // FP32: a shard of 2^19 + 12 bytes on 2 local ranks
    FailingDevice device(dq::engine::host_device());
    device.fail_bytes = kCount / 2 * 4;
    device.fail_times = rank == 1 ? 1 : 0;
    Engine engine(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), &device, nullptr, true);
    const std::vector<float> in = small_integers(rank, kCount);
    std::vector<float> out(kCount);
    for (int call = 0; call < 2; ++call) {
      PassReason reason;
      double worst = 0;
      const ncclResult_t r = all_reduce_small_integers(engine, in, &out, n, &reason, &worst);
      CHECK_OR(100, r == ncclSuccess, "rank %d call %d: %s", rank, call, ncclGetErrorString(r));
      const PassReason expect = call == 0 ? PassReason::kFailure : PassReason::kRerouted;
      CHECK_OR(101, reason == expect, "rank %d call %d: %s, %s expected", rank, call,
               dq::engine::reason_name(reason), dq::engine::reason_name(expect));
      if (call == 1) CHECK_OR(102, worst < 3.0, "rank %d: off by %g", rank, worst);
    }
    CHECK_OR(103, device.failed_allocs == (rank == 1 ? 1 : 0), "rank %d: %d allocations failed",
             rank, device.failed_allocs);
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 120), "shard_alloc_fail") ? 0 : 1;
}

// ---- rail_overlap --------------------------------------------------------------------------
// The first rail message group of the first rail communicator (piece 0's) holds back until a
// BF16 all-reduce (a statistics all-reduce) is issued on the second rail communicator (piece
// 1's), for at most kHoldMs. With one rail engine, piece 1's rail call could only start after
// piece 0's last message: the hold would run out. Per rank (process) state.
std::vector<ncclComm_t> g_made;  // the split communicators in split order: node, rail 0, rail 1
std::mutex g_overlap_m;
std::condition_variable g_overlap_cv;
bool g_second_stats = false, g_held = false, g_hold_ran_out = false;

ncclResult_t recorded_split(ncclComm_t parent, int color, int key, ncclComm_t* child,
                            ncclConfig_t* config) {
  const ncclResult_t r = ncclCommSplit(parent, color, key, child, config);
  if (r == ncclSuccess) g_made.push_back(*child);  // at the handshake, before any stream work
  return r;
}
ncclResult_t watched_all_reduce(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                                ncclComm_t c, cudaStream_t st) {
  if (t == ncclBfloat16 && g_made.size() > 2 && c == g_made[2]) {
    std::lock_guard<std::mutex> lock(g_overlap_m);
    g_second_stats = true;
    g_overlap_cv.notify_all();
  }
  return ncclAllReduce(s, r, n, t, op, c, st);
}
ncclResult_t held_send(const void* b, size_t n, ncclDataType_t t, int peer, ncclComm_t c,
                       cudaStream_t st) {
  constexpr auto kHoldMs = std::chrono::milliseconds(5000);
  if (g_made.size() > 1 && c == g_made[1]) {
    std::unique_lock<std::mutex> lock(g_overlap_m);
    if (!g_held) {
      g_held = true;
      if (!g_overlap_cv.wait_for(lock, kHoldMs, [] { return g_second_stats; }))
        g_hold_ran_out = true;
    }
  }
  return ncclSend(b, n, t, peer, c, st);
}

int scenario_rail_overlap(int n) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_HIERARCHY", "node"},
                                      {"DYNAMIQ_MIN_BYTES", "0"},
                                      {"DYNAMIQ_BLOCK_BYTES", "256K"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    join_fake_node("overlap-node", rank);
    dq::engine::NcclOps ops = cpu_nccl_ops();
    ops.comm_split = recorded_split;
    ops.all_reduce = watched_all_reduce;
    ops.send = held_send;
    // 2^18 values: a shard of 2^17 per rank, 4 pieces of 32,768 (256 KiB / 4 B / 2 ranks).
    constexpr size_t kCount = 1 << 18;
    const std::vector<float> in = small_integers(rank, kCount);
    std::vector<float> out(kCount);
    {
      PassReason reason;
      const ncclResult_t r = all_reduce_once(settings, ops, comms[0], rank, n, in, &out, &reason);
      CHECK_OR(80, r == ncclSuccess && reason == PassReason::kRerouted, "rank %d: %d, reason %d",
               rank, static_cast<int>(r), static_cast<int>(reason));
      // 5 bits on small integers in pieces of 128 super-groups: near the sum (vNMSE 0.022 with
      // one rail engine or two, the same bytes), far from garbage (~1).
      double error = 0, energy = 0;
      for (size_t i = 0; i < kCount; ++i) {
        const double want = small_integers_sum(i, n);
        error += (out[i] - want) * (out[i] - want);
        energy += want * want;
      }
      CHECK_OR(81, error < 0.05 * energy, "rank %d: vNMSE %g", rank, error / energy);
    }
    CHECK_OR(82, g_made.size() == 4, "rank %d: %zu split communicators, 4 wanted", rank,
             g_made.size());
    CHECK_OR(83, g_held && !g_hold_ran_out,
             "rank %d: piece 0's first rail message %s for piece 1's statistics all-reduce", rank,
             g_held ? "waited in vain" : "was never sent");
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 120), "rail_overlap") ? 0 : 1;
}

// ---- teardown_order ------------------------------------------------------------------------
// A two-level engine's teardown once it is broken (marked aborted, as the shim's ncclCommAbort
// marks it), after one compressed call on two fake nodes of two ranks. Each rank logs, in order,
// the device's waits (each bounded wait and each stream destroy, which waits for the stream's
// work) and the revokes, aborts and destroys of the four communicators the engine split, so that
// operations stuck on a silent peer end before the waits instead of each wait running to
// DYNAMIQ_TIMEOUT_MS. Cases, without ncclCommRevoke (an NCCL before 2.28):
//   - the device's abort_ends_queued_nccl_work() true (a GPU's answer), aborted: all four are
//     aborted before the first wait;
//   - false (the host device, whose threads make those NCCL calls and must not race an abort),
//     aborted: aborted all the same, but only after the rail engines' waits;
//   - true, not aborted: destroyed, never aborted;
// and with ncclCommRevoke, aborted, for either answer: all four revoked before the first wait
// (their operations end and the streams drain), aborted after the rail engines' waits.
std::vector<std::string> g_teardown_log;
ncclResult_t logged_abort(ncclComm_t comm) {
  if (std::find(g_made.begin(), g_made.end(), comm) != g_made.end())
    g_teardown_log.push_back("abort");
  return ncclCommAbort(comm);
}
ncclResult_t logged_revoke(ncclComm_t comm, int flags) {
  if (std::find(g_made.begin(), g_made.end(), comm) != g_made.end())
    g_teardown_log.push_back("revoke");
  return ncclCommRevoke(comm, flags);
}
ncclResult_t logged_destroy(ncclComm_t comm) {
  if (std::find(g_made.begin(), g_made.end(), comm) != g_made.end())
    g_teardown_log.push_back("destroy");
  return ncclCommDestroy(comm);
}

int teardown_order_case(int n, int rank, ncclComm_t comm, bool aborts_end_work, bool aborted,
                        bool with_revoke) {
  const auto settings = settings_for(
      {{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_HIERARCHY", "node"}, {"DYNAMIQ_MIN_BYTES", "0"}});
  dq::engine::NcclOps ops = cpu_nccl_ops();
  ops.comm_split = recorded_split;
  ops.comm_abort = logged_abort;
  ops.comm_destroy = logged_destroy;
  ops.comm_revoke = with_revoke ? logged_revoke : nullptr;  // without: an NCCL before 2.28
  g_made.clear();
  g_teardown_log.clear();
  FailingDevice device(dq::engine::host_device());
  device.aborts_end_work = aborts_end_work;
  std::atomic<bool> abort_flag{false};
  constexpr size_t kCount = 1 << 18;
  const std::vector<float> in = small_integers(rank, kCount);
  std::vector<float> out(kCount);
  {
    Engine engine(settings, true, {comm, rank, n}, ops, &device, nullptr, true);
    engine.watch_abort(&abort_flag);
    PassReason reason;
    double worst = 0;
    const ncclResult_t r = all_reduce_small_integers(engine, in, &out, n, &reason, &worst);
    CHECK_OR(90, r == ncclSuccess && reason == PassReason::kRerouted, "rank %d: %d, reason %s",
             rank, static_cast<int>(r), dq::engine::reason_name(reason));
    CHECK_OR(91, worst < 3.0, "rank %d: off by %g", rank, worst);
    CHECK_OR(92, g_made.size() == 4, "rank %d: %zu split communicators, 4 wanted", rank,
             g_made.size());
    abort_flag = aborted;
    device.on_wait = [](const char* what) { g_teardown_log.push_back(what); };
  }
  std::string order;
  for (const std::string& e : g_teardown_log) order += e + " ";
  const auto count = [&](const char* what) {
    return std::count(g_teardown_log.begin(), g_teardown_log.end(), what);
  };
  const auto first = [&](const char* what) {
    return std::find(g_teardown_log.begin(), g_teardown_log.end(), what) - g_teardown_log.begin();
  };
  const auto last = [&](const char* what) {
    const auto it = std::find(g_teardown_log.rbegin(), g_teardown_log.rend(), what);
    return static_cast<long>(g_teardown_log.rend() - it) - 1;  // -1: none
  };
  if (with_revoke) {
    CHECK_OR(96,
             count("revoke") == 4 && count("abort") == 4 && count("destroy") == 0 &&
                 last("revoke") < first("wait") && first("wait") < first("abort"),
             "rank %d: aborted, with a revoke, the four communicators must be revoked before any "
             "wait and aborted after the rail engines' waits: %s",
             rank, order.c_str());
  } else if (!aborted) {
    CHECK_OR(93, count("destroy") == 4 && count("abort") == 0,
             "rank %d: a healthy teardown must destroy the four communicators: %s", rank,
             order.c_str());
  } else if (aborts_end_work) {
    CHECK_OR(94, count("abort") == 4 && count("destroy") == 0 && last("abort") < first("wait"),
             "rank %d: aborted, on a device whose aborts end its work, the four communicators "
             "must be aborted before any wait: %s",
             rank, order.c_str());
  } else {
    CHECK_OR(95, count("abort") == 4 && count("destroy") == 0 && first("wait") < first("abort"),
             "rank %d: aborted, on the host device, the communicators must be aborted after the "
             "rail engines' waits: %s",
             rank, order.c_str());
  }
  return 0;
}

int scenario_teardown_order(int n) {
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    join_fake_node("teardown-node", rank);
    if (const int rc = teardown_order_case(n, rank, comms[0], true, true, false)) return rc;
    if (const int rc = teardown_order_case(n, rank, comms[0], false, true, false)) return rc;
    if (const int rc = teardown_order_case(n, rank, comms[0], true, false, false)) return rc;
    if (const int rc = teardown_order_case(n, rank, comms[0], true, true, true)) return rc;
    return teardown_order_case(n, rank, comms[0], false, true, true);
  };
  return all_zero(run_ranks(n, 1, body, 120), "teardown_order") ? 0 : 1;
}

// ---- two_level_in_progress -------------------------------------------------------------------
// NCCL's non-blocking communicators, modelled over the CPU NCCL's blocking ones for every
// communicator (the caller's and the four the engine splits, which it always makes non-blocking):
// a call outside a group, and a group's end, answer ncclInProgress once their work is issued, and
// each communicator they used stays in progress for kNbPolls polls of ncclCommGetAsyncError; a
// call on a communicator still in progress is refused (ncclInvalidArgument), as NCCL refuses it.
// The host device issues NCCL calls from its stream threads, hence the lock. Each rank is its own
// process.
constexpr int kNbPolls = 2;
std::mutex g_nb_mutex;
std::map<ncclComm_t, int> g_nb_polls_left;  // guarded by g_nb_mutex
std::atomic<int> g_nb_answers{0}, g_nb_refused{0};
thread_local int t_nb_depth = 0;
thread_local std::vector<ncclComm_t> t_nb_group;  // the communicators of the open group

void nb_mark_in_progress(const std::vector<ncclComm_t>& comms) {
  std::lock_guard<std::mutex> lock(g_nb_mutex);
  for (ncclComm_t c : comms) g_nb_polls_left[c] = kNbPolls;
  g_nb_answers.fetch_add(1);
}
ncclResult_t nb_call(ncclComm_t comm, const std::function<ncclResult_t()>& call) {
  {
    std::lock_guard<std::mutex> lock(g_nb_mutex);
    if (g_nb_polls_left[comm] > 0) {
      g_nb_refused.fetch_add(1);
      return ncclInvalidArgument;
    }
  }
  const ncclResult_t r = call();
  if (r != ncclSuccess) return r;
  if (t_nb_depth > 0) {
    t_nb_group.push_back(comm);
    return ncclSuccess;
  }
  nb_mark_in_progress({comm});
  return ncclInProgress;
}
ncclResult_t nb_group_start() {
  ++t_nb_depth;
  return ncclGroupStart();
}
ncclResult_t nb_group_end() {
  const ncclResult_t r = ncclGroupEnd();
  if (--t_nb_depth > 0 || r != ncclSuccess || t_nb_group.empty()) return r;
  nb_mark_in_progress(t_nb_group);
  t_nb_group.clear();
  return ncclInProgress;
}
ncclResult_t nb_async_error(ncclComm_t comm, ncclResult_t* state) {
  {
    std::lock_guard<std::mutex> lock(g_nb_mutex);
    int& left = g_nb_polls_left[comm];
    if (left > 0) {
      --left;
      *state = ncclInProgress;
      return ncclSuccess;
    }
  }
  return ncclCommGetAsyncError(comm, state);
}
ncclResult_t nb_send(const void* b, size_t n, ncclDataType_t t, int peer, ncclComm_t c,
                     cudaStream_t s) {
  return nb_call(c, [&] { return ncclSend(b, n, t, peer, c, s); });
}
ncclResult_t nb_recv(void* b, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
  return nb_call(c, [&] { return ncclRecv(b, n, t, peer, c, s); });
}
ncclResult_t nb_all_reduce(const void* in, void* out, size_t n, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t c, cudaStream_t s) {
  return nb_call(c, [&] { return ncclAllReduce(in, out, n, t, op, c, s); });
}
ncclResult_t nb_reduce_scatter(const void* in, void* out, size_t n, ncclDataType_t t,
                               ncclRedOp_t op, ncclComm_t c, cudaStream_t s) {
  return nb_call(c, [&] { return ncclReduceScatter(in, out, n, t, op, c, s); });
}
ncclResult_t nb_all_gather(const void* in, void* out, size_t n, ncclDataType_t t, ncclComm_t c,
                           cudaStream_t s) {
  return nb_call(c, [&] { return ncclAllGather(in, out, n, t, c, s); });
}
ncclResult_t nb_reduce(const void* in, void* out, size_t n, ncclDataType_t t, ncclRedOp_t op,
                       int root, ncclComm_t c, cudaStream_t s) {
  return nb_call(c, [&] { return ncclReduce(in, out, n, t, op, root, c, s); });
}

// Two fake nodes of two ranks, every communicator non-blocking as above: an all-reduce whose
// count leaves a tail for the caller's communicator, a reduce-scatter and a reduce to rank 1, each
// compressed on the two-level schedule, near the exact sum, with every ncclInProgress answer
// polled to its end and no call refused.
int scenario_two_level_in_progress(int n) {
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_HIERARCHY", "node"},
                                      {"DYNAMIQ_MIN_BYTES", "0"},
                                      {"DYNAMIQ_TIMEOUT_MS", "20000"}});
  auto body = [&](int rank, ncclComm_t* comms) -> int {
    join_fake_node("nonblocking-node", rank);
    dq::engine::NcclOps ops = cpu_nccl_ops();
    ops.group_start = nb_group_start;
    ops.group_end = nb_group_end;
    ops.send = nb_send;
    ops.recv = nb_recv;
    ops.all_reduce = nb_all_reduce;
    ops.reduce_scatter = nb_reduce_scatter;
    ops.all_gather = nb_all_gather;
    ops.reduce = nb_reduce;
    ops.comm_get_async_error = nb_async_error;
    Engine engine(settings, true, {comms[0], rank, n}, ops, dq::engine::host_device(), nullptr,
                  true);
    constexpr size_t kRecv = (1 << 15) + 3;
    const size_t count_of[3] = {(1 << 17) + 1, kRecv * n, (1 << 17) + 1};
    const dq::engine::Collective kinds[3] = {dq::engine::Collective::kAllReduce,
                                             dq::engine::Collective::kReduceScatter,
                                             dq::engine::Collective::kReduce};
    constexpr int kRoot = 1;
    for (int k = 0; k < 3; ++k) {
      const std::vector<float> in = small_integers(rank, count_of[k]);
      const bool scatter = kinds[k] == dq::engine::Collective::kReduceScatter;
      std::vector<float> out(scatter ? kRecv : count_of[k], -1.0f);
      CallArgs args;
      args.collective = kinds[k];
      args.root = kRoot;
      args.send = in.data();
      args.recv = out.data();
      args.count = count_of[k];
      PassReason reason;
      const ncclResult_t r = engine.run(args, &reason);
      CHECK_OR(90, r == ncclSuccess && reason == PassReason::kRerouted,
               "rank %d: %s: %s, reason %d (%d ncclInProgress answers, %d calls refused)", rank,
               dq::engine::collective_name(kinds[k]), ncclGetErrorString(r),
               static_cast<int>(reason), g_nb_answers.load(), g_nb_refused.load());
      if (kinds[k] == dq::engine::Collective::kReduce && rank != kRoot) continue;
      const size_t first = scatter ? static_cast<size_t>(rank) * kRecv : 0;
      double error = 0, energy = 0;
      for (size_t i = 0; i < out.size(); ++i) {
        const double want = small_integers_sum(first + i, n);
        error += (out[i] - want) * (out[i] - want);
        energy += want * want;
      }
      // 5 bits on small integers: a vNMSE of about 0.02 (rail_overlap); garbage gives about 1.
      CHECK_OR(91, error < 0.05 * energy, "rank %d: %s: vNMSE %g", rank,
               dq::engine::collective_name(kinds[k]), error / energy);
      // The tail the shards leave (one element) is exact: the caller's communicator sums it.
      if (!scatter)
        CHECK_OR(93, out.back() == small_integers_sum(out.size() - 1, n), "rank %d: %s: tail %g",
                 rank, dq::engine::collective_name(kinds[k]), static_cast<double>(out.back()));
    }
    CHECK_OR(92, g_nb_answers.load() > 0 && g_nb_refused.load() == 0,
             "rank %d: %d ncclInProgress answers, %d calls refused", rank, g_nb_answers.load(),
             g_nb_refused.load());
    if (rank == 0)
      std::printf("two-level on non-blocking communicators: %d ncclInProgress answers settled\n",
                  g_nb_answers.load());
    return 0;
  };
  return all_zero(run_ranks(n, 1, body, 120), "two_level_in_progress") ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: engine_multirank "
                 "audit|alloc_fail|budget_scratch_fail|event_fail|blocks|block_floor|corrupt|"
                 "layout_order|collectives|"
                 "setup_fail|stalled_wait|"
                 "split_settles|rail_overlap|teardown_order|byte_counts|two_level_in_progress|"
                 "shard_alloc_fail|auto_plan_fail|enqueue_fail "
                 "NRANKS [TOPO]\n");
    return 2;
  }
  const std::string scenario = argv[1];
  const int n = std::atoi(argv[2]);
  const std::string topo = argc > 3 ? argv[3] : "auto";
  if (scenario == "audit") return scenario_audit(n, topo);
  if (scenario == "alloc_fail") return scenario_alloc_fail(n, PlanFault::kBuffers);
  if (scenario == "budget_scratch_fail") return scenario_alloc_fail(n, PlanFault::kBudgetScratch);
  if (scenario == "event_fail") return scenario_alloc_fail(n, PlanFault::kEvents);
  if (scenario == "blocks") return scenario_blocks(n);
  if (scenario == "block_floor") return scenario_block_floor(n);
  if (scenario == "corrupt") return scenario_corrupt(n);
  if (scenario == "layout_order") return scenario_layout_order(n);
  if (scenario == "collectives") return scenario_collectives(n);
  if (scenario == "setup_fail") return scenario_setup_fail(n);
  if (scenario == "not_opted_in") return scenario_not_opted_in(n);
  if (scenario == "plan_cache") return scenario_plan_cache(n);
  if (scenario == "budget") return scenario_budget(n, topo);
  if (scenario == "auto") return scenario_auto(n);
  if (scenario == "auto_target") return scenario_auto_target(n);
  if (scenario == "check") return scenario_check(n);
  if (scenario == "stalled_wait") return scenario_stalled_wait(n);
  if (scenario == "split_settles") return scenario_split_settles(n);
  if (scenario == "rail_overlap") return scenario_rail_overlap(n);
  if (scenario == "teardown_order") return scenario_teardown_order(n);
  if (scenario == "byte_counts") return scenario_byte_counts(n);
  if (scenario == "two_level_in_progress") return scenario_two_level_in_progress(n);
  if (scenario == "shard_alloc_fail") return scenario_shard_alloc_fail(n);
  if (scenario == "auto_plan_fail") return scenario_auto_plan_fail(n);
  if (scenario == "auto_plan_fail_always") return scenario_auto_plan_fail_always(n);
  if (scenario == "enqueue_fail") return scenario_enqueue_fail(n);
  if (scenario == "nccl_code_kept") return scenario_nccl_code_kept(n);
  std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
  return 2;
}
