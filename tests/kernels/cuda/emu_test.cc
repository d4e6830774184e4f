// Self-tests of the CUDA emulation (kernels/cuda/EMULATION.md): block reductions and scans
// against sequential results, the warp intrinsics against the PTX rules, and every rule break the
// emulator must report: a barrier not every thread reaches, divergent barriers, a partial warp in
// a full-mask shuffle, lanes outside a mask, mismatched collectives, unwritten shared memory, and
// out-of-bounds shared-memory indices.
#include <gtest/gtest.h>

#include <time.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/kernels/cuda/emu_kernels.h"

namespace dq::cuda::selftest {
namespace {

using dq::emu::Fault;
using dq::emu::last_report;
using dq::emu::launches;
using dq::emu::require_loaded;

TEST(CudaEmu, BlockReduceAndScanMatchSequential) {
  std::mt19937 rng(7);
  for (int threads : {32, 64, 96, 256, 1024}) {
    const int blocks = 3;
    std::vector<int> in(blocks * threads);
    for (int& v : in) v = static_cast<int>(rng() % 2001) - 1000;
    std::vector<int> reduced(3 * blocks), scanned(in.size()), totals(blocks);
    ASSERT_EQ(
        reduce_and_scan(in.data(), blocks, threads, reduced.data(), scanned.data(), totals.data()),
        cudaSuccess)
        << last_report().message;
    for (int b = 0; b < blocks; ++b) {
      const int* x = &in[b * threads];
      int sum = 0, max = x[0], min = x[0];
      for (int t = 0; t < threads; ++t) {
        EXPECT_EQ(scanned[b * threads + t], sum) << "block " << b << " thread " << t;
        sum += x[t];
        max = std::max(max, x[t]);
        min = std::min(min, x[t]);
      }
      EXPECT_EQ(reduced[3 * b], sum);
      EXPECT_EQ(reduced[3 * b + 1], max);
      EXPECT_EQ(reduced[3 * b + 2], min);
      EXPECT_EQ(totals[b], sum);
    }
  }
}

TEST(CudaEmu, EarlyReturnBeforeBarrierIsADeadlock) {
  EXPECT_EQ(early_return(256, 200), cudaErrorLaunchFailure);
  EXPECT_EQ(last_report().fault, Fault::kDeadlock);
  const std::string& m = last_report().message;
  EXPECT_NE(m.find("200 wait at __syncthreads() at"), std::string::npos) << m;
  EXPECT_NE(m.find("emu_kernels.cu:"), std::string::npos) << m;
  EXPECT_NE(m.find("[threads 0-199]"), std::string::npos) << m;
  EXPECT_NE(m.find("56 exited [threads 200-255]"), std::string::npos) << m;
  EXPECT_NE(m.find("early_return_kernel"), std::string::npos) << m;
  // The failed launch is over: the next one runs normally.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(early_return(256, 256), cudaSuccess) << last_report().message;
}

TEST(CudaEmu, BarriersInBothBranchesAreDivergence) {
  dq::emu::set_thread_order(dq::emu::BlockOrdering{});  // the threads named run in index order
  EXPECT_EQ(divergent_barrier(64), cudaErrorLaunchFailure);
  EXPECT_EQ(last_report().fault, Fault::kBarrierDivergence);
  const std::string& m = last_report().message;
  // Both call sites are named: thread 0 waits at the first, thread 1 arrives at the second.
  const size_t first = m.find("emu_kernels.cu:");
  ASSERT_NE(first, std::string::npos) << m;
  const size_t second = m.find("emu_kernels.cu:", first + 1);
  ASSERT_NE(second, std::string::npos) << m;
  EXPECT_NE(m.substr(first, 20), m.substr(second, 20)) << m;
  EXPECT_NE(m.find("thread 1 "), std::string::npos) << m;
  EXPECT_NE(m.find("thread 0 "), std::string::npos) << m;
}

TEST(CudaEmu, HalfAWarpInAFullMaskShuffleIsReported) {
  std::vector<int> out(64, -1);
  EXPECT_EQ(partial_warp_shuffle(64, 16, out.data()), cudaErrorLaunchFailure);
  EXPECT_EQ(last_report().fault, Fault::kDeadlock);
  const std::string& m = last_report().message;
  EXPECT_NE(m.find("32 wait at __shfl_sync(mask 0xffffffff, width 32)"), std::string::npos) << m;
  EXPECT_NE(m.find("[threads 0-15, 32-47]"), std::string::npos) << m;
  EXPECT_NE(m.find("32 exited [threads 16-31, 48-63]"), std::string::npos) << m;
  // All 32 lanes: no fault, every lane reads lane 0 of its warp.
  EXPECT_EQ(partial_warp_shuffle(64, 32, out.data()), cudaSuccess) << last_report().message;
  for (int t = 0; t < 64; ++t) EXPECT_EQ(out[t], t / 32 * 32);
}

TEST(CudaEmu, UnwrittenSharedMemoryShowsThePoison) {
  // Two blocks, each writing its own 128 words of each output.
  std::vector<uint32_t> st(256, 0), dy(256, 0);
  ASSERT_EQ(read_unwritten_shared(128, st.data(), dy.data()), cudaSuccess) << last_report().message;
  for (int t = 0; t < 256; ++t) {
    EXPECT_EQ(st[t], 0xffffffffu) << t;
    EXPECT_EQ(dy[t], 0xffffffffu) << t;
  }
  float as_float;
  std::memcpy(&as_float, &st[0], 4);
  EXPECT_TRUE(std::isnan(as_float));
}

TEST(CudaEmu, SharedIndicesInBoundsWork) {
  int out = -1;
  ASSERT_EQ(static_shared_index(31, &out), cudaSuccess);
  EXPECT_EQ(out, 31);
  float f = -1;
  ASSERT_EQ(dynamic_shared_index(31, &f), cudaSuccess);
  EXPECT_EQ(f, 31.0f);
}

TEST(CudaEmuDeathTest, StaticSharedIndexOutOfBoundsIsDetected) {
#if !defined(DQ_EMU_BOUNDS_CHECKED)
  GTEST_SKIP() << "this build has no -fsanitize=bounds-strict for the emulated tests";
#else
  int out = 0;
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The ASan + UBSan CI leg aborts at the report (abort_on_error=1) without running the death
  // callback that names the kernel and thread, and TSan's runtime never calls it: the detection
  // itself is what is checked there.
  EXPECT_DEATH(static_shared_index(32, &out), "index 32 out of bounds for type 'int \\[32\\]'");
#else
  EXPECT_DEATH(
      static_shared_index(32, &out),
      "index 32 out of bounds for type 'int \\[32\\]'(.|\n)*dq-emu: sanitizer error in kernel "
      "static_index_kernel.*thread 0 ");
#endif
#endif
}

TEST(CudaEmuDeathTest, DynamicSharedIndexOutOfBoundsIsDetected) {
  float out = 0;
  EXPECT_DEATH(
      dynamic_shared_index(32, &out),
      "dq-emu: shared memory out of bounds: dynamic shared memory of 128 bytes accessed at "
      "offset 128 in kernel dynamic_index_kernel.*thread 0 ");
}

// The PTX shfl.sync rules, written out per mode for the expected values.
int expect_shuffle(int mode, int t, int width, int b) {
  const int lane = t % 32, warp_base = t - lane;
  const int seg_base = lane / width * width;
  int j = lane;
  switch (mode) {
    case 0:
      j = seg_base + (b % width);
      break;
    case 1:
      j = lane - b >= seg_base ? lane - b : lane;
      break;
    case 2:
      j = lane + b < seg_base + width ? lane + b : lane;
      break;
    case 3:
      j = (lane ^ b) < seg_base + width ? (lane ^ b) : lane;
      break;
  }
  return 100 + warp_base + j;
}

TEST(CudaEmu, ShufflesFollowThePtxRules) {
  const int threads = 64;
  std::vector<int> out(4 * threads);
  for (int width : {32, 16, 8, 4, 2, 1})
    for (int src : {0, 3, 17, 31, 40})
      for (int delta : {0, 1, 5, 16})
        for (int xmask : {1, 6, 16, 31}) {
          ASSERT_EQ(shuffles(threads, width, src, delta, xmask, out.data()), cudaSuccess)
              << last_report().message;
          for (int t = 0; t < threads; ++t) {
            ASSERT_EQ(out[4 * t], expect_shuffle(0, t, width, src))
                << width << " " << src << " " << t;
            ASSERT_EQ(out[4 * t + 1], expect_shuffle(1, t, width, delta))
                << width << " " << delta << " " << t;
            ASSERT_EQ(out[4 * t + 2], expect_shuffle(2, t, width, delta))
                << width << " " << delta << " " << t;
            ASSERT_EQ(out[4 * t + 3], expect_shuffle(3, t, width, xmask))
                << width << " " << xmask << " " << t;
          }
        }
  EXPECT_EQ(shuffles(32, 12, 0, 0, 1, out.data()), cudaErrorLaunchFailure);
  EXPECT_EQ(last_report().fault, Fault::kBadWidth);
}

TEST(CudaEmu, VotesOverMasks) {
  std::vector<unsigned> out(3 * 32);
  for (unsigned mask : {0xffffffffu, 0x0000ffffu, 0xf0f0f0f0u, 0x80000001u})
    for (unsigned bits : {0u, 0xffffffffu, 0x12345678u, 0x0000ffffu}) {
      std::fill(out.begin(), out.end(), 7u);
      ASSERT_EQ(votes(bits, mask, out.data()), cudaSuccess) << last_report().message;
      for (int lane = 0; lane < 32; ++lane) {
        if (!((mask >> lane) & 1u)) {
          EXPECT_EQ(out[3 * lane], 7u);
          continue;
        }
        EXPECT_EQ(out[3 * lane], bits & mask);
        EXPECT_EQ(out[3 * lane + 1], (bits & mask) != 0 ? 1u : 0u);
        EXPECT_EQ(out[3 * lane + 2], (bits & mask) == mask ? 1u : 0u);
      }
    }
}

TEST(CudaEmu, ReadingALaneOutsideTheMaskIsReported) {
  std::vector<int> out(32, -1);
  ASSERT_EQ(shuffle_lane(0x0000ffffu, 5, out.data()), cudaSuccess) << last_report().message;
  for (int lane = 0; lane < 16; ++lane) EXPECT_EQ(out[lane], 50);
  EXPECT_EQ(shuffle_lane(0x0000ffffu, 20, out.data()), cudaErrorLaunchFailure);
  EXPECT_EQ(last_report().fault, Fault::kLaneOutsideMask);
  EXPECT_NE(last_report().message.find("reads lane 20, which is not in the mask"),
            std::string::npos)
      << last_report().message;
}

TEST(CudaEmu, MismatchedCollectivesAreReported) {
  dq::emu::set_thread_order(dq::emu::BlockOrdering{});  // the lanes named run in index order
  std::vector<int> out(32);
  EXPECT_EQ(mismatched_collectives(out.data()), cudaErrorLaunchFailure);
  EXPECT_EQ(last_report().fault, Fault::kWarpMismatch);
  const std::string& m = last_report().message;
  EXPECT_NE(m.find("__ballot_sync(mask 0xffffffff) at"), std::string::npos) << m;
  EXPECT_NE(m.find("waits in __shfl_sync(mask 0xffffffff, width 32) at"), std::string::npos) << m;
}

TEST(CudaEmu, Atomics) {
  int counter = 0, max = -1;
  float fsum = 0.0f;
  unsigned cas = 0;
  ASSERT_EQ(atomics(5, 96, &counter, &fsum, &max, &cas), cudaSuccess) << last_report().message;
  EXPECT_EQ(counter, 480);
  EXPECT_EQ(fsum, 240.0f);
  EXPECT_EQ(max, 479);
  EXPECT_EQ(cas, 480u);
}

TEST(CudaEmu, ThreadAndBlockIndices) {
  const dim3 grid(3, 2), block(4, 2, 3);
  const int per_block = 24, n = 6 * per_block;
  std::vector<unsigned> out(6 * n, 999), dims(6, 0);
  ASSERT_EQ(indices(grid, block, out.data(), dims.data()), cudaSuccess) << last_report().message;
  EXPECT_EQ(dims, (std::vector<unsigned>{4, 2, 3, 3, 2, 1}));
  for (unsigned by = 0; by < 2; ++by)
    for (unsigned bx = 0; bx < 3; ++bx)
      for (unsigned z = 0; z < 3; ++z)
        for (unsigned y = 0; y < 2; ++y)
          for (unsigned x = 0; x < 4; ++x) {
            const unsigned id = (by * 3 + bx) * per_block + (z * 2 + y) * 4 + x;
            const std::vector<unsigned> want{x, y, z, bx, by, 0};
            EXPECT_EQ(std::vector<unsigned>(out.begin() + 6 * id, out.begin() + 6 * id + 6), want);
          }
}

TEST(CudaEmu, InvalidConfigurationsAreRefused) {
  EXPECT_EQ(configured(1025, 0), cudaErrorInvalidConfiguration);
  EXPECT_EQ(last_report().fault, Fault::kBadConfig);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // the launcher took the error
  EXPECT_EQ(configured(128, 300 * 1024), cudaErrorInvalidConfiguration);
  EXPECT_EQ(configured(1024, 100 * 1024), cudaSuccess);
  EXPECT_EQ(configured(33, 0), cudaSuccess);  // a partial last warp
}

// A device loads every kernel at set-up; with require_loaded on, a kernel never loaded is refused
// (on a GPU its module would load at its first launch, mid-call). Launches are counted, refused
// ones too.
TEST(CudaEmu, LaunchesOfKernelsNeverLoadedAreRefused) {
  require_loaded(true);
  const uint64_t before = launches();
  EXPECT_EQ(configured(32, 0), cudaErrorLaunchFailure);
  EXPECT_EQ(last_report().fault, Fault::kNotLoaded);
  EXPECT_NE(last_report().message.find("configured_kernel"), std::string::npos);
  ASSERT_EQ(load_configured(), cudaSuccess);
  EXPECT_EQ(configured(32, 0), cudaSuccess) << last_report().message;
  require_loaded(false);
  EXPECT_EQ(launches() - before, 2u);
}

// ---- block order: the order in which a launch runs its blocks ---------------------------------
using dq::emu::BlockOrder;
using dq::emu::BlockOrdering;

// Restores blockIdx order when a test ends, so later tests of this process run as before.
struct OrderScope {
  explicit OrderScope(const BlockOrdering& o) { dq::emu::set_block_order(o); }
  ~OrderScope() { dq::emu::set_block_order(BlockOrdering{}); }
};

// The shuffle exactly as EMULATION.md documents it, written again here from the text, so the
// emulator's generator cannot change without this test noticing (a seed must keep reproducing).
std::vector<uint64_t> documented_shuffle(uint64_t seed, uint64_t n, uint64_t launch) {
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  std::vector<uint64_t> p(n);
  std::iota(p.begin(), p.end(), uint64_t{0});
  uint64_t state = seed ^ mix(launch);
  for (uint64_t i = n - 1; i >= 1 && n > 1; --i) {
    state += 0x9E3779B97F4A7C15ull;
    std::swap(p[i], p[mix(state) % (i + 1)]);
  }
  return p;
}

// The blocks of one launch in the order they ran (their linear numbers), checked to be every
// block exactly once.
std::vector<uint64_t> ran_order(dim3 grid) {
  const unsigned n = grid.x * grid.y * grid.z;
  unsigned taken = 0;
  std::vector<unsigned> ran(n, 0xFFFFFFFFu);
  EXPECT_EQ(block_order(grid, &taken, ran.data()), cudaSuccess) << last_report().message;
  EXPECT_EQ(taken, n);
  EXPECT_EQ(dq::emu::last_counters().blocks, n);
  std::vector<unsigned> sorted = ran;
  std::sort(sorted.begin(), sorted.end());
  for (unsigned b = 0; b < n; ++b) EXPECT_EQ(sorted[b], b) << "every block once";
  return std::vector<uint64_t>(ran.begin(), ran.end());
}

TEST(CudaEmuBlockOrder, EveryOrderRunsEveryBlockOnceInItsSequence) {
  for (const dim3 grid : {dim3(1), dim3(7), dim3(100), dim3(4, 3, 2)}) {
    const uint64_t n = uint64_t{grid.x} * grid.y * grid.z;
    std::vector<uint64_t> index(n), reverse(n);
    std::iota(index.begin(), index.end(), uint64_t{0});
    std::iota(reverse.rbegin(), reverse.rend(), uint64_t{0});
    {
      OrderScope scope(BlockOrdering{BlockOrder::kIndex, 0});
      EXPECT_EQ(ran_order(grid), index);
    }
    {
      OrderScope scope(BlockOrdering{BlockOrder::kReverse, 0});
      EXPECT_EQ(ran_order(grid), reverse);
    }
    for (uint64_t seed : {1ull, 2ull, 0xFFFFFFFFFFFFFFFFull}) {
      OrderScope scope(BlockOrdering{BlockOrder::kShuffle, seed});
      // Setting the order restarts the launch numbering: the launches are 0, 1, 2 here.
      for (uint64_t launch = 0; launch < 3; ++launch)
        EXPECT_EQ(ran_order(grid), documented_shuffle(seed, n, launch))
            << "seed " << seed << " launch " << launch << " of " << n << " blocks";
    }
  }
}

TEST(CudaEmuBlockOrder, ShufflesDependOnTheSeedAndTheLaunch) {
  const uint64_t n = 100;
  std::vector<uint64_t> index(n);
  std::iota(index.begin(), index.end(), uint64_t{0});
  const BlockOrdering one{BlockOrder::kShuffle, 1}, two{BlockOrder::kShuffle, 2};
  const std::vector<uint64_t> a = dq::emu::block_sequence(one, n, 0);
  EXPECT_EQ(a, dq::emu::block_sequence(one, n, 0));  // reproducible
  EXPECT_NE(a, index);
  EXPECT_NE(a, dq::emu::block_sequence(two, n, 0));
  EXPECT_NE(a, dq::emu::block_sequence(one, n, 1));
  // Two launches of one process run different permutations.
  OrderScope scope(one);
  EXPECT_NE(ran_order(dim3(n)), ran_order(dim3(n)));
}

TEST(CudaEmuBlockOrder, BadOrdersAreRefusedByName) {
  BlockOrdering o;
  std::string error;
  for (const char* bad :
       {"", "sideways", "Reverse", "index ", "shuffle", "shuffle:", "shuffle:x", "shuffle:-1",
        "shuffle:+1", "shuffle:1x", "shuffle:18446744073709551616"}) {
    error.clear();
    EXPECT_FALSE(dq::emu::parse_block_order(bad, &o, &error)) << bad;
    EXPECT_NE(error.find(std::string("\"") + bad + "\""), std::string::npos) << error;
  }
  ASSERT_TRUE(dq::emu::parse_block_order("shuffle:18446744073709551615", &o, &error));
  EXPECT_EQ(o.order, BlockOrder::kShuffle);
  EXPECT_EQ(o.seed, 0xFFFFFFFFFFFFFFFFull);
  ASSERT_TRUE(dq::emu::parse_block_order("reverse", &o, &error));
  EXPECT_EQ(o.order, BlockOrder::kReverse);
}

// DQ_EMU_BLOCK_ORDER is read at a process's first launch, so each case runs in a fresh process
// (a "threadsafe" death test re-executes the test binary).
void launch_under_environment(const char* value, bool want_reverse) {
  setenv("DQ_EMU_BLOCK_ORDER", value, 1);
  unsigned taken = 0, ran[3] = {9, 9, 9};
  const cudaError_t e = block_order(dim3(3), &taken, ran);
  if (!want_reverse) {
    const std::string& m = last_report().message;
    const bool named = m.find("DQ_EMU_BLOCK_ORDER") != std::string::npos &&
                       m.find(std::string("\"") + value + "\"") != std::string::npos;
    std::exit(e == cudaErrorInvalidConfiguration && last_report().fault == Fault::kBadConfig &&
                      named && taken == 0
                  ? 0
                  : 1);
  }
  std::exit(e == cudaSuccess && ran[0] == 2 && ran[1] == 1 && ran[2] == 0 ? 0 : 1);
}

TEST(CudaEmuBlockOrderDeathTest, TheEnvironmentSetsTheOrderAndABadValueFailsEveryLaunch) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(launch_under_environment("reverse", true), testing::ExitedWithCode(0), "");
  EXPECT_EXIT(launch_under_environment("shuffle:seven", false), testing::ExitedWithCode(0),
              "DQ_EMU_BLOCK_ORDER");
}

// The defects the orders exist to expose. A hand-off to "the last block" by ticket is right in
// every order; one that takes block gridDim.x - 1 for the last is right only when the order makes
// it so. A chain whose links follow tickets never waits; one that follows blockIdx waits for a
// block that has not run, and its first missed poll (poll_missed) is a fault, not a long spin.
TEST(CudaEmuBlockOrder, HandOffsByIndexFailOutOfIndexOrder) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP()
      << "its by-index launches race on purpose; in this build CudaEmuRaceDeathTest "
         "checks that ThreadSanitizer reports them, and CudaEmuRace runs the by-ticket ones";
#endif
  const int n = 16;
  const unsigned want = n * (n + 1) / 2;
  const BlockOrdering orders[] = {{BlockOrder::kIndex, 0},
                                  {BlockOrder::kReverse, 0},
                                  {BlockOrder::kShuffle, 1},
                                  {BlockOrder::kShuffle, 2}};
  for (const BlockOrdering& o : orders) {
    OrderScope scope(o);
    for (uint64_t launch = 0; launch < 2; ++launch) {  // the launches' numbers since the order
      const bool by_ticket = launch == 0;
      const std::vector<uint64_t> seq = dq::emu::block_sequence(o, n, launch);
      std::vector<unsigned> parts(n, 0);
      unsigned ticket = 0, total = 0;
      ASSERT_EQ(hand_off(n, by_ticket, parts.data(), &ticket, &total), cudaSuccess);
      // By index, block n - 1 sums the parts of the blocks that ran before it and its own.
      unsigned by_index = 0;
      for (uint64_t b : seq) {
        by_index += static_cast<unsigned>(b) + 1;
        if (b == n - 1) break;
      }
      EXPECT_EQ(total, by_ticket ? want : by_index) << dq::emu::block_order_name(o);
      if (o.order == BlockOrder::kIndex || by_ticket) {
        EXPECT_EQ(total, want);
      } else if (o.order == BlockOrder::kReverse) {
        EXPECT_EQ(total, unsigned{n});
      }
    }
    for (bool by_ticket : {true, false}) {
      std::vector<unsigned> done(n, 0);
      unsigned ticket = 0, timeouts = 0;
      const cudaError_t e = chain(n, by_ticket, 1000, &ticket, done.data(), &timeouts);
      EXPECT_EQ(timeouts, 0u);
      std::vector<uint64_t> index(n);
      std::iota(index.begin(), index.end(), uint64_t{0});
      if (by_ticket || dq::emu::block_sequence(o, n, 2 + (by_ticket ? 0 : 1)) == index) {
        EXPECT_EQ(e, cudaSuccess) << last_report().message;
        continue;
      }
      EXPECT_EQ(e, cudaErrorLaunchFailure);
      EXPECT_EQ(last_report().fault, Fault::kDeadlock);
      const std::string& m = last_report().message;
      EXPECT_NE(m.find("polled at"), std::string::npos) << m;
      EXPECT_NE(m.find("emu_kernels.cu:"), std::string::npos) << m;
      EXPECT_NE(m.find("block order " + dq::emu::block_order_name(o)), std::string::npos) << m;
    }
  }
}

