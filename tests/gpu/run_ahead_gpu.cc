// The host runs a control window of compressed calls ahead of the GPU, through the preloaded shim
// on a real device with NVIDIA's NCCL, 2 ranks (two fake hosts; tests/gpu/two_ranks.h): the
// engine_run_ahead_4ranks test of the CPU path, on CUDA's streams, events and mapped memory.
// Each rank:
//  - makes a first compressed call (handshake, plan) and waits for it;
//  - holds its stream shut with a host function that blocks until a gate opens, then issues
//    calls 1..W (W = DYNAMIQ_CONTROL_WINDOW's default), each on buffers of its own: every one
//    must return while the gate is shut (no host wait for an earlier call's control all-reduce);
//  - issues call W + 1, which must return only after the gate opened (a thread opens it 300 ms
//    after call W returned): it waits for call 1's control all-reduce, whose slot it reuses;
//  - then checks every call's result against the exact sum (vNMSE bounded), the shim's counters
//    (W + 2 compressed) and the communicator's health.
// Exit 77 (skipped) without NCCL or a CUDA device.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "config/settings.h"
#include "tests/gpu/two_ranks.h"

namespace {

using namespace dq::gputest;

constexpr size_t kCount = size_t{1} << 20;  // floats: 4 MiB, above the test's DYNAMIQ_MIN_BYTES
constexpr double kMaxVnmse = 1e-3;          // DynamiQ at 5 bits is far below; a wrong byte is above
constexpr int kGateMs = 300;                // the gate opens this long after call W returned
constexpr int kGateLimitMs = 20000;         // and after this in any case

float input(int rank, int call, size_t i) {
  return static_cast<float>((rank + 1) * (call + 1)) + static_cast<float>(i % 7);
}

struct Gate {
  std::atomic<bool> open{false};
};

// A host function on the stream: the stream's later work waits until the gate opens.
void CUDART_CB hold(void* p) {
  auto* gate = static_cast<Gate*>(p);
  const auto limit = std::chrono::steady_clock::now() + std::chrono::milliseconds(kGateLimitMs);
  while (!gate->open.load() && std::chrono::steady_clock::now() < limit)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

#define RANK_CHECK(cond, code, ...) DQ_RANK_CHECK(rank, cond, code, __VA_ARGS__)

int run_rank(int rank) {
  const int window = static_cast<int>(dq::config::Settings{}.control_window);
  const int calls = window + 2;
  Nccl nccl;
  NcclId id{};
  cudaStream_t stream = nullptr;
  if (const int c = start_rank(rank, &nccl, &id, &stream)) return c;
  std::vector<float*> send(calls, nullptr), recv(calls, nullptr);
  std::vector<float> host(kCount);
  for (int k = 0; k < calls; ++k) {
    RANK_CHECK(cudaMalloc(&send[k], kCount * 4) == cudaSuccess &&
                   cudaMalloc(&recv[k], kCount * 4) == cudaSuccess,
               15, "cudaMalloc");
    for (size_t i = 0; i < kCount; ++i) host[i] = input(rank, k, i);
    RANK_CHECK(cudaMemcpy(send[k], host.data(), kCount * 4, cudaMemcpyHostToDevice) == cudaSuccess,
               15, "the input copy of call %d", k);
  }
  void* comm = nullptr;
  RANK_CHECK(nccl.comm_init_rank(&comm, kRanks, id, rank) == kNcclSuccess, 16, "ncclCommInitRank");
  auto call = [&](int k) {
    return nccl.all_reduce(send[k], recv[k], kCount, kNcclFloat32, kNcclSum, comm, stream);
  };
  RANK_CHECK(call(0) == kNcclSuccess && cudaStreamSynchronize(stream) == cudaSuccess, 20,
             "the first call");

  Gate gate;
  RANK_CHECK(cudaLaunchHostFunc(stream, hold, &gate) == cudaSuccess, 21, "cudaLaunchHostFunc");
  std::atomic<bool> trigger{false}, opened{false};
  std::thread opener([&] {
    const auto limit = std::chrono::steady_clock::now() + std::chrono::milliseconds(kGateLimitMs);
    while (!trigger.load() && std::chrono::steady_clock::now() < limit)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(kGateMs));
    opened = true;
    gate.open = true;
  });
  int rc = 0;
  double window_ms = 0, last_ms = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 1; k <= window && rc == 0; ++k) {
    if (call(k) != kNcclSuccess) rc = 22;
    if (rc == 0 && opened.load()) rc = 23;
  }
  window_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  trigger = true;
  if (rc == 0) {
    const auto t1 = std::chrono::steady_clock::now();
    if (call(window + 1) != kNcclSuccess) rc = 24;
    last_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
    if (rc == 0 && !opened.load()) rc = 25;
  }
  gate.open = true;  // whatever happened, the stream runs again
  opener.join();
  RANK_CHECK(rc != 22 && rc != 24, rc, "a call failed");
  RANK_CHECK(rc != 23, rc, "a call of the window (1..%d) waited for the held stream", window);
  RANK_CHECK(rc != 25, rc, "call %d returned with the stream held: it did not wait", window + 1);
  std::printf(
      "rank %d: calls 1..%d returned in %.1f ms with the stream held; call %d waited "
      "%.1f ms for it\n",
      rank, window, window_ms, window + 1, last_ms);
  RANK_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, 26, "the stream after the gate");
  for (int k = 0; k < calls; ++k) {
    RANK_CHECK(cudaMemcpy(host.data(), recv[k], kCount * 4, cudaMemcpyDeviceToHost) == cudaSuccess,
               27, "reading call %d", k);
    double err = 0, norm = 0;
    bool finite = true;
    for (size_t i = 0; i < kCount; ++i) {
      const double want = static_cast<double>(input(0, k, i)) + input(1, k, i);
      finite = finite && std::isfinite(host[i]);
      err += (host[i] - want) * (host[i] - want);
      norm += want * want;
    }
    RANK_CHECK(finite && err / norm <= kMaxVnmse, 28, "call %d: vNMSE %.3e (bound %.0e)", k,
               err / norm, kMaxVnmse);
  }
  unsigned long long rerouted = 0, passed = 0;
  RANK_CHECK(nccl.counters(comm, &rerouted, &passed) == 0, 29, "dynamiqCommCounters");
  RANK_CHECK(rerouted == static_cast<unsigned long long>(calls) && passed == 0, 30,
             "%llu compressed, %llu passed through (expected %d and 0)", rerouted, passed, calls);
  int state = -1;
  RANK_CHECK(nccl.get_async_error(comm, &state) == kNcclSuccess && state == kNcclSuccess, 31,
             "ncclCommGetAsyncError reports %d", state);
  nccl.comm_destroy(comm);
  std::printf("rank %d: pass (%d calls compressed, each within vNMSE %.0e)\n", rank, calls,
              kMaxVnmse);
  return 0;
}

}  // namespace

int main(int, char** argv) {
  return two_ranks_main(argv, run_rank, 90);
}
