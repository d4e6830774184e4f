#include "tests/shim/shim_test_util.h"

#include <dlfcn.h>
#include <signal.h>
#include <tbb/task_arena.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "config/settings.h"
#include "kernels/bf16.h"
#include "tests/common/check.h"
#include "tests/common/test_data.h"
#include "tools/sim/gradients.h"

namespace dq::shim_test {

using dq::test::fail;

std::string g_dir;

CountersFn counters_fn() {
  return reinterpret_cast<CountersFn>(dlsym(RTLD_DEFAULT, "dynamiqCommCounters"));
}

unsigned long long rerouted_calls(ncclComm_t comm) {
  const CountersFn fn = counters_fn();
  unsigned long long rerouted = 0, passed = 0;
  if (fn == nullptr || fn(comm, &rerouted, &passed) != 0) return ~0ull;
  return rerouted;
}

std::string rank_file(int r, const char* what) {
  return g_dir + "/" + what + std::to_string(r);
}

std::string rank_log(int r) {
  return read_file(g_dir + "/rank" + std::to_string(r) + ".log");
}

ncclResult_t init_comm(ncclComm_t* comm, int n, const ncclUniqueId& id, int r,
                       const char* comm_name) {
  if (comm_name == nullptr) return ncclCommInitRank(comm, n, id, r);
  ncclConfig_t config;
  std::memset(&config, 0, sizeof config);
  config.size = sizeof config;
  config.magic = DQ_NCCL_CONFIG_MAGIC;
  config.version = DQ_NCCL_VERSION_CODE;
  config.blocking = 1;
  config.commName = comm_name;
  return ncclCommInitRankConfig(comm, n, id, r, &config);
}

std::vector<int> run_ranks(int n, const std::function<Env(int)>& env,
                           const std::function<int(int, ncclComm_t)>& body, int timeout_s,
                           const char* comm_name,
                           std::function<bool(int, const dq::test::RankExit&)> expected) {
  dq::test::RankOptions opt;
  opt.timeout_s = timeout_s;
  opt.expected = std::move(expected);
  const auto exits = dq::test::run_ranks<ncclUniqueId>(
      n, 1, ncclGetUniqueId, opt, [&](int r, const ncclUniqueId* id) {
        const std::string log = g_dir + "/rank" + std::to_string(r) + ".log";
        if (std::freopen(log.c_str(), "w", stderr) == nullptr) return 98;
        for (auto& [k, v] : env(r)) setenv(k.c_str(), v.c_str(), 1);
        ncclComm_t comm = nullptr;
        if (init_comm(&comm, n, *id, r, comm_name) != ncclSuccess) return 97;
        const int rc = body(r, comm);
        std::fflush(stderr);
        if (rc == 0) ncclCommDestroy(comm);
        return rc;
      });
  std::vector<int> codes;
  for (const auto& e : exits) codes.push_back(e.code());
  return codes;
}

bool all_zero(const std::vector<int>& codes, const char* what) {
  // Ranks killed because another failed (125) come last: the failure is the one to show.
  for (const bool cut : {false, true})
    for (size_t r = 0; r < codes.size(); ++r)
      if (codes[r] != 0 && (codes[r] == 125) == cut) {
        std::fprintf(stderr, "--- rank %zu log ---\n%s", r, rank_log(static_cast<int>(r)).c_str());
        return fail("%s: rank %zu exited with %d", what, r, codes[r]);
      }
  return true;
}

// Identical bytes on every rank: MAX of (h, ~h) gives max and ~min of the per-rank hashes.
namespace {

// The victim dies inside call 2, `delay_ms` into it (a call takes some tens of ms here), or just
// before it when delay_ms is 0.
void kill_self_after(int delay_ms) {
  if (delay_ms == 0) raise(SIGKILL);
  std::thread([delay_ms] {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    raise(SIGKILL);
  }).detach();
}

ncclResult_t kill_call(const std::string& collective, const std::vector<float>& in,
                       std::vector<float>* out, int n, ncclComm_t comm) {
  const size_t count = in.size();
  if (collective == "reducescatter")
    return ncclReduceScatter(in.data(), out->data(), count / n, ncclFloat32, ncclSum, comm,
                             nullptr);
  if (collective == "reduce")
    return ncclReduce(in.data(), out->data(), count, ncclFloat32, ncclSum, 0, comm, nullptr);
  return ncclAllReduce(in.data(), out->data(), count, ncclFloat32, ncclSum, comm, nullptr);
}

// One rank of one killed-rank run; returns only when no call failed (41 for a survivor).
int kill_rank_body(const KillSpec& spec, const std::string& collective, int run, int victim,
                   int rank, ncclComm_t comm) {
  const int n = spec.n;
  std::vector<float> in(spec.count, 1.0f), out(spec.count);
  for (int k = 0; k < 6; ++k) {
    if (rank == victim && k == 2) kill_self_after((run * spec.delay_step_ms) % spec.delay_mod_ms);
    const auto t0 = std::chrono::steady_clock::now();
    const ncclResult_t r = kill_call(collective, in, &out, n, comm);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r == ncclSuccess && k < 2) {
      // Before the kill: a correct result (all ones sum to n exactly: mean subtraction leaves
      // nothing to round), on the elements this rank receives.
      const size_t n_out = collective == "reducescatter"         ? spec.count / n
                           : collective == "reduce" && rank != 0 ? 0
                                                                 : spec.count;
      for (size_t i = 0; i < n_out; ++i)
        if (out[i] != static_cast<float>(n)) {
          std::fprintf(stderr, "rank %d: call %d element %zu = %g, expected %d\n", rank, k, i,
                       out[i], n);
          _exit(42);
        }
    }
    if (r != ncclSuccess) {
      std::fprintf(stderr, "rank %d: call %d failed after %.2f s: %s\n", rank, k, s,
                   ncclGetErrorString(r));
      write_text(rank_file(rank, "kill"), std::to_string(s));
      // Calls before the kill must succeed; the first failure comes with or after it. The
      // communicator is broken then: exit without destroying it.
      _exit(k >= 2 ? 0 : 40);
    }
  }
  if (rank == victim) pause();  // killed by its timer thread during or after call 2
  return 41;                    // calls after the kill must not all succeed
}

}  // namespace