// ---- thread order: the order in which released threads run -------------------------------------

// Restores the index thread order when a test ends.
struct ThreadOrderScope {
  explicit ThreadOrderScope(const BlockOrdering& o) { dq::emu::set_thread_order(o); }
  ~ThreadOrderScope() { dq::emu::set_thread_order(BlockOrdering{}); }
};

// The three rounds of thread_order() for `threads` threads, each checked to be every thread once.
std::vector<std::vector<unsigned>> rounds_run(int threads) {
  unsigned taken[3] = {0, 0, 0};
  std::vector<unsigned> ran(3 * threads, 0xFFFFFFFFu);
  EXPECT_EQ(thread_order(threads, taken, ran.data()), cudaSuccess) << last_report().message;
  std::vector<std::vector<unsigned>> rounds;
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(taken[r], static_cast<unsigned>(threads));
    rounds.emplace_back(ran.begin() + r * threads, ran.begin() + (r + 1) * threads);
    std::vector<unsigned> sorted = rounds.back();
    std::sort(sorted.begin(), sorted.end());
    for (int t = 0; t < threads; ++t)
      EXPECT_EQ(sorted[t], static_cast<unsigned>(t)) << "round " << r;
  }
  return rounds;
}

TEST(CudaEmuThreadOrder, ReleasedThreadsRunInTheOrderAsked) {
  const int n = 64;  // two warps
  std::vector<unsigned> index(n), reverse(n);
  std::iota(index.begin(), index.end(), 0u);
  std::iota(reverse.rbegin(), reverse.rend(), 0u);
  {
    ThreadOrderScope scope(BlockOrdering{BlockOrder::kIndex, 0});
    const auto r = rounds_run(n);
    EXPECT_EQ(r[0], index);
    // The thread that completes a barrier or a warp's collective carries on first.
    std::vector<unsigned> after_barrier = {63};
    for (unsigned t = 0; t < 63; ++t) after_barrier.push_back(t);
    EXPECT_EQ(r[1], after_barrier);
  }
  {
    ThreadOrderScope scope(BlockOrdering{BlockOrder::kReverse, 0});
    const auto r = rounds_run(n);
    EXPECT_EQ(r[0], reverse);
    EXPECT_EQ(r[1], reverse);
    EXPECT_EQ(r[2], reverse);  // warp 1's lanes 63..32 released first, then warp 0's
  }
  std::vector<std::vector<unsigned>> shuffles[2];
  for (uint64_t seed : {1ull, 2ull}) {
    ThreadOrderScope scope(BlockOrdering{BlockOrder::kShuffle, seed});
    dq::emu::set_block_order(BlockOrdering{});  // restarts the launch numbering: launch 0 again
    const auto r = rounds_run(n);
    for (const auto& round : r) {
      EXPECT_NE(round, index) << "seed " << seed;
      EXPECT_NE(round, reverse) << "seed " << seed;
    }
    EXPECT_NE(r[0], r[1]) << "each release draws its own order";
    shuffles[seed - 1] = r;
    dq::emu::set_block_order(BlockOrdering{});
    EXPECT_EQ(rounds_run(n), r) << "seed " << seed << " reproduces";
  }
  EXPECT_NE(shuffles[0], shuffles[1]);
}

