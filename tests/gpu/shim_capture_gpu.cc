// CUDA graph capture through the preloaded shim on a real device with NVIDIA's NCCL, 2 ranks (two
// fake hosts; tests/gpu/two_ranks.h), as PyTorch does it: an eager warm-up call (compressed), then
// an all-reduce captured on a side stream in global capture mode, replayed twice with new inputs,
// then an eager call again. Each rank checks:
//  - the warm-up is compressed (the shim's counters) with its vNMSE against the exact sum bounded;
//  - under capture the call returns success, leaves the capture active (a refused query or
//    synchronisation would have invalidated it), ends into a graph and is not compressed (the
//    shim's counters: passed through, or not counted);
//  - each replay is NCCL's exact sum of that replay's inputs (small integers: exact in FP32);
//  - the communicator is healthy afterwards: no asynchronous error, and the next eager call is
//    compressed again with a bounded vNMSE.
// The parent checks both ranks passed and hold the same bytes after the last call.
// Environment (tests/gpu/meson.build): LD_PRELOAD=libdynamiq.so, DYNAMIQ_ENABLE=1,
// DYNAMIQ_MIN_BYTES below the call's size. Exit 77 (skipped) without NCCL or a CUDA device.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/fnv1a.h"
#include "tests/gpu/two_ranks.h"

namespace {

using namespace dq::gputest;

constexpr size_t kCount = size_t{1} << 20;  // floats: 4 MiB, above the test's DYNAMIQ_MIN_BYTES
// DynamiQ at 5 bits on these values: far below (docs/results/accuracy.md); a lost chunk or a wrong
// byte order is far above.
constexpr double kMaxVnmse = 1e-3;

// Rank r's input of round k: small integers, so every sum is exact in FP32.
float input(int rank, int round, size_t i) {
  return static_cast<float>((rank + 1) * (round + 1)) + static_cast<float>(i % 7);
}

struct Rank {
  int rank = 0;
  Nccl nccl;
  void* comm = nullptr;
  cudaStream_t stream = nullptr;
  float *send = nullptr, *recv = nullptr;
  std::vector<float> host;
  unsigned long long passed_in_capture = 0;  // how the shim counted the captured call
};

#define RANK_CHECK(cond, code, ...) DQ_RANK_CHECK(r.rank, cond, code, __VA_ARGS__)

int fill(Rank& r, int round) {
  for (size_t i = 0; i < kCount; ++i) r.host[i] = input(r.rank, round, i);
  RANK_CHECK(cudaMemcpyAsync(r.send, r.host.data(), kCount * 4, cudaMemcpyHostToDevice, r.stream) ==
                     cudaSuccess &&
                 cudaStreamSynchronize(r.stream) == cudaSuccess,
             30, "the input copy of round %d", round);
  return 0;
}

// The result of round k against the exact sum: its vNMSE, or -1 when an element is not finite.
double fetch_vnmse(Rank& r, int round, bool* exact) {
  if (cudaMemcpyAsync(r.host.data(), r.recv, kCount * 4, cudaMemcpyDeviceToHost, r.stream) !=
          cudaSuccess ||
      cudaStreamSynchronize(r.stream) != cudaSuccess)
    return -1;
  double err = 0, norm = 0;
  *exact = true;
  for (size_t i = 0; i < kCount; ++i) {
    const double want = static_cast<double>(input(0, round, i)) + input(1, round, i);
    if (!std::isfinite(r.host[i])) return -1;
    if (r.host[i] != want) *exact = false;
    err += (r.host[i] - want) * (r.host[i] - want);
    norm += want * want;
  }
  return err / norm;
}

// The shim's counters must read (rerouted, passed).
int expect_counters(Rank& r, unsigned long long rerouted, unsigned long long passed,
                    const char* when) {
  unsigned long long got_r = 0, got_p = 0;
  RANK_CHECK(r.nccl.counters(r.comm, &got_r, &got_p) == 0, 40, "dynamiqCommCounters %s", when);
  std::printf("rank %d: %s: %llu compressed, %llu passed through\n", r.rank, when, got_r, got_p);
  RANK_CHECK(got_r == rerouted && got_p == passed, 41,
             "%s: expected %llu compressed and %llu passed through", when, rerouted, passed);
  return 0;
}

int eager_compressed(Rank& r, int round, unsigned long long rerouted, unsigned long long passed) {
  if (int rc = fill(r, round)) return rc;
  RANK_CHECK(r.nccl.all_reduce(r.send, r.recv, kCount, kNcclFloat32, kNcclSum, r.comm, r.stream) ==
                 kNcclSuccess,
             50, "eager all-reduce of round %d", round);
  bool exact = false;
  const double v = fetch_vnmse(r, round, &exact);
  std::printf("rank %d: eager call of round %d: vNMSE %.3e\n", r.rank, round, v);
  RANK_CHECK(v >= 0 && v <= kMaxVnmse, 51, "round %d: vNMSE %.3e (bound %.0e)", round, v,
             kMaxVnmse);
  return expect_counters(r, rerouted, passed, "after the eager call");
}

// The capture (global mode, as torch.cuda.graph), then two replays with new inputs.
int capture_and_replay(Rank& r) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  RANK_CHECK(cudaStreamBeginCapture(r.stream, cudaStreamCaptureModeGlobal) == cudaSuccess, 60,
             "cudaStreamBeginCapture");
  const int rc =
      r.nccl.all_reduce(r.send, r.recv, kCount, kNcclFloat32, kNcclSum, r.comm, r.stream);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t query = cudaStreamIsCapturing(r.stream, &status);
  const cudaError_t end = cudaStreamEndCapture(r.stream, &graph);
  std::printf("rank %d: captured all-reduce returned %d; capture status %d (%s); end: %s\n", r.rank,
              rc, static_cast<int>(status), cudaGetErrorString(query), cudaGetErrorString(end));
  RANK_CHECK(rc == kNcclSuccess, 61, "the all-reduce under capture returned %d", rc);
  RANK_CHECK(query == cudaSuccess && status == cudaStreamCaptureStatusActive, 62,
             "the capture is no longer active after the all-reduce (invalidated)");
  RANK_CHECK(end == cudaSuccess && graph != nullptr, 63, "cudaStreamEndCapture: %s",
             cudaGetErrorString(end));
  RANK_CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess, 64, "cudaGraphInstantiate");
  // Not compressed; counted as passed through, or (a shim that hands captured calls to NCCL
  // before its engine sees them) not counted at all.
  unsigned long long got_r = 0, got_p = 0;
  RANK_CHECK(r.nccl.counters(r.comm, &got_r, &got_p) == 0, 40, "dynamiqCommCounters");
  RANK_CHECK(got_r == 1 && got_p <= 1, 41,
             "after the capture: %llu compressed, %llu passed through (expected 1, 0 or 1)", got_r,
             got_p);
  r.passed_in_capture = got_p;
  for (int round = 1; round <= 2; ++round) {
    if (int c = fill(r, round)) return c;
    RANK_CHECK(cudaGraphLaunch(exec, r.stream) == cudaSuccess, 65, "cudaGraphLaunch %d", round);
    bool exact = false;
    const double v = fetch_vnmse(r, round, &exact);
    std::printf("rank %d: replay %d: %s (vNMSE %.3e)\n", r.rank, round,
                exact ? "exact" : "NOT exact", v);
    RANK_CHECK(exact, 66, "replay %d is not NCCL's exact sum", round);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return expect_counters(r, 1, r.passed_in_capture, "after the replays");
}

