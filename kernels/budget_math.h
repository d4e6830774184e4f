// The error-targeted budget's arithmetic (DYNAMIQ_BITS=auto, docs/ENGINE.md section 10), shared
// by the host (kernels/budget_model.cc) and the CUDA kernel (kernels/cuda/budget.cu), so that a
// GPU computes the choice itself and every rank, host or GPU, gets the same bits.
//
// Per call part, from the all-reduced statistics: each super-group's energy about its mean and
// its mean's energy, each weighted by how often it is rounded along the schedule (which depends
// on how many workers' super-groups are not all zero), summed per BF16 energy key (the codec's
// width key) as fixed-point integers, then cumulated from the largest key down. Integer sums do
// not depend on the order of addition, so a kernel's atomics and the host's loop agree exactly. One
// plan's predicted error is then a bisection over the codec's threshold in which each step is O(1).
#pragma once
#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/bf16.h"
#include "kernels/dynamiq_layout.h"
#include "kernels/dynamiq_range.h"
#include "kernels/hd.h"

namespace dq {

// ---- the candidates auto chooses from ---------------------------------------------------------
// The ladder of budgets: 3, 3.5, ..., 8 bits per coordinate (metadata included, as DYNAMIQ_BITS).
inline constexpr int kLadderRungs = 11;
DQ_HD constexpr double ladder_bits(int rung) {
  return 3.0 + 0.5 * rung;
}
// Then the MX formats a call falls back to when no rung that costs fewer bits meets the target.
// On dense buckets whose super-groups share one scale, DynamiQ needs about 8.6 bits to beat
// MXFP8's error (docs/results/budget.md, the MX fallback), so "never worse than MXFP8" means
// sending such a bucket as MXFP8 (8.25 bits). Candidates are ordered by bits, not by index:
// MXFP6 (6.25) sits between the rungs 6 and 6.5.
inline constexpr int kCandidateMxfp6 = kLadderRungs;
inline constexpr int kCandidateMxfp8 = kLadderRungs + 1;
inline constexpr int kCandidates = kLadderRungs + 2;
DQ_HD constexpr bool candidate_is_mx(int c) {
  return c >= kLadderRungs;
}
// Bits per coordinate of one copy: the rung's budget; MX: 8 or 6 bits per element plus an E8M0
// exponent per 32.
DQ_HD constexpr double candidate_bits(int c) {
  return c == kCandidateMxfp8 ? 8.25 : c == kCandidateMxfp6 ? 6.25 : ladder_bits(c);
}

// Expected squared error of one rounding of a super-group, as a fraction of the energy rounded.
// Derived for values that are Gaussian within a super-group (docs/ENGINE.md section 10;
// tools/sim/derive_error_constants.py recomputes them): DynamiQ's stochastic rounding of widths
// 2, 4, 8 with the default level tables (eps 0.23, 0.30, 0.05) and hierarchical scales (BF16
// unit rounded up, UINT8 group factors rounded up), BF16 stochastic rounding for width 16; MX
// round-to-nearest-even with a shared E8M0 exponent per 32 values.
inline constexpr double kRoundingErrorWidth2 = 0.70368;
inline constexpr double kRoundingErrorWidth4 = 0.013509;
inline constexpr double kRoundingErrorWidth8 = 4.424e-05;
inline constexpr double kRoundingErrorWidth16 = 5.5199e-06;
inline constexpr double kRoundingErrorMxfp8 = 8.6307e-04;  // E4M3
inline constexpr double kRoundingErrorMxfp6 = 2.9144e-03;  // E3M2 (the codec "mxfp6")
DQ_HD constexpr double candidate_mx_error(int c) {
  return c == kCandidateMxfp8   ? kRoundingErrorMxfp8
         : c == kCandidateMxfp6 ? kRoundingErrorMxfp6
                                : 0.0;
}

// How one super-group's roundings compound along a schedule, given that m of the n workers'
// super-groups are not all zero (n less the summed all-zero count, dynamiq_layout.h): every node of
// a chunk's in-tree compresses its partial sum once (the sink's compression feeds the all-gather),
// but a partial sum that equals one input already rounded is rounded again to the same values
// (round to nearest is idempotent; stochastic rounding leaves a value on its grid), so a node adds
// error only when its own values are non-zero or two or more of its children's subtrees are. With
// the m non-zero workers placed uniformly at random and their deviations independent of equal
// energy, a partial sum of X of them holds X/m of the centred energy and (X/m)^2 of the mean's:
//   linear[m] = sum over nodes of E[X 1{adds error}] / m,
//   square[m] = sum over nodes of E[X^2 1{adds error}] / m^2,
// averaged over the chunks (kernels/budget_model.cc computes them exactly, hypergeometric
// moments). Ring: linear[m] = (m + 1) / 2; m = n gives the dense profile. Tables of n + 1
// entries (m = 0 .. n), in memory the predicting device reads.
struct HopProfile {
  const double* linear = nullptr;
  const double* square = nullptr;
};

// DYNAMIQ_TARGET: the error auto must meet. mxfp8 / mxfp6: that format's predicted vNMSE on the
// same statistics; vnmse:X: X itself.
struct BudgetTarget {
  enum class Kind : uint8_t { kMxfp8, kMxfp6, kVnmse };
  Kind kind = Kind::kMxfp8;
  double vnmse = 0;  // kVnmse only
};

// Super-groups per width (2, 4, 8, 16), by width_index().
struct WidthCounts {
  uint64_t n[4] = {0, 0, 0, 0};
};

// What auto predicts for one call of a bucket: per candidate, the vNMSE (negative: that
// candidate's plan does not fit the budget) and the widths (none for MX); the target's vNMSE;
// the candidate chosen.
struct BudgetPrediction {
  double vnmse[kCandidates] = {};
  WidthCounts widths[kCandidates];
  double target = 0;
  int rung = kLadderRungs - 1;
};

// ---- one super-group ----------------------------------------------------------------------------
// The width key's values: the finite non-negative BF16 bit patterns 0 .. 0x7F7F.
inline constexpr uint32_t kEnergyKeys = 0x7F80;

struct SupergroupEnergy {
  uint32_t key = 0;        // BF16 pattern of the width key (the codec's key; -0 as 0)
  double energy = 0;       // F_j, the summed sum of squares (kernels/dynamiq_range.h)
  double centred = 0;      // the workers' energy about the sum's mean, estimated (see below)
  double mean = 0;         // the exact sum's mean energy, c_j M_j^2
  int contributors = 1;    // workers whose super-group is not all zero, 1 .. n_workers
  double hop_centred = 0;  // the energy the hops round with the mean subtracted, weighted by
  double hop_mean = 0;     // the hop profile; and the mean's (rounded only at width 16)
};

// Super-group j of a part of `count` elements (n_sg super-groups) summed over `n_workers`, from
// its statistics words `words` (supergroup_stat_words() of the part's reduced statistics; a kernel
// passes the words it loaded): false when the energy is not finite (a poisoned super-group).
// `shift`: the part's width-key shift (width_key_shift() of the largest floor(log2 energy); 0 for
// a first pass). A mean whose sum overflowed is not subtracted by the codec: modelled as 0, not
// dense.
DQ_HD bool supergroup_energy(const SupergroupStatWords& words, size_t j, size_t n_sg, size_t count,
                             int n_workers, const HopProfile& hop, int shift,
                             SupergroupEnergy* out) {
  const float m = bf16_to_f32(words.mean);  // sum of the workers' means
  const float workers = contributing_workers(words.all_zero, n_workers);
  const double f = energy_key(words.energy, workers,
                              static_cast<uint32_t>(j));  // sum of sums of squares
  if (f < 0.0) return false;
  out->energy = f;
  const uint32_t kb = f32_bits(width_key(f, shift)) >> 16;
  out->key = kb < kEnergyKeys ? kb : kEnergyKeys - 1;
  // Workers whose values are all zero: an exact sum (dynamiq_layout.h); a value out of range (a
  // peer's bad word) counts as none: the most roundings.
  out->contributors = static_cast<int>(workers);
  const bool mean_finite = m - m == 0.0f;
  const double c = static_cast<double>(j + 1 == n_sg ? count - 256 * j : 256);
  const double md = mean_finite ? m : 0.0;
  const double cm2 = c * md * md;
  // The contributors' energy about their own means is F - c sum_i mu_i^2 <= F - c M^2 / k (M the
  // sum of the means, k contributors): the estimate assumes their means agree. The exact sum's
  // mean is M.
  const double centred = f - cm2 / out->contributors;
  out->centred = centred > 0.0 ? centred : 0.0;
  out->mean = cm2;
  const double linear = hop.linear[out->contributors], square = hop.square[out->contributors];
  if (supergroup_dense(words.all_zero) && mean_finite) {  // the codec subtracts it (widths 2, 4, 8)
    out->hop_centred = out->centred * linear;
    out->hop_mean = out->mean * square;
  } else {  // no mean subtracted: every width rounds the mean's energy too
    out->hop_centred = out->centred * linear + out->mean * square;
    out->hop_mean = 0.0;
  }
  return true;
}

// The largest of a super-group's energies: what the fixed-point scale must hold.
DQ_HD double largest_energy(const SupergroupEnergy& e) {
  double v = e.centred > e.mean ? e.centred : e.mean;
  v = v > e.hop_centred ? v : e.hop_centred;
  return v > e.hop_mean ? v : e.hop_mean;
}

// The fixed-point scale of a part: 2^s, so that n_sg values of at most `max_value` each, times
// 2^s, sum below 2^63. max_value < 2^(e+1) and n_sg < 2^l give s = 62 - l - e. A super-group
// below 2^-s of the largest is counted as 0; the relative error of a sum is below n_sg^2 2^-62.
DQ_HD double fixed_point_scale(double max_value, uint64_t n_sg) {
  if (!(max_value > 0.0)) return 1.0;
  const int e = floor_log2(max_value);  // kernels/dynamiq_range.h
  int l = 0;
  while (l < 64 && (n_sg >> l) != 0) ++l;
  int s = 62 - l - e;
  s = s < -1022 ? -1022 : s > 1023 ? 1023 : s;
  return pow2d(s);
}

DQ_HD uint64_t to_fixed_point(double value, double scale) {
  return static_cast<uint64_t>(value * scale);  // exact scaling by a power of two, truncated
}

// ---- one part's cumulative sums -----------------------------------------------------------------
// Per key k in [0, kEnergyKeys], the super-groups whose key is at least k (k = kEnergyKeys: none):
// their count and their fixed-point centred and mean energies weighted by the hop profile.
struct KeySums {
  uint64_t count = 0, hop_centred = 0, hop_mean = 0;
};

// A part's sums as dense per-key tables (the host's; kernels/cuda/budget.cu keeps only the keys a
// part has): kEnergyKeys + 1 entries each, cumulated from the largest key down; the part's
// unweighted energies (the vNMSE's denominator); unit = 1 / scale. The functions below take any
// type with at_least(k), centred, mean and unit.
struct BudgetSums {
  const uint64_t* count;
  const uint64_t* hop_centred;
  const uint64_t* hop_mean;
  uint64_t centred, mean;
  double unit;
  DQ_HD KeySums at_least(uint32_t k) const {
    return KeySums{count[k], hop_centred[k], hop_mean[k]};
  }
};

// The distinct keys a part of `count` elements can have: at most one a super-group, and at most
// kEnergyKeys (what a device that keeps only the keys present sizes its memory by).
DQ_HD constexpr uint64_t budget_key_entries(uint64_t count) {
  return (count + 255) / 256 < kEnergyKeys ? (count + 255) / 256 : kEnergyKeys;
}

// The first key whose BF16 value is at least t (t >= 0 or +Inf): keys >= it hold F_j >= t.
DQ_HD uint32_t first_key_at_least(float t) {
  if (!(t > 0.0f)) return 0;
  const uint32_t u = f32_bits(t);
  const uint32_t k = (u >> 16) + ((u & 0xffffu) != 0 ? 1u : 0u);
  return k < kEnergyKeys ? k : kEnergyKeys;
}

template <class Sums>
DQ_HD double part_energy(const Sums& s) {
  return static_cast<double>(s.centred) * s.unit + static_cast<double>(s.mean) * s.unit;
}

// The expected squared error of an MX format of relative rounding error k: no mean subtraction,
// every hop rounds the partial sum whole.
template <class Sums>
DQ_HD double part_mx_error(const Sums& s, double k) {
  const KeySums all = s.at_least(0);
  const double centred = static_cast<double>(all.hop_centred) * s.unit;
  const double mean = static_cast<double>(all.hop_mean) * s.unit;
  return k * (centred + mean);
}

// The first keys of the width classes 16, 8 (and wider) and 4 (and wider) at threshold offset
// theta: build_dynamiq_layout's width_class() on the same float comparisons.
struct WidthCut {
  uint32_t k16, k8, k4;
};
DQ_HD WidthCut width_cut(float theta, bool allow_width16) {
  const float t48 = theta * (257.0f / 131072.0f);
  const float t24 = t48 * (17.0f / 512.0f);
  WidthCut c;
  c.k16 = allow_width16 ? first_key_at_least(theta) : kEnergyKeys;
  const uint32_t k8 = first_key_at_least(t48);
  c.k8 = k8 < c.k16 ? k8 : c.k16;
  const uint32_t k4 = first_key_at_least(t24);
  c.k4 = k4 < c.k8 ? k4 : c.k8;
  return c;
}

// The widths the codec planned as `p` gives the part (build_dynamiq_layout's bisection over the
// threshold's bit pattern) and the expected squared error of the result (units of the data
// squared); the widths are added to *widths.
template <class Sums>
DQ_HD double part_plan_error(const Sums& s, const DynamiqPlan& p, WidthCounts* widths) {
  const uint64_t n_sg = s.at_least(0).count;
  WidthCut cut{kEnergyKeys, kEnergyKeys, kEnergyKeys};  // fixed widths: modelled as all 2-bit
  if (p.variable_widths) {
    const uint64_t budget = dynamiq_record_budget(p);
    uint32_t lo = 0, hi = 0x7f800000u;
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      const WidthCut c = width_cut(f32_from_bits(mid), p.allow_width16);
      const uint64_t n16 = s.at_least(c.k16).count, n8 = s.at_least(c.k8).count;
      const uint64_t n4 = s.at_least(c.k4).count;
      const uint64_t bytes = n16 * static_cast<uint64_t>(p.record[3]) +
                             (n8 - n16) * static_cast<uint64_t>(p.record[2]) +
                             (n4 - n8) * static_cast<uint64_t>(p.record[1]) +
                             (n_sg - n4) * static_cast<uint64_t>(p.record[0]);
      if (bytes <= budget)
        hi = mid;
      else
        lo = mid + 1;
    }
    cut = width_cut(f32_from_bits(lo), p.allow_width16);
  }
  const KeySums s16 = s.at_least(cut.k16), s8 = s.at_least(cut.k8), s4 = s.at_least(cut.k4);
  const KeySums s0 = s.at_least(0);
  if (widths != nullptr) {
    widths->n[3] += s16.count;
    widths->n[2] += s8.count - s16.count;
    widths->n[1] += s4.count - s8.count;
    widths->n[0] += n_sg - s4.count;
  }
  const double u = s.unit;
  const double c16 = static_cast<double>(s16.hop_centred) * u;
  const double m16 = static_cast<double>(s16.hop_mean) * u;
  const double c8 = static_cast<double>(s8.hop_centred - s16.hop_centred) * u;
  const double c4 = static_cast<double>(s4.hop_centred - s8.hop_centred) * u;
  const double c2 = static_cast<double>(s0.hop_centred - s4.hop_centred) * u;
  // Widths 2, 4, 8 round the partial sums less their means (restored exactly); width 16 rounds
  // them whole.
  double e = kRoundingErrorWidth16 * (c16 + m16);
  e += kRoundingErrorWidth8 * c8;
  e += kRoundingErrorWidth4 * c4;
  e += kRoundingErrorWidth2 * c2;
  return e;
}

