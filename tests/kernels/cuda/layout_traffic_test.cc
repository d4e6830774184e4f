// The DynamiQ layout kernels' global-memory traffic under the CUDA emulation (the accessors of
// kernels/cuda/cuda_compat.h count every byte a thread reads or writes, atomics included;
// dq::emu::global_bytes_so_far() sums the several launches of one build). One layout build of S
// super-groups, by the one-block kernel and by the seven grid kernels, moves at most a * S + b
// bytes, the constants derived below from what each kernel reads and writes a super-group, a
// block and a chunk (the grid's blocks read one or a few words of the blocks' summaries each, never
// every block's). The bytes grow about 4x from S to 4S super-groups (with 4x the chunks), where a
// pass that re-read the statistics or the layout per chunk, per bisection step or per block would
// grow them more. A batch moves what its layouts move
// alone plus the grid blocks' search of the table. Every counted layout is also compared with the
// host's build_dynamiq_layout() byte for byte, so the counted kernels are correct ones.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/codec.h"
#include "kernels/cuda/dynamiq.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_layout.h"
#include "tests/kernels/cuda/device_buffers.h"
#include "tests/kernels/cuda/layout_stats.h"

namespace dq::cuda {
namespace {

using test::first_difference;
using test::make_stats;

constexpr int kWorkers = 4;
constexpr uint64_t kCall = 0x5eed5eedull;
constexpr uint64_t kGridBlock = 256;  // super-groups a grid block takes (kGridThreads)

// One layout: its parameters, statistics and the host's bytes.
struct Layout {
  DynamiqDeviceParams params;
  std::vector<uint16_t> stats;
  std::vector<uint64_t> host;
};

Layout make_layout(size_t n_sg, int chunks, const DynamiqOptions& o, uint32_t seed) {
  Layout l;
  std::unique_ptr<Codec> codec = make_dynamiq_codec(o);
  const size_t count = n_sg * kSuperGroup;
  EXPECT_EQ(codec->plan(count, chunks, kWorkers), Status::kOk);
  l.params = dynamiq_device_params(count, chunks, kWorkers, codec->chunk_capacity(), o);
  l.stats = make_stats(l.params.plan.n_sg, kWorkers, 4.0, true, seed);
  l.host.assign(l.params.sections.bytes / 8, 0);
  EXPECT_EQ(build_dynamiq_layout(l.params.plan, l.stats.data(), kCall, l.host.data()), Status::kOk);
  return l;
}

// The batch plan_layout_batch() makes of `l` alone (no launch: the layout pointer is not used).
LayoutBatch plan_alone(const Layout& l) {
  uint64_t unused = 0;
  const LayoutJob job{l.params, l.stats.data(), &unused};
  LayoutBatch batch;
  EXPECT_TRUE(plan_layout_batch(&job, 1, &batch));
  return batch;
}

// The bytes of one table entry (a job: plan, sections, pointers), as plan_layout_batch() sizes it.
uint64_t job_bytes(const Layout& l) {
  return plan_alone(l).table.size();
}

bool on_grid(const Layout& l) {
  return plan_alone(l).n_grid == 1;
}

// The one-block kernel's most bytes for layout `l` (kernels/cuda/dynamiq_layout.cu, phases 1-6),
// from what each phase reads and writes:
//  - the whole layout zeroed once (sections.bytes), the header (24);
//  - per super-group: its three statistics words read and its mean and exponent written (6 + 5),
//    its energy and all-zero words read again and its parked width key written (4 + 4); variable
//    widths: the bisection reads the parked keys once a step, at most 31 steps (the thresholds'
//    bit patterns 0 .. 0x7f800000), fixed widths once to count the poisoned ones (4); the final
//    widths: the key read, the width written (4 + 1); the partition: the width, its chunk's two
//    cuts, order, offset and by_index (1 + 8 + 4 + 4 + 4); the digests: order, width, mean and
//    exponent (4 + 1 + 4 + 1);
//  - per chunk: its content, cut and check zeroed with the layout, its cut written (4), its
//    content read from the cuts and written (8 + 8), the digest warp's 32 lanes reading its two
//    cuts (256), lane 0 its content (8) and the check written (4): 288 (their zeroing is the
//    layout's);
//  - once: the job staged (the table entry), the error word and the first cut (4 + 4).
// Every term is a most (the bisection takes 30 or 31 steps), and the sum is what these inputs
// move, so a pass that re-read the statistics or a section once more per chunk or per bisection
// step breaks it.
uint64_t one_block_bound(const Layout& l) {
  const DynamiqPlan& p = l.params.plan;
  const uint64_t s = p.n_sg, chunks = static_cast<uint64_t>(p.n_chunks);
  const uint64_t widths = p.variable_widths ? 31 * 4 : 4;
  const uint64_t per_sg = (6 + 5) + (4 + 4) + widths + (4 + 1) + (1 + 8 + 4 + 4 + 4) + 10;
  return l.params.sections.bytes + 24 + per_sg * s + 288 * chunks + job_bytes(l) + 8;
}

// The probes of block_lower_bound() over at most n positions (the grid's class search): each
// round at most 256 probes, one in each step of the range, which then shrinks to one step.
uint64_t search_probes(uint64_t n) {
  uint64_t probes = 0;
  for (; n > kGridBlock; n = (n + kGridBlock - 1) / kGridBlock) probes += kGridBlock;
  return probes + n;
}

// The grid kernels' most bytes for layout `l` (kernels/cuda/dynamiq_layout_grid.cuh, B blocks of
// 256 super-groups, D = B + chunks digest blocks, seven launches), from what each kernel moves:
//  - per super-group: extent: its energy and all-zero words (4); breakpoints: the same words and
//    three breakpoints written (4 + 12); widths: its breakpoints read, its width written (at most
//    12 + 1); partition: its width, order and by_index (1 + 4 + 4); digest: order, three
//    statistics words, mean, exponent, width (4 + 6 + 4 + 1 + 1); finish: its chunk's cut and its
//    offset (4 + 4); variable widths: the breakpoints read again for the three histograms (36);
//  - per block of the six launches before the digests': the job staged, the error word (4);
//    extent: its largest key and poisoned count written (8), its ticket (an atomic: 8), the last
//    block's reduction reading them (8); breakpoints: the layout's largest key (4); widths: its
//    class counts written (16), its ticket (8), the last block's scan reading and writing them
//    (32), fixed widths the layout's poisoned count (4); partition: the sums of the blocks before
//    and of all (8 words: 32); variable widths: each of the three histograms' bins published by
//    one atomic per non-empty bin (at most 768 bins: 3 * 256 breakpoints, 8 bytes each), the
//    three histogram kernels' tickets (3 * 8), the pick words (the digits picked so far, 16 bytes)
//    read by the two digit kernels and the widths kernel (3 * 16), never the histograms;
//  - per digest block: the job staged, the error word (4), the class search (3 searches,
//    search_probes(S) probes of order and width, 5 bytes each), its ticket, chain word, the chain
//    before and its chunk's first cut (16 + 16 + 8 + 4; blocks run in order here, so one poll
//    finds the chain set), the cuts scanned for its segment (8 a chunk), the ticket of the blocks
//    done (16);
//  - per chunk: its cut written (4), its content from two cuts (8 + 8), the check (4);
//  - once: the histograms zeroed (3 * 2048 * 4), the chain zeroed (8 (B + chunks + 2)), the header
//    and the sections' padding (24 + 8 * 8), the tickets of the histogram and widths kernels
//    zeroed and the extent ticket put back to 0 (16 + 4), the layout's largest key and poisoned
//    count written (8); variable widths: each digit picked once, by its kernel's last block, from
//    its histogram read twice (3 * 2 * 8192), the pick words written (3 * 16).
// No term is quadratic in the blocks: a block reading every block's summaries (24 bytes a pair of
// blocks, 400 MB at 4,096 blocks) breaks the bound at a few blocks, and one re-picking the digits
// before its level from the histograms (6 picks of 8 KiB, twice: 96 KiB a block, over 5 times the
// histograms' publishing term) breaks it at any size.
uint64_t grid_bound(const Layout& l) {
  const DynamiqPlan& p = l.params.plan;
  const uint64_t s = p.n_sg, chunks = static_cast<uint64_t>(p.n_chunks);
  const uint64_t blocks = (s + kGridBlock - 1) / kGridBlock, digest = blocks + chunks;
  const uint64_t per_sg = 4 + 16 + 13 + 9 + 16 + 8 + (p.variable_widths ? 36 : 0);
  const uint64_t per_block = 6 * (job_bytes(l) + 4) + (8 + 8 + 8) + 4 + (16 + 8 + 32) + 32 +
                             (p.variable_widths ? 3 * 768 * 8 + 3 * 8 + 3 * 16 : 4);
  const uint64_t per_digest_block =
      job_bytes(l) + 4 + 3 * search_probes(s) * 5 + 44 + 8 * chunks + 16;
  const uint64_t once = 3 * 2048 * 4 + 8 * (blocks + chunks + 2) + 24 + 64 + 20 + 8 +
                        (p.variable_widths ? 3 * (2 * 8192 + 16) : 0);
  return per_sg * s + per_block * blocks + per_digest_block * digest + 24 * chunks + once;
}

uint64_t bound(const Layout& l) {
  return on_grid(l) ? grid_bound(l) : one_block_bound(l);
}

// The bytes one build of `l` by launch_dynamiq_layout moves; its layout must be the host's.
uint64_t build_bytes(const Layout& l) {
  std::vector<uint64_t> dev(l.host.size(), 0xa5a5a5a5a5a5a5a5ull);
  unsigned error = 0;
  const uint64_t before = emu::global_bytes_so_far();
  EXPECT_EQ(launch_dynamiq_layout(l.params, l.stats.data(), kCall, dev.data(), &error, nullptr),
            cudaSuccess)
      << test::kernel_fault();
  const uint64_t bytes = emu::global_bytes_so_far() - before;
  EXPECT_EQ(error, 0u);
  EXPECT_EQ(first_difference(l.host, dev), -1) << l.params.plan.n_sg << " super-groups";
  return bytes;
}

void report(const char* what, const Layout& l, uint64_t bytes) {
  const DynamiqPlan& p = l.params.plan;
  std::printf("%s: %zu super-groups, %d chunks: %llu bytes, %.1f a super-group, bound %llu\n", what,
              p.n_sg, p.n_chunks, static_cast<unsigned long long>(bytes),
              static_cast<double>(bytes) / static_cast<double>(p.n_sg),
              static_cast<unsigned long long>(bound(l)));
}

DynamiqOptions fixed_widths() {
  DynamiqOptions o;
  o.variable_widths = false;
  return o;
}

// A build of S and of 4S super-groups (and 4x the chunks): each within its bound, and the second
// at most kMostGrowth times the first, everything counted. A linear kernel gives 3.97-4.05 here
// (the constant terms and the grid's class search, whose second round grows with S / 256 probes;
// 4.10 from 32,768 fixed-width super-groups, where it is a larger share); a pass of
// O(S log2 S) bytes would give 4.6-4.8 at these sizes, one of O(S * chunks) up to 16 (less where
// other terms dominate: one thread re-reading order and width per chunk gave 4.25 to 5.3; every
// block reading every block's summaries (24 bytes a pair of blocks) gave 4.08 and 4.41 from 8,192
// super-groups; its largest keys alone (4 bytes a pair) 4.04 and 4.06 there, which only the
// fixed-width case from 128 blocks (32,768 super-groups, cheap to emulate) catches: 4.38).
constexpr double kMostGrowth = 4.15;

void check_growth(const char* what, size_t s, int chunks, const DynamiqOptions& o, bool grid) {
  const Layout small = make_layout(s, chunks, o, 11), large = make_layout(4 * s, 4 * chunks, o, 12);
  ASSERT_EQ(on_grid(small), grid) << what;
  ASSERT_EQ(on_grid(large), grid) << what;
  const uint64_t a = build_bytes(small), b = build_bytes(large);
  report(what, small, a);
  report(what, large, b);
  EXPECT_LE(a, bound(small)) << what;
  EXPECT_LE(b, bound(large)) << what;
  ASSERT_GT(a, 0u);
  const double growth = static_cast<double>(b) / static_cast<double>(a);
  std::printf("%s: 4x the super-groups and chunks: %.3fx the bytes\n", what, growth);
  EXPECT_LE(growth, kMostGrowth) << what;
}

TEST(CudaLayoutTraffic, OneBlockLayoutIsLinearInSupergroups) {
  check_growth("one-block", 1000, 2, DynamiqOptions{}, false);
  check_growth("one-block fixed widths", 1000, 2, fixed_widths(), false);
}

TEST(CudaLayoutTraffic, GridLayoutIsLinearInSupergroups) {
  check_growth("grid", 8192, 2, DynamiqOptions{}, true);
  check_growth("grid fixed widths", 8192, 2, fixed_widths(), true);
  check_growth("grid fixed widths, 128 blocks", 32768, 1, fixed_widths(), true);
}

// A large grid layout (2^18 super-groups: 2^26 values, 1024 blocks), where every block reading
// every block's summaries would be over half the fixed-width bytes (24 B a pair of blocks, 96 B a
// super-group): within the linear bound. Slow under the emulator, so left out of the default run
// (docs/results/gpu.md gives the command).
TEST(CudaLayoutTraffic, DISABLED_LargeGridLayout) {
  for (const DynamiqOptions& o : {DynamiqOptions{}, fixed_widths()}) {
    const Layout l = make_layout(size_t{1} << 18, 8, o, 31);
    ASSERT_TRUE(on_grid(l));
    const uint64_t bytes = build_bytes(l);
    report(o.variable_widths ? "large grid" : "large grid fixed widths", l, bytes);
    EXPECT_LE(bytes, bound(l));
  }
}

// A batch of small and grid layouts in one launch_dynamiq_layouts() call moves what its layouts
// move built one by one, plus each grid block's search for its layout in the table (every thread
// reads a job's first block, ceil(log2(grid layouts)) times, in each of the seven launches); each
// layout as the host's.
TEST(CudaLayoutTraffic, BatchMovesItsLayoutsBytes) {
  std::vector<Layout> parts;
  parts.push_back(make_layout(1000, 2, DynamiqOptions{}, 21));
  parts.push_back(make_layout(8192, 2, DynamiqOptions{}, 22));
  parts.push_back(make_layout(3000, 5, fixed_widths(), 23));
  parts.push_back(make_layout(7000, 3, fixed_widths(), 24));
  uint64_t alone = 0, bounds = 0;
  for (const Layout& l : parts) {
    alone += build_bytes(l);
    bounds += bound(l);
  }
  std::vector<std::vector<uint64_t>> dev;
  std::vector<LayoutJob> jobs;
  for (const Layout& l : parts) dev.emplace_back(l.host.size(), 0xa5a5a5a5a5a5a5a5ull);
  for (size_t i = 0; i < parts.size(); ++i)
    jobs.push_back(LayoutJob{parts[i].params, parts[i].stats.data(), dev[i].data()});
  LayoutBatch batch;
  ASSERT_TRUE(plan_layout_batch(jobs.data(), static_cast<int>(jobs.size()), &batch));
  ASSERT_EQ(batch.n_small, 2);
  ASSERT_EQ(batch.n_grid, 2);
  std::vector<uint64_t> table((batch.table.size() + 7) / 8);  // 8-byte aligned
  std::memcpy(table.data(), batch.table.data(), batch.table.size());
  unsigned error = 0;
  const uint64_t before = emu::global_bytes_so_far();
  ASSERT_EQ(launch_dynamiq_layouts(batch, table.data(), kCall, &error, nullptr), cudaSuccess)
      << test::kernel_fault();
  const uint64_t bytes = emu::global_bytes_so_far() - before;
  EXPECT_EQ(error, 0u);
  for (size_t i = 0; i < parts.size(); ++i)
    EXPECT_EQ(first_difference(parts[i].host, dev[i]), -1) << "part " << i;
  // Each grid block's search: one step for 2 grid layouts, a job's first block read by every
  // thread (4 bytes), in six launches of grid_blocks and the digests' of digest_blocks.
  const uint64_t search = (6ull * batch.grid_blocks + batch.digest_blocks) * kGridBlock * 4;
  std::printf("batch of 2 one-block and 2 grid layouts: %llu bytes; alone %llu, bound %llu\n",
              static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(alone),
              static_cast<unsigned long long>(bounds));
  EXPECT_LE(bytes, alone + search);
  EXPECT_LE(bytes, bounds + search);
}

}  // namespace
}  // namespace dq::cuda
