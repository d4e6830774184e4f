#include "kernels/budget_model.h"

#include <algorithm>
#include <cctype>
#include <cfloat>
#include <cstdlib>
#include <map>
#include <memory>

#include "common/c_locale.h"
#include "common/float_env.h"
#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_math.h"

namespace dq {

namespace {

// Expectations over X ~ Hypergeometric(population, successes, draws): the non-zero workers among
// `draws` given slots when `successes` of `population` slots are non-zero, uniformly placed.
struct Moments {
  double first, second;  // E[X], E[X^2]
};
Moments hypergeometric(int population, int successes, int draws) {
  const double n = population, k = successes, d = draws;
  const double mean = d * k / n;
  const double var = population > 1 ? d * (k / n) * ((n - k) / n) * ((n - d) / (n - 1)) : 0.0;
  return Moments{mean, var + mean * mean};
}

// A node of an in-tree up to its shape: its subtree's size, then its children's subtree sizes,
// sorted. Nodes of the same shape add the same expected error.
using NodeShape = std::vector<int>;

}  // namespace

HopTables hop_profile(const topo::Schedule& s) {
  const int n = s.n_workers;
  HopTables t;
  if (s.trees.empty() || n < 1) {  // no schedule: one rounding of everything
    t.linear.assign(static_cast<size_t>(std::max(n, 1)) + 1, 1.0);
    t.square = t.linear;
    return t;
  }
  // Every node's shape, counted over all chunks. Subtree sizes in one pass from the leaves:
  // a node's size is final once its children's are (reverse breadth-first order from the sink).
  std::map<NodeShape, int64_t> shapes;
  for (const topo::ChunkTree& tree : s.trees) {
    std::vector<int> order{tree.sink};
    for (size_t i = 0; i < order.size(); ++i)
      for (int c : tree.nodes[order[i]].children) order.push_back(c);
    std::vector<int> size(tree.nodes.size(), 1);
    for (size_t i = order.size(); i-- > 0;)
      for (int c : tree.nodes[order[i]].children) size[order[i]] += size[c];
    for (int v : order) {
      NodeShape shape{size[v]};
      for (int c : tree.nodes[v].children) shape.push_back(size[c]);
      std::sort(shape.begin() + 1, shape.end());
      ++shapes[shape];
    }
  }
  t.linear.assign(static_cast<size_t>(n) + 1, 0.0);
  t.square.assign(static_cast<size_t>(n) + 1, 0.0);
  std::vector<double> none(static_cast<size_t>(n) + 1);  // P(r given slots are all zero)
  const double trees = static_cast<double>(s.trees.size());
  for (int m = 1; m <= n; ++m) {
    none[0] = 1.0;
    for (int r = 1; r <= n; ++r)
      none[r] = n - m - (r - 1) <= 0 ? 0.0 : none[r - 1] * (n - m - (r - 1)) / (n - (r - 1));
    double linear = 0, square = 0;
    for (const auto& [shape, copies] : shapes) {
      // X = non-zero workers in the subtree. The node adds no error when its own values are zero
      // and at most one child's subtree holds non-zero workers: subtract, per child i, E[X; the
      // rest of the subtree (r = size - size_i slots) zero], where X is then the child's count,
      // hypergeometric over the n - r other slots.
      const Moments all = hypergeometric(n, m, shape[0]);
      double first = all.first, second = all.second;
      for (size_t i = 1; i < shape.size(); ++i) {
        const int r = shape[0] - shape[i];
        if (none[r] == 0.0) continue;
        const Moments child = hypergeometric(n - r, m, shape[i]);
        first -= none[r] * child.first;
        second -= none[r] * child.second;
      }
      linear += static_cast<double>(copies) * first;
      square += static_cast<double>(copies) * second;
    }
    t.linear[m] = linear / (trees * m);
    t.square[m] = square / (trees * m * static_cast<double>(m));
  }
  t.linear[0] = t.linear[1];  // unused: a super-group counts at least one contributor
  t.square[0] = t.square[1];
  return t;
}

bool parse_budget_target(std::string_view text, BudgetTarget* out) {
  const std::string t = lower_ascii(text);
  if (t == "mxfp8") return *out = BudgetTarget{BudgetTarget::Kind::kMxfp8, 0}, true;
  if (t == "mxfp6") return *out = BudgetTarget{BudgetTarget::Kind::kMxfp6, 0}, true;
  if (t.rfind("vnmse:", 0) != 0) return false;
  const std::string x = t.substr(6);
  // A plain decimal or exponent form: digits, one dot, an optional e[+-]digits.
  if (x.empty() || x.size() > 32) return false;
  for (char c : x)
    if (!std::isdigit(static_cast<unsigned char>(c)) && c != '.' && c != 'e' && c != '-' &&
        c != '+')
      return false;
  char* end = nullptr;
  const double v = strtod_c(x.c_str(), &end);
  if (end != x.c_str() + x.size() || !(v > 0.0) || v > 10.0) return false;
  *out = BudgetTarget{BudgetTarget::Kind::kVnmse, v};
  return true;
}

std::string budget_target_name(const BudgetTarget& t) {
  if (t.kind == BudgetTarget::Kind::kMxfp8) return "mxfp8";
  if (t.kind == BudgetTarget::Kind::kMxfp6) return "mxfp6";
  return "vnmse:" + number_text(t.vnmse, 6);
}

bool StatsSummary::load(const uint16_t* reduced, size_t count, int n_workers,
                        const HopProfile& hop) {
  std::fill(count_.begin(), count_.end(), 0);
  std::fill(hop_centred_.begin(), hop_centred_.end(), 0);
  std::fill(hop_mean_.begin(), hop_mean_.end(), 0);
  centred_ = mean_ = 0;
  unit_ = 1.0;
  const size_t n_sg = (count + 255) / 256;
  if (n_workers < 1 || (n_sg > 0 && reduced == nullptr) || hop.linear == nullptr ||
      hop.square == nullptr)
    return false;
  // Two passes: the largest energy fixes the fixed-point scale, then the sums per key. Integer
  // sums: the kernel's atomics (any order) give the same bits.
  double max_value = 0;
  int largest = INT32_MIN;  // floor(log2) of the largest energy: the width keys' shift
  SupergroupEnergy e;
  for (size_t j = 0; j < n_sg; ++j) {
    if (!supergroup_energy(supergroup_stat_words(reduced, n_sg, j, n_workers), j, n_sg, count,
                           n_workers, hop, 0, &e))
      return false;
    max_value = std::max(max_value, largest_energy(e));
    if (e.energy > 0.0) largest = std::max(largest, floor_log2(e.energy));
  }
  const double scale = fixed_point_scale(max_value, n_sg);
  const int shift = width_key_shift(largest);
  for (size_t j = 0; j < n_sg; ++j) {
    supergroup_energy(supergroup_stat_words(reduced, n_sg, j, n_workers), j, n_sg, count, n_workers,
                      hop, shift, &e);
    ++count_[e.key];
    hop_centred_[e.key] += to_fixed_point(e.hop_centred, scale);
    hop_mean_[e.key] += to_fixed_point(e.hop_mean, scale);
    centred_ += to_fixed_point(e.centred, scale);
    mean_ += to_fixed_point(e.mean, scale);
  }
  for (size_t k = kEnergyKeys; k-- > 0;) {  // entry k: keys >= k
    count_[k] += count_[k + 1];
    hop_centred_[k] += hop_centred_[k + 1];
    hop_mean_[k] += hop_mean_[k + 1];
  }
  unit_ = 1.0 / scale;  // a power of two: exact
  return true;
}

double predict_mx_vnmse(const std::vector<const StatsSummary*>& parts, double k) {
  if (parts.empty()) return -1.0;
  double err = 0, energy = 0;
  for (const StatsSummary* s : parts) {
    err += s->mx_error(k);
    energy += s->energy();
  }
  return energy > 0 ? err / energy : 0.0;
}

double mx_rounding_error(std::string_view spec) {
  return spec == "mxfp8" ? kRoundingErrorMxfp8 : spec == "mxfp6" ? kRoundingErrorMxfp6 : 0.0;
}

std::string candidate_spec(int c) {
  if (c == kCandidateMxfp8) return "mxfp8";
  if (c == kCandidateMxfp6) return "mxfp6";
  return "dynamiq:" + number_text(ladder_bits(c), 6);
}

bool plan_budget_codec(std::string_view spec, size_t count, int chunks, int n_workers,
                       DynamiqPlan* plan, bool* fits) {
  std::string error;
  const std::unique_ptr<Codec> codec = make_codec(spec, &error);
  if (!codec || codec->plan(count, chunks, n_workers) != Status::kOk) return false;
  DynamiqOptions options;
  if (mx_rounding_error(spec) == 0.0 && !dynamiq_parameters(*codec, &options, plan)) return false;
  *fits = codec->fits_budget() && chunks_large_enough(count, chunks);
  return true;
}

void predict_budget(const std::vector<const StatsSummary*>& parts,
                    const std::vector<std::vector<DynamiqPlan>>& plans,
                    const std::vector<std::vector<bool>>& fits, const BudgetTarget& target,
                    BudgetPrediction* out) {
  BudgetJob job;
  job.auto_budget = 1;
  job.target = target;
  job.used_mx = -1;  // candidates only
  BudgetAccumulator acc;
  BudgetPartJob part;
  for (size_t i = 0; i < parts.size(); ++i) {
    for (int r = 0; r < kLadderRungs; ++r)
      part.rungs[r] = static_cast<size_t>(r) < plans[i].size() ? plans[i][r] : DynamiqPlan{};
    for (int c = 0; c < kCandidates; ++c)
      part.fits[c] = static_cast<size_t>(c) < fits[i].size() && fits[i][c] ? 1 : 0;
    PartTerms terms;
    const BudgetSums sums = parts[i]->sums();
    for (int c = 0; c <= kCandidates; ++c) part_term(job, part, sums, c, &terms);
    add_part(job, part, terms, &acc);
  }
  BudgetResult result;
  finish_budget(job, acc, &result);
  *out = result.prediction;
}

double predict_vnmse(const std::vector<const StatsSummary*>& parts,
                     const std::vector<const DynamiqPlan*>& plans, WidthCounts* widths) {
  if (parts.empty()) return -1.0;
  double err = 0, energy = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    err += parts[i]->dynamiq_error(*plans[i], widths);
    energy += parts[i]->energy();
  }
  return energy > 0 ? err / energy : 0.0;
}

void run_budget_job(const BudgetJob& job, const uint16_t* reduced, BudgetResult* out) {
  // In the format's environment whatever the caller's: every rank must choose the same budget.
  const DefaultFloatEnvironment float_env;
  // One summary per thread, reused: its tables are 0.75 MB.
  static thread_local StatsSummary summary;
  BudgetAccumulator acc;
  for (uint32_t i = 0; i < job.n_parts; ++i) {
    const BudgetPartJob& part = job.parts[i];
    if (!summary.load(reduced + part.stats_offset, part.count, job.n_workers, job.hop)) {
      out->state = kBudgetNoPrediction;
      return;
    }
    PartTerms terms;
    const BudgetSums sums = summary.sums();
    for (int c = job.auto_budget ? 0 : kCandidates; c <= kCandidates; ++c)
      part_term(job, part, sums, c, &terms);
    add_part(job, part, terms, &acc);
  }
  finish_budget(job, acc, out);
}

}  // namespace dq
