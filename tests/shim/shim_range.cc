// The whole finite FP32 / BF16 range through the preloaded shim on the CPU NCCL (docs/FORMAT.md,
// "Range"): compressed all-reduce and reduce-scatter calls of Gaussian gradients scaled by powers
// of two from the subnormals to 2^120, and of a log-scale random walk across super-groups
// (1e-30..1e30; in a reduce-scatter, one rank's block alone reaching 1e27). Every rank checks its
// result against the exact FP64 sum of every rank's input: compressed, finite, vNMSE within 1.5x
// of the unit-scale call's (the same data times 1) in the same run, identical on every rank; a
// super-group whose sums overflow comes back non-finite while the rest stays finite.
// Usage: shim_range allreduce|reducescatter NRANKS. Exit 0 pass, 1 fail, 77 skip.
#include <dlfcn.h>
#include <unistd.h>

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/nccl_api.h"
#include "kernels/bf16.h"
#include "tests/common/rank_harness.h"
#include "tests/shim/shim_test_util.h"

namespace {

using namespace dq::shim_test;

constexpr size_t kCount = 1 << 18;  // elements per all-reduce (per rank in a reduce-scatter)
constexpr double kFloatMax = FLT_MAX;

// One case: the scale of every value (log2) or the log-scale walk; BF16 or FP32.
struct Case {
  const char* name;
  int scale_log2;  // ignored by the walk
  bool walk;
  bool bf16;
  bool overflow;  // super-group 5 at 3/4 of the largest finite value in every rank
};

const Case kCases[] = {
    {"unit fp32", 0, false, false, false},      {"2^-140 fp32", -140, false, false, false},
    {"2^-100 fp32", -100, false, false, false}, {"2^60 fp32", 60, false, false, false},
    {"2^100 fp32", 100, false, false, false},   {"2^120 fp32", 120, false, false, false},
    {"walk fp32", 0, true, false, false},       {"unit bf16", 0, false, true, false},
    {"2^-128 bf16", -128, false, true, false},  {"2^110 bf16", 110, false, true, false},
    {"walk bf16", 0, true, true, false},        {"overflow fp32", 0, false, false, true},
    {"overflow bf16", 0, false, true, true},
};

// Rank r's value i of a case (the walk: super-group scales 10^w, w a random walk in [-30, 30]
// with steps of up to 6 decades, the same in every rank). Values of `total` elements.
std::vector<float> values(const Case& c, int rank, size_t total) {
  std::mt19937 rng(1000 + rank);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> x(total);
  std::mt19937 walk_rng(77);
  double w = 0;
  for (size_t i = 0; i < total; ++i) {
    if (c.walk && i % 256 == 0) {
      w += static_cast<double>(static_cast<int>(walk_rng() % 9) - 4) * 1.5;
      w = std::min(30.0, std::max(-30.0, w));
    }
    double v = normal(rng);
    v = c.walk ? v * std::pow(10.0, w) : std::ldexp(v, c.scale_log2);
    if (c.overflow && i / 256 == 5) v = 0.75 * kFloatMax;
    float f = static_cast<float>(v);
    if (c.bf16) f = dq::bf16_to_f32(dq::f32_to_bf16_rne(f));
    x[i] = f;
  }
  return x;
}

// The exact FP64 sums of elements [first, first + n) over every rank.
std::vector<double> exact_sums(const Case& c, int n, size_t total, size_t first, size_t count) {
  std::vector<double> sum(count, 0.0);
  for (int r = 0; r < n; ++r) {
    const std::vector<float> x = values(c, r, total);
    for (size_t i = 0; i < count; ++i) sum[i] += x[first + i];
  }
  return sum;
}

// One collective of case c on this rank; returns 0 or a failure code, *vnmse the error of this
// rank's result (the whole vector, or its block).
int run_case(const Case& c, bool scatter, int rank, int n, ncclComm_t comm, double* vnmse) {
  const size_t total = scatter ? kCount * n : kCount, out_count = kCount;
  const size_t first = scatter ? kCount * rank : 0;
  const std::vector<float> in = values(c, rank, total);
  const size_t word = c.bf16 ? 2 : 4;
  std::vector<unsigned char> send(total * word), recv(out_count * word);
  for (size_t i = 0; i < total; ++i) {
    if (c.bf16) {
      const uint16_t b = dq::f32_to_bf16_rne(in[i]);
      std::memcpy(send.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(send.data() + 4 * i, &in[i], 4);
    }
  }
  unsigned long long before = 0, after = 0, passed = 0;
  counters_fn()(comm, &before, &passed);
  const ncclDataType_t dt = c.bf16 ? ncclBfloat16 : ncclFloat32;
  const ncclResult_t r =
      scatter ? ncclReduceScatter(send.data(), recv.data(), out_count, dt, ncclSum, comm, nullptr)
              : ncclAllReduce(send.data(), recv.data(), out_count, dt, ncclSum, comm, nullptr);
  if (r != ncclSuccess) return 10;
  counters_fn()(comm, &after, &passed);
  if (after <= before) return 11;  // not compressed
  if (!same_bytes_everywhere(comm, recv.data(), recv.size()) && !scatter) return 12;
  const std::vector<double> exact = exact_sums(c, n, total, first, out_count);
  double num = 0, den = 0;
  for (size_t i = 0; i < out_count; ++i) {
    float got;
    if (c.bf16) {
      uint16_t b;
      std::memcpy(&b, recv.data() + 2 * i, 2);
      got = dq::bf16_to_f32(b);
    } else {
      std::memcpy(&got, recv.data() + 4 * i, 4);
    }
    const bool overflowing = std::fabs(exact[i]) > 2.0 * kFloatMax;
    if (overflowing) {
      if (std::isfinite(got) && !scatter) {
        std::fprintf(stderr, "%s: element %zu sums to %g, result finite %g\n", c.name, i, exact[i],
                     got);
        return 13;
      }
      continue;
    }
    if (c.overflow && (first + i) / 256 == 5) continue;  // the overflowing super-group
    if (!std::isfinite(got)) {
      std::fprintf(stderr, "%s: element %zu sums to %g, result %g\n", c.name, i, exact[i], got);
      return 14;
    }
    num += (got - exact[i]) * (got - exact[i]);
    den += exact[i] * exact[i];
  }
  *vnmse = den > 0 ? num / den : 0.0;
  return 0;
}

int rank_body(bool scatter, int rank, int n, ncclComm_t comm) {
  double unit[2] = {0, 0};  // fp32, bf16
  for (const Case& c : kCases) {
    if (scatter && c.overflow) continue;  // only one rank's block holds the overflowing sums
    double v = 0;
    const int rc = run_case(c, scatter, rank, n, comm, &v);
    std::fprintf(stderr, "rank %d %s %s: vNMSE %.4e (rc %d)\n", rank,
                 scatter ? "reduce-scatter" : "all-reduce", c.name, v, rc);
    if (rc != 0) return rc;
    if (c.scale_log2 == 0 && !c.walk && !c.overflow) unit[c.bf16 ? 1 : 0] = v;
    const double reference = unit[c.bf16 ? 1 : 0];
    if (c.overflow || c.walk) {
      if (!(v < 0.1)) return 20;
    } else if (!(v <= 1.5 * reference)) {
      std::fprintf(stderr, "%s: vNMSE %.4e above 1.5x the unit scale's %.4e\n", c.name, v,
                   reference);
      return 21;
    }
  }
  return 0;
}

// Every case through `what` (allreduce or reducescatter) on n ranks; prints every rank's log.
Outcome run_range(const std::string& what, int n) {
  if (what != "allreduce" && what != "reducescatter") return Outcome::unknown;
  const bool scatter = what == "reducescatter";
  const auto codes = dq::shim_test::run_ranks(
      n,
      [](int) {
        return Env{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_MIN_BYTES", "64K"}};
      },
      [&](int r, ncclComm_t comm) { return rank_body(scatter, r, n, comm); }, 600);
  bool ok = true;
  for (size_t r = 0; r < codes.size(); ++r) {
    std::printf("--- rank %zu (exit %d) ---\n%s", r, codes[r],
                rank_log(static_cast<int>(r)).c_str());
    ok = ok && codes[r] == 0;
  }
  return outcome(ok);
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 2 ? std::atoi(argv[2]) : 0;
  return dq::shim_test::scenario_main(argc, argv, 3, "shim_range allreduce|reducescatter NRANKS",
                                      "/tmp/dq-shim-range-XXXXXX",
                                      " range with " + std::to_string(n) + " ranks",
                                      [n](const std::string& what) { return run_range(what, n); });
}
