// DynamiQ codec tests: each assertion targets a defect that would corrupt or bias a training run.
#include <gtest/gtest.h>

#include <tbb/task_arena.h>
#include <xmmintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/float_env.h"
#include "kernels/bf16.h"
#include "kernels/bitpack.h"
#include "kernels/codec.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_layout.h"
#include "kernels/dynamiq_math.h"
#include "kernels/dynamiq_range.h"
#include "kernels/host_isa.h"
#include "kernels/host_path_check.h"
#include "kernels/parallel.h"
#include "kernels/payload.h"
#include "kernels/philox.h"
#include "kernels/stats_sum.h"

namespace dq {
namespace {

std::unique_ptr<Codec> codec(const char* spec) {
  std::string err;
  auto c = make_codec(spec, &err);
  EXPECT_TRUE(c) << err;
  return c;
}

// Statistics all-reduce as the engine does it: BF16 words summed over ranks, rounded to BF16.
std::vector<uint16_t> reduce_stats(Codec& c, const std::vector<std::vector<float>>& rows) {
  StatsSum sum(c.stats_words(), c.stats_byte_sum_words());
  std::vector<uint16_t> local(c.stats_words());
  for (const auto& r : rows) {
    EXPECT_EQ(c.local_stats({r.data(), DType::kF32, r.size()}, local.data()), Status::kOk);
    sum.add(local.data());
  }
  std::vector<uint16_t> out(c.stats_words());
  sum.result(out.data(), false);
  return out;
}

// Compresses one worker's row as a leaf and decodes it alone (parameter-server view).
std::vector<float> leaf_roundtrip(Codec& c, const std::vector<float>& x, uint32_t rank,
                                  uint32_t n_ranks, uint64_t seed, uint64_t call = 0) {
  std::vector<uint8_t> payload(c.chunk_capacity());
  RoundingKey key{seed, call, rank, rank, n_ranks, 0};  // leaves: one stratum class
  EXPECT_EQ(c.hop(0, {x.data(), DType::kF32, x.size()}, nullptr, 0, payload.data(), key),
            Status::kOk);
  std::vector<float> out(x.size(), -12345.0f);
  EXPECT_EQ(
      c.finish(0, {payload.data(), payload.size()}, out.data(), DType::kF32, ReduceOp::kSum, 1),
      Status::kOk);
  return out;
}

std::vector<float> gaussian(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

TEST(Philox, KnownAnswers) {
  // Random123 known-answer vectors for philox4x32-10.
  Philox4 a = philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(a.v[0], 0x6627e8d5u);
  EXPECT_EQ(a.v[1], 0xe169c58du);
  EXPECT_EQ(a.v[2], 0xbc57ac4cu);
  EXPECT_EQ(a.v[3], 0x9b00dbd8u);
  Philox4 b = philox4x32_10(~0u, ~0u, ~0u, ~0u, ~0u, ~0u);
  EXPECT_EQ(b.v[0], 0x408f276du);
  EXPECT_EQ(b.v[1], 0x41c83b0eu);
  EXPECT_EQ(b.v[2], 0xa20bc7c6u);
  EXPECT_EQ(b.v[3], 0x6d5451fdu);
  Philox4 c =
      philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(c.v[0], 0xd16cfe09u);
  EXPECT_EQ(c.v[1], 0x94fdccebu);
  EXPECT_EQ(c.v[2], 0x5001e420u);
  EXPECT_EQ(c.v[3], 0x24126ea1u);
}

// The host's 8-lane AVX2 Philox must give the scalar (device) function's bits in every lane,
// including where the 32-bit block counter wraps.
TEST(Philox, EightLanesMatchScalar) {
  if (!host_isa_supported(HostIsa::kAvx2)) GTEST_SKIP() << "no AVX2 on this CPU";
  const uint32_t firsts[] = {0u, 1u, 0x12345678u, 0xfffffffcu, 0xfffffff9u};
  for (uint32_t first : firsts)
    for (uint64_t seed : {0ull, 1ull, 0x0123456789abcdefull}) {
      const uint64_t call = seed * 3 + first;
      uint32_t got[4][8];
      ASSERT_TRUE(philox_draw_x8_avx2(seed, call, 5, kStreamRounding, first, got));
      for (uint32_t i = 0; i < 8; ++i) {
        const Philox4 one = philox_draw(seed, call, 5, kStreamRounding, first + i);
        for (int w = 0; w < 4; ++w)
          EXPECT_EQ(got[w][i], one.v[w]) << first << " lane " << i << " word " << w;
      }
    }
}

// The host's AVX2 shuffle (16 groups' permutation positions at once) must give the scalar
// (device) function's position in every lane: small and large strata (the pivot's high-half
// multiply at full 32 bits), every member of a small class, members past strata (taken mod).
TEST(Correlated, LanesMatchScalar) {
  if (!host_isa_supported(HostIsa::kAvx2)) GTEST_SKIP() << "no AVX2 on this CPU";
  std::mt19937 rng(20261206);
  uint32_t keys[16];
  for (uint32_t strata : {1u, 2u, 3u, 4u, 7u, 32u, 255u, 1000u, 65537u, 0x80000001u, 0xffffffffu})
    for (int trial = 0; trial < 64; ++trial) {
      for (uint32_t& k : keys) k = static_cast<uint32_t>(rng());
      if (trial == 0)
        for (uint32_t& k : keys) k = 0xffffffffu - static_cast<uint32_t>(&k - keys);  // wraps
      const uint32_t member =
          strata <= 8 && trial < 8 ? static_cast<uint32_t>(trial) : static_cast<uint32_t>(rng());
      uint32_t got[16];
      ASSERT_TRUE(shuffle_positions_x16_avx2(keys, member, strata, got));
      for (int i = 0; i < 16; ++i)
        ASSERT_EQ(got[i], shuffle_position(keys[i], member, strata))
            << "strata " << strata << " member " << member << " key " << keys[i] << " lane " << i;
    }
}

// Rounding draws 16 random bits per value and a tie word only where those bits leave the
// decision open, so P(up) must equal x even below the 16-bit resolution: 16 bits alone would
// give floor(x * 2^16) / 2^16 (0 for the first x here) or the ceiling (4x).
TEST(Rounding, SixteenBitUniformsWithTieWordsAreUnbiasedBelowTheirResolution) {
  const uint64_t n = uint64_t{1} << 23;
  for (float x : {0.25f * 0x1p-16f, 3.75f * 0x1p-16f, 0.3f, 0.999f}) {
    uint64_t ups = 0, ties = 0;
    for (uint64_t e = 0; e < n; ++e) {
      const uint32_t u16 = rounding_bits16(11, 2, 6, e);
      int up = round_up_coarse(x, u16);
      if (up < 0) {
        ++ties;
        up = round_up_tie(x, u16, rounding_tie_uniform(11, 2, 6, e));
      }
      ups += static_cast<uint64_t>(up);
    }
    const double expect = static_cast<double>(x) * n;
    const double sigma = std::sqrt(expect * (1.0 - x));
    EXPECT_NEAR(static_cast<double>(ups), expect, 5.0 * sigma + 1.0) << "x = " << x;
    EXPECT_NEAR(static_cast<double>(ties), n / 65536.0, 5.0 * std::sqrt(n / 65536.0))
        << "x = " << x;
  }
  // Certain decisions never consume a tie word.
  EXPECT_EQ(round_up_coarse(1.0f, 65535u), 1);
  EXPECT_EQ(round_up_coarse(0.0f, 0u), 0);
  EXPECT_EQ(round_up_coarse(-3.0f, 0u), 0);
  EXPECT_EQ(round_up_coarse(2.0f, 0u), 1);
}

// The 16-bit layout: every (block, word, half) serves exactly one element of a super-group.
TEST(Rounding, EveryElementHasItsOwnSixteenBits) {
  std::vector<int> seen(64 * 4 * 2, 0);  // two super-groups: 64 blocks of 4 words of 2 halves
  for (uint64_t e = 0; e < 512; ++e) {
    const uint32_t b = rounding_block(e);
    ASSERT_LT(b, 64u);
    ++seen[(b * 4 + rounding_word(e)) * 2 + rounding_half(e)];
  }
  for (int c : seen) EXPECT_EQ(c, 1);
}

TEST(Bf16, StochasticRoundingIsUnbiasedAndExactOnBf16Values) {
  EXPECT_EQ(f32_to_bf16_stochastic(1.0f, 0u), 0x3f80);
  EXPECT_EQ(f32_to_bf16_stochastic(1.0f, 0xffffu), 0x3f80);
  const float x = f32_from_bits(0x3f804000u);  // a quarter of the way from 0x3f80 to 0x3f81
  double sum = 0;
  for (uint32_t r = 0; r < 65536; ++r) sum += bf16_to_f32(f32_to_bf16_stochastic(x, r));
  EXPECT_DOUBLE_EQ(sum / 65536, static_cast<double>(x));  // exact over the full random range
  EXPECT_EQ(f32_to_bf16_stochastic(-x, 0u), 0xbf81);      // magnitude rounds, sign kept
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16_stochastic(NAN, 7u))));
}

TEST(Bf16, RoundingModes) {
  EXPECT_EQ(f32_to_bf16_rne(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16_rne(f32_from_bits(0x3f808000u)), 0x3f80);  // tie to even
  EXPECT_EQ(f32_to_bf16_rne(f32_from_bits(0x3f818000u)), 0x3f82);  // tie to even (up)
  EXPECT_EQ(f32_to_bf16_up(f32_from_bits(0x3f800001u)), 0x3f81);   // any excess rounds up
  EXPECT_EQ(f32_to_bf16_up(3.4e38f), 0x7f7f);                      // saturates, never Inf
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16_rne(NAN))));
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16_rne(INFINITY))));
  EXPECT_EQ(f32_to_bf16_sat(3.4e38f), 0x7f7f);
}

