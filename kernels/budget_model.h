// The error-targeted budget (DYNAMIQ_BITS=auto, docs/ENGINE.md section 10): a model of the vNMSE
// a DynamiQ all-reduce will have at each budget of a fixed ladder, and of MXFP8's and MXFP6's on
// the same data, from nothing but the all-reduced statistics every rank holds identically (per
// super-group: the sums of the workers' means, of their sums of squares and of "all zero").
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
// The codec `spec` ("mxfp8", "mxfp6" or a "dynamiq:<bits>") for a codec part of `count` elements
// cut into `chunks` chunk messages over `n_workers`: a DynamiQ codec's plan (`plan` unused, may be
// null, for MX) and whether it fits: its codec keeps its budget and every chunk message holds
// kMinSuperGroupsPerChunk super-groups (codec.h), the rule by which the engine passes a call
// through (over_budget) whatever its codec. False when the spec names no such codec or it cannot
// plan this part. The engine (per bucket) and the tools (dynamiq-predict, dq_auto_choose) all
// decide here, so that they choose alike.
bool plan_budget_codec(std::string_view spec, size_t count, int chunks, int n_workers,
                       DynamiqPlan* plan, bool* fits);
// The same for candidate c (candidate_spec(c)).
inline bool plan_candidate(int c, size_t count, int chunks, int n_workers, DynamiqPlan* plan,
                           bool* fits) {
  return plan_budget_codec(candidate_spec(c), count, chunks, n_workers, plan, fits);
}
// The relative rounding error of the MX codec `spec` ("mxfp8", "mxfp6"); 0 for any other codec.
double mx_rounding_error(std::string_view spec);
// The hop profile (budget_math.h) of a schedule: its tables, owned, and a view of them. The
// schedule is the compressed stage's: flat, the schedule over every rank; two-level
// (DYNAMIQ_HIERARCHY=node), the schedule over the nodes that each shard's rail runs, with the
// node sums' statistics and n_workers = nodes in StatsSummary::load: the exact sums inside a node
// round nothing (FP32), so the model counts inter-node hops only (tools/sim/two_level.h; held to
// the simulator by BudgetModel.TwoLevelPredictionWithinBoundOfTheSimulator).
struct HopTables {
  std::vector<double> linear, square;  // n_workers + 1 entries: m = 0 .. n_workers
  HopProfile view() const { return HopProfile{linear.data(), square.data()}; }
};
HopTables hop_profile(const topo::Schedule& schedule);
// "mxfp8", "mxfp6" or "vnmse:X" with X a decimal in (0, 10] (case-insensitive names).
bool parse_budget_target(std::string_view text, BudgetTarget* out);
std::string budget_target_name(const BudgetTarget& t);

// One codec part's statistics (a pipeline block, or a reduce-scatter chunk), summarised once in
// O(S + keys): per BF16 energy key, the super-groups and their fixed-point energies, cumulated
// from the largest key down (budget_math.h), so that a budget's prediction is a bisection of
// O(1) steps.
class StatsSummary {
 public:
  // reduced: the stats_words() BF16 statistics words of a tensor of `count` elements summed
  // over `n_workers`, whose schedule has the hop profile `hop` (n_workers + 1
  // entries). False (no prediction) when a statistic is not finite: a poisoned super-group, or
  // an energy that overflowed.
  bool load(const uint16_t* reduced, size_t count, int n_workers, const HopProfile& hop);
  // The widths the codec planned as `plan` gives these statistics (the same bisection on the
  // same float comparisons as build_dynamiq_layout) and the expected squared error of the result
  // (units of the data squared).
  double dynamiq_error(const DynamiqPlan& plan, WidthCounts* widths) const {
    return part_plan_error(sums(), plan, widths);
  }
  // The expected squared error of an MX format with relative rounding error k.
  double mx_error(double k) const { return part_mx_error(sums(), k); }
  // Expected energy of the exact sum: the vNMSE's denominator.
  double energy() const { return part_energy(sums()); }
  size_t supergroups() const { return static_cast<size_t>(count_[0]); }
  BudgetSums sums() const {
    return BudgetSums{count_.data(), hop_centred_.data(), hop_mean_.data(), centred_, mean_, unit_};
  }

 private:
  // kEnergyKeys + 1 entries each (see BudgetSums); all zero when nothing is loaded.
  std::vector<uint64_t> count_ = std::vector<uint64_t>(kEnergyKeys + 1, 0);
  std::vector<uint64_t> hop_centred_ = std::vector<uint64_t>(kEnergyKeys + 1, 0);
  std::vector<uint64_t> hop_mean_ = std::vector<uint64_t>(kEnergyKeys + 1, 0);
  uint64_t centred_ = 0, mean_ = 0;
  double unit_ = 1.0;
};

// Predicts every candidate for a call made of `parts` (their summaries; per part, the plan of
// each rung, plans[part][rung], and whether each candidate fits, fits[part][candidate]: a
// candidate with no entry does not) and chooses the one with the fewest bits whose vNMSE meets
// the target; when none does, the one with the smallest predicted vNMSE.
void predict_budget(const std::vector<const StatsSummary*>& parts,
                    const std::vector<std::vector<DynamiqPlan>>& plans,
                    const std::vector<std::vector<bool>>& fits, const BudgetTarget& target,
                    BudgetPrediction* out);

// The predicted vNMSE of a call sent in an MX format of relative rounding error k: -1 when the
// parts are empty.
double predict_mx_vnmse(const std::vector<const StatsSummary*>& parts, double k);

// The predicted vNMSE of one plan alone (for a fixed budget): -1 when the parts are empty.
double predict_vnmse(const std::vector<const StatsSummary*>& parts,
                     const std::vector<const DynamiqPlan*>& plans, WidthCounts* widths);

// A call's prediction as the engine enqueues it (Device::predict_budget), on the host: each of
// the job's parts loaded from `reduced` and accumulated in order, then finish_budget(); the same
// bits as the kernel of kernels/cuda/budget.cu. kBudgetNoPrediction when a statistic is not
// finite.
void run_budget_job(const BudgetJob& job, const uint16_t* reduced, BudgetResult* out);

}  // namespace dq
