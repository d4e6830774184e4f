// Graph capture after an eager warm-up, on the emulated CUDA device (its capture model:
// shim/engine/cuda_device.h): PyTorch's pattern. Each rank runs two compressed calls eagerly on
// a stream of its own, then the same call while that stream is being captured, then two more
// eagerly. The captured call must pass through (PassReason::kCapturing) without the engine
// touching the device in any way CUDA refuses during a capture (an event query for the previous
// call's control words was one): the capture stays intact. Its pass-through, run as the graph's
// replay would run it (the NCCL all-reduce alone), gives the exact sum; and the communicator is
// healthy after: the eager calls after it are compressed, with no error, and every rank holds
// the same result.
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/nccl_api.h"
#include "config/settings.h"
#include "shim/engine/cuda_device.h"
#include "shim/engine/engine.h"
#include "shim/engine/metrics.h"
#include "tests/common/check.h"
#include "tests/common/engine_test_util.h"
#include "tests/common/rank_harness.h"

// Returns `code`, the communicators destroyed when it is 0 (engine_emulated_cuda.cc).
int destroy_if_passed(int code, ncclComm_t* comms, int n_comms);

namespace {

using dq::engine::CallArgs;
using dq::engine::Device;
using dq::engine::Engine;
using dq::engine::PassReason;

// Small integers: every order of summation gives the exact sum, so a pass-through is exact.
std::vector<float> integer_input(int rank, int k, size_t count) {
  std::vector<float> in(count);
  for (size_t i = 0; i < count; ++i)
    in[i] = static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(k)) % 13) - 6 + rank);
  return in;
}

float exact_sum(int n, int k, size_t i) {
  float s = 0.0f;
  for (int r = 0; r < n; ++r) s += static_cast<float>(static_cast<int>((i * 7 + k) % 13) - 6 + r);
  return s;
}

// Runs one eager call on `stream` and waits for it; 0 or an exit code.
int eager_call(Engine& eng, Device* d, dq::engine::StreamHandle stream,
               dq::engine::EventHandle done, const std::vector<float>& in, std::vector<float>* out,
               int rank, int k) {
  CallArgs call = dq::test::call_of(in.data(), out->data(), in.size());
  call.stream = static_cast<cudaStream_t>(stream);
  PassReason reason = PassReason::kDisabled;
  const ncclResult_t r = eng.run(call, &reason);
  CHECK_OR(10, r == ncclSuccess && reason == PassReason::kRerouted,
           "rank %d: eager call %d: NCCL result %d, reason %s", rank, k, static_cast<int>(r),
           dq::engine::reason_name(reason));
  CHECK_OR(11,
           d->record(done, stream) == dq::Status::kOk && d->synchronize(done) == dq::Status::kOk,
           "rank %d: eager call %d: waiting for the stream", rank, k);
  CHECK_OR(12, eng.async_error() == ncclSuccess, "rank %d: eager call %d: asynchronous error", rank,
           k);
  return 0;
}