// ---- a call: its parts in order
// ------------------------------------------------------------------ What a call's prediction needs
// besides the statistics, in memory the device reads (the engine keeps it in mapped memory, written
// before the call's first enqueue). Per part: its geometry, the plan of each rung and which
// candidates fit (auto only), the plan the call used.
struct BudgetPartJob {
  uint64_t count = 0;         // elements of this codec part
  uint64_t stats_offset = 0;  // into the call's statistics words (stats_words() a part)
  DynamiqPlan rungs[kLadderRungs];
  uint8_t fits[kCandidates] = {};
  DynamiqPlan used;  // the call's plan of this part (a DynamiQ call)
};
struct BudgetJob {
  uint32_t n_parts = 0;
  int32_t n_workers = 1;
  uint32_t auto_budget = 0;  // predict every candidate and choose (DYNAMIQ_BITS=auto)
  HopProfile hop;            // n_workers + 1 entries per table
  BudgetTarget target;
  // > 0: the call went as MX of this rounding error; 0: as DynamiQ with the parts' `used` plans;
  // < 0: no plan to predict (a prediction of the candidates alone).
  double used_mx = 0;
  const BudgetPartJob* parts = nullptr;
};
// The prediction, written by the device into mapped memory; the host reads it once the call's
// control all-reduce is absorbed (a control window later).
enum BudgetState : uint32_t { kBudgetPending = 0, kBudgetPredicted = 1, kBudgetNoPrediction = 2 };
struct BudgetResult {
  uint32_t state = kBudgetPending;
  BudgetPrediction prediction;  // auto_budget only
  double used_vnmse = -1;       // the call's own predicted vNMSE
  WidthCounts used_widths;
};