// Every eps the codec spec accepts ([0, 2], kernels/codec.cc): finite levels from 0 to 1 that
// never decrease (the device derives its lookup grid by bisection on that: stage_level_tables),
// strictly increasing up to 0.4, and level_floor() as a linear scan. An eps so small that q
// rounds to 1 gives the uniform levels, not NaN.
TEST(Levels, TableIsMonotoneAndLookupMatchesLinearScan) {
  for (int bits : {2, 4, 8})
    for (float eps : {0.0f, 1e-30f, 1e-12f, 1e-8f, 0.001f, 0.1f, 0.18f, 0.23f, 0.4f, 1.0f, 2.0f}) {
      LevelTable t, uniform;
      build_level_table(bits, eps, true, &t);
      build_level_table(bits, eps, false, &uniform);
      ASSERT_EQ(t.level[0], 0.0f);
      ASSERT_EQ(t.level[t.max_mag], 1.0f);
      for (int r = 0; r < t.max_mag; ++r) {
        ASSERT_TRUE(std::isfinite(t.level[r])) << "bits " << bits << " eps " << eps << " r " << r;
        if (eps <= 0.4f)
          ASSERT_LT(t.level[r], t.level[r + 1]) << "bits " << bits << " eps " << eps << " r " << r;
        else
          ASSERT_LE(t.level[r], t.level[r + 1]) << "bits " << bits << " eps " << eps << " r " << r;
      }
      if (eps <= 1e-12f) {
        for (int r = 0; r <= t.max_mag; ++r) ASSERT_EQ(t.level[r], uniform.level[r]) << r;
      }
      std::mt19937 gen(bits * 100 + static_cast<int>(eps * 100));
      std::uniform_real_distribution<float> u(0.0f, 1.0f);
      for (int i = 0; i < 20000; ++i) {
        float m = i < 2 ? static_cast<float>(i) : (i < 2 + t.max_mag ? t.level[i - 2] : u(gen));
        int expect = 0;
        while (expect < t.max_mag && t.level[expect + 1] <= m) ++expect;
        ASSERT_EQ(level_floor(t, m), expect) << "bits " << bits << " eps " << eps << " m " << m;
      }
    }
}

// A codec spec with eps4 = eps8 = 1e-12 (accepted, in [0, 2]) encodes as the uniform levels do,
// byte for byte (the 2-bit levels are {0, 1} either way), and its sum is finite.
TEST(Levels, AVanishingEpsEncodesAsUniformLevels) {
  auto tiny = codec("dynamiq:5:eps4=1e-12:eps8=1e-12");
  auto uniform = codec("dynamiq:5:levels=uniform");
  auto x = gaussian(20000, 11), y = gaussian(20000, 12);
  for (Codec* c : {tiny.get(), uniform.get()}) {
    ASSERT_EQ(c->plan(x.size(), 1, 2), Status::kOk);
    auto stats = reduce_stats(*c, {x, y});
    ASSERT_EQ(c->agree(stats.data(), 5), Status::kOk);
  }
  std::vector<uint8_t> a(tiny->chunk_capacity()), b(uniform->chunk_capacity());
  ASSERT_EQ(a.size(), b.size());
  const RoundingKey key{9, 5, 1, 1, 2, 0};
  ASSERT_EQ(tiny->hop(0, {x.data(), DType::kF32, x.size()}, nullptr, 0, a.data(), key),
            Status::kOk);
  ASSERT_EQ(uniform->hop(0, {x.data(), DType::kF32, x.size()}, nullptr, 0, b.data(), key),
            Status::kOk);
  EXPECT_EQ(a, b);
  const std::vector<float> back = leaf_roundtrip(*tiny, x, 0, 2, 9);
  for (size_t i = 0; i < back.size(); ++i) ASSERT_TRUE(std::isfinite(back[i])) << i;
}

TEST(Levels, NonUniformPutsMoreLevelsNearZero) {
  LevelTable uni, non;
  build_level_table(8, 0.1f, false, &uni);
  build_level_table(8, 0.1f, true, &non);
  // Convex levels: every inner level sits below its uniform counterpart, so the gaps near zero
  // are smaller and those near the scale larger.
  for (int r = 1; r < 127; ++r) EXPECT_LT(non.level[r], uni.level[r]) << r;
  EXPECT_LT(non.level[1] - non.level[0], uni.level[1] - uni.level[0]);
  EXPECT_GT(non.level[127] - non.level[126], uni.level[127] - uni.level[126]);
}

TEST(CorrelatedRounding, TwoWorkersAtOneHalfHaveZeroVarianceSum) {
  LevelTable t;
  build_level_table(2, 0.23f, true, &t);  // magnitudes {0, 1}: one bit of magnitude
  int uncorrelated_varied = 0;
  for (uint64_t group = 0; group < 4000; ++group) {
    int sum = 0, sum_plain = 0;
    for (uint32_t rank = 0; rank < 2; ++rank) {
      float pi = static_cast<float>(correlated_stratum(7, 3, 0, group, rank, 2));
      sum += round_magnitude(t, 0.5f, pi, 2.0f, 7, 3, rank, group * 16);
      sum_plain += round_magnitude(t, 0.5f, 0.0f, 1.0f, 7, 3, rank, group * 16);
    }
    ASSERT_EQ(sum, 1) << "group " << group;
    uncorrelated_varied += sum_plain != 1;
  }
  EXPECT_GT(uncorrelated_varied, 1500);  // independent rounding: sum is 0 or 2 half the time
}

TEST(CorrelatedRounding, StrataArePermutationsAndPairsAreSpread) {
  for (uint32_t n : {2u, 3u, 5u, 16u, 100u, 1024u}) {
    std::vector<int> pair_count(n, 0);  // distance between the strata of rank 0 and rank 1
    for (uint64_t group = 0; group < 200; ++group) {
      std::vector<int> seen(n, 0);
      for (uint32_t r = 0; r < n; ++r) {
        uint32_t s = correlated_stratum(1, 0, 0, group, r, n);
        ASSERT_LT(s, n);
        seen[s]++;
      }
      for (uint32_t s = 0; s < n; ++s) ASSERT_EQ(seen[s], 1) << "n " << n;
      uint32_t a = correlated_stratum(1, 0, 0, group, 0, n),
               b = correlated_stratum(1, 0, 0, group, 1, n);
      pair_count[(b + n - a) % n]++;
    }
    // A fixed cyclic shift would put every pair at distance 1; the shuffle must not.
    if (n > 3) {
      EXPECT_LT(*std::max_element(pair_count.begin(), pair_count.end()), 200 / 2 + 1);
    }
  }
}

TEST(CorrelatedRounding, CodecSumOfTwoLeavesIsExact) {
  // Values sit exactly halfway between the 2-bit levels 0 and scale (255, an exact scale).
  for (const char* spec :
       {"dynamiq:3:widths=fixed:mean=0:corr=1", "dynamiq:3:widths=fixed:mean=0:corr=0"}) {
    auto c = codec(spec);
    std::vector<float> x(65536, 127.5f);  // large enough for the budget's 2-bit layout
    for (size_t k = 0; k < x.size(); k += 16) x[k] = 255.0f;
    ASSERT_EQ(c->plan(x.size(), 1, 2), Status::kOk);
    auto stats = reduce_stats(*c, {x, x});
    ASSERT_EQ(c->agree(stats.data(), 0), Status::kOk);
    ASSERT_EQ(dynamiq_layout(*c).widths[0], 2);
    double sq = 0;
    for (uint64_t seed = 1; seed <= 20; ++seed) {
      auto a = leaf_roundtrip(*c, x, 0, 2, seed), b = leaf_roundtrip(*c, x, 1, 2, seed);
      for (size_t k = 0; k < x.size(); ++k) sq += std::pow(a[k] + b[k] - 2.0 * x[k], 2);
    }
    if (std::string(spec).find("corr=1") != std::string::npos) {
      EXPECT_EQ(sq, 0.0) << spec;
    } else {
      EXPECT_GT(sq, 1e6) << spec;
    }
  }
}

// Mean of many independent roundings stays within a few standard errors of the input.
void expect_unbiased(const char* spec, int expected_width) {
  auto c = codec(spec);
  const size_t total = 256 * 128, n = 512;  // large enough for the budget; first 512 checked
  std::vector<float> x = gaussian(total, 5);
  for (size_t k = 256; k < n; ++k) x[k] *= 1e-3f;  // a second super-group at another scale
  ASSERT_EQ(c->plan(total, 1, 1), Status::kOk);
  auto stats = reduce_stats(*c, {x});
  ASSERT_EQ(c->agree(stats.data(), 0), Status::kOk);
  ASSERT_EQ(dynamiq_layout(*c).widths[0], expected_width) << spec;
  const int trials = 3000;
  std::vector<double> sum(n, 0), sum_sq(n, 0);
  for (int s = 0; s < trials; ++s) {
    auto y = leaf_roundtrip(*c, x, 0, 1, 1000 + s);
    y.resize(n);
    for (size_t k = 0; k < n; ++k) {
      sum[k] += y[k];
      sum_sq[k] += static_cast<double>(y[k]) * y[k];
    }
  }
  int outliers = 0;
  double worst = 0;
  for (size_t k = 0; k < n; ++k) {
    double mean = sum[k] / trials, var = sum_sq[k] / trials - mean * mean;
    double se = std::sqrt(std::max(var, 0.0) / trials);
    // A rounding with p within 1/trials of 0 or 1 shows no flips, so its sample SE is 0 while
    // its mean is off by up to a few gaps / trials: floor the SE at that resolution.
    double sg_scale = 0;
    for (size_t i = k / 256 * 256; i < k / 256 * 256 + 256; ++i)
      sg_scale = std::max(sg_scale, double(std::fabs(x[i])));
    double z = std::fabs(mean - x[k]) / (se + sg_scale / trials);
    worst = std::max(worst, z);
    outliers += z > 4.0;
  }
  EXPECT_LE(outliers, 2) << spec << " worst z " << worst;  // 512 tests at 4 sigma: ~0.03 expected
  EXPECT_LT(worst, 6.0) << spec;
}

TEST(Unbiased, TwoBit) {
  expect_unbiased("dynamiq:3:widths=fixed", 2);
}
TEST(Unbiased, FourBit) {
  expect_unbiased("dynamiq:5:widths=fixed", 4);
}
TEST(Unbiased, EightBit) {
  expect_unbiased("dynamiq:9.5:widths=fixed", 8);
}
TEST(Unbiased, EightBitUniformLevelsFlatScales) {
  expect_unbiased("dynamiq:10:widths=fixed:levels=uniform:scales=flat", 8);
}

