// The error-targeted budget (DYNAMIQ_BITS=auto, docs/ENGINE.md section 10): a model of the vNMSE
// a DynamiQ all-reduce will have at each budget of a fixed ladder, and of MXFP8's and MXFP6's on
// the same data, from nothing but the all-reduced statistics every rank holds identically (per
// super-group: the sum of the workers' means and the sum of their sums of squares).
//
// Every rank must choose the same budget, so everything here is a pure function of those bytes:
// integer sums, IEEE +, -, *, / in double in a fixed order (no libm, no reduction whose order
// depends on threads or ranks), and the width allocation replays the codec's own float
// comparisons. The arithmetic is kernels/budget_math.h, which the CUDA kernel shares.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/budget_math.h"
#include "kernels/dynamiq_layout.h"
#include "topo/schedule.h"

namespace dq {

// The codec spec of a candidate: "mxfp8", "mxfp6", or a rung's "dynamiq:<bits>".
std::string candidate_spec(int c);
// The relative rounding error of the MX codec `spec` ("mxfp8", "mxfp6"); 0 for any other codec.
double mx_rounding_error(std::string_view spec);
// The hop profile (budget_math.h) of a schedule.
HopProfile hop_profile(const topo::Schedule& schedule);
// "mxfp8", "mxfp6" or "vnmse:X" with X a decimal in (0, 10] (case-insensitive names).
bool parse_budget_target(std::string_view text, BudgetTarget* out);
std::string budget_target_name(const BudgetTarget& t);

// One codec part's statistics (a pipeline block, or a reduce-scatter chunk), summarised once in
// O(S + keys): per BF16 energy key, the super-groups and their fixed-point energies, cumulated
// from the largest key down (budget_math.h), so that a budget's prediction is a bisection of
// O(1) steps.
class StatsSummary {
 public:
  // reduced: 2 BF16 words per super-group (summed means, summed sums of squares) of a tensor of
  // `count` elements summed over `n_workers`. False (no prediction) when a statistic is not
  // finite: a poisoned super-group, or an energy that overflowed.
  bool load(const uint16_t* reduced, size_t count, int n_workers);
  // The widths the codec planned as `plan` gives these statistics (the same bisection on the
  // same float comparisons as build_dynamiq_layout) and the expected squared error of the result
  // (units of the data squared).
  double dynamiq_error(const DynamiqPlan& plan, const HopProfile& hop, WidthCounts* widths) const {
    return part_plan_error(sums(), plan, hop, widths);
  }
  // The expected squared error of an MX format with relative rounding error k.
  double mx_error(double k, const HopProfile& hop) const { return part_mx_error(sums(), k, hop); }
  // Expected energy of the exact sum: the vNMSE's denominator.
  double energy() const { return part_energy(sums()); }
  size_t supergroups() const { return static_cast<size_t>(count_[0]); }
  BudgetSums sums() const {
    return BudgetSums{count_.data(), centred_.data(), mean_.data(), unit_};
  }

 private:
  // kEnergyKeys + 1 entries each (see BudgetSums); all zero when nothing is loaded.
  std::vector<uint64_t> count_ = std::vector<uint64_t>(kEnergyKeys + 1, 0);
  std::vector<uint64_t> centred_ = std::vector<uint64_t>(kEnergyKeys + 1, 0);
  std::vector<uint64_t> mean_ = std::vector<uint64_t>(kEnergyKeys + 1, 0);
  double unit_ = 1.0;
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

// A call's prediction as the engine enqueues it (Device::predict_budget), on the host: each of
// the job's parts loaded from `reduced` and accumulated in order, then finish_budget(); the same
// bits as the kernel of kernels/cuda/budget.cu. kBudgetNoPrediction when a statistic is not
// finite.
void run_budget_job(const BudgetJob& job, const uint16_t* reduced, BudgetResult* out);

}  // namespace dq
