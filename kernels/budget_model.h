// The error-targeted budget (DYNAMIQ_BITS=auto, docs/ENGINE.md section 10): a model of the vNMSE
// a DynamiQ all-reduce will have at each budget of a fixed ladder, and of MXFP8's and MXFP6's on
// the same data, from nothing but the all-reduced statistics every rank holds identically (per
// super-group: the sum of the workers' means and the sum of their sums of squares).
//
// Every rank must choose the same budget, so everything here is a pure function of those bytes:
// IEEE +, -, *, / in double in a fixed order (no libm, no reduction whose order depends on threads
// or ranks), and the width allocation replays the codec's own float comparisons.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/dynamiq_layout.h"
#include "topo/schedule.h"

namespace dq {

// The ladder of budgets auto chooses from: 3, 3.5, ..., 8 bits per coordinate (metadata
// included, as DYNAMIQ_BITS).
inline constexpr int kLadderRungs = 11;
constexpr double ladder_bits(int rung) { return 3.0 + 0.5 * rung; }

// Auto's candidates: the ladder's rungs 0..kLadderRungs-1, then the MX formats a call falls back
// to when no rung that costs fewer bits meets the target. On dense buckets whose super-groups
// share one scale, DynamiQ needs about 8.6 bits to beat MXFP8's error (docs/RESULTS.md section
// 17), so "never worse than MXFP8" means sending such a bucket as MXFP8 (8.25 bits). Candidates
// are ordered by bits, not by index: MXFP6 (6.25) sits between the rungs 6 and 6.5.
inline constexpr int kCandidateMxfp6 = kLadderRungs;
inline constexpr int kCandidateMxfp8 = kLadderRungs + 1;
inline constexpr int kCandidates = kLadderRungs + 2;
constexpr bool candidate_is_mx(int c) { return c >= kLadderRungs; }
// Bits per coordinate of one copy: the rung's budget; MX: 8 or 6 bits per element plus an E8M0
// exponent per 32.
constexpr double candidate_bits(int c) {
  return c == kCandidateMxfp8 ? 8.25 : c == kCandidateMxfp6 ? 6.25 : ladder_bits(c);
}
// The codec spec of an MX candidate ("mxfp8", "mxfp6"); a rung's is "dynamiq:<bits>".
std::string candidate_spec(int c);

// Expected squared error of one rounding of a super-group, as a fraction of the energy (sum of
// squares) rounded. Derived for values that are Gaussian within a super-group (docs/ENGINE.md
// section 10; tools/sim/derive_error_constants.py recomputes them): DynamiQ's stochastic rounding
// of widths 2, 4, 8 with the default level tables (eps 0.23, 0.30, 0.05) and hierarchical scales
// (BF16 unit rounded up, UINT8 group factors rounded up), BF16 stochastic rounding for width 16;
// MX round-to-nearest-even with a shared E8M0 exponent per 32 values.
inline constexpr double kRoundingError[4] = {0.70368, 0.013509, 4.424e-05, 5.5199e-06};
inline constexpr double kRoundingErrorMxfp8 = 8.6307e-04;      // E4M3
inline constexpr double kRoundingErrorMxfp6 = 2.9144e-03;      // E3M2 (the codec "mxfp6")
// The relative rounding error of the MX codec `spec` ("mxfp8", "mxfp6"); 0 for any other codec.
double mx_rounding_error(std::string_view spec);

// How one coordinate's roundings compound along a schedule: over the compressions of one chunk
// (every node of its in-tree compresses once; the sink's compression feeds the all-gather),
// linear = sum of (contributors / n) and square = sum of (contributors / n)^2, averaged over
// the chunks. With workers' deviations independent, a partial sum of k workers holds k/n of the
// centred energy and (k/n)^2 of the mean's. Ring: linear = (n + 1) / 2.
struct HopProfile {
  double linear = 1.0;
  double square = 1.0;
};
HopProfile hop_profile(const topo::Schedule& schedule);

// DYNAMIQ_TARGET: the error auto must meet. mxfp8 / mxfp6: that format's predicted vNMSE on the
// same statistics; vnmse:X: X itself.
struct BudgetTarget {
  enum class Kind : uint8_t { kMxfp8, kMxfp6, kVnmse };
  Kind kind = Kind::kMxfp8;
  double vnmse = 0;  // kVnmse only
};
// "mxfp8", "mxfp6" or "vnmse:X" with X a decimal in (0, 10] (case-insensitive names).
bool parse_budget_target(std::string_view text, BudgetTarget* out);
std::string budget_target_name(const BudgetTarget& t);

// Super-groups per width (2, 4, 8, 16), by width_index().
struct WidthCounts {
  uint64_t n[4] = {0, 0, 0, 0};
};

// One codec part's statistics (a pipeline block, or a reduce-scatter chunk), summarised once in
// O(S) (a counting sort of the BF16 width keys) so that every budget's prediction costs a few
// binary searches.
class StatsSummary {
 public:
  // reduced: 2 BF16 words per super-group (summed means, summed sums of squares) of a tensor of
  // `count` elements summed over `n_workers`. False (no prediction) when a statistic is not
  // finite: a poisoned super-group, or an energy that overflowed.
  bool load(const uint16_t* reduced, size_t count, int n_workers);
  // The widths the codec planned as `plan` gives these statistics (the same bisection on the
  // same float comparisons as build_dynamiq_layout) and the expected squared error of the result
  // (units of the data squared).
  double dynamiq_error(const DynamiqPlan& plan, const HopProfile& hop, WidthCounts* widths) const;
  // The expected squared error of an MX format with relative rounding error k.
  double mx_error(double k, const HopProfile& hop) const;
  // Expected energy of the exact sum: the vNMSE's denominator.
  double energy() const { return energy_; }
  size_t supergroups() const { return count_.back(); }

 private:
  // The distinct values of the codec's width key F_j (a BF16 value), descending, and from the
  // largest down to each: the super-groups (count_[k] over the first k values), their centred
  // energy C_j and their mean's energy c_j M_j^2 (each of size values + 1, starting at 0).
  std::vector<float> value_;
  std::vector<uint64_t> count_;
  std::vector<double> centred_;
  std::vector<double> mean_;
  double energy_ = 0;
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

// Predicts every candidate for a call made of `parts` (their summaries; per part, the plan of
// each rung, plans[part][rung], and whether each candidate fits, fits[part][candidate]: a
// candidate with no entry does not) and chooses the one with the fewest bits whose vNMSE meets
// the target; when none does, the one with the smallest predicted vNMSE. All parts share `hop`.
void predict_budget(const std::vector<const StatsSummary*>& parts,
                    const std::vector<std::vector<DynamiqPlan>>& plans,
                    const std::vector<std::vector<bool>>& fits, const HopProfile& hop,
                    const BudgetTarget& target, BudgetPrediction* out);

// The predicted vNMSE of a call sent in an MX format of relative rounding error k: -1 when the
// parts are empty.
double predict_mx_vnmse(const std::vector<const StatsSummary*>& parts, double k,
                        const HopProfile& hop);

// The predicted vNMSE of one plan alone (for a fixed budget): -1 when the parts are empty.
double predict_vnmse(const std::vector<const StatsSummary*>& parts,
                     const std::vector<const DynamiqPlan*>& plans, const HopProfile& hop,
                     WidthCounts* widths);

}  // namespace dq
