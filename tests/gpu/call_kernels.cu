// The codec kernels of one compressed all-reduce as one rank of a 2-rank ring runs them, timed on
// the device, against the time NCCL's BF16 all-reduce of the same tensor takes on a 100 Gbit/s
// link (computed from its bytes: a ring all-reduce sends 2 (n - 1) / n of the tensor per rank).
// The GPU path's target: the kernels take at most 10% of that link time (a 256 MiB FP32 tensor:
// 10.7 ms of link, so 1.07 ms of kernels). Not a test: it prints the numbers and fails only on a
// CUDA error, a kernel's error flag, a budget that did not predict, or a result far from the exact
// sum (a broken sequence would time nothing real); never on the ratio.
//
//   call_kernels [count (default 2^26)] [block bytes (default 16 MiB)] [iterations (default 10)]
//
// The call is cut as the engine cuts it (shim/engine/engine_plan.cc, cut_blocks): pipeline blocks
// of `block bytes` of FP32 (DYNAMIQ_BLOCK_BYTES's default), the last one taking the remainder, each
// a DynamiQ codec at the default budget planned for 2 chunks and 2 workers. Both ranks' inputs and
// messages are made first; then rank 0's kernels are timed with CUDA events, each kind alone over
// every block and all of them in the engine's order as one "call":
//   stats   the statistics of every block (the all-reduce of them is communication: not timed;
//           its result, the two ranks' statistics summed, is made beforehand);
//   budget  the budget prediction over every block (DYNAMIQ_BITS=auto: every candidate; its job and
//           hop tables in mapped host memory, as the engine keeps them);
//   layout  every block's layout from the reduced statistics (one batch: launch_dynamiq_layouts,
//           one launch for the small layouts and seven for the grid ones, its table copied to
//           the device once, as the engine plans it);
//   leaf    the chunk rank 0 sends (n_in = 0), every block;
//   hop     rank 0's sink chunk: rank 1's leaf added and compressed again (n_in = 1), every block;
//   finish  both chunks' final messages decoded into the result tensor, one launch a block (the
//           engine's finish step: launch_dynamiq_finishes over the block's chunks).
// The call is timed first and its RESULT line (kernels_vs_link) printed at once, then each kind
// alone as it is measured; the table and the full RESULT line come last. Exit 77 without a device.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/budget_math.h"
#include "kernels/budget_model.h"
#include "kernels/codec.h"
#include "kernels/cuda/budget.h"
#include "kernels/cuda/dynamiq.h"
#include "kernels/cuda/stats.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/stats_sum.h"
#include "tests/gpu/gpu_bench.h"
#include "topo/schedule.h"