int capture_body(int n, int rank, ncclComm_t comm) {
  constexpr size_t kCount = 64 * 1024 + 300;
  const auto settings = dq::test::settings_for(
      {{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_MIN_BYTES", "0"}, {"DYNAMIQ_TIMEOUT_MS", "20000"}});
  const std::unique_ptr<Device> cuda = dq::engine::make_emulated_cuda_device();
  Engine eng(settings, true, {comm, rank, n}, dq::test::cpu_nccl_ops(), cuda.get(),
             std::make_shared<dq::engine::CommMetrics>(), true);
  dq::engine::StreamHandle stream = nullptr;
  dq::engine::EventHandle done = nullptr;
  CHECK_OR(2,
           cuda->create_stream(&stream) == dq::Status::kOk &&
               cuda->create_event(&done) == dq::Status::kOk,
           "rank %d: setup", rank);
  std::vector<float> out(kCount);
  for (int k = 0; k < 2; ++k)  // the warm-up: its control all-reduces stay unread
    if (const int rc = eager_call(eng, cuda.get(), stream, done, integer_input(rank, k, kCount),
                                  &out, rank, k))
      return rc;

  // The capture: the engine is asked first, as the interceptor does, then NCCL's own call.
  const std::vector<float> in = integer_input(rank, 2, kCount);
  CHECK_OR(3, dq::engine::emulated_cuda_begin_capture(cuda.get(), stream) == dq::Status::kOk,
           "rank %d: begin capture", rank);
  CallArgs call = dq::test::call_of(in.data(), out.data(), kCount);
  call.stream = static_cast<cudaStream_t>(stream);
  PassReason reason = PassReason::kRerouted;
  const ncclResult_t r = eng.run(call, &reason);
  std::string why;
  const dq::Status intact = dq::engine::emulated_cuda_end_capture(cuda.get(), &why);
  CHECK_OR(4, r == ncclSuccess && reason == PassReason::kCapturing,
           "rank %d: captured call: NCCL result %d, reason %s (expected capturing)", rank,
           static_cast<int>(r), dq::engine::reason_name(reason));
  CHECK_OR(5, intact == dq::Status::kOk, "rank %d: the engine invalidated the capture: %s", rank,
           why.c_str());
  // The graph's replay: the pass-through all-reduce, exact.
  CHECK_OR(6,
           ncclAllReduce(in.data(), out.data(), kCount, ncclFloat32, ncclSum, comm, nullptr) ==
               ncclSuccess,
           "rank %d: the replayed all-reduce", rank);
  for (size_t i = 0; i < kCount; ++i)
    CHECK_OR(7, out[i] == exact_sum(n, 2, i), "rank %d: replay: element %zu is %g, not %g", rank, i,
             static_cast<double>(out[i]), static_cast<double>(exact_sum(n, 2, i)));

  // Healthy after: compressed, no error, one result on every rank, near the exact sum (5 bits on
  // these values: vNMSE about 0.015; a broken call gives about 1).
  for (int k = 3; k < 5; ++k) {
    if (const int rc = eager_call(eng, cuda.get(), stream, done, integer_input(rank, k, kCount),
                                  &out, rank, k))
      return rc;
    CHECK_OR(8, dq::test::same_bytes_everywhere(comm, out.data(), kCount * 4),
             "rank %d: call %d: results differ across ranks", rank, k);
    double err = 0, norm = 0;
    for (size_t i = 0; i < kCount; ++i) {
      const double x = exact_sum(n, k, i);
      err += (out[i] - x) * (out[i] - x);
      norm += x * x;
    }
    CHECK_OR(9, err <= 0.05 * norm, "rank %d: call %d: vNMSE %g", rank, k, err / norm);
  }
  cuda->destroy_event(done);
  cuda->destroy_stream(stream);
  return 0;
}

// Rank 1's device cannot be set up (its streams fail after the caller's own): its engine keeps
// the device as a standby for the handshake it owes its peers. Captured calls, inside a group and
// outside one, must pass through on every rank alike (kCapturing), the standby rank's included:
// that rank neither holds a grouped call back (its peers send theirs into the group) nor runs the
// handshake on the capturing stream (its peers skip it under capture: it would wait for them, and
// CUDA refuses the handshake's allocation during a capture). After the capture the handshake runs
// outside it, and every call passes through exactly.
int standby_capture_body(int n, int rank, ncclComm_t comm) {
  constexpr size_t kCount = 16 * 1024 + 5;
  const auto settings = dq::test::settings_for(
      {{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_MIN_BYTES", "0"}, {"DYNAMIQ_TIMEOUT_MS", "20000"}});
  dq::engine::EmulatedCudaFault fault;
  if (rank == 1) fault.streams_before_failure = 1;  // the caller's stream below, then none
  const std::unique_ptr<Device> cuda = dq::engine::make_emulated_cuda_device(nullptr, fault);
  dq::engine::StreamHandle stream = nullptr;
  CHECK_OR(2, cuda->create_stream(&stream) == dq::Status::kOk, "rank %d: the caller's stream",
           rank);
  Engine eng(settings, true, {comm, rank, n}, dq::test::cpu_nccl_ops(), cuda.get(),
             std::make_shared<dq::engine::CommMetrics>(), true);
  std::vector<float> out(kCount);
  const std::vector<float> in = integer_input(rank, 0, kCount);
  CHECK_OR(3, dq::engine::emulated_cuda_begin_capture(cuda.get(), stream) == dq::Status::kOk,
           "rank %d: begin capture", rank);
  for (const bool in_group : {true, false}) {
    CallArgs call = dq::test::call_of(in.data(), out.data(), kCount);
    call.stream = static_cast<cudaStream_t>(stream);
    call.in_group = in_group;
    PassReason reason = PassReason::kRerouted;
    const ncclResult_t r = eng.run(call, &reason);
    CHECK_OR(4, r == ncclSuccess && reason == PassReason::kCapturing,
             "rank %d: captured call %s a group: NCCL result %d, reason %s (capturing expected on "
             "every rank)",
             rank, in_group ? "inside" : "outside", static_cast<int>(r),
             dq::engine::reason_name(reason));
  }
  std::string why;
  CHECK_OR(5, dq::engine::emulated_cuda_end_capture(cuda.get(), &why) == dq::Status::kOk,
           "rank %d: the engine invalidated the capture: %s", rank, why.c_str());
  // After the capture: the handshake (rank 1's stand-in), then each call passes through exactly.
  for (int k = 1; k < 3; ++k) {
    const std::vector<float> eager = integer_input(rank, k, kCount);
    CallArgs call = dq::test::call_of(eager.data(), out.data(), kCount);
    call.stream = static_cast<cudaStream_t>(stream);
    PassReason reason = PassReason::kRerouted;
    const ncclResult_t r = eng.run(call, &reason);
    CHECK_OR(6, r == ncclSuccess && reason != PassReason::kRerouted,
             "rank %d: eager call %d: NCCL result %d, reason %s (a pass-through expected)", rank, k,
             static_cast<int>(r), dq::engine::reason_name(reason));
    CHECK_OR(7,
             ncclAllReduce(eager.data(), out.data(), kCount, ncclFloat32, ncclSum, comm, nullptr) ==
                 ncclSuccess,
             "rank %d: eager call %d: the pass-through", rank, k);
    for (size_t i = 0; i < kCount; ++i)
      CHECK_OR(8, out[i] == exact_sum(n, k, i), "rank %d: call %d: element %zu is %g, not %g", rank,
               k, i, static_cast<double>(out[i]), static_cast<double>(exact_sum(n, k, i)));
  }
  cuda->destroy_stream(stream);
  return 0;
}

// Rank 1's device cannot be set up, and NCCL reports its stand-in handshake (the MAX all-reduce
// of its control words on the standby's memory) failed after issuing it, as a non-blocking
// communicator's call that never settled does. Its peers' handshakes complete with it and they
// pass through from then on. Rank 1 must not run the stand-in again at its next call: that
// all-reduce would meet its peers' next collective instead (another size and type: a hang or a
// corrupted sum). Its failure is sticky, as every other failure of the handshake.
std::atomic<int> g_standby_all_reduces{0};
ncclResult_t failing_all_reduce(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                                ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  const ncclResult_t r = ncclAllReduce(send, recv, count, dtype, op, comm, stream);
  return ++g_standby_all_reduces == 1 && r == ncclSuccess ? ncclSystemError : r;
}

int standby_failure_body(int n, int rank, ncclComm_t comm) {
  constexpr size_t kCount = 16 * 1024 + 5;
  const auto settings = dq::test::settings_for(
      {{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_MIN_BYTES", "0"}, {"DYNAMIQ_TIMEOUT_MS", "20000"}});
  dq::engine::EmulatedCudaFault fault;
  dq::engine::NcclOps ops = dq::test::cpu_nccl_ops();
  if (rank == 1) {
    fault.streams_before_failure = 1;  // the caller's stream below, then none
    ops.all_reduce = failing_all_reduce;
  }
  const std::unique_ptr<Device> cuda = dq::engine::make_emulated_cuda_device(nullptr, fault);
  dq::engine::StreamHandle stream = nullptr;
  CHECK_OR(2, cuda->create_stream(&stream) == dq::Status::kOk, "rank %d: the caller's stream",
           rank);
  Engine eng(settings, true, {comm, rank, n}, ops, cuda.get(),
             std::make_shared<dq::engine::CommMetrics>(), true);
  std::vector<float> out(kCount);
  const std::vector<float> in = integer_input(rank, 0, kCount);
  for (int k = 0; k < (rank == 1 ? 2 : 1); ++k) {
    CallArgs call = dq::test::call_of(in.data(), out.data(), kCount);
    call.stream = static_cast<cudaStream_t>(stream);
    PassReason reason = PassReason::kRerouted;
    const ncclResult_t r = eng.run(call, &reason);
    if (rank == 1) {
      CHECK_OR(3, r != ncclSuccess, "rank 1: call %d succeeded after its handshake failed", k);
      CHECK_OR(4, g_standby_all_reduces.load() == 1,
               "rank 1: call %d: %d stand-in handshakes issued (1 expected: a second meets its "
               "peers' next collective)",
               k, g_standby_all_reduces.load());
    } else {
      CHECK_OR(5, r == ncclSuccess && reason != PassReason::kRerouted,
               "rank %d: NCCL result %d, reason %s (a pass-through expected)", rank,
               static_cast<int>(r), dq::engine::reason_name(reason));
    }
  }
  cuda->destroy_stream(stream);
  return 0;
}

// A non-blocking communicator, modelled over the CPU NCCL: every group end and every all-reduce
// outside a group answers ncclInProgress (the operation was issued, as the CPU NCCL's return
// says), and ncclCommGetAsyncError answers ncclInProgress for the next kPolls polls, then
// ncclSuccess. The engine must take that as NCCL documents it: poll, then go on.
constexpr int kPolls = 3;
thread_local int t_group_depth = 0;
std::atomic<int> g_polls_left{0}, g_in_progress{0}, g_polled{0};

ncclResult_t in_progress(ncclResult_t r) {
  if (r != ncclSuccess) return r;
  g_polls_left.store(kPolls);
  g_in_progress.fetch_add(1);
  return ncclInProgress;
}
ncclResult_t nb_group_start() {
  ++t_group_depth;
  return ncclGroupStart();
}
ncclResult_t nb_group_end() {
  --t_group_depth;
  return in_progress(ncclGroupEnd());
}
ncclResult_t nb_all_reduce(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t c, cudaStream_t st) {
  const ncclResult_t res = ncclAllReduce(s, r, n, t, op, c, st);
  return t_group_depth > 0 ? res : in_progress(res);
}
ncclResult_t nb_async_error(ncclComm_t, ncclResult_t* state) {
  g_polled.fetch_add(1);
  *state = g_polls_left.fetch_sub(1) > 0 ? ncclInProgress : ncclSuccess;
  return ncclSuccess;
}

int in_progress_body(int n, int rank, ncclComm_t comm) {
  constexpr size_t kCount = 32 * 1024 + 17;
  const auto settings = dq::test::settings_for(
      {{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_MIN_BYTES", "0"}, {"DYNAMIQ_TIMEOUT_MS", "20000"}});
  dq::engine::NcclOps ops = dq::test::cpu_nccl_ops();
  ops.group_start = nb_group_start;
  ops.group_end = nb_group_end;
  ops.all_reduce = nb_all_reduce;
  ops.comm_get_async_error = nb_async_error;
  const std::unique_ptr<Device> cuda = dq::engine::make_emulated_cuda_device();
  Engine eng(settings, true, {comm, rank, n}, ops, cuda.get(),
             std::make_shared<dq::engine::CommMetrics>(), true);
  dq::engine::StreamHandle stream = nullptr;
  dq::engine::EventHandle done = nullptr;
  CHECK_OR(2,
           cuda->create_stream(&stream) == dq::Status::kOk &&
               cuda->create_event(&done) == dq::Status::kOk,
           "rank %d: setup", rank);
  std::vector<float> out(kCount);
  for (int k = 0; k < 3; ++k) {
    if (const int rc = eager_call(eng, cuda.get(), stream, done, integer_input(rank, k, kCount),
                                  &out, rank, k))
      return rc;
    CHECK_OR(8, dq::test::same_bytes_everywhere(comm, out.data(), kCount * 4),
             "rank %d: call %d: results differ across ranks", rank, k);
  }
  CHECK_OR(13, g_in_progress.load() > 0 && g_polled.load() >= (kPolls + 1) * g_in_progress.load(),
           "rank %d: %d answers ncclInProgress, %d polls", rank, g_in_progress.load(),
           g_polled.load());
  cuda->destroy_event(done);
  cuda->destroy_stream(stream);
  return 0;
}

int run_check(int n, const char* what, int (*body)(int, int, ncclComm_t)) {
  dq::test::RankOptions opt;
  opt.timeout_s = 120;
  const auto exits = dq::test::run_ranks<ncclUniqueId>(
      n, 1, ncclGetUniqueId, opt, [&](int r, const ncclUniqueId* ids) {
        ncclComm_t comm;
        if (ncclCommInitRank(&comm, n, ids[0], r) != ncclSuccess) return 97;
        return destroy_if_passed(body(n, r, comm), &comm, 1);
      });
  for (size_t r = 0; r < exits.size(); ++r)
    if (exits[r].code() != 0) {
      std::fprintf(stderr, "FAIL: %s: rank %zu exited with %d\n", what, r, exits[r].code());
      return 1;
    }
  return 0;
}

}  // namespace

// engine_emulated_cuda in_progress NRANKS: compressed calls over a non-blocking communicator's
// ncclInProgress answers (above). Exit 0 pass.
int in_progress_check(int n) {
  if (run_check(n, "ncclInProgress", in_progress_body) != 0) return 1;
  std::printf(
      "non-blocking communicator, %d ranks: ncclInProgress answers polled to completion; calls "
      "compressed, identical on every rank\n",
      n);
  return 0;
}

// engine_emulated_cuda standby_capture NRANKS: captured calls with rank 1's device not set up
// (standby_capture_body). Exit 0 pass.
int standby_capture_check(int n) {
  if (run_check(n, "standby capture", standby_capture_body) != 0) return 1;
  std::printf(
      "capture with rank 1's device not set up, %d ranks: every rank passed the captured calls "
      "through, in a group and outside, the capture intact; the handshake after it, the calls "
      "exact\n",
      n);
  return 0;
}

// engine_emulated_cuda standby_failure NRANKS: rank 1's stand-in handshake reported failed
// (standby_failure_body). Exit 0 pass.
int standby_failure_check(int n) {
  if (run_check(n, "standby failure", standby_failure_body) != 0) return 1;
  std::printf(
      "rank 1's device not set up and its stand-in handshake reported failed, %d ranks: its peers "
      "passed through, rank 1 failed its next call without a second stand-in\n",
      n);
  return 0;
}

// engine_emulated_cuda capture NRANKS: the sequence above on NRANKS ranks. Exit 0 pass.
int capture_check(int n) {
  if (run_check(n, "capture", capture_body) != 0) return 1;
  std::printf(
      "capture after warm-up, %d ranks: the captured call passed through exactly with the "
      "capture intact; the calls after it compressed, healthy, identical on every rank\n",
      n);
  return 0;
}