// The defect the orders exist to expose: a read of another thread's shared word with no barrier
// after its write. Index order hides it for every reader but the last; reverse order shows it to
// every reader; with the barrier every order gives the same, right result.
TEST(CudaEmuThreadOrder, AMissingBarrierChangesTheResultOutOfIndexOrder) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "its launches race on purpose; in this build CudaEmuRaceDeathTest checks that "
                  "ThreadSanitizer reports them";
#endif
  const int n = 64;
  std::vector<unsigned> right(n);
  for (int k = 0; k < n; ++k) right[k] = 100 + (k + 1) % n;
  std::vector<unsigned> by_order[3];
  const BlockOrdering orders[3] = {
      {BlockOrder::kIndex, 0}, {BlockOrder::kReverse, 0}, {BlockOrder::kShuffle, 7}};
  for (int o = 0; o < 3; ++o) {
    ThreadOrderScope scope(orders[o]);
    std::vector<unsigned> out(n, 0);
    ASSERT_EQ(neighbour_race(n, true, out.data()), cudaSuccess) << last_report().message;
    EXPECT_EQ(out, right) << dq::emu::block_order_name(orders[o]);
    by_order[o].assign(n, 0);
    ASSERT_EQ(neighbour_race(n, false, by_order[o].data()), cudaSuccess);
  }
  // Index: thread k < 62 reads thread k + 1's word before k + 1 runs (thread 63 ran first).
  for (int k = 0; k < n - 2; ++k) EXPECT_EQ(by_order[0][k], static_cast<unsigned>(k + 1)) << k;
  // Reverse: thread k + 1 wrote before thread k reads, for every k but the last.
  for (int k = 0; k < n - 1; ++k) EXPECT_EQ(by_order[1][k], right[k]) << k;
  EXPECT_NE(by_order[0], by_order[1]);
  EXPECT_NE(by_order[2], by_order[0]);
  EXPECT_NE(by_order[2], by_order[1]);
}