// Two chained hops (leaf -> root). `stratified_chain` puts both in one stratum class, which the
// engine never does: the root's input depends on the leaf's rounding, so the root's correlated
// uniform is not independent of what it rounds and the sum becomes biased. The test pins both
// facts: independent classes are unbiased, a chained class is measurably not.
int chained_hop_outliers(bool stratified_chain) {
  auto c = codec("dynamiq:5");
  const size_t total = 256 * 64, n = 256;  // budget-sized tensor; the first 256 are checked
  std::vector<float> x0 = gaussian(total, 1), x1 = gaussian(total, 2);
  EXPECT_EQ(c->plan(total, 1, 2), Status::kOk);
  auto stats = reduce_stats(*c, {x0, x1});
  EXPECT_EQ(c->agree(stats.data(), 0), Status::kOk);
  std::vector<double> sum(n, 0), sq(n, 0);
  const int trials = 3000;
  std::vector<uint8_t> leaf(c->chunk_capacity()), root(c->chunk_capacity());
  std::vector<float> out(total);
  for (int s = 0; s < trials; ++s) {
    const RoundingKey leaf_key = stratified_chain ? RoundingKey{uint64_t(s), 0, 0, 0, 2, 0}
                                                  : RoundingKey{uint64_t(s), 0, 0, 0, 1, 0};
    const RoundingKey root_key = stratified_chain ? RoundingKey{uint64_t(s), 0, 1, 1, 2, 0}
                                                  : RoundingKey{uint64_t(s), 0, 1, 0, 1, 1};
    EXPECT_EQ(c->hop(0, {x0.data(), DType::kF32, total}, nullptr, 0, leaf.data(), leaf_key),
              Status::kOk);
    ByteView in{leaf.data(), leaf.size()};
    EXPECT_EQ(c->hop(0, {x1.data(), DType::kF32, total}, &in, 1, root.data(), root_key),
              Status::kOk);
    EXPECT_EQ(c->finish(0, {root.data(), root.size()}, out.data(), DType::kF32, ReduceOp::kSum, 2),
              Status::kOk);
    for (size_t k = 0; k < n; ++k) {
      sum[k] += out[k];
      sq[k] += double(out[k]) * out[k];
    }
  }
  int outliers = 0;
  for (size_t k = 0; k < n; ++k) {
    double mean = sum[k] / trials, se = std::sqrt((sq[k] / trials - mean * mean) / trials);
    outliers += std::fabs(mean - (double(x0[k]) + x1[k])) > 4 * se + 1e-7;
  }
  return outliers;
}

TEST(Unbiased, ChainedHopsInSeparateClasses) {
  EXPECT_LE(chained_hop_outliers(false), 2);
}
TEST(Unbiased, StratifyingAChainIsBiased) {
  EXPECT_GT(chained_hop_outliers(true), 20);
}

TEST(Budget, CapacityIsFixedBeforeDataAndFitsTheBudget) {
  std::mt19937 gen(3);
  for (size_t count : {size_t{1} << 14, size_t{100000}, size_t{1} << 20, size_t{3000017}})
    for (int chunks : {1, 2, 4, 7, 16})
      for (double budget : {3.0, 4.0, 5.0, 6.5, 8.0}) {
        char spec[64];
        std::snprintf(spec, sizeof spec, "dynamiq:%g", budget);
        auto c = codec(spec);
        ASSERT_EQ(c->plan(count, chunks, chunks), Status::kOk);
        const size_t capacity = c->chunk_capacity();
        const bool honest = dynamiq_layout(*c).budget_honest;
        EXPECT_EQ(c->fits_budget(), honest);
        if (count >= (size_t{1} << 20)) {
          EXPECT_TRUE(honest) << count << " " << chunks << " " << budget;
        }
        if (honest) {
          EXPECT_LE(c->bits_per_coord(), budget) << count << " " << chunks << " " << budget;
          EXPECT_GT(c->bits_per_coord(), budget - 0.05 - 8.0 * (chunks * 528.0) / count);
        }
        // Any statistics, however extreme, give a layout that fits the fixed capacity.
        std::vector<uint16_t> stats(c->stats_words());
        for (int trial = 0; trial < 4; ++trial) {
          std::lognormal_distribution<float> spread(0.0f, trial * 3.0f);
          for (size_t j = 0; j < (count + 255) / 256; ++j) {
            stats[stat_word(j, kStatMean)] = f32_to_bf16_rne(0.0f);
            stats[stat_word(j, kStatEnergy)] =
                f32_to_bf16_rne(trial == 3 ? (j % 2 ? 1e30f : 0.0f) : spread(gen));
          }
          ASSERT_EQ(c->agree(stats.data(), trial), Status::kOk);
          EXPECT_EQ(c->chunk_capacity(), capacity);
        }
      }
}

TEST(Budget, BytesProducedEqualBytesPredictedAndNothingBeyond) {
  auto c = codec("dynamiq:5");
  const size_t n = 70000;
  auto x = gaussian(n, 9);
  ASSERT_EQ(c->plan(n, 3, 3), Status::kOk);
  const size_t cap = c->chunk_capacity();
  auto stats = reduce_stats(*c, {x, x, x});
  ASSERT_EQ(c->agree(stats.data(), 0), Status::kOk);
  for (int chunk = 0; chunk < 3; ++chunk) {
    std::vector<uint8_t> buf(cap + 64, 0xA5);
    ASSERT_EQ(c->hop(chunk, {x.data(), DType::kF32, n}, nullptr, 0, buf.data(), {1, 0, 0, 0, 1, 0}),
              Status::kOk);
    for (size_t i = cap; i < buf.size(); ++i) ASSERT_EQ(buf[i], 0xA5) << "wrote past capacity";
    std::vector<uint8_t> again(cap, 0x5A);
    ASSERT_EQ(
        c->hop(chunk, {x.data(), DType::kF32, n}, nullptr, 0, again.data(), {1, 0, 0, 0, 1, 0}),
        Status::kOk);
    ASSERT_EQ(0, std::memcmp(again.data(), buf.data(), cap))
        << "every byte up to capacity is defined";
  }
}

TEST(Allocation, LargerEnergyNeverGetsFewerBits) {
  auto c = codec("dynamiq:5");
  const size_t n = 256 * 4096;
  ASSERT_EQ(c->plan(n, 4, 4), Status::kOk);
  std::mt19937 gen(11);
  std::lognormal_distribution<float> spread(0.0f, 4.0f);
  std::vector<uint16_t> stats(c->stats_words());
  std::vector<float> energy(n / 256);
  for (size_t j = 0; j < energy.size(); ++j) {
    stats[stat_word(j, kStatMean)] = 0;
    stats[stat_word(j, kStatEnergy)] = f32_to_bf16_rne(spread(gen));
    energy[j] = bf16_to_f32(stats[stat_word(j, kStatEnergy)]);
  }
  ASSERT_EQ(c->agree(stats.data(), 0), Status::kOk);
  auto view = dynamiq_layout(*c);
  int count[17] = {0};
  for (size_t a = 0; a < energy.size(); ++a) {
    count[view.widths[a]]++;
    for (size_t b = a + 1; b < std::min(energy.size(), a + 64); ++b)
      if (energy[a] > energy[b]) {
        ASSERT_GE(view.widths[a], view.widths[b]);
      } else if (energy[a] < energy[b]) {
        ASSERT_LE(view.widths[a], view.widths[b]);
      }
  }
  EXPECT_GT(count[2], 0);  // the spread uses several widths at 5 bits
  EXPECT_GT(count[8] + count[16], 0);
  // Wire order: widest first, stable; chunks cover every super-group once.
  for (size_t i = 1; i < view.n_supergroups; ++i) {
    ASSERT_GE(view.widths[view.order[i - 1]], view.widths[view.order[i]]);
    if (view.widths[view.order[i - 1]] == view.widths[view.order[i]]) {
      ASSERT_LT(view.order[i - 1], view.order[i]);
    }
  }
  EXPECT_EQ(view.chunk_first[0], 0u);
  EXPECT_EQ(view.chunk_first[4], view.n_supergroups);
}

// Slack for the record a cut runs into is kept once per cut, not once per message: a plan of one
// chunk (each part of a reduce-scatter, a reduce) may fill its whole message, and a plan of P
// chunks (an all-reduce) loses max_record - 1 bytes per cut only. With the slack in every
// message, a plan a few super-groups a chunk over the floor could not hold every super-group at
// 4 bits and sent some at 2: the soak's failing reduce-scatter (65.5 super-groups, one chunk) and
// all-reduce (64.4 a chunk, 4 chunks), each up to 2.7x the vNMSE of larger calls. Equal energies,
// 64 to 67.5 super-groups a chunk at 5 bits: none below 4 bits, every chunk within its message.
TEST(Allocation, CutSlackIsKeptOncePerCutNotPerMessage) {
  for (int chunks : {1, 2, 4, 16})
    for (int workers : {2, 4})
      for (size_t per_chunk : {size_t{64 * 256}, size_t{64 * 256 + 102}, size_t{65 * 256 + 128},
                               size_t{66 * 256 + 128}, size_t{67 * 256 + 128}}) {
        const size_t count = per_chunk * static_cast<size_t>(chunks);
        auto c = codec("dynamiq:5");
        ASSERT_EQ(c->plan(count, chunks, workers), Status::kOk);
        std::vector<uint16_t> stats(c->stats_words(), 0);
        for (size_t j = 0; j < (count + 255) / 256; ++j)
          stats[stat_word(j, kStatEnergy)] = f32_to_bf16_rne(100.0f);
        ASSERT_EQ(c->agree(stats.data(), 0), Status::kOk);  // fails if a chunk is over capacity
        const DynamiqLayoutView view = dynamiq_layout(*c);
        for (size_t j = 0; j < view.n_supergroups; ++j)
          ASSERT_GE(view.widths[j], 4) << "count " << count << ", " << chunks << " chunks, "
                                       << workers << " workers, super-group " << j;
      }
}

