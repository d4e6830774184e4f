// The budget model of DYNAMIQ_BITS=auto (kernels/budget_model.h, docs/ENGINE.md section 10):
// the widths it replays are the codec's, its choice is monotone in the target and a pure function
// of the statistics' bytes, a non-finite statistic gives no prediction, and its vNMSE is within a
// bound of the simulator's on fixed seeds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/budget_model.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/stats_sum.h"
#include "tools/sim/auto_choice.h"
#include "tools/sim/gradients.h"
#include "tools/sim/simulate.h"
#include "tools/sim/two_level.h"
#include "topo/schedule.h"

namespace dq {
namespace {

struct Case {
  sim::Matrix m;
  topo::Schedule sched;
  std::vector<const float*> rows;
  size_t d = 0;
  std::vector<uint16_t> stats;  // reduced, as the engine's all-reduce gives them
  HopTables hop;
};

// The reduced statistics of c's rows, as the engine's all-reduce gives them.
void reduce_stats(Case* c) {
  std::string error;
  auto codec = make_codec("dynamiq:5", &error);
  const int n = c->sched.n_workers;
  EXPECT_EQ(codec->plan(c->d, c->sched.n_chunks, n), Status::kOk);
  StatsSum sum(codec->stats_words(), codec->stats_byte_sum_words());
  std::vector<uint16_t> local(codec->stats_words());
  for (const float* row : c->rows) {
    EXPECT_EQ(codec->local_stats(ConstTensor{row, DType::kF32, c->d}, local.data()), Status::kOk);
    sum.add(local.data());
  }
  c->stats.assign(codec->stats_words(), 0);
  sum.result(c->stats.data(), false);
}

// Synthetic gradients of `n` workers (independent deviations: the model's assumption unless
// `shared` says otherwise) through `topo`, with their reduced statistics. owners > 0: each
// super-group is kept in `owners` workers (chosen by the super-group's index) and zero in the
// rest, as an embedding row is non-zero only where a worker's batch used its token.
Case make_case(int n, topo::Kind topo, double spread, double shared, uint64_t seed,
               size_t d = 1 << 18, int owners = 0) {
  Case c;
  sim::SyntheticSpec spec;
  spec.rows = static_cast<size_t>(n);
  spec.cols = d;
  spec.spread = spread;
  spec.shared = shared;
  spec.seed = seed;
  sim::make_synthetic(spec, &c.m);
  EXPECT_EQ(topo::make_schedule(topo, n, &c.sched), Status::kOk);
  for (int r = 0; r < n; ++r) c.rows.push_back(c.m.row(r));
  c.d = d;
  for (size_t j = 0; owners > 0 && j * 256 < d; ++j) {
    const int first = static_cast<int>((j * 7919) % static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      if ((r - first + n) % n < owners) continue;
      float* row = c.m.data.data() + static_cast<size_t>(r) * c.m.cols + j * 256;
      std::fill(row, row + std::min<size_t>(256, d - j * 256), 0.0f);
    }
  }
  reduce_stats(&c);
  c.hop = hop_profile(c.sched);
  return c;
}

std::unique_ptr<Codec> planned(double bits, const Case& c, DynamiqPlan* plan) {
  std::string error;
  char spec[32];
  std::snprintf(spec, sizeof spec, "dynamiq:%g", bits);
  auto codec = make_codec(spec, &error);
  EXPECT_EQ(codec->plan(c.d, c.sched.n_chunks, c.sched.n_workers), Status::kOk);
  DynamiqOptions options;
  EXPECT_TRUE(dynamiq_parameters(*codec, &options, plan));
  return codec;
}

// with_mx: the MX fallbacks are candidates too (the engine's auto); without, the ladder alone.
BudgetPrediction predict(const Case& c, const BudgetTarget& target, bool with_mx = false) {
  StatsSummary s;
  EXPECT_TRUE(s.load(c.stats.data(), c.d, c.sched.n_workers, c.hop.view()));
  std::vector<std::vector<DynamiqPlan>> plans(1, std::vector<DynamiqPlan>(kLadderRungs));
  std::vector<std::vector<bool>> fits(1, std::vector<bool>(with_mx ? kCandidates : kLadderRungs));
  for (int r = 0; r < kLadderRungs; ++r) {
    auto codec = planned(ladder_bits(r), c, &plans[0][r]);
    fits[0][r] = codec->fits_budget();
  }
  for (int r = kLadderRungs; with_mx && r < kCandidates; ++r) fits[0][r] = true;
  BudgetPrediction p;
  predict_budget({&s}, plans, fits, target, &p);
  return p;
}

// The profile by enumeration: every placement of the m non-zero workers, every node of every
// chunk's tree, which adds error when its own values are non-zero or two or more of its
// children's subtrees hold non-zero workers, weighted by the non-zero workers X under it.
void enumerated_profile(const topo::Schedule& s, int m, double* linear, double* square) {
  const int n = s.n_workers;
  double sum_x = 0, sum_x2 = 0, placements = 0;
  for (uint32_t set = 0; set < (1u << n); ++set) {
    if (__builtin_popcount(set) != m) continue;
    placements += 1;
    for (const topo::ChunkTree& tree : s.trees) {
      // Subtree counts by walking every node's ancestors (small n: clarity over speed).
      std::vector<int> under(tree.nodes.size(), 0);
      for (size_t v = 0; v < tree.nodes.size(); ++v)
        if (set >> tree.nodes[v].worker & 1u)
          for (int a = static_cast<int>(v); a >= 0; a = tree.nodes[a].parent) ++under[a];
      for (size_t v = 0; v < tree.nodes.size(); ++v) {
        int busy_children = 0;
        for (int c : tree.nodes[v].children) busy_children += under[c] > 0 ? 1 : 0;
        const bool own = set >> tree.nodes[v].worker & 1u;
        if (!own && busy_children < 2) continue;
        sum_x += under[v];
        sum_x2 += static_cast<double>(under[v]) * under[v];
      }
    }
  }
  const double norm = placements * static_cast<double>(s.trees.size());
  *linear = sum_x / (norm * m);
  *square = sum_x2 / (norm * m * m);
}

TEST(BudgetModel, HopProfileOfRingAndButterfly) {
  for (int n : {2, 3, 4, 8, 16}) {
    topo::Schedule s;
    ASSERT_EQ(topo::make_schedule(topo::Kind::kRing, n, &s), Status::kOk);
    const HopTables h = hop_profile(s);
    ASSERT_EQ(h.linear.size(), static_cast<size_t>(n) + 1);
    // Dense: every node of a ring chunk compresses once, holding 1, 2, ..., n workers.
    EXPECT_NEAR(h.linear[n], (n + 1) / 2.0, 1e-12) << n;
    EXPECT_NEAR(h.square[n], (n + 1) * (2.0 * n + 1) / (6.0 * n), 1e-12) << n;
    // m non-zero workers: only their nodes round, holding 1, ..., m of them.
    for (int m = 1; m <= n; ++m) EXPECT_NEAR(h.linear[m], (m + 1) / 2.0, 1e-12) << n << " " << m;
    EXPECT_NEAR(h.linear[1], 1.0, 1e-12);  // one owner: one rounding, whatever the hops
    EXPECT_NEAR(h.square[1], 1.0, 1e-12);
  }
  topo::Schedule s;
  ASSERT_EQ(topo::make_schedule(topo::Kind::kButterfly, 8, &s), Status::kOk);
  // Butterfly of 8: 4 nodes of 1, 2 of 2, 1 of 4 and the sink of 8 per chunk: 1 + log2(8) / 2.
  EXPECT_NEAR(hop_profile(s).linear[8], 2.5, 1e-12);
  EXPECT_NEAR(hop_profile(s).linear[1], 1.0, 1e-12);
}

// The closed form (hypergeometric moments per node shape) against enumeration, for rings and
// butterflies with and without a power-of-two size.
TEST(BudgetModel, HopProfileMatchesEnumeration) {
  for (topo::Kind kind : {topo::Kind::kRing, topo::Kind::kButterfly})
    for (int n : {2, 3, 4, 5, 6, 7, 8, 12}) {
      topo::Schedule s;
      ASSERT_EQ(topo::make_schedule(kind, n, &s), Status::kOk);
      const HopTables h = hop_profile(s);
      for (int m = 1; m <= n; ++m) {
        double linear = 0, square = 0;
        enumerated_profile(s, m, &linear, &square);
        EXPECT_NEAR(h.linear[m], linear, 1e-9 * linear)
            << topo::kind_name(kind) << " n " << n << " m " << m;
        EXPECT_NEAR(h.square[m], square, 1e-9 * square)
            << topo::kind_name(kind) << " n " << n << " m " << m;
      }
    }
}

// The model replays the codec's width allocation: the same count of each width as the layout
// the codec builds from the same statistics, at every rung.
TEST(BudgetModel, WidthsAreTheCodecs) {
  for (double spread : {0.0, 1.0, 2.5}) {
    const Case c = make_case(4, topo::Kind::kRing, spread, 0.0, 11);
    StatsSummary s;
    ASSERT_TRUE(s.load(c.stats.data(), c.d, 4, c.hop.view()));
    for (int r = 0; r < kLadderRungs; ++r) {
      DynamiqPlan plan;
      auto codec = planned(ladder_bits(r), c, &plan);
      ASSERT_EQ(codec->agree(c.stats.data(), 0), Status::kOk);
      const DynamiqLayoutView v = dynamiq_layout(*codec);
      uint64_t codec_widths[4] = {0, 0, 0, 0};
      for (size_t j = 0; j < v.n_supergroups; ++j) ++codec_widths[width_index(v.widths[j])];
      WidthCounts model;
      s.dynamiq_error(plan, &model);
      for (int w = 0; w < 4; ++w)
        EXPECT_EQ(model.n[w], codec_widths[w])
            << "spread " << spread << ", " << ladder_bits(r) << " bits, width class " << w;
    }
  }
}

// A tighter target never gives a smaller budget; a loose one gives the smallest rung, an
// impossible one the largest.
TEST(BudgetModel, LadderChoiceIsMonotoneInTheTarget) {
  for (double spread : {0.0, 1.0}) {
    const Case c = make_case(4, topo::Kind::kRing, spread, 0.0, 5);
    int previous = -1;
    for (double x : {5.0, 1.0, 0.3, 0.1, 0.03, 0.01, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5, 1e-7}) {
      const BudgetPrediction p = predict(c, BudgetTarget{BudgetTarget::Kind::kVnmse, x});
      EXPECT_GE(p.rung, previous) << "vnmse:" << x;
      if (p.rung < kLadderRungs - 1) {
        EXPECT_LE(p.vnmse[p.rung], x) << "vnmse:" << x;
      }
      if (p.rung > 0) {
        EXPECT_GT(p.vnmse[p.rung - 1], x) << "vnmse:" << x;  // the smallest rung
      }
      previous = p.rung;
    }
    EXPECT_EQ(predict(c, BudgetTarget{BudgetTarget::Kind::kVnmse, 10.0}).rung, 0);
    EXPECT_EQ(predict(c, BudgetTarget{BudgetTarget::Kind::kVnmse, 1e-9}).rung, kLadderRungs - 1);
    // MXFP6's target is looser than MXFP8's.
    EXPECT_LE(predict(c, BudgetTarget{BudgetTarget::Kind::kMxfp6, 0}).rung,
              predict(c, BudgetTarget{BudgetTarget::Kind::kMxfp8, 0}).rung);
  }
}

// The MX fallbacks: on data without scale locality no rung of 8 bits or fewer meets MXFP8's
// error, so auto sends MXFP8 (the format's own error is the target: met with equality); with
// locality a rung meets it with fewer bits. Whatever the target, the choice is the candidate
// with the fewest bits among those predicted to meet it, or the least error when none does.
TEST(BudgetModel, FallsBackToMxOnlyWhenNoCheaperRungMeetsTheTarget) {
  const BudgetTarget mxfp8{BudgetTarget::Kind::kMxfp8, 0};
  const Case dense = make_case(4, topo::Kind::kRing, 0.0, 0.0, 5);
  const BudgetPrediction d = predict(dense, mxfp8, true);
  EXPECT_EQ(d.rung, kCandidateMxfp8);
  EXPECT_EQ(d.vnmse[kCandidateMxfp8], d.target);
  EXPECT_GT(d.vnmse[kLadderRungs - 1], d.target);  // 8 bits of DynamiQ: worse than MXFP8 here
  EXPECT_EQ(candidate_spec(d.rung), "mxfp8");
  EXPECT_EQ(candidate_bits(d.rung), 8.25);
  const Case local = make_case(4, topo::Kind::kRing, 2.0, 0.0, 5);
  const BudgetPrediction l = predict(local, mxfp8, true);
  EXPECT_LT(l.rung, kLadderRungs);
  EXPECT_LT(candidate_bits(l.rung), 8.25);
  EXPECT_LE(l.vnmse[l.rung], l.target);
  for (const Case* c : {&dense, &local})
    for (double x : {1.0, 0.1, 0.01, 3e-3, 1e-3, 3e-4, 1e-4, 1e-6}) {
      const BudgetPrediction p = predict(*c, BudgetTarget{BudgetTarget::Kind::kVnmse, x}, true);
      bool any = false;
      for (int k = 0; k < kCandidates; ++k) {
        ASSERT_GE(p.vnmse[k], 0.0) << k;  // every candidate fits these sizes
        if (p.vnmse[k] > x) continue;
        any = true;
        EXPECT_GE(candidate_bits(k), candidate_bits(p.rung)) << "vnmse:" << x << ": " << k;
      }
      if (any) {
        EXPECT_LE(p.vnmse[p.rung], x) << "vnmse:" << x;
      } else {
        for (int k = 0; k < kCandidates; ++k) EXPECT_GE(p.vnmse[k], p.vnmse[p.rung]) << k;
      }
    }
  // Without the MX entries in `fits` (a caller of the ladder alone), MX is never chosen.
  EXPECT_EQ(predict(dense, mxfp8, false).rung, kLadderRungs - 1);
}

// One rule decides which candidates a part may use, for the engine's buckets and the tools'
// predictions alike (plan_budget_codec): the codec keeps its budget and every chunk message holds
// kMinSuperGroupsPerChunk super-groups, MX included, since the engine passes a smaller part
// through whatever its codec. The tools once let MX fit any part.
TEST(BudgetModel, CandidatesFitByTheEnginesRule) {
  const int n = 4, chunks = 4;
  const size_t small = kMinSuperGroupsPerChunk * 256 * chunks - 256;  // one super-group short
  const size_t large = 4 * kMinSuperGroupsPerChunk * 256 * chunks + 77;
  for (int c = 0; c < kCandidates; ++c) {
    for (size_t count : {small, large}) {
      DynamiqPlan plan;
      bool fits = count != small;  // the opposite of what is expected
      ASSERT_TRUE(plan_candidate(c, count, chunks, n, &plan, &fits)) << candidate_spec(c);
      std::string error;
      auto codec = make_codec(candidate_spec(c), &error);
      ASSERT_EQ(codec->plan(count, chunks, n), Status::kOk);
      EXPECT_EQ(fits, count == large && codec->fits_budget()) << candidate_spec(c) << " " << count;
      if (candidate_is_mx(c)) continue;
      DynamiqPlan direct;
      DynamiqOptions options;
      ASSERT_TRUE(dynamiq_parameters(*codec, &options, &direct));
      EXPECT_EQ(plan.count, direct.count);
      EXPECT_EQ(plan.capacity, direct.capacity);
      EXPECT_EQ(plan.stride, direct.stride);
      EXPECT_EQ(std::memcmp(plan.record, direct.record, sizeof plan.record), 0);
    }
  }
  // The large part: the 5-bit rung and both MX formats fit.
  DynamiqPlan plan;
  bool fits = false;
  ASSERT_TRUE(plan_budget_codec("dynamiq:5", large, chunks, n, &plan, &fits));
  EXPECT_TRUE(fits);
  ASSERT_TRUE(plan_budget_codec("mxfp6", large, chunks, n, nullptr, &fits));
  EXPECT_TRUE(fits);
  EXPECT_FALSE(plan_budget_codec("nonsense:3", large, chunks, n, nullptr, &fits));
  // dq_auto_choose's and dynamiq-predict's prediction of the small part: no candidate (the
  // engine passes it through), where MXFP8 used to be chosen.
  const Case tiny = make_case(n, topo::Kind::kRing, 2.0, 0.0, 11, small);
  ASSERT_EQ(tiny.sched.n_chunks, chunks);
  BudgetPrediction p;
  std::string error;
  ASSERT_EQ(sim::predict_auto(tiny.rows, tiny.d, tiny.sched,
                              BudgetTarget{BudgetTarget::Kind::kMxfp8, 0}, &p, &error),
            Status::kOk)
      << error;
  for (int c = 0; c < kCandidates; ++c) EXPECT_EQ(p.vnmse[c], -1.0) << candidate_spec(c);
  const Case big = make_case(n, topo::Kind::kRing, 2.0, 0.0, 11, large);
  ASSERT_EQ(sim::predict_auto(big.rows, big.d, big.sched,
                              BudgetTarget{BudgetTarget::Kind::kMxfp8, 0}, &p, &error),
            Status::kOk);
  EXPECT_GE(p.vnmse[kCandidateMxfp8], 0.0);
  EXPECT_GE(p.vnmse[2], 0.0);  // the 4-bit rung
}

// Every rank computes from the same bytes: the prediction is identical bit for bit whatever
// else the process did (a fresh summary, a different order of calls), and the rung follows.
TEST(BudgetModel, ChoiceIsAPureFunctionOfTheStatistics) {
  const Case a = make_case(8, topo::Kind::kButterfly, 1.0, 0.0, 3);
  const Case b = make_case(8, topo::Kind::kButterfly, 1.0, 0.0, 3);
  ASSERT_EQ(a.stats, b.stats);
  const BudgetTarget t{BudgetTarget::Kind::kMxfp8, 0};
  const BudgetPrediction p = predict(a, t);
  predict(make_case(8, topo::Kind::kRing, 2.0, 0.5, 9), t);  // unrelated work in between
  const BudgetPrediction q = predict(b, t);
  EXPECT_EQ(p.rung, q.rung);
  EXPECT_EQ(std::memcmp(p.vnmse, q.vnmse, sizeof p.vnmse), 0);
  EXPECT_EQ(std::memcmp(&p.target, &q.target, sizeof p.target), 0);
}

// A non-finite energy (a NaN or Inf in some rank's input): no prediction, so the engine uses the
// fixed default. A non-finite mean alone is a sum of finite means that overflowed: predicted. A
// non-zero count out of range (a bad peer word) counts as every worker: the prediction of dense
// data.
TEST(BudgetModel, NonFiniteStatisticsGiveNoPrediction) {
  Case c = make_case(4, topo::Kind::kRing, 1.0, 0.0, 2);
  StatsSummary s;
  EXPECT_TRUE(s.load(c.stats.data(), c.d, 4, c.hop.view()));
  const double dense = s.mx_error(kRoundingErrorMxfp8);
  for (uint16_t bad : {uint16_t{0x7fc0}, uint16_t{0x7f80}, uint16_t{0xff80}}) {
    std::vector<uint16_t> stats = c.stats;
    stats[stat_word(3, kStatEnergy)] = bad;
    EXPECT_FALSE(s.load(stats.data(), c.d, 4, c.hop.view())) << bad;
    stats = c.stats;
    stats[stat_word(3, kStatMean)] = bad;
    EXPECT_TRUE(s.load(stats.data(), c.d, 4, c.hop.view())) << bad;
  }
  // The packed count word of super-groups 2 and 3 (4 workers: two to a word): non-finite, not an
  // integer (0.5), or above the 8 bits two counts can sum to (384).
  const size_t n_sg = (c.d + 255) / 256;
  ASSERT_EQ(zero_counts_per_word(4), 2);
  for (uint16_t bad :
       {uint16_t{0x7fc0}, uint16_t{0x7f80}, uint16_t{0xff80}, uint16_t{0x3f00}, uint16_t{0x43c0}}) {
    std::vector<uint16_t> stats = c.stats;
    stats[zero_count_word(n_sg, 3, 4)] = bad;
    EXPECT_TRUE(s.load(stats.data(), c.d, 4, c.hop.view())) << bad;
    // 4 of 4 contributors already; the mean then counts as rounded in the same total.
    EXPECT_NEAR(s.mx_error(kRoundingErrorMxfp8), dense, 1e-12 * dense) << bad;
  }
}

// The prediction holds over the whole finite range (kernels/dynamiq_range.h): the same data
// times 2^e predicts the error of unit scale (within 1.5x) and the same width split (the 8-bit
// share within a factor of 2). Before, energies above about 2^128 were not finite: no
// prediction at all; below about 2^-75 they flushed to 0.
TEST(BudgetModel, PredictionHoldsOverTheWholeRange) {
  Case c = make_case(4, topo::Kind::kRing, 1.0, 0.5, 3);
  DynamiqPlan plan;
  planned(5.0, c, &plan);
  auto predicted = [&](WidthCounts* w) {
    StatsSummary s;
    EXPECT_TRUE(s.load(c.stats.data(), c.d, 4, c.hop.view()));
    return predict_vnmse({&s}, {&plan}, w);
  };
  WidthCounts unit_widths;
  const double unit = predicted(&unit_widths);
  ASSERT_GT(unit, 0.0);
  ASSERT_GT(unit_widths.n[2], 0u);
  const std::vector<float> original = c.m.data;
  for (int e : {-130, -100, 60, 100}) {
    for (size_t i = 0; i < original.size(); ++i) c.m.data[i] = std::ldexp(original[i], e);
    reduce_stats(&c);
    WidthCounts w;
    const double v = predicted(&w);
    EXPECT_GT(v, unit / 1.5) << "2^" << e;
    EXPECT_LT(v, unit * 1.5) << "2^" << e;
    EXPECT_GE(2 * w.n[2], unit_widths.n[2]) << "2^" << e;
    EXPECT_LE(w.n[2], 2 * unit_widths.n[2]) << "2^" << e;
  }
}

TEST(BudgetModel, TargetParsing) {
  BudgetTarget t;
  EXPECT_TRUE(parse_budget_target("MXFP8", &t));
  EXPECT_EQ(t.kind, BudgetTarget::Kind::kMxfp8);
  EXPECT_TRUE(parse_budget_target("vnmse:2.5e-3", &t));
  EXPECT_EQ(t.kind, BudgetTarget::Kind::kVnmse);
  EXPECT_DOUBLE_EQ(t.vnmse, 2.5e-3);
  EXPECT_EQ(budget_target_name(t), "vnmse:0.0025");
  for (const char* bad : {"", "mxfp4", "vnmse", "vnmse:", "vnmse:-1", "vnmse:0", "vnmse:nan",
                          "vnmse:inf", "vnmse:1x", "vnmse:20"})
    EXPECT_FALSE(parse_budget_target(bad, &t)) << bad;
}

// Every budget in `budgets` and the MX formats in `mx`, predicted from c's statistics, against the
// simulator: predicted / measured within [0.6, 1.6]. `what` names the case in a failure.
void expect_prediction_within_bound(const Case& c, const std::vector<double>& budgets,
                                    const std::vector<std::string>& mx, const std::string& what) {
  StatsSummary s;
  ASSERT_TRUE(s.load(c.stats.data(), c.d, c.sched.n_workers, c.hop.view()));
  auto check = [&](const std::string& spec, double predicted) {
    std::string error;
    auto codec = make_codec(spec, &error);
    sim::SimResult r;
    ASSERT_EQ(sim::simulate_allreduce(*codec, c.sched, c.rows, c.d, sim::SimOptions{}, nullptr, &r),
              Status::kOk);
    const double ratio = predicted / r.vnmse;
    EXPECT_TRUE(ratio >= 0.6 && ratio <= 1.6)
        << spec << " " << what << ": predicted " << predicted << ", measured " << r.vnmse;
  };
  for (double bits : budgets) {
    DynamiqPlan plan;
    planned(bits, c, &plan);
    char spec[32];
    std::snprintf(spec, sizeof spec, "dynamiq:%g", bits);
    check(spec, predict_vnmse({&s}, {&plan}, nullptr));
  }
  for (const std::string& spec : mx) check(spec, s.mx_error(mx_rounding_error(spec)) / s.energy());
}

// The model against the simulator on fixed seeds (docs/results/budget.md has the full
// validation): predicted / measured within [0.6, 1.6] for each fixed budget 4..8 and for MXFP8
// and MXFP6, ring and butterfly, 4 and 8 workers, independent deviations.
TEST(BudgetModel, PredictionWithinBoundOfTheSimulator) {
  for (int n : {4, 8})
    for (topo::Kind topo : {topo::Kind::kRing, topo::Kind::kButterfly})
      for (double spread : {0.0, 1.0})
        expect_prediction_within_bound(
            make_case(n, topo, spread, 0.0, 1), {4, 5, 6, 7, 8}, {"mxfp8", "mxfp6"},
            std::string(topo::kind_name(topo)) + " n=" + std::to_string(n) + " spread " +
                std::to_string(spread));
}

// Sparse super-groups, as the word embedding's: each non-zero in 1 or 3 of 16 workers. The hops
// that add zeros round nothing (docs/results/budget.md: a dense hop profile over-predicted
// such data 2-12x, and before sparse super-groups kept their mean the zero workers' hops shifted
// the partial sums by -mu and re-rounded them: DynamiQ 5-7 bits measured 1.7-2.2x the
// one-rounding prediction on the ring); with the all-zero counts the prediction stays within
// [0.6, 1.6].
TEST(BudgetModel, SparseSuperGroupsWithinBoundOfTheSimulator) {
  for (int owners : {1, 3})
    for (topo::Kind topo : {topo::Kind::kRing, topo::Kind::kButterfly})
      expect_prediction_within_bound(
          make_case(16, topo, 1.0, 0.0, 4, 1 << 17, owners), {4, 5, 6, 8}, {"mxfp8"},
          std::string(topo::kind_name(topo)) + " owners " + std::to_string(owners));
}

// The two-level shape (tools/sim/two_level.h) on synthetic data: the model counts the compressed
// stage's hops, which run over the nodes. Per shard, the summary the engine's rail forms: the
// node sums' statistics, n_workers = nodes and the hop profile of the schedule over the nodes.
// Predicted / measured within [0.6, 1.6] for each fixed budget and MXFP8, as for the flat shape.
// Counting the ranks instead (every rank's statistics and the profile of a schedule over all of
// them, the flat model) predicts the ring of nodes x 2 ranks at least 1.5x higher, and without
// super-group locality (spread 0, where the model is tightest) beyond that band.
void expect_two_level_within_bound(int nodes, int local, topo::Kind topo, double spread) {
  const int n = nodes * local;
  const size_t d = 1 << 18;
  Case flat = make_case(n, topo, spread, 0.0, 5, d);  // the rows, and the ranks' statistics
  topo::Schedule sched;
  ASSERT_EQ(topo::make_schedule(topo, nodes, &sched), Status::kOk);
  const HopTables hop = hop_profile(sched);
  std::vector<std::vector<float>> sums;
  sim::node_sums(flat.rows, d, nodes, local, &sums);
  const size_t shard = sim::two_level_shard_elems(d, local);
  std::vector<std::unique_ptr<StatsSummary>> owned;
  std::vector<const StatsSummary*> parts;
  std::vector<size_t> counts;
  for (size_t begin = 0; begin < d; begin += shard) {
    std::vector<const float*> rail;
    for (const auto& s : sums) rail.push_back(s.data() + begin);
    counts.push_back(std::min(shard, d - begin));
    std::string error;
    auto codec = make_codec("dynamiq:5", &error);
    ASSERT_EQ(codec->plan(counts.back(), sched.n_chunks, nodes), Status::kOk);
    const std::vector<uint16_t> stats = sim::reduced_stats(*codec, rail, counts.back());
    owned.push_back(std::make_unique<StatsSummary>());
    ASSERT_TRUE(owned.back()->load(stats.data(), counts.back(), nodes, hop.view()));
    parts.push_back(owned.back().get());
  }
  const std::string what = std::string(topo::kind_name(topo)) + " " + std::to_string(nodes) +
                           " x " + std::to_string(local) + " spread " + std::to_string(spread);
  auto measured = [&](const std::string& spec) {
    sim::SimResult r;
    EXPECT_EQ(sim::simulate_two_level_allreduce(spec, sched, local, flat.rows, d, sim::SimOptions{},
                                                nullptr, &r),
              Status::kOk);
    return r.vnmse;
  };
  for (double bits : {4.0, 5.0, 6.0, 8.0}) {
    std::vector<DynamiqPlan> plans(parts.size());
    std::vector<const DynamiqPlan*> plan_of;
    for (size_t i = 0; i < parts.size(); ++i) {
      bool fits = false;
      std::string error;
      ASSERT_EQ(sim::auto_rung_plan(bits, counts[i], sched, &plans[i], &fits, &error), Status::kOk);
      plan_of.push_back(&plans[i]);
    }
    char spec[32];
    std::snprintf(spec, sizeof spec, "dynamiq:%g", bits);
    const double m = measured(spec);
    const double ratio = predict_vnmse(parts, plan_of, nullptr) / m;
    EXPECT_TRUE(ratio >= 0.6 && ratio <= 1.6) << spec << " " << what << ": ratio " << ratio;
    if (bits == 5.0 && topo == topo::Kind::kRing) {
      // The flat model, counting every rank's hop, on the same call.
      StatsSummary ranks;
      ASSERT_TRUE(ranks.load(flat.stats.data(), d, n, flat.hop.view()));
      DynamiqPlan plan;
      planned(bits, flat, &plan);
      const double rank_ratio = predict_vnmse({&ranks}, {&plan}, nullptr) / m;
      EXPECT_GT(rank_ratio / ratio, 1.5) << what << ": counting ranks " << rank_ratio;
      if (spread == 0.0) {
        EXPECT_GT(rank_ratio, 1.6) << what << ": counting ranks " << rank_ratio;
      }
    }
  }
  const double mx = predict_mx_vnmse(parts, mx_rounding_error("mxfp8")) / measured("mxfp8");
  EXPECT_TRUE(mx >= 0.6 && mx <= 1.6) << "mxfp8 " << what << ": ratio " << mx;
}

TEST(BudgetModel, TwoLevelPredictionWithinBoundOfTheSimulator) {
  for (topo::Kind topo : {topo::Kind::kRing, topo::Kind::kButterfly})
    for (double spread : {0.0, 1.0}) {
      expect_two_level_within_bound(4, 2, topo, spread);
      expect_two_level_within_bound(8, 2, topo, spread);
    }
}

}  // namespace
}  // namespace dq
