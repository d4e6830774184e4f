// The host runs ahead of its device by a control window of compressed calls, and no further
// (DYNAMIQ_CONTROL_WINDOW, docs/ENGINE.md section 3). Usage: engine_run_ahead NRANKS. Exit 0 pass.
//
// Each rank calls the engine (host device, CPU NCCL) with a caller's stream that is one of the
// device's own ordered queues, as a GPU job's stream is: the calls return once enqueued. After a
// first call (handshake, plan), the stream is held shut by a gate queued on it, so nothing of the
// later calls can run. Then:
//   - calls 1..W return while the gate is shut: no host wait for an earlier call's control
//     all-reduce (W = the window; a one-call-late wait would block call 2 until the timeout);
//   - call W + 1 returns only after the gate opened: it waits for call 1's control all-reduce,
//     whose slot it reuses (a thread opens the gate 200 ms after call W returned);
//   - every call's output, once the stream ran, is byte for byte that of the same calls made on
//     the calling thread (each call complete before the next), and the same on every rank: what
//     a call decides depends on the count of calls, never on how far the device lags;
//   - with DYNAMIQ_BITS=auto (a target met by 3 bits) every call's budget is known when it
//     returns: 5 bits (the fixed default) for calls 0..W-1, 3 from call W on (it reads call 0's
//     prediction, a window back); the same on every rank and in the reference. Call W's new
//     budget is a new plan, whose agreement waits for the device: there the gate opens after
//     call W - 1 instead;
//   - with the sampled check (DYNAMIQ_CHECK_EVERY=2) and further calls, the checks read are the
//     same calls' as in the reference.
//   - with rank 0's stream alone held, so that the ranks lag their devices unequally, the same:
//     every decision is a function of the call count, not of the lag.
// Windows: 1 (the host never runs more than one call ahead) and the default.
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/engine_test_util.h"
#include "tests/common/rank_harness.h"

namespace {

using dq::engine::CallArgs;
using dq::engine::Device;
using dq::engine::Engine;
using dq::engine::EventHandle;
using dq::engine::PassReason;
using dq::engine::StreamHandle;

constexpr size_t kCount = 256 * 1024;  // FP32, 1 MiB a call
constexpr int kGateMs = 200;           // how long after call W the gate opens
constexpr int kGateLimitMs = 30000;    // the gate opens after this in any case

float value(int rank, int call, size_t i) {
  const double x = static_cast<double>(i);
  return static_cast<float>(std::sin(0.001 * x + rank + 0.37 * call) *
                            (1.0 + 4.0 * std::cos(0.00003 * x + call)));
}

std::vector<float> input(int rank, int call) {
  std::vector<float> in(kCount);
  for (size_t i = 0; i < kCount; ++i) in[i] = value(rank, call, i);
  return in;
}

// A gate queued on a stream: the stream's later work waits until open() (or kGateLimitMs).
struct Gate {
  std::mutex m;
  std::condition_variable cv;
  bool open = false;
  std::atomic<bool> opened{false};  // read by the calling thread without the lock
  uint32_t error = 0;               // the lane's error word
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    cv.wait_for(lock, std::chrono::milliseconds(kGateLimitMs), [&] { return open; });
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(m);
      open = true;
    }
    opened = true;
    cv.notify_all();
  }
};

struct Run {
  std::vector<std::vector<float>> out;  // each call's output
  std::vector<double> bits;             // each call's budget, read when it returned
  uint64_t checked = 0;                 // sampled checks read
  double window_wait_s = 0;             // the window-wait metric at the end
};

double latest_bits(const dq::engine::CommMetrics& metrics) {
  std::lock_guard<std::mutex> lock(metrics.budget_mutex);
  return metrics.budget.buckets.empty() ? 0.0 : metrics.budget.buckets.front().budget_bits;
}

uint64_t checks_read(const dq::engine::CommMetrics& metrics) {
  std::lock_guard<std::mutex> lock(metrics.budget_mutex);
  return metrics.budget.checked_calls + metrics.budget.checked_nonfinite;
}

