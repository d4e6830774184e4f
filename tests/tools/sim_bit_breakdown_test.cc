// dq::sim::bit_breakdown (--bits-breakdown): the parts of one compressed copy add up to the
// codec's bits per coordinate (and, with what the budget's rounding leaves, to the budget), and
// the per-width shares of super-groups and of the squared error each add up to 1.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/dynamiq_layout.h"
#include "tools/sim/bit_breakdown.h"
#include "tools/sim/gradients.h"
#include "tools/sim/simulate.h"
#include "topo/schedule.h"

namespace dq::sim {
namespace {

struct Outcome {
  BitBreakdown bits;
  SimResult result;
  double bits_per_coord = 0;
  size_t capacity = 0, stats_words = 0;
  int workers = 0;
};

// One all-reduce of synthetic gradients, then the breakdown and the per-width error.
Outcome run(const std::string& spec, topo::Kind kind, int n, size_t cols, double spread = 1.0) {
  Matrix m;
  SyntheticSpec syn;
  syn.rows = static_cast<size_t>(n);
  syn.cols = cols;
  syn.spread = spread;
  syn.seed = 11;
  make_synthetic(syn, &m);
  std::vector<const float*> rows;
  for (int r = 0; r < n; ++r) rows.push_back(m.row(r));
  topo::Schedule s;
  EXPECT_EQ(topo::make_schedule(kind, n, &s), Status::kOk);
  std::string err;
  auto codec = make_codec(spec, &err);
  EXPECT_TRUE(codec) << err;
  Outcome out;
  std::vector<float> decoded;
  EXPECT_EQ(simulate_allreduce(*codec, s, rows, cols, SimOptions{}, &decoded, &out.result),
            Status::kOk);
  EXPECT_TRUE(bit_breakdown(*codec, &out.bits, &err)) << err;
  EXPECT_TRUE(
      accumulate_width_error(*codec, rows, n, decoded.data(), ReduceOp::kSum, &out.bits, &err))
      << err;
  out.bits_per_coord = codec->bits_per_coord();
  out.capacity = codec->chunk_capacity();
  out.stats_words = codec->stats_words();
  out.workers = n;
  return out;
}

void expect_consistent(const Outcome& r, double budget, const std::string& what) {
  SCOPED_TRACE(what);
  const BitBreakdown& b = r.bits;
  // Every bit of one copy, exactly, in whole bits.
  EXPECT_EQ(b.copy_bits(), 8 * (2 * r.stats_words + static_cast<uint64_t>(b.chunks) * r.capacity));
  EXPECT_NEAR(b.per_coord(b.copy_bits()), r.bits_per_coord, 1e-12);
  EXPECT_NEAR(b.per_coord(b.copy_bits()), r.result.bits_per_coord, 1e-12);
  const double parts = b.per_coord(b.values) + b.per_coord(b.group_factors) + b.per_coord(b.units) +
                       b.per_coord(b.statistics) + b.per_coord(b.headers) + b.per_coord(b.padding) +
                       b.per_coord(b.slack) + b.unallocated / static_cast<double>(b.count);
  EXPECT_NEAR(parts, budget, 1e-9);
  if (b.budget_honest) {
    EXPECT_GE(b.unallocated, 0);
    // The budget is rounded down to whole bytes, then split into P equal whole-byte messages.
    EXPECT_LT(b.unallocated, 8.0 * (1 + b.chunks));
  }
  // Two words a super-group, and its all-zero count packed with others' (FORMAT.md).
  const uint64_t per = static_cast<uint64_t>(zero_counts_per_word(r.workers));
  EXPECT_EQ(b.statistics, 16u * (2 * b.supergroups + (b.supergroups + per - 1) / per));
  EXPECT_EQ(b.headers, 128u * static_cast<uint64_t>(b.chunks));
  // Shares of super-groups and of the error add up to 1; the error is the simulator's.
  size_t sgs = 0;
  double err = 0, energy = 0;
  for (int w = 0; w < 4; ++w) {
    sgs += b.sg_by_width[w];
    err += b.error_by_width[w] / b.error_total();
    energy += b.energy_by_width[w];
  }
  EXPECT_EQ(sgs, b.supergroups);
  EXPECT_NEAR(err, 1.0, 1e-12);
  EXPECT_NEAR(b.error_total() / energy, r.result.vnmse, 1e-9 * r.result.vnmse);
}

TEST(SimBitBreakdown, PartsSumToTheBudgetAndSharesToOne) {
  for (topo::Kind kind : {topo::Kind::kRing, topo::Kind::kButterfly})
    for (double budget : {3.0, 5.0, 8.0}) {
      char spec[32];
      std::snprintf(spec, sizeof spec, "dynamiq:%g", budget);
      // 400 whole super-groups per chunk of 4, and a partial last one of 100 elements.
      const Outcome r = run(spec, kind, 4, 256 * 1600 + 100);
      expect_consistent(r, budget, std::string(spec) + " " + topo::kind_name(kind));
      EXPECT_TRUE(r.bits.budget_honest);
      // The partial super-group: 156 element codes and, without width 16, 9 of its 16 factors
      // cover nothing.
      EXPECT_GT(r.bits.padding, 0u);
      EXPECT_GT(r.bits.slack, 0u);
    }
}

TEST(SimBitBreakdown, FlatScalesAndWholeSuperGroups) {
  const Outcome r = run("dynamiq:5:scales=flat", topo::Kind::kRing, 4, 256 * 1024);
  expect_consistent(r, 5.0, "flat scales");
  EXPECT_EQ(r.bits.units, 0u);
  EXPECT_EQ(r.bits.padding, 0u);
  size_t narrow = r.bits.sg_by_width[0] + r.bits.sg_by_width[1] + r.bits.sg_by_width[2];
  EXPECT_EQ(r.bits.group_factors, 16u * 16u * narrow);  // 16 BF16 scales per record
}

TEST(SimBitBreakdown, HierarchicalRecordContents) {
  const Outcome r = run("dynamiq:5", topo::Kind::kRing, 4, 256 * 1024);
  const BitBreakdown& b = r.bits;
  size_t narrow = b.sg_by_width[0] + b.sg_by_width[1] + b.sg_by_width[2];
  EXPECT_EQ(b.units, 16u * narrow);
  EXPECT_EQ(b.group_factors, 8u * 16u * narrow);
  uint64_t codes = 0;
  for (int w = 0; w < 4; ++w) codes += 256u * kBreakdownWidths[w] * b.sg_by_width[w];
  EXPECT_EQ(b.values, codes);
}

TEST(SimBitBreakdown, TinyTensorIsNotBudgetHonestButStillAddsUp) {
  const Outcome r = run("dynamiq:5", topo::Kind::kRing, 4, 256 * 8);
  EXPECT_FALSE(r.bits.budget_honest);
  expect_consistent(r, 5.0, "tiny");
  EXPECT_LT(r.bits.unallocated, 0);
}

TEST(SimBitBreakdown, RefusesOtherCodecs) {
  std::string err;
  auto codec = make_codec("mxfp8", &err);
  ASSERT_TRUE(codec);
  ASSERT_EQ(codec->plan(4096, 4, 4), Status::kOk);
  BitBreakdown b;
  EXPECT_FALSE(bit_breakdown(*codec, &b, &err));
  EXPECT_NE(err.find("not a DynamiQ codec"), std::string::npos);
}

}  // namespace
}  // namespace dq::sim
