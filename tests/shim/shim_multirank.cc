// End-to-end tests of libdynamiq.so on the CPU NCCL: each run forks N rank processes (the shim
// is preloaded by the test's environment), gives each its own DYNAMIQ_* settings, and checks
// what an application would see. Usage: shim_multirank SCENARIO NRANKS [TOPO]
// Exit 0 pass, 1 fail, 77 skip (shim not preloaded).
// (accuracy takes TOPO and optionally DYNAMIQ_BLOCK_BYTES; kill, kill_reducescatter and
// kill_reduce take the number of runs; reducescatter and reduce take TOPO.)
#include <dlfcn.h>
#include <signal.h>
#include <tbb/task_arena.h>
#include <unistd.h>
#include <xmmintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/nccl_api.h"
#include "config/settings.h"
#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "kernels/dynamiq_layout.h"
#include "tests/common/check.h"
#include "tests/common/rank_harness.h"
#include "tests/common/test_data.h"
#include "tests/shim/shim_test_util.h"
#include "tools/sim/gradients.h"
#include "tools/sim/simulate.h"
#include "topo/schedule.h"

namespace {

using namespace dq::shim_test;
using BytesFn = int (*)(void*, unsigned long long*, unsigned long long*);
using RegisterFn = int (*)(void*, int);

BytesFn bytes_fn() {
  return reinterpret_cast<BytesFn>(dlsym(RTLD_DEFAULT, "dynamiqCommBytes"));
}

using dq::test::fail;

// Rank-side helpers ---------------------------------------------------------------------------

bool rerouted_delta(ncclComm_t comm, unsigned long long* before) {
  unsigned long long r = 0, p = 0;
  counters_fn()(comm, &r, &p);
  const bool delta = r > *before;
  *before = r;
  return delta;
}

// ---- accuracy: rerouted results against the simulator, both dtypes and ops ------------------
constexpr size_t kCount = 1000003;  // not a multiple of 256: any element count

// The vNMSE of an all-reduce result (`got_bytes`: kCount FP32 or BF16 values) against the exact
// FP64 sum (avg: the mean) of what every rank contributed (its row, rounded to BF16 for a BF16
// call); *finite false when the result holds a non-finite value.
double result_vnmse(const dq::sim::Matrix& rows, int n, bool bf16, bool avg,
                    const unsigned char* got_bytes, bool* finite) {
  double num = 0, den = 0;
  for (size_t i = 0; i < kCount; ++i) {
    double exact = 0;
    for (int w = 0; w < n; ++w) exact += input(rows, w, i, bf16);
    if (avg) exact /= n;
    const float got = dq::test::load_element(got_bytes, i, bf16);
    *finite = *finite && std::isfinite(got);
    num += (got - exact) * (got - exact);
    den += exact * exact;
  }
  return num / den;
}

// From 16 ranks the statistics' all-zero counts are bytes, summed as unsigned 8-bit integers
// (docs/FORMAT.md). So that both byte lanes carry counts there, every odd super-group (the high
// byte of its count word) is one worker's alone, all zero on the others. The engine and the
// simulator read the counts through the same helpers, so this holds the engine to the simulator
// on such data; it cannot tell how the counts were summed (bytes summed as BF16 passed it,
// tried by hand): engine_byte_counts (engine_multirank.cc) checks the all-reduces themselves.
void one_owner_odd_supergroups(int n, dq::sim::Matrix* rows) {
  for (size_t j = 1; j * 256 < rows->cols; j += 2)
    for (int w = 0; w < n; ++w)
      if (static_cast<size_t>(w) != (j / 2) % static_cast<size_t>(n))
        for (size_t i = j * 256; i < std::min(rows->cols, j * 256 + 256); ++i)
          rows->data[static_cast<size_t>(w) * rows->cols + i] = 0.0f;
}

bool scenario_accuracy(int n, const std::string& topo, const std::string& block_bytes) {
  dq::sim::Matrix rows;
  make_rows(n, kCount, 7, &rows);
  if (n >= 16) one_owner_odd_supergroups(n, &rows);
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
          std::vector<unsigned char> in = typed_input(rows, rank, kCount, bf16);
          std::vector<unsigned char> out(kCount * esize, 0xCD);
          void* dst = inplace ? in.data() : out.data();
          const ncclResult_t res =
              ncclAllReduce(in.data(), dst, kCount, bf16 ? ncclBfloat16 : ncclFloat32,
                            op ? ncclAvg : ncclSum, comm, nullptr);
          if (res != ncclSuccess) return 10;
          const bool rerouted = rerouted_delta(comm, &seen);
          const auto* res_bytes = static_cast<const unsigned char*>(dst);
          const bool same = same_bytes_everywhere(comm, dst, kCount * esize);
          bool finite = true;
          const double vnmse = result_vnmse(rows, n, bf16, op != 0, res_bytes, &finite);
          char line[256];
          std::snprintf(line, sizeof line, "%d %d %d %d %d %d %d %.6e\n", call, dt, op, inplace,
                        rerouted, same, finite, vnmse);
          report += line;
        }
    write_text(rank_file(rank, "accuracy"), report);
    return 0;
  };
  Env env = {{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_TOPO", topo}, {"DYNAMIQ_BLOCK_BYTES", block_bytes}};
  auto codes = run_ranks(
      n, [&](int) { return env; }, body, 600);
  if (!all_zero(codes, "accuracy")) return false;

  // The simulator's vNMSE for the same rows, codec, schedule, seed and call numbers.
  dq::topo::Kind kind;
  dq::topo::parse_kind(topo, &kind);
  dq::topo::Schedule sched;
  if (dq::topo::make_schedule(kind, n, &sched) != dq::Status::kOk) return fail("schedule");
  const std::string r0 = read_file(rank_file(0, "accuracy"));
  for (int r = 1; r < n; ++r)
    EXPECT(read_file(rank_file(r, "accuracy")) == r0,
           "rank %d reports differ from rank 0's:\n%s\n%s", r,
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
      for (size_t i = 0; i < kCount; ++i) conv[w * kCount + i] = input(rows, w, i, dt);
      ptrs.push_back(conv.data() + w * kCount);
    }
    std::string err;
    auto codec = dq::make_codec("dynamiq:5", &err);
    dq::sim::SimOptions opt;
    opt.seed = 24301;  // DYNAMIQ_SEED's default
    opt.call = static_cast<uint64_t>(call);
    opt.op = op ? dq::ReduceOp::kAvg : dq::ReduceOp::kSum;
    dq::sim::SimResult sim;
    if (dq::sim::simulate_allreduce(*codec, sched, ptrs, kCount, opt, nullptr, &sim) !=
        dq::Status::kOk)
      return fail("simulate");
    // A BF16 result adds its own rounding (2^-9 relative, squared ~1e-6 of the energy).
    const double floor = dt ? 4e-6 : 0.0;
    std::printf(
        "n=%d %s %s %s %s: rerouted %d identical %d finite %d vNMSE %.4e (simulated %.4e)\n", n,
        topo.c_str(), dt ? "bf16" : "f32", op ? "avg" : "sum",
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
  std::printf("mean vNMSE over 8 calls: engine %.4e, simulator %.4e\n", engine_sum / 8,
              sim_sum / 8);
  EXPECT(engine_sum <= 1.25 * sim_sum + floor_sum && engine_sum >= 0.8 * sim_sum,
         "mean vNMSE %.4e vs simulated %.4e", engine_sum / 8, sim_sum / 8);
  return checked == 8;
}

// ---- pass-through: exactly NCCL's result for every call dynamiq does not reroute ------------
// Integer-valued floats sum exactly in any order, so "exact" is checkable bit for bit.
float exact_value(int rank, size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + rank * 13) % 97) - 48);
}

bool exact_sum_check(int n, const float* got, size_t count, bool avg) {
  for (size_t i = 0; i < count; ++i) {
    double want = 0;
    for (int r = 0; r < n; ++r) want += exact_value(r, i);
    if (avg) want = static_cast<float>(want) / static_cast<float>(n);
    if (got[i] != static_cast<float>(want)) return false;
  }
  return true;
}

// Runs one float all-reduce of `count` values; returns 0 when exact, 20 + k otherwise; sets
// *rerouted from dynamiq's counters.
int exact_float_call(int n, int rank, ncclComm_t comm, size_t count, ncclRedOp_t op, bool* rerouted,
                     unsigned long long* seen) {
  std::vector<float> in(count), out(count, -1.0f);
  for (size_t i = 0; i < count; ++i) in[i] = exact_value(rank, i);
  if (ncclAllReduce(in.data(), out.data(), count, ncclFloat32, op, comm, nullptr) != ncclSuccess)
    return 21;
  *rerouted = rerouted_delta(comm, seen);
  if (op == ncclMax) {
    for (size_t i = 0; i < count; ++i) {
      float want = exact_value(0, i);
      for (int r = 1; r < n; ++r) want = std::max(want, exact_value(r, i));
      if (out[i] != want) return 22;
    }
    return 0;
  }
  return exact_sum_check(n, out.data(), count, op == ncclAvg) ? 0 : 23;
}