// ThreadSanitizer's view of the emulated threads (EMULATION.md, "ThreadSanitizer"): in the TSan
// build every thread is a fiber and only a __syncthreads, a __syncwarp and a block's start and end
// order memory, so an access no barrier orders is a reported race whatever order the threads ran
// in. Elsewhere nothing detects races: the racy launches are skipped.
TEST(CudaEmuRace, AccessesOrderedByABarrierAreNotReported) {
  std::vector<unsigned> out(64, 0), right(64);
  for (int k = 0; k < 64; ++k) right[k] = 100 + (k + 1) % 64;
  ASSERT_EQ(neighbour_race(64, true, out.data()), cudaSuccess) << last_report().message;
  EXPECT_EQ(out, right);
  std::vector<unsigned> lanes(32, 0), right_lanes(32);
  for (int k = 0; k < 32; ++k) right_lanes[k] = 100 + (k + 1) % 32;
  ASSERT_EQ(warp_neighbour(1, lanes.data()), cudaSuccess) << last_report().message;
  EXPECT_EQ(lanes, right_lanes);
}

// Between blocks only a __threadfence with an atomic orders memory: a part written before a
// fence and a ticket, read by the block that takes the last ticket after a fence of its own. In
// every block order, and in the TSan build with every block on threads of its own.
TEST(CudaEmuRace, HandOffsThroughAFencedTicketAreNotReported) {
  const int n = 16;
  const BlockOrdering orders[] = {
      {BlockOrder::kIndex, 0}, {BlockOrder::kReverse, 0}, {BlockOrder::kShuffle, 3}};
  for (const BlockOrdering& o : orders) {
    OrderScope scope(o);
    std::vector<unsigned> parts(n, 0);
    unsigned ticket = 0, total = 0;
    ASSERT_EQ(hand_off(n, true, parts.data(), &ticket, &total), cudaSuccess);
    EXPECT_EQ(total, unsigned{n * (n + 1) / 2}) << dq::emu::block_order_name(o);
    std::vector<unsigned> done(n, 0);
    unsigned timeouts = 0;
    ticket = 0;
    ASSERT_EQ(chain(n, true, 1000, &ticket, done.data(), &timeouts), cudaSuccess)
        << last_report().message;
    EXPECT_EQ(done, std::vector<unsigned>(n, 1u)) << dq::emu::block_order_name(o);
    EXPECT_EQ(timeouts, 0u);
  }
}