// The all-zero counts share words (FORMAT.md): summed as the all-reduce sums them, one BF16
// rounding an addition, in any order, every super-group's digit is its count of workers with all
// values zero, exactly, for every worker count; and the statistics take fewer words than three a
// super-group up to 255 workers (from 16 the counts are bytes, summed as integers). A bad summed
// BF16 word, or a byte above the worker count, reads as not dense with every worker.
TEST(Statistics, AllZeroCountsSumExactlyInAnyOrder) {
  std::mt19937 gen(5);
  for (int workers : {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 40, 255, 256}) {
    const size_t count = 256 * 37 + 5;  // a partial last super-group; a partial last word
    const size_t n_sg = (count + 255) / 256;
    auto c = codec("dynamiq:5");
    ASSERT_EQ(c->plan(count, 2, workers), Status::kOk);
    ASSERT_EQ(c->stats_words(), stats_words(n_sg, workers));
    if (workers <= 255) {
      EXPECT_LT(c->stats_words(), 3 * n_sg);
    } else {
      EXPECT_EQ(c->stats_words(), 3 * n_sg);
    }
    // The byte-summed words: the count section from 16 to 255 workers, else none.
    const size_t byte_words = c->stats_byte_sum_words();
    EXPECT_EQ(byte_words, workers >= 16 && workers <= 255 ? (n_sg + 1) / 2 : 0) << workers;
    std::vector<std::vector<uint16_t>> local(static_cast<size_t>(workers));
    std::vector<int> zeros(n_sg, 0);
    std::vector<float> x(count);
    for (int w = 0; w < workers; ++w) {
      for (size_t j = 0; j < n_sg; ++j) {
        const bool all_zero = gen() % 3 == 0 || (j == 5 && w < workers - 1);
        zeros[j] += all_zero ? 1 : 0;
        for (size_t k = 256 * j; k < std::min(count, 256 * j + 256); ++k)
          x[k] = all_zero ? (k % 2 ? -0.0f : 0.0f) : (k % 7 == j % 7 ? 1.5f : 0.0f);
      }
      local[static_cast<size_t>(w)].resize(c->stats_words());
      ASSERT_EQ(
          c->local_stats({x.data(), DType::kF32, count}, local[static_cast<size_t>(w)].data()),
          Status::kOk);
    }
    // Forward, reverse and a pairwise tree, each addition rounded to BF16, or (the last
    // byte_words words) summed as two unsigned 8-bit lanes, as the all-reduce sums them.
    const size_t float_words = c->stats_words() - byte_words;
    auto add = [float_words](uint16_t a, uint16_t b, size_t word) {
      return word >= float_words ? byte_lanes_sum(a, b)
                                 : f32_to_bf16_rne(bf16_to_f32(a) + bf16_to_f32(b));
    };
    std::vector<std::vector<uint16_t>> sums;
    for (int order = 0; order < 3; ++order) {
      std::vector<std::vector<uint16_t>> v = local;
      if (order == 1) std::reverse(v.begin(), v.end());
      while (v.size() > 1) {
        std::vector<std::vector<uint16_t>> next;
        for (size_t i = 0; i < v.size(); i += order == 2 ? 2 : v.size()) {
          std::vector<uint16_t> acc = v[i];
          const size_t end = order == 2 ? std::min(v.size(), i + 2) : v.size();
          for (size_t k = i + 1; k < end; ++k)
            for (size_t t = 0; t < acc.size(); ++t) acc[t] = add(acc[t], v[k][t], t);
          next.push_back(acc);
        }
        v = next;
      }
      sums.push_back(v[0]);
    }
    for (const auto& reduced : sums)
      for (size_t j = 0; j < n_sg; ++j) {
        const SupergroupStatWords w = supergroup_stat_words(reduced.data(), n_sg, j, workers);
        ASSERT_EQ(bf16_to_f32(w.all_zero), static_cast<float>(zeros[j]))
            << workers << " workers, super-group " << j;
        EXPECT_EQ(supergroup_dense(w.all_zero), zeros[j] == 0);
        EXPECT_EQ(contributing_workers(w.all_zero, workers),
                  zeros[j] < workers ? workers - zeros[j] : workers);
      }
    if (byte_words > 0) {
      // A byte above the worker count (a peer's bad byte) in either lane.
      std::vector<uint16_t> bad = sums[0];
      for (size_t j : {size_t{0}, size_t{1}}) {
        bad[zero_count_word(n_sg, j, workers)] =
            byte_lanes_word(j == 0 ? 255 : 0, j == 1 ? 255 : 0);
        const SupergroupStatWords w = supergroup_stat_words(bad.data(), n_sg, j, workers);
        EXPECT_FALSE(supergroup_dense(w.all_zero)) << j;
        EXPECT_EQ(contributing_workers(w.all_zero, workers), workers) << j;
      }
    } else if (zero_counts_per_word(workers) > 1) {
      std::vector<uint16_t> bad = sums[0];
      for (uint16_t word : {uint16_t{0x3f00}, uint16_t{0x4380}, uint16_t{0x7fc0}}) {  // 0.5, 256
        bad[zero_count_word(n_sg, 0, workers)] = word;
        const SupergroupStatWords w = supergroup_stat_words(bad.data(), n_sg, 0, workers);
        EXPECT_FALSE(supergroup_dense(w.all_zero)) << word;
        EXPECT_EQ(contributing_workers(w.all_zero, workers), workers) << word;
      }
    }
  }
}

TEST(Determinism, SameKeySameBytesDifferentSeedDifferentBytes) {
  auto c = codec("dynamiq:5");
  auto x = gaussian(10000, 4);
  ASSERT_EQ(c->plan(x.size(), 1, 2), Status::kOk);
  auto stats = reduce_stats(*c, {x, x});
  ASSERT_EQ(c->agree(stats.data(), 5), Status::kOk);
  std::vector<uint8_t> a(c->chunk_capacity()), b(a.size()), d(a.size()), e(a.size());
  ASSERT_EQ(c->hop(0, {x.data(), DType::kF32, x.size()}, nullptr, 0, a.data(), {9, 5, 1, 1, 2, 0}),
            Status::kOk);
  ASSERT_EQ(c->hop(0, {x.data(), DType::kF32, x.size()}, nullptr, 0, b.data(), {9, 5, 1, 1, 2, 0}),
            Status::kOk);
  ASSERT_EQ(c->hop(0, {x.data(), DType::kF32, x.size()}, nullptr, 0, d.data(), {10, 5, 1, 1, 2, 0}),
            Status::kOk);
  ASSERT_EQ(c->hop(0, {x.data(), DType::kF32, x.size()}, nullptr, 0, e.data(), {9, 5, 0, 0, 2, 0}),
            Status::kOk);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, d);
  EXPECT_NE(a, e);  // another hop draws other random bits
}

// The engine cuts a large call into pipeline blocks, each a codec planned over its own slice.
// Two blocks holding the same values under the same key must still draw different randomness
// (uniforms, tie words, permutations, BF16 stochastic bits): key.element_base, the block's first
// element in the whole tensor, keys every draw. Same layout, so the headers agree.
TEST(ElementBase, BlocksAtDifferentBasesDrawDifferently) {
  const size_t n = 256 * 64;  // budget-sized block
  auto x = gaussian(n, 31);
  for (const char* spec : {"dynamiq:5", "dynamiq:3:widths=fixed", "dynamiq:17:widths=fixed"}) {
    for (uint32_t strata : {1u, 3u}) {  // plain, and correlated (the permutation draws)
      auto c = codec(spec);
      ASSERT_EQ(c->plan(n, 1, 3), Status::kOk);
      auto stats = reduce_stats(*c, {x, x, x});
      ASSERT_EQ(c->agree(stats.data(), 4), Status::kOk);
      std::vector<uint8_t> first(c->chunk_capacity()), second(first.size());
      RoundingKey key{6, 4, 1, strata - 1, strata, 0};
      ASSERT_EQ(c->hop(0, {x.data(), DType::kF32, n}, nullptr, 0, first.data(), key), Status::kOk);
      key.element_base = n;  // the next block of the same tensor
      ASSERT_EQ(c->hop(0, {x.data(), DType::kF32, n}, nullptr, 0, second.data(), key), Status::kOk);
      EXPECT_EQ(0, std::memcmp(first.data(), second.data(), kChunkHeaderBytes)) << spec;
      EXPECT_NE(first, second) << spec << " strata " << strata
                               << ": two blocks reused the same draws";
    }
  }
}

// What element_base means: a block at base B draws, element for element, what the whole tensor
// draws for elements B.. . With fixed widths both plans give every super-group the same width and
// the same wire order (index order), so the block's records equal the whole tensor's records from
// super-group B / 256 on, byte for byte; a fused hop (decode an input, add, re-encode) included.
// 2^18 values per block: about 4 roundings per hop that 16 random bits leave open, so the tie
// words are keyed too.
TEST(ElementBase, ABlockEncodesLikeItsPartOfTheWholeTensor) {
  const size_t block = 256 * 1024, whole = 2 * block;
  std::vector<std::vector<float>> rows = {gaussian(whole, 51), gaussian(whole, 52)};
  for (const char* spec :
       {"dynamiq:5:widths=fixed", "dynamiq:17:widths=fixed", "dynamiq:9.5:widths=fixed"}) {
    auto w = codec(spec), b = codec(spec);
    ASSERT_EQ(w->plan(whole, 1, 2), Status::kOk);
    ASSERT_EQ(b->plan(block, 1, 2), Status::kOk);
    std::vector<std::vector<float>> tails;
    for (const auto& r : rows) tails.emplace_back(r.begin() + block, r.end());
    auto w_stats = reduce_stats(*w, rows);
    auto b_stats = reduce_stats(*b, tails);
    // The block's means and energies, then its all-zero count words, are the whole tensor's
    // second half of each (the block starts a count word).
    const size_t b_sg = block / 256, w_sg = whole / 256, b_counts = b_stats.size() - 2 * b_sg;
    ASSERT_TRUE(
        std::equal(b_stats.begin(), b_stats.begin() + 2 * b_sg, w_stats.begin() + 2 * b_sg));
    ASSERT_TRUE(std::equal(b_stats.begin() + 2 * b_sg, b_stats.end(),
                           w_stats.begin() + 2 * w_sg + b_counts));
    ASSERT_EQ(w->agree(w_stats.data(), 8), Status::kOk);
    ASSERT_EQ(b->agree(b_stats.data(), 8), Status::kOk);
    const int bits = dynamiq_layout(*b).widths[0];
    for (size_t j = 0; j < whole / 256; ++j) ASSERT_EQ(dynamiq_layout(*w).widths[j], bits) << spec;
    const size_t record = record_bytes(bits, true), skip = kChunkHeaderBytes + block / 256 * record;
    std::vector<uint8_t> w_leaf(w->chunk_capacity()), w_out(w_leaf.size());
    std::vector<uint8_t> b_leaf(b->chunk_capacity()), b_out(b_leaf.size());
    RoundingKey leaf{3, 8, 0, 0, 2, 0}, root{3, 8, 1, 1, 2, 0};  // correlated: one class of two
    ASSERT_EQ(w->hop(0, {rows[0].data(), DType::kF32, whole}, nullptr, 0, w_leaf.data(), leaf),
              Status::kOk);
    const ByteView w_in{w_leaf.data(), w_leaf.size()};
    ASSERT_EQ(w->hop(0, {rows[1].data(), DType::kF32, whole}, &w_in, 1, w_out.data(), root),
              Status::kOk);
    leaf.element_base = root.element_base = block;
    ASSERT_EQ(b->hop(0, {tails[0].data(), DType::kF32, block}, nullptr, 0, b_leaf.data(), leaf),
              Status::kOk);
    const ByteView b_in{b_leaf.data(), b_leaf.size()};
    ASSERT_EQ(b->hop(0, {tails[1].data(), DType::kF32, block}, &b_in, 1, b_out.data(), root),
              Status::kOk);
    const size_t body = block / 256 * record;
    EXPECT_EQ(0, std::memcmp(b_leaf.data() + kChunkHeaderBytes, w_leaf.data() + skip, body))
        << spec << " leaf";
    EXPECT_EQ(0, std::memcmp(b_out.data() + kChunkHeaderBytes, w_out.data() + skip, body))
        << spec << " fused hop";
  }
}