// One part's contribution to the call's sums, computed per candidate (independently: a kernel
// computes them in parallel), then added in part order.
struct PartTerms {
  double energy = 0, target_error = 0, used_error = 0;
  double error[kCandidates] = {};
  WidthCounts widths[kCandidates];
  WidthCounts used_widths;
};

// Term `c` of a part: candidate c < kCandidates (auto only), or c == kCandidates: the energy, the
// target's error (auto only) and the error of the plan the call used (job.used_mx < 0: none).
template <class Sums>
DQ_HD void part_term(const BudgetJob& job, const BudgetPartJob& part, const Sums& s, int c,
                     PartTerms* t) {
  if (c < kCandidates) {
    if (candidate_is_mx(c))
      t->error[c] = part_mx_error(s, candidate_mx_error(c));
    else
      t->error[c] = part_plan_error(s, part.rungs[c], &t->widths[c]);
    return;
  }
  t->energy = part_energy(s);
  if (job.auto_budget) {
    const bool mxfp8 = job.target.kind == BudgetTarget::Kind::kMxfp8;
    t->target_error = part_mx_error(s, mxfp8 ? kRoundingErrorMxfp8 : kRoundingErrorMxfp6);
  }
  if (job.used_mx > 0)
    t->used_error = part_mx_error(s, job.used_mx);
  else if (job.used_mx == 0)
    t->used_error = part_plan_error(s, part.used, &t->used_widths);
}

