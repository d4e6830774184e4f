// The fused-hop kernel's throughput against a device-to-device cudaMemcpy in the same run
// (the kernels' target: the hop at least 60% of the copy's bandwidth). Not a test: it prints the
// numbers and fails only on a CUDA error or a kernel's error flag, never on the ratio.
//
//   hop_bandwidth [count (default 2^26)] [chunks (default 8)] [iterations (default 20)]
//   hop_bandwidth --grids    (the hop on a few grids: grid_sweep())
//
// Two workers' tensors of `count` values, FP32 and then BF16 (the own values a mixed-precision
// job's gradients have); statistics and layout on the device; then, timed with CUDA events over
// `iterations` rounds after one warm-up round:
//  - copy: cudaMemcpyAsync device to device of the tensor (count * 4 or count * 2 bytes);
//  - leaf: the hop with no input (n_in = 0) of every chunk, i.e. the whole tensor compressed;
//  - hop:  the hop with one input message (n_in = 1, the other worker's leaf) of every chunk,
//          the step of a ring all-reduce, with correlated rounding over 2 strata;
//  - hop_s1: the same hop with plain stochastic rounding (strata = 1): the difference from hop
//          is what the correlated rounding's strata cost (no hardware counters needed);
//  - finish: the other worker's leaves (one contributor each) decoded into a tensor of the own
//          values' type, every chunk in one launch (the engine's finish step);
//  - stats: the statistics kernel over the tensor;
//  - layout: the layout from the reduced statistics (a batch of one: one block, or the grid
//            path's seven kernels for 2^26 values; printed as layout_ms).
// "GB/s" is tensor bytes (count * 4 or 2) per second, so each ratio is the copy's time over the
// kernel's for the same tensor; "traffic" adds what each moves besides (the copy reads and
// writes the tensor; a hop reads the tensor and its inputs and writes a chunk_capacity()
// message per chunk; the finish reads each message twice, its validators' and its decoders'
// pass, and writes the tensor). Each type first times the copy and the hop and prints their
// RESULT line (hop_vs_copy, copy_GBps, hop_GBps) at once, then the rest and a full RESULT line
// repeating them (BF16's keys start bf16_). Exit 77 without a device.
//
// After the timed rounds, one more round of each kernel (statistics, layout, leaf and hop of
// chunk 0, finish) runs between cudaProfilerStart() and cudaProfilerStop(), so that Nsight
// Compute with --profile-from-start off profiles those launches alone (check.sh's
// profile_kernels); without a profiler attached the two calls do nothing.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "kernels/cuda/dynamiq.h"
#include "kernels/cuda/stats.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/stats_sum.h"
#include "tests/gpu/gpu_bench.h"

