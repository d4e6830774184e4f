#include "tools/sim/auto_choice.h"

#include <cstdio>
#include <memory>

#include "kernels/bf16.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/stats_sum.h"

namespace dq::sim {

std::vector<uint16_t> reduced_stats(Codec& codec, const std::vector<const float*>& rows, size_t d) {
  const size_t words = codec.stats_words();
  StatsSum sum(words, codec.stats_byte_sum_words());
  std::vector<uint16_t> local(words), out(words);
  for (const float* r : rows) {
    codec.local_stats(ConstTensor{r, DType::kF32, d}, local.data());
    sum.add(local.data());
  }
  sum.result(out.data(), false);
  return out;
}

Status auto_rung_plan(double bits, size_t d, const topo::Schedule& sched, DynamiqPlan* plan,
                      bool* fits, std::string* error) {
  char spec[32];
  std::snprintf(spec, sizeof spec, "dynamiq:%g", bits);
  if (!plan_budget_codec(spec, d, sched.n_chunks, sched.n_workers, plan, fits)) {
    *error = std::string(spec) + " cannot plan " + std::to_string(d) + " elements";
    return Status::kInvalidArgument;
  }
  return Status::kOk;
}

Status predict_auto(const std::vector<const float*>& rows, size_t d, const topo::Schedule& sched,
                    const BudgetTarget& target, BudgetPrediction* out, std::string* error) {
  // The statistics are the same for every rung (they do not depend on the budget).
  std::unique_ptr<Codec> base = make_codec("dynamiq:5", error);
  if (!base) return Status::kInternal;
  base->plan(d, sched.n_chunks, sched.n_workers);
  const std::vector<uint16_t> stats = reduced_stats(*base, rows, d);
  StatsSummary summary;
  const HopTables hop = hop_profile(sched);
  if (!summary.load(stats.data(), d, sched.n_workers, hop.view())) {
    *error = "a statistic is not finite (non-finite input, or an energy that overflowed)";
    return Status::kInvalidArgument;
  }
  return predict_auto(summary, d, sched, target, out, error);
}

Status predict_auto(const StatsSummary& summary, size_t d, const topo::Schedule& sched,
                    const BudgetTarget& target, BudgetPrediction* out, std::string* error) {
  // One part, planned as the engine plans a bucket's (plan_candidate).
  std::vector<std::vector<DynamiqPlan>> plans(1, std::vector<DynamiqPlan>(kLadderRungs));
  std::vector<std::vector<bool>> fits(1, std::vector<bool>(kCandidates, false));
  for (int c = 0; c < kCandidates; ++c) {
    bool f = false;
    if (!plan_candidate(c, d, sched.n_chunks, sched.n_workers,
                        candidate_is_mx(c) ? nullptr : &plans[0][c], &f)) {
      *error = candidate_spec(c) + " cannot plan " + std::to_string(d) + " elements";
      return Status::kInternal;
    }
    fits[0][c] = f;
  }
  predict_budget({&summary}, plans, fits, target, out);
  return Status::kOk;
}

}  // namespace dq::sim
