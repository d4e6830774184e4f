// The layout and budget kernels where they spread over several blocks, under the CUDA emulation
// and, compiled by nvcc (tests/gpu/meson.build), on a real device, against the host byte for byte:
// layouts on the grid path (sizes just above its threshold, counts that are not multiples of the
// block's 256 super-groups, one to 64 chunks, every width option, poisoned and all-zero
// super-groups, a budget nothing fits), budgets of parts that span many blocks (odd counts, one
// super-group, an exact multiple of the block). Every buffer the kernels touch is device memory, or
// mapped memory where the host reads it too (tests/kernels/cuda/device_buffers.h); launches are
// counted by the emulator only.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/budget_model.h"
#include "kernels/codec.h"
#include "kernels/cuda/budget.h"
#include "kernels/cuda/dynamiq.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_layout.h"
#include "tests/kernels/cuda/device_buffers.h"
#include "tests/kernels/cuda/layout_stats.h"
#include "topo/schedule.h"

namespace dq::cuda {
namespace {

using test::DeviceArray;
using test::first_difference;
using test::kernel_fault;
using test::make_stats;
using test::MappedArray;

// One launch of the layout of `params` on device copies of the statistics, the layout `dev`
// and the word `*error` (a plain word, or a StepWord's flags; the StepWord's fold then writes
// a device copy of `*lane_error`), all fetched back. Launches the emulator counted in *launches.
cudaError_t device_layout(const DynamiqDeviceParams& params, const std::vector<uint16_t>& stats,
                          uint64_t call, std::vector<uint64_t>* dev, unsigned* error,
                          uint64_t* launches) {
  const DeviceArray<uint16_t> d_stats(stats);
  const DeviceArray<uint64_t> d_dev(*dev);
  const DeviceArray<unsigned> d_error(error, 1);
  const uint64_t before = test::launches_so_far();
  cudaError_t e =
      launch_dynamiq_layout(params, d_stats.get(), call, d_dev.get(), d_error.get(), nullptr);
  *launches = test::launches_so_far() - before;
  if (e == cudaSuccess) e = d_dev.fetch(*dev);
  return e == cudaSuccess ? d_error.fetch(error) : e;
}
cudaError_t device_layout(const DynamiqDeviceParams& params, const std::vector<uint16_t>& stats,
                          uint64_t call, std::vector<uint64_t>* dev, StepWord* word,
                          uint32_t* lane_error, uint64_t* launches) {
  const DeviceArray<uint16_t> d_stats(stats);
  const DeviceArray<uint64_t> d_dev(*dev);
  const DeviceArray<uint32_t> d_lane(lane_error, 1);
  word->error = d_lane.get();  // the fold's, on the device
  const DeviceArray<StepWord> d_word(word, 1);
  const uint64_t before = test::launches_so_far();
  cudaError_t e =
      launch_dynamiq_layout(params, d_stats.get(), call, d_dev.get(),
                            d_word.get() == nullptr ? nullptr : &d_word.get()->flags, nullptr);
  *launches = test::launches_so_far() - before;
  if (e == cudaSuccess) e = d_dev.fetch(*dev);
  if (e == cudaSuccess) e = d_word.fetch(word);
  if (e == cudaSuccess) e = d_lane.fetch(lane_error);
  word->error = lane_error;
  return e;
}

struct LayoutRun {
  std::vector<uint64_t> host, dev;
  uint64_t launches = 0;
  unsigned error = 0;
};

LayoutRun run_layout(size_t count, int chunks, int workers, const DynamiqOptions& o,
                     const std::vector<uint16_t>& stats, size_t capacity_cut = 0) {
  LayoutRun r;
  std::unique_ptr<Codec> codec = make_dynamiq_codec(o);
  EXPECT_EQ(codec->plan(count, chunks, workers), Status::kOk);
  DynamiqDeviceParams params =
      dynamiq_device_params(count, chunks, workers, codec->chunk_capacity(), o);
  params.plan.capacity -= capacity_cut;
  const size_t words = params.sections.bytes / 8;
  r.host.assign(words, 0x5a5a5a5a5a5a5a5aull);
  r.dev.assign(words, 0xa5a5a5a5a5a5a5a5ull);  // garbage: every byte must be written
  const uint64_t call = 0x123456789ull + count;
  const Status hs = build_dynamiq_layout(params.plan, stats.data(), call, r.host.data());
  EXPECT_EQ(hs, capacity_cut == 0 ? Status::kOk : Status::kInternal);
  EXPECT_EQ(device_layout(params, stats, call, &r.dev, &r.error, &r.launches), cudaSuccess)
      << kernel_fault();
  return r;
}

// Launches of a layout on the grid path (seven kernels) and in one block.
constexpr uint64_t kGridLaunches = 7, kBlockLaunches = 1;

TEST(CudaGridKernels, LayoutOnTheGridMatchesHostByteForByte) {
  DynamiqOptions fixed, no16, no_mean, flat, tight;
  fixed.variable_widths = false;
  no16.allow_width16 = false;
  no_mean.mean_subtraction = false;
  flat.hierarchical_scales = false;
  tight.budget_bits = 2.5;
  const DynamiqOptions options[] = {DynamiqOptions{}, fixed, no16, no_mean, flat, tight};
  // Super-groups: the smallest count on the grid path, odd counts, a multiple of 256, and a count
  // whose last super-group is partial.
  const size_t counts[] = {6400 * 256, 6401 * 256 - 17, 7168 * 256, 9999 * 256 + 1};
  uint32_t seed = 1;
  int runs = 0;
  for (size_t oi = 0; oi < std::size(options); ++oi)
    for (size_t count : counts)
      for (int chunks : {1, 2, 3, 8, 64}) {
        if (oi > 0 && chunks != 3 && chunks != 8) continue;  // every option on two chunk counts
        const int workers = chunks == 1 ? 1 : chunks == 8 ? 40 : 4;  // 40: the counts are bytes
        const size_t n_sg = (count + 255) / 256;
        const double decades = seed % 3 == 0 ? 0.0 : 4.0;  // one scale, or many widths
        const std::vector<uint16_t> stats = make_stats(n_sg, workers, decades, seed % 2 == 0, seed);
        ++seed;
        const LayoutRun r = run_layout(count, chunks, workers, options[oi], stats);
        const std::string what = "option " + std::to_string(oi) + " count " +
                                 std::to_string(count) + " chunks " + std::to_string(chunks);
        DQ_EXPECT_LAUNCHES(r.launches, kGridLaunches) << what;
        EXPECT_EQ(r.error, 0u) << what;
        EXPECT_EQ(first_difference(r.host, r.dev), -1) << what;
        ++runs;
      }
  EXPECT_GT(runs, 40);
}

TEST(CudaGridKernels, SmallLayoutStaysInOneBlock) {
  const size_t count = 4095 * 256;
  const std::vector<uint16_t> stats = make_stats(4095, 4, 4.0, true, 7);
  const LayoutRun r = run_layout(count, 4, 4, DynamiqOptions{}, stats);
  DQ_EXPECT_LAUNCHES(r.launches, kBlockLaunches);
  EXPECT_EQ(first_difference(r.host, r.dev), -1);
}

TEST(CudaGridKernels, LayoutOnTheGridFlagsAChunkOverCapacity) {
  const size_t count = 8000 * 256;
  const std::vector<uint16_t> stats = make_stats(8000, 4, 4.0, false, 11);
  const LayoutRun fits = run_layout(count, 4, 4, DynamiqOptions{}, stats);
  EXPECT_EQ(fits.error, 0u);
  // 600 bytes short (the cuts stay): chunk 0, at least one stride long, no longer fits.
  const LayoutRun over = run_layout(count, 4, 4, DynamiqOptions{}, stats, 600);
  DQ_EXPECT_LAUNCHES(over.launches, kGridLaunches);
  EXPECT_EQ(over.error, unsigned{kDynamiqChunkOverCapacity});
}

// A record budget below every super-group's 2-bit record: no threshold fits, so the
// radix select finds no first digit (its kernel's last block writes that to the pick words, the
// digit kernels stop, the widths kernel keeps the host's end of the bisection, 0x7f800000): the
// last chunk over capacity, the bytes the host's. No other layout here takes that path; a widths
// kernel that ignored the pick words' not-found flag (theta 0) failed only this test.
TEST(CudaGridKernels, LayoutOnTheGridWhereNoThresholdFits) {
  const size_t count = 8000 * 256;
  const std::vector<uint16_t> stats = make_stats(8000, 4, 4.0, false, 14);
  std::unique_ptr<Codec> codec = make_dynamiq_codec(DynamiqOptions{});
  ASSERT_EQ(codec->plan(count, 4, 4), Status::kOk);
  DynamiqDeviceParams params =
      dynamiq_device_params(count, 4, 4, codec->chunk_capacity(), DynamiqOptions{});
  DynamiqPlan& p = params.plan;
  const size_t cut_slack = p.capacity - kChunkHeaderBytes - p.stride;  // kept as planned
  p.stride = p.n_sg * p.record[0] / (2 * static_cast<uint64_t>(p.n_chunks));
  p.capacity = kChunkHeaderBytes + p.stride + cut_slack;
  ASSERT_LT(dynamiq_record_budget(p), p.n_sg * p.record[0]);
  std::vector<uint64_t> host(params.sections.bytes / 8, 0), dev(host.size(), 0xa5a5a5a5ull);
  ASSERT_EQ(build_dynamiq_layout(p, stats.data(), 5, host.data()), Status::kInternal);
  unsigned error = 0;
  uint64_t launches = 0;
  ASSERT_EQ(device_layout(params, stats, 5, &dev, &error, &launches), cudaSuccess)
      << kernel_fault();
  DQ_EXPECT_LAUNCHES(launches, kGridLaunches);
  EXPECT_EQ(error, unsigned{kDynamiqChunkOverCapacity});
  // The host stops at the chunk over capacity (the last: the others hold one stride each), so
  // that chunk's check is not its digest there; every other byte is the host's.
  const size_t last_check = params.sections.chunk_check + 4 * (p.n_chunks - 1);
  for (std::vector<uint64_t>* v : {&host, &dev})
    std::memset(reinterpret_cast<unsigned char*>(v->data()) + last_check, 0, 4);
  EXPECT_EQ(first_difference(host, dev), -1);
}

TEST(CudaGridKernels, LayoutOnTheGridWritesNothingAfterAFailure) {
  const size_t count = 8000 * 256;
  const std::vector<uint16_t> stats = make_stats(8000, 4, 4.0, false, 12);
  std::unique_ptr<Codec> codec = make_dynamiq_codec(DynamiqOptions{});
  ASSERT_EQ(codec->plan(count, 4, 4), Status::kOk);
  const DynamiqDeviceParams params =
      dynamiq_device_params(count, 4, 4, codec->chunk_capacity(), DynamiqOptions{});
  std::vector<uint64_t> dev(params.sections.bytes / 8, 0xa5a5a5a5a5a5a5a5ull);
  const std::vector<uint64_t> untouched = dev;
  unsigned error = kSkipFlag | 2u;
  uint64_t launches = 0;
  EXPECT_EQ(device_layout(params, stats, 1, &dev, &error, &launches), cudaSuccess)
      << kernel_fault();
  EXPECT_EQ(error, kSkipFlag | 2u);
  EXPECT_EQ(first_difference(dev, untouched), -1);
}

// As the devices run it: the launches' word is a step word (kFoldFlag armed), which must not read
// as a failure, and the sequence's last kernel folds it into the lane's error word.
TEST(CudaGridKernels, LayoutOnTheGridFoldsAStepWord) {
  const size_t count = 8000 * 256;
  const std::vector<uint16_t> stats = make_stats(8000, 4, 4.0, false, 13);
  for (size_t cut : {size_t{0}, size_t{600}}) {
    std::unique_ptr<Codec> codec = make_dynamiq_codec(DynamiqOptions{});
    ASSERT_EQ(codec->plan(count, 4, 4), Status::kOk);
    DynamiqDeviceParams params =
        dynamiq_device_params(count, 4, 4, codec->chunk_capacity(), DynamiqOptions{});
    params.plan.capacity -= cut;
    std::vector<uint64_t> host(params.sections.bytes / 8, 0), dev(host.size(), 0xa5a5a5a5ull);
    ASSERT_EQ(build_dynamiq_layout(params.plan, stats.data(), 7, host.data()),
              cut == 0 ? Status::kOk : Status::kInternal);
    uint32_t lane_error = 0;
    StepWord word = step_word(&lane_error, kDynamiqChunkOverCapacity, 11u, 22u);
    uint64_t launches = 0;
    ASSERT_EQ(device_layout(params, stats, 7, &dev, &word, &lane_error, &launches), cudaSuccess)
        << kernel_fault();
    DQ_EXPECT_LAUNCHES(launches, kGridLaunches);
    EXPECT_EQ(word.blocks_done, 0u);  // folded once, by the last block
    if (cut == 0) {
      EXPECT_EQ(lane_error, 0u);
      EXPECT_EQ(word.raised, 0u);
      EXPECT_EQ(word.flags, kFoldFlag);  // armed for the next launch
      EXPECT_EQ(first_difference(host, dev), -1);
    } else {
      EXPECT_EQ(lane_error, 11u);  // the malformed-data word, as the mask says
      EXPECT_EQ(word.raised, unsigned{kDynamiqChunkOverCapacity});
      EXPECT_EQ(word.flags, kFoldFlag | kSkipFlag);  // the lane failed: later steps skip
    }
  }
}

uint64_t bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}

DynamiqPlan plan_of(double budget_bits, size_t count, int chunks, int workers) {
  DynamiqOptions o;
  o.budget_bits = budget_bits;
  std::unique_ptr<Codec> c = make_dynamiq_codec(o);
  EXPECT_EQ(c->plan(count, chunks, workers), Status::kOk);
  DynamiqOptions got;
  DynamiqPlan p;
  EXPECT_TRUE(dynamiq_parameters(*c, &got, &p));
  return p;
}

TEST(CudaGridKernels, BudgetOverManyBlocksMatchesHostBitForBit) {
  // Parts of one super-group, of odd counts spanning several 256-super-group blocks, of an exact
  // multiple of the block, and one past the 1024-block grid (a grid-stride loop).
  const std::vector<std::vector<size_t>> shapes = {
      {200}, {1001 * 256 + 7}, {1024 * 256}, {300000, 1, 65536 * 5 + 3}, {1100 * 256 * 256 + 5}};
  uint32_t seed = 40;
  for (const auto& shape : shapes)
    for (int workers : {3, 8, 40}) {
      std::vector<BudgetPartJob> parts;
      std::vector<uint16_t> stats;
      for (size_t count : shape) {
        BudgetPartJob part;
        part.count = count;
        part.stats_offset = stats.size();
        for (int r = 0; r < kLadderRungs; ++r)
          part.rungs[r] = plan_of(ladder_bits(r), count, workers, workers);
        for (int c = 0; c < kCandidates; ++c) part.fits[c] = 1;
        part.used = part.rungs[seed % kLadderRungs];
        const std::vector<uint16_t> s =
            make_stats((count + 255) / 256, workers, 3.0, false, seed++);
        stats.insert(stats.end(), s.begin(), s.end());
        parts.push_back(part);
      }
      topo::Schedule sched;
      ASSERT_EQ(topo::make_schedule(topo::Kind::kRing, workers, &sched), Status::kOk);
      const HopTables hop = hop_profile(sched);
      BudgetJob job;
      job.n_parts = static_cast<uint32_t>(parts.size());
      job.n_workers = workers;
      job.auto_budget = 1;
      job.hop = hop.view();
      job.parts = parts.data();
      BudgetResult host, dev;
      run_budget_job(job, stats.data(), &host);
      // The device's: the job, its parts and hop tables mapped (the host sizes the grids from
      // them), the statistics and scratch in device memory, the result mapped.
      const MappedArray<BudgetPartJob> m_parts(parts);
      const MappedArray<double> m_linear(hop.linear), m_square(hop.square);
      job.hop = HopProfile{m_linear.get(), m_square.get()};
      job.parts = m_parts.get();
      const MappedArray<BudgetJob> m_job(&job, 1);
      const DeviceArray<uint16_t> d_stats(stats);
      std::vector<unsigned char> scratch(budget_scratch_bytes(job), 0xA5);
      const DeviceArray<unsigned char> d_scratch(scratch);
      const MappedArray<BudgetResult> m_dev(&dev, 1);
      const uint64_t before = test::launches_so_far();
      ASSERT_EQ(launch_budget(m_job.get(), d_stats.get(), d_scratch.get(), scratch.size(),
                              m_dev.get(), nullptr, nullptr),
                cudaSuccess)
          << kernel_fault();
      DQ_EXPECT_LAUNCHES(test::launches_so_far() - before, kBudgetLaunches);
      ASSERT_EQ(m_dev.fetch(&dev), cudaSuccess) << kernel_fault();
      const std::string what = "parts " + std::to_string(shape.size()) + " first count " +
                               std::to_string(shape[0]) + " workers " + std::to_string(workers);
      ASSERT_EQ(host.state, kBudgetPredicted) << what;
      ASSERT_EQ(dev.state, host.state) << what;
      EXPECT_EQ(bits(dev.used_vnmse), bits(host.used_vnmse)) << what;
      EXPECT_EQ(dev.prediction.rung, host.prediction.rung) << what;
      for (int c = 0; c < kCandidates; ++c) {
        EXPECT_EQ(bits(dev.prediction.vnmse[c]), bits(host.prediction.vnmse[c])) << what << c;
        for (int w = 0; w < 4; ++w)
          EXPECT_EQ(dev.prediction.widths[c].n[w], host.prediction.widths[c].n[w]) << what << c;
      }
    }
}

}  // namespace
}  // namespace dq::cuda
