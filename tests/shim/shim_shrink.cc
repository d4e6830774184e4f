// ncclCommShrink and ncclCommRevoke (NCCL 2.27 / 2.28 fault tolerance: PyTorch's shrink_group,
// TorchFT-style recovery) through the preloaded libdynamiq.so on the CPU NCCL. Four ranks of a
// communicator named "grads", opted in by name (DYNAMIQ_COMMS=name=grads) or, in `dead`, by size
// (size=4, which the 3-rank communicator a shrink makes does not match: it keeps its parent's
// decision); rank 2 is the one lost after a first compressed all-reduce. Usage: shim_shrink
// SCENARIO
//   dead      rank 2 exits without a word; the survivors' next all-reduce fails and they shrink
//             with NCCL_SHRINK_ABORT.
//   hung      rank 2 lives but never joins the next all-reduce; each survivor's other thread
//             revokes the communicator 500 ms into it: the call returns within 5 s
//             (DYNAMIQ_TIMEOUT_MS and the CPU NCCL's timeout are 60 s), the parent reports
//             quiescent, and the survivors shrink (NCCL_SHRINK_DEFAULT).
//   hung_2x2  as hung, on two fake nodes (NCCL_HOSTID): the stuck operations are on the node and
//             rail communicators the engine made, which the revoke must reach as well.
//   abort, abort_2x2  rank 2 hung as above, and each survivor's other thread aborts the
//             communicator (ncclCommAbort, as a watchdog does) 500 ms into the stuck call: the
//             abort and the call return within 5 s, not at the 60 s timeouts; before the
//             abort, the counters' C API (dynamiqCommCounters, -Bytes, -Check) answers within
//             2 s though the call holds the communicator.
// Then, on every survivor: the parent refuses work (ncclInvalidUsage), and the shrunk
// communicator (3 ranks, parent order) carries two all-reduces that dynamiq compressed (its
// counters), identical on every survivor, vNMSE against the exact sum below 1e-2 (5 bits).
// Exit 0 pass, 1 fail, 77 skip (shim not preloaded).
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/nccl_api.h"
#include "tests/common/check.h"
#include "tests/common/rank_harness.h"
#include "tests/shim/shim_test_util.h"
#include "tools/sim/gradients.h"

