// NCCL's group simulation and in-job recovery through the preloaded shim on a real device with
// NVIDIA's NCCL, 2 ranks (two fake hosts; tests/gpu/two_ranks.h). Each rank:
//  1. a compressed eager all-reduce (the shim's counters), vNMSE against the exact sum bounded;
//  2. with NCCL 2.22+: an all-reduce in a group closed by ncclGroupSimulateEnd, which must not
//     run (its output keeps a sentinel, also after a later empty group), then an eager call that
//     must be compressed and complete;
//  3. with NCCL 2.28+: rank 1 stops calling; rank 0's next compressed all-reduce is stuck (its
//     stream not done 500 ms in), ncclCommRevoke from rank 0 ends it (the stream completes within
//     5 s) and the communicator reports quiescent (ncclCommGetAsyncError leaves ncclInProgress
//     within 5 s); then both ranks abort the communicator, each abort within 5 s.
// Environment (tests/gpu/meson.build): LD_PRELOAD=libdynamiq.so, DYNAMIQ_ENABLE=1,
// DYNAMIQ_MIN_BYTES below the call's size. Exit 77 (skipped) without NCCL or a CUDA device.
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "tests/gpu/two_ranks.h"

namespace {

using namespace dq::gputest;
using Clock = std::chrono::steady_clock;

constexpr size_t kCount = size_t{1} << 20;  // floats: 4 MiB, above the test's DYNAMIQ_MIN_BYTES
constexpr double kMaxVnmse = 1e-3;          // as shim_capture_gpu: far above DynamiQ-5 here
constexpr float kSentinel = 12345.0f;
constexpr int kNcclInProgress = 7;

// NCCL's ncclSimInfo_t (2.22+) and its initializer's magic.
struct SimInfo {
  size_t size;
  unsigned int magic;
  unsigned int version;
  float estimated_time;
};
constexpr unsigned int kSimInfoMagic = 0x74685283u;

struct Rank {
  int rank = 0;
  Nccl nccl;
  void* comm = nullptr;
  cudaStream_t stream = nullptr;
  float *send = nullptr, *recv = nullptr, *simulated = nullptr;
  std::vector<float> host;
  int (*group_start)() = nullptr;
  int (*group_end)() = nullptr;
  int (*group_simulate_end)(SimInfo*) = nullptr;  // null: the real NCCL has none
  int (*comm_revoke)(void*, int) = nullptr;       // null: the real NCCL has none
  int (*comm_abort)(void*) = nullptr;
  int (*get_version)(int*) = nullptr;
};

#define RANK_CHECK(cond, code, ...) DQ_RANK_CHECK(r.rank, cond, code, __VA_ARGS__)

float input(int rank, int round, size_t i) {
  return static_cast<float>((rank + 1) * (round + 1)) + static_cast<float>(i % 7);
}

int fill(Rank& r, int round) {
  for (size_t i = 0; i < kCount; ++i) r.host[i] = input(r.rank, round, i);
  RANK_CHECK(cudaMemcpyAsync(r.send, r.host.data(), kCount * 4, cudaMemcpyHostToDevice, r.stream) ==
                     cudaSuccess &&
                 cudaStreamSynchronize(r.stream) == cudaSuccess,
             30, "the input copy of round %d", round);
  return 0;
}

unsigned long long compressed(Rank& r) {
  unsigned long long got_r = 0, got_p = 0;
  r.nccl.counters(r.comm, &got_r, &got_p);
  return got_r;
}

// An eager compressed call of round `round`: the result's vNMSE against the exact sum.
int eager_compressed(Rank& r, int round) {
  if (int rc = fill(r, round)) return rc;
  const unsigned long long before = compressed(r);
  RANK_CHECK(r.nccl.all_reduce(r.send, r.recv, kCount, kNcclFloat32, kNcclSum, r.comm, r.stream) ==
                 kNcclSuccess,
             40, "eager all-reduce of round %d", round);
  RANK_CHECK(cudaMemcpyAsync(r.host.data(), r.recv, kCount * 4, cudaMemcpyDeviceToHost, r.stream) ==
                     cudaSuccess &&
                 cudaStreamSynchronize(r.stream) == cudaSuccess,
             41, "the result copy of round %d", round);
  double err = 0, norm = 0;
  for (size_t i = 0; i < kCount; ++i) {
    const double want = static_cast<double>(input(0, round, i)) + input(1, round, i);
    err += (r.host[i] - want) * (r.host[i] - want);
    norm += want * want;
  }
  const double v = std::isfinite(err) ? err / norm : -1;
  std::printf("rank %d: eager call of round %d: vNMSE %.3e\n", r.rank, round, v);
  RANK_CHECK(v >= 0 && v <= kMaxVnmse, 42, "round %d: vNMSE %.3e", round, v);
  RANK_CHECK(compressed(r) == before + 1, 43, "round %d was not compressed", round);
  return 0;
}

// Part 2: nothing of a simulated group runs.
int simulated_group(Rank& r) {
  if (r.group_simulate_end == nullptr) {
    std::printf("rank %d: NCCL has no ncclGroupSimulateEnd (before 2.22): part 2 skipped\n",
                r.rank);
    return 0;
  }
  std::vector<float> sentinel(kCount, kSentinel);
  RANK_CHECK(
      cudaMemcpy(r.simulated, sentinel.data(), kCount * 4, cudaMemcpyHostToDevice) == cudaSuccess,
      50, "sentinel copy");
  if (int rc = fill(r, 1)) return rc;
  int version = 0;
  r.get_version(&version);
  SimInfo info{sizeof(SimInfo), kSimInfoMagic, static_cast<unsigned int>(version), -1.0f};
  const unsigned long long before = compressed(r);
  RANK_CHECK(r.group_start() == kNcclSuccess, 51, "ncclGroupStart");
  RANK_CHECK(r.nccl.all_reduce(r.send, r.simulated, kCount, kNcclFloat32, kNcclSum, r.comm,
                               r.stream) == kNcclSuccess,
             52, "the simulated group's all-reduce");
  const int end = r.group_simulate_end(&info);
  std::printf("rank %d: ncclGroupSimulateEnd returned %d, estimate %g us\n", r.rank, end,
              info.estimated_time);
  RANK_CHECK(end == kNcclSuccess, 53, "ncclGroupSimulateEnd returned %d", end);
  RANK_CHECK(compressed(r) == before, 54, "the simulated all-reduce was compressed");
  if (int rc = eager_compressed(r, 2)) return rc;
  RANK_CHECK(r.group_start() == kNcclSuccess && r.group_end() == kNcclSuccess, 55, "empty group");
  RANK_CHECK(cudaStreamSynchronize(r.stream) == cudaSuccess &&
                 cudaMemcpy(sentinel.data(), r.simulated, kCount * 4, cudaMemcpyDeviceToHost) ==
                     cudaSuccess,
             56, "sentinel read-back");
  for (size_t i = 0; i < kCount; ++i)
    RANK_CHECK(sentinel[i] == kSentinel, 57, "the simulated all-reduce wrote element %zu", i);
  return 0;
}

// In a rank: what another rank left under NAME in the parent's folder ("" when nothing).
std::string peer_result(const char* name) {
  const char* dir = std::getenv("DQ_TEST_DIR");
  return dir != nullptr ? dq::test::read_file(std::string(dir) + "/" + name) : "";
}

// Waits until `done` or `seconds` passed; the seconds it took, or -1 at the bound.
template <class Done>
double wait_until(Done done, double seconds) {
  const auto start = Clock::now();
  for (;;) {
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    if (done()) return s;
    if (s > seconds) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

// Part 3: a call stuck on a silent rank, revoked; then the aborts.
int revoke_and_abort(Rank& r) {
  const bool revoke = r.comm_revoke != nullptr;
  if (!revoke)
    std::printf("rank %d: NCCL has no ncclCommRevoke (before 2.28): only the abort is checked\n",
                r.rank);
  if (r.rank == 1) {
    // Silent: the next call is rank 0's alone. Aborts once rank 0 is done (bounded).
    const double waited = wait_until([] { return !peer_result("rank0_done").empty(); }, 60);
    const auto start = Clock::now();
    const int abort = r.comm_abort(r.comm);
    const double abort_s = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf("rank 1: waited %.1f s for rank 0; ncclCommAbort returned %d after %.3f s\n",
                waited, abort, abort_s);
    RANK_CHECK(waited >= 0, 70, "rank 0 never finished");
    RANK_CHECK(abort == kNcclSuccess && abort_s < 5.0, 71, "ncclCommAbort: %d after %.3f s", abort,
               abort_s);
    return 0;
  }
  if (int rc = fill(r, 3)) return rc;
  RANK_CHECK(r.nccl.all_reduce(r.send, r.recv, kCount, kNcclFloat32, kNcclSum, r.comm, r.stream) ==
                 kNcclSuccess,
             72, "the stuck call's enqueue");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  RANK_CHECK(cudaStreamQuery(r.stream) == cudaErrorNotReady, 73,
             "the call without rank 1 completed");
  if (revoke) {
    const int rv = r.comm_revoke(r.comm, 0);
    const double ended =
        wait_until([&] { return cudaStreamQuery(r.stream) != cudaErrorNotReady; }, 5);
    int state = kNcclInProgress;
    const double quiet = wait_until(
        [&] { return r.nccl.get_async_error(r.comm, &state) == 0 && state != kNcclInProgress; }, 5);
    std::printf(
        "rank 0: ncclCommRevoke returned %d; the stream done after %.3f s; the communicator "
        "state %d after %.3f s\n",
        rv, ended, state, quiet);
    RANK_CHECK(rv == kNcclSuccess, 74, "ncclCommRevoke returned %d", rv);
    RANK_CHECK(ended >= 0, 75, "the revoked call's stream did not complete within 5 s");
    RANK_CHECK(quiet >= 0, 76, "the revoked communicator stayed in progress for 5 s");
  }
  const auto start = Clock::now();
  const int abort = r.comm_abort(r.comm);
  const double abort_s = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("rank 0: ncclCommAbort returned %d after %.3f s\n", abort, abort_s);
  write_result("rank0_done", "1");
  RANK_CHECK(abort == kNcclSuccess && abort_s < 5.0, 77, "ncclCommAbort: %d after %.3f s", abort,
             abort_s);
  return 0;
}

int run_rank(int rank) {
  Rank r;
  r.rank = rank;
  NcclId id{};
  if (const int c = start_rank(rank, &r.nccl, &id, &r.stream)) return c;
  resolve(RTLD_DEFAULT, "ncclGroupStart", &r.group_start);
  resolve(RTLD_DEFAULT, "ncclGroupEnd", &r.group_end);
  resolve(RTLD_DEFAULT, "ncclCommAbort", &r.comm_abort);
  resolve(r.nccl.lib, "ncclGetVersion", &r.get_version);
  // The shim exports both whatever the NCCL behind it has: ask the real library.
  if (dlsym(r.nccl.lib, "ncclGroupSimulateEnd") != nullptr)
    resolve(RTLD_DEFAULT, "ncclGroupSimulateEnd", &r.group_simulate_end);
  if (dlsym(r.nccl.lib, "ncclCommRevoke") != nullptr)
    resolve(RTLD_DEFAULT, "ncclCommRevoke", &r.comm_revoke);
  RANK_CHECK(r.group_start && r.group_end && r.comm_abort && r.get_version, 15,
             "an NCCL entry point is missing");
  RANK_CHECK(cudaMalloc(&r.send, kCount * 4) == cudaSuccess &&
                 cudaMalloc(&r.recv, kCount * 4) == cudaSuccess &&
                 cudaMalloc(&r.simulated, kCount * 4) == cudaSuccess,
             16, "cudaMalloc");
  r.host.resize(kCount);
  RANK_CHECK(r.nccl.comm_init_rank(&r.comm, kRanks, id, rank) == kNcclSuccess, 17,
             "ncclCommInitRank");
  if (int c = eager_compressed(r, 0)) return c;
  if (int c = simulated_group(r)) return c;
  if (int c = revoke_and_abort(r)) return c;
  std::printf("rank %d: pass\n", rank);
  return 0;
}

}  // namespace

int main(int, char** argv) {
  return two_ranks_main(argv, run_rank, 100);
}
