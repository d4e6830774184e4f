// The whole engine on the emulated CUDA device (shim/engine/cuda_device.h: the CUDA kernels of
// kernels/cuda/ under the CPU emulation of CUDA) over the CPU NCCL, against the host device on
// the same inputs. Usage: engine_emulated_cuda NRANKS [TOPO] | steps | canary_steps |
// canary NRANKS | capture NRANKS | in_progress NRANKS | two_level. Exit 0 pass. (The canary
// modes: see canary_steps_check and canary_body below.)
//
// Each rank holds two communicators: one engine on the host device, one on the emulated CUDA
// device, both with the same settings, and runs the same calls on both: all-reduce and
// reduce-scatter, FP32 and BF16, SUM and AVG, odd counts (a partial last super-group), two
// pipeline blocks each, one input with an infinite value (a poisoned super-group). Every call
// must be compressed by both engines, the emulated device's output must equal the host
// device's byte for byte, an all-reduce's output must be the same on every rank, and the
// DynamiQ steps must have run as kernels (none on the host codec). One MXFP8 all-reduce checks
// the other side: a codec without kernels runs on the host codec, with the host's bytes. Then
// DYNAMIQ_BITS=auto with the MXFP8 target on data without scale locality: after its first call
// the bucket goes as MXFP8 while its DynamiQ statistics still run as kernels every 8th call, the
// same bytes and the same choices on both devices, and the sampled check (DYNAMIQ_CHECK_EVERY)
// reads the same samples on both.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/log.h"
#include "common/nccl_api.h"
#include "config/settings.h"
#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/payload.h"
#include "kernels/stats_sum.h"
#include "shim/engine/cuda_device.h"
#include "shim/engine/engine.h"
#include "tests/common/engine_test_util.h"
#include "tests/common/rank_harness.h"

// Returns `code`, the communicators destroyed when it is 0 (below).
int destroy_if_passed(int code, ncclComm_t* comms, int n_comms);

namespace {

using dq::engine::CallArgs;
using dq::engine::Collective;
using dq::engine::CudaDeviceCounts;
using dq::engine::Engine;
using dq::engine::PassReason;

using dq::test::cpu_nccl_ops;
using dq::test::settings_for;

// True when `h` is the same on every rank: MAX of (h, ~h) gives max and ~min.

// Gradient-like values whose magnitude changes along the tensor (so the widths vary), different
// on every rank; `poison` puts +Inf at one element.
std::vector<unsigned char> make_input(int rank, size_t count, bool bf16, bool poison) {
  std::vector<unsigned char> in(count * (bf16 ? 2 : 4));
  for (size_t i = 0; i < count; ++i) {
    const double x = static_cast<double>(i);
    float v =
        static_cast<float>(std::sin(0.0013 * x + rank) * std::exp(4.0 * std::sin(0.0001 * x)));
    if (poison && i == count / 3) v = std::numeric_limits<float>::infinity();
    if (bf16) {
      const uint16_t b = dq::f32_to_bf16_rne(v);
      std::memcpy(&in[i * 2], &b, 2);
    } else {
      std::memcpy(&in[i * 4], &v, 4);
    }
  }
  return in;
}

struct Case {
  const char* what;
  Collective collective;
  bool bf16, avg, poison;
  const char* codec;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Two engines with the same settings on one rank, one on the host device and one on the emulated
// CUDA device, each with its metrics; call() runs the same FP32 all-reduce on both, which must
// be compressed by both, with no asynchronous error and the same output bytes.
struct DevicePair {
  DevicePair(const dq::config::Settings& settings, int n, int rank, ncclComm_t* comms,
             dq::engine::Device* cuda)
      : rank(rank),
        on_host(settings, true, {comms[0], rank, n}, cpu_nccl_ops(), dq::engine::host_device(),
                metrics_host, true),
        on_cuda(settings, true, {comms[1], rank, n}, cpu_nccl_ops(), cuda, metrics_cuda, true) {}
  // Exit codes code, code + 1, code + 2 name the failing check. The outputs stay in out_cuda.
  int call(const void* send, size_t count, int k, int code) {
    out_host.assign(count, 0.0f);
    out_cuda.assign(count, 0.0f);
    CallArgs args;
    args.send = send;
    args.count = count;
    PassReason rh = PassReason::kRerouted, rc = PassReason::kRerouted;
    args.recv = out_host.data();
    CHECK_OR(code, on_host.run(args, &rh) == ncclSuccess && rh == PassReason::kRerouted,
             "rank %d: auto call %d on the host device", rank, k);
    args.recv = out_cuda.data();
    CHECK_OR(code + 1,
             on_cuda.run(args, &rc) == ncclSuccess && rc == PassReason::kRerouted &&
                 on_cuda.async_error() == ncclSuccess,
             "rank %d: auto call %d on the emulated CUDA device", rank, k);
    CHECK_OR(code + 2, std::memcmp(out_host.data(), out_cuda.data(), count * 4) == 0,
             "rank %d: auto call %d: the devices' outputs differ", rank, k);
    return 0;
  }
  const int rank;
  std::shared_ptr<dq::engine::CommMetrics> metrics_host =
      std::make_shared<dq::engine::CommMetrics>();
  std::shared_ptr<dq::engine::CommMetrics> metrics_cuda =
      std::make_shared<dq::engine::CommMetrics>();
  Engine on_host, on_cuda;
  std::vector<float> out_host, out_cuda;
};

// Auto on data with scale locality and a loose target (vNMSE 0.02: fewer bits than the first
// call's fixed 5): the prediction runs as the budget kernel on the emulated device, from the
// reduced statistics alone; every call's choice (a DynamiQ rung), predicted
// vNMSE and output must be the host device's.
int auto_rungs(int n, const std::string& topo, int rank, ncclComm_t* comms,
               dq::engine::Device* cuda) {
  constexpr int kCalls = 6;
  constexpr size_t kCount = 3 * 65536 + 1000;  // two pipeline blocks, a partial super-group
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_TOPO", topo},
                                      {"DYNAMIQ_BITS", "auto"},
                                      {"DYNAMIQ_TARGET", "vnmse:0.02"},
                                      {"DYNAMIQ_BLOCK_BYTES", "524288"},
                                      {"DYNAMIQ_MIN_BYTES", "0"},
                                      {"DYNAMIQ_CONTROL_WINDOW", "1"}});  // each call predicts
  DevicePair pair(settings, n, rank, comms, cuda);
  const CudaDeviceCounts before = dq::engine::cuda_device_counts(cuda);
  for (int k = 0; k < kCalls; ++k) {
    const std::vector<unsigned char> in = make_input(rank + 7 * k, kCount, false, false);
    if (const int rc = pair.call(in.data(), kCount, k, 70); rc != 0) return rc;
    std::lock_guard<std::mutex> lh(pair.metrics_host->budget_mutex),
        lc(pair.metrics_cuda->budget_mutex);
    const dq::engine::BudgetMetrics &bh = pair.metrics_host->budget,
                                    &bc = pair.metrics_cuda->budget;
    CHECK_OR(73,
             bh.bits_sum == bc.bits_sum && bh.predicted_vnmse_sum == bc.predicted_vnmse_sum &&
                 bh.predicted_vnmse_last == bc.predicted_vnmse_last,
             "rank %d: auto call %d: bits %g vs %g, predicted vNMSE %.17g vs %.17g", rank, k,
             bh.bits_sum, bc.bits_sum, bh.predicted_vnmse_last, bc.predicted_vnmse_last);
  }
  const CudaDeviceCounts after = dq::engine::cuda_device_counts(cuda);
  std::lock_guard<std::mutex> lc(pair.metrics_cuda->budget_mutex);
  const dq::engine::BudgetMetrics& bc = pair.metrics_cuda->budget;
  // Every call predicted on the device (read one call late: kCalls - 1 read), none sent as MX,
  // and the budget moved off the fixed default of the first call.
  CHECK_OR(74,
           after.budgets - before.budgets == static_cast<uint64_t>(kCalls) &&
               bc.predicted_calls == static_cast<uint64_t>(kCalls - 1) && bc.mx_calls == 0 &&
               bc.bits_sum != 5.0 * kCalls,
           "rank %d: auto with locality: %llu budget kernels, %llu predictions read, %llu MX "
           "calls, mean %g bits",
           rank, static_cast<unsigned long long>(after.budgets - before.budgets),
           static_cast<unsigned long long>(bc.predicted_calls),
           static_cast<unsigned long long>(bc.mx_calls), bc.bits_sum / kCalls);
  if (rank == 0)
    std::fprintf(stderr,
                 "rank 0: auto with scale locality: %d calls, mean %.2f bits, the same choices, "
                 "predictions and bytes on both devices (predicted by the budget kernel)\n",
                 kCalls, bc.bits_sum / kCalls);
  return 0;
}

