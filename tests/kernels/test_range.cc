// Every codec over the whole finite range of FP32 and BF16 (docs/FORMAT.md, "Range"): the same
// Gaussian gradients scaled by powers of two from the smallest subnormal to the top of the
// range, summed through real schedules. Where the exact sum is finite (with room: every partial
// sum stays below FLT_MAX / 2) the result is finite and its vNMSE within 1.5x of the same data's
// at unit scale, plus what the format itself cannot resolve (its smallest step, for the
// baselines near the bottom of the range); where the exact sum overflows (an element above
// 2 FLT_MAX) the result holds a non-finite value. A log-scale walk over 1e-30..1e30 across
// super-groups keeps the error of its unit-scale counterpart.
#include <gtest/gtest.h>

#include <array>
#include <cfloat>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_math.h"
#include "kernels/stats_sum.h"
#include "tools/sim/simulate.h"
#include "topo/schedule.h"

namespace dq {
namespace {

using Rows = std::vector<std::vector<float>>;

struct Outcome {
  double vnmse = 0;
  bool all_finite = true;
  bool any_non_finite = false;
  double floor_term = 0;  // the format's resolution, as a vNMSE term (see resolution())
};

// The smallest step a codec can represent after its own scaling, per rounding: DynamiQ scales a
// super-group far from unit scale by a power of two, so only FP32's subnormal step remains (the
// output's rounding); BF16 words stop at 2^-133; an MX block at scale 2^-127 times its smallest
// element step; uniform at a BF16 scale (>= 2^-133) over L levels.
double resolution(const std::string& spec, bool bf16) {
  const double fp32_step = std::ldexp(1.0, bf16 ? -133 : -149);
  if (spec.rfind("dynamiq", 0) == 0) return fp32_step;
  if (spec == "bf16") return std::ldexp(1.0, -133);
  if (spec == "mxfp8") return std::ldexp(1.0, -136);
  if (spec == "mxfp6") return std::ldexp(1.0, -131);
  if (spec == "mxfp6e2m3") return std::ldexp(1.0, -130);
  if (spec == "mxfp4") return std::ldexp(1.0, -128);
  return std::ldexp(1.0, -133);  // uniform: S >= 2^-133, steps S / L with stochastic rounding
}

Outcome run(const std::string& spec, topo::Kind kind, const Rows& rows, bool bf16) {
  std::string err;
  auto codec = make_codec(spec, &err);
  EXPECT_TRUE(codec) << err;
  topo::Schedule s;
  EXPECT_EQ(topo::make_schedule(kind, static_cast<int>(rows.size()), &s), Status::kOk);
  std::vector<const float*> ptrs;
  for (const auto& r : rows) ptrs.push_back(r.data());
  std::vector<float> out;
  sim::SimResult result;
  sim::SimOptions opt;
  EXPECT_EQ(sim::simulate_allreduce(*codec, s, ptrs, rows[0].size(), opt, &out, &result),
            Status::kOk);
  Outcome o;
  double err_sq = 0, exact_sq = 0;
  for (size_t k = 0; k < out.size(); ++k) {
    double exact = 0;
    for (const auto& r : rows) exact += r[k];
    // BF16 data: the result as a BF16 output holds it (round to nearest even).
    const float got = bf16 ? bf16_to_f32(f32_to_bf16_rne(out[k])) : out[k];
    if (!std::isfinite(got)) {
      o.all_finite = false;
      o.any_non_finite = true;
      continue;
    }
    err_sq += (got - exact) * (got - exact);
    exact_sq += exact * exact;
  }
  o.vnmse = exact_sq > 0 ? err_sq / exact_sq : 0;
  // One step per rounding on the longest path (n roundings) and the output's.
  const double step = resolution(spec, bf16) * (static_cast<double>(rows.size()) + 1.0);
  o.floor_term = exact_sq > 0 ? static_cast<double>(out.size()) * step * step / exact_sq : 0;
  return o;
}

Rows gaussian(int n, size_t d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Rows rows(n, std::vector<float>(d));
  for (auto& r : rows)
    for (auto& v : r) v = normal(rng);
  return rows;
}

// rows times 2^e (exact for normal results; rounded where it lands on subnormals; beyond the
// largest finite value of the type, that value), then rounded to BF16 where `bf16`.
Rows scaled(const Rows& base, int e, bool bf16) {
  const double top = bf16 ? static_cast<double>(bf16_to_f32(0x7f7f)) : FLT_MAX;
  Rows rows = base;
  for (auto& r : rows)
    for (auto& v : r) {
      const double x = std::ldexp(static_cast<double>(v), e);
      v = static_cast<float>(std::max(-top, std::min(top, x)));
      if (bf16) v = bf16_to_f32(f32_to_bf16_rne(v));
    }
  return rows;
}

enum class Range { kFinite, kOverflow, kEdge };

// kFinite: every partial sum in any order stays below FLT_MAX / 2 (sum of magnitudes);
// kOverflow: some exact sum exceeds 2 FLT_MAX; kEdge otherwise (not asserted) or an input is Inf.
Range classify(const Rows& rows) {
  double largest_abs_sum = 0, largest_exact = 0;
  for (size_t k = 0; k < rows[0].size(); ++k) {
    double abs_sum = 0, exact = 0;
    for (const auto& r : rows) {
      if (!std::isfinite(r[k])) return Range::kEdge;
      abs_sum += std::fabs(r[k]);
      exact += r[k];
    }
    largest_abs_sum = std::max(largest_abs_sum, abs_sum);
    largest_exact = std::max(largest_exact, std::fabs(exact));
  }
  if (largest_abs_sum < FLT_MAX / 2.0) return Range::kFinite;
  if (largest_exact > 2.0 * static_cast<double>(FLT_MAX)) return Range::kOverflow;
  return Range::kEdge;
}

// The scales swept: every 13th power of two from the bottom, the top 10 one by one (the finite
// edge and the first overflowing scales lie there).
std::vector<int> sweep() {
  std::vector<int> e;
  for (int x = -149; x < 118; x += 13) e.push_back(x);
  for (int x = 118; x <= 127; ++x) e.push_back(x);
  return e;
}

void sweep_codec(const std::string& spec, topo::Kind kind, int n, bool bf16) {
  // kMinSuperGroupsPerChunk super-groups per chunk message: below, DynamiQ's error has a cliff.
  const Rows base = gaussian(n, kMinSuperGroupsPerChunk * 256 * n, 17 + n);
  const Outcome unit = run(spec, kind, scaled(base, 0, bf16), bf16);
  ASSERT_TRUE(unit.all_finite);
  ASSERT_LT(unit.vnmse, 0.2) << spec << ": the unit-scale reference itself is poor";
  int finite_cases = 0, overflow_cases = 0;
  for (int e : sweep()) {
    const Rows rows = scaled(base, e, bf16);
    const Range range = classify(rows);
    if (range == Range::kEdge) continue;
    const Outcome o = run(spec, kind, rows, bf16);
    const std::string what = spec + (bf16 ? " bf16" : " fp32") +
                             (kind == topo::Kind::kRing ? " ring" : " butterfly") +
                             " n=" + std::to_string(n) + " scale 2^" + std::to_string(e);
    if (range == Range::kFinite) {
      ++finite_cases;
      EXPECT_TRUE(o.all_finite) << what;
      EXPECT_LE(o.vnmse, 1.5 * unit.vnmse + o.floor_term)
          << what << ": unit scale " << unit.vnmse << " floor " << o.floor_term;
    } else {
      ++overflow_cases;
      EXPECT_TRUE(o.any_non_finite) << what << ": an exact sum overflows, the result is finite";
    }
  }
  EXPECT_GT(finite_cases, 20) << spec;  // the sweep reached both ends of the range
  EXPECT_GT(overflow_cases, 0) << spec;
  // Unit-scale data but one super-group at 3/4 of the largest finite value in every worker: its
  // exact sums overflow, and so must the result there.
  Rows rows = scaled(base, 0, bf16);
  for (auto& r : rows) std::fill(r.begin() + 3 * 256, r.begin() + 4 * 256, 0.75f * FLT_MAX);
  if (bf16)
    for (auto& r : rows)
      for (auto& v : r) v = bf16_to_f32(f32_to_bf16_rne(v));
  ASSERT_EQ(classify(rows), Range::kOverflow);
  const Outcome o = run(spec, kind, rows, bf16);
  EXPECT_TRUE(o.any_non_finite) << spec << ": one super-group's sums overflow";
}

TEST(Range, DynamiqEveryPowerOfTwoScale) {
  for (bool bf16 : {false, true})
    for (auto kind : {topo::Kind::kRing, topo::Kind::kButterfly})
      for (int n : {4, 16}) sweep_codec("dynamiq:5", kind, n, bf16);
}

TEST(Range, BaselinesEveryPowerOfTwoScale) {
  for (const char* spec : {"bf16", "mxfp8", "mxfp6", "mxfp6e2m3", "mxfp4", "uniform:5"})
    for (bool bf16 : {false, true}) sweep_codec(spec, topo::Kind::kRing, 4, bf16);
}

// The widths the layout gives the same data at other scales: the split of unit scale (the 8-bit
// share within a factor of 2, the 2-bit share no larger by more than 2% of the super-groups).
// Before the width keys' shift, every super-group fell to 2 bits above about 2^56; with keys
// that saturate instead, all tie at 4 bits.
std::array<int, 4> width_counts(const Rows& rows) {
  auto codec = make_codec("dynamiq:5", nullptr);
  const int n = static_cast<int>(rows.size());
  EXPECT_EQ(codec->plan(rows[0].size(), n, n), Status::kOk);
  StatsSum sum(codec->stats_words(), codec->stats_byte_sum_words());
  for (const auto& r : rows) {
    std::vector<uint16_t> local(codec->stats_words());
    EXPECT_EQ(codec->local_stats(ConstTensor{r.data(), DType::kF32, r.size()}, local.data()),
              Status::kOk);
    sum.add(local.data());
  }
  std::vector<uint16_t> reduced(codec->stats_words());
  sum.result(reduced.data(), true);
  std::vector<uint64_t> layout(codec->layout_bytes() / 8);
  EXPECT_EQ(codec->build_layout(reduced.data(), 1, layout.data()), Status::kOk);
  const DynamiqLayoutView v = dynamiq_layout(*codec, layout.data());
  std::array<int, 4> c{};
  for (size_t j = 0; j < v.n_supergroups; ++j) ++c[width_index(v.widths[j])];
  return c;
}

TEST(Range, WidthSplitFollowsUnitScale) {
  for (int n : {4, 16}) {
    const int n_sg = 1024;  // 8-bit super-groups need a budget's slack of 128 bytes each
    const Rows base = gaussian(n, 256 * n_sg, 3);
    const std::array<int, 4> unit = width_counts(base);
    // Some 8-bit super-groups at unit scale with 4 workers (16 leave no slack for them).
    if (n == 4) {
      ASSERT_GT(unit[2], 0) << unit[0] << " " << unit[1] << " " << unit[3];
    }
    for (int e : {-140, -100, -60, 40, 56, 70, 90, 110, 120}) {
      const std::array<int, 4> c = width_counts(scaled(base, e, false));
      EXPECT_GE(2 * c[2], unit[2]) << "n=" << n << " 2^" << e << ": 8-bit " << c[2];
      EXPECT_LE(c[2], 2 * unit[2] + n_sg / 100) << "n=" << n << " 2^" << e << ": 8-bit " << c[2];
      EXPECT_LE(c[0], unit[0] + n_sg / 50) << "n=" << n << " 2^" << e << ": 2-bit " << c[0];
    }
  }
}

// Super-group scales on a log-scale random walk over 1e-30..1e30 (each worker's values at the
// super-group's scale): finite, and the error of the same data brought down to unit scale (a
// power of two: the largest super-groups near 1, those below 2^-149 of them flushed, which
// weigh nothing).
TEST(Range, LogScaleWalkAcrossSuperGroups) {
  for (auto kind : {topo::Kind::kRing, topo::Kind::kButterfly}) {
    const int n = 4;
    const size_t n_sg = kMinSuperGroupsPerChunk * n;
    Rows rows = gaussian(n, n_sg * 256, 5);
    std::mt19937 rng(7);
    double log10_scale = 0, top = -100;
    std::vector<double> scale(n_sg);
    for (size_t j = 0; j < n_sg; ++j) {
      log10_scale += static_cast<double>(static_cast<int>(rng() % 9) - 4) * 1.5;
      log10_scale = std::min(30.0, std::max(-30.0, log10_scale));
      scale[j] = std::pow(10.0, log10_scale);
      top = std::max(top, log10_scale);
    }
    for (auto& r : rows)
      for (size_t k = 0; k < r.size(); ++k)
        r[k] = static_cast<float>(static_cast<double>(r[k]) * scale[k / 256]);
    EXPECT_GT(top, 20.0);  // the walk reaches far beyond what a sum of squares holds
    const int down = -static_cast<int>(std::ceil(top * 3.3219281));
    const Outcome walk = run("dynamiq:5", kind, rows, false);
    const Outcome unit = run("dynamiq:5", kind, scaled(rows, down, false), false);
    EXPECT_TRUE(walk.all_finite);
    EXPECT_LE(walk.vnmse, 1.5 * unit.vnmse) << "unit-scale counterpart " << unit.vnmse;
    EXPECT_LT(walk.vnmse, 0.1);
  }
}

}  // namespace
}  // namespace dq
