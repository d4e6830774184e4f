#include "kernels/budget_model.h"

#include <algorithm>
#include <cctype>
#include <cfloat>
#include <cstdio>
#include <cstdlib>

#include "kernels/bf16.h"
#include "kernels/dynamiq_math.h"

namespace dq {

HopProfile hop_profile(const topo::Schedule& s) {
  HopProfile h{0.0, 0.0};
  if (s.trees.empty() || s.n_workers < 1) return HopProfile{};
  const double n = static_cast<double>(s.n_workers);
  for (const topo::ChunkTree& tree : s.trees) {
    // Contributors of each node: itself plus its subtree. Children precede nothing in
    // particular, so sizes come from a walk to the root from every node.
    std::vector<int> size(tree.nodes.size(), 0);
    for (size_t i = 0; i < tree.nodes.size(); ++i)
      for (int v = static_cast<int>(i); v >= 0; v = tree.nodes[v].parent) ++size[v];
    for (int k : size) {
      const double share = k / n;
      h.linear += share;
      h.square += share * share;
    }
  }
  h.linear /= static_cast<double>(s.trees.size());
  h.square /= static_cast<double>(s.trees.size());
  return h;
}

bool parse_budget_target(std::string_view text, BudgetTarget* out) {
  std::string t(text);
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
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
  const double v = std::strtod(x.c_str(), &end);
  if (end != x.c_str() + x.size() || !(v > 0.0) || v > 10.0) return false;
  *out = BudgetTarget{BudgetTarget::Kind::kVnmse, v};
  return true;
}

std::string budget_target_name(const BudgetTarget& t) {
  if (t.kind == BudgetTarget::Kind::kMxfp8) return "mxfp8";
  if (t.kind == BudgetTarget::Kind::kMxfp6) return "mxfp6";
  char buf[48];
  std::snprintf(buf, sizeof buf, "vnmse:%.6g", t.vnmse);
  return buf;
}

bool StatsSummary::load(const uint16_t* reduced, size_t count, int n_workers) {
  std::fill(count_.begin(), count_.end(), 0);
  std::fill(centred_.begin(), centred_.end(), 0);
  std::fill(mean_.begin(), mean_.end(), 0);
  unit_ = 1.0;
  const size_t n_sg = (count + 255) / 256;
  if (n_workers < 1 || (n_sg > 0 && reduced == nullptr)) return false;
  // Two passes: the largest energy fixes the fixed-point scale, then the sums per key. Integer
  // sums: the kernel's atomics (any order) give the same bits.
  double max_value = 0;
  SupergroupEnergy e;
  for (size_t j = 0; j < n_sg; ++j) {
    if (!supergroup_energy(reduced, j, n_sg, count, n_workers, &e)) return false;
    max_value = std::max(max_value, std::max(e.centred, e.mean));
  }
  const double scale = fixed_point_scale(max_value, n_sg);
  for (size_t j = 0; j < n_sg; ++j) {
    supergroup_energy(reduced, j, n_sg, count, n_workers, &e);
    ++count_[e.key];
    centred_[e.key] += to_fixed_point(e.centred, scale);
    mean_[e.key] += to_fixed_point(e.mean, scale);
  }
  for (size_t k = kEnergyKeys; k-- > 0;) {  // entry k: keys >= k
    count_[k] += count_[k + 1];
    centred_[k] += centred_[k + 1];
    mean_[k] += mean_[k + 1];
  }
  unit_ = 1.0 / scale;  // a power of two: exact
  return true;
}

double predict_mx_vnmse(const std::vector<const StatsSummary*>& parts, double k,
                        const HopProfile& hop) {
  if (parts.empty()) return -1.0;
  double err = 0, energy = 0;
  for (const StatsSummary* s : parts) {
    err += s->mx_error(k, hop);
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
  char spec[32];
  std::snprintf(spec, sizeof spec, "dynamiq:%g", ladder_bits(c));
  return spec;
}

void predict_budget(const std::vector<const StatsSummary*>& parts,
                    const std::vector<std::vector<DynamiqPlan>>& plans,
                    const std::vector<std::vector<bool>>& fits, const HopProfile& hop,
                    const BudgetTarget& target, BudgetPrediction* out) {
  BudgetJob job;
  job.auto_budget = 1;
  job.hop = hop;
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
                     const std::vector<const DynamiqPlan*>& plans, const HopProfile& hop,
                     WidthCounts* widths) {
  if (parts.empty()) return -1.0;
  double err = 0, energy = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    err += parts[i]->dynamiq_error(*plans[i], hop, widths);
    energy += parts[i]->energy();
  }
  return energy > 0 ? err / energy : 0.0;
}

void run_budget_job(const BudgetJob& job, const uint16_t* reduced, BudgetResult* out) {
  // One summary per thread, reused: its tables are 0.75 MB.
  static thread_local StatsSummary summary;
  BudgetAccumulator acc;
  for (uint32_t i = 0; i < job.n_parts; ++i) {
    const BudgetPartJob& part = job.parts[i];
    if (!summary.load(reduced + part.stats_offset, part.count, job.n_workers)) {
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