// The TSan build keeps the words a thread read atomically until its next fence, at most 256 of
// them: more is a fault naming the thread, not an ordering silently dropped. Elsewhere no limit.
TEST(CudaEmuRace, OverTheAtomicReadsAFenceCanHoldIsAFaultInTheTsanBuild) {
  std::vector<unsigned> words(257);
  std::iota(words.begin(), words.end(), 1u);
  unsigned sum = 0;
  ASSERT_EQ(relaxed_reads(words.data(), 256, &sum), cudaSuccess) << last_report().message;
  EXPECT_EQ(sum, 256u * 257u / 2u);
  const cudaError_t e = relaxed_reads(words.data(), 257, &sum);
#if defined(__SANITIZE_THREAD__)
  EXPECT_EQ(e, cudaErrorLaunchFailure);
  EXPECT_EQ(last_report().fault, Fault::kTsanLimit);
  EXPECT_NE(last_report().message.find("thread 0"), std::string::npos) << last_report().message;
  EXPECT_NE(last_report().message.find("over 256 words"), std::string::npos)
      << last_report().message;
#else
  EXPECT_EQ(e, cudaSuccess) << last_report().message;
  EXPECT_EQ(sum, 257u * 258u / 2u);
#endif
}

// Two launches from two host threads, as two streams' kernels are launched by the emulated
// device's stream threads: the second starts after the first returned, seen through a flag that
// either orders memory (release / acquire: an event between the streams) or does not (relaxed:
// no event). Both fill the same 64 words; returns them.
std::vector<unsigned> fill_from_two_threads(bool ordered) {
  std::vector<unsigned> words(64, 0);
  std::atomic<int> stage{0};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  auto wait_for = [&](int value, std::memory_order order) {
    while (stage.load(order) < value && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
  };
  // The first thread outlives the second launch, as a stream's worker does: TSan reuses a
  // finished thread's number, and would take the first launch's accesses for the second's own.
  std::thread first([&] {
    EXPECT_EQ(fill_words(words.data(), 64, 7), cudaSuccess);
    stage.store(1, ordered ? std::memory_order_release : std::memory_order_relaxed);
    wait_for(2, std::memory_order_relaxed);
  });
  wait_for(1, ordered ? std::memory_order_acquire : std::memory_order_relaxed);
  EXPECT_EQ(fill_words(words.data(), 64, 9), cudaSuccess);
  stage.store(2, std::memory_order_relaxed);
  first.join();
  return words;
}

// On a GPU two streams' kernels run at once unless an event orders them; the emulator runs one
// launch at a time, but in the TSan build orders two host threads' launches only by what the
// threads themselves order.
TEST(CudaEmuRace, LaunchesOrderedBetweenHostThreadsAreNotReported) {
  EXPECT_EQ(fill_from_two_threads(true), std::vector<unsigned>(64, 9u));
}

TEST(CudaEmuRaceDeathTest, AnUnorderedAccessIsReportedInTheTsanBuild) {
#if !defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "races are detected in the ThreadSanitizer build only";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // 66: TSan's exit status after a report (at the report with halt_on_error=1, else at exit).
  std::vector<unsigned> out(64, 0);
  EXPECT_EXIT(
      {
        neighbour_race(64, false, out.data());
        std::exit(0);
      },
      testing::ExitedWithCode(66), "ThreadSanitizer: data race(.|\n)*neighbour_race_kernel");
  for (int ordering : {0, 2})
    EXPECT_EXIT(
        {
          warp_neighbour(ordering, out.data());
          std::exit(0);
        },
        testing::ExitedWithCode(66), "ThreadSanitizer: data race(.|\n)*warp_neighbour_kernel")
        << "ordering " << ordering;
  // Between blocks, in index order (where the sum comes out right): the last block by index
  // instead of by ticket, or either side's fence left out.
  struct HandOff {
    bool by_ticket;
    int fences;
  };
  for (const HandOff h : {HandOff{false, 3}, HandOff{true, 1}, HandOff{true, 2}})
    EXPECT_EXIT(
        {
          std::vector<unsigned> parts(16, 0);
          std::vector<unsigned> ticket_total(2, 0);
          hand_off(16, h.by_ticket, parts.data(), &ticket_total[0], &ticket_total[1], h.fences);
          std::exit(0);
        },
        testing::ExitedWithCode(66), "ThreadSanitizer: data race(.|\n)*hand_off_kernel")
        << "by ticket " << h.by_ticket << ", fences " << h.fences;
  // Two host threads' launches (two streams' kernels) with nothing ordering them.
  EXPECT_EXIT(
      {
        fill_from_two_threads(false);
        std::exit(0);
      },
      testing::ExitedWithCode(66), "ThreadSanitizer: data race(.|\n)*fill_words_kernel");
#endif
}

TEST(CudaEmuThreadOrder, BadOrdersAreRefusedByName) {
  BlockOrdering o;
  std::string error;
  EXPECT_FALSE(dq::emu::parse_thread_order("backwards", &o, &error));
  EXPECT_NE(error.find("thread order \"backwards\""), std::string::npos) << error;
  ASSERT_TRUE(dq::emu::parse_thread_order("shuffle:3", &o, &error));
  EXPECT_EQ(o.order, BlockOrder::kShuffle);
  EXPECT_EQ(o.seed, 3u);
}

// DQ_EMU_THREAD_ORDER is read at a process's first launch: each case in a fresh process.
void thread_order_under_environment(const char* value, bool valid) {
  setenv("DQ_EMU_THREAD_ORDER", value, 1);
  unsigned taken[3] = {0, 0, 0}, ran[3 * 32];
  const cudaError_t e = thread_order(32, taken, ran);
  if (!valid) {
    const std::string& m = last_report().message;
    std::exit(e == cudaErrorInvalidConfiguration && last_report().fault == Fault::kBadConfig &&
                      m.find("DQ_EMU_THREAD_ORDER") != std::string::npos &&
                      m.find(std::string("\"") + value + "\"") != std::string::npos && taken[0] == 0
                  ? 0
                  : 1);
  }
  std::exit(e == cudaSuccess && ran[0] == 31 && ran[31] == 0 ? 0 : 1);
}

TEST(CudaEmuThreadOrderDeathTest, TheEnvironmentSetsTheOrderAndABadValueFailsEveryLaunch) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(thread_order_under_environment("reverse", true), testing::ExitedWithCode(0), "");
  EXPECT_EXIT(thread_order_under_environment("shuffle:", false), testing::ExitedWithCode(0),
              "DQ_EMU_THREAD_ORDER");
}