namespace {

using namespace dq;
using namespace dq::cuda;

constexpr int kWorkers = 2;  // and so 2 chunks per block (a ring of 2)
constexpr double kLinkBitsPerSecond = 100e9;

// `n` T of pinned host memory the device reads (mapped); its one address for host and device.
template <class T>
T* mapped(size_t n) {
  void* host = nullptr;
  DQ_BENCH_CHECK(cudaHostAlloc(&host, n * sizeof(T), cudaHostAllocMapped));
  void* dev = nullptr;
  DQ_BENCH_CHECK(cudaHostGetDevicePointer(&dev, host, 0));
  if (dev != host) {  // every 64-bit CUDA platform has unified addressing: one address for both
    std::fprintf(stderr, "FAIL: mapped memory has a device address different from its host one\n");
    std::exit(1);
  }
  return static_cast<T*>(host);
}

struct Block {
  size_t begin = 0, count = 0, stats_off = 0, cap = 0;
  std::unique_ptr<Codec> codec;
  DynamiqDeviceParams params{};
  void* layout = nullptr;
  uint8_t* leaf[kWorkers] = {};   // by chunk: the leaf message of that chunk (its non-sink rank's)
  uint8_t* final[kWorkers] = {};  // by chunk: its sink's final message, cap bytes apart
  uint8_t* scratch = nullptr;     // rank 0's timed outputs (two messages)
};

struct Call {
  size_t count = 0, stats_words = 0;
  uint64_t call = 3;
  std::vector<Block> blocks;
  float* own[kWorkers] = {};
  float* result = nullptr;
  uint16_t *d_stats = nullptr, *d_reduced = nullptr;
  LevelTable* d_levels = nullptr;
  unsigned* d_error = nullptr;  // the flags of a StepWord (setup)
  LayoutBatch layouts;          // every block's layout (setup)
  void* d_layout_table = nullptr;
  void* budget_scratch = nullptr;
  BudgetJob* job = nullptr;  // mapped, with its parts and hop tables
  BudgetResult* budget_out = nullptr;
  topo::Schedule schedule;
  HopTables hop;
};

RoundingKey key_of(const Call& c, const Block& b, int rank) {
  RoundingKey k;
  k.seed = 1;
  k.call = c.call;
  k.rank = static_cast<uint32_t>(rank);
  k.element_base = b.begin;  // plain rounding on a ring: strata = 1
  return k;
}

// The engine's cut into blocks, each planned; false when a block cannot be planned.
bool cut_blocks(size_t count, size_t block_bytes, Call* c) {
  const DynamiqOptions options{};
  size_t block_elems = block_bytes / sizeof(float) / 256 * 256;
  if (block_elems < 256) block_elems = 256;
  const size_t n_blocks = count / block_elems > 0 ? count / block_elems : 1;
  c->count = count;
  c->blocks.resize(n_blocks);
  for (size_t i = 0; i < n_blocks; ++i) {
    Block& b = c->blocks[i];
    b.begin = i * block_elems;
    b.count = i + 1 == n_blocks ? count - b.begin : block_elems;
    b.codec = make_dynamiq_codec(options);
    if (b.codec->plan(b.count, kWorkers, kWorkers) != Status::kOk) return false;
    b.cap = b.codec->chunk_capacity();
    b.params = dynamiq_device_params(b.count, kWorkers, kWorkers, b.cap, options);
    b.stats_off = c->stats_words;
    c->stats_words += b.codec->stats_words();
  }
  return true;
}

// The budget job of the call in mapped memory, as the engine stages it (engine_budget.cc).
bool stage_budget_job(Call* c) {
  if (topo::make_schedule(topo::Kind::kRing, kWorkers, &c->schedule) != Status::kOk) return false;
  c->hop = hop_profile(c->schedule);
  const size_t n_table = c->hop.linear.size();
  double* linear = mapped<double>(n_table);
  double* square = mapped<double>(n_table);
  for (size_t i = 0; i < n_table; ++i) {
    linear[i] = c->hop.linear[i];
    square[i] = c->hop.square[i];
  }
  BudgetPartJob* parts = mapped<BudgetPartJob>(c->blocks.size());
  for (size_t i = 0; i < c->blocks.size(); ++i) {
    const Block& b = c->blocks[i];
    BudgetPartJob part;
    part.count = b.count;
    part.stats_offset = b.stats_off;
    for (int r = 0; r < kLadderRungs; ++r) {
      std::string err;
      char spec[32];
      std::snprintf(spec, sizeof spec, "dynamiq:%g", ladder_bits(r));
      std::unique_ptr<Codec> rung = make_codec(spec, &err);
      DynamiqOptions o;
      if (!rung || rung->plan(b.count, kWorkers, kWorkers) != Status::kOk ||
          !dynamiq_parameters(*rung, &o, &part.rungs[r])) {
        std::fprintf(stderr, "FAIL: cannot plan %s: %s\n", spec, err.c_str());
        return false;
      }
    }
    for (int k = 0; k < kCandidates; ++k) part.fits[k] = 1;
    DynamiqOptions o;
    if (!dynamiq_parameters(*b.codec, &o, &part.used)) return false;
    parts[i] = part;
  }
  c->job = mapped<BudgetJob>(1);
  *c->job = BudgetJob{};
  c->job->n_parts = static_cast<uint32_t>(c->blocks.size());
  c->job->n_workers = kWorkers;
  c->job->auto_budget = 1;
  c->job->hop = HopProfile{linear, square};
  c->job->used_mx = 0;  // a DynamiQ call
  c->job->parts = parts;
  c->budget_out = mapped<BudgetResult>(1);
  *c->budget_out = BudgetResult{};
  DQ_BENCH_CHECK(cudaMalloc(&c->budget_scratch, budget_scratch_bytes(*c->job)));
  return true;
}

// Both ranks' inputs, the reduced statistics, every layout, both ranks' leaves and final messages.
void prepare(Call* c) {
  const size_t bytes = c->count * sizeof(float);
  LevelTable levels[3];
  dynamiq_level_tables(DynamiqOptions{}, levels);
  DQ_BENCH_CHECK(cudaMalloc(&c->d_levels, sizeof levels));
  DQ_BENCH_CHECK(cudaMemcpy(c->d_levels, levels, sizeof levels, cudaMemcpyHostToDevice));
  DQ_BENCH_CHECK(cudaMalloc(&c->result, bytes));
  // A zeroed StepWord (no kFoldFlag: nothing folds); its flags are every kernel's error word,
  // its tickets the finish's.
  DQ_BENCH_CHECK(cudaMalloc(&c->d_error, sizeof(StepWord)));
  DQ_BENCH_CHECK(cudaMemset(c->d_error, 0, sizeof(StepWord)));
  const size_t words = c->stats_words;
  DQ_BENCH_CHECK(cudaMalloc(&c->d_stats, kWorkers * words * sizeof(uint16_t)));
  DQ_BENCH_CHECK(cudaMalloc(&c->d_reduced, words * sizeof(uint16_t)));
  for (int r = 0; r < kWorkers; ++r) {
    DQ_BENCH_CHECK(cudaMalloc(&c->own[r], bytes));
    const std::vector<float> x = gpubench::make_values(c->count, 11 + r);
    DQ_BENCH_CHECK(cudaMemcpy(c->own[r], x.data(), bytes, cudaMemcpyHostToDevice));
    for (const Block& b : c->blocks)
      DQ_BENCH_CHECK(launch_supergroup_stats(c->own[r] + b.begin, false, b.count, kWorkers,
                                             c->d_stats + r * words + b.stats_off, nullptr));
  }
  // The statistics' all-reduce, on the host: both ranks' words summed, block by block (StatsSum).
  std::vector<uint16_t> stats(kWorkers * words), reduced(words);
  DQ_BENCH_CHECK(cudaMemcpy(stats.data(), c->d_stats, stats.size() * sizeof(uint16_t),
                            cudaMemcpyDeviceToHost));
  for (const Block& b : c->blocks) {
    StatsSum sum(b.codec->stats_words(), b.codec->stats_byte_sum_words());
    for (int r = 0; r < kWorkers; ++r) sum.add(stats.data() + r * words + b.stats_off);
    sum.result(reduced.data() + b.stats_off, true);
  }
  DQ_BENCH_CHECK(
      cudaMemcpy(c->d_reduced, reduced.data(), words * sizeof(uint16_t), cudaMemcpyHostToDevice));
  std::vector<LayoutJob> jobs;
  for (Block& b : c->blocks) {
    DQ_BENCH_CHECK(cudaMalloc(&b.layout, b.params.sections.bytes));
    jobs.push_back(LayoutJob{b.params, c->d_reduced + b.stats_off, b.layout});
  }
  if (!plan_layout_batch(jobs.data(), static_cast<int>(jobs.size()), &c->layouts)) {
    std::fprintf(stderr, "FAIL: the layouts' batch could not be planned\n");
    std::exit(1);
  }
  DQ_BENCH_CHECK(cudaMalloc(&c->d_layout_table, c->layouts.table.size()));
  DQ_BENCH_CHECK(cudaMemcpy(c->d_layout_table, c->layouts.table.data(), c->layouts.table.size(),
                            cudaMemcpyHostToDevice));
  DQ_BENCH_CHECK(
      launch_dynamiq_layouts(c->layouts, c->d_layout_table, c->call, c->d_error, nullptr));
  for (Block& b : c->blocks) {
    DQ_BENCH_CHECK(cudaMalloc(&b.scratch, 2 * b.cap));
    DQ_BENCH_CHECK(cudaMalloc(&b.final[0], kWorkers * b.cap));
    for (int k = 0; k < kWorkers; ++k) {
      DQ_BENCH_CHECK(cudaMalloc(&b.leaf[k], b.cap));
      b.final[k] = b.final[0] + k * b.cap;
    }
    // Rank r leaves chunk 1 - r and is the sink of chunk r.
    for (int r = 0; r < kWorkers; ++r)
      DQ_BENCH_CHECK(launch_dynamiq_hop(b.params, c->d_levels, b.layout, 1 - r, c->own[r] + b.begin,
                                        false, nullptr, 0, b.leaf[1 - r], key_of(*c, b, r),
                                        c->d_error, nullptr));
    for (int r = 0; r < kWorkers; ++r) {
      const uint8_t* in = b.leaf[r];
      DQ_BENCH_CHECK(launch_dynamiq_hop(b.params, c->d_levels, b.layout, r, c->own[r] + b.begin,
                                        false, &in, 1, b.final[r], key_of(*c, b, r), c->d_error,
                                        nullptr));
    }
  }
  DQ_BENCH_CHECK(cudaDeviceSynchronize());
}

// Rank 0's kernels of one kind over every block (the file comment), or all of them in order.
enum class Kind { kStats, kBudget, kLayout, kLeaf, kHop, kFinish, kCall };

void enqueue(const Call& c, Kind kind) {
  const bool all = kind == Kind::kCall;
  if (all || kind == Kind::kStats)
    for (const Block& b : c.blocks)
      DQ_BENCH_CHECK(launch_supergroup_stats(c.own[0] + b.begin, false, b.count, kWorkers,
                                             c.d_stats + b.stats_off, nullptr, 0, c.d_error));
  if (all || kind == Kind::kBudget)
    DQ_BENCH_CHECK(launch_budget(c.job, c.d_reduced, c.budget_scratch, budget_scratch_bytes(*c.job),
                                 c.budget_out, c.d_error, nullptr));
  if (all || kind == Kind::kLayout)
    DQ_BENCH_CHECK(launch_dynamiq_layouts(c.layouts, c.d_layout_table, c.call, c.d_error, nullptr));
  if (all || kind == Kind::kLeaf)
    for (const Block& b : c.blocks)
      DQ_BENCH_CHECK(launch_dynamiq_hop(b.params, c.d_levels, b.layout, 1, c.own[0] + b.begin,
                                        false, nullptr, 0, b.scratch, key_of(c, b, 0), c.d_error,
                                        nullptr));
  if (all || kind == Kind::kHop)
    for (const Block& b : c.blocks) {
      const uint8_t* in = b.leaf[0];  // rank 1's leaf of chunk 0
      DQ_BENCH_CHECK(launch_dynamiq_hop(b.params, c.d_levels, b.layout, 0, c.own[0] + b.begin,
                                        false, &in, 1, b.scratch + b.cap, key_of(c, b, 0),
                                        c.d_error, nullptr));
    }
  if (all || kind == Kind::kFinish)
    for (const Block& b : c.blocks)
      DQ_BENCH_CHECK(launch_dynamiq_finishes(
          b.params, c.d_levels, b.layout, 0, kWorkers, b.final[0], b.cap, c.result + b.begin, false,
          false, kWorkers, reinterpret_cast<StepWord*>(c.d_error), nullptr));
}

// vNMSE of the decoded result against the exact FP32 sum of both inputs.
double result_vnmse(const Call& c) {
  std::vector<float> a(c.count), b(c.count), r(c.count);
  DQ_BENCH_CHECK(cudaMemcpy(a.data(), c.own[0], c.count * 4, cudaMemcpyDeviceToHost));
  DQ_BENCH_CHECK(cudaMemcpy(b.data(), c.own[1], c.count * 4, cudaMemcpyDeviceToHost));
  DQ_BENCH_CHECK(cudaMemcpy(r.data(), c.result, c.count * 4, cudaMemcpyDeviceToHost));
  double err = 0, norm = 0;
  for (size_t i = 0; i < c.count; ++i) {
    const double exact = static_cast<double>(a[i]) + b[i];
    err += (r[i] - exact) * (r[i] - exact);
    norm += exact * exact;
  }
  return norm > 0 ? err / norm : (err > 0 ? INFINITY : 0.0);
}

int measure(const Call& c, int iterations) {
  gpubench::Timer timer;
  const char* names[] = {"stats", "budget", "layout", "leaf", "hop", "finish", "call"};
  double t[7] = {};
  const double link_bytes = 2.0 * (kWorkers - 1) / kWorkers * static_cast<double>(c.count) * 2;
  const double t_link = link_bytes * 8 / kLinkBitsPerSecond;
  // The whole call first, its RESULT line printed and flushed at once, then each kind alone,
  // each printed as it is measured: a kind that fails (which exits) or the step's timeout keeps
  // the target's figure and the kinds measured before it.
  const int order[7] = {6, 0, 1, 2, 3, 4, 5};
  for (int k : order) {
    t[k] = timer.seconds_per_round([&] { enqueue(c, static_cast<Kind>(k)); }, iterations);
    if (k == 6)
      std::printf("RESULT kernels_vs_link=%.4f call_kernels_ms=%.3f link_ms_100gbit=%.3f\n",
                  t[6] / t_link, t[6] * 1e3, t_link * 1e3);
    else
      std::printf("measured %s: %.3f ms\n", names[k], t[k] * 1e3);
    std::fflush(stdout);
  }
  unsigned error = 0;
  DQ_BENCH_CHECK(cudaMemcpy(&error, c.d_error, sizeof error, cudaMemcpyDeviceToHost));
  const double vnmse = result_vnmse(c);
  std::printf("count %zu FP32 (%.1f MiB), %zu block(s), 2 ranks (ring), %d iterations\n", c.count,
              c.count * 4 / 1048576.0, c.blocks.size(), iterations);
  std::printf("%-7s %10s %12s\n", "kernels", "ms", "launches");
  const size_t nb = c.blocks.size();
  const size_t launches[7] = {nb, 1, nb, nb, nb, 2 * nb, 6 * nb + 1};
  double sum = 0;
  for (int k = 0; k < 7; ++k) {
    std::printf("%-7s %10.3f %12zu\n", names[k], t[k] * 1e3, launches[k]);
    if (k < 6) sum += t[k];
  }
  std::printf("sum of the kinds alone %.3f ms; the call's sequence %.3f ms\n", sum * 1e3,
              t[6] * 1e3);
  std::printf("NCCL BF16 all-reduce of it at 100 Gbit/s: %.0f bytes per rank, %.3f ms\n",
              link_bytes, t_link * 1e3);
  std::printf("result vNMSE against the exact sum: %.3e; budget state %u\n", vnmse,
              static_cast<unsigned>(c.budget_out->state));
  std::printf(
      "RESULT kernels_vs_link=%.4f (target <= 0.10) call_kernels_ms=%.3f link_ms_100gbit=%.3f "
      "stats_ms=%.3f budget_ms=%.3f layout_ms=%.3f leaf_ms=%.3f hop_ms=%.3f finish_ms=%.3f\n",
      t[6] / t_link, t[6] * 1e3, t_link * 1e3, t[0] * 1e3, t[1] * 1e3, t[2] * 1e3, t[3] * 1e3,
      t[4] * 1e3, t[5] * 1e3);
  int rc = 0;
  if (error != 0) {
    std::printf("FAIL: the kernels raised error flags 0x%x\n", error);
    rc = 1;
  }
  if (c.budget_out->state != kBudgetPredicted) {
    std::printf("FAIL: the budget kernel did not predict (state %u)\n",
                static_cast<unsigned>(c.budget_out->state));
    rc = 1;
  }
  // DynamiQ at 5 bits on these values: about 1e-4 (docs/results/accuracy.md); a lost block,
  // a wrong chunk or an undecoded message is far above.
  if (!(vnmse <= 1e-2)) {
    std::printf("FAIL: the result is far from the exact sum (vNMSE %.3e)\n", vnmse);
    rc = 1;
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t count = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (size_t{1} << 26);
  const size_t block_bytes = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : (size_t{16} << 20);
  const int iterations = argc > 3 ? std::atoi(argv[3]) : 10;
  if (count < 256 * kWorkers || block_bytes == 0 || iterations < 1) {
    std::fprintf(stderr, "usage: %s [count >= 512] [block bytes > 0] [iterations >= 1]\n", argv[0]);
    return 2;
  }
  gpubench::require_device();
  Call c;
  if (!cut_blocks(count, block_bytes, &c)) {
    std::fprintf(stderr, "FAIL: the host codec cannot plan count %zu in blocks of %zu bytes\n",
                 count, block_bytes);
    return 1;
  }
  if (!stage_budget_job(&c)) {
    std::fprintf(stderr, "FAIL: cannot stage the budget job\n");
    return 1;
  }
  prepare(&c);
  return measure(c, iterations);
}
