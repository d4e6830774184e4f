// dynamiq-demo: the end-to-end demonstration. Run as N ranks under dynamiq-run with
// libdynamiq.so preloaded; each rank all-reduces its row of a gradient .npy (real gradients by
// default) twice: compressed by dynamiq (FP32 in, DYNAMIQ_* settings), and passed through
// uncompressed in BF16 on a second communicator that opts out. Rank 0 prints, per scheme, the
// vNMSE against the exact FP64 sum, the bytes each rank sent, and the time per call.
#include <dlfcn.h>
#include <nccl.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/fnv1a.h"
#include "kernels/bf16.h"
#include "tools/cli/cli.h"
#include "tools/run/rendezvous.h"
#include "tools/sim/gradients.h"

namespace {

using CountersFn = int (*)(void*, unsigned long long*, unsigned long long*);
using RegisterFn = int (*)(void*, int);

template <class F>
F shim_fn(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

int die(int rank, const char* what) {
  std::fprintf(stderr, "dynamiq-demo: rank %d: %s\n", rank, what);
  return 1;
}

struct Outcome {
  double vnmse = 0, seconds = 0, sent_bytes = 0;
  bool compressed = false, identical = false;
};

// Identical bytes on every rank: MAX of (h, ~h).
bool identical(ncclComm_t comm, const void* data, size_t bytes) {
  const uint64_t h = dq::fnv1a64(data, bytes);
  uint64_t w[2] = {h, ~h};
  ncclAllReduce(w, w, 2, ncclUint64, ncclMax, comm, nullptr);
  return w[0] == ~w[1];
}

constexpr const char* kUsage =
    "usage: dynamiq-demo [INPUT.npy [ITERS]]   (N ranks under dynamiq-run, libdynamiq.so "
    "preloaded)\n"
    "  INPUT.npy     float32 matrix [n_rows, d]; rank r all-reduces row r mod n_rows\n"
    "                (default tools/gradients/sample/step00079.npy)\n"
    "  ITERS         all-reduces per scheme, the fastest is shown (1..1000000, default 3)\n"
    "  -h, --help    print this help\n"
    "  --version     print the version and exit\n"
    "e.g. LD_PRELOAD=build/shim/libdynamiq.so DYNAMIQ_ENABLE=1 build/tools/dynamiq-run --cpu-nccl "
    "\\\n"
    "       -n 4 -- build/tools/dynamiq-demo tools/gradients/sample/step00079.npy\n";

int usage_error(const std::string& what) {
  std::fprintf(stderr, "dynamiq-demo: %s\n%s", what.c_str(), kUsage);
  return 2;
}

// Returned by the steps of main when the run goes on (any other value is the exit code).
constexpr int kContinue = -1;

// INPUT.npy and ITERS from the command line.
int parse_command_line(int argc, char** argv, std::string* input, int* iters) {
  std::string iters_arg = "3";
  *input = "tools/gradients/sample/step00079.npy";
  CLI::App app;
  dq::cli::configure(&app, "dynamiq-demo");
  app.add_option("input", *input)->allow_extra_args(false);
  app.add_option("iters", iters_arg)->allow_extra_args(false);
  std::string parse_error;
  switch (dq::cli::parse(&app, argc, argv, &parse_error)) {
    case dq::cli::Parsed::kHelp:
      std::fputs(kUsage, stdout);
      return 0;
    case dq::cli::Parsed::kVersion:
      std::printf("%s\n", dq::cli::version_line("dynamiq-demo").c_str());
      return 0;
    case dq::cli::Parsed::kError:
      return usage_error(parse_error);
    case dq::cli::Parsed::kRun:
      break;
  }
  char* end = nullptr;
  const long iters_long = std::strtol(iters_arg.c_str(), &end, 10);
  if (iters_arg.empty() || *end != '\0' || iters_long < 1 || iters_long > 1000000)
    return usage_error("ITERS must be 1..1000000, not '" + iters_arg + "'");
  *iters = static_cast<int>(iters_long);
  return kContinue;
}

// The shim's per-communicator counters (compressed calls, and bytes) before and after a run.
struct ShimCounters {
  CountersFn counters = nullptr;
  CountersFn bytes = nullptr;
};

// Rank r's contribution: row r of the input (rows are reused, scaled, when there are more
// ranks than rows).
float row_value(const dq::sim::Matrix& m, int r, size_t i) {
  return m.row(r % m.rows)[i] * static_cast<float>(1 + r / m.rows);
}

// This rank's row as the scheme's all-reduce input: FP32, or rounded to BF16.
std::vector<unsigned char> scheme_input(const dq::sim::Matrix& m, int rank, bool bf16) {
  const size_t d = m.cols, esize = bf16 ? 2 : 4;
  std::vector<unsigned char> in(d * esize);
  for (size_t i = 0; i < d; ++i) {
    const float v = row_value(m, rank, i);
    if (bf16) {
      const uint16_t b = dq::f32_to_bf16_rne(v);
      std::memcpy(&in[i * 2], &b, 2);
    } else {
      std::memcpy(&in[i * 4], &v, 4);
    }
  }
  return in;
}

// The squared error of an all-reduce result against the exact sum.
double squared_error(const std::vector<unsigned char>& res, bool bf16,
                     const std::vector<double>& exact) {
  double err = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    float got;
    if (bf16) {
      uint16_t b;
      std::memcpy(&b, &res[i * 2], 2);
      got = dq::bf16_to_f32(b);
    } else {
      std::memcpy(&got, &res[i * 4], 4);
    }
    err += (got - exact[i]) * (got - exact[i]);
  }
  return err;
}

// Runs one scheme's ITERS all-reduces on comm (scheme 1: BF16 on the opted-out communicator)
// and measures it into *o.
int run_scheme(int scheme, ncclComm_t comm, const dq::sim::Matrix& m, int rank, int n, int iters,
               const std::vector<double>& exact, double energy, const ShimCounters& shim,
               Outcome* o) {
  const bool bf16 = scheme == 1;
  const size_t d = m.cols;
  const size_t esize = bf16 ? 2 : 4;
  std::vector<unsigned char> in = scheme_input(m, rank, bf16), res(d * esize);
  unsigned long long r0 = 0, p0 = 0, r1 = 0, p1 = 0, b0 = 0, w0 = 0, b1 = 0, w1 = 0;
  shim.counters(comm, &r0, &p0);
  shim.bytes(comm, &b0, &w0);
  double best = 1e30;
  for (int it = 0; it < iters; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    if (ncclAllReduce(in.data(), res.data(), d, bf16 ? ncclBfloat16 : ncclFloat32, ncclSum, comm,
                      nullptr) != ncclSuccess)
      return die(rank, "ncclAllReduce failed");
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  shim.counters(comm, &r1, &p1);
  shim.bytes(comm, &b1, &w1);
  o->compressed = r1 > r0;
  o->seconds = best;
  // Compressed: what the engine handed to ncclSend. Pass-through: NCCL's ring all-reduce
  // sends 2 (n-1)/n of the buffer per rank.
  o->sent_bytes = o->compressed ? static_cast<double>(w1 - w0) / iters
                                : 2.0 * (n - 1) / n * static_cast<double>(d * esize);
  o->vnmse = squared_error(res, bf16, exact) / energy;
  o->identical = identical(comm, res.data(), d * esize);
  return kContinue;
}

// Rank 0's table: one line per scheme and the wire bytes saved.
void print_report(const Outcome out[2], int n, size_t d, const char* input) {
  std::printf("dynamiq-demo: %d ranks, %zu values per rank from %s\n", n, d, input);
  std::printf("%-34s %12s %16s %12s %10s %10s\n", "scheme", "vNMSE", "sent/rank (B)", "bits/value",
              "ms/call", "identical");
  const char* names[2] = {"dynamiq (FP32 in, DYNAMIQ_* set)", "NCCL BF16, uncompressed"};
  for (int s = 0; s < 2; ++s) {
    const Outcome& o = out[s];
    std::printf("%-34s %12.3e %16.0f %12.2f %10.1f %10s%s\n", names[s], o.vnmse, o.sent_bytes,
                o.sent_bytes * 8.0 / (2.0 * (n - 1) / n * d), o.seconds * 1e3,
                o.identical ? "yes" : "NO",
                s == 0 && !o.compressed
                    ? "   (NOT compressed: DYNAMIQ_DEBUG=INFO prints why, in the line 'dynamiq: "
                      "communicator index 0 ...: pass-through: <reason>')"
                    : "");
  }
  std::printf("wire bytes: dynamiq sends %.2fx fewer than BF16\n",
              out[1].sent_bytes / std::max(out[0].sent_bytes, 1.0));
}

}  // namespace

int main(int argc, char** argv) {
  std::string input_arg;
  int iters = 0;
  if (const int rc = parse_command_line(argc, argv, &input_arg, &iters); rc != kContinue) return rc;
  const char* input = input_arg.c_str();
  dq::rendezvous::JobEnv job;
  if (dq::rendezvous::read_job_env(&job) != dq::Status::kOk) return die(0, "no job environment");
  const int n = job.world_size, rank = job.rank;
  ShimCounters shim{shim_fn<CountersFn>("dynamiqCommCounters"),
                    shim_fn<CountersFn>("dynamiqCommBytes")};
  auto reg = shim_fn<RegisterFn>("dynamiqCommRegister");
  if (!shim.counters || !shim.bytes || !reg)
    return die(rank, "libdynamiq.so is not preloaded (LD_PRELOAD=build/shim/libdynamiq.so)");

  dq::sim::Matrix m;
  std::string error;
  if (dq::sim::read_npy(input, static_cast<size_t>(n), &m, &error) != dq::Status::kOk)
    return die(rank, error.c_str());
  if (m.rows == 0) return die(rank, "empty input");
  const size_t d = m.cols;

  ncclUniqueId ids[2];
  if (rank == 0)
    for (auto& id : ids) ncclGetUniqueId(&id);
  if (dq::rendezvous::share_bytes(job, "demo-ids", ids, sizeof ids) != dq::Status::kOk)
    return die(rank, "rendezvous failed");
  ncclComm_t grad = nullptr, plain = nullptr;
  if (ncclCommInitRank(&grad, n, ids[0], rank) != ncclSuccess ||
      ncclCommInitRank(&plain, n, ids[1], rank) != ncclSuccess)
    return die(rank, "ncclCommInitRank failed");
  reg(plain, 0);  // the baseline communicator opts out: NCCL's own all-reduce, uncompressed

  std::vector<double> exact(d, 0.0);
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < d; ++i) exact[i] += row_value(m, r, i);
  double energy = 0;
  for (double e : exact) energy += e * e;

  Outcome out[2];
  for (int scheme = 0; scheme < 2; ++scheme)
    if (const int rc = run_scheme(scheme, scheme == 1 ? plain : grad, m, rank, n, iters, exact,
                                  energy, shim, &out[scheme]);
        rc != kContinue)
      return rc;
  if (rank == 0) print_report(out, n, d, input);
  const bool ok = out[0].identical && out[1].identical && std::isfinite(out[0].vnmse);
  ncclCommDestroy(grad);
  ncclCommDestroy(plain);
  return ok ? 0 : 1;
}