// Auto's MX fallback on both devices (see the file comment): 10 calls of one bucket.
int auto_fallback(int n, const std::string& topo, int rank, ncclComm_t* comms,
                  dq::engine::Device* cuda) {
  constexpr int kCalls = 10;
  constexpr size_t kCount = 256 * 1024;  // FP32: 1 MiB, 1,024 super-groups
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_TOPO", topo},
                                      {"DYNAMIQ_BITS", "auto"},
                                      {"DYNAMIQ_TARGET", "mxfp8"},
                                      {"DYNAMIQ_CHECK_EVERY", "3"},
                                      {"DYNAMIQ_MIN_BYTES", "0"},
                                      {"DYNAMIQ_CONTROL_WINDOW", "1"}});  // read one call late
  DevicePair pair(settings, n, rank, comms, cuda);
  CudaDeviceCounts before;  // after the first call (its canary computes statistics too)
  std::vector<float> in(kCount);
  for (int k = 0; k < kCalls; ++k) {
    if (k == 1) before = dq::engine::cuda_device_counts(cuda);
    // One scale everywhere: no rung of 8 bits or fewer meets MXFP8's error.
    for (size_t i = 0; i < kCount; ++i)
      in[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i) + 1.3 * rank + k) +
                                 0.5 * std::sin(0.0011 * static_cast<double>(i)));
    if (const int rc = pair.call(in.data(), kCount, k, 60); rc != 0) return rc;
    CHECK_OR(63, dq::test::same_bytes_everywhere(comms[0], pair.out_cuda.data(), kCount * 4),
             "rank %d: auto call %d: results differ across ranks", rank, k);
  }
  const CudaDeviceCounts after = dq::engine::cuda_device_counts(cuda);
  std::lock_guard<std::mutex> lh(pair.metrics_host->budget_mutex),
      lc(pair.metrics_cuda->budget_mutex);
  const dq::engine::BudgetMetrics &bh = pair.metrics_host->budget, &bc = pair.metrics_cuda->budget;
  // Calls 1..9 as MXFP8; statistics computed at calls 0 and 8 (as kernels), read at 1 and 9.
  CHECK_OR(64,
           bh.mx_calls == kCalls - 1 && bc.mx_calls == kCalls - 1 && bh.predicted_calls == 2 &&
               bc.predicted_calls == 2 && bc.buckets.size() == 1 &&
               bh.predicted_vnmse_sum == bc.predicted_vnmse_sum &&
               after.budgets - before.budgets == 1 && bc.buckets[0].codec == "mxfp8" &&
               bc.buckets[0].budget_bits == 8.25,
           "rank %d: auto: MX calls host %llu, CUDA %llu; predicted calls %llu, %llu; latest %s "
           "at %g bits",
           rank, static_cast<unsigned long long>(bh.mx_calls),
           static_cast<unsigned long long>(bc.mx_calls),
           static_cast<unsigned long long>(bh.predicted_calls),
           static_cast<unsigned long long>(bc.predicted_calls),
           bc.buckets.empty() ? "-" : bc.buckets[0].codec.c_str(),
           bc.buckets.empty() ? 0.0 : bc.buckets[0].budget_bits);
  // The sampled check (calls 2, 5, 8; the first two read): the same samples on both devices,
  // copied from the output only after the last codec step on the device's streams.
  CHECK_OR(66,
           bh.checked_calls == 2 && bc.checked_calls == 2 &&
               bh.checked_sq_error == bc.checked_sq_error &&
               bh.checked_energy == bc.checked_energy && bc.checked_sq_error > 0,
           "rank %d: sampled checks: host %llu (error %.6g), emulated CUDA %llu (error %.6g)", rank,
           static_cast<unsigned long long>(bh.checked_calls), bh.checked_sq_error,
           static_cast<unsigned long long>(bc.checked_calls), bc.checked_sq_error);
  CHECK_OR(65, after.stats - before.stats == 1 && after.host_fallbacks == before.host_fallbacks,
           "rank %d: auto: %llu statistics kernels in calls 1-9 (expected 1), %llu steps on the "
           "host codec",
           rank, static_cast<unsigned long long>(after.stats - before.stats),
           static_cast<unsigned long long>(after.host_fallbacks - before.host_fallbacks));
  if (rank == 0)
    std::fprintf(stderr,
                 "rank 0: auto, target mxfp8, dense data: %d calls identical on both devices, "
                 "%llu as MXFP8, of which one computed the statistics (as kernels)\n",
                 kCalls, static_cast<unsigned long long>(bc.mx_calls));
  return 0;
}

// ---- launches per call: the exact formula ---------------------------------------------------
// The kernel launches of one compressed DynamiQ call on n ranks, ring or butterfly, with `blocks`
// pipeline blocks. Per call: one statistics kernel and one layout kernel over every codec part of
// every block (the layouts here are all below the grid layout's size: one block each, in one
// launch), and the budget's kernels (the bucket's prediction from the reduced statistics, made
// with fixed bits too, for the metrics; none while the bucket's previous prediction is within the
// control window, unread). Per block: one kernel per hop step (a rank compresses n
// chunk messages on either topology: the ring's leaf, n - 2 fused hops and the sink's; the
// butterfly's n/2 + n/4 + ... + 1 leaves and fused hops and the sink's), and one for the finish
// step (validator blocks, then decoder blocks behind them: FinishGate, kernels/cuda/step_fold.h),
// of every chunk at once for an all-reduce, of the rank's own for a reduce-scatter. Nothing else:
// the step's last kernel folds its flags into the error word (no arm or fold kernels), the same
// launches as on a GPU (shim/engine/cuda_steps.h). The budget's launches (kernels/cuda/budget.cu):
// one to set up, then six over the grid that take every codec part of the call at once: a constant
// per call, however many parts (the reduce-scatter of 4 blocks below has 4 n parts).
constexpr uint64_t kBudgetLaunchesPerCall = 7;
constexpr uint64_t kStatsLaunchesPerCall = 1;
constexpr uint64_t kLayoutLaunchesPerCall = 1;
// A call whose layouts are all on the grid (at least ~6,300 super-groups each) launches the grid
// layout's seven kernels once for all of them, not the one-block kernel.
constexpr uint64_t kGridLayoutExtraLaunches = 6;

uint64_t launches_per_call(int n, int blocks, bool predicts = true) {
  const uint64_t hop_steps = static_cast<uint64_t>(n);
  const uint64_t finishes = 1;  // all-reduce and reduce-scatter alike
  const uint64_t b = static_cast<uint64_t>(blocks);
  return kStatsLaunchesPerCall + kLayoutLaunchesPerCall + (predicts ? kBudgetLaunchesPerCall : 0) +
         b * (hop_steps + finishes);
}

