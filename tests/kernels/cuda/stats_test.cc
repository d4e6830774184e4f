// kernels/cuda/stats.cu under the CUDA emulation against the host codec's statistics
// (DynamiqCodec::local_stats), word for word (a NaN word only as a NaN): FP32 and BF16 inputs,
// counts that leave a partial last super-group and a partial last tile, zeros, denormals,
// overflowing squares, NaN / Inf (poisoned super-groups), one block to many blocks, and worker
// counts that pack 8, 4, 2 and 1 all-zero counts a word.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "kernels/cuda/stats.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_layout.h"
#include "tests/kernels/cuda/device_buffers.h"

namespace dq::cuda {
namespace {

using test::DeviceArray;
using test::kernel_fault;

// Values of super-group j drawn from one of several regimes, so that every path of the
// arithmetic is met: plain, tiny, denormal, huge (squares overflow), zeros, NaN and Inf.
std::vector<float> make_values(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(count);
  for (size_t base = 0; base < count; base += 256) {
    const int regime = static_cast<int>(rng() % 9);
    const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
    for (size_t i = base; i < std::min(count, base + 256); ++i) {
      float v = normal(rng) * scale;
      switch (regime) {
        case 1:
          v = 0.0f;
          break;
        case 2:
          v = normal(rng) * 1e-39f;
          break;  // denormals
        case 3:
          v = normal(rng) * 1e37f;
          break;  // sum of squares overflows
        case 4:
          v = (rng() % 2) ? 3.0e38f : -3.0e38f;
          break;  // the sum itself overflows
        case 5:
          if (rng() % 64 == 0) v = std::numeric_limits<float>::quiet_NaN();
          break;
        case 6:
          if (rng() % 64 == 0) v = (rng() % 2) ? INFINITY : -INFINITY;
          break;
        case 7:
          v = (rng() % 2) ? -0.0f : 0.0f;
          break;
        default:
          break;
      }
      x[i] = v;
    }
  }
  return x;
}

// Worker counts whose all-zero counts pack 8, 4, 2, 2 and 1 to a word, then 2 bytes a word (40,
// 255) and a BF16 word each again (256).
const int kWorkerCounts[] = {1, 3, 5, 15, 16, 40, 255, 256};

std::vector<uint16_t> host_stats(const void* x, DType dtype, size_t count, int workers = 1) {
  auto codec = make_dynamiq_codec(DynamiqOptions{});
  EXPECT_EQ(codec->plan(count, 1, workers), Status::kOk);
  std::vector<uint16_t> stats(codec->stats_words(), 0x1234);
  EXPECT_EQ(codec->local_stats(ConstTensor{x, dtype, count}, stats.data()), Status::kOk);
  return stats;
}

bool is_nan(uint16_t w) {
  return (w & 0x7fffu) > 0x7f80u;
}

// Word for word, except that any NaN equals any NaN: which operand's payload and sign a NaN sum
// carries depends on the order the compiler puts the operands of a commutative add in (x86 keeps
// the first's), so even two host builds may differ there, and a GPU returns the canonical NaN.
// Every other word, Inf and -0 included, must be identical.
void expect_same(const std::vector<uint16_t>& host, const std::vector<uint16_t>& dev,
                 const char* what, size_t count, int blocks, int workers = 1) {
  ASSERT_EQ(host.size(), dev.size());
  const size_t pairs = kStatPairWords * ((count + 255) / 256);
  for (size_t i = 0; i < host.size(); ++i) {
    if (is_nan(host[i]) && is_nan(dev[i])) continue;
    if (i < pairs)
      ASSERT_EQ(host[i], dev[i]) << what << " count " << count << " blocks " << blocks
                                 << " workers " << workers << ": super-group " << i / kStatPairWords
                                 << " word " << i % kStatPairWords;
    else
      ASSERT_EQ(host[i], dev[i]) << what << " count " << count << " blocks " << blocks
                                 << " workers " << workers << ": all-zero count word " << i - pairs;
  }
}

const size_t kCounts[] = {
    0, 1, 2, 15, 16, 17, 255, 256, 257, 511, 4095, 4096, 4097, 3 * 4096 + 1000, 40000};

// The kernel's statistics of x (device copies of x and of the output, as the kernel sees them).
template <class T>
cudaError_t device_stats(const std::vector<T>& x, bool bf16, std::vector<uint16_t>* dev, int blocks,
                         int workers = 1) {
  const DeviceArray<T> d_x(x);
  const DeviceArray<uint16_t> d_stats(*dev);
  const cudaError_t e =
      launch_supergroup_stats(d_x.get(), bf16, x.size(), workers, d_stats.get(), nullptr, blocks);
  return e != cudaSuccess ? e : d_stats.fetch(*dev);
}

// A lane that failed before the step: the error word is already set when the kernel starts, so
// not one statistics word is written (the output keeps its sentinel), on one block and many.
TEST(CudaStats, PresetErrorWordWritesNothing) {
  for (size_t count : {size_t{257}, size_t{40000}})
    for (int blocks : {1, 0}) {
      const std::vector<float> x = make_values(count, 7);
      std::vector<uint16_t> dev(stats_words((count + 255) / 256, 1), 0xBEEF);
      unsigned error = 2;  // any failure before this step
      const DeviceArray<float> d_x(x);
      const DeviceArray<uint16_t> d_stats(dev);
      const DeviceArray<unsigned> d_error(&error, 1);
      ASSERT_EQ(launch_supergroup_stats(d_x.get(), false, count, 1, d_stats.get(), nullptr, blocks,
                                        d_error.get()),
                cudaSuccess)
          << kernel_fault();
      ASSERT_EQ(d_stats.fetch(dev), cudaSuccess);
      ASSERT_EQ(d_error.fetch(&error), cudaSuccess);
      EXPECT_EQ(error, 2u) << "the kernel raises no flags of its own";
      for (size_t i = 0; i < dev.size(); ++i)
        ASSERT_EQ(dev[i], 0xBEEF) << "count " << count << " word " << i;
      // A clear word: the same launch writes every word.
      error = 0;
      const DeviceArray<unsigned> d_clear(&error, 1);
      ASSERT_EQ(launch_supergroup_stats(d_x.get(), false, count, 1, d_stats.get(), nullptr, blocks,
                                        d_clear.get()),
                cudaSuccess);
      ASSERT_EQ(d_stats.fetch(dev), cudaSuccess);
      expect_same(host_stats(x.data(), DType::kF32, count), dev, "clear word", count, blocks);
    }
}

TEST(CudaStats, Fp32MatchesHostByteForByte) {
  uint32_t seed = 1;
  for (size_t count : kCounts)
    for (int blocks : {1, 3, 0}) {
      const std::vector<float> x = make_values(count, seed++);
      for (int workers : kWorkerCounts) {
        const std::vector<uint16_t> host = host_stats(x.data(), DType::kF32, count, workers);
        std::vector<uint16_t> dev(host.size(), 0xBEEF);
        ASSERT_EQ(device_stats(x, false, &dev, blocks, workers), cudaSuccess) << kernel_fault();
        expect_same(host, dev, "fp32", count, blocks, workers);
      }
    }
}

TEST(CudaStats, Bf16MatchesHostByteForByte) {
  uint32_t seed = 100;
  for (size_t count : kCounts)
    for (int blocks : {1, 2, 0}) {
      const std::vector<float> f = make_values(count, seed++);
      std::vector<uint16_t> x(count);
      for (size_t i = 0; i < count; ++i) x[i] = f32_to_bf16_rne(f[i]);
      for (int workers : kWorkerCounts) {
        const std::vector<uint16_t> host = host_stats(x.data(), DType::kBF16, count, workers);
        std::vector<uint16_t> dev(host.size(), 0xBEEF);
        ASSERT_EQ(device_stats(x, true, &dev, blocks, workers), cudaSuccess) << kernel_fault();
        expect_same(host, dev, "bf16", count, blocks, workers);
      }
    }
}

// Random bit patterns: every exponent, signalling and quiet NaNs, infinities.
TEST(CudaStats, Bf16RandomBitPatterns) {
  std::mt19937 rng(5);
  const size_t count = 5000;
  std::vector<uint16_t> x(count);
  for (auto& w : x) w = static_cast<uint16_t>(rng());
  // Keep most super-groups finite so their words are not all NaN.
  for (size_t i = 0; i < count; ++i)
    if ((i / 256) % 3 != 0 && (x[i] & 0x7f80u) == 0x7f80u) x[i] &= 0xbfffu;
  const std::vector<uint16_t> host = host_stats(x.data(), DType::kBF16, count);
  std::vector<uint16_t> dev(host.size(), 0xBEEF);
  ASSERT_EQ(device_stats(x, true, &dev, 0), cudaSuccess) << kernel_fault();
  expect_same(host, dev, "bf16 bits", count, 0);
}

TEST(CudaStats, PoisonedSuperGroupsStayNonFinite) {
  std::vector<float> x(1000, 1.0f);
  x[300] = std::numeric_limits<float>::quiet_NaN();
  x[600] = INFINITY;
  std::vector<uint16_t> dev(stats_words(4, 1));
  ASSERT_EQ(device_stats(x, false, &dev, 0), cudaSuccess) << kernel_fault();
  EXPECT_EQ(dev[stat_word(0, kStatMean)], f32_to_bf16_sat(1.0f));
  EXPECT_TRUE(std::isnan(bf16_to_f32(dev[stat_word(1, kStatMean)])));
  EXPECT_TRUE(std::isinf(bf16_to_f32(dev[stat_word(2, kStatMean)])));
  EXPECT_EQ(summed_all_zero(dev[zero_count_word(4, 1, 1)], 1, 1), 0);  // a NaN is not zero
  expect_same(host_stats(x.data(), DType::kF32, x.size()), dev, "poisoned", x.size(), 0);
}

// The all-zero count: 1 exactly when every value of the super-group is zero (-0 included; a
// denormal, or one non-zero value among zeros, is not zero), the partial last one too; in its
// digit of the packed word, for every packing.
TEST(CudaStats, AllZeroWord) {
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (int workers : kWorkerCounts) {
      std::vector<float> x(5 * 256 + 40, 0.5f);
      for (size_t i = 256; i < 512; ++i) x[i] = i % 2 ? -0.0f : 0.0f;       // all zero
      for (size_t i = 512; i < 768; ++i) x[i] = i == 700 ? 1e-40f : 0.0f;   // one denormal
      for (size_t i = 768; i < 1024; ++i) x[i] = i == 1023 ? -3.0f : 0.0f;  // the last value
      for (size_t i = 1280; i < x.size(); ++i) x[i] = 0.0f;                 // partial, zero
      std::vector<uint16_t> x16(x.size());
      for (size_t i = 0; i < x.size(); ++i) x16[i] = f32_to_bf16_rne(x[i]);
      if (dtype == DType::kBF16) {
        ASSERT_NE(x16[700] & 0x7fffu, 0u);  // the denormal survives
      }
      const void* data = dtype == DType::kF32 ? static_cast<const void*>(x.data()) : x16.data();
      const std::vector<uint16_t> host = host_stats(data, dtype, x.size(), workers);
      const int per = zero_counts_per_word(workers);
      ASSERT_EQ(host.size(), 2 * 6 + (6 + per - 1) / per);
      const uint16_t expected[6] = {0, kBf16One, 0, 0, 0, kBf16One};
      for (size_t j = 0; j < 6; ++j)
        EXPECT_EQ(summed_all_zero(host[zero_count_word(6, j, workers)], j, workers), expected[j])
            << j << " workers " << workers;
      // FORMAT.md's packing: the first word holds super-groups 0 .. per - 1, super-group i's
      // count times 2^(bits i): a BF16 integer, or from 16 to 255 workers two bytes in memory
      // order (super-group 0 in the low byte).
      unsigned word0 = 0;
      for (int i = 0; i < per && i < 6; ++i)
        if (expected[i] != 0) word0 += 1u << (zero_count_bits(workers) * i);
      const uint16_t expected_word0 = zero_counts_are_bytes(workers)
                                          ? static_cast<uint16_t>(word0)
                                          : f32_to_bf16_rne(static_cast<float>(word0));
      EXPECT_EQ(host[zero_count_word(6, 0, workers)], expected_word0) << workers;
      if (zero_counts_are_bytes(workers)) {
        EXPECT_EQ(word0, 1u << 8) << "super-group 1 all zero: the high byte";
      }
      std::vector<uint16_t> dev(host.size(), 0xBEEF);
      if (dtype == DType::kF32)
        ASSERT_EQ(device_stats(x, false, &dev, 0, workers), cudaSuccess) << kernel_fault();
      else
        ASSERT_EQ(device_stats(x16, true, &dev, 0, workers), cudaSuccess) << kernel_fault();
      expect_same(host, dev, "all-zero word", x.size(), 0, workers);
    }
}

// A batch: the codec parts of one call (slices of one input at their offsets, empty ones
// included) in one launch, each part's words exactly the host's statistics of its slice, on one
// block, a few and many; a lane that failed before writes no word of any part.
template <class T>
void expect_batch_matches_host(const std::vector<T>& x, DType dtype, int workers) {
  const bool bf16 = dtype == DType::kBF16;
  // (offset, count): parts of unequal sizes, an empty one between two others, one at the end.
  const std::vector<std::pair<size_t, size_t>> cuts = {
      {0, 4097}, {4097, 0}, {4097, 256}, {4353, 40000}, {44353, 1}, {44354, x.size() - 44354}};
  std::vector<std::vector<uint16_t>> host;
  std::vector<StatsJob> jobs;
  size_t words = 0;
  for (const auto& [offset, count] : cuts) {
    host.push_back(host_stats(x.data() + offset, dtype, count, workers));
    jobs.push_back(StatsJob{offset, count, nullptr, 0});
    words += host.back().size();
  }
  const unsigned long long tiles = stats_batch_tiles(jobs.data(), static_cast<int>(jobs.size()));
  EXPECT_EQ(jobs[2].first_tile, 2u);  // 4097 values: 17 super-groups, 2 tiles; then none
  for (int blocks : {1, 3, 0})
    for (unsigned preset : {0u, 2u}) {
      std::vector<uint16_t> dev(words, 0xBEEF);
      const DeviceArray<T> d_x(x);
      const DeviceArray<uint16_t> d_stats(dev);
      size_t at = 0;
      for (size_t j = 0; j < jobs.size(); ++j) {
        jobs[j].stats = d_stats.get() + at;
        at += host[j].size();
      }
      const DeviceArray<StatsJob> d_jobs(jobs);
      unsigned error = preset;
      const DeviceArray<unsigned> d_error(&error, 1);
#if DQ_CUDA_EMULATED
      const uint64_t launched = emu::launches();
#endif
      ASSERT_EQ(
          launch_supergroup_stats_batch(d_jobs.get(), static_cast<int>(jobs.size()), tiles,
                                        d_x.get(), bf16, workers, nullptr, blocks, d_error.get()),
          cudaSuccess)
          << kernel_fault();
#if DQ_CUDA_EMULATED
      EXPECT_EQ(emu::launches() - launched, 1u) << "every part in one launch";
#endif
      ASSERT_EQ(d_stats.fetch(dev), cudaSuccess);
      ASSERT_EQ(d_error.fetch(&error), cudaSuccess);
      EXPECT_EQ(error, preset) << "the kernel raises no flags of its own";
      at = 0;
      for (size_t j = 0; j < jobs.size(); ++j) {
        const std::vector<uint16_t> part(dev.begin() + static_cast<long>(at),
                                         dev.begin() + static_cast<long>(at + host[j].size()));
        at += host[j].size();
        if (preset != 0) {
          for (size_t i = 0; i < part.size(); ++i)
            ASSERT_EQ(part[i], 0xBEEF) << "part " << j << " word " << i;
        } else {
          expect_same(host[j], part, bf16 ? "bf16 batch" : "fp32 batch", cuts[j].second, blocks,
                      workers);
        }
      }
    }
}

TEST(CudaStats, BatchMatchesHostPartByPart) {
  const std::vector<float> f = make_values(50000, 17);
  std::vector<uint16_t> x16(f.size());
  for (size_t i = 0; i < f.size(); ++i) x16[i] = f32_to_bf16_rne(f[i]);
  for (int workers : {1, 4, 16}) {
    expect_batch_matches_host(f, DType::kF32, workers);
    expect_batch_matches_host(x16, DType::kBF16, workers);
  }
}

}  // namespace
}  // namespace dq::cuda