TEST(ElementBase, MustBeAMultipleOf256WithinTheIndexLimit) {
  auto c = codec("dynamiq:5");
  const size_t n = 256 * 64;
  auto x = gaussian(n, 3);
  ASSERT_EQ(c->plan(n, 1, 1), Status::kOk);
  auto stats = reduce_stats(*c, {x});
  ASSERT_EQ(c->agree(stats.data(), 0), Status::kOk);
  std::vector<uint8_t> out(c->chunk_capacity());
  RoundingKey key{1, 0, 0, 0, 1, 0};
  for (uint64_t base :
       {uint64_t{16}, uint64_t{255}, kMaxElementIndex - n + 256, kMaxElementIndex}) {
    key.element_base = base;
    EXPECT_EQ(c->hop(0, {x.data(), DType::kF32, n}, nullptr, 0, out.data(), key),
              Status::kInvalidArgument)
        << base;
  }
  key.element_base = kMaxElementIndex - n;  // the last block that fits
  EXPECT_EQ(c->hop(0, {x.data(), DType::kF32, n}, nullptr, 0, out.data(), key), Status::kOk);
}

// A layout of the same plan shape (elements, chunks, workers) built by a codec of another budget
// or record format passes the layout's own header check, but its chunks and records do not fit
// this codec's messages: the hop and the finish refuse it and write nothing past the message.
TEST(Layout, ALayoutOfAnotherBudgetIsRefused) {
  const size_t n = size_t{1} << 18;
  auto x = gaussian(n, 21);
  for (const char* other : {"dynamiq:8", "dynamiq:5:scales=flat"}) {
    auto wide = codec(other), narrow = codec("dynamiq:3");
    ASSERT_EQ(wide->plan(n, 2, 2), Status::kOk);
    ASSERT_EQ(narrow->plan(n, 2, 2), Status::kOk);
    auto stats = reduce_stats(*wide, {x, x});
    std::vector<uint64_t> layout(wide->layout_bytes() / 8 + 1);
    ASSERT_EQ(wide->build_layout(stats.data(), 3, layout.data()), Status::kOk);
    const size_t cap = narrow->chunk_capacity();
    std::vector<uint8_t> out(cap + 4096, 0xA5);
    const RoundingKey key{2, 3, 0, 0, 1, 0};
    for (int chunk = 0; chunk < 2; ++chunk) {
      EXPECT_EQ(narrow->fused_hop(layout.data(), chunk, {x.data(), DType::kF32, n}, nullptr, 0,
                                  out.data(), key),
                Status::kInvalidArgument)
          << other << " chunk " << chunk;
      std::vector<float> y(n);
      EXPECT_EQ(narrow->decode_finish(layout.data(), chunk, {out.data(), cap}, y.data(),
                                      DType::kF32, ReduceOp::kSum, 1),
                Status::kInvalidArgument)
          << other << " chunk " << chunk;
    }
    for (size_t b = cap; b < out.size(); ++b)
      ASSERT_EQ(out[b], 0xA5) << other << ": byte " << b - cap << " past the message written";
  }
}

// Values the codec cannot read or write are refused, as the block codecs refuse them, rather
// than read as BF16 (FP16 input) or written as BF16 bits (FP16 output).
TEST(Layout, TypesOtherThanFp32AndBf16AreRefused) {
  const size_t n = 256 * 8;
  auto x = gaussian(n, 5);
  auto c = codec("dynamiq:5");
  ASSERT_EQ(c->plan(n, 1, 1), Status::kOk);
  std::vector<uint16_t> stats(c->stats_words());
  EXPECT_EQ(c->local_stats({x.data(), DType::kFloat16, n}, stats.data()), Status::kInvalidArgument);
  EXPECT_EQ(c->local_stats({x.data(), DType::kF32, n}, nullptr), Status::kInvalidArgument);
  ASSERT_EQ(c->local_stats({x.data(), DType::kF32, n}, stats.data()), Status::kOk);
  std::vector<uint64_t> layout(c->layout_bytes() / 8 + 1);
  ASSERT_EQ(c->build_layout(stats.data(), 1, layout.data()), Status::kOk);
  std::vector<uint8_t> msg(c->chunk_capacity());
  const RoundingKey key{1, 1, 0, 0, 1, 0};
  EXPECT_EQ(
      c->fused_hop(layout.data(), 0, {x.data(), DType::kFloat16, n}, nullptr, 0, msg.data(), key),
      Status::kInvalidArgument);
  ASSERT_EQ(c->fused_hop(layout.data(), 0, {x.data(), DType::kF32, n}, nullptr, 0, msg.data(), key),
            Status::kOk);
  std::vector<float> y(n, 7.0f);
  EXPECT_EQ(c->decode_finish(layout.data(), 0, {msg.data(), msg.size()}, y.data(), DType::kFloat16,
                             ReduceOp::kSum, 1),
            Status::kInvalidArgument);
  EXPECT_EQ(c->decode_finish(layout.data(), 0, {msg.data(), msg.size()}, y.data(), DType::kF32,
                             static_cast<ReduceOp>(2), 1),
            Status::kInvalidArgument);
  EXPECT_EQ(c->decode_finish(layout.data(), 0, {msg.data(), msg.size()}, nullptr, DType::kF32,
                             ReduceOp::kSum, 1),
            Status::kInvalidArgument);
  EXPECT_EQ(y[0], 7.0f);  // nothing written by the refused calls
  EXPECT_EQ(c->decode_finish(layout.data(), 0, {msg.data(), msg.size()}, y.data(), DType::kF32,
                             ReduceOp::kSum, 1),
            Status::kOk);
}

// The layout lives in memory the caller owns: a layout built into a caller's buffer works like the
// codec's own, hops and finishes of one call need nothing else, and one codec serves two calls'
// layouts side by side.
TEST(Layout, CallerOwnedLayoutsAreIndependentOfTheCodec) {
  auto c = codec("dynamiq:5");
  const size_t n = 256 * 300;
  auto x = gaussian(n, 12), y = gaussian(n, 13);
  for (size_t k = 0; k < n; ++k) y[k] *= 1.0f + static_cast<float>(k % 4096) / 64.0f;
  ASSERT_EQ(c->plan(n, 2, 1), Status::kOk);
  ASSERT_GE(c->layout_bytes(), 8u);
  auto sx = reduce_stats(*c, {x}), sy = reduce_stats(*c, {y});
  std::vector<uint64_t> lx(c->layout_bytes() / 8 + 1, 0xdeadbeefdeadbeefull), ly(lx);
  ASSERT_EQ(c->build_layout(sx.data(), 10, lx.data()), Status::kOk);
  ASSERT_EQ(c->build_layout(sy.data(), 11, ly.data()), Status::kOk);
  EXPECT_EQ(lx.back(), 0xdeadbeefdeadbeefull) << "wrote past layout_bytes()";
  std::vector<uint64_t> again(lx.size(), 0);
  ASSERT_EQ(c->build_layout(sx.data(), 10, again.data()), Status::kOk);
  EXPECT_EQ(0, std::memcmp(again.data(), lx.data(), c->layout_bytes())) << "not deterministic";
  EXPECT_NE(0, std::memcmp(ly.data(), lx.data(), c->layout_bytes()));
  // The codec's own layout (agree) gives the same bytes as the caller's buffer.
  ASSERT_EQ(c->agree(sx.data(), 10), Status::kOk);
  EXPECT_EQ(0, std::memcmp(c->owned_layout(), lx.data(), c->layout_bytes()));
  const RoundingKey key{2, 10, 0, 0, 1, 0};
  for (int chunk = 0; chunk < 2; ++chunk) {
    std::vector<uint8_t> own(c->chunk_capacity()), mine(own.size());
    ASSERT_EQ(c->hop(chunk, {x.data(), DType::kF32, n}, nullptr, 0, own.data(), key), Status::kOk);
    ASSERT_EQ(
        c->fused_hop(lx.data(), chunk, {x.data(), DType::kF32, n}, nullptr, 0, mine.data(), key),
        Status::kOk);
    EXPECT_EQ(own, mine);
    // A payload of one call is not valid under the other call's layout.
    std::vector<float> out(n);
    EXPECT_EQ(c->decode_finish(ly.data(), chunk, {mine.data(), mine.size()}, out.data(),
                               DType::kF32, ReduceOp::kSum, 1),
              Status::kMalformedPayload);
    ASSERT_EQ(c->decode_finish(lx.data(), chunk, {mine.data(), mine.size()}, out.data(),
                               DType::kF32, ReduceOp::kSum, 1),
              Status::kOk);
    std::vector<std::pair<size_t, size_t>> a, b;
    c->chunk_ranges(chunk, &a);
    c->layout_ranges(lx.data(), chunk, &b);
    EXPECT_EQ(a, b);
  }
  // A layout built for another plan is refused, not misread.
  auto other = codec("dynamiq:5");
  ASSERT_EQ(other->plan(n, 3, 1), Status::kOk);
  std::vector<uint8_t> out(c->chunk_capacity());
  EXPECT_EQ(other->fused_hop(lx.data(), 0, {x.data(), DType::kF32, n}, nullptr, 0, out.data(), key),
            Status::kInvalidArgument);
  EXPECT_EQ(c->fused_hop(nullptr, 0, {x.data(), DType::kF32, n}, nullptr, 0, out.data(), key),
            Status::kInvalidArgument);
}