// Compressed FP32 calls of 1, 2 and 3 blocks (all-reduce) and 2 and 4 blocks (reduce-scatter) on
// one engine, after a first call of another shape (the canary's launches are its own): each call's
// launches, and its hop launches, exactly the formula's; then the 1-block shape again, within the
// default control window of its first call: no prediction, so the formula less the budget's.
int launch_formula(int n, const std::string& topo, int rank, ncclComm_t* comms,
                   dq::engine::Device* cuda) {
  const size_t block_bytes = 256 * 1024;
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_TOPO", topo},
                                      {"DYNAMIQ_CODEC", "dynamiq"},
                                      {"DYNAMIQ_MIN_BYTES", "0"},
                                      {"DYNAMIQ_BLOCK_BYTES", std::to_string(block_bytes)}});
  Engine engine(settings, true, {comms[1], rank, n}, cpu_nccl_ops(), cuda, nullptr, true);
  struct Shape {
    int blocks;
    bool scatter;
  };
  const Shape shapes[] = {{5, false}, {1, false}, {2, false}, {3, false},
                          {2, true},  {4, true},  {1, false}};
  const size_t repeat = std::size(shapes) - 1;  // shape 1 again, its prediction unread
  if (settings.control_window < static_cast<int64_t>(std::size(shapes))) {
    std::fprintf(stderr, "FAIL: the default control window is shorter than this test's calls\n");
    return 93;
  }
  for (size_t i = 0; i < std::size(shapes); ++i) {
    const Shape& s = shapes[i];
    // A block counts the caller's bytes, a reduce-scatter's one slice per rank.
    const size_t span = s.blocks * block_bytes / 4 / (s.scatter ? n : 1);
    const size_t count = s.scatter ? span * n : span;
    const auto in = make_input(rank, count, false, false);
    std::vector<float> out(span, 0.0f);
    CallArgs args;
    args.collective = s.scatter ? Collective::kReduceScatter : Collective::kAllReduce;
    args.send = in.data();
    args.recv = out.data();
    args.count = count;
    const CudaDeviceCounts before = dq::engine::cuda_device_counts(cuda);
    PassReason r = PassReason::kRerouted;
    CHECK_OR(90, engine.run(args, &r) == ncclSuccess && r == PassReason::kRerouted,
             "rank %d: launch formula call %zu not compressed (%s)", rank, i,
             dq::engine::reason_name(r));
    CHECK_OR(91, engine.async_error() == ncclSuccess, "rank %d: call %zu: async error", rank, i);
    if (i == 0) continue;  // the communicator's first call also runs the canary
    const CudaDeviceCounts after = dq::engine::cuda_device_counts(cuda);
    const uint64_t launches = after.launches - before.launches;
    const uint64_t hops = after.hops - before.hops;
    const uint64_t hop_launches = after.hop_launches - before.hop_launches;
    const uint64_t expected = launches_per_call(n, s.blocks, i != repeat);
    CHECK_OR(92,
             launches == expected && hops == static_cast<uint64_t>(s.blocks) * n &&
                 hop_launches == hops && after.budgets - before.budgets == (i != repeat ? 1u : 0u),
             "rank %d, %s, %d ranks, %d blocks, %s: %llu launches (formula %llu): %llu hop steps "
             "(%llu launches), %llu statistics, %llu layouts, %llu finishes, %llu budgets",
             rank, topo.c_str(), n, s.blocks, s.scatter ? "reduce-scatter" : "all-reduce",
             static_cast<unsigned long long>(launches), static_cast<unsigned long long>(expected),
             static_cast<unsigned long long>(hops), static_cast<unsigned long long>(hop_launches),
             static_cast<unsigned long long>(after.stats - before.stats),
             static_cast<unsigned long long>(after.layouts - before.layouts),
             static_cast<unsigned long long>(after.finishes - before.finishes),
             static_cast<unsigned long long>(after.budgets - before.budgets));
    if (rank == 0)
      std::fprintf(stderr, "rank 0: %s, %d ranks, %d blocks, %s: %llu launches per call\n",
                   topo.c_str(), n, s.blocks, s.scatter ? "reduce-scatter" : "all-reduce",
                   static_cast<unsigned long long>(launches));
  }
  return 0;
}

// A block large enough that its layout runs over the grid (at least kGridMinSupergroups
// super-groups, dynamiq_layout.cu), as the default 16 MiB blocks do: the steps' flags words are
// step words there too, so the grid kernels must neither read kFoldFlag as a failure nor leave
// the step unfolded. The same bytes as the host device, on every rank.
int grid_layout_call(int n, const std::string& topo, int rank, ncclComm_t* comms,
                     dq::engine::Device* cuda) {
  constexpr size_t kCount = 6500 * 256 + 77;  // FP32: 6.3 MiB, one block, a partial super-group
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_TOPO", topo},
                                      {"DYNAMIQ_BLOCK_BYTES", "16M"},
                                      {"DYNAMIQ_MIN_BYTES", "0"}});
  DevicePair pair(settings, n, rank, comms, cuda);
  CudaDeviceCounts before;
  for (int k = 0; k < 2; ++k) {  // the first call also runs the canary: the second is counted
    before = dq::engine::cuda_device_counts(cuda);
    const std::vector<unsigned char> in = make_input(rank + 5 * k, kCount, false, false);
    if (const int rc = pair.call(in.data(), kCount, k, 80); rc != 0) return rc;
    CHECK_OR(83, dq::test::same_bytes_everywhere(comms[0], pair.out_cuda.data(), kCount * 4),
             "rank %d: grid-layout call %d: results differ across ranks", rank, k);
  }
  const CudaDeviceCounts after = dq::engine::cuda_device_counts(cuda);
  // The bucket's second call, within the control window of its first: no prediction.
  const uint64_t expected = launches_per_call(n, 1, false) + kGridLayoutExtraLaunches;
  CHECK_OR(84, after.launches - before.launches == expected && after.layouts - before.layouts == 1,
           "rank %d: the grid-layout call: %llu launches (formula %llu), %llu layouts", rank,
           static_cast<unsigned long long>(after.launches - before.launches),
           static_cast<unsigned long long>(expected),
           static_cast<unsigned long long>(after.layouts - before.layouts));
  if (rank == 0)
    std::fprintf(stderr,
                 "rank 0: %zu elements in one block (layout over the grid): identical "
                 "bytes on both devices\n",
                 kCount);
  return 0;
}

