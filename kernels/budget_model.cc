#include "kernels/budget_model.h"

#include <algorithm>
#include <cctype>
#include <cfloat>
#include <cstdio>
#include <cstdlib>
#include <numeric>

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
  key_.clear();
  centred_.assign(1, 0.0);
  mean_.assign(1, 0.0);
  energy_ = 0;
  if (n_workers < 1 || (n_sg > 0 && reduced == nullptr)) return false;
  std::vector<double> centred(n_sg), mean(n_sg);
  std::vector<float> key(n_sg);
  for (size_t j = 0; j < n_sg; ++j) {
    const float m = bf16_to_f32(reduced[2 * j]);      // sum over workers of their means
    const float f = bf16_to_f32(reduced[2 * j + 1]);  // sum over workers of sum of squares
    if (!(m - m == 0.0f) || !(f >= 0.0f && f <= FLT_MAX)) return false;  // non-finite
    const double c = static_cast<double>(j + 1 == n_sg ? count - 256 * j : 256);
    const double md = m;
    // The workers' energy about their own means is F - c sum_i mu_i^2 <= F - c M^2 / n (M the
    // sum of the means): the estimate assumes the means agree. The exact sum's mean is M.
    centred[j] = std::max(0.0, static_cast<double>(f) - c * md * md / n_workers);
    mean[j] = c * md * md;
    key[j] = f;
  }
  std::vector<uint32_t> order(n_sg);
  std::iota(order.begin(), order.end(), 0u);
  // Descending key, ties by index: a total order, so every rank gets the same permutation.
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return key[a] != key[b] ? key[a] > key[b] : a < b;
  });
  key_.resize(n_sg);
  centred_.resize(n_sg + 1);
  mean_.resize(n_sg + 1);
  for (size_t i = 0; i < n_sg; ++i) {
    const uint32_t j = order[i];
    key_[i] = key[j];
    centred_[i + 1] = centred_[i] + centred[j];
    mean_[i + 1] = mean_[i] + mean[j];
  }
  energy_ = centred_[n_sg] + mean_[n_sg];
  return true;
}

double StatsSummary::dynamiq_error(const DynamiqPlan& p, const HopProfile& hop,
                                   WidthCounts* widths) const {
  const size_t n_sg = key_.size();
  // Super-groups with key >= t: a prefix of the descending keys.
  auto at_least = [&](float t) {
    return static_cast<size_t>(
        std::partition_point(key_.begin(), key_.end(), [t](float f) { return f >= t; }) -
        key_.begin());
  };
  // The codec's widths for threshold offset theta (build_dynamiq_layout's width_for): prefix
  // lengths of the classes 16, 8 (and wider), 4 (and wider).
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
    return static_cast<uint64_t>(c.w16) * p.record[3] +
           static_cast<uint64_t>(c.w8 - c.w16) * p.record[2] +
           static_cast<uint64_t>(c.w4 - c.w8) * p.record[1] +
           static_cast<uint64_t>(n_sg - c.w4) * p.record[0];
  };
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
    widths->n[3] += c.w16;
    widths->n[2] += c.w8 - c.w16;
    widths->n[1] += c.w4 - c.w8;
    widths->n[0] += n_sg - c.w4;
  }
  auto centred = [&](size_t a, size_t b) { return centred_[b] - centred_[a]; };
  auto mean = [&](size_t a, size_t b) { return mean_[b] - mean_[a]; };
  // Widths 2, 4, 8 round the partial sums less their means (restored exactly); width 16 rounds
  // them whole.
  double e = kRoundingError[3] * (hop.linear * centred(0, c.w16) + hop.square * mean(0, c.w16));
  e += kRoundingError[2] * hop.linear * centred(c.w16, c.w8);
  e += kRoundingError[1] * hop.linear * centred(c.w8, c.w4);
  e += kRoundingError[0] * hop.linear * centred(c.w4, n_sg);
  return e;
}

double StatsSummary::mx_error(double k, const HopProfile& hop) const {
  // No mean subtraction: every hop rounds the partial sum whole.
  const size_t n = key_.size();
  return k * (hop.linear * centred_[n] + hop.square * mean_[n]);
}

namespace {
double target_of(const std::vector<const StatsSummary*>& parts, const HopProfile& hop,
                 const BudgetTarget& t) {
  if (t.kind == BudgetTarget::Kind::kVnmse) return t.vnmse;
  const double k = t.kind == BudgetTarget::Kind::kMxfp8 ? kRoundingErrorMxfp8 : kRoundingErrorMxfp6;
  double err = 0, energy = 0;
  for (const StatsSummary* s : parts) {
    err += s->mx_error(k, hop);
    energy += s->energy();
  }
  return energy > 0 ? err / energy : 0.0;
}
}  // namespace

void predict_budget(const std::vector<const StatsSummary*>& parts,
                    const std::vector<std::vector<DynamiqPlan>>& plans,
                    const std::vector<std::vector<bool>>& fits, const HopProfile& hop,
                    const BudgetTarget& target, BudgetPrediction* out) {
  *out = BudgetPrediction{};
  out->target = target_of(parts, hop, target);
  double energy = 0;
  for (const StatsSummary* s : parts) energy += s->energy();
  int chosen = -1, top_fit = -1;
  for (int r = 0; r < kLadderRungs; ++r) {
    bool ok = true;
    double err = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      ok = ok && fits[i][r];
      err += parts[i]->dynamiq_error(plans[i][r], hop, &out->widths[r]);
    }
    out->vnmse[r] = !ok ? -1.0 : energy > 0 ? err / energy : 0.0;
    if (!ok) continue;
    top_fit = r;
    if (chosen < 0 && out->vnmse[r] <= out->target) chosen = r;
  }
  out->rung = chosen >= 0 ? chosen : top_fit >= 0 ? top_fit : kLadderRungs - 1;
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