// Re-encodes a record with only the pointwise __host__ __device__ functions (what one CUDA thread
// per value computes) and requires the host's vectorised bytes to match exactly.
TEST(DeviceMath, HostRecordMatchesPointwiseReference) {
  for (const char* spec :
       {"dynamiq:3:widths=fixed", "dynamiq:5:widths=fixed", "dynamiq:9.5:widths=fixed"}) {
    auto c = codec(spec);
    const size_t n = 256 * 128;  // budget-sized, so the fixed width follows the budget
    auto x = gaussian(n, 21);
    ASSERT_EQ(c->plan(n, 1, 5), Status::kOk);
    auto stats = reduce_stats(*c, {x, x, x, x, x});
    ASSERT_EQ(c->agree(stats.data(), 77), Status::kOk);
    auto view = dynamiq_layout(*c);
    ASSERT_TRUE(view.budget_honest);
    const int bits = view.widths[0];
    ASSERT_TRUE(bits == 2 || bits == 4 || bits == 8) << spec;
    std::vector<uint8_t> out(c->chunk_capacity());
    const RoundingKey key{123, 77, 3, 3, 5, 2};
    ASSERT_EQ(c->hop(0, {x.data(), DType::kF32, n}, nullptr, 0, out.data(), key), Status::kOk);
    LevelTable t;
    build_level_table(bits, DynamiqOptions{}.eps[bits == 2 ? 0 : bits == 4 ? 1 : 2], true, &t);
    const uint8_t* rec = out.data() + kChunkHeaderBytes;
    for (size_t i = 0; i < view.n_supergroups; ++i, rec += record_bytes(bits, true)) {
      const uint32_t j = view.order[i];
      const float mu = supergroup_dense(supergroup_stat_words(stats.data(), n / 256, j, 5).all_zero)
                           ? bf16_to_f32(stats[stat_word(j, kStatMean)]) / 5.0f
                           : 0.0f;
      float v[256], sgmax = 0, gmax[16] = {0};
      for (int k = 0; k < 256; ++k) {
        v[k] = x[j * 256 + k] - mu;
        gmax[k / 16] = std::max(gmax[k / 16], std::fabs(v[k]));
        sgmax = std::max(sgmax, std::fabs(v[k]));
      }
      const uint16_t unit_bits = supergroup_unit_bf16(sgmax);
      ASSERT_EQ(rec[0] | (rec[1] << 8), unit_bits);
      const float unit = bf16_to_f32(unit_bits);
      for (int k = 0; k < 256; ++k) {
        const int g = k / 16;
        const uint8_t f = group_factor(gmax[g], unit);
        ASSERT_EQ(rec[2 + g], f);
        const float scale = static_cast<float>(f) * unit;
        const float pi = static_cast<float>(correlated_stratum(
            key.seed, key.call, key.stratum_class, j * 16ull + g, key.stratum, key.strata));
        const int mag = round_magnitude(t, magnitude_ratio(v[k], scale), pi, 5.0f, key.seed,
                                        key.call, key.rank, j * 256ull + k);
        const uint32_t code = encode_code(mag, v[k] < 0.0f, t.max_mag);
        const uint32_t got = (rec[18 + k * bits / 8] >> ((k * bits) % 8)) & ((1u << bits) - 1);
        ASSERT_EQ(got, code) << spec << " sg " << j << " k " << k;
      }
    }
  }
}

// The fused hop (decode the inputs, add own values, re-encode) against the pointwise
// __host__ __device__ functions, record by record and byte for byte, for every width (the
// variable-width plan mixes 2, 4, 8 and 16) and for each 8-bit lookup path of the host: one
// grid step (default eps) and several (eps8 = 0.4 packs many levels into the first cells).
TEST(DeviceMath, FusedHopMatchesPointwiseReference) {
  int ties = 0;  // roundings the 16 random bits left open: the host's rare tie path ran
  for (const char* spec : {"dynamiq:5", "dynamiq:7:corr=0", "dynamiq:9.5:widths=fixed:eps8=0.4",
                           "dynamiq:5:widths=fixed", "dynamiq:3:widths=fixed"}) {
    auto c = codec(spec);
    const size_t n = 256 * 400 + 40;  // a partial last super-group; ~8 rounding ties per spec
    std::vector<std::vector<float>> rows;
    for (uint32_t r = 0; r < 3; ++r) {
      auto x = gaussian(n, 40 + r);
      for (size_t k = 0; k < n; ++k)
        x[k] *= std::pow(10.0f, static_cast<float>((k / 256) % 9) - 4.0f);
      for (size_t k = 3; k < n; k += 777) x[k] = 0.0f;
      rows.push_back(x);
    }
    ASSERT_EQ(c->plan(n, 1, 3), Status::kOk);
    auto stats = reduce_stats(*c, rows);
    ASSERT_EQ(c->agree(stats.data(), 5), Status::kOk);
    auto view = dynamiq_layout(*c);
    std::vector<uint8_t> leaf(c->chunk_capacity()), out(c->chunk_capacity());
    const RoundingKey leaf_key{9, 5, 0, 0, 1, 0}, key{9, 5, 2, 1, 3, 1};
    ASSERT_EQ(c->hop(0, {rows[0].data(), DType::kF32, n}, nullptr, 0, leaf.data(), leaf_key),
              Status::kOk);
    const ByteView in{leaf.data(), leaf.size()};
    ASSERT_EQ(c->hop(0, {rows[2].data(), DType::kF32, n}, &in, 1, out.data(), key), Status::kOk);
    DynamiqOptions defaults;
    std::string s(spec);
    const float eps8 = s.find("eps8=0.4") != std::string::npos ? 0.4f : defaults.eps[2];
    const bool corr = s.find("corr=0") == std::string::npos;
    LevelTable tables[3];
    build_level_table(2, defaults.eps[0], true, &tables[0]);
    build_level_table(4, defaults.eps[1], true, &tables[1]);
    build_level_table(8, eps8, true, &tables[2]);
    size_t offset = kChunkHeaderBytes;
    int seen[4] = {0, 0, 0, 0};
    for (size_t i = 0; i < view.n_supergroups; ++i) {
      const uint32_t j = view.order[i];
      const int bits = view.widths[j];
      ++seen[width_index(bits)];
      const uint8_t* rec_in = leaf.data() + offset;
      const uint8_t* rec = out.data() + offset;
      offset += record_bytes(bits, true);
      const float mu =
          bits == 16 ||
                  !supergroup_dense(supergroup_stat_words(stats.data(), n / 256 + 1, j, 3).all_zero)
              ? 0.0f
              : bf16_to_f32(stats[stat_word(j, kStatMean)]) / 3.0f;
      float v[256];
      for (int k = 0; k < 256; ++k) {
        const size_t e = j * 256ull + k;
        v[k] = e < n ? rows[2][e] - mu : 0.0f;
      }
      if (bits == 16) {
        for (int k = 0; k < 256; ++k) {
          v[k] += bf16_to_f32(static_cast<uint16_t>(rec_in[2 * k] | (rec_in[2 * k + 1] << 8)));
          const uint64_t e = j * 256ull + k;
          const uint32_t bits16 = rounding_bits16(key.seed, key.call, key.rank, e);
          ASSERT_EQ(rec[2 * k] | (rec[2 * k + 1] << 8), f32_to_bf16_stochastic(v[k], bits16))
              << spec << " sg " << j << " k " << k;
        }
        continue;
      }
      const LevelTable& t = tables[width_index(bits)];
      const float unit_in = bf16_to_f32(static_cast<uint16_t>(rec_in[0] | (rec_in[1] << 8)));
      for (int k = 0; k < 256; ++k)
        v[k] += decode_code(t, unpack_code(rec_in + 18, k, bits),
                            static_cast<float>(rec_in[2 + k / 16]) * unit_in);
      float sgmax = 0, gmax[16] = {0};
      for (int k = 0; k < 256; ++k) {
        gmax[k / 16] = std::max(gmax[k / 16], std::fabs(v[k]));
        sgmax = std::max(sgmax, std::fabs(v[k]));
      }
      const uint16_t unit_bits = supergroup_unit_bf16(sgmax);
      ASSERT_EQ(rec[0] | (rec[1] << 8), unit_bits) << spec << " sg " << j;
      const float unit = bf16_to_f32(unit_bits);
      for (int k = 0; k < 256; ++k) {
        const int g = k / 16;
        const uint8_t f = group_factor(gmax[g], unit);
        ASSERT_EQ(rec[2 + g], f);
        const float scale = static_cast<float>(f) * unit;
        const uint32_t strata = corr ? key.strata : 1;
        const float pi = static_cast<float>(correlated_stratum(
            key.seed, key.call, key.stratum_class, j * 16ull + g, key.stratum, strata));
        const float m = magnitude_ratio(v[k], scale);
        const int mag = round_magnitude(t, m, pi, static_cast<float>(strata), key.seed, key.call,
                                        key.rank, j * 256ull + k);
        ties += round_up_coarse(
                    round_up_threshold(t, m, level_floor(t, m), pi, static_cast<float>(strata)),
                    rounding_bits16(key.seed, key.call, key.rank, j * 256ull + k)) < 0;
        ASSERT_EQ(unpack_code(rec + 18, k, bits), encode_code(mag, v[k] < 0.0f, t.max_mag))
            << spec << " sg " << j << " k " << k;
      }
    }
    if (s == "dynamiq:5") {  // the mixed plan exercised every quantised width
      EXPECT_GT(seen[0], 0);
      EXPECT_GT(seen[1], 0);
      EXPECT_GT(seen[2], 0);
    }
  }
  EXPECT_GT(ties, 0);
}

// Every byte a codec produces under one host path (codec_step_bytes(): statistics, the leaves of
// workers 0 and 1 in each of two chunks, worker 2's fused hop of them, every finish), on values
// with a partial last super-group, an all-zero one and a poisoned one.
std::vector<uint8_t> codec_bytes(HostIsa isa, const char* spec, DType dtype) {
  std::unique_ptr<Codec> c;
  {
    const ThreadHostIsa on_path(isa);
    c = codec(spec);
  }
  const size_t n = 3 * 4096 + 77;  // a partial last super-group
  const int workers = 3, chunks = 2;
  std::vector<std::vector<float>> rows;
  for (int w = 0; w < workers; ++w) {
    rows.push_back(gaussian(n, 40 + w, w == 1 ? 1e-3f : 1.0f));
    for (size_t i = 1000; i < 1256; ++i) rows[w][i] = 0.0f;  // an all-zero super-group
  }
  rows[2][5000] = std::numeric_limits<float>::infinity();  // a poisoned super-group
  std::vector<std::vector<uint16_t>> bf16_rows(workers, std::vector<uint16_t>(n));
  std::vector<ConstTensor> tensors;
  for (int w = 0; w < workers; ++w) {
    for (size_t i = 0; i < n; ++i) bf16_rows[w][i] = f32_to_bf16_rne(rows[w][i]);
    tensors.push_back(dtype == DType::kF32 ? ConstTensor{rows[w].data(), dtype, n}
                                           : ConstTensor{bf16_rows[w].data(), dtype, n});
  }
  std::string error;
  std::vector<uint8_t> bytes = codec_step_bytes(*c, tensors, chunks, &error);
  EXPECT_EQ(error, "") << spec << " on " << host_isa_name(isa);
  return bytes;
}