int body(int n, const std::string& topo, int rank, ncclComm_t* comms) {
  const std::unique_ptr<dq::engine::Device> cuda = dq::engine::make_emulated_cuda_device();
  const dq::engine::NcclOps ops = cpu_nccl_ops();
  const Case cases[] = {
      {"all-reduce FP32 SUM", Collective::kAllReduce, false, false, false, "dynamiq"},
      {"all-reduce FP32 AVG, poisoned", Collective::kAllReduce, false, true, true, "dynamiq"},
      {"all-reduce BF16 SUM", Collective::kAllReduce, true, false, false, "dynamiq"},
      {"all-reduce BF16 AVG", Collective::kAllReduce, true, true, false, "dynamiq"},
      {"reduce-scatter FP32 SUM", Collective::kReduceScatter, false, false, false, "dynamiq"},
      {"reduce-scatter FP32 AVG", Collective::kReduceScatter, false, true, false, "dynamiq"},
      {"reduce-scatter BF16 SUM, poisoned", Collective::kReduceScatter, true, false, true,
       "dynamiq"},
      {"reduce-scatter BF16 AVG", Collective::kReduceScatter, true, true, false, "dynamiq"},
      {"all-reduce FP32 SUM, MXFP8 (baseline kernels)", Collective::kAllReduce, false, false, false,
       "mxfp8"},
      {"all-reduce BF16 AVG, uniform (DYNAMIQ_BITS 5: uniform:5, baseline kernels)",
       Collective::kAllReduce, true, true, false, "uniform"},
      {"reduce-scatter FP32 SUM, BF16 codec (baseline kernels)", Collective::kReduceScatter, false,
       false, false, "bf16"},
  };
  double host_s = 0, cuda_s = 0;
  for (const Case& c : cases) {
    const size_t esize = c.bf16 ? 2 : 4;
    const bool scatter = c.collective == Collective::kReduceScatter;
    // Two pipeline blocks of the smallest DYNAMIQ_BLOCK_BYTES (256 KiB; FP32 on 4 ranks: 64
    // super-groups per chunk message, the least a plan compresses), the second with an odd
    // remainder. A block counts the caller's bytes, a reduce-scatter's one slice per rank.
    const size_t block_bytes = 256 * 1024;
    const size_t block_elems = block_bytes / esize / (scatter ? n : 1);
    const size_t span = 2 * block_elems + (scatter ? 77 : 333);
    const size_t count = scatter ? span * n : span;
    const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                        {"DYNAMIQ_TOPO", topo},
                                        {"DYNAMIQ_CODEC", c.codec},
                                        {"DYNAMIQ_MIN_BYTES", "0"},
                                        {"DYNAMIQ_BLOCK_BYTES", std::to_string(block_bytes)}});
    Engine on_host(settings, true, {comms[0], rank, n}, ops, dq::engine::host_device(), nullptr,
                   true);
    Engine on_cuda(settings, true, {comms[1], rank, n}, ops, cuda.get(), nullptr, true);
    const auto in = make_input(rank, count, c.bf16, c.poison && rank == n - 1);
    const size_t out_bytes = (scatter ? span : count) * esize;
    std::vector<unsigned char> out_host(out_bytes, 0xCD), out_cuda(out_bytes, 0xEF);
    CallArgs args;
    args.collective = c.collective;
    args.send = in.data();
    args.count = count;
    args.dtype = c.bf16 ? ncclBfloat16 : ncclFloat32;
    args.op = c.avg ? ncclAvg : ncclSum;
    const CudaDeviceCounts before = dq::engine::cuda_device_counts(cuda.get());
    PassReason rh = PassReason::kRerouted, rc = PassReason::kRerouted;
    args.recv = out_host.data();
    auto t0 = std::chrono::steady_clock::now();
    CHECK_OR(10, on_host.run(args, &rh) == ncclSuccess, "rank %d, %s: host device call failed",
             rank, c.what);
    host_s += seconds_since(t0);
    args.recv = out_cuda.data();
    t0 = std::chrono::steady_clock::now();
    CHECK_OR(11, on_cuda.run(args, &rc) == ncclSuccess, "rank %d, %s: emulated CUDA call failed",
             rank, c.what);
    CHECK_OR(12, on_cuda.async_error() == ncclSuccess, "rank %d, %s: emulated CUDA async error",
             rank, c.what);
    cuda_s += seconds_since(t0);
    CHECK_OR(13, rh == PassReason::kRerouted && rc == PassReason::kRerouted,
             "rank %d, %s: not compressed (host %s, emulated CUDA %s)", rank, c.what,
             dq::engine::reason_name(rh), dq::engine::reason_name(rc));
    for (size_t b = 0; b < out_bytes; ++b)
      CHECK_OR(14, out_host[b] == out_cuda[b],
               "rank %d, %s: output byte %zu (element %zu) is 0x%02x on the emulated CUDA device, "
               "0x%02x on the host device",
               rank, c.what, b, b / esize, out_cuda[b], out_host[b]);
    if (!scatter)
      CHECK_OR(15, dq::test::same_bytes_everywhere(comms[0], out_cuda.data(), out_bytes),
               "rank %d, %s: all-reduce results differ across ranks", rank, c.what);
    const CudaDeviceCounts after = dq::engine::cuda_device_counts(cuda.get());
    // Every codec runs as kernels now, the baselines too (they have no statistics to compute).
    const bool baseline = std::string(c.codec) != "dynamiq";
    const uint64_t kernel_steps = (after.stats - before.stats) + (after.layouts - before.layouts) +
                                  (after.hops - before.hops) + (after.finishes - before.finishes);
    const uint64_t fallbacks = after.host_fallbacks - before.host_fallbacks;
    CHECK_OR(16,
             (baseline || after.stats > before.stats) && after.layouts > before.layouts &&
                 after.hops > before.hops && after.finishes > before.finishes && fallbacks == 0,
             "rank %d, %s: steps as kernels: %llu stats, %llu layouts, %llu hops, %llu "
             "finishes; %llu on the host codec",
             rank, c.what, static_cast<unsigned long long>(after.stats - before.stats),
             static_cast<unsigned long long>(after.layouts - before.layouts),
             static_cast<unsigned long long>(after.hops - before.hops),
             static_cast<unsigned long long>(after.finishes - before.finishes),
             static_cast<unsigned long long>(fallbacks));
    if (rank == 0)
      std::fprintf(stderr, "rank 0: %s: %zu elements, identical bytes (%llu kernel steps)\n",
                   c.what, count, static_cast<unsigned long long>(kernel_steps));
  }
  const CudaDeviceCounts total = dq::engine::cuda_device_counts(cuda.get());
  std::fprintf(stderr,
               "rank %d: %zu calls equal; kernels ran %llu stats, %llu layouts, %llu hops, %llu "
               "finishes; host %.2f s, emulated CUDA %.2f s\n",
               rank, std::size(cases), static_cast<unsigned long long>(total.stats),
               static_cast<unsigned long long>(total.layouts),
               static_cast<unsigned long long>(total.hops),
               static_cast<unsigned long long>(total.finishes), host_s, cuda_s);
  if (const int rc = launch_formula(n, topo, rank, comms, cuda.get()); rc != 0) return rc;
  if (const int rc = grid_layout_call(n, topo, rank, comms, cuda.get()); rc != 0) return rc;
  if (const int rc = auto_rungs(n, topo, rank, comms, cuda.get()); rc != 0) return rc;
  return auto_fallback(n, topo, rank, comms, cuda.get());
}

// ---- steps: each device step on its own, both devices, one process ---------------------------
// The statistics, layout, leaf and fused hops and finish of one DynamiQ codec (4 chunks, 4
// workers) through the Device interface on a device stream: every output byte the same on both
// devices. Then the error word: an input whose chunk header is corrupt, one with an invalid
// record and one that sums more workers than exist each set it to the same word on both devices
// (kCodec, kMalformedPayload); a step queued after that does nothing; on the caller's stream the
// step returns that Status at once.
struct Lanes {
  dq::engine::Device* d;
  dq::engine::StreamHandle stream = nullptr;
  dq::engine::EventHandle done = nullptr;
  uint32_t* error = nullptr;
  dq::engine::Lane lane() const { return dq::engine::Lane{stream, error}; }
  void sync() const {
    d->record(done, stream);
    d->synchronize(done);
  }
};

// Everything one device produced in steps_check, in order.
struct StepResults {
  std::vector<uint16_t> stats;
  std::vector<uint64_t> layout;
  std::vector<std::vector<uint8_t>> leaf;
  std::vector<uint8_t> fused, out;
  uint32_t errors[3] = {0, 0, 0};
  bool untouched = false;
  dq::Status caller = dq::Status::kOk;
};