bool scenario_kill(const KillSpec& spec, int runs, const std::string& collective) {
  const int n = spec.n;
  double slowest = 0;
  for (int run = 0; run < runs; ++run) {
    const int victim = (run * spec.victim_step + spec.victim_offset) % n;
    auto body = [&](int rank, ncclComm_t comm) {
      return kill_rank_body(spec, collective, run, victim, rank, comm);
    };
    auto codes =
        run_ranks(n, spec.env, body, 60, nullptr, [victim](int r, const dq::test::RankExit& e) {
          return r == victim ? e.signaled(SIGKILL) : e.exited(0);
        });
    for (int r = 0; r < n; ++r) {
      if (r == victim) {
        EXPECT(codes[r] == -SIGKILL, "run %d: victim %d exited %d", run, r, codes[r]);
        continue;
      }
      EXPECT(codes[r] == 0, "run %d: rank %d exited %d (124 = hang):\n%s", run, r, codes[r],
             rank_log(r).c_str());
      const double s = std::atof(read_file(rank_file(r, "kill")).c_str());
      EXPECT(s <= spec.timeout_ms / 1000.0 + 5.0, "run %d: rank %d took %.2f s", run, r, s);
      slowest = std::max(slowest, s);
    }
  }
  std::printf(
      "%s (%s): all survivors returned an error within DYNAMIQ_TIMEOUT_MS + 5 s, %d/%d runs; "
      "slowest survivor's failing call took %.2f s\n",
      spec.label, collective.c_str(), runs, runs, slowest);
  return true;
}