// Running sums over a call's parts, in part order (the same order on host and device).
struct BudgetAccumulator {
  double energy = 0, target_error = 0, used_error = 0;
  double error[kCandidates] = {};
  uint8_t fits[kCandidates] = {};
  WidthCounts widths[kCandidates];
  WidthCounts used_widths;
  uint32_t parts = 0;
};

DQ_HD void add_widths(const WidthCounts& from, WidthCounts* to) {
  for (int w = 0; w < 4; ++w) to->n[w] += from.n[w];
}

// A part's terms added to the sums every call has (the energy, the target's error, the used
// plan's), and, separately, to candidate c's (auto only; `fits`: the part's fits[c], `first`:
// the call's first part). Each sum is its own over the parts, so a device may add the candidates
// in parallel, each in part order, and get add_part()'s bits.
DQ_HD void add_part_common(const BudgetJob& job, const PartTerms& t, BudgetAccumulator* a) {
  ++a->parts;
  a->energy += t.energy;
  a->used_error += t.used_error;
  add_widths(t.used_widths, &a->used_widths);
  if (job.auto_budget) a->target_error += t.target_error;
}
DQ_HD void add_part_candidate(const PartTerms& t, int c, uint8_t fits, bool first,
                              BudgetAccumulator* a) {
  a->fits[c] = static_cast<uint8_t>((first || a->fits[c]) && fits);
  a->error[c] += t.error[c];
  add_widths(t.widths[c], &a->widths[c]);
}