// The host device's results `h` against the emulated CUDA device's `c` (and what ran as kernels
// there): 0 when they agree, else the failed check's exit code.
int compare_step_results(const StepResults& h, const StepResults& c, const dq::engine::Device* cuda,
                         int workers) {
  CHECK_OR(33, h.stats == c.stats, "statistics differ");
  CHECK_OR(34, h.layout == c.layout, "layouts differ");
  for (int r = 0; r < workers - 1; ++r)
    CHECK_OR(35, h.leaf[r] == c.leaf[r], "worker %d's leaf message differs", r);
  CHECK_OR(36, h.fused == c.fused, "the fused hop's message differs");
  CHECK_OR(37, h.out == c.out, "the finish's output differs");
  const uint32_t malformed = dq::engine::error_word(
      dq::engine::ErrorSource::kCodec, static_cast<int>(dq::Status::kMalformedPayload));
  for (int e = 0; e < 3; ++e)
    CHECK_OR(38, h.errors[e] == malformed && c.errors[e] == malformed,
             "malformed input %d: error word 0x%x on the host device, 0x%x on the emulated CUDA "
             "device, expected 0x%x",
             e, h.errors[e], c.errors[e], malformed);
  CHECK_OR(39, h.untouched && c.untouched, "a step ran after the error word was set");
  CHECK_OR(40, h.caller == dq::Status::kMalformedPayload && c.caller == h.caller,
           "caller's stream: %s on the host device, %s on the emulated CUDA device",
           dq::status_name(h.caller), dq::status_name(c.caller));
  const CudaDeviceCounts n = dq::engine::cuda_device_counts(cuda);
  CHECK_OR(41, n.host_fallbacks == 0 && n.stats == static_cast<uint64_t>(workers) && n.layouts == 1,
           "steps: %llu on the host codec", static_cast<unsigned long long>(n.host_fallbacks));
  // Launches: one kernel per statistics, layout, hop and finish step (no gate or clear kernels; a
  // finish validates and decodes in one launch).
  CHECK_OR(42,
           n.hop_launches == n.hops &&
               n.launches == n.stats + n.layouts + n.hops + n.finishes + n.budgets,
           "launches: %llu for %llu statistics, %llu layouts, %llu hops (%llu launches), %llu "
           "finishes",
           static_cast<unsigned long long>(n.launches), static_cast<unsigned long long>(n.stats),
           static_cast<unsigned long long>(n.layouts), static_cast<unsigned long long>(n.hops),
           static_cast<unsigned long long>(n.hop_launches),
           static_cast<unsigned long long>(n.finishes));
  return 0;
}

int steps_check() {
  const std::unique_ptr<dq::engine::Device> cuda = dq::engine::make_emulated_cuda_device();
  std::string why;
  const std::unique_ptr<dq::Codec> codec = dq::make_codec("dynamiq:5", &why);
  constexpr int kChunks = 4, kWorkers = 4;
  constexpr size_t kCount = 300 * 256 + 77;
  CHECK_OR(30, codec && codec->plan(kCount, kChunks, kWorkers) == dq::Status::kOk, "plan: %s",
           why.c_str());
  const size_t cap = codec->chunk_capacity(), words = codec->stats_words();
  std::vector<std::vector<unsigned char>> x(kWorkers);
  for (int r = 0; r < kWorkers; ++r) x[r] = make_input(r, kCount, r == 2, r == 3);
  auto tensor = [&](int r) {
    return dq::ConstTensor{x[r].data(), r == 2 ? dq::DType::kBF16 : dq::DType::kF32, kCount};
  };
  StepResults res[2];
  dq::engine::Device* devices[2] = {dq::engine::host_device(), cuda.get()};
  for (int k = 0; k < 2; ++k) {
    Lanes l{devices[k]};
    StepResults& out = res[k];
    CHECK_OR(31,
             l.d->create_stream(&l.stream) == dq::Status::kOk &&
                 l.d->create_event(&l.done) == dq::Status::kOk &&
                 l.d->alloc_mapped(4, reinterpret_cast<void**>(&l.error)) == dq::Status::kOk,
             "%s: setup", l.d->name());
    *l.error = 0;
    const std::unique_ptr<dq::engine::PreparedCodec> prepared = l.d->prepare(*codec);
    // Statistics of every worker, summed as the statistics all-reduce does (dq::StatsSum).
    dq::StatsSum sum(words, codec->stats_byte_sum_words());
    out.stats.assign(words * kWorkers, 0);
    for (int r = 0; r < kWorkers; ++r)
      l.d->local_stats(*prepared, tensor(r), out.stats.data() + r * words, l.lane());
    l.sync();
    for (int r = 0; r < kWorkers; ++r) sum.add(out.stats.data() + r * words);
    std::vector<uint16_t> reduced(words);
    sum.result(reduced.data(), true);
    out.layout.assign((codec->layout_bytes() + 7) / 8, 0x5a5a5a5a5a5a5a5aull);
    l.d->build_layout(*prepared, reduced.data(), 7, out.layout.data(), l.lane());
    // Leaves of chunk 1 on every worker, then worker 3's fused hop of the other three.
    dq::RoundingKey key;
    key.seed = 11;
    key.call = 7;
    out.leaf.assign(kWorkers, std::vector<uint8_t>(cap, 0xEE));
    for (int r = 0; r < kWorkers - 1; ++r) {
      key.rank = static_cast<uint32_t>(r);
      l.d->hop(*prepared, out.layout.data(), 1, tensor(r), nullptr, 0, out.leaf[r].data(), key,
               l.lane());
    }
    const dq::ByteView in[3] = {
        {out.leaf[0].data(), cap}, {out.leaf[1].data(), cap}, {out.leaf[2].data(), cap}};
    out.fused.assign(cap, 0xEE);
    key.rank = 3;
    l.d->hop(*prepared, out.layout.data(), 1, tensor(3), in, 3, out.fused.data(), key, l.lane());
    out.out.assign(kCount * 4, 0xEE);
    l.d->finish(*prepared, out.layout.data(), 1, dq::ByteView{out.fused.data(), cap},
                out.out.data(), dq::DType::kF32, dq::ReduceOp::kAvg, kWorkers, l.lane());
    l.sync();
    CHECK_OR(32, *l.error == 0, "%s: error word 0x%x on valid inputs", l.d->name(), *l.error);
    // Malformed inputs: a chunk header byte (the magic), every record byte 0xFF (negative scales,
    // invalid codes), and a message that sums every worker already (with own: one too many).
    for (int e = 0; e < 3; ++e) {
      std::vector<uint8_t> bad = out.leaf[0], sink(cap, 0xEE);
      if (e == 0) bad[1] ^= 0x40;
      if (e == 1)
        std::memset(bad.data() + dq::kChunkHeaderBytes, 0xFF, cap - dq::kChunkHeaderBytes);
      if (e == 2) bad = out.fused;
      const dq::ByteView v{bad.data(), cap};
      *l.error = 0;
      l.d->hop(*prepared, out.layout.data(), 1, tensor(3), &v, 1, sink.data(), key, l.lane());
      l.sync();
      out.errors[e] = *l.error;
    }
    // With the word set, a later step does nothing.
    std::vector<uint8_t> skipped(cap, 0xEE);
    l.d->hop(*prepared, out.layout.data(), 1, tensor(3), nullptr, 0, skipped.data(), key, l.lane());
    l.sync();
    out.untouched = skipped == std::vector<uint8_t>(cap, 0xEE);
    // On the caller's stream: at once, with the Status.
    *l.error = 0;
    std::vector<uint8_t> bad = out.leaf[0], sink(cap, 0xEE);
    bad[1] ^= 0x40;
    const dq::ByteView v{bad.data(), cap};
    out.caller = l.d->hop(*prepared, out.layout.data(), 1, tensor(3), &v, 1, sink.data(), key,
                          dq::engine::Lane{nullptr, l.error});
    l.d->destroy_event(l.done);
    l.d->destroy_stream(l.stream);
    l.d->release(l.error, nullptr);
  }
  if (const int failed = compare_step_results(res[0], res[1], cuda.get(), kWorkers)) return failed;
  std::printf(
      "emulated CUDA device steps: statistics, layout, leaves, fused hop, finish equal the host "
      "device's; malformed inputs set the same error word; later steps skipped\n");
  return 0;
}