namespace {

using dq::gpubench::make_values;
using dq::gpubench::Timer;

// The device buffers of the run: both workers' tensors, the statistics, the layout (built from
// the reduced statistics as the engine would) and worker 1's leaves (the hops' inputs).
struct Bench {
  size_t count = 0, cap = 0, stats_words = 0;
  int n_chunks = 0;
  bool bf16 = false;  // own values: BF16, else FP32
  uint64_t call = 7;
  dq::cuda::DynamiqDeviceParams params{};
  void *own[2] = {}, *copy_dst = nullptr;
  uint16_t *d_stats = nullptr, *d_reduced = nullptr;
  dq::LevelTable* d_levels = nullptr;
  void* d_layout = nullptr;
  uint8_t *leaves = nullptr, *out = nullptr;
  unsigned* d_error = nullptr;
  dq::cuda::StepWord* d_finish_word = nullptr;  // the finish's flags and tickets
  dq::cuda::LayoutBatch layout_batch;  // the layout as a batch of one, its table on the device
  void* d_layout_table = nullptr;
};

void prepare(const dq::Codec& codec, const dq::DynamiqOptions& options, Bench* b) {
  using namespace dq;
  using namespace dq::cuda;
  const size_t bytes = b->count * (b->bf16 ? 2 : 4);
  LevelTable levels[3];
  dynamiq_level_tables(options, levels);
  for (int r = 0; r < 2; ++r) {
    DQ_BENCH_CHECK(cudaMalloc(&b->own[r], bytes));
    const std::vector<float> x = make_values(b->count, 1 + r);
    std::vector<uint16_t> h;
    if (b->bf16) {
      h.resize(b->count);
      for (size_t i = 0; i < b->count; ++i) h[i] = f32_to_bf16_rne(x[i]);
    }
    const void* src = b->bf16 ? static_cast<const void*>(h.data()) : x.data();
    DQ_BENCH_CHECK(cudaMemcpy(b->own[r], src, bytes, cudaMemcpyHostToDevice));
  }
  const size_t words = b->stats_words = codec.stats_words();
  DQ_BENCH_CHECK(cudaMalloc(&b->copy_dst, bytes));
  DQ_BENCH_CHECK(cudaMalloc(&b->d_stats, 2 * words * sizeof(uint16_t)));
  DQ_BENCH_CHECK(cudaMalloc(&b->d_reduced, words * sizeof(uint16_t)));
  DQ_BENCH_CHECK(cudaMalloc(&b->d_levels, sizeof levels));
  DQ_BENCH_CHECK(cudaMalloc(&b->d_layout, b->params.sections.bytes));
  DQ_BENCH_CHECK(cudaMalloc(&b->leaves, b->cap * b->n_chunks));
  DQ_BENCH_CHECK(cudaMalloc(&b->out, b->cap * b->n_chunks));
  DQ_BENCH_CHECK(cudaMalloc(&b->d_error, sizeof(unsigned)));
  DQ_BENCH_CHECK(cudaMemset(b->d_error, 0, sizeof(unsigned)));
  DQ_BENCH_CHECK(cudaMalloc(&b->d_finish_word, sizeof(dq::cuda::StepWord)));
  DQ_BENCH_CHECK(cudaMemset(b->d_finish_word, 0, sizeof(dq::cuda::StepWord)));
  DQ_BENCH_CHECK(cudaMemcpy(b->d_levels, levels, sizeof levels, cudaMemcpyHostToDevice));
  // Statistics of both workers on the device, summed on the host as the all-reduce would.
  for (int r = 0; r < 2; ++r)
    DQ_BENCH_CHECK(
        launch_supergroup_stats(b->own[r], b->bf16, b->count, 2, b->d_stats + r * words, nullptr));
  std::vector<uint16_t> stats(2 * words), reduced(words);
  DQ_BENCH_CHECK(cudaMemcpy(stats.data(), b->d_stats, stats.size() * sizeof(uint16_t),
                            cudaMemcpyDeviceToHost));
  StatsSum sum(words, codec.stats_byte_sum_words());
  for (int r = 0; r < 2; ++r) sum.add(stats.data() + r * words);
  sum.result(reduced.data(), true);
  DQ_BENCH_CHECK(
      cudaMemcpy(b->d_reduced, reduced.data(), words * sizeof(uint16_t), cudaMemcpyHostToDevice));
  const LayoutJob job{b->params, b->d_reduced, b->d_layout};
  if (!plan_layout_batch(&job, 1, &b->layout_batch)) {
    std::fprintf(stderr, "FAIL: the layout's batch could not be planned\n");
    std::exit(1);
  }
  DQ_BENCH_CHECK(cudaMalloc(&b->d_layout_table, b->layout_batch.table.size()));
  DQ_BENCH_CHECK(cudaMemcpy(b->d_layout_table, b->layout_batch.table.data(),
                            b->layout_batch.table.size(), cudaMemcpyHostToDevice));
  DQ_BENCH_CHECK(
      launch_dynamiq_layouts(b->layout_batch, b->d_layout_table, b->call, b->d_error, nullptr));
  for (int c = 0; c < b->n_chunks; ++c) {
    const RoundingKey key{1, b->call, 1, 1, 2, 0, 0};
    DQ_BENCH_CHECK(launch_dynamiq_hop(b->params, b->d_levels, b->d_layout, c, b->own[1], b->bf16,
                                      nullptr, 0, b->leaves + c * b->cap, key, b->d_error,
                                      nullptr));
  }
  DQ_BENCH_CHECK(cudaDeviceSynchronize());
}

// The host codec planned for `count` values in `n_chunks` chunks of 2 workers; ends the program
// when it cannot be.
std::unique_ptr<dq::Codec> planned_codec(const dq::DynamiqOptions& options, size_t count,
                                         int n_chunks) {
  auto codec = dq::make_dynamiq_codec(options);
  if (codec->plan(count, n_chunks, 2) != dq::Status::kOk) {
    std::fprintf(stderr, "FAIL: the host codec cannot plan count %zu over %d chunks\n", count,
                 n_chunks);
    std::exit(1);
  }
  return codec;
}

// A bench of `codec` (planned for count, n_chunks) with own values of one type, prepared.
void make_bench(const dq::Codec& codec, const dq::DynamiqOptions& options, size_t count,
                int n_chunks, bool bf16, Bench* b) {
  b->count = count;
  b->n_chunks = n_chunks;
  b->bf16 = bf16;
  b->cap = codec.chunk_capacity();
  b->params = dq::cuda::dynamiq_device_params(count, n_chunks, 2, b->cap, options);
  prepare(codec, options, b);
}

// Seconds per round of the device-to-device copy of worker 0's tensor: every ratio's baseline.
double copy_seconds(const Bench& b, Timer& timer, int iterations) {
  const size_t bytes = b.count * (b.bf16 ? 2 : 4);
  return timer.seconds_per_round(
      [&] {
        DQ_BENCH_CHECK(
            cudaMemcpyAsync(b.copy_dst, b.own[0], bytes, cudaMemcpyDeviceToDevice, nullptr));
      },
      iterations);
}

// A ring step's hop of every chunk (one input: worker 1's leaf), with `strata` correlated
// roundings (1: plain), on a grid of at most max_blocks blocks (0: the launch's own).
void enqueue_hops(const Bench& b, uint32_t strata, int max_blocks) {
  using namespace dq;
  const RoundingKey key{1, b.call, 0, 0, strata, strata > 1 ? 1u : 0u, 0};
  for (int c = 0; c < b.n_chunks; ++c) {
    const uint8_t* in = b.leaves + c * b.cap;
    DQ_BENCH_CHECK(cuda::launch_dynamiq_hop(b.params, b.d_levels, b.d_layout, c, b.own[0], b.bf16,
                                            &in, 1, b.out + c * b.cap, key, b.d_error, nullptr,
                                            max_blocks));
  }
}

// The copy's time over each hop's: the RESULT line's ratios for one type of own values.
struct Ratios {
  double hop = 0, hop_strata1 = 0, leaf = 0, finish = 0, copy_gbps = 0, hop_gbps = 0, layout_ms = 0;
  unsigned error = 0;  // the kernels' error flags
};

// Seconds per round of every timed step (the file comment), and the table.
Ratios measure(const Bench& b, int iterations) {
  using namespace dq;
  using namespace dq::cuda;
  const size_t bytes = b.count * (b.bf16 ? 2 : 4), cap = b.cap;
  const int n_chunks = b.n_chunks;
  Timer timer;
  const double gb = 1e9;
  // The copy and the hop first, their RESULT line printed and flushed at once: the ratio the
  // target is read from survives a later kernel's failure (which exits) or the step's timeout.
  const double t_copy = copy_seconds(b, timer, iterations);
  const double t_hop = timer.seconds_per_round([&] { enqueue_hops(b, 2, 0); }, iterations);
  const char* prefix = b.bf16 ? "bf16_" : "";
  std::printf("RESULT %shop_vs_copy=%.3f %scopy_GBps=%.1f %shop_GBps=%.1f\n", prefix,
              t_copy / t_hop, prefix, bytes / t_copy / gb, prefix, bytes / t_hop / gb);
  std::fflush(stdout);
  const double t_stats = timer.seconds_per_round(
      [&] {
        DQ_BENCH_CHECK(launch_supergroup_stats(b.own[0], b.bf16, b.count, 2, b.d_stats, nullptr));
      },
      iterations);
  // Each round rebuilds the same layout bytes from the same reduced statistics (its table
  // planned and copied once, as the engine does).
  const double t_layout = timer.seconds_per_round(
      [&] {
        DQ_BENCH_CHECK(
            launch_dynamiq_layouts(b.layout_batch, b.d_layout_table, b.call, b.d_error, nullptr));
      },
      iterations);
  const double t_leaf = timer.seconds_per_round(
      [&] {
        const RoundingKey key{1, b.call, 0, 0, 1, 0, 0};
        for (int c = 0; c < n_chunks; ++c)
          DQ_BENCH_CHECK(launch_dynamiq_hop(b.params, b.d_levels, b.d_layout, c, b.own[0], b.bf16,
                                            nullptr, 0, b.out + c * cap, key, b.d_error, nullptr));
      },
      iterations);
  const double t_hop_s1 = timer.seconds_per_round([&] { enqueue_hops(b, 1, 0); }, iterations);
  const double t_finish = timer.seconds_per_round(
      [&] {
        DQ_BENCH_CHECK(launch_dynamiq_finishes(b.params, b.d_levels, b.d_layout, 0, n_chunks,
                                               b.leaves, cap, b.copy_dst, b.bf16, false, 1,
                                               b.d_finish_word, nullptr));
      },
      iterations);
  Ratios r;  // its error flags: run() reads them once every kernel has run

  const double msgs = static_cast<double>(cap) * n_chunks;
  std::printf(
      "count %zu %s (%.1f MB), %d chunks of capacity %zu bytes (%.1f MB of messages), %d "
      "iterations\n",
      b.count, b.bf16 ? "BF16" : "FP32", bytes / 1e6, n_chunks, cap, msgs / 1e6, iterations);
  std::printf("%-6s %10s %10s %14s %14s\n", "step", "ms", "GB/s", "traffic GB/s", "vs copy");
  auto row = [&](const char* name, double t, double traffic) {
    std::printf("%-6s %10.3f %10.1f %14.1f %13.1f%%\n", name, t * 1e3, bytes / t / gb,
                traffic / t / gb, 100.0 * t_copy / t);
  };
  row("copy", t_copy, 2.0 * bytes);
  row("stats", t_stats, bytes + 4.0 * b.stats_words / 2);
  row("layout", t_layout, 2.0 * b.stats_words + static_cast<double>(b.params.sections.bytes));
  row("leaf", t_leaf, bytes + msgs);
  row("hop", t_hop, bytes + 2.0 * msgs);
  row("hop_s1", t_hop_s1, bytes + 2.0 * msgs);
  row("finish", t_finish, bytes + 2.0 * msgs);
  r.hop = t_copy / t_hop;
  r.hop_strata1 = t_copy / t_hop_s1;
  r.leaf = t_copy / t_leaf;
  r.finish = t_copy / t_finish;
  r.copy_gbps = bytes / t_copy / gb;
  r.hop_gbps = bytes / t_hop / gb;
  r.layout_ms = t_layout * 1e3;
  return r;
}

// One launch of each kernel the benchmark times, inside the profiler's range (the file comment):
// the statistics, the layout, chunk 0's leaf and hop (correlated rounding over 2 strata, as
// timed), and the finish of every chunk (one launch, as the engine's).
void profiled_round(const Bench& b) {
  using namespace dq;
  using namespace dq::cuda;
  DQ_BENCH_CHECK(cudaDeviceSynchronize());
  DQ_BENCH_CHECK(cudaProfilerStart());
  DQ_BENCH_CHECK(launch_supergroup_stats(b.own[0], b.bf16, b.count, 2, b.d_stats, nullptr));
  DQ_BENCH_CHECK(
      launch_dynamiq_layouts(b.layout_batch, b.d_layout_table, b.call, b.d_error, nullptr));
  const RoundingKey leaf_key{1, b.call, 0, 0, 1, 0, 0}, hop_key{1, b.call, 0, 0, 2, 1, 0};
  DQ_BENCH_CHECK(launch_dynamiq_hop(b.params, b.d_levels, b.d_layout, 0, b.own[0], b.bf16, nullptr,
                                    0, b.out, leaf_key, b.d_error, nullptr));
  const uint8_t* in = b.leaves;
  DQ_BENCH_CHECK(launch_dynamiq_hop(b.params, b.d_levels, b.d_layout, 0, b.own[0], b.bf16, &in, 1,
                                    b.out, hop_key, b.d_error, nullptr));
  DQ_BENCH_CHECK(launch_dynamiq_finishes(b.params, b.d_levels, b.d_layout, 0, b.n_chunks, b.leaves,
                                         b.cap, b.copy_dst, b.bf16, false, 1, b.d_finish_word,
                                         nullptr));
  DQ_BENCH_CHECK(cudaDeviceSynchronize());
  DQ_BENCH_CHECK(cudaProfilerStop());
}

// Both types' benchmarks, one after the other (each frees nothing: the process ends after).
Ratios run(const dq::Codec& codec, const dq::DynamiqOptions& options, size_t count, int n_chunks,
           bool bf16, int iterations) {
  Bench b;
  make_bench(codec, options, count, n_chunks, bf16, &b);
  Ratios r = measure(b, iterations);
  profiled_round(b);
  // Both words only gain bits (the finish's StepWord was zeroed, no kFoldFlag: nothing folds it),
  // so one read covers the timed rounds and the profiled one.
  dq::cuda::StepWord finish_word{};
  DQ_BENCH_CHECK(cudaMemcpy(&r.error, b.d_error, sizeof r.error, cudaMemcpyDeviceToHost));
  DQ_BENCH_CHECK(
      cudaMemcpy(&finish_word, b.d_finish_word, sizeof finish_word, cudaMemcpyDeviceToHost));
  r.error |= finish_word.flags;
  return r;
}

// --grids: the FP32 hop (one input, 2 strata, every chunk) on its own grid and on 1/2, 1/4 and
// 1/8 of it, against the copy of the tensor. The launch's grid gives a block 16 super-groups, or
// more blocks where that would leave an SM fewer than 4: from 8 ranks on, a 16 MiB pipeline
// block's chunk then gives each warp one super-group, and each warp pays the block's set-up (its
// level table) for it. Whether fewer, fuller blocks are faster is this table. Returns the
// kernels' error flags.
unsigned grid_sweep(const dq::DynamiqOptions& options, size_t count, int n_chunks, int iterations) {
  using namespace dq;
  const auto codec = planned_codec(options, count, n_chunks);
  Bench b;
  make_bench(*codec, options, count, n_chunks, false, &b);
  Timer timer;
  const size_t bytes = count * 4;
  const double t_copy = copy_seconds(b, timer, iterations);
  const unsigned standard = cuda::dynamiq_hop_grid(b.params);
  const double per_chunk = static_cast<double>((b.params.plan.n_sg + n_chunks - 1) / n_chunks);
  std::printf("grids: count %zu FP32 (%.1f MB), %d chunks of %.0f super-groups, copy %.3f ms\n",
              count, bytes / 1e6, n_chunks, per_chunk, t_copy * 1e3);
  std::printf("%8s %16s %10s %10s\n", "blocks", "sg a warp", "hop ms", "vs copy");
  std::string blocks_list, ratio_list;
  unsigned last = 0;
  for (unsigned divisor : {1u, 2u, 4u, 8u}) {
    const unsigned blocks = standard / divisor > 0 ? standard / divisor : 1;
    if (blocks == last) continue;
    last = blocks;
    const double t =
        timer.seconds_per_round([&] { enqueue_hops(b, 2, static_cast<int>(blocks)); }, iterations);
    const double ratio = t_copy / t;
    std::printf("%8u %16.2f %10.3f %9.1f%%\n", blocks, per_chunk / (8.0 * blocks), t * 1e3,
                100.0 * ratio);
    char item[32];
    std::snprintf(item, sizeof item, "%s%u", blocks_list.empty() ? "" : ",", blocks);
    blocks_list += item;
    std::snprintf(item, sizeof item, "%s%.3f", ratio_list.empty() ? "" : ",", ratio);
    ratio_list += item;
  }
  std::printf("RESULT grid_count=%zu grid_chunks=%d grid_blocks=%s grid_hop_vs_copy=%s\n", count,
              n_chunks, blocks_list.c_str(), ratio_list.c_str());
  std::fflush(stdout);
  unsigned error = 0;
  DQ_BENCH_CHECK(cudaMemcpy(&error, b.d_error, sizeof error, cudaMemcpyDeviceToHost));
  return error;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dq;
  if (argc > 1 && std::strcmp(argv[1], "--grids") == 0) {
    // An 8-rank ring's step on a 16 MiB pipeline block (2,048 super-groups a chunk), then the
    // default run's tensor (32,768 a chunk).
    dq::gpubench::require_device();
    const DynamiqOptions options{};
    unsigned error = grid_sweep(options, size_t{1} << 22, 8, 50);
    error |= grid_sweep(options, size_t{1} << 26, 8, 10);
    if (error != 0) {
      std::printf("FAIL: the kernels raised error flags 0x%x\n", error);
      return 1;
    }
    return 0;
  }
  const size_t count = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (size_t{1} << 26);
  const int n_chunks = argc > 2 ? std::atoi(argv[2]) : 8;
  const int iterations = argc > 3 ? std::atoi(argv[3]) : 20;
  if (count == 0 || n_chunks < 1 || iterations < 1) {
    std::fprintf(stderr, "usage: %s [count > 0] [chunks >= 1] [iterations >= 1]\n", argv[0]);
    return 2;
  }
  dq::gpubench::require_device();
  const DynamiqOptions options{};
  const auto codec = planned_codec(options, count, n_chunks);
  // A RESULT line a type, printed as soon as it is measured: a failure in the second keeps the
  // first's figures.
  const Ratios f32 = run(*codec, options, count, n_chunks, false, iterations);
  std::printf(
      "RESULT hop_vs_copy=%.3f leaf_vs_copy=%.3f (target: hop >= 0.60) hop_strata1_vs_copy=%.3f "
      "finish_vs_copy=%.3f copy_GBps=%.1f hop_GBps=%.1f layout_ms=%.3f\n",
      f32.hop, f32.leaf, f32.hop_strata1, f32.finish, f32.copy_gbps, f32.hop_gbps, f32.layout_ms);
  std::fflush(stdout);
  const Ratios bf16 = run(*codec, options, count, n_chunks, true, iterations);
  std::printf(
      "RESULT bf16_hop_vs_copy=%.3f bf16_leaf_vs_copy=%.3f bf16_hop_strata1_vs_copy=%.3f "
      "bf16_finish_vs_copy=%.3f bf16_copy_GBps=%.1f bf16_hop_GBps=%.1f bf16_layout_ms=%.3f\n",
      bf16.hop, bf16.leaf, bf16.hop_strata1, bf16.finish, bf16.copy_gbps, bf16.hop_gbps,
      bf16.layout_ms);
  if ((f32.error | bf16.error) != 0) {
    std::printf("FAIL: the kernels raised error flags 0x%x (FP32), 0x%x (BF16)\n", f32.error,
                bf16.error);
    return 1;
  }
  return 0;
}