DQ_HD void add_part(const BudgetJob& job, const BudgetPartJob& part, const PartTerms& t,
                    BudgetAccumulator* a) {
  const bool first = a->parts == 0;
  add_part_common(job, t, a);
  if (!job.auto_budget) return;
  for (int c = 0; c < kCandidates; ++c) add_part_candidate(t, c, part.fits[c], first, a);
}

// The call's predicted vNMSE (of the plan used) and, with auto, every candidate's and the choice:
// the fewest bits meeting the target (no two candidates have the same bits); failing that, the
// smallest error (ties: the lower index). Strict comparisons in index order: one answer for the
// same bytes on every rank.
DQ_HD void finish_budget(const BudgetJob& job, const BudgetAccumulator& a, BudgetResult* out) {
  const bool any = a.parts > 0;
  out->used_vnmse = !any ? -1.0 : a.energy > 0 ? a.used_error / a.energy : 0.0;
  out->used_widths = a.used_widths;
  BudgetPrediction& p = out->prediction;
  p = BudgetPrediction{};
  if (job.auto_budget) {
    if (job.target.kind == BudgetTarget::Kind::kVnmse) {
      p.target = job.target.vnmse;
    } else {
      const double t = !any ? -1.0 : a.energy > 0 ? a.target_error / a.energy : 0.0;
      p.target = t > 0.0 ? t : 0.0;
    }
    for (int c = 0; c < kCandidates; ++c) {
      p.vnmse[c] = !(any && a.fits[c]) ? -1.0 : a.energy > 0 ? a.error[c] / a.energy : 0.0;
      p.widths[c] = a.widths[c];
    }
    int chosen = -1, best = -1;
    for (int c = 0; c < kCandidates; ++c) {
      if (p.vnmse[c] < 0) continue;
      if (best < 0 || p.vnmse[c] < p.vnmse[best]) best = c;
      if (p.vnmse[c] <= p.target && (chosen < 0 || candidate_bits(c) < candidate_bits(chosen)))
        chosen = c;
    }
    p.rung = chosen >= 0 ? chosen : best >= 0 ? best : kLadderRungs - 1;
  }
  out->state = kBudgetPredicted;
}

}  // namespace dq
