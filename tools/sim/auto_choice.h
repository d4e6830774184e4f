// DYNAMIQ_BITS=auto off the engine: the statistics all-reduce and the budget model's choice for
// a call of known worker rows, as the engine makes it from the all-reduced statistics (the engine
// uses the previous call's of the same bucket). Shared by dynamiq-predict and the C API
// (dq_auto_choose, which the convergence study's auto scheme calls).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/budget_model.h"
#include "kernels/codec.h"
#include "topo/schedule.h"

namespace dq::sim {

// The statistics all-reduce as the simulator and the engine do it: each worker's BF16 words
// summed in rank order in FP32, rounded to BF16.
std::vector<uint16_t> reduced_stats(Codec& codec, const std::vector<const float*>& rows, size_t d);

// The plan of the DynamiQ budget `bits` for d elements on `sched`, and whether it fits (the codec's
// budget and the chunk size the schedule needs).
Status auto_rung_plan(double bits, size_t d, const topo::Schedule& sched, DynamiqPlan* plan,
                      bool* fits, std::string* error);

// auto's prediction for a call of `rows` (d elements each, one per worker of sched): every
// candidate's predicted vNMSE and the one chosen (candidate_spec(out->rung) names its codec).
// The candidates are the engine's (plan_budget_codec): for a part too small for every one, each
// vNMSE is -1 and the rung the last, where the engine passes the call through (over_budget).
// kInvalidArgument when a statistic is not finite (the engine then keeps the fixed default).
Status predict_auto(const std::vector<const float*>& rows, size_t d, const topo::Schedule& sched,
                    const BudgetTarget& target, BudgetPrediction* out, std::string* error);
// The same from the call's loaded statistics summary (of reduced_stats), for a caller that has
// already made it.
Status predict_auto(const StatsSummary& summary, size_t d, const topo::Schedule& sched,
                    const BudgetTarget& target, BudgetPrediction* out, std::string* error);

}  // namespace dq::sim