// The paths other than the scalar one that this CPU runs.
std::vector<HostIsa> vector_paths() {
  std::vector<HostIsa> paths;
  for (HostIsa isa : {HostIsa::kAvx2, HostIsa::kAvx512})
    if (host_isa_supported(isa)) paths.push_back(isa);
  return paths;
}

// Every byte the codec `spec` writes (codec_bytes) is the same on every path this CPU runs as on
// the scalar one, for FP32 and BF16 input.
void expect_same_bytes_on_every_path(const char* spec) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const std::vector<uint8_t> scalar = codec_bytes(HostIsa::kScalar, spec, dtype);
    for (HostIsa isa : vector_paths()) {
      const std::vector<uint8_t> other = codec_bytes(isa, spec, dtype);
      ASSERT_EQ(scalar.size(), other.size()) << spec << " " << host_isa_name(isa);
      size_t first = 0;
      while (first < scalar.size() && scalar[first] == other[first]) ++first;
      EXPECT_EQ(first, scalar.size()) << spec << (dtype == DType::kF32 ? " f32 " : " bf16 ")
                                      << host_isa_name(isa) << ": first differing byte";
    }
  }
}

// Every path gives the scalar path's bytes for every option set, input type and step.
TEST(HostIsa, EveryPathGivesTheSameBytes) {
  if (vector_paths().empty()) GTEST_SKIP() << "no AVX2 on this CPU: one path only";
  for (const char* spec :
       {"dynamiq:3", "dynamiq:5", "dynamiq:7", "dynamiq:3:widths=fixed", "dynamiq:5:widths=fixed",
        "dynamiq:9.5:widths=fixed", "dynamiq:17:widths=fixed", "dynamiq:5:corr=0",
        "dynamiq:5:levels=uniform", "dynamiq:5:scales=flat", "dynamiq:5:mean=0"})
    expect_same_bytes_on_every_path(spec);
}

// The statistics words of every super-group are the same on every path (the vector paths sum eight
// groups at a time from transposed values): all +0, all -0 and mixed zeros (the all-zero counts),
// a NaN, an infinity or a denormal at positions spread over the groups and their halves, values
// far from unit scale (the wide statistics), values differing in every position, and a partial
// last super-group; FP32 and BF16, at 2, 8 and 300 workers (each count word's layout).
TEST(HostIsa, StatisticsAreTheSameOnEveryPath) {
  if (vector_paths().empty()) GTEST_SKIP() << "no AVX2 on this CPU: one path only";
  const size_t n = 40 * kSuperGroup + 131;
  std::vector<float> x = gaussian(n, 77);
  for (size_t i = 0; i < n; ++i) x[i] *= 1.0f + static_cast<float>(i % 97) * 1e-3f;
  auto sg = [&](int j) { return x.data() + static_cast<size_t>(j) * kSuperGroup; };
  std::fill(sg(0), sg(1), 0.0f);
  std::fill(sg(1), sg(2), -0.0f);
  std::fill(sg(2), sg(3), 0.0f);
  sg(2)[137] = -0.0f;
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(), 1e-41f};
  int j = 3;
  for (float special : specials)
    for (int pos : {0, 7, 8, 15, 16 * 5 + 3, 16 * 8 + 9, 255}) {
      std::fill(sg(j), sg(j + 1), 0.0f);
      sg(j)[pos] = special;
      ++j;
    }
  for (int k = 0; k < kSuperGroup; ++k) sg(j)[k] *= 1e30f;  // far from unit scale
  for (int k = 0; k < kSuperGroup; ++k) sg(j + 1)[k] *= 1e-30f;
  for (int k = 0; k < kSuperGroup; ++k) sg(j + 2)[k] = static_cast<float>(k) * 0.37f - 11.0f;
  j += 3;
  // Cancellation: in group g, 2^24 at value a and -2^24 at value b, 1 elsewhere, so the sum
  // depends on the order of the additions (1 + 2^24 rounds back to 2^24): the group's own order.
  for (auto [a, b] : {std::pair{0, 8}, {3, 12}, {15, 8}, {1, 6}, {9, 2}}) {
    for (int k = 0; k < kSuperGroup; ++k) {
      const int v = k % kGroup, g = k / kGroup;
      sg(j)[k] = (v == a ? 0x1p24f : v == b ? -0x1p24f : 1.0f) * static_cast<float>(g + 1);
    }
    ++j;
  }
  ASSERT_LT(j, 40);
  std::vector<uint16_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = f32_to_bf16_rne(x[i]);
  for (int workers : {2, 8, 300})
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      std::vector<HostIsa> paths = vector_paths();
      paths.insert(paths.begin(), HostIsa::kScalar);
      std::vector<std::vector<uint16_t>> words(paths.size());
      size_t path = 0;
      for (HostIsa isa : paths) {
        std::unique_ptr<Codec> c;
        {
          const ThreadHostIsa on_path(isa);
          c = codec("dynamiq:5");
        }
        ASSERT_EQ(c->plan(n, 1, workers), Status::kOk);
        words[path].resize(c->stats_words());
        const ConstTensor t = dtype == DType::kF32 ? ConstTensor{x.data(), dtype, n}
                                                   : ConstTensor{b.data(), dtype, n};
        ASSERT_EQ(c->local_stats(t, words[path].data()), Status::kOk);
        ++path;
      }
      for (size_t q = 1; q < paths.size(); ++q)
        for (size_t w = 0; w < words[0].size(); ++w)
          ASSERT_EQ(words[0][w], words[q][w])
              << host_isa_name(paths[q]) << ", word " << w << ", " << workers << " workers, "
              << (dtype == DType::kF32 ? "FP32" : "BF16");
    }
}

// The baseline codecs take the same path (kernels/baselines/baselines_hot.h) and give the same
// bytes on each: leaves, the fused hop and every finish, FP32 and BF16 (no statistics).
TEST(HostIsa, EveryBaselinePathGivesTheSameBytes) {
  if (vector_paths().empty()) GTEST_SKIP() << "no AVX2 on this CPU: one path only";
  for (const char* spec :
       {"bf16", "mxfp8", "mxfp6e3m2", "mxfp6e2m3", "mxfp4", "uniform:3", "uniform:5", "uniform:9"})
    expect_same_bytes_on_every_path(spec);
}

// Auto picks the best path this CPU supports and whose start-up check passes (on a real CPU every
// path it has: the other HostIsa tests compare their bytes); a forced path is kept until changed.
TEST(HostIsa, AutoPicksTheBestSupportedPath) {
  const HostIsa before = host_isa();
  ASSERT_TRUE(select_host_isa(HostIsa::kAuto));
  const bool has_avx2 = __builtin_cpu_supports("avx2");
  const bool has_avx512 = has_avx2 && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  EXPECT_EQ(host_isa_cpu_has(HostIsa::kAvx2), has_avx2);
  EXPECT_EQ(host_isa_cpu_has(HostIsa::kAvx512), has_avx512);
  std::string difference;
  const bool avx2 = has_avx2 && host_path_gives_scalar_bytes(HostIsa::kAvx2, &difference);
  const bool avx512 = has_avx512 && host_path_gives_scalar_bytes(HostIsa::kAvx512, &difference);
  const HostIsa best = avx512 ? HostIsa::kAvx512 : avx2 ? HostIsa::kAvx2 : HostIsa::kScalar;
  EXPECT_EQ(host_isa(), best);
  EXPECT_STREQ(host_isa_name(), avx512 ? "avx512" : avx2 ? "avx2" : "scalar");
  EXPECT_EQ(host_isa_supported(HostIsa::kAvx2), avx2);
  EXPECT_EQ(host_isa_supported(HostIsa::kAvx512), avx512);
  // A path not supported is refused and changes nothing.
  if (!avx512) {
    EXPECT_FALSE(select_host_isa(HostIsa::kAvx512));
    EXPECT_EQ(host_isa(), best);
  }
  ASSERT_TRUE(select_host_isa(HostIsa::kScalar));
  EXPECT_EQ(host_isa(), HostIsa::kScalar);
  EXPECT_TRUE(select_host_isa(before));
  HostIsa parsed;
  EXPECT_TRUE(parse_host_isa("avx2", &parsed));
  EXPECT_EQ(parsed, HostIsa::kAvx2);
  EXPECT_TRUE(parse_host_isa("avx512", &parsed));
  EXPECT_EQ(parsed, HostIsa::kAvx512);
  EXPECT_FALSE(parse_host_isa("avx512f", &parsed));
}

// The format's floating-point environment (common/float_env.h): set while the guard lives,
// whatever the thread had (flush-to-zero, denormals-are-zero, rounding toward zero), and the
// thread's own restored afterwards exactly, so that a flag raised inside does not leak out.
TEST(FloatEnvironment, GuardSetsTheDefaultAndRestoresTheCallers) {
  const unsigned before = _mm_getcsr();
  const unsigned app = 0x1F80u | 0x8040u | 0x6000u;  // FTZ, DAZ, toward zero; no flag set
  _mm_setcsr(app);
  EXPECT_FALSE(float_environment_is_default());
  volatile float zero = 0.0f, tiny = 1e-39f;
  float inside_product = 0.0f;
  bool inside_default = false;
  {
    const DefaultFloatEnvironment env;
    inside_default = float_environment_is_default();
    inside_product = tiny * 1.0f;  // a subnormal: kept, not flushed
    (void)(1.0f / zero);           // raises divide-by-zero inside
  }
  const unsigned after = _mm_getcsr();
  _mm_setcsr(before);
  EXPECT_TRUE(inside_default);
  EXPECT_EQ(inside_product, 1e-39f);
  EXPECT_EQ(after, app) << "the caller's environment, flags included";
}