bool scenario_toggle(const ToggleSpec& spec) {
  const std::string control = g_dir + "/switch";
  write_text(control, "on\n");
  const int window = static_cast<int>(dq::config::Settings{}.control_window);
  const int calls = 6 + window + 2;
  std::string expected;
  for (int k = 0; k < calls; ++k) {
    const int read_at = k - window;  // the call whose switch word call k applies
    expected += read_at >= 3 && read_at < 6 ? '0' : '1';
  }
  auto body = [&](int rank, ncclComm_t comm) -> int {
    unsigned long long seen = 0, passed = 0;
    counters_fn()(comm, &seen, &passed);
    std::string pattern;
    for (int k = 0; k < calls; ++k) {
      if (rank == 0 && k == 3) write_text(control, "off\n");
      if (rank == 0 && k == 6) write_text(control, "1\n");
      bool rerouted = false;
      if (const int rc = spec.call(rank, comm, &seen, &rerouted); rc != 0) return rc;
      pattern += rerouted ? '1' : '0';
    }
    write_text(rank_file(rank, "toggle"), pattern);
    return 0;
  };
  auto codes = run_ranks(
      spec.n, [&](int r) { return spec.env(r, control); }, body, 300);
  if (!all_zero(codes, "toggle")) return false;
  for (int r = 0; r < spec.n; ++r) {
    const std::string p = read_file(rank_file(r, "toggle"));
    EXPECT(p == expected, "rank %d compressed calls %s, expected %s", r, p.c_str(),
           expected.c_str());
  }
  std::printf("%s: every rank compressed calls %s (control window %d)\n", spec.label,
              expected.c_str(), window);
  return true;
}

void make_rows(const dq::sim::SyntheticSpec& spec, dq::sim::Matrix* rows) {
  tbb::task_arena serial(1);
  serial.execute([&] { dq::sim::make_synthetic(spec, rows); });
}

void make_rows(int n, size_t cols, uint64_t seed, dq::sim::Matrix* rows) {
  dq::sim::SyntheticSpec spec;
  spec.rows = static_cast<size_t>(n);
  spec.cols = cols;
  spec.spread = 1.0;
  spec.seed = seed;
  make_rows(spec, rows);
}

std::vector<unsigned char> typed_input(const dq::sim::Matrix& rows, int rank, size_t count,
                                       bool bf16) {
  std::vector<unsigned char> out(count * (bf16 ? 2 : 4));
  for (size_t i = 0; i < count; ++i) {
    dq::test::store_element(out.data(), i, bf16, rows.row(rank)[i]);
  }
  return out;
}

float input(const dq::sim::Matrix& rows, int w, size_t i, bool bf16) {
  const float v = rows.row(w)[i];
  return bf16 ? dq::bf16_to_f32(dq::f32_to_bf16_rne(v)) : v;
}

int scenario_main(int argc, char** argv, int min_argc, const char* usage, const char* dir_template,
                  const std::string& suffix,
                  const std::function<Outcome(const std::string&)>& run) {
  if (argc < min_argc) {
    std::fprintf(stderr, "usage: %s\n", usage);
    return 2;
  }
  if (counters_fn() == nullptr) {
    std::printf("SKIP: libdynamiq.so is not preloaded\n");
    return 77;
  }
  std::vector<char> tmpl(dir_template, dir_template + std::strlen(dir_template) + 1);
  if (mkdtemp(tmpl.data()) == nullptr) return 1;
  g_dir = tmpl.data();
  const std::string scenario = argv[1];
  const Outcome outcome = run(scenario);
  if (outcome == Outcome::unknown) {
    std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
    return 2;
  }
  if (outcome != Outcome::fail) std::system(("rm -rf " + g_dir).c_str());  // kept for a failure
  if (outcome == Outcome::skip) return 77;
  const bool ok = outcome == Outcome::pass;
  std::printf("%s: %s%s\n", ok ? "PASS" : "FAIL", scenario.c_str(), suffix.c_str());
  return ok ? 0 : 1;
}

}  // namespace dq::shim_test
