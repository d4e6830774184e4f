// Every DynamiQ layout of a call in one batch (launch_dynamiq_layouts), under the CUDA emulation
// and, compiled by nvcc (tests/gpu/meson.build), on a real device, against the host's
// build_dynamiq_layout byte for byte: small layouts (one block each, one
// launch) and grid layouts (their blocks concatenated, seven launches) of different sizes, chunk
// counts and options in one batch; the launch count the engine's formula uses; a lane that failed
// before the step; a capacity flag raised by one layout, which must reach the word and stop no
// other layout; a step word folded once, by the batch's last launch. Every buffer the kernels
// touch is device memory (tests/kernels/cuda/device_buffers.h); launches are counted by the
// emulator only.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/codec.h"
#include "kernels/cuda/dynamiq.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_layout.h"
#include "tests/kernels/cuda/device_buffers.h"
#include "tests/kernels/cuda/layout_stats.h"

namespace dq::cuda {
namespace {

using test::DeviceArray;
using test::first_difference;
using test::kernel_fault;
using test::make_stats;

// One layout of a test batch: its shape, its statistics, the host's bytes and the device's.
struct Part {
  size_t count;
  int chunks;
  int workers;
  DynamiqOptions options;
  size_t capacity_cut = 0;  // bytes taken off the capacity after planning (the cuts stay)
  DynamiqDeviceParams params;
  std::vector<uint16_t> stats;
  std::vector<uint64_t> host, dev;
  Status host_status = Status::kOk;
};

DynamiqOptions fixed_widths() {
  DynamiqOptions o;
  o.variable_widths = false;
  return o;
}
DynamiqOptions flat_scales() {
  DynamiqOptions o;
  o.hierarchical_scales = false;
  return o;
}
DynamiqOptions no_width16() {
  DynamiqOptions o;
  o.allow_width16 = false;
  return o;
}

Part make_part(size_t count, int chunks, int workers, const DynamiqOptions& o, uint32_t seed,
               size_t capacity_cut = 0) {
  Part p{count, chunks, workers, o, capacity_cut, {}, {}, {}, {}, Status::kOk};
  std::unique_ptr<Codec> codec = make_dynamiq_codec(o);
  EXPECT_EQ(codec->plan(count, chunks, workers), Status::kOk);
  p.params = dynamiq_device_params(count, chunks, workers, codec->chunk_capacity(), o);
  p.params.plan.capacity -= capacity_cut;
  const size_t n_sg = p.params.plan.n_sg;
  p.stats = make_stats(n_sg, workers, seed % 3 == 0 ? 0.0 : 4.0, seed % 2 == 0, seed);
  p.host.assign(p.params.sections.bytes / 8, 0x5a5a5a5a5a5a5a5aull);
  p.dev.assign(p.host.size(), 0xa5a5a5a5a5a5a5a5ull);  // garbage: every byte must be written
  return p;
}

constexpr uint64_t kCall = 0xfeedf00d1234ull;

// The launches' error word: a plain word, or a StepWord's flags.
unsigned* flags_of(unsigned* word) {
  return word;
}
unsigned* flags_of(StepWord* word) {
  return word == nullptr ? nullptr : &word->flags;
}

// The batch of `parts` (planned, as the engine will, once, with the device copies of their
// statistics and layouts), launched on a device copy of `word` with a device copy of its table;
// the layouts and the word are fetched back into `parts` and `word`. `word`: a plain flags word
// (unsigned), or a StepWord whose fold writes the lane's error word `*lane_error`. Returns the
// launches the emulator counted (0 on a real device).
// Every part's host layout built, and device copies of its statistics and layout with the jobs
// that name them (the arrays are reserved up front: a job points into them).
struct DeviceParts {
  std::vector<DeviceArray<uint16_t>> stats;
  std::vector<DeviceArray<uint64_t>> layouts;
  std::vector<LayoutJob> jobs;
  explicit DeviceParts(std::vector<Part>& parts) {
    stats.reserve(parts.size());
    layouts.reserve(parts.size());
    for (Part& p : parts) {
      p.host_status = build_dynamiq_layout(p.params.plan, p.stats.data(), kCall, p.host.data());
      stats.emplace_back(p.stats);
      layouts.emplace_back(p.dev);
      jobs.push_back(LayoutJob{p.params, p.stats.empty() ? nullptr : stats.back().get(),
                               layouts.back().get()});
    }
  }
};

template <class Word>
uint64_t run_batch(std::vector<Part>& parts, Word* word, LayoutBatch* batch,
                   uint32_t* lane_error = nullptr) {
  const DeviceParts d(parts);
  EXPECT_TRUE(plan_layout_batch(d.jobs.data(), static_cast<int>(d.jobs.size()), batch));
  std::vector<uint64_t> table((batch->table.size() + 7) / 8);  // 8-byte aligned
  if (!batch->table.empty()) std::memcpy(table.data(), batch->table.data(), batch->table.size());
  const DeviceArray<uint64_t> d_table(table);
  const DeviceArray<uint32_t> d_lane(lane_error, lane_error == nullptr ? 0 : 1);
  if constexpr (std::is_same_v<Word, StepWord>)
    word->error = lane_error == nullptr ? nullptr : d_lane.get();  // the fold's, on the device
  const DeviceArray<Word> d_word(word, 1);
  const uint64_t before = test::launches_so_far();
  cudaError_t e =
      launch_dynamiq_layouts(*batch, d_table.get(), kCall, flags_of(d_word.get()), nullptr);
  EXPECT_EQ(e, cudaSuccess) << kernel_fault();
  const uint64_t launches = test::launches_so_far() - before;
  for (size_t i = 0; i < parts.size() && e == cudaSuccess; ++i)
    e = d.layouts[i].fetch(parts[i].dev);
  if (e == cudaSuccess) e = d_word.fetch(word);
  if (e == cudaSuccess && lane_error != nullptr) e = d_lane.fetch(lane_error);
  if constexpr (std::is_same_v<Word, StepWord>) word->error = lane_error;
  EXPECT_EQ(e, cudaSuccess) << kernel_fault();
  return launches;
}

std::string what(const Part& p, size_t i) {
  return "part " + std::to_string(i) + " count " + std::to_string(p.count) + " chunks " +
         std::to_string(p.chunks);
}

// Small and grid layouts interleaved (the table puts the small ones first): sizes on both sides
// of the grid threshold (about 6,300 super-groups: the grid path's scratch must fit the sections),
// partial last super-groups, one to 64 chunks, fixed and variable widths, hierarchical and flat
// scales, no width 16, one super-group.
std::vector<Part> mixed_parts() {
  std::vector<Part> parts;
  parts.push_back(make_part(6400 * 256, 3, 4, DynamiqOptions{}, 1));     // grid
  parts.push_back(make_part(6000 * 256, 4, 4, DynamiqOptions{}, 2));     // small
  parts.push_back(make_part(7168 * 256 - 17, 8, 4, fixed_widths(), 3));  // grid
  parts.push_back(make_part(100, 1, 1, flat_scales(), 4));               // small, one super-group
  parts.push_back(make_part(9999 * 256 + 1, 64, 4, flat_scales(), 5));   // grid
  parts.push_back(make_part(1000 * 256 + 3, 64, 4, fixed_widths(), 6));  // small
  parts.push_back(make_part(6401 * 256 - 17, 2, 4, no_width16(), 7));    // grid
  parts.push_back(make_part(2048 * 256, 3, 4, DynamiqOptions{}, 8));     // small
  parts.push_back(make_part(6300 * 256, 1, 1, fixed_widths(), 9));       // grid, one chunk
  return parts;
}

TEST(CudaLayoutBatch, MixedBatchMatchesHostInEightLaunches) {
  std::vector<Part> parts = mixed_parts();
  unsigned word = 0;
  LayoutBatch batch;
  const uint64_t launches = run_batch(parts, &word, &batch);
  EXPECT_EQ(batch.n_small, 4);
  EXPECT_EQ(batch.n_grid, 5);
  EXPECT_EQ(layout_batch_launches(batch), 8);
  DQ_EXPECT_LAUNCHES(launches, 8u);
  EXPECT_EQ(word, 0u);
  for (size_t i = 0; i < parts.size(); ++i) {
    EXPECT_EQ(parts[i].host_status, Status::kOk) << what(parts[i], i);
    EXPECT_EQ(first_difference(parts[i].host, parts[i].dev), -1) << what(parts[i], i);
  }
}

// A batch of `parts` alone: `n_small` one-block and `n_grid` grid layouts in `launches`
// launches, every layout as the host's.
void expect_batch(std::vector<Part> parts, int n_small, int n_grid, uint64_t launches) {
  unsigned word = 0;
  LayoutBatch batch;
  DQ_EXPECT_LAUNCHES(run_batch(parts, &word, &batch), launches);
  EXPECT_EQ(layout_batch_launches(batch), static_cast<int>(launches));
  EXPECT_EQ(batch.n_small, n_small);
  EXPECT_EQ(batch.n_grid, n_grid);
  for (size_t i = 0; i < parts.size(); ++i)
    EXPECT_EQ(first_difference(parts[i].host, parts[i].dev), -1) << what(parts[i], i);
}

TEST(CudaLayoutBatch, LaunchesAreOneForSmallSevenForGrid) {
  std::vector<Part> grid;
  grid.push_back(make_part(8000 * 256, 4, 4, DynamiqOptions{}, 20));
  grid.push_back(make_part(6500 * 256 + 9, 16, 4, flat_scales(), 21));
  expect_batch(std::move(grid), 0, 2, 7);
  std::vector<Part> small;
  for (uint32_t i = 0; i < 5; ++i)
    small.push_back(make_part((300 + 700 * i) * 256 + i, 1 + 7 * static_cast<int>(i), 4,
                              i % 2 ? fixed_widths() : DynamiqOptions{}, 30 + i));
  expect_batch(std::move(small), 5, 0, 1);
  expect_batch({}, 0, 0, 0);
}

TEST(CudaLayoutBatch, FailedLaneWritesNoLayout) {
  std::vector<Part> parts = mixed_parts();
  std::vector<std::vector<uint64_t>> untouched;
  for (const Part& p : parts) untouched.push_back(p.dev);
  unsigned word = kSkipFlag | 2u;
  LayoutBatch batch;
  DQ_EXPECT_LAUNCHES(run_batch(parts, &word, &batch), 8u);
  EXPECT_EQ(word, kSkipFlag | 2u);
  for (size_t i = 0; i < parts.size(); ++i)
    EXPECT_EQ(first_difference(parts[i].dev, untouched[i]), -1) << what(parts[i], i);
}

// One device copy of the table serves every call, as the engine uses it (copied once, at plan
// time): the extent kernel's ticket words in it are back to 0 after each launch, a failed lane's
// included, so the table reads as planned after every launch (a ticket left counting would find
// no last block again, leaving block 0's largest key and poisoned count where the layout's belong)
// and a build after a failed one or after a good one is the host's byte for byte.
TEST(CudaLayoutBatch, OneTableCopyServesEveryCall) {
  std::vector<Part> parts = mixed_parts();
  const DeviceParts d(parts);
  LayoutBatch batch;
  ASSERT_TRUE(plan_layout_batch(d.jobs.data(), static_cast<int>(d.jobs.size()), &batch));
  ASSERT_GT(batch.n_grid, 0);
  std::vector<uint64_t> table((batch.table.size() + 7) / 8);  // 8-byte aligned
  std::memcpy(table.data(), batch.table.data(), batch.table.size());
  const std::vector<uint64_t> planned = table;
  const DeviceArray<uint64_t> d_table(table);
  int call = 0;
  for (const unsigned flags : {kSkipFlag | 2u, 0u, 0u}) {
    unsigned word = flags;
    const DeviceArray<unsigned> d_word(&word, 1);
    ASSERT_EQ(launch_dynamiq_layouts(batch, d_table.get(), kCall, d_word.get(), nullptr),
              cudaSuccess)
        << kernel_fault();
    std::vector<uint64_t> after(table.size());
    ASSERT_EQ(d_table.fetch(after), cudaSuccess) << kernel_fault();
    EXPECT_EQ(first_difference(planned, after), -1) << "launch " << call;
    ASSERT_EQ(d_word.fetch(&word), cudaSuccess) << kernel_fault();
    EXPECT_EQ(word, flags) << "launch " << call;
    for (size_t i = 0; i < parts.size() && flags == 0; ++i) {
      ASSERT_EQ(d.layouts[i].fetch(parts[i].dev), cudaSuccess) << kernel_fault();
      EXPECT_EQ(first_difference(parts[i].host, parts[i].dev), -1)
          << what(parts[i], i) << ", launch " << call;
    }
    ++call;
  }
}

// One small and one grid layout 600 bytes short of capacity (chunk 0, at least one stride long,
// no longer fits): the flag reaches the word, and every other layout, the later blocks of the
// one-block launch and the grid launches after it included, is still written whole.
std::vector<Part> parts_over_capacity() {
  std::vector<Part> parts;
  parts.push_back(make_part(3000 * 256, 4, 4, DynamiqOptions{}, 40, 600));  // small, block 0
  parts.push_back(make_part(2500 * 256 + 5, 4, 4, DynamiqOptions{}, 41));   // small, block 1
  parts.push_back(make_part(8000 * 256, 4, 4, DynamiqOptions{}, 42, 600));  // grid
  parts.push_back(make_part(6000 * 256, 8, 4, flat_scales(), 43));          // grid
  return parts;
}

TEST(CudaLayoutBatch, CapacityFlagReachesTheWordAndStopsNoOtherLayout) {
  std::vector<Part> parts = parts_over_capacity();
  unsigned word = 0;
  LayoutBatch batch;
  DQ_EXPECT_LAUNCHES(run_batch(parts, &word, &batch), 8u);
  EXPECT_EQ(word, unsigned{kDynamiqChunkOverCapacity});
  for (size_t i = 0; i < parts.size(); ++i) {
    EXPECT_EQ(parts[i].host_status, parts[i].capacity_cut > 0 ? Status::kInternal : Status::kOk)
        << what(parts[i], i);
    if (parts[i].capacity_cut == 0) {
      EXPECT_EQ(first_difference(parts[i].host, parts[i].dev), -1) << what(parts[i], i);
    }
  }
  // The small layout alone over capacity: the grid layouts after it are still built.
  std::vector<Part> small_over = parts_over_capacity();
  small_over[2] = make_part(8000 * 256, 4, 4, DynamiqOptions{}, 42);
  word = 0;
  DQ_EXPECT_LAUNCHES(run_batch(small_over, &word, &batch), 8u);
  EXPECT_EQ(word, unsigned{kDynamiqChunkOverCapacity});
  for (size_t i = 1; i < small_over.size(); ++i)
    EXPECT_EQ(first_difference(small_over[i].host, small_over[i].dev), -1)
        << what(small_over[i], i);
}

// As the devices run it: a step word (kFoldFlag armed), folded once, by the batch's last launch,
// after every layout of the batch (a small layout's flag does not stop the grid layouts).
TEST(CudaLayoutBatch, BatchFoldsAStepWordOnce) {
  for (bool over : {false, true}) {
    std::vector<Part> parts = parts_over_capacity();
    if (!over) {
      parts[0] = make_part(3000 * 256, 4, 4, DynamiqOptions{}, 40);
      parts[2] = make_part(8000 * 256, 4, 4, DynamiqOptions{}, 42);
    } else {
      parts[2] = make_part(8000 * 256, 4, 4, DynamiqOptions{}, 42);  // the small one alone
    }
    uint32_t lane_error = 0;
    StepWord word = step_word(&lane_error, kDynamiqChunkOverCapacity, 11u, 22u);
    LayoutBatch batch;
    DQ_EXPECT_LAUNCHES(run_batch(parts, &word, &batch, &lane_error), 8u);
    EXPECT_EQ(word.blocks_done, 0u);  // folded by the last block of the last launch
    EXPECT_EQ(lane_error, over ? 11u : 0u);
    EXPECT_EQ(word.raised, over ? unsigned{kDynamiqChunkOverCapacity} : 0u);
    EXPECT_EQ(word.flags, over ? kFoldFlag | kSkipFlag : kFoldFlag);
    for (size_t i = over ? 1 : 0; i < parts.size(); ++i)
      EXPECT_EQ(first_difference(parts[i].host, parts[i].dev), -1) << what(parts[i], i);
  }
}

TEST(CudaLayoutBatch, InvalidJobsAreRefused) {
  Part p = make_part(5000 * 256, 4, 4, DynamiqOptions{}, 50);
  const LayoutJob good{p.params, p.stats.data(), p.dev.data()};
  LayoutJob no_layout = good, no_stats = good, no_chunks = good;
  no_layout.layout = nullptr;
  no_stats.reduced_stats = nullptr;
  no_chunks.params.plan.n_chunks = 0;
  for (const LayoutJob& bad : {no_layout, no_stats, no_chunks}) {
    const LayoutJob jobs[2] = {good, bad};
    LayoutBatch batch;
    batch.n_grid = 3;
    EXPECT_FALSE(plan_layout_batch(jobs, 2, &batch));
    EXPECT_EQ(batch.n_grid, 0);  // cleared
    EXPECT_TRUE(batch.table.empty());
    // The single launch answers the same.
    unsigned word = 0;
    EXPECT_EQ(launch_dynamiq_layout(bad.params, bad.reduced_stats, 1, bad.layout, &word, nullptr),
              cudaErrorInvalidValue);
  }
  LayoutBatch batch;
  ASSERT_TRUE(plan_layout_batch(&good, 1, &batch));
  std::vector<uint64_t> table((batch.table.size() + 7) / 8);
  std::memcpy(table.data(), batch.table.data(), batch.table.size());
  unsigned word = 0;
  EXPECT_EQ(launch_dynamiq_layouts(batch, table.data(), 1, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(launch_dynamiq_layouts(batch, nullptr, 1, &word, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace dq::cuda