// Throughput of the emulator, per second of this process's CPU time (the machines are shared, so
// wall time says little); printed, and the limit only catches a pathological slowdown.
double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The accessors count every byte once per access, and block_copy_to_shared() reads exactly the n
// bytes asked for (16-byte vectors in the aligned middle, bytes at the ends) at any alignment.
TEST(CudaEmu, GlobalTrafficIsCountedAndCopiesReadEachByteOnce) {
  std::vector<uint8_t> src(600), dst(600);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 37 + 11);
  // A 16-byte aligned base, so `misalign` is the source's offset modulo 16.
  const uintptr_t base = (reinterpret_cast<uintptr_t>(src.data()) + 15) & ~uintptr_t{15};
  for (int threads : {32, 256})
    for (int misalign = 0; misalign < 16; ++misalign)
      for (int n : {0, 1, 5, 15, 16, 17, 33, 100, 274, 512}) {
        const uint8_t* from = reinterpret_cast<const uint8_t*>(base) + misalign;
        std::fill(dst.begin(), dst.end(), 0xEE);
        ASSERT_EQ(copy_through_shared(from, n, dst.data(), threads), cudaSuccess)
            << last_report().message;
        ASSERT_EQ(std::memcmp(dst.data(), from, n), 0) << "misalign " << misalign << " n " << n;
        ASSERT_EQ(dst[n], 0xEE);
        EXPECT_EQ(dq::emu::last_counters().global_read, static_cast<uint64_t>(n))
            << "misalign " << misalign << " n " << n;
        EXPECT_EQ(dq::emu::last_counters().global_written, static_cast<uint64_t>(n));
      }
}