// A layout built by a caller whose thread flushes subnormals (torch.set_flush_denormal(True))
// has the bytes of one built under the format's environment: its serial arithmetic (the means,
// the range keys) runs under the default too, so ranks with different environments agree.
TEST(FloatEnvironment, ALayoutIsTheSameUnderFlushToZero) {
  const size_t n = 256 * 64;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i)  // subnormal scale, a mean that is not zero
    x[i] = std::ldexp(1.0f + static_cast<float>(i % 7) / 8.0f, -127 - static_cast<int>(i % 7));
  auto c = codec("dynamiq:5");
  ASSERT_EQ(c->plan(n, 2, 1), Status::kOk);
  const auto stats = reduce_stats(*c, {x});
  std::vector<uint64_t> plain(c->layout_bytes() / 8 + 1), flushed(plain.size());
  ASSERT_EQ(c->build_layout(stats.data(), 1, plain.data()), Status::kOk);
  const unsigned before = _mm_getcsr();
  _mm_setcsr(before | 0x8040u);  // FTZ, DAZ
  const Status built = c->build_layout(stats.data(), 1, flushed.data());
  _mm_setcsr(before);
  ASSERT_EQ(built, Status::kOk);
  EXPECT_EQ(0, std::memcmp(plain.data(), flushed.data(), c->layout_bytes()));
}

// Every task of dq::parallel_for runs under the default environment, also on TBB workers whose
// arena captured another one from the thread that made it (as an application's thread with
// torch.set_flush_denormal(True) would). tbb::parallel_for on the same arena, the control, shows
// that its workers do carry the captured environment.
TEST(FloatEnvironment, EveryCodecTaskRunsUnderTheDefault) {
  const unsigned before = _mm_getcsr();
  _mm_setcsr(0x1F80u | 0x8040u | 0x4000u);  // FTZ, DAZ, upward
  tbb::task_arena arena(2);
  arena.initialize();  // captures this thread's environment for its workers
  _mm_setcsr(before);
  // Each task notes whether it ran under the default, and on which thread; tasks wait (at most
  // 2 s) until a second thread has taken one, so that a worker runs some. Every access to that
  // record holds `m`, this thread's too: libtbb is not built for ThreadSanitizer, so the lock is
  // what orders the tasks with this thread there (tbb::parallel_for has no annotations). `m` is
  // static, constant-initialized: a mutex constructed on this stack is itself a write TSan could
  // not order with the tasks' locking.
  static std::mutex m;
  auto run = [&](bool wrapped, int* tasks_not_default, int* threads) {
    std::set<std::thread::id> seen;
    int not_default = 0;
    { const std::lock_guard<std::mutex> publish(m); }
    auto body = [&](const tbb::blocked_range<int>& r) {
      for (int i = r.begin(); i < r.end(); ++i) {
        const bool is_default = float_environment_is_default();
        std::unique_lock<std::mutex> lock(m);
        if (!is_default) ++not_default;
        seen.insert(std::this_thread::get_id());
        for (int k = 0; k < 200 && seen.size() < 2; ++k) {
          lock.unlock();
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
          lock.lock();
        }
      }
    };
    arena.execute([&] {
      if (wrapped)
        dq::parallel_for(tbb::blocked_range<int>(0, 64, 1), body);
      else
        tbb::parallel_for(tbb::blocked_range<int>(0, 64, 1), body);
    });
    const std::lock_guard<std::mutex> lock(m);
    *tasks_not_default = not_default;
    *threads = static_cast<int>(seen.size());
  };
  int not_default = -1, threads = 0;
  run(true, &not_default, &threads);
  EXPECT_EQ(not_default, 0) << "tasks of dq::parallel_for not under the default environment";
  if (threads < 2) GTEST_SKIP() << "no TBB worker took a task: one thread here";
  run(false, &not_default, &threads);
  if (threads >= 2) {
    EXPECT_GT(not_default, 0) << "the control: the arena's workers' environment";
  }
}

// ThreadHostIsa changes the path of codecs made on its own thread only, and only while it lives.
TEST(HostIsa, ThreadPathStaysOnItsThread) {
  const HostIsa process = host_isa();
  {
    const ThreadHostIsa on_scalar(HostIsa::kScalar);
    EXPECT_EQ(host_isa(), HostIsa::kScalar);
    HostIsa elsewhere = HostIsa::kAuto;
    std::thread([&elsewhere] { elsewhere = host_isa(); }).join();
    EXPECT_EQ(elsewhere, process);
  }
  EXPECT_EQ(host_isa(), process);
}

// A codec that writes one wrong bit: in the fused hop's output (n_in > 0) or in every FP32
// finish, for the specs of one family; otherwise the codec it wraps.
class OneWrongBit final : public Codec {
 public:
  enum class Where { kFusedHop, kFinish };
  OneWrongBit(std::unique_ptr<Codec> inner, Where where)
      : inner_(std::move(inner)), where_(where) {}
  std::string name() const override { return inner_->name(); }
  Status plan(size_t count, int n_chunks, int n_workers) override {
    count_ = count;
    n_chunks_ = n_chunks;
    n_workers_ = n_workers;
    return inner_->plan(count, n_chunks, n_workers);
  }
  size_t stats_words() const override { return inner_->stats_words(); }
  size_t stats_byte_sum_words() const override { return inner_->stats_byte_sum_words(); }
  Status local_stats(const ConstTensor& x, uint16_t* words) const override {
    return inner_->local_stats(x, words);
  }
  size_t layout_bytes() const override { return inner_->layout_bytes(); }
  Status build_layout(const uint16_t* stats, uint64_t call, void* layout) const override {
    return inner_->build_layout(stats, call, layout);
  }
  size_t chunk_capacity() const override { return inner_->chunk_capacity(); }
  bool fits_budget() const override { return inner_->fits_budget(); }
  Status fused_hop(const void* layout, int chunk, const ConstTensor& own, const ByteView* in,
                   int n_in, uint8_t* out, const RoundingKey& key) const override {
    const Status s = inner_->fused_hop(layout, chunk, own, in, n_in, out, key);
    if (where_ == Where::kFusedHop && n_in > 0) out[chunk_capacity() / 2] ^= 0x10;
    return s;
  }
  Status decode_finish(const void* layout, int chunk, ByteView in, void* out, DType out_dtype,
                       ReduceOp op, int n_contrib) const override {
    const Status s = inner_->decode_finish(layout, chunk, in, out, out_dtype, op, n_contrib);
    if (where_ == Where::kFinish && out_dtype == DType::kF32) {
      std::vector<std::pair<size_t, size_t>> ranges;
      inner_->layout_ranges(layout, chunk, &ranges);
      if (!ranges.empty()) static_cast<uint8_t*>(out)[4 * ranges[0].first] ^= 0x01;
    }
    return s;
  }
  void layout_ranges(const void* layout, int chunk,
                     std::vector<std::pair<size_t, size_t>>* ranges) const override {
    inner_->layout_ranges(layout, chunk, ranges);
  }

 private:
  std::unique_ptr<Codec> inner_;
  Where where_;
};

// The start-up check finds one wrong bit in one family's fused hop or finish, names that family,
// and passes a maker against itself.
TEST(HostPathCheck, FindsOneWrongBitAndNamesWhere) {
  auto scalar = [](const char* spec) {
    const ThreadHostIsa on_scalar(HostIsa::kScalar);
    std::string error;
    return make_codec(spec, &error);
  };
  std::string difference;
  EXPECT_TRUE(codec_makers_agree(scalar, scalar, &difference)) << difference;
  for (const char* family : {"dynamiq", "mxfp8"})
    for (auto where : {OneWrongBit::Where::kFusedHop, OneWrongBit::Where::kFinish}) {
      auto faulty = [&](const char* spec) -> std::unique_ptr<Codec> {
        std::unique_ptr<Codec> c = scalar(spec);
        if (std::strncmp(spec, family, std::strlen(family)) != 0) return c;
        return std::make_unique<OneWrongBit>(std::move(c), where);
      };
      difference.clear();
      EXPECT_FALSE(codec_makers_agree(scalar, faulty, &difference)) << family;
      // The first difference: the wrong byte itself, or a finish refusing a corrupted payload.
      EXPECT_EQ(difference.rfind(family, 0), 0u) << difference;
      EXPECT_NE(difference.find(", FP32: "), std::string::npos) << difference;
    }
  // A codec missing from one maker is a difference too.
  auto none = [](const char*) { return std::unique_ptr<Codec>(); };
  EXPECT_FALSE(codec_makers_agree(scalar, none, &difference));
  EXPECT_NE(difference.find("made by one maker only"), std::string::npos) << difference;
}

// The check's problem reaches every width's lookup: the widths kernels/host_path_check.cc says
// each of its DynamiQ specs gives. A budget or plan change that left a width out would leave that
// width's vector code unchecked (under QEMU the 8-bit lookups are what differ).
TEST(HostPathCheck, ItsProblemReachesEveryWidth) {
  auto count = [](const char* spec, int bits) {
    const std::vector<int> widths = host_path_check_widths(spec);
    EXPECT_FALSE(widths.empty()) << spec;
    return std::count(widths.begin(), widths.end(), bits);
  };
  EXPECT_GT(count("dynamiq:5", 2), 0);
  EXPECT_GT(count("dynamiq:5", 4), 0);
  EXPECT_GT(count("dynamiq:5", 8), 0);
  // Every super-group but the poisoned one.
  const std::vector<int> fixed = host_path_check_widths("dynamiq:9.5:widths=fixed:eps8=0.4");
  EXPECT_EQ(count("dynamiq:9.5:widths=fixed:eps8=0.4", 8) + 1, static_cast<long>(fixed.size()));
  EXPECT_GT(count("dynamiq:7", 8), 0);
  EXPECT_GT(count("dynamiq:7", 16), 0);
  EXPECT_GT(count("dynamiq:5:levels=uniform:scales=flat:w16=0", 2), 0);
  EXPECT_GT(count("dynamiq:5:levels=uniform:scales=flat:w16=0", 8), 0);
  EXPECT_TRUE(host_path_check_widths("mxfp8").empty());
}

// Every path this CPU has passes its start-up check (on a real CPU they all write the same bytes).
TEST(HostPathCheck, EveryPathThisCpuHasPasses) {
  for (HostIsa isa : {HostIsa::kAvx2, HostIsa::kAvx512}) {
    if (!host_isa_cpu_has(isa)) continue;
    std::string difference;
    EXPECT_TRUE(host_path_gives_scalar_bytes(isa, &difference))
        << host_isa_name(isa) << ": " << difference;
  }
}

}  // namespace
}  // namespace dq