// ---- the canary (docs/ENGINE.md section 6) ----------------------------------------------------
// One process: run_canary on the emulated device matches the host codec; its tensor gives every
// width (2, 4, 8, 16); a corrupted fused-hop kernel is found at the byte it corrupts, in the first
// hop payload; the host device reports no canary needed; a codec without kernels matches too.
constexpr int64_t kCorruptByte = 276;

// A codec spec the test names as text, parsed (the engine takes CodecSpec values); an invalid
// one ends the test.
dq::CodecSpec spec_of(const char* text) {
  dq::CodecSpec spec;
  std::string why;
  if (!dq::parse_codec_spec(text, &spec, &why)) {
    std::fprintf(stderr, "codec spec %s: %s\n", text, why.c_str());
    std::exit(2);
  }
  return spec;
}

int canary_steps_check() {
  const std::unique_ptr<dq::engine::Device> good = dq::engine::make_emulated_cuda_device();
  dq::engine::EmulatedCudaFault fault;
  fault.hop_output_byte = kCorruptByte;
  const std::unique_ptr<dq::engine::Device> bad =
      dq::engine::make_emulated_cuda_device(nullptr, fault);
  CHECK_OR(
      50, good->needs_canary() && bad->needs_canary() && !dq::engine::host_device()->needs_canary(),
      "needs_canary: emulated CUDA %d, host %d", good->needs_canary(),
      dq::engine::host_device()->needs_canary());
  auto canary = [](dq::engine::Device* d, const char* spec) {
    dq::engine::StreamHandle s = nullptr;
    if (d->create_stream(&s) != dq::Status::kOk) std::exit(51);
    dq::engine::CanaryResult r = dq::engine::run_canary(d, spec_of(spec), s, 0x5eed);
    d->destroy_stream(s);
    return r;
  };
  const dq::engine::CanaryResult ok = canary(good.get(), "dynamiq:5");
  CHECK_OR(52, ok.ran && !ok.differs, "emulated device, dynamiq:5: %s",
           ok.ran ? ok.describe().c_str() : "not run");
  std::string why;
  const std::unique_ptr<dq::Codec> codec = dq::make_codec("dynamiq:5", &why);
  CHECK_OR(53,
           codec &&
               codec->plan(dq::engine::kCanaryCount, dq::engine::kCanaryChunks,
                           dq::engine::kCanaryWorkers) == dq::Status::kOk &&
               ok.host_layout.size() == codec->layout_bytes(),
           "plan: %s", why.c_str());
  const dq::DynamiqLayoutView view = dq::dynamiq_layout(*codec, ok.host_layout.data());
  std::map<int, int> widths;
  for (size_t j = 0; j < view.n_supergroups; ++j) ++widths[view.widths[j]];
  CHECK_OR(54, widths[2] > 0 && widths[4] > 0 && widths[8] > 0 && widths[16] > 0,
           "canary widths: %d x 2, %d x 4, %d x 8, %d x 16 bits", widths[2], widths[4], widths[8],
           widths[16]);
  const dq::engine::CanaryResult host = canary(dq::engine::host_device(), "dynamiq:5");
  CHECK_OR(55, host.ran && !host.differs, "host device: %s", host.describe().c_str());
  // The baselines' canary: their kernels against the host codec, none of it on the host codec.
  for (const char* spec : {"mxfp8", "uniform:5", "bf16", "mxfp6e2m3", "mxfp4"}) {
    const dq::engine::CudaDeviceCounts before = dq::engine::cuda_device_counts(good.get());
    const dq::engine::CanaryResult mx = canary(good.get(), spec);
    const dq::engine::CudaDeviceCounts after = dq::engine::cuda_device_counts(good.get());
    CHECK_OR(56, mx.ran && !mx.differs, "emulated device, %s: %s", spec,
             mx.ran ? mx.describe().c_str() : "not run");
    CHECK_OR(58,
             after.host_fallbacks == before.host_fallbacks && after.hops > before.hops &&
                 after.finishes > before.finishes && after.layouts > before.layouts,
             "emulated device, %s canary: %llu steps on the host codec, %llu hops as kernels", spec,
             static_cast<unsigned long long>(after.host_fallbacks - before.host_fallbacks),
             static_cast<unsigned long long>(after.hops - before.hops));
  }
  const dq::engine::CanaryResult corrupt = canary(bad.get(), "dynamiq:5");
  CHECK_OR(57,
           corrupt.ran && corrupt.differs && corrupt.device_status == dq::Status::kOk &&
               corrupt.step == "hop payload (chunk 0)" &&
               corrupt.byte == static_cast<size_t>(kCorruptByte) &&
               corrupt.got == (corrupt.expected ^ fault.mask),
           "corrupted hop kernel: %s",
           corrupt.differs ? corrupt.describe().c_str() : "no difference");
  // A fault in the stratified (correlated-rounding) leaves alone: the canary's leaves are
  // stratified, so it is found there.
  dq::engine::EmulatedCudaFault strat_fault = fault;
  strat_fault.stratified_leaves = true;
  const std::unique_ptr<dq::engine::Device> strat =
      dq::engine::make_emulated_cuda_device(nullptr, strat_fault);
  const dq::engine::CanaryResult stratified = canary(strat.get(), "dynamiq:5");
  CHECK_OR(59,
           stratified.ran && stratified.differs &&
               stratified.step == "leaf payload of worker 0 (chunk 0)" &&
               stratified.byte == static_cast<size_t>(kCorruptByte),
           "corrupted stratified leaves: %s",
           stratified.differs ? stratified.describe().c_str() : "no difference");
  std::printf("canary: emulated device matches (widths 2/4/8/16: %d/%d/%d/%d super-groups); %s\n",
              widths[2], widths[4], widths[8], widths[16], corrupt.describe().c_str());
  return 0;
}