int call_engine(Engine& engine, const std::vector<float>& in, std::vector<float>* out,
                cudaStream_t stream, int rank, int k) {
  CallArgs args = dq::test::call_of(in.data(), out->data(), kCount);
  args.stream = stream;
  PassReason reason;
  const ncclResult_t r = engine.run(args, &reason);
  CHECK_OR(10, r == ncclSuccess && reason == PassReason::kRerouted,
           "rank %d call %d: %d, %s (not compressed)", rank, k, static_cast<int>(r),
           dq::engine::reason_name(reason));
  return 0;
}

// The caller's stream and the gate that holds it, torn down before the engine whatever happens:
// the stream's queued waits refer to the engine's events, and its gate to this object.
struct HeldStream {
  Device* device;
  StreamHandle stream = nullptr;
  EventHandle drained = nullptr;
  Gate gate;
  explicit HeldStream(Device* d) : device(d) {}
  ~HeldStream() {
    gate.release();
    if (stream != nullptr) device->destroy_stream(stream);  // waits for its work
    if (drained != nullptr) device->destroy_event(drained);
  }
  bool drain() {
    return device->record(drained, stream) == dq::Status::kOk &&
           device->synchronize(drained) == dq::Status::kOk;
  }
};

// Calls 0..W+1 on a stream the gate holds shut from call 1 on, then `tail` calls more. The gate
// opens kGateMs after call `opens_after` returned; calls 1..opens_after must return while it is
// shut, and call opens_after + 1 only once it opened. `held` false: no gate on this rank's stream
// (its calls wait only for what its peers' held streams keep back).
int gated_run(const dq::config::Settings& settings, int n, int rank, ncclComm_t comm,
              int opens_after, int tail, bool held_here, Run* run) {
  Device* device = dq::engine::host_device();
  auto metrics = std::make_shared<dq::engine::CommMetrics>();
  Engine engine(settings, true, {comm, rank, n}, dq::test::cpu_nccl_ops(), device, metrics, true);
  const int window = static_cast<int>(settings.control_window);
  HeldStream held(device);
  CHECK_OR(20, device->create_stream(&held.stream) == dq::Status::kOk, "rank %d: no stream", rank);
  CHECK_OR(21, device->create_event(&held.drained) == dq::Status::kOk, "rank %d: no event", rank);
  const auto cuda_stream = static_cast<cudaStream_t>(held.stream);
  const int calls = window + 2 + tail;
  run->out.assign(calls, std::vector<float>(kCount));
  std::vector<std::vector<float>> inputs;
  for (int k = 0; k < calls; ++k) inputs.push_back(input(rank, k));
  if (const int rc = call_engine(engine, inputs[0], &run->out[0], cuda_stream, rank, 0); rc != 0)
    return rc;
  run->bits.push_back(latest_bits(*metrics));
  CHECK_OR(22, held.drain(), "rank %d: the first call did not drain", rank);

  Gate& gate = held.gate;
  if (!held_here) gate.release();  // queued open: the stream never waits on it
  CHECK_OR(23,
           device->nccl(dq::engine::Lane{held.stream, &gate.error},
                        [&gate] {
                          gate.wait();
                          return ncclSuccess;
                        }) == dq::Status::kOk,
           "rank %d: the gate was not queued", rank);
  std::mutex m;
  std::condition_variable cv;
  bool trigger = false;
  std::thread opener([&] {
    {
      std::unique_lock<std::mutex> lock(m);
      cv.wait_for(lock, std::chrono::milliseconds(kGateLimitMs), [&] { return trigger; });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(kGateMs));
    gate.release();
  });
  auto pull_trigger = [&] {
    std::lock_guard<std::mutex> lock(m);
    trigger = true;
    cv.notify_all();
  };
  int rc = 0;
  for (int k = 1; k <= window + 1 && rc == 0; ++k) {
    if (k == opens_after + 1) pull_trigger();
    rc = call_engine(engine, inputs[k], &run->out[k], cuda_stream, rank, k);
    run->bits.push_back(latest_bits(*metrics));
    if (!held_here) continue;
    if (rc == 0 && k <= opens_after && gate.opened.load()) {
      std::fprintf(stderr, "FAIL: rank %d: call %d (window %d) waited for the gate\n", rank, k,
                   window);
      rc = 24;
    }
    if (rc == 0 && k == opens_after + 1 && !gate.opened.load()) {
      std::fprintf(stderr,
                   "FAIL: rank %d: call %d (window %d) returned with the gate shut: it did not "
                   "wait for the device\n",
                   rank, k, window);
      rc = 25;
    }
  }
  pull_trigger();  // the opener never waits past a failure
  opener.join();
  if (rc != 0) return rc;
  for (int k = window + 2; k < calls; ++k) {
    if (const int r = call_engine(engine, inputs[k], &run->out[k], cuda_stream, rank, k); r != 0)
      return r;
    run->bits.push_back(latest_bits(*metrics));
  }
  CHECK_OR(26, held.drain() && engine.async_error() == ncclSuccess,
           "rank %d: the calls did not complete cleanly", rank);
  run->checked = checks_read(*metrics);
  run->window_wait_s = metrics->window_wait_nanoseconds.load() * 1e-9;
  return 0;
}

