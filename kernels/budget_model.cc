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
  const size_t n_sg = (count + 255) / 256;
  value_.clear();
  count_.assign(1, 0);
  centred_.assign(1, 0.0);
  mean_.assign(1, 0.0);
  energy_ = 0;
  if (n_workers < 1 || (n_sg > 0 && reduced == nullptr)) return false;
  // The width key F_j is a BF16 value: a counting sort over its 0x7F80 finite non-negative bit
  // patterns orders the super-groups in O(S) (a comparison sort of 64 K super-groups took tens
  // of milliseconds of the host's time per call). Per pattern, sums in index order; then
  // cumulative over the patterns in descending order: one fixed order on every rank.
  constexpr size_t kPatterns = 0x7F80;
  struct Bin {
    uint64_t n = 0;
    double centred = 0, mean = 0;
  };
  static thread_local std::vector<Bin> bins(kPatterns);
  bool finite = true;
  for (size_t j = 0; j < n_sg && finite; ++j) {
    const float m = bf16_to_f32(reduced[2 * j]);      // sum over workers of their means
    const float f = bf16_to_f32(reduced[2 * j + 1]);  // sum over workers of sums of squares
    if (!(m - m == 0.0f) || !(f >= 0.0f && f <= FLT_MAX)) {  // non-finite, or negative
      finite = false;
      break;
    }
    const uint16_t pattern = f == 0.0f ? 0 : reduced[2 * j + 1];  // -0 is 0
    const double c = static_cast<double>(j + 1 == n_sg ? count - 256 * j : 256);
    const double md = m;
    Bin& bin = bins[pattern];
    ++bin.n;
    // The workers' energy about their own means is F - c sum_i mu_i^2 <= F - c M^2 / n (M the
    // sum of the means): the estimate assumes the means agree. The exact sum's mean is M.
    bin.centred += std::max(0.0, static_cast<double>(f) - c * md * md / n_workers);
    bin.mean += c * md * md;
  }
  for (size_t p = kPatterns; p-- > 0;) {
    Bin& bin = bins[p];
    if (bin.n == 0) continue;
    if (finite) {
      value_.push_back(bf16_to_f32(static_cast<uint16_t>(p)));
      count_.push_back(count_.back() + bin.n);
      centred_.push_back(centred_.back() + bin.centred);
      mean_.push_back(mean_.back() + bin.mean);
    }
    bin = Bin{};  // the scratch is zero again for the next call
  }
  if (!finite) {
    value_.clear();
    count_.assign(1, 0);
    centred_.assign(1, 0.0);
    mean_.assign(1, 0.0);
    return false;
  }
  energy_ = centred_.back() + mean_.back();
  return true;
}

double StatsSummary::dynamiq_error(const DynamiqPlan& p, const HopProfile& hop,
                                   WidthCounts* widths) const {
  const size_t n_sg = count_.back();
  // Distinct keys with value >= t: a prefix of the descending values.
  auto at_least = [&](float t) {
    return static_cast<size_t>(
        std::partition_point(value_.begin(), value_.end(), [t](float f) { return f >= t; }) -
        value_.begin());
  };
  // The codec's widths for threshold offset theta (build_dynamiq_layout's width_for), as prefix
  // lengths in distinct keys of the classes 16, 8 (and wider), 4 (and wider).
  struct Cut {
    size_t w16, w8, w4;
  };
  auto cut = [&](float theta) {
    const float t48 = theta * (257.0f / 131072.0f);
    const float t24 = t48 * (17.0f / 512.0f);
    Cut c;
    c.w16 = p.allow_width16 ? at_least(theta) : 0;
    c.w8 = std::max(c.w16, at_least(t48));
    c.w4 = std::max(c.w8, at_least(t24));
    return c;
  };
  auto bytes = [&](const Cut& c) {
    return count_[c.w16] * p.record[3] + (count_[c.w8] - count_[c.w16]) * p.record[2] +
           (count_[c.w4] - count_[c.w8]) * p.record[1] + (n_sg - count_[c.w4]) * p.record[0];
  };
  const size_t end = value_.size();
  Cut c{0, 0, 0};
  if (p.variable_widths) {
    const uint64_t budget = static_cast<uint64_t>(p.stride) * p.n_chunks;
    uint32_t lo = 0, hi = 0x7f800000u;
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (bytes(cut(f32_from_bits(mid))) <= budget) hi = mid;
      else lo = mid + 1;
    }
    c = cut(f32_from_bits(lo));
  }
  if (widths != nullptr) {
    widths->n[3] += count_[c.w16];
    widths->n[2] += count_[c.w8] - count_[c.w16];
    widths->n[1] += count_[c.w4] - count_[c.w8];
    widths->n[0] += n_sg - count_[c.w4];
  }
  auto centred = [&](size_t a, size_t b) { return centred_[b] - centred_[a]; };
  auto mean = [&](size_t a, size_t b) { return mean_[b] - mean_[a]; };
  // Widths 2, 4, 8 round the partial sums less their means (restored exactly); width 16 rounds
  // them whole.
  double e = kRoundingError[3] * (hop.linear * centred(0, c.w16) + hop.square * mean(0, c.w16));
  e += kRoundingError[2] * hop.linear * centred(c.w16, c.w8);
  e += kRoundingError[1] * hop.linear * centred(c.w8, c.w4);
  e += kRoundingError[0] * hop.linear * centred(c.w4, end);
  return e;
}

double StatsSummary::mx_error(double k, const HopProfile& hop) const {
  // No mean subtraction: every hop rounds the partial sum whole.
  return k * (hop.linear * centred_.back() + hop.square * mean_.back());
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

namespace {
double target_of(const std::vector<const StatsSummary*>& parts, const HopProfile& hop,
                 const BudgetTarget& t) {
  if (t.kind == BudgetTarget::Kind::kVnmse) return t.vnmse;
  const double k = t.kind == BudgetTarget::Kind::kMxfp8 ? kRoundingErrorMxfp8 : kRoundingErrorMxfp6;
  return std::max(0.0, predict_mx_vnmse(parts, k, hop));
}
}  // namespace

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
  *out = BudgetPrediction{};
  out->target = target_of(parts, hop, target);
  double energy = 0;
  for (const StatsSummary* s : parts) energy += s->energy();
  for (int c = 0; c < kCandidates; ++c) {
    bool ok = true;
    double err = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      ok = ok && static_cast<size_t>(c) < fits[i].size() && fits[i][c];
      if (!candidate_is_mx(c))
        err += parts[i]->dynamiq_error(plans[i][c], hop, &out->widths[c]);
      else
        err += parts[i]->mx_error(mx_rounding_error(candidate_spec(c)), hop);
    }
    out->vnmse[c] = !ok ? -1.0 : energy > 0 ? err / energy : 0.0;
  }
  // Fewest bits meeting the target (no two candidates have the same bits); failing that, the
  // smallest error (ties: the lower index). Strict comparisons in index order: one answer for
  // the same bytes on every rank.
  int chosen = -1, best = -1;
  for (int c = 0; c < kCandidates; ++c) {
    if (out->vnmse[c] < 0) continue;
    if (best < 0 || out->vnmse[c] < out->vnmse[best]) best = c;
    if (out->vnmse[c] <= out->target &&
        (chosen < 0 || candidate_bits(c) < candidate_bits(chosen)))
      chosen = c;
  }
  out->rung = chosen >= 0 ? chosen : best >= 0 ? best : kLadderRungs - 1;
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

}  // namespace dq