// Four ranks, three communicators each: (0) the host device and (1) the emulated device, the same
// compressed calls on both: compressed, bytes equal, the canary run on the emulated device only;
// (2) the emulated device whose fused-hop kernel is corrupted on rank 1 alone: the canary fails
// there, every rank agrees, and every call passes through on every rank (recv untouched by the
// engine, then NCCL's own result), counted as canary_failed; one canary warning per rank, the
// corrupted rank's naming the step and the byte.
int canary_body(int n, int rank, ncclComm_t* comms, const std::string& log_dir) {
  const std::string log = log_dir + "/rank" + std::to_string(rank) + ".log";
  setenv("DYNAMIQ_DEBUG_FILE", log.c_str(), 1);
  dq::config::reload_log_from_env();
  const std::unique_ptr<dq::engine::Device> good = dq::engine::make_emulated_cuda_device();
  dq::engine::EmulatedCudaFault fault;
  fault.hop_output_byte = kCorruptByte;
  const std::unique_ptr<dq::engine::Device> bad =
      dq::engine::make_emulated_cuda_device(nullptr, fault);
  const dq::engine::NcclOps ops = cpu_nccl_ops();
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_MIN_BYTES", "0"}});
  auto metrics = [] { return std::make_shared<dq::engine::CommMetrics>(); };
  const auto m_host = metrics(), m_cuda = metrics(), m_bad = metrics();
  Engine on_host(settings, true, {comms[0], rank, n}, ops, dq::engine::host_device(), m_host, true);
  Engine on_cuda(settings, true, {comms[1], rank, n}, ops, good.get(), m_cuda, true);
  Engine corrupted(settings, true, {comms[2], rank, n}, ops, rank == 1 ? bad.get() : good.get(),
                   m_bad, true);
  struct Call {
    const char* what;
    Collective collective;
    bool bf16, avg;
  };
  const Call calls[] = {{"all-reduce FP32 SUM", Collective::kAllReduce, false, false},
                        {"all-reduce BF16 AVG", Collective::kAllReduce, true, true},
                        {"reduce-scatter FP32 SUM", Collective::kReduceScatter, false, false}};
  for (const Call& c : calls) {
    const bool scatter = c.collective == Collective::kReduceScatter;
    const size_t esize = c.bf16 ? 2 : 4;
    const size_t span = 4 * 64 * 256 + 333;  // 64 super-groups per chunk message and more
    const size_t count = scatter ? span * n : span, out_count = span;
    const auto in = make_input(rank, count, c.bf16, false);
    CallArgs args;
    args.collective = c.collective;
    args.send = in.data();
    args.count = count;
    args.dtype = c.bf16 ? ncclBfloat16 : ncclFloat32;
    args.op = c.avg ? ncclAvg : ncclSum;
    std::vector<unsigned char> out_host(out_count * esize, 0xCD), out_cuda(out_count * esize, 0xEF),
        out_bad(out_count * esize, 0xAB), expect(out_count * esize, 0);
    PassReason rh, rc, rb;
    args.recv = out_host.data();
    CHECK_OR(60, on_host.run(args, &rh) == ncclSuccess, "rank %d, %s: host call", rank, c.what);
    args.recv = out_cuda.data();
    CHECK_OR(61, on_cuda.run(args, &rc) == ncclSuccess, "rank %d, %s: emulated call", rank, c.what);
    CHECK_OR(62, rh == PassReason::kRerouted && rc == PassReason::kRerouted,
             "rank %d, %s: host %s, emulated CUDA %s (expected rerouted)", rank, c.what,
             dq::engine::reason_name(rh), dq::engine::reason_name(rc));
    CHECK_OR(63, out_host == out_cuda, "rank %d, %s: emulated device's bytes differ", rank, c.what);
    args.recv = out_bad.data();
    CHECK_OR(64, corrupted.run(args, &rb) == ncclSuccess && corrupted.async_error() == ncclSuccess,
             "rank %d, %s: the corrupted communicator's call failed", rank, c.what);
    CHECK_OR(65, rb == PassReason::kCanaryFailed, "rank %d, %s: %s, expected canary_failed", rank,
             c.what, dq::engine::reason_name(rb));
    CHECK_OR(66, out_bad == std::vector<unsigned char>(out_bad.size(), 0xAB),
             "rank %d, %s: the engine wrote into a passed-through call's recv", rank, c.what);
    // The caller passes it through (as the shim does); NCCL's own result on another
    // communicator is the reference.
    const ncclDataType_t t = args.dtype;
    const ncclRedOp_t op = args.op;
    ncclResult_t pass, ref;
    if (scatter) {
      pass = ncclReduceScatter(in.data(), out_bad.data(), out_count, t, op, comms[2], nullptr);
      ref = ncclReduceScatter(in.data(), expect.data(), out_count, t, op, comms[0], nullptr);
    } else {
      pass = ncclAllReduce(in.data(), out_bad.data(), count, t, op, comms[2], nullptr);
      ref = ncclAllReduce(in.data(), expect.data(), count, t, op, comms[0], nullptr);
    }
    CHECK_OR(67, pass == ncclSuccess && ref == ncclSuccess && out_bad == expect,
             "rank %d, %s: the passed-through result differs from NCCL's", rank, c.what);
  }
  CHECK_OR(68,
           on_host.canary() == Engine::Canary::kNotRun &&
               on_cuda.canary() == Engine::Canary::kPassed &&
               corrupted.canary() == Engine::Canary::kFailed,
           "rank %d: canary state host %d, emulated %d, corrupted %d", rank,
           static_cast<int>(on_host.canary()), static_cast<int>(on_cuda.canary()),
           static_cast<int>(corrupted.canary()));
  const uint64_t n_calls = std::size(calls);
  for (int k = 0; k < dq::engine::kPassReasonCount; ++k) {
    const auto reason = static_cast<PassReason>(k);
    const uint64_t want_good = reason == PassReason::kRerouted ? n_calls : 0;
    const uint64_t want_bad = reason == PassReason::kCanaryFailed ? n_calls : 0;
    CHECK_OR(69,
             m_host->calls[k].load() == want_good && m_cuda->calls[k].load() == want_good &&
                 m_bad->calls[k].load() == want_bad,
             "rank %d: %s counted %llu / %llu / %llu times (host / emulated / corrupted)", rank,
             dq::engine::reason_name(reason),
             static_cast<unsigned long long>(m_host->calls[k].load()),
             static_cast<unsigned long long>(m_cuda->calls[k].load()),
             static_cast<unsigned long long>(m_bad->calls[k].load()));
  }
  // The warnings: one canary line per rank.
  std::vector<std::string> lines;
  if (std::FILE* f = std::fopen(log.c_str(), "r")) {
    char line[2048];
    while (std::fgets(line, sizeof line, f))
      if (std::strstr(line, "canary")) lines.emplace_back(line);
    std::fclose(f);
  }
  CHECK_OR(70, lines.size() == 1, "rank %d: %zu canary lines in the log, expected 1", rank,
           lines.size());
  const std::string& w = lines.front();
  const std::string byte = "hop payload (chunk 0) differs from the host codec at byte " +
                           std::to_string(kCorruptByte) + " (0x";
  if (rank == 1)
    CHECK_OR(71, w.find("WARN") != std::string::npos && w.find(byte) != std::string::npos,
             "rank 1: the warning does not name the step and byte: %s", w.c_str());
  else
    CHECK_OR(
        72,
        w.find("WARN") != std::string::npos && w.find("another rank's device") != std::string::npos,
        "rank %d: the warning does not name a peer's canary: %s", rank, w.c_str());
  if (rank <= 1) std::fprintf(stderr, "rank %d: %s", rank, w.c_str());
  return 0;
}