// The same calls on the calling thread: each complete when it returns.
int reference_run(const dq::config::Settings& settings, int n, int rank, ncclComm_t comm, int calls,
                  Run* run) {
  auto metrics = std::make_shared<dq::engine::CommMetrics>();
  Engine engine(settings, true, {comm, rank, n}, dq::test::cpu_nccl_ops(),
                dq::engine::host_device(), metrics, true);
  run->out.assign(calls, std::vector<float>(kCount));
  for (int k = 0; k < calls; ++k) {
    if (const int rc = call_engine(engine, input(rank, k), &run->out[k], nullptr, rank, k); rc != 0)
      return rc;
    run->bits.push_back(latest_bits(*metrics));
  }
  run->checked = checks_read(*metrics);
  return 0;
}

struct Case {
  const char* label;
  std::map<std::string, std::string> env;
  bool auto_bits;
  int tail;                 // calls after the gated ones
  bool rank0_only = false;  // only rank 0's stream held: the ranks lag the device unequally
};

// The calls that return with the gate shut: 1..W, as the window allows; with auto, 1..W-1, since
// call W takes a new budget (3 bits), and agreeing a new plan is a host wait for the device (the
// plan's MAX all-reduce queues behind the earlier calls' work on the comm stream).
int opens_after(const Case& c, int window) {
  return c.auto_bits ? window - 1 : window;
}