namespace {

using namespace dq::shim_test;
using dq::test::fail;
using Clock = std::chrono::steady_clock;

constexpr int kRanks = 4;
constexpr int kLost = 2;
constexpr size_t kCount = size_t{1} << 20;  // FP32 values a call
constexpr double kVnmseBound = 1e-2;

enum class Mode { kDead, kHung, kAbort };

// Rank `rank`'s row, FP32.
std::vector<float> row(const dq::sim::Matrix& rows, int rank) {
  std::vector<float> v(kCount);
  for (size_t i = 0; i < kCount; ++i) v[i] = input(rows, rank, i, false);
  return v;
}

// Waits for the files the survivors write when they are done (bounded).
void wait_for_survivors() {
  const auto deadline = Clock::now() + std::chrono::seconds(150);
  for (;;) {
    int done = 0;
    for (int r = 0; r < kRanks; ++r)
      if (r != kLost && !read_file(rank_file(r, "done")).empty()) ++done;
    if (done == kRanks - 1 || Clock::now() > deadline) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// The all-reduce that rank kLost never joins, on a thread of its own, and `interrupt` (a
// watchdog's revoke or abort) on this one 500 ms into it.
struct StuckCall {
  int early = -1;          // the call's result if it had returned before the interrupt, else -1
  int result = -1;         // the call's result
  int interrupted = -1;    // what `interrupt` returned
  double interrupt_s = 0;  // how long `interrupt` took (s)
  double ended_s = 0;      // from the interrupt to the call's return (s)
};
StuckCall stuck_call(ncclComm_t comm, const std::vector<float>& in,
                     const std::function<ncclResult_t()>& interrupt) {
  std::vector<float> out(kCount);
  std::atomic<int> result{-1};
  std::thread call([&] {
    result = ncclAllReduce(in.data(), out.data(), kCount, ncclFloat32, ncclSum, comm, nullptr);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  StuckCall s;
  s.early = result.load();
  const auto at = Clock::now();
  s.interrupted = interrupt();
  s.interrupt_s = std::chrono::duration<double>(Clock::now() - at).count();
  call.join();
  s.ended_s = std::chrono::duration<double>(Clock::now() - at).count();
  s.result = result.load();
  return s;
}

// The stuck call, revoked. The first survivor to revoke ends its own call; the others' may end
// before their revoke, since the first one's connections close (the CPU NCCL then fails fast).
// Writes "own" or "peer" (which ended it) to rank_file(rank, "ended"). 0 or an exit code.
int revoke_stuck_call(int rank, ncclComm_t comm, const std::vector<float>& in) {
  const StuckCall s = stuck_call(comm, in, [&] { return ncclCommRevoke(comm, 0); });
  std::fprintf(stderr, "test: the stuck all-reduce returned %d, %s\n", s.result,
               s.early != -1 ? "before this rank's revoke"
                             : (std::to_string(s.ended_s) + " s after this rank's revoke").c_str());
  write_text(rank_file(rank, "ended"), s.early != -1 ? "peer" : "own");
  if (s.early == ncclSuccess) return 40;  // it cannot complete without rank kLost
  if (s.interrupted != ncclSuccess) return 41;
  if (s.result == ncclSuccess) return 42;
  if (s.early == -1 && s.ended_s > 5.0) return 43;
  ncclResult_t async = ncclInternalError;
  if (ncclCommGetAsyncError(comm, &async) != ncclSuccess || async != ncclSuccess) return 44;
  return 0;
}

// The stuck call, and ncclCommAbort. Writes the abort's duration (s) to
// rank_file(rank, "abort_s"). 0 or an exit code.
// Before the abort, as a monitoring thread would: the counters' C API answers at once while the
// call holds the communicator through its wait (it waited for the call, up to DYNAMIQ_TIMEOUT_MS).
int abort_stuck_call(int rank, ncclComm_t comm, const std::vector<float>& in) {
  double counters_s = -1;
  unsigned long long bytes_in = 0, wire = 0, checked = 0;
  const StuckCall s = stuck_call(comm, in, [&] {
    using Bytes = int (*)(void*, unsigned long long*, unsigned long long*);
    using Check = int (*)(void*, unsigned long long*, unsigned long long*, double*,
                          unsigned long long*, double*, double*);
    const auto bytes = reinterpret_cast<Bytes>(dlsym(RTLD_DEFAULT, "dynamiqCommBytes"));
    const auto check = reinterpret_cast<Check>(dlsym(RTLD_DEFAULT, "dynamiqCommCheck"));
    const auto at = Clock::now();
    (void)rerouted_calls(comm);
    if (bytes != nullptr) bytes(comm, &bytes_in, &wire);
    if (check != nullptr) check(comm, nullptr, &checked, nullptr, nullptr, nullptr, nullptr);
    counters_s = std::chrono::duration<double>(Clock::now() - at).count();
    return ncclCommAbort(comm);
  });
  std::fprintf(stderr, "test: the counters answered in %.3f s during the stuck call\n", counters_s);
  if (counters_s > 2.0) return 64;
  std::fprintf(stderr, "test: ncclCommAbort returned %d after %.3f s, the call %d after %.3f s\n",
               s.interrupted, s.interrupt_s, s.result, s.ended_s);
  write_text(rank_file(rank, "abort_s"), std::to_string(s.interrupt_s));
  if (s.early == ncclSuccess) return 60;  // it cannot complete without rank kLost
  if (s.interrupted != ncclSuccess) return 61;
  if (s.result == ncclSuccess) return 62;
  if (s.interrupt_s > 5.0 || s.ended_s > 5.0) return 63;
  return 0;
}

int survivor(int rank, ncclComm_t comm, Mode mode, const dq::sim::Matrix& rows) {
  const std::vector<float> in = row(rows, rank);
  if (mode == Mode::kAbort) {
    const int rc = abort_stuck_call(rank, comm, in);
    write_text(rank_file(rank, "done"), "1");
    std::fflush(stderr);
    _exit(rc);  // the communicator is gone: the harness must not destroy it
  }
  int excluded[1] = {kLost};
  ncclComm_t sub = nullptr;
  if (mode == Mode::kHung) {
    if (const int rc = revoke_stuck_call(rank, comm, in); rc != 0) return rc;
    if (ncclCommShrink(comm, excluded, 1, &sub, nullptr, DQ_NCCL_SHRINK_DEFAULT) != ncclSuccess)
      return 50;
  } else {
    std::vector<float> out(kCount);
    if (ncclAllReduce(in.data(), out.data(), kCount, ncclFloat32, ncclSum, comm, nullptr) ==
        ncclSuccess)
      return 45;
    if (ncclCommShrink(comm, excluded, 1, &sub, nullptr, DQ_NCCL_SHRINK_ABORT) != ncclSuccess)
      return 50;
  }
  // The parent refuses work now.
  float one = 1, total = 0;
  if (ncclAllReduce(&one, &total, 1, ncclFloat32, ncclSum, comm, nullptr) != ncclInvalidUsage)
    return 51;
  int count = 0, me = -1;
  if (sub == nullptr || ncclCommCount(sub, &count) != ncclSuccess ||
      ncclCommUserRank(sub, &me) != ncclSuccess)
    return 52;
  if (count != kRanks - 1 || me != rank - (rank > kLost ? 1 : 0)) return 53;
  std::vector<float> out(kCount);
  for (int call = 0; call < 2; ++call) {
    const unsigned long long before = rerouted_calls(sub);
    if (ncclAllReduce(in.data(), out.data(), kCount, ncclFloat32, ncclSum, sub, nullptr) !=
        ncclSuccess)
      return 54;
    if (rerouted_calls(sub) != before + 1) return 55;  // compressed, as its parent was
    if (!same_bytes_everywhere(sub, out.data(), kCount * sizeof(float))) return 56;
  }
  double err = 0, energy = 0;
  for (size_t i = 0; i < kCount; ++i) {
    double exact = 0;
    for (int r = 0; r < kRanks; ++r)
      if (r != kLost) exact += input(rows, r, i, false);
    err += (out[i] - exact) * (out[i] - exact);
    energy += exact * exact;
  }
  const double vnmse = err / energy;
  std::fprintf(stderr, "test: shrunk communicator vNMSE %.4e\n", vnmse);
  write_text(rank_file(rank, "vnmse"), std::to_string(vnmse));
  if (!(vnmse < kVnmseBound)) return 57;
  if (ncclCommDestroy(sub) != ncclSuccess) return 58;
  write_text(rank_file(rank, "done"), "1");
  return 0;
}

bool scenario(Mode mode, bool two_nodes, const char* label) {
  dq::sim::Matrix rows;
  make_rows(kRanks, kCount, 4242, &rows);
  auto env = [&](int rank) {
    Env e{{"DYNAMIQ_ENABLE", "1"},
          {"DYNAMIQ_COMMS", mode == Mode::kDead ? "size=4" : "name=grads"},
          {"DYNAMIQ_TIMEOUT_MS", "60000"},
          {"DYNAMIQ_CPU_NCCL_TIMEOUT_MS", "60000"},
          {"DYNAMIQ_DEBUG", "INFO"}};
    if (two_nodes) e.push_back({"NCCL_HOSTID", rank < 2 ? "node0" : "node1"});
    return e;
  };
  auto body = [&](int rank, ncclComm_t comm) -> int {
    const std::vector<float> in = row(rows, rank);
    std::vector<float> out(kCount);
    if (ncclAllReduce(in.data(), out.data(), kCount, ncclFloat32, ncclSum, comm, nullptr) !=
        ncclSuccess)
      return 30;
    if (rerouted_calls(comm) != 1) return 31;
    if (rank != kLost) return survivor(rank, comm, mode, rows);
    if (mode == Mode::kDead) _exit(0);  // no destroy, no word: its connections just close
    wait_for_survivors();
    return 0;
  };
  const auto start = Clock::now();
  if (!all_zero(run_ranks(kRanks, env, body, 300, "grads"), label)) return false;
  if (mode == Mode::kAbort) {
    double slowest = 0;
    for (int r = 0; r < kRanks; ++r)
      if (r != kLost)
        slowest = std::max(slowest, std::atof(read_file(rank_file(r, "abort_s")).c_str()));
    std::printf(
        "%s: rank %d silent in a compressed call; every survivor's ncclCommAbort from another "
        "thread returned within %.3f s (the timeouts are 60 s), and its call with an error\n",
        label, kLost, slowest);
    return true;
  }
  double worst = 0;
  int own = 0;
  for (int r = 0; r < kRanks; ++r)
    if (r != kLost) {
      worst = std::max(worst, std::atof(read_file(rank_file(r, "vnmse")).c_str()));
      own += read_file(rank_file(r, "ended")) == "own";
    }
  if (mode == Mode::kHung && own == 0)
    return fail("%s: no survivor's call was ended by its own revoke", label);
  // The new communicator's decision line names the one it replaces, for the operator.
  for (int r = 0; r < kRanks; ++r)
    if (r != kLost && count_occurrences(rank_log(r), "(shrunk from index 0): compressed") != 1)
      return fail("%s: rank %d's log has no decision line for the shrunk communicator:\n%s", label,
                  r, rank_log(r).c_str());
  std::printf(
      "%s: rank %d lost after a compressed call; the 3 survivors shrank and compressed 2 calls "
      "on the new communicator, identical on each (vNMSE at most %.3e); %.1f s\n",
      label, kLost, worst, std::chrono::duration<double>(Clock::now() - start).count());
  return true;
}

Outcome run_scenario(const std::string& which) {
  if (which == "dead") return outcome(scenario(Mode::kDead, false, "dead"));
  if (which == "hung") return outcome(scenario(Mode::kHung, false, "hung"));
  if (which == "hung_2x2") return outcome(scenario(Mode::kHung, true, "hung_2x2"));
  if (which == "abort") return outcome(scenario(Mode::kAbort, false, "abort"));
  if (which == "abort_2x2") return outcome(scenario(Mode::kAbort, true, "abort_2x2"));
  return Outcome::unknown;
}

}  // namespace

int main(int argc, char** argv) {
  return scenario_main(argc, argv, 2, "shim_shrink dead|hung|hung_2x2|abort|abort_2x2",
                       "/tmp/dq-shim-shrink-XXXXXX", "", run_scenario);
}