// ---- two_level: the two-level schedule on both devices ------------------------------------------
// 2 nodes x 2 ranks (NCCL_HOSTID per rank, DYNAMIQ_HIERARCHY=node): an FP32 all-reduce in two
// pipelined pieces (three engine streams, the rail engine's own), a BF16 AVG reduce-scatter and an
// FP32 reduce to rank 3, each with odd counts: compressed on both devices, the rail engine's
// DynamiQ steps as kernels on the emulated one, and the same bytes as on the host device.
int two_level_body(int rank, ncclComm_t* comms) {
  const int n = 4;
  setenv("NCCL_HOSTID", rank < 2 ? "node0" : "node1", 1);  // read at the handshake
  const std::unique_ptr<dq::engine::Device> cuda = dq::engine::make_emulated_cuda_device();
  const dq::engine::NcclOps ops = cpu_nccl_ops();
  struct TwoLevelCase {
    const char* what;
    Collective collective;
    bool bf16, avg;
    size_t count;  // a reduce-scatter: per rank
  };
  // 256 KiB blocks: a piece is 32,768 shard elements (64 super-groups per rail chunk).
  const TwoLevelCase cases[] = {
      {"all-reduce FP32 SUM, 2 pieces", Collective::kAllReduce, false, false, 2 * 65536 + 333},
      {"reduce-scatter BF16 AVG", Collective::kReduceScatter, true, true, 32768 + 77},
      {"reduce FP32 SUM to rank 3", Collective::kReduce, false, false, 65536 + 333},
  };
  const auto settings = settings_for({{"DYNAMIQ_ENABLE", "1"},
                                      {"DYNAMIQ_HIERARCHY", "node"},
                                      {"DYNAMIQ_MIN_BYTES", "0"},
                                      {"DYNAMIQ_BLOCK_BYTES", "262144"}});
  const auto m_host = std::make_shared<dq::engine::CommMetrics>();
  const auto m_cuda = std::make_shared<dq::engine::CommMetrics>();
  Engine on_host(settings, true, {comms[0], rank, n}, ops, dq::engine::host_device(), m_host, true);
  Engine on_cuda(settings, true, {comms[1], rank, n}, ops, cuda.get(), m_cuda, true);
  for (const TwoLevelCase& c : cases) {
    const size_t esize = c.bf16 ? 2 : 4;
    const bool scatter = c.collective == Collective::kReduceScatter;
    const size_t count = scatter ? c.count * n : c.count;
    const auto in = make_input(rank, count, c.bf16, false);
    const size_t out_bytes = (scatter ? c.count : count) * esize;
    std::vector<unsigned char> out_host(out_bytes, 0xCD), out_cuda(out_bytes, 0xCD);
    CallArgs args;
    args.collective = c.collective;
    args.root = 3;
    args.send = in.data();
    args.count = count;
    args.dtype = c.bf16 ? ncclBfloat16 : ncclFloat32;
    args.op = c.avg ? ncclAvg : ncclSum;
    const CudaDeviceCounts before = dq::engine::cuda_device_counts(cuda.get());
    PassReason rh = PassReason::kRerouted, rc = PassReason::kRerouted;
    args.recv = out_host.data();
    CHECK_OR(80, on_host.run(args, &rh) == ncclSuccess, "rank %d, %s: host device call failed",
             rank, c.what);
    args.recv = out_cuda.data();
    CHECK_OR(81, on_cuda.run(args, &rc) == ncclSuccess && on_cuda.async_error() == ncclSuccess,
             "rank %d, %s: emulated CUDA call failed", rank, c.what);
    CHECK_OR(82, rh == PassReason::kRerouted && rc == PassReason::kRerouted,
             "rank %d, %s: not run (host %s, emulated CUDA %s)", rank, c.what,
             dq::engine::reason_name(rh), dq::engine::reason_name(rc));
    const CudaDeviceCounts after = dq::engine::cuda_device_counts(cuda.get());
    CHECK_OR(83, after.hops > before.hops && after.host_fallbacks == before.host_fallbacks,
             "rank %d, %s: the rail engine ran no hop kernel", rank, c.what);
    for (size_t b = 0; b < out_bytes; ++b)
      CHECK_OR(84, out_host[b] == out_cuda[b],
               "rank %d, %s: output byte %zu is 0x%02x on the emulated CUDA device, 0x%02x on the "
               "host device",
               rank, c.what, b, out_cuda[b], out_host[b]);
    if (c.collective == Collective::kAllReduce) {
      CHECK_OR(85, dq::test::same_bytes_everywhere(comms[0], out_cuda.data(), out_bytes),
               "rank %d, %s: results differ across ranks", rank, c.what);
      // Two levels: the compressed stage saw this rank's shard, half the call (a flat schedule
      // would count all of it).
      const uint64_t shard_bytes = count / 2 * esize;
      CHECK_OR(86, m_host->bytes_in.load() == shard_bytes && m_cuda->bytes_in.load() == shard_bytes,
               "rank %d, %s: %llu / %llu bytes compressed, expected the shard's %llu", rank, c.what,
               static_cast<unsigned long long>(m_host->bytes_in.load()),
               static_cast<unsigned long long>(m_cuda->bytes_in.load()),
               static_cast<unsigned long long>(shard_bytes));
    }
    if (rank == 0)
      std::fprintf(stderr, "rank 0: two levels, %s: identical bytes on both devices\n", c.what);
  }
  return 0;
}

int canary_check(int n) {
  char dir[] = "/tmp/dq_canary_XXXXXX";
  CHECK_OR(2, mkdtemp(dir) != nullptr, "mkdtemp");
  dq::test::RankOptions opt;
  opt.timeout_s = 180;
  const auto exits = dq::test::run_ranks<ncclUniqueId>(
      n, 3, ncclGetUniqueId, opt, [&](int r, const ncclUniqueId* ids) {
        ncclComm_t comms[3];
        for (int k = 0; k < 3; ++k)
          if (ncclCommInitRank(&comms[k], n, ids[k], r) != ncclSuccess) return 97;
        return destroy_if_passed(canary_body(n, r, comms, dir), comms, 3);
      });
  bool ok = true;
  for (size_t r = 0; r < exits.size(); ++r) {
    const std::string log = std::string(dir) + "/rank" + std::to_string(r) + ".log";
    std::remove(log.c_str());
    if (exits[r].code() != 0) {
      std::fprintf(stderr, "FAIL: rank %zu exited with %d%s\n", r, exits[r].code(),
                   exits[r].code() == 124 ? " (hang: killed at the deadline)" : "");
      ok = false;
    }
  }
  rmdir(dir);
  if (!ok) return 1;
  std::printf(
      "canary, %d ranks: passes on the emulated device (calls compressed, bytes equal the "
      "host device's; no canary on the host device); a corrupted hop kernel on rank 1 "
      "turns the communicator to pass-through on every rank, one warning each\n",
      n);
  return 0;
}

}  // namespace

// A passing rank destroys its communicators before it exits, so their connections' threads are
// joined (ThreadSanitizer reports a finished thread never joined as a leak, once it has finished
// by the time the process exits); a failing one exits with its code at once. Returns `code`.
int destroy_if_passed(int code, ncclComm_t* comms, int n_comms) {
  if (code == 0)
    for (int k = 0; k < n_comms; ++k) ncclCommDestroy(comms[k]);
  return code;
}

int capture_check(int n);          // engine_emulated_cuda_capture.cc
int in_progress_check(int n);      // engine_emulated_cuda_capture.cc
int standby_capture_check(int n);  // engine_emulated_cuda_capture.cc
int standby_failure_check(int n);  // engine_emulated_cuda_capture.cc

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s NRANKS [TOPO] | steps | canary_steps | canary NRANKS\n",
                 argv[0]);
    return 2;
  }
  if (std::string(argv[1]) == "steps") return steps_check();
  if (std::string(argv[1]) == "canary_steps") return canary_steps_check();
  if (std::string(argv[1]) == "canary") return canary_check(argc > 2 ? std::atoi(argv[2]) : 4);
  if (std::string(argv[1]) == "in_progress")
    return in_progress_check(argc > 2 ? std::atoi(argv[2]) : 2);
  if (std::string(argv[1]) == "capture") return capture_check(argc > 2 ? std::atoi(argv[2]) : 2);
  if (std::string(argv[1]) == "standby_capture")
    return standby_capture_check(argc > 2 ? std::atoi(argv[2]) : 4);
  if (std::string(argv[1]) == "standby_failure")
    return standby_failure_check(argc > 2 ? std::atoi(argv[2]) : 4);
  const bool two_level = std::string(argv[1]) == "two_level";
  const int n = two_level ? 4 : std::atoi(argv[1]);
  const std::string topo = argc > 2 ? argv[2] : "auto";
  dq::test::RankOptions opt;
  opt.timeout_s = 240;
  const auto exits = dq::test::run_ranks<ncclUniqueId>(
      n, 2, ncclGetUniqueId, opt, [&](int r, const ncclUniqueId* ids) {
        ncclComm_t comms[2];
        for (int k = 0; k < 2; ++k)
          if (ncclCommInitRank(&comms[k], n, ids[k], r) != ncclSuccess) return 97;
        return destroy_if_passed(two_level ? two_level_body(r, comms) : body(n, topo, r, comms),
                                 comms, 2);
      });
  bool ok = true;
  for (size_t r = 0; r < exits.size(); ++r)
    if (exits[r].code() != 0) {
      const int code = exits[r].code();
      std::fprintf(stderr, "FAIL: rank %zu exited with %d%s\n", r, code,
                   code == 124   ? " (hang: killed at the deadline)"
                   : code == 125 ? " (killed: another rank failed)"
                                 : "");
      ok = false;
    }
  if (!ok) return 1;
  std::printf("emulated CUDA device, %d ranks, %s: every call's bytes equal the host device's\n", n,
              two_level ? "two levels (2 x 2)" : topo.c_str());
  return 0;
}