int one_case(const Case& c, int n, int rank, ncclComm_t comm) {
  std::map<std::string, std::string> env = c.env;
  env.emplace("DYNAMIQ_ENABLE", "1");
  env.emplace("DYNAMIQ_TOPO", "ring");
  env.emplace("DYNAMIQ_TIMEOUT_MS", "20000");
  const auto settings = dq::test::settings_for(env);
  const int window = static_cast<int>(settings.control_window);
  Run gated, reference;
  const int shut = opens_after(c, window);
  const bool held = !c.rank0_only || rank == 0;
  if (const int rc = gated_run(settings, n, rank, comm, shut, c.tail, held, &gated); rc != 0)
    return rc;
  const int calls = static_cast<int>(gated.out.size());
  if (const int rc = reference_run(settings, n, rank, comm, calls, &reference); rc != 0) return rc;
  for (int k = 0; k < calls; ++k) {
    CHECK_OR(30, std::memcmp(gated.out[k].data(), reference.out[k].data(), kCount * 4) == 0,
             "rank %d, %s: call %d's output differs from the same call made on the calling thread",
             rank, c.label, k);
    CHECK_OR(31, dq::test::same_bytes_everywhere(comm, gated.out[k].data(), kCount * 4),
             "rank %d, %s: call %d's output differs between ranks", rank, c.label, k);
    CHECK_OR(32, gated.bits[k] == reference.bits[k],
             "rank %d, %s: call %d: %g bits ahead of the device, %g on the calling thread", rank,
             c.label, k, gated.bits[k], reference.bits[k]);
    if (c.auto_bits) {
      const double want = k < window ? 5.0 : 3.0;
      CHECK_OR(33, gated.bits[k] == want,
               "rank %d, %s: call %d took %g bits, not %g (a prediction is read a window of %d "
               "calls after its call)",
               rank, c.label, k, gated.bits[k], want, window);
    }
  }
  CHECK_OR(34, dq::test::same_bytes_everywhere(comm, gated.bits.data(), gated.bits.size() * 8),
           "rank %d, %s: the ranks' budgets differ", rank, c.label);
  CHECK_OR(35, gated.checked == reference.checked,
           "rank %d, %s: %llu checks read ahead of the device, %llu on the calling thread", rank,
           c.label, static_cast<unsigned long long>(gated.checked),
           static_cast<unsigned long long>(reference.checked));
  // The call after the window waited for the gate (kGateMs after it was issued): the metric
  // shows it. With auto that call waited in its new plan's agreement instead.
  CHECK_OR(37, c.auto_bits || !held || gated.window_wait_s >= kGateMs * 0.5e-3,
           "rank %d, %s: window wait %.3f s, but call %d waited for the gate (%d ms)", rank,
           c.label, gated.window_wait_s, shut + 1, kGateMs);
  if (c.env.count("DYNAMIQ_CHECK_EVERY"))
    CHECK_OR(36, gated.checked > 0, "rank %d, %s: no sampled check was read", rank, c.label);
  if (rank == 0)
    std::printf(
        "%s (window %d): calls 1..%d returned with the stream held, call %d waited for it; %d "
        "calls byte-identical to the calling thread's and across ranks; %llu checks read; "
        "window wait %.3f s\n",
        c.label, window, shut, shut + 1, calls, static_cast<unsigned long long>(gated.checked),
        gated.window_wait_s);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 4;
  const std::string window = std::to_string(dq::config::Settings{}.control_window);
  const Case cases[] = {
      {"window 1", {{"DYNAMIQ_CONTROL_WINDOW", "1"}}, false, 0},
      {"default window, sampled check", {{"DYNAMIQ_CHECK_EVERY", "2"}}, false, 12},
      {"default window, auto", {{"DYNAMIQ_BITS", "auto"}, {"DYNAMIQ_TARGET", "vnmse:1"}}, true, 2},
      {"default window, auto, rank 0 alone held",
       {{"DYNAMIQ_BITS", "auto"}, {"DYNAMIQ_TARGET", "vnmse:1"}, {"DYNAMIQ_CHECK_EVERY", "3"}},
       true,
       12,
       true},
  };
  dq::test::RankOptions opt;
  opt.timeout_s = 240;
  const auto exits = dq::test::run_ranks<ncclUniqueId>(
      n, 1, ncclGetUniqueId, opt, [&](int r, const ncclUniqueId* ids) {
        ncclComm_t comm = nullptr;
        if (ncclCommInitRank(&comm, n, ids[0], r) != ncclSuccess) return 97;
        for (const Case& c : cases)
          if (const int rc = one_case(c, n, r, comm); rc != 0) return rc;
        return 0;
      });
  int failed = 0;
  for (size_t r = 0; r < exits.size(); ++r)
    if (exits[r].code() != 0) {
      std::fprintf(stderr, "FAIL: rank %zu exited with %d\n", r, exits[r].code());
      failed = 1;
    }
  if (failed == 0)
    std::printf("engine_run_ahead %d ranks: passed (default window %s)\n", n, window.c_str());
  return failed;
}