// CUDA refuses a vector access at an address its size does not divide (x86 would not notice): a
// kernel that takes a 16-byte path for a pointer it has not checked fails here as on a GPU.
TEST(CudaEmu, MisalignedVectorLoadsAreRefused) {
  alignas(16) uint8_t src[64];
  for (int b = 0; b < 64; ++b) src[b] = static_cast<uint8_t>(b);
  uint4 out{};
  for (int misalign : {0, 16, 1, 4, 8, 12})
    if (misalign % 16 == 0) {
      ASSERT_EQ(vector_load(src + misalign, &out), cudaSuccess) << last_report().message;
      EXPECT_EQ(out.x, 0x03020100u + 0x10101010u * static_cast<uint32_t>(misalign / 16));
    } else {
      EXPECT_EQ(vector_load(src + misalign, &out), cudaErrorLaunchFailure) << misalign;
      EXPECT_EQ(last_report().fault, Fault::kMisaligned) << misalign;
      EXPECT_NE(last_report().message.find("not a multiple of its type's alignment, 16 bytes"),
                std::string::npos)
          << last_report().message;
    }
}

// Prints the emulator's throughput per second of process CPU time (kernels/cuda/EMULATION.md,
// "Speed"), and checks what it counted and computed. No speed floor: a unit test's timing fails
// on a loaded machine (a floor of 0.2 M barriers/s failed CI's TSan leg at 0.195 M, two tests
// at once); CI's duration is where a slower emulator shows.
TEST(CudaEmu, Speed) {
  const int blocks = 4, threads = 256, iterations = 500;
  double t0 = cpu_seconds();
  ASSERT_EQ(barrier_loop(blocks, threads, iterations), cudaSuccess) << last_report().message;
  const double s = cpu_seconds() - t0;
  const double barriers = static_cast<double>(dq::emu::last_counters().barriers);
  EXPECT_EQ(barriers, double{blocks} * threads * iterations);
  std::vector<int> out(blocks * threads);
  t0 = cpu_seconds();
  ASSERT_EQ(shuffle_loop(blocks, threads, iterations, out.data()), cudaSuccess)
      << last_report().message;
  const double s2 = cpu_seconds() - t0;
  const double shuffles = static_cast<double>(dq::emu::last_counters().collectives);
  EXPECT_EQ(shuffles, double{blocks} * threads * iterations);
  // Each warp's lanes as the kernel leaves them: v += v[lane ^ (1 + i % 31)], wrapping.
  for (int warp = 0; warp < blocks * threads / 32; ++warp) {
    unsigned v[32];
    for (int lane = 0; lane < 32; ++lane)
      v[lane] = static_cast<unsigned>((warp * 32 + lane) % threads);
    for (int i = 0; i < iterations; ++i) {
      unsigned next[32];
      for (int lane = 0; lane < 32; ++lane) next[lane] = v[lane] + v[lane ^ (1 + i % 31)];
      std::copy(next, next + 32, v);
    }
    for (int lane = 0; lane < 32; ++lane)
      ASSERT_EQ(out[static_cast<size_t>(warp * 32 + lane)], static_cast<int>(v[lane]))
          << "warp " << warp << " lane " << lane;
  }
  std::printf(
      "emulator: %.1f M thread-barriers/s, %.1f M lane-shuffles/s of CPU time (%d threads x %d "
      "blocks)\n",
      barriers / s / 1e6, shuffles / s2 / 1e6, threads, blocks);
}

}  // namespace
}  // namespace dq::cuda::selftest