int healthy(Rank& r, const char* when) {
  int state = -1;
  RANK_CHECK(r.nccl.get_async_error(r.comm, &state) == kNcclSuccess && state == kNcclSuccess, 70,
             "%s: ncclCommGetAsyncError reports %d", when, state);
  return 0;
}

int run_rank(int rank) {
  Rank r;
  r.rank = rank;
  NcclId id{};
  if (const int c = start_rank(rank, &r.nccl, &id, &r.stream)) return c;
  RANK_CHECK(cudaMalloc(&r.send, kCount * 4) == cudaSuccess &&
                 cudaMalloc(&r.recv, kCount * 4) == cudaSuccess,
             15, "cudaMalloc");
  r.host.resize(kCount);
  RANK_CHECK(r.nccl.comm_init_rank(&r.comm, kRanks, id, rank) == kNcclSuccess, 16,
             "ncclCommInitRank");
  if (int c = eager_compressed(r, 0, 1, 0)) return c;
  if (int c = capture_and_replay(r)) return c;
  if (int c = healthy(r, "after the replays")) return c;
  if (int c = eager_compressed(r, 3, 2, r.passed_in_capture)) return c;
  if (int c = healthy(r, "after the last eager call")) return c;
  write_result("digest" + std::to_string(rank),
               std::to_string(dq::fnv1a64(r.host.data(), kCount * sizeof(float))));
  r.nccl.comm_destroy(r.comm);
  std::printf("rank %d: pass\n", rank);
  return 0;
}

}  // namespace

int main(int, char** argv) {
  return two_ranks_main(argv, run_rank, 75, [](const std::string& dir) {
    if (read_result(dir, "digest0") == read_result(dir, "digest1")) return true;
    std::printf("FAIL: the ranks' results after the last call differ\n");
    return false;
  });
}