bool scenario_passthrough(int n) {
  auto body = [&](int rank, ncclComm_t comm) -> int {
    unsigned long long seen = 0;
    rerouted_delta(comm, &seen);
    bool rerouted = false;
    int rc;
    // Below DYNAMIQ_MIN_BYTES (set to 64 KiB here): 1000 floats.
    if ((rc = exact_float_call(n, rank, comm, 1000, ncclSum, &rerouted, &seen)) || rerouted)
      return 30 + rc;
    // Above it, but with fewer than dq::kMinSuperGroupsPerChunk (64) super-groups per chunk
    // message (the budget's fixed costs would leave most widths at 2 bits): passes through,
    // exact. At the floor it is compressed. (auto topology: n chunks for ring and butterfly.)
    static_assert(dq::kMinSuperGroupsPerChunk == 64, "the scenario is sized for 64");
    const size_t edge = static_cast<size_t>(n) * dq::kMinSuperGroupsPerChunk * 256;
    if ((rc = exact_float_call(n, rank, comm, edge - 256, ncclSum, &rerouted, &seen)) || rerouted)
      return 35 + rc;
    rc = exact_float_call(n, rank, comm, edge, ncclSum, &rerouted, &seen);
    if ((rc != 0 && rc != 23) || !rerouted) return 38;
    // Other ops at a size that would be rerouted for SUM.
    if ((rc = exact_float_call(n, rank, comm, 1 << 20, ncclMax, &rerouted, &seen)) || rerouted)
      return 40 + rc;
    // Other dtypes: int32 sum.
    {
      const size_t count = 1 << 20;
      std::vector<int32_t> in(count), out(count);
      for (size_t i = 0; i < count; ++i) in[i] = static_cast<int32_t>(i % 1000) * (rank + 1);
      if (ncclAllReduce(in.data(), out.data(), count, ncclInt32, ncclSum, comm, nullptr) !=
          ncclSuccess)
        return 50;
      if (rerouted_delta(comm, &seen)) return 51;
      for (size_t i = 0; i < count; ++i)
        if (out[i] != static_cast<int32_t>(i % 1000) * n * (n + 1) / 2) return 52;
    }
    // Inside the caller's group, an eligible call is held back and compressed when the group
    // ends (docs/ENGINE.md section 8); a small one joins the real group and is exact.
    {
      const size_t count = 1 << 20;
      std::vector<float> in(count), out(count), small_out(1000);
      for (size_t i = 0; i < count; ++i) in[i] = exact_value(rank, i);
      if (ncclGroupStart() != ncclSuccess) return 60;
      if (ncclAllReduce(in.data(), small_out.data(), 1000, ncclFloat32, ncclSum, comm, nullptr) !=
          ncclSuccess)
        return 61;
      if (rerouted_delta(comm, &seen)) return 62;  // nothing has run yet
      if (ncclAllReduce(in.data(), out.data(), count, ncclFloat32, ncclSum, comm, nullptr) !=
          ncclSuccess)
        return 63;
      if (ncclGroupEnd() != ncclSuccess) return 64;
      if (!rerouted_delta(comm, &seen)) return 65;
      if (!exact_sum_check(n, small_out.data(), 1000, false)) return 66;
    }
    // Other collectives: broadcast is NCCL's own.
    {
      const size_t count = 1 << 20;
      std::vector<float> buf(count);
      for (size_t i = 0; i < count; ++i) buf[i] = rank == 0 ? exact_value(0, i) : 0.0f;
      if (ncclBroadcast(buf.data(), buf.data(), count, ncclFloat32, 0, comm, nullptr) !=
          ncclSuccess)
        return 70;
      for (size_t i = 0; i < count; ++i)
        if (buf[i] != exact_value(0, i)) return 71;
    }
    // And an eligible call right after all of that is rerouted (the test would be vacuous if
    // compression were simply off).
    if ((rc = exact_float_call(n, rank, comm, 1 << 20, ncclSum, &rerouted, &seen)) != 0 && rc != 23)
      return 80 + rc;
    return rerouted ? 0 : 89;
  };
  auto codes = run_ranks(
      n,
      [](int) {
        return Env{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_MIN_BYTES", "64K"}};
      },
      body, 300);
  return all_zero(codes, "passthrough");
}

// Communicators not opted in pass through; name and color rules and the C API select them.
bool scenario_optin(int n) {
  auto body = [&](int rank, ncclComm_t comm) -> int {
    unsigned long long seen_a = 0, seen_b = 0, seen_c = 0;
    bool rerouted = false;
    int rc;
    // `comm` is named "grad.main" (matches name=grad*).
    rerouted_delta(comm, &seen_a);
    if ((rc = exact_float_call(n, rank, comm, 1 << 20, ncclSum, &rerouted, &seen_a)) != 0 &&
        rc != 23)
      return 10 + rc;
    if (!rerouted) return 11;
    // A split of color 5 (DYNAMIQ_COMMS has no color=5 term): passes through, exact.
    ncclComm_t split5 = nullptr;
    if (ncclCommSplit(comm, 5, rank, &split5, nullptr) != ncclSuccess || !split5) return 20;
    // A split of color 3 is selected by color=3 ... unless the C API opts it out first.
    ncclComm_t split3 = nullptr;
    if (ncclCommSplit(comm, 3, rank, &split3, nullptr) != ncclSuccess || !split3) return 30;
    auto reg = reinterpret_cast<RegisterFn>(dlsym(RTLD_DEFAULT, "dynamiqCommRegister"));
    if (reg == nullptr) return 31;
    // The name "grad.main" is inherited by splits: opt split5 out explicitly, split3 stays in.
    if (reg(split5, 0) != 0) return 32;
    rerouted_delta(split5, &seen_b);
    if ((rc = exact_float_call(n, rank, split5, 1 << 20, ncclSum, &rerouted, &seen_b)) != 0)
      return 40 + rc;
    if (rerouted) return 41;
    rerouted_delta(split3, &seen_c);
    if ((rc = exact_float_call(n, rank, split3, 1 << 20, ncclSum, &rerouted, &seen_c)) != 0 &&
        rc != 23)
      return 50 + rc;
    if (!rerouted) return 51;
    // Registering after the first all-reduce is refused (it could diverge across ranks).
    if (reg(split3, 0) != ncclInvalidUsage) return 52;
    ncclCommDestroy(split5);
    ncclCommDestroy(split3);
    return 0;
  };
  auto codes = run_ranks(
      n,
      [](int) {
        return Env{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_COMMS", "name=grad*,color=3"}};
      },
      body, 300, "grad.main");
  if (!all_zero(codes, "optin")) return false;
  // And a communicator matching no term is left alone.
  auto body2 = [&](int rank, ncclComm_t comm) -> int {
    unsigned long long seen = 0;
    bool rerouted = false;
    rerouted_delta(comm, &seen);
    const int rc = exact_float_call(n, rank, comm, 1 << 20, ncclSum, &rerouted, &seen);
    return rc ? rc : (rerouted ? 1 : 0);
  };
  codes = run_ranks(
      n,
      [](int) {
        return Env{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_COMMS", "name=grad*"}};
      },
      body2, 300, "optimizer.state");
  return all_zero(codes, "optin (not selected)");
}

// Ranks with different settings: every rank passes through, results exact, one warning each.
bool scenario_mismatch(int n) {
  struct Case {
    std::string key;
    std::string value;
  };
  // A valid value other than the default for every setting the wire protocol depends on. Each of
  // them must be agreed (a rank with another value would issue other messages); the test is
  // driven from the table: every agreed entry of settings.def is tried on its own, and an agreed
  // entry missing here fails the test, as does one of these no longer agreed.
  const std::vector<std::pair<std::string, std::string>> kAlternative = {
      {"DYNAMIQ_ENABLE", "0"},
      {"DYNAMIQ_CODEC", "mxfp8"},
      {"DYNAMIQ_BITS", "6"},
      {"DYNAMIQ_TARGET", "mxfp6"},
      {"DYNAMIQ_CHECK_EVERY", "5"},
      {"DYNAMIQ_TOPO", "ring"},
      {"DYNAMIQ_HIERARCHY", "flat"},
      {"DYNAMIQ_MIN_BYTES", "64K"},
      {"DYNAMIQ_DTYPES", "float32"},
      {"DYNAMIQ_COLLECTIVES", "reduce"},
      {"DYNAMIQ_CORRELATED", "0"},
      {"DYNAMIQ_SEED", "7"},
      {"DYNAMIQ_COMMS", "name=nothing*"},
      {"DYNAMIQ_BLOCK_BYTES", "4M"},
      {"DYNAMIQ_CONTROL_WINDOW", "3"},
      {"DYNAMIQ_PLAN_CACHE", "5"}};
  std::vector<Case> cases;
  for (int i = 0; i < dq::config::Agreed::count(); ++i) {
    const std::string key = dq::config::Agreed::key(i);
    auto it = std::find_if(kAlternative.begin(), kAlternative.end(),
                           [&](const auto& kv) { return kv.first == key; });
    EXPECT(it != kAlternative.end(),
           "agreed setting %s has no alternative value in this test: add one", key.c_str());
    cases.push_back({key, it->second});
  }
  for (const auto& [key, value] : kAlternative) {
    bool agreed = false;
    for (int i = 0; i < dq::config::Agreed::count(); ++i)
      agreed |= key == dq::config::Agreed::key(i);
    EXPECT(agreed,
           "%s is no longer an agreed setting: ranks with different values would issue "
           "different messages",
           key.c_str());
  }
  cases.push_back({"DYNAMIQ_BITS", "banana"});  // invalid on one rank
  for (const Case& c : cases) {
    const int odd = n - 1;  // the last rank differs
    auto body = [&](int rank, ncclComm_t comm) -> int {
      unsigned long long seen = 0;
      bool rerouted = false;
      rerouted_delta(comm, &seen);
      for (int k = 0; k < 3; ++k) {  // several calls: still one warning
        const int rc = exact_float_call(n, rank, comm, 1 << 20, ncclSum, &rerouted, &seen);
        if (rc) return rc;
        if (rerouted) return 5;
      }
      return 0;
    };
    auto env = [&](int rank) {
      Env e{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_TOPO", "butterfly"}};
      // A target steers only auto's budget (with a fixed one it is refused, as invalid): every
      // rank takes auto so that the target alone differs.
      if (c.key == "DYNAMIQ_TARGET") e.push_back({"DYNAMIQ_BITS", "auto"});
      if (rank == odd) e.push_back({c.key, c.value});
      return e;
    };
    auto codes = run_ranks(n, env, body, 300);
    if (!all_zero(codes, c.key.c_str())) return false;
    const bool invalid = c.value == "banana";
    for (int r = 0; r < n; ++r) {
      const std::string log = rank_log(r);
      const int warnings = count_occurrences(log, "disagree on:");
      EXPECT(warnings == 1, "%s=%s: rank %d printed %d disagreement warnings:\n%s", c.key.c_str(),
             c.value.c_str(), r, warnings, log.c_str());
      const std::string named = invalid ? "validity of the DYNAMIQ_* environment" : c.key;
      EXPECT(log.find(named) != std::string::npos, "%s: rank %d's warning does not name %s:\n%s",
             c.key.c_str(), r, named.c_str(), log.c_str());
      if (invalid && r == odd)
        EXPECT(log.find("DYNAMIQ_BITS=banana is not valid; accepted: 3..16") != std::string::npos,
               "rank %d does not explain its invalid setting:\n%s", r, log.c_str());
    }
    std::printf("%s differs on rank %d: every rank passed through, exact, one warning each\n",
                c.key.c_str(), odd);
  }
  return true;
}

// A NaN or an Inf in one rank's input, FP32 and BF16, SUM and AVG: non-finite result on every
// rank, identical everywhere; far-away values stay finite.
bool scenario_nan(int n) {
  const size_t count = 1 << 20, where = 777777;
  auto body = [&](int rank, ncclComm_t comm) -> int {
    unsigned long long seen = 0;
    rerouted_delta(comm, &seen);
    for (int k = 0; k < 8; ++k) {
      const bool inf = k & 1, avg = k & 2, bf16 = k & 4;
      const size_t esize = bf16 ? 2 : 4;
      std::vector<unsigned char> in(count * esize), out(count * esize);
      auto put = [&](size_t i, float v) {
        if (bf16) {
          const uint16_t h = dq::f32_to_bf16_rne(v);
          std::memcpy(&in[i * 2], &h, 2);
        } else {
          std::memcpy(&in[i * 4], &v, 4);
        }
      };
      auto got = [&](size_t i) {
        float v;
        if (bf16) {
          uint16_t h;
          std::memcpy(&h, &out[i * 2], 2);
          v = dq::bf16_to_f32(h);
        } else {
          std::memcpy(&v, &out[i * 4], 4);
        }
        return v;
      };
      for (size_t i = 0; i < count; ++i) put(i, exact_value(rank, i) * 1e-3f);
      if (rank == n - 1) put(where, inf ? INFINITY : NAN);
      if (ncclAllReduce(in.data(), out.data(), count, bf16 ? ncclBfloat16 : ncclFloat32,
                        avg ? ncclAvg : ncclSum, comm, nullptr) != ncclSuccess)
        return 10 + 10 * k;
      if (!rerouted_delta(comm, &seen)) return 11 + 10 * k;
      if (std::isfinite(got(where))) {
        std::fprintf(stderr, "rank %d: %s %s %s: element %zu = %g, finite\n", rank,
                     bf16 ? "bf16" : "fp32", avg ? "avg" : "sum", inf ? "inf" : "nan", where,
                     got(where));
        return 12 + 10 * k;
      }
      if (!same_bytes_everywhere(comm, out.data(), out.size())) return 13 + 10 * k;
      // Only the poisoned super-group is lost: far-away values stay finite.
      if (!std::isfinite(got(0)) || !std::isfinite(got(count - 1))) return 14 + 10 * k;
    }
    return 0;
  };
  auto codes = run_ranks(
      n,
      [](int) {
        return Env{{"DYNAMIQ_ENABLE", "1"}};
      },
      body, 300);
  return all_zero(codes, "nan");
}

// ---- float_env: the application's floating-point environment changes nothing ----------------
// Each rank's thread environment is the application's (MXCSR on x86-64): flush-to-zero and
// denormals-are-zero (torch.set_flush_denormal(True), a library built with -Ofast), another
// rounding (fesetround), an unmasked invalid-operation trap (feenableexcept). The same compressed
// calls, with super-groups near and below FP32's smallest normal and a NaN, run once with every
// rank at the default environment and once with ranks 1..3 each in one of those: the outputs must
// be the same bytes as the default run's on every rank, no rank may trap, and each rank's
// environment must be exactly as it set it after every call, flags included (common/float_env.h).
// Without the guard, each of the three alone made the ranks' outputs differ from one another on
// the first call, the trap killed its rank (SIGFPE), and the calls left exception flags set.
constexpr uint32_t kMxcsrDefault = 0x1F80;
constexpr uint32_t kMxcsrFtzDaz = kMxcsrDefault | 0x8040;
constexpr uint32_t kMxcsrUpwardInvalidTraps = (kMxcsrDefault | 0x4000) & ~0x0080u;
constexpr uint32_t kMxcsrTowardZero = kMxcsrDefault | 0x6000;

bool scenario_float_env(int n) {
  const size_t count = 1 << 20;
  // Each rank writes the FNV-1a digest of the job's outputs to its file, in hex.
  auto job = [&](bool changed) {
    auto body = [&, changed](int rank, ncclComm_t comm) -> int {
      const uint32_t changes[] = {kMxcsrFtzDaz, kMxcsrUpwardInvalidTraps, kMxcsrTowardZero};
      const uint32_t mine = !changed || rank == 0 ? kMxcsrDefault : changes[(rank - 1) % 3];
      // Scales by super-group: unit, 1e-3, FP32's smallest normals, subnormals only.
      const float scales[] = {1.0f, 1e-3f, 2e-38f, 3e-40f};
      uint64_t digest = 1469598103934665603ull;
      unsigned long long seen = 0;
      rerouted_delta(comm, &seen);
      for (int k = 0; k < 4; ++k) {
        const bool bf16 = k & 1, avg = k & 2;
        const size_t esize = bf16 ? 2 : 4;
        std::vector<unsigned char> in(count * esize), out(count * esize);
        for (size_t i = 0; i < count; ++i) {
          const float v = i == 123457 && rank == n - 1
                              ? NAN
                              : exact_value(rank, i) * scales[(i / 256) % 4] / 16.0f;
          if (bf16) {
            const uint16_t h = dq::f32_to_bf16_rne(v);
            std::memcpy(&in[i * 2], &h, 2);
          } else {
            std::memcpy(&in[i * 4], &v, 4);
          }
        }
        _mm_setcsr(mine);
        const ncclResult_t rc =
            ncclAllReduce(in.data(), out.data(), count, bf16 ? ncclBfloat16 : ncclFloat32,
                          avg ? ncclAvg : ncclSum, comm, nullptr);
        const uint32_t after = _mm_getcsr();
        _mm_setcsr(kMxcsrDefault);
        if (rc != ncclSuccess) return 10 + 10 * k;
        if (after != mine) {
          std::fprintf(stderr, "rank %d: MXCSR %#x after the call, %#x before\n", rank, after,
                       mine);
          return 11 + 10 * k;
        }
        if (!rerouted_delta(comm, &seen)) return 12 + 10 * k;
        if (!same_bytes_everywhere(comm, out.data(), out.size())) return 13 + 10 * k;
        for (unsigned char b : out) digest = (digest ^ b) * 1099511628211ull;
      }
      char hex[32];
      std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(digest));
      write_text(rank_file(rank, changed ? "float_env_changed." : "float_env_default."), hex);
      return 0;
    };
    auto enabled = [](int) { return Env{{"DYNAMIQ_ENABLE", "1"}}; };
    return all_zero(run_ranks(n, enabled, body, 300),
                    changed ? "float_env, changed environments" : "float_env, default");
  };
  if (!job(false) || !job(true)) return false;
  const std::string want = read_file(rank_file(0, "float_env_default."));
  for (int r = 0; r < n; ++r) {
    const std::string got = read_file(rank_file(r, "float_env_changed."));
    if (want.empty() || got != want)
      return fail("float_env: rank %d's outputs (digest %s) differ from the default run's (%s)", r,
                  got.c_str(), want.c_str());
  }
  std::printf(
      "float_env: %d ranks, 4 calls each: the same bytes with ranks in FTZ+DAZ, upward "
      "rounding with invalid trapping, and rounding toward zero as at the default\n",
      n);
  return true;
}

// A rank killed mid-job: every other rank gets an error from its collective within the timeout.
// `collective`: allreduce, reducescatter (4M floats of input, n blocks) or reduce (root 0; the
// victim runs through every rank, root included).
bool scenario_killed_rank(int n, int runs, const std::string& collective = "allreduce") {
  KillSpec spec;
  spec.n = n;
  spec.count = 4 << 20;
  spec.timeout_ms = 3000;
  spec.victim_step = 1;  // the victim is rank run % n
  spec.victim_offset = 0;
  spec.delay_step_ms = 9;  // 0-45 ms into call 2
  spec.delay_mod_ms = 50;
  spec.env = [&](int) {
    return Env{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_TIMEOUT_MS", std::to_string(spec.timeout_ms)}};
  };
  spec.label = "killed rank";
  return scenario_kill(spec, runs, collective);
}

// A peer stalled past DYNAMIQ_TIMEOUT_MS but well within the CPU NCCL's own timeout: the other
// ranks' engines give up waiting for the new plan's agreement, a failure the CPU NCCL does not
// share. Through the shim's ncclCommGetAsyncError (read twice) and a further call, the
// communicator reports that error every time until the application aborts it, and
// ncclGetLastError gives the engine's warning; the stalled rank,
// once it wakes, gets an error too (its peers no longer take part).
bool scenario_stalled_peer(int n) {
  constexpr int kTimeoutMs = 1000, kStallMs = 4000, kStalled = 1;
  auto body = [&](int rank, ncclComm_t comm) -> int {
    const size_t first = 1 << 20, second = (1 << 20) + 4096;  // a new shape: a new plan
    std::vector<float> in(second, 1.0f), out(second);
    unsigned long long seen = 0;
    rerouted_delta(comm, &seen);
    if (ncclAllReduce(in.data(), out.data(), first, ncclFloat32, ncclSum, comm, nullptr) !=
            ncclSuccess ||
        !rerouted_delta(comm, &seen) || out[0] != static_cast<float>(n))
      return 10;
    if (rank == kStalled) {
      std::this_thread::sleep_for(std::chrono::milliseconds(kStallMs));
      const ncclResult_t r =
          ncclAllReduce(in.data(), out.data(), second, ncclFloat32, ncclSum, comm, nullptr);
      std::fprintf(stderr, "rank %d: woke, its call returned %s\n", rank, ncclGetErrorString(r));
      ncclCommAbort(comm);
      std::fflush(stderr);
      _exit(r != ncclSuccess ? 0 : 11);
    }
    const auto t0 = std::chrono::steady_clock::now();
    const ncclResult_t r =
        ncclAllReduce(in.data(), out.data(), second, ncclFloat32, ncclSum, comm, nullptr);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "rank %d: the call returned %s after %.0f ms\n", rank,
                 ncclGetErrorString(r), ms);
    // Before the stalled rank woke: the engine's own bound, not the CPU NCCL's.
    if (r != ncclRemoteError || ms < kTimeoutMs || ms > kStallMs - 500) return 12;
    auto async_error_is = [&](ncclResult_t want, int read) {
      ncclResult_t e = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm, &e);
      if (q == ncclSuccess && e == want) return true;
      std::fprintf(stderr, "rank %d: ncclCommGetAsyncError read %d: returned %d, error %d (%s)\n",
                   rank, read, static_cast<int>(q), static_cast<int>(e), ncclGetErrorString(e));
      return false;
    };
    if (!async_error_is(r, 1) || !async_error_is(r, 2)) return 13;
    // What a framework puts in its exception ("Last error:"): the engine's reason, not NCCL's
    // text of its own last failure (none: the CPU NCCL's calls all succeeded).
    const std::string last = ncclGetLastError(comm);
    if (last.rfind("dynamiq: ", 0) != 0 || last.find("rank") == std::string::npos) {
      std::fprintf(stderr, "rank %d: ncclGetLastError gave '%s'\n", rank, last.c_str());
      return 17;
    }
    const ncclResult_t again =
        ncclAllReduce(in.data(), out.data(), first, ncclFloat32, ncclSum, comm, nullptr);
    if (again != r) {
      std::fprintf(stderr, "rank %d: the further call returned %s\n", rank,
                   ncclGetErrorString(again));
      return 14;
    }
    if (!async_error_is(r, 3)) return 15;
    // No abort before every waiting rank has seen its own bound: an abort ends this rank's calls
    // stuck on the stalled peer at once, closing its connections, and a slower peer's wait would
    // then fail on the lost connection (ncclSystemError) instead of at its bound.
    write_text(rank_file(rank, "timed_out"), "1");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (int p = 0; p < n; ++p)
      while (p != kStalled && read_file(rank_file(p, "timed_out")).empty() &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (ncclCommAbort(comm) != ncclSuccess) return 16;
    std::fflush(stderr);
    _exit(0);
  };
  auto codes = run_ranks(
      n,
      [&](int) {
        return Env{{"DYNAMIQ_ENABLE", "1"},
                   {"DYNAMIQ_TIMEOUT_MS", std::to_string(kTimeoutMs)},
                   {"DYNAMIQ_CPU_NCCL_TIMEOUT_MS", "20000"},
                   {"DYNAMIQ_NET_TIMEOUT_MS", "20000"}};
      },
      body, 90);
  if (!all_zero(codes, "stalled_peer")) return false;
  std::printf(
      "stalled peer: its peers' calls failed with ncclRemoteError after DYNAMIQ_TIMEOUT_MS, "
      "reported by ncclCommGetAsyncError (three reads) and by a further call until the abort\n");
  return true;
}

// The A/B switch: rank 0's control file flips every rank on the same call.
bool scenario_toggle(int n) {
  ToggleSpec spec;
  spec.n = n;
  spec.env = [](int, const std::string& control) {
    return Env{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_CONTROL_FILE", control}};
  };
  spec.call = [n](int rank, ncclComm_t comm, unsigned long long* seen, bool* rerouted) {
    const int rc = exact_float_call(n, rank, comm, 1 << 20, ncclSum, rerouted, seen);
    return rc != 0 && !(rc == 23 && *rerouted) ? 10 + rc : 0;  // exact whenever passed through
  };
  spec.label = "A/B switch";
  return dq::shim_test::scenario_toggle(spec);
}

// The number on the Prometheus line of metric `name` whose labels contain `label` ("" for
// any); NAN when there is none.
double prom_value(const std::string& text, const std::string& name, const std::string& label) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(name + "{", 0) != 0 || line.find(label) == std::string::npos) continue;
    const size_t close = line.rfind("} ");
    if (close != std::string::npos) return std::strtod(line.c_str() + close + 2, nullptr);
  }
  return NAN;
}

// The C API's budget figures (dynamiqCommBudget, dynamiqCommCheck) under DYNAMIQ_BITS=auto with
// the sampled check on every second call: each figure equals what the same rank's Prometheus
// file says (the API and the metrics read the same counters; a swapped or stale field differs),
// the counts fit the calls made, and every rank reports the same (the statistics, choices and
// checks are all-reduced, so they are identical by construction).
bool scenario_budget_api(int n) {
  using BudgetFn =
      int (*)(void*, unsigned long long*, unsigned long long*, double*, double*, double*);
  using CheckFn = int (*)(void*, unsigned long long*, unsigned long long*, double*,
                          unsigned long long*, double*, double*);
  using FlushFn = int (*)();
  const int calls = 8;
  auto body = [&](int rank, ncclComm_t comm) -> int {
    auto budget = reinterpret_cast<BudgetFn>(dlsym(RTLD_DEFAULT, "dynamiqCommBudget"));
    auto check = reinterpret_cast<CheckFn>(dlsym(RTLD_DEFAULT, "dynamiqCommCheck"));
    auto flush = reinterpret_cast<FlushFn>(dlsym(RTLD_DEFAULT, "dynamiqMetricsFlush"));
    if (budget == nullptr || check == nullptr || flush == nullptr) return 2;
    // Gradient-like rows (super-group scales spread over decades), another draw per call.
    const size_t count = 1 << 20;
    std::vector<float> in(count), out(count);
    for (int k = 0; k < calls; ++k) {
      dq::sim::SyntheticSpec spec;
      spec.rows = static_cast<size_t>(n);
      spec.cols = count;
      spec.spread = 1.5;
      spec.seed = 100 + static_cast<uint64_t>(k);
      dq::sim::Matrix rows;
      make_rows(spec, &rows);
      std::copy(rows.row(static_cast<size_t>(rank)), rows.row(static_cast<size_t>(rank)) + count,
                in.begin());
      if (ncclAllReduce(in.data(), out.data(), count, ncclFloat32, ncclSum, comm, nullptr) !=
          ncclSuccess)
        return 3;
    }
    unsigned long long widths[4] = {}, predicted = 0, mx = 0, checked = 0, paired = 0;
    double vmean = 0, vlast = 0, bits = 0, sampled = 0, pmean = 0, smean = 0;
    if (budget(comm, widths, &predicted, &vmean, &vlast, &bits) != 0) return 4;
    if (check(comm, &mx, &checked, &sampled, &paired, &pmean, &smean) != 0) return 5;
    int dummy = 0;  // not a communicator of ours
    if (budget(&dummy, nullptr, nullptr, nullptr, nullptr, nullptr) != ncclInvalidArgument ||
        check(&dummy, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr) != ncclInvalidArgument)
      return 6;
    if (flush() != 0) return 7;
    char line[512];
    std::snprintf(line, sizeof line,
                  "%llu %llu %llu %llu %llu %.17g %.17g %.17g %llu %llu %.17g %llu %.17g %.17g\n",
                  widths[0], widths[1], widths[2], widths[3], predicted, vmean, vlast, bits, mx,
                  checked, sampled, paired, pmean, smean);
    write_text(rank_file(rank, "budget_api"), line);
    return 0;
  };
  const std::string path = g_dir + "/budget.%r.prom";
  auto codes = run_ranks(
      n,
      [&](int) {
        // A control window of 1: each call reads its predecessor's prediction and checks are read
        // two calls after theirs, so 8 calls make figures of each kind.
        return Env{{"DYNAMIQ_ENABLE", "1"},         {"DYNAMIQ_BITS", "auto"},
                   {"DYNAMIQ_TARGET", "mxfp8"},     {"DYNAMIQ_CHECK_EVERY", "2"},
                   {"DYNAMIQ_CONTROL_WINDOW", "1"}, {"DYNAMIQ_METRICS_FILE", path}};
      },
      body, 300);
  if (!all_zero(codes, "budget_api")) return false;
  const std::string line0 = read_file(rank_file(0, "budget_api"));
  for (int r = 1; r < n; ++r)
    EXPECT(read_file(rank_file(r, "budget_api")) == line0, "rank %d reports %s, rank 0 %s", r,
           read_file(rank_file(r, "budget_api")).c_str(), line0.c_str());
  unsigned long long w[4], predicted, mx, checked, paired;
  double vmean, vlast, bits, sampled, pmean, smean;
  EXPECT(
      std::sscanf(line0.c_str(), "%llu %llu %llu %llu %llu %lg %lg %lg %llu %llu %lg %llu %lg %lg",
                  &w[0], &w[1], &w[2], &w[3], &predicted, &vmean, &vlast, &bits, &mx, &checked,
                  &sampled, &paired, &pmean, &smean) == 14,
      "rank 0 wrote %s", line0.c_str());
  const std::string prom = read_file(g_dir + "/budget.0.prom");
  // The file prints %.9g: equal within 1e-6 relative (a swapped or stale field is far off).
  bool all_same = true;
  auto same = [&](double api, double file, const std::string& what) {
    if (std::fabs(api - file) <= 1e-6 * std::fabs(file)) return;
    fail("%s: API %.9g, metrics file %.9g", what.c_str(), api, file);
    all_same = false;
  };
  auto metric = [&](const char* name, const std::string& label = "") {
    return prom_value(prom, name, label);
  };
  static const char* kWidth[4] = {"2", "4", "8", "16"};
  for (int k = 0; k < 4; ++k) {
    const std::string label = std::string("width=\"") + kWidth[k] + "\"";
    same(static_cast<double>(w[k]), metric("dynamiq_width_supergroups_total", label),
         "width " + std::string(kWidth[k]));
  }
  same(static_cast<double>(predicted), metric("dynamiq_predicted_calls_total"), "predicted calls");
  same(vmean * static_cast<double>(predicted), metric("dynamiq_predicted_vnmse_sum_total"),
       "predicted vNMSE sum");
  same(vlast, metric("dynamiq_predicted_vnmse"), "latest predicted vNMSE");
  same(static_cast<double>(mx), metric("dynamiq_mx_fallback_calls_total"), "MX calls");
  same(static_cast<double>(checked), metric("dynamiq_check_calls_total"), "checked calls");
  same(sampled, metric("dynamiq_check_sq_error_total") / metric("dynamiq_check_energy_total"),
       "sampled vNMSE");
  same(static_cast<double>(paired), metric("dynamiq_check_paired_calls_total"), "paired calls");
  same(pmean * static_cast<double>(paired),
       metric("dynamiq_check_paired_predicted_vnmse_sum_total"), "paired predicted sum");
  same(smean * static_cast<double>(paired), metric("dynamiq_check_paired_sampled_vnmse_sum_total"),
       "paired sampled sum");
  if (!all_same) return false;
  // Counts that fit the calls: predictions for calls 2..8 at most (one call late), checks on
  // every second call, at least one of each; the figures of a real prediction.
  EXPECT(predicted >= 1 && predicted <= calls - 1, "%llu predicted calls of %d", predicted, calls);
  EXPECT(checked >= 1 && checked <= calls / 2 && paired <= checked, "%llu checked, %llu paired",
         checked, paired);
  EXPECT(vmean > 0 && vmean < 0.1 && sampled > 0 && sampled < 0.1,
         "predicted mean %.3g, sampled %.3g", vmean, sampled);
  EXPECT(mx <= static_cast<unsigned long long>(calls) && (bits == 0) == (mx == calls) &&
             (bits == 0 || (bits >= 3 && bits <= 8)),
         "mean bits %.3f with %llu MX calls of %d", bits, mx, calls);
  std::printf(
      "budget API: %llu predicted calls (mean vNMSE %.3g), %llu MX, %llu checked (sampled "
      "%.3g), mean %.2f bits; equal to the metrics file and on every rank\n",
      predicted, vmean, mx, checked, sampled, bits);
  return true;
}

// Metrics: per-communicator counters with reasons, JSON and Prometheus.
bool scenario_metrics(int n) {
  auto body = [&](int rank, ncclComm_t comm) -> int {
    unsigned long long seen = 0;
    bool rerouted = false;
    exact_float_call(n, rank, comm, 1 << 20, ncclSum, &rerouted, &seen);
    exact_float_call(n, rank, comm, 1000, ncclSum, &rerouted, &seen);
    exact_float_call(n, rank, comm, 1 << 20, ncclMax, &rerouted, &seen);
    return 0;
  };
  for (const char* ext : {".json", ".prom"}) {
    const std::string path = g_dir + "/metrics.%r" + ext;
    auto codes = run_ranks(
        n,
        [&](int) {
          return Env{{"DYNAMIQ_ENABLE", "1"},
                     {"DYNAMIQ_METRICS_FILE", path},
                     {"DYNAMIQ_DEBUG", "INFO"},
                     {"DYNAMIQ_DEBUG_SUBSYS", "ENV"}};
        },
        body, 300);
    if (!all_zero(codes, "metrics")) return false;
    for (int r = 0; r < n; ++r) {
      // DYNAMIQ_DEBUG=INFO prints the settings that differ from their defaults once, and no
      // other (DYNAMIQ_SEED keeps its default).
      const std::string log = rank_log(r);
      EXPECT(count_occurrences(log, "dynamiq setting DYNAMIQ_METRICS_FILE=" + path) == 1 &&
                 count_occurrences(log, "dynamiq setting DYNAMIQ_ENABLE=1") == 1 &&
                 count_occurrences(log, "dynamiq setting DYNAMIQ_SEED=") == 0 &&
                 count_occurrences(log, "dynamiq settings: ") == 1,
             "rank %d did not print its changed settings once:\n%s", r, log.c_str());
      const std::string text = read_file(g_dir + "/metrics." + std::to_string(r) + ext);
      EXPECT(!text.empty(), "rank %d wrote no %s metrics", r, ext);
      if (std::string(ext) == ".json") {
        EXPECT(text.find("\"rerouted\":1,") != std::string::npos &&
                   text.find("\"small\":1") != std::string::npos &&
                   text.find("\"op\":1") != std::string::npos &&
                   text.find("\"bytes_in\":4194304") != std::string::npos,
               "rank %d metrics: %s", r, text.c_str());
      } else {
        EXPECT(text.find("outcome=\"rerouted\"} 1") != std::string::npos &&
                   text.find("outcome=\"small\"} 1") != std::string::npos &&
                   text.find("dynamiq_rerouted_bytes_in_total{job_id=") != std::string::npos &&
                   text.find(",comm=\"0\",name=\"\",rank=\"" + std::to_string(r) + "\"} 4194304") !=
                       std::string::npos,
               "rank %d metrics: %s", r, text.c_str());
      }
    }
  }
  std::printf("metrics: JSON and Prometheus files name every outcome\n");
  return true;
}
// ---- reduce-scatter and reduce (FSDP, ZeRO, Megatron) ----------------------------------------
// The schedule the engine runs: DYNAMIQ_TOPO (auto: butterfly for a power of two >= 4, else the
// ring); a reduce-scatter on a butterfly of a rank count that is not a power of two runs on the
// ring (it needs one chunk ending at every rank).
dq::topo::Kind engine_kind(const std::string& topo, int n, bool reduce_scatter) {
  const bool pow2 = (n & (n - 1)) == 0;
  dq::topo::Kind kind = dq::topo::Kind::kRing;
  if (topo == "butterfly" || (topo == "auto" && pow2 && n >= 4)) kind = dq::topo::Kind::kButterfly;
  if (reduce_scatter && kind == dq::topo::Kind::kButterfly && !pow2) kind = dq::topo::Kind::kRing;
  return kind;
}

// The eight variants of a compressed call, in call order: dtype (FP32, BF16) x op (SUM, AVG) x
// placement (out of place, in place). Call k is the engine's compressed call k on the
// communicator, which keys its rounding draws.
struct Variant {
  bool bf16, avg, in_place;
};
Variant variant(int k) {
  return Variant{(k & 4) != 0, (k & 2) != 0, (k & 1) != 0};
}

// The inputs as the reduction sees them: every rank's row in FP32, BF16-rounded for BF16 calls.
std::vector<float> seen_rows(const dq::sim::Matrix& rows, int n, size_t count, bool bf16,
                             std::vector<const float*>* ptrs) {
  std::vector<float> conv(static_cast<size_t>(n) * count);
  ptrs->clear();
  for (int w = 0; w < n; ++w) {
    for (size_t i = 0; i < count; ++i) conv[w * count + i] = input(rows, w, i, bf16);
  }
  for (int w = 0; w < n; ++w) ptrs->push_back(conv.data() + w * count);
  return conv;
}

// vNMSE of `count` result values (the call's element type) against the exact FP64 sum (or
// average) of the inputs `ptrs` at elements offset .. offset + count - 1.
double block_vnmse(const std::string& bytes, size_t count, bool bf16, bool avg,
                   const std::vector<const float*>& ptrs, size_t offset, bool* finite,
                   double* num_out = nullptr, double* den_out = nullptr) {
  double num = 0, den = 0;
  *finite = true;
  for (size_t i = 0; i < count; ++i) {
    double exact = 0;
    for (const float* row : ptrs) exact += row[offset + i];
    if (avg) exact /= static_cast<double>(ptrs.size());
    const float got = dq::test::load_element(bytes.data(), i, bf16);
    *finite = *finite && std::isfinite(got);
    num += (got - exact) * (got - exact);
    den += exact * exact;
  }
  if (num_out) *num_out += num;
  if (den_out) *den_out += den;
  return den > 0 ? num / den : 0.0;
}

// How many of `count` result values equal the simulator's decode (rounded to BF16 for BF16).
size_t same_as_simulator(const std::string& bytes, size_t count, bool bf16, const float* sim) {
  size_t same = 0;
  for (size_t i = 0; i < count; ++i) {
    const float want = bf16 ? dq::bf16_to_f32(dq::f32_to_bf16_rne(sim[i])) : sim[i];
    const float got = dq::test::load_element(bytes.data(), i, bf16);
    same += std::memcmp(&want, &got, 4) == 0 ? 1 : 0;
  }
  return same;
}

// The engine's wire bytes for one compressed reduce-scatter of `recv` elements per rank, as
// dynamiqCommBytes counts them, and the bound they must stay under. Each pipeline block of
// the rank block (reduce_scatter_block_elems) has one codec per chunk, planned with
// plan(C_b, 1 chunk, n): a chunk message of cap_b = floor(5 C_b / 8) - 2 W_b bytes (W_b =
// stats_words(ceil(C_b / 256), n) BF16 statistics words take the rest of the budget), and every
// rank sends n - 1 of them per block. The statistics all-reduce (every rank block's words, S = n
// sum_b W_b) plus one control word are counted as a ring sends them: (4 S + 4)(n-1)/n.
// So wire = (n-1) sum_b cap_b + floor((4 S + 4)(n-1)/n)
//        <= (n-1)/n x (n recv) x 5/8 + 2 (n-1) sum_b W_b + 4:
// 5 bits per input coordinate on (n-1)/n of the input, plus the statistics.
void scatter_wire_bytes(size_t recv, size_t esize, int n, uint64_t block_bytes, uint64_t* expected,
                        double* bound) {
  const size_t block = dq::sim::reduce_scatter_block_elems(block_bytes, esize, n);
  const size_t n_blocks = std::max<size_t>(1, recv / block);
  uint64_t caps = 0, words = 0;
  for (size_t b = 0; b < n_blocks; ++b) {
    const size_t count = b + 1 == n_blocks ? recv - b * block : block;
    std::string err;
    auto codec = dq::make_codec("dynamiq:5", &err);
    codec->plan(count, 1, n);
    caps += codec->chunk_capacity();
    words += codec->stats_words();
  }
  const uint64_t nn = static_cast<uint64_t>(n);
  *expected = (nn - 1) * caps + (4 * nn * words + 4) * (nn - 1) / nn;
  *bound = (n - 1.0) / n * static_cast<double>(nn * recv) * 5.0 / 8.0 +
           2.0 * (n - 1) * static_cast<double>(words) + 4.0;
}

constexpr size_t kScatterRecv = 50001;  // odd: rank blocks start off super-group boundaries
constexpr size_t kReduceCount = 300007;

// One rank of scenario_reducescatter's run `tag`: its 8 calls, each result block into a file and
// a report line (call, rerouted, bytes in, wire bytes); 0, or 10 + the call that failed.
int reducescatter_calls(const std::string& tag, int rank, ncclComm_t comm,
                        const dq::sim::Matrix& rows, size_t total, size_t recv) {
  unsigned long long seen = 0, in0 = 0, wire0 = 0, in1 = 0, wire1 = 0;
  rerouted_delta(comm, &seen);
  std::string report;
  for (int k = 0; k < 8; ++k) {
    const Variant v = variant(k);
    const size_t esize = v.bf16 ? 2 : 4;
    std::vector<unsigned char> in = typed_input(rows, rank, total, v.bf16);
    std::vector<unsigned char> out(recv * esize, 0xCD);
    unsigned char* dst = v.in_place ? in.data() + rank * recv * esize : out.data();
    bytes_fn()(comm, &in0, &wire0);
    if (ncclReduceScatter(in.data(), dst, recv, v.bf16 ? ncclBfloat16 : ncclFloat32,
                          v.avg ? ncclAvg : ncclSum, comm, nullptr) != ncclSuccess)
      return 10 + k;
    const bool rerouted = rerouted_delta(comm, &seen);
    bytes_fn()(comm, &in1, &wire1);
    write_text(rank_file(rank, (tag + "rs" + std::to_string(k) + "_").c_str()),
               std::string(reinterpret_cast<const char*>(dst), recv * esize));
    report += std::to_string(k) + " " + std::to_string(rerouted) + " " + std::to_string(in1 - in0) +
              " " + std::to_string(wire1 - wire0) + "\n";
  }
  write_text(rank_file(rank, (tag + "rs_report").c_str()), report);
  return 0;
}

// Compressed reduce-scatter: 8 calls (FP32/BF16, SUM/AVG, out of place / in place with recvbuff
// = sendbuff + rank x recvcount), run twice from fresh processes with the same seed. Every call
// rerouted; every rank's block within [0.5, 2]x of the simulator's vNMSE for that block and call;
// each rank's block bit-identical across the two runs; wire bytes as derived above.
// `block_bytes`: DYNAMIQ_BLOCK_BYTES (K/M suffix); small blocks cut each rank block into several
// pipeline blocks, which the simulator mirrors (SimOptions::block_elems).
bool scenario_reducescatter(int n, const std::string& topo, const std::string& block_bytes) {
  uint64_t block = std::strtoull(block_bytes.c_str(), nullptr, 10);
  if (block_bytes.back() == 'K') block <<= 10;
  if (block_bytes.back() == 'M') block <<= 20;
  const size_t recv = kScatterRecv, total = recv * static_cast<size_t>(n);
  dq::sim::Matrix rows;
  make_rows(n, total, 11, &rows);
  auto body = [&](const std::string& tag, int rank, ncclComm_t comm) {
    return reducescatter_calls(tag, rank, comm, rows, total, recv);
  };
  // 64 KiB: every call here is compressed whatever n (the default 1 MiB counts the send buffer).
  const Env env = {{"DYNAMIQ_ENABLE", "1"},
                   {"DYNAMIQ_TOPO", topo},
                   {"DYNAMIQ_MIN_BYTES", "64K"},
                   {"DYNAMIQ_BLOCK_BYTES", block_bytes}};
  for (const std::string tag : {"a", "b"}) {
    auto codes = run_ranks(
        n, [&](int) { return env; },
        [&](int rank, ncclComm_t comm) { return body(tag, rank, comm); }, 600);
    if (!all_zero(codes, ("reducescatter run " + tag).c_str())) return false;
  }

  dq::topo::Schedule sched;
  const dq::topo::Kind kind = engine_kind(topo, n, true);
  if (dq::topo::make_schedule(kind, n, &sched) != dq::Status::kOk) return fail("schedule");
  double engine_sum = 0, sim_sum = 0;
  size_t bit_same = 0, bit_total = 0;
  for (int k = 0; k < 8; ++k) {
    const Variant v = variant(k);
    const size_t esize = v.bf16 ? 2 : 4;
    std::vector<const float*> ptrs;
    const std::vector<float> conv = seen_rows(rows, n, total, v.bf16, &ptrs);
    dq::sim::SimOptions opt;
    opt.seed = 24301;  // DYNAMIQ_SEED's default
    opt.call = static_cast<uint64_t>(k);
    opt.op = v.avg ? dq::ReduceOp::kAvg : dq::ReduceOp::kSum;
    opt.block_elems = dq::sim::reduce_scatter_block_elems(block, esize, n);
    dq::sim::SimResult sim;
    std::vector<float> sim_out;
    if (dq::sim::simulate_reduce_scatter("dynamiq:5", sched, ptrs, recv, opt, &sim_out, &sim) !=
        dq::Status::kOk)
      return fail("simulate");
    uint64_t expected_wire = 0;
    double bound = 0;
    scatter_wire_bytes(recv, esize, n, block, &expected_wire, &bound);
    // A BF16 result adds its own rounding (2^-9 relative, squared ~1e-6 of the energy).
    const double floor = v.bf16 ? 4e-6 : 0.0;
    double worst = 0, num = 0, den = 0;
    size_t call_same = 0;
    for (int r = 0; r < n; ++r) {
      std::istringstream report(read_file(rank_file(r, "ars_report")));
      int kk = -1, rerouted = 0;
      unsigned long long bytes_in = 0, wire = 0;
      for (int j = 0; j <= k; ++j) report >> kk >> rerouted >> bytes_in >> wire;
      EXPECT(report && kk == k, "rank %d: report truncated", r);
      EXPECT(rerouted == 1, "call %d: rank %d did not reroute the reduce-scatter", k, r);
      EXPECT(bytes_in == total * esize, "call %d rank %d: bytes_in %llu", k, r, bytes_in);
      EXPECT(wire == expected_wire && wire <= bound,
             "call %d rank %d: %llu wire bytes; derived %llu, bound %.0f", k, r, wire,
             static_cast<unsigned long long>(expected_wire), bound);
      const std::string a = read_file(rank_file(r, ("ars" + std::to_string(k) + "_").c_str()));
      const std::string b = read_file(rank_file(r, ("brs" + std::to_string(k) + "_").c_str()));
      EXPECT(a.size() == recv * esize, "call %d rank %d: %zu result bytes", k, r, a.size());
      EXPECT(a == b, "call %d: rank %d's block differs between two runs with the same seed", k, r);
      bool finite = true;
      const double vn = block_vnmse(a, recv, v.bf16, v.avg, ptrs, r * recv, &finite, &num, &den);
      const double want = sim.block_vnmse[r];
      EXPECT(finite, "call %d rank %d: non-finite result from finite inputs", k, r);
      // One block's vNMSE varies by tens of % with the draws; a wrong slice, key or statistic
      // costs far more than 2x.
      EXPECT(vn >= 0.5 * want && vn <= 2.0 * want + floor,
             "call %d rank %d: block vNMSE %.4e vs simulated %.4e", k, r, vn, want);
      worst = std::max(worst, vn / want);
      engine_sum += vn;
      sim_sum += want;
      const size_t same = same_as_simulator(a, recv, v.bf16, sim_out.data() + r * recv);
      call_same += same;
      bit_same += same;
      bit_total += recv;
    }
    std::printf(
        "n=%d %s %zu block(s) %s %s %s: all ranks rerouted, identical across runs; vNMSE %.4e over "
        "all "
        "blocks (simulated %.4e), worst block/simulated %.2f, %.1f%% of values bit-identical to "
        "the simulator's; wire %llu B per rank = %.3f bits per input coordinate (bound %.0f "
        "B)\n",
        n, dq::topo::kind_name(kind), std::max<size_t>(1, recv / opt.block_elems),
        v.bf16 ? "bf16" : "f32", v.avg ? "avg" : "sum", v.in_place ? "in-place" : "out-of-place",
        num / den, sim.vnmse, worst, 100.0 * call_same / (recv * n),
        static_cast<unsigned long long>(expected_wire),
        8.0 * expected_wire / static_cast<double>(total), bound);
  }
  std::printf(
      "mean block vNMSE over 8 calls x %d ranks: engine %.4e, simulator %.4e; %.1f%% of "
      "result values bit-identical to the simulator's\n",
      n, engine_sum / (8 * n), sim_sum / (8 * n), 100.0 * bit_same / bit_total);
  EXPECT(engine_sum <= 1.25 * sim_sum && engine_sum >= 0.8 * sim_sum,
         "mean block vNMSE %.4e vs simulated %.4e", engine_sum / (8 * n), sim_sum / (8 * n));
  return true;
}

// Compressed reduce to roots 0 and n-1: 16 calls (8 variants per root), twice. The root's result
// within [0.5, 2]x of the simulator's all-reduce vNMSE for that call (same reduce phase, and the
// root decodes the same final payloads), bit-identical across the two runs; every other rank's
// receive buffer untouched.
bool scenario_reduce(int n, const std::string& topo) {
  const size_t count = kReduceCount;
  dq::sim::Matrix rows;
  make_rows(n, count, 13, &rows);
  const int roots[2] = {0, n - 1};
  auto body = [&](const std::string& tag, int rank, ncclComm_t comm) -> int {
    unsigned long long seen = 0;
    rerouted_delta(comm, &seen);
    std::string report;
    for (int call = 0; call < 16; ++call) {
      const int root = roots[call / 8];
      const Variant v = variant(call % 8);
      const size_t esize = v.bf16 ? 2 : 4;
      std::vector<unsigned char> in = typed_input(rows, rank, count, v.bf16);
      const std::vector<unsigned char> before = in;
      std::vector<unsigned char> out(count * esize, 0xCD);
      unsigned char* dst = v.in_place ? in.data() : out.data();
      if (ncclReduce(in.data(), dst, count, v.bf16 ? ncclBfloat16 : ncclFloat32,
                     v.avg ? ncclAvg : ncclSum, root, comm, nullptr) != ncclSuccess)
        return 10 + call;
      const bool rerouted = rerouted_delta(comm, &seen);
      bool untouched = true;
      if (rank == root)
        write_text(rank_file(rank, (tag + "red" + std::to_string(call) + "_").c_str()),
                   std::string(reinterpret_cast<const char*>(dst), count * esize));
      else
        untouched = v.in_place ? in == before
                               : std::all_of(out.begin(), out.end(),
                                             [](unsigned char c) { return c == 0xCD; });
      report += std::to_string(call) + " " + std::to_string(rerouted) + " " +
                std::to_string(untouched) + "\n";
    }
    write_text(rank_file(rank, (tag + "red_report").c_str()), report);
    return 0;
  };
  // 64 KiB: every call here is compressed whatever n (the default 1 MiB counts the send buffer).
  const Env env = {{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_TOPO", topo}, {"DYNAMIQ_MIN_BYTES", "64K"}};
  for (const std::string tag : {"a", "b"}) {
    auto codes = run_ranks(
        n, [&](int) { return env; },
        [&](int rank, ncclComm_t comm) { return body(tag, rank, comm); }, 600);
    if (!all_zero(codes, ("reduce run " + tag).c_str())) return false;
  }
  dq::topo::Schedule sched;
  const dq::topo::Kind kind = engine_kind(topo, n, false);
  if (dq::topo::make_schedule(kind, n, &sched) != dq::Status::kOk) return fail("schedule");
  double engine_sum = 0, sim_sum = 0;
  size_t bit_same = 0, bit_total = 0;
  for (int r = 0; r < n; ++r) {
    std::istringstream report(read_file(rank_file(r, "ared_report")));
    for (int call = 0; call < 16; ++call) {
      int c = -1, rerouted = 0, untouched = 0;
      report >> c >> rerouted >> untouched;
      EXPECT(report && c == call, "rank %d: report truncated", r);
      EXPECT(rerouted == 1, "call %d: rank %d did not reroute the reduce", call, r);
      EXPECT(untouched == 1, "call %d: rank %d (not the root) had its receive buffer written", call,
             r);
    }
  }
  for (int call = 0; call < 16; ++call) {
    const int root = roots[call / 8];
    const Variant v = variant(call % 8);
    std::vector<const float*> ptrs;
    const std::vector<float> conv = seen_rows(rows, n, count, v.bf16, &ptrs);
    std::string err;
    auto codec = dq::make_codec("dynamiq:5", &err);
    dq::sim::SimOptions opt;
    opt.seed = 24301;
    opt.call = static_cast<uint64_t>(call);
    opt.op = v.avg ? dq::ReduceOp::kAvg : dq::ReduceOp::kSum;
    dq::sim::SimResult sim;
    std::vector<float> sim_out;
    if (dq::sim::simulate_allreduce(*codec, sched, ptrs, count, opt, &sim_out, &sim) !=
        dq::Status::kOk)
      return fail("simulate");
    const std::string a = read_file(rank_file(root, ("ared" + std::to_string(call) + "_").c_str()));
    const std::string b = read_file(rank_file(root, ("bred" + std::to_string(call) + "_").c_str()));
    EXPECT(a.size() == count * (v.bf16 ? 2 : 4), "call %d: root wrote %zu bytes", call, a.size());
    EXPECT(a == b, "call %d: the root's result differs between two runs with the same seed", call);
    bool finite = true;
    const double vn = block_vnmse(a, count, v.bf16, v.avg, ptrs, 0, &finite);
    const double floor = v.bf16 ? 4e-6 : 0.0;
    EXPECT(finite, "call %d: non-finite result", call);
    EXPECT(vn >= 0.5 * sim.vnmse && vn <= 2.0 * sim.vnmse + floor,
           "call %d (root %d): vNMSE %.4e vs simulated %.4e", call, root, vn, sim.vnmse);
    engine_sum += vn;
    sim_sum += sim.vnmse;
    const size_t same = same_as_simulator(a, count, v.bf16, sim_out.data());
    bit_same += same;
    bit_total += count;
    std::printf(
        "n=%d %s root %d %s %s %s: rerouted on every rank, identical across runs, "
        "others untouched; vNMSE %.4e (simulated %.4e), %.1f%% of values bit-identical "
        "to the simulator's\n",
        n, dq::topo::kind_name(kind), root, v.bf16 ? "bf16" : "f32", v.avg ? "avg" : "sum",
        v.in_place ? "in-place" : "out-of-place", vn, sim.vnmse, 100.0 * same / count);
  }
  std::printf(
      "mean vNMSE over 16 calls: engine %.4e, simulator %.4e; %.1f%% of result values "
      "bit-identical to the simulator's\n",
      engine_sum / 16, sim_sum / 16, 100.0 * bit_same / bit_total);
  EXPECT(engine_sum <= 1.25 * sim_sum && engine_sum >= 0.8 * sim_sum,
         "mean vNMSE %.4e vs simulated %.4e", engine_sum / 16, sim_sum / 16);
  return true;
}

// Exact reference of an integer-valued reduce-scatter / reduce (exact_value inputs): element
// `at` of the sum (or max) over ranks.
float exact_reduced(int n, size_t at, ncclRedOp_t op) {
  float best = exact_value(0, at);
  double sum = 0;
  for (int r = 0; r < n; ++r) {
    sum += exact_value(r, at);
    best = std::max(best, exact_value(r, at));
  }
  return op == ncclMax ? best : static_cast<float>(sum);
}

// One float reduce-scatter (recvcount `recv`) or reduce (root `root`) of exact_value inputs:
// 0 when the result is exact (non-roots: untouched), else an error code; *rerouted from the
// counters. `group`: issued inside ncclGroupStart/End.
int exact_collective(int n, int rank, ncclComm_t comm, bool scatter, size_t recv, int root,
                     ncclRedOp_t op, bool group, bool* rerouted, unsigned long long* seen) {
  const size_t total = scatter ? recv * n : recv;
  std::vector<float> in(total), out(recv, -1.0f);
  for (size_t i = 0; i < total; ++i) in[i] = exact_value(rank, i);
  if (group && ncclGroupStart() != ncclSuccess) return 1;
  const ncclResult_t res =
      scatter ? ncclReduceScatter(in.data(), out.data(), recv, ncclFloat32, op, comm, nullptr)
              : ncclReduce(in.data(), out.data(), recv, ncclFloat32, op, root, comm, nullptr);
  if (res != ncclSuccess) return 2;
  if (group && ncclGroupEnd() != ncclSuccess) return 3;
  *rerouted = rerouted_delta(comm, seen);
  if (!scatter && rank != root) {
    for (size_t i = 0; i < recv; ++i)
      if (out[i] != -1.0f) return 4;
    return 0;
  }
  const size_t offset = scatter ? static_cast<size_t>(rank) * recv : 0;
  for (size_t i = 0; i < recv; ++i)
    if (out[i] != exact_reduced(n, offset + i, op)) {
      std::fprintf(stderr, "rank %d: %s %zu: element %zu is %g, exact %g\n", rank,
                   scatter ? "reduce-scatter" : "reduce", recv, i, out[i],
                   exact_reduced(n, offset + i, op));
      return 5;
    }
  return 0;
}

// Reduce-scatter and reduce calls dynamiq does not compress give exactly NCCL's result:
// below DYNAMIQ_MIN_BYTES, below 64 super-groups per chunk message, other ops and dtypes,
// inside the caller's group, and collectives DYNAMIQ_COLLECTIVES leaves out. Each phase ends
// with an eligible call that is compressed (else the test would be vacuous).
bool scenario_collectives_passthrough(int n) {
  // Phase 1: every collective allowed (the default), DYNAMIQ_MIN_BYTES=64K.
  auto body = [&](int rank, ncclComm_t comm) -> int {
    unsigned long long seen = 0;
    rerouted_delta(comm, &seen);
    bool rr = false;
    int rc;
    const size_t floor_recv = dq::kMinSuperGroupsPerChunk * 256;  // one chunk per rank block
    // Small: 1000 floats per rank block (n x 4000 B < 64 KiB for n <= 8).
    if ((rc = exact_collective(n, rank, comm, true, 1000, 0, ncclSum, false, &rr, &seen)) || rr)
      return 10 + rc;
    if ((rc = exact_collective(n, rank, comm, false, 1000, 0, ncclSum, false, &rr, &seen)) || rr)
      return 20 + rc;
    // A rank block one super-group short of 64 per chunk message: passes through, exact. At 64
    // the reduce-scatter is compressed.
    if ((rc = exact_collective(n, rank, comm, true, floor_recv - 256, 0, ncclSum, false, &rr,
                               &seen)) ||
        rr)
      return 30 + rc;
    rc = exact_collective(n, rank, comm, true, floor_recv, 0, ncclSum, false, &rr, &seen);
    if ((rc != 0 && rc != 5) || !rr) return 38;
    // Max: NCCL's.
    if ((rc = exact_collective(n, rank, comm, true, 1 << 18, 0, ncclMax, false, &rr, &seen)) || rr)
      return 40 + rc;
    if ((rc = exact_collective(n, rank, comm, false, 1 << 18, n - 1, ncclMax, false, &rr, &seen)) ||
        rr)
      return 45 + rc;
    // Inside the caller's group: small ones join the real group (exact); eligible ones are held
    // back and compressed when the group ends (docs/ENGINE.md section 8).
    if ((rc = exact_collective(n, rank, comm, true, 1000, 0, ncclSum, true, &rr, &seen)) || rr)
      return 50 + rc;
    rc = exact_collective(n, rank, comm, true, 1 << 18, 0, ncclSum, true, &rr, &seen);
    if ((rc != 0 && rc != 5) || !rr) return 53;
    rc = exact_collective(n, rank, comm, false, 1 << 18, 0, ncclSum, true, &rr, &seen);
    if ((rc != 0 && rc != 5) || !rr) return 55;
    // int32 reduce-scatter: NCCL's.
    {
      const size_t recv = 1 << 18;
      std::vector<int32_t> in(recv * n), out(recv);
      for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<int32_t>(i % 1000) * (rank + 1);
      if (ncclReduceScatter(in.data(), out.data(), recv, ncclInt32, ncclSum, comm, nullptr) !=
          ncclSuccess)
        return 60;
      if (rerouted_delta(comm, &seen)) return 61;
      for (size_t i = 0; i < recv; ++i)
        if (out[i] != static_cast<int32_t>((rank * recv + i) % 1000) * n * (n + 1) / 2) return 62;
    }
    // Eligible: compressed (not exact).
    rc = exact_collective(n, rank, comm, false, 1 << 18, n - 1, ncclSum, false, &rr, &seen);
    if ((rc != 0 && rc != 5) || !rr) return 70 + rc;
    return 0;
  };
  auto codes = run_ranks(
      n,
      [](int) {
        return Env{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_MIN_BYTES", "64K"}};
      },
      body, 300);
  if (!all_zero(codes, "collectives passthrough")) return false;
  // Phase 2: DYNAMIQ_COLLECTIVES picks which collectives are compressed; the rest pass through.
  for (const std::string allowed : {"allreduce", "reducescatter", "reduce"}) {
    auto body2 = [&](int rank, ncclComm_t comm) -> int {
      unsigned long long seen = 0;
      rerouted_delta(comm, &seen);
      bool rr = false;
      int rc;
      const size_t recv = 1 << 18;
      rc = exact_collective(n, rank, comm, true, recv, 0, ncclSum, false, &rr, &seen);
      if (rr != (allowed == "reducescatter") || (!rr && rc != 0)) return 10 + rc;
      rc = exact_collective(n, rank, comm, false, recv, 0, ncclSum, false, &rr, &seen);
      if (rr != (allowed == "reduce") || (!rr && rc != 0)) return 20 + rc;
      rc = exact_float_call(n, rank, comm, recv, ncclSum, &rr, &seen);
      if (rr != (allowed == "allreduce") || (!rr && rc != 0)) return 30 + rc;
      return 0;
    };
    codes = run_ranks(
        n,
        [&](int) {
          return Env{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_COLLECTIVES", allowed}};
        },
        body2, 300);
    if (!all_zero(codes, ("DYNAMIQ_COLLECTIVES=" + allowed).c_str())) return false;
  }
  std::printf(
      "reduce-scatter and reduce: small (also grouped), short of 64 super-groups, max and "
      "int32 calls passed through exactly; eligible grouped ones compressed at "
      "ncclGroupEnd; DYNAMIQ_COLLECTIVES=allreduce|reducescatter|reduce compressed that "
      "collective alone, the others exact\n");
  return true;
}

// The scenario named `scenario` on n ranks; argv: [program, scenario, n, options...].
Outcome run_scenario(const std::string& scenario, int n, int argc, char** argv) {
  bool ok = false;
  if (scenario == "accuracy") {
    // Optional 4th argument: DYNAMIQ_BLOCK_BYTES (small blocks exercise the pipeline).
    ok = scenario_accuracy(n, argc > 3 ? argv[3] : "ring", argc > 4 ? argv[4] : "16M");
  } else if (scenario == "passthrough") {
    ok = scenario_passthrough(n);
  } else if (scenario == "optin") {
    ok = scenario_optin(n);
  } else if (scenario == "mismatch") {
    ok = scenario_mismatch(n);
  } else if (scenario == "nan") {
    ok = scenario_nan(n);
  } else if (scenario == "float_env") {
    ok = scenario_float_env(n);
  } else if (scenario == "kill") {
    ok = scenario_killed_rank(n, argc > 3 ? std::atoi(argv[3]) : 5);
  } else if (scenario == "kill_reducescatter" || scenario == "kill_reduce") {
    ok = scenario_killed_rank(n, argc > 3 ? std::atoi(argv[3]) : 5, scenario.substr(5));
  } else if (scenario == "reducescatter") {
    ok = scenario_reducescatter(n, argc > 3 ? argv[3] : "auto", argc > 4 ? argv[4] : "16M");
  } else if (scenario == "reduce") {
    ok = scenario_reduce(n, argc > 3 ? argv[3] : "auto");
  } else if (scenario == "collectives_passthrough") {
    ok = scenario_collectives_passthrough(n);
  } else if (scenario == "stalled_peer") {
    ok = scenario_stalled_peer(n);
  } else if (scenario == "toggle") {
    ok = scenario_toggle(n);
  } else if (scenario == "metrics") {
    ok = scenario_metrics(n);
  } else if (scenario == "budget_api") {
    ok = scenario_budget_api(n);
  } else {
    return Outcome::unknown;
  }
  return ok ? Outcome::pass : Outcome::fail;
}
}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 2 ? std::atoi(argv[2]) : 0;
  return scenario_main(
      argc, argv, 3, "shim_multirank SCENARIO NRANKS [TOPO]", "/tmp/dq-shim-test-XXXXXX",
      " with " + std::to_string(n) + " ranks",
      [&](const std::string& scenario) { return run_scenario(scenario, n, argc, argv); });
}
