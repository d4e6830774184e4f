// End-to-end tests of libdynamiq.so on the CPU NCCL: each run forks N rank processes (the shim
// is preloaded by the test's environment), gives each its own DYNAMIQ_* settings, and checks
// what an application would see. Usage: shim_multirank SCENARIO NRANKS [TOPO]
// Exit 0 pass, 1 fail, 77 skip (shim not preloaded).
#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/nccl_api.h"
#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "tools/sim/gradients.h"
#include "tools/sim/simulate.h"
#include "topo/schedule.h"

namespace {

using Env = std::vector<std::pair<std::string, std::string>>;
using CountersFn = int (*)(void*, unsigned long long*, unsigned long long*);
using RegisterFn = int (*)(void*, int);

CountersFn counters_fn() {
  return reinterpret_cast<CountersFn>(dlsym(RTLD_DEFAULT, "dynamiqCommCounters"));
}

std::string g_dir;  // per-run scratch directory (rank logs, result files)

bool fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
bool fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "FAIL: ");
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
  return false;
}

#define EXPECT(cond, ...) \
  do {                    \
    if (!(cond)) return fail(__VA_ARGS__); \
  } while (0)

// Forks n ranks; rank r applies env(r), creates its communicator and runs body(rank, comm).
// A rank's stderr goes to g_dir/rank<r>.log. Returns the ranks' exit codes (-signal if killed).
std::vector<int> run_ranks(int n, const std::function<Env(int)>& env,
                           const std::function<int(int, ncclComm_t)>& body, int timeout_s,
                           const char* comm_name = nullptr) {
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) return std::vector<int>(n, 99);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      const std::string log = g_dir + "/rank" + std::to_string(r) + ".log";
      if (std::freopen(log.c_str(), "w", stderr) == nullptr) _exit(98);
      for (auto& [k, v] : env(r)) setenv(k.c_str(), v.c_str(), 1);
      ncclComm_t comm = nullptr;
      ncclResult_t res;
      if (comm_name) {
        ncclConfig_t config;
        std::memset(&config, 0, sizeof config);
        config.size = sizeof config;
        config.magic = DQ_NCCL_CONFIG_MAGIC;
        config.version = DQ_NCCL_VERSION_CODE;
        config.blocking = 1;
        config.commName = comm_name;
        res = ncclCommInitRankConfig(&comm, n, id, r, &config);
      } else {
        res = ncclCommInitRank(&comm, n, id, r);
      }
      if (res != ncclSuccess) _exit(97);
      const int rc = body(r, comm);
      std::fflush(stderr);
      if (rc == 0) ncclCommDestroy(comm);
      _exit(rc);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes(n, -999);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int left = n;
  while (left > 0) {  // bounded by the deadline
    for (int r = 0; r < n; ++r) {
      if (codes[r] != -999) continue;
      int st = 0;
      if (waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
        --left;
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "ranks still running after %d s: killing them (a hang)\n", timeout_s);
      for (int r = 0; r < n; ++r)
        if (codes[r] == -999) kill(pids[r], SIGKILL);
      for (int r = 0; r < n; ++r)
        if (codes[r] == -999) {
          waitpid(pids[r], nullptr, 0);
          codes[r] = 124;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return codes;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int count_occurrences(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

bool all_zero(const std::vector<int>& codes, const char* what) {
  for (size_t r = 0; r < codes.size(); ++r)
    if (codes[r] != 0) {
      std::fprintf(stderr, "--- rank %zu log ---\n%s", r,
                   read_file(g_dir + "/rank" + std::to_string(r) + ".log").c_str());
      return fail("%s: rank %zu exited with %d", what, r, codes[r]);
    }
  return true;
}

// Rank-side helpers ---------------------------------------------------------------------------

bool rerouted_delta(ncclComm_t comm, unsigned long long* before) {
  unsigned long long r = 0, p = 0;
  counters_fn()(comm, &r, &p);
  const bool delta = r > *before;
  *before = r;
  return delta;
}

// Identical bytes on every rank: MAX of (h, ~h) gives max and ~min of the per-rank hashes.
bool identical_everywhere(ncclComm_t comm, const void* data, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  uint64_t w[2] = {h, ~h};
  if (ncclAllReduce(w, w, 2, ncclUint64, ncclMax, comm, nullptr) != ncclSuccess) return false;
  return w[0] == ~w[1];
}

std::string rank_file(int r, const char* what) {
  return g_dir + "/" + what + std::to_string(r);
}
void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

// ---- accuracy: rerouted results against the simulator, both dtypes and ops ------------------
constexpr size_t kCount = 1000003;  // not a multiple of 256: any element count

bool scenario_accuracy(int n, const std::string& topo) {
  dq::sim::SyntheticSpec spec;
  spec.rows = n;
  spec.cols = kCount;
  spec.spread = 1.0;
  spec.seed = 7;
  dq::sim::Matrix rows;
  dq::sim::make_synthetic(spec, &rows);
  auto body = [&](int rank, ncclComm_t comm) -> int {
    unsigned long long seen = 0;
    rerouted_delta(comm, &seen);
    std::string report;
    int call = 0;
    for (int dt = 0; dt < 2; ++dt)
      for (int op = 0; op < 2; ++op)
        for (int inplace = 0; inplace < 2; ++inplace, ++call) {
          const bool bf16 = dt == 1;
          const size_t esize = bf16 ? 2 : 4;
          std::vector<unsigned char> in(kCount * esize), out(kCount * esize, 0xCD);
          for (size_t i = 0; i < kCount; ++i) {
            const float v = rows.row(rank)[i];
            if (bf16) {
              const uint16_t b = dq::f32_to_bf16_rne(v);
              std::memcpy(&in[i * 2], &b, 2);
            } else {
              std::memcpy(&in[i * 4], &v, 4);
            }
          }
          void* dst = inplace ? in.data() : out.data();
          const ncclResult_t res =
              ncclAllReduce(in.data(), dst, kCount, bf16 ? ncclBfloat16 : ncclFloat32,
                            op ? ncclAvg : ncclSum, comm, nullptr);
          if (res != ncclSuccess) return 10;
          const bool rerouted = rerouted_delta(comm, &seen);
          const auto* res_bytes = static_cast<const unsigned char*>(dst);
          const bool same = identical_everywhere(comm, dst, kCount * esize);
          // The error against the exact FP64 sum of what every rank contributed.
          double num = 0, den = 0;
          bool finite = true;
          for (size_t i = 0; i < kCount; ++i) {
            double exact = 0;
            for (int w = 0; w < n; ++w)
              exact += bf16 ? dq::bf16_to_f32(dq::f32_to_bf16_rne(rows.row(w)[i])) : rows.row(w)[i];
            if (op) exact /= n;
            float got;
            if (bf16) {
              uint16_t b;
              std::memcpy(&b, res_bytes + i * 2, 2);
              got = dq::bf16_to_f32(b);
            } else {
              std::memcpy(&got, res_bytes + i * 4, 4);
            }
            finite = finite && std::isfinite(got);
            num += (got - exact) * (got - exact);
            den += exact * exact;
          }
          char line[256];
          std::snprintf(line, sizeof line, "%d %d %d %d %d %d %d %.6e\n", call, dt, op, inplace,
                        rerouted, same, finite, num / den);
          report += line;
        }
    write_text(rank_file(rank, "accuracy"), report);
    return 0;
  };
  Env env = {{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_TOPO", topo}};
  auto codes = run_ranks(n, [&](int) { return env; }, body, 600);
  if (!all_zero(codes, "accuracy")) return false;

  // The simulator's vNMSE for the same rows, codec, schedule, seed and call numbers.
  dq::topo::Kind kind;
  dq::topo::parse_kind(topo, &kind);
  dq::topo::Schedule sched;
  if (dq::topo::make_schedule(kind, n, &sched) != dq::Status::kOk) return fail("schedule");
  const std::string r0 = read_file(rank_file(0, "accuracy"));
  for (int r = 1; r < n; ++r)
    EXPECT(read_file(rank_file(r, "accuracy")) == r0, "rank %d reports differ from rank 0's:\n%s\n%s", r,
           read_file(rank_file(r, "accuracy")).c_str(), r0.c_str());
  std::istringstream lines(r0);
  int checked = 0;
  double engine_sum = 0, sim_sum = 0, floor_sum = 0;
  for (int k = 0; k < 8; ++k) {
    int call, dt, op, inplace, rerouted, same, finite;
    double vnmse;
    lines >> call >> dt >> op >> inplace >> rerouted >> same >> finite >> vnmse;
    EXPECT(lines.good(), "accuracy report truncated:\n%s", r0.c_str());
    std::vector<float> conv(static_cast<size_t>(n) * kCount);
    std::vector<const float*> ptrs;
    for (int w = 0; w < n; ++w) {
      for (size_t i = 0; i < kCount; ++i)
        conv[w * kCount + i] = dt ? dq::bf16_to_f32(dq::f32_to_bf16_rne(rows.row(w)[i])) : rows.row(w)[i];
      ptrs.push_back(conv.data() + w * kCount);
    }
    std::string err;
    auto codec = dq::make_codec("dynamiq:5", &err);
    dq::sim::SimOptions opt;
    opt.seed = 24301;  // DYNAMIQ_SEED's default
    opt.call = static_cast<uint64_t>(call);
    opt.op = op ? dq::ReduceOp::kAvg : dq::ReduceOp::kSum;
    dq::sim::SimResult sim;
    if (dq::sim::simulate_allreduce(*codec, sched, ptrs, kCount, opt, nullptr, &sim) != dq::Status::kOk)
      return fail("simulate");
    // A BF16 result adds its own rounding (2^-9 relative, squared ~1e-6 of the energy).
    const double floor = dt ? 4e-6 : 0.0;
    std::printf("n=%d %s %s %s %s: rerouted %d identical %d finite %d vNMSE %.4e (simulated %.4e)\n",
                n, topo.c_str(), dt ? "bf16" : "f32", op ? "avg" : "sum",
                inplace ? "in-place" : "out-of-place", rerouted, same, finite, vnmse, sim.vnmse);
    EXPECT(rerouted == 1, "call %d was not rerouted", call);
    EXPECT(same == 1, "call %d: results differ across ranks", call);
    EXPECT(finite == 1, "call %d: non-finite result from finite inputs", call);
    // One call's vNMSE varies by ~20% with the random draws; a wrong hop, key or statistic
    // costs far more than 2x. The mean over the 8 calls is held to a tighter band below.
    EXPECT(vnmse <= 2.0 * sim.vnmse + floor && vnmse >= 0.5 * sim.vnmse,
           "call %d: vNMSE %.4e vs simulated %.4e", call, vnmse, sim.vnmse);
    engine_sum += vnmse;
    sim_sum += sim.vnmse;
    floor_sum += floor;
    ++checked;
  }
  std::printf("mean vNMSE over 8 calls: engine %.4e, simulator %.4e\n", engine_sum / 8, sim_sum / 8);
  EXPECT(engine_sum <= 1.25 * sim_sum + floor_sum && engine_sum >= 0.8 * sim_sum,
         "mean vNMSE %.4e vs simulated %.4e", engine_sum / 8, sim_sum / 8);
  return checked == 8;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: shim_multirank SCENARIO NRANKS [TOPO]\n");
    return 2;
  }
  if (counters_fn() == nullptr) {
    std::printf("SKIP: libdynamiq.so is not preloaded\n");
    return 77;
  }
  char tmpl[] = "/tmp/dq-shim-test-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  g_dir = tmpl;
  const std::string scenario = argv[1];
  const int n = std::atoi(argv[2]);
  bool ok = false;
  if (scenario == "accuracy") {
    ok = scenario_accuracy(n, argc > 3 ? argv[3] : "ring");
  } else {
    std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
    return 2;
  }
  std::printf("%s: %s with %d ranks\n", ok ? "PASS" : "FAIL", scenario.c_str(), n);
  if (ok) std::system(("rm -rf " + g_dir).c_str());
  return ok ? 0 : 1;
}
