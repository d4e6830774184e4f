#include "tools/sim/bit_breakdown.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_layout.h"
#include "kernels/dynamiq_math.h"
#include "kernels/payload.h"

namespace dq::sim {
namespace {

int width_slot(int bits) {
  for (int i = 0; i < 4; ++i)
    if (kBreakdownWidths[i] == bits) return i;
  return -1;
}

bool fail(std::string* error, const char* what, long long a = 0, long long b = 0) {
  if (error) {
    char buf[200];
    std::snprintf(buf, sizeof buf, what, a, b);
    *error = buf;
  }
  return false;
}

}  // namespace

bool bit_breakdown(const Codec& codec, BitBreakdown* out, std::string* error) {
  DynamiqOptions options;
  DynamiqPlan plan;
  if (!dynamiq_parameters(codec, &options, &plan))
    return fail(error, "bit breakdown: not a DynamiQ codec");
  const DynamiqLayoutView view = dynamiq_layout(codec);
  if (plan.n_sg > 0 &&
      (view.widths == nullptr || view.order == nullptr || view.chunk_first == nullptr))
    return fail(error, "bit breakdown: the codec has no layout (agree() not run)");
  BitBreakdown b;
  b.count = plan.count;
  b.supergroups = plan.n_sg;
  b.chunks = plan.n_chunks;
  b.budget_bits = options.budget_bits;
  b.budget_honest = view.budget_honest;

  // What a record of each width holds (docs/FORMAT.md): widths 2/4/8 carry a BF16 unit and 16
  // UINT8 group factors (flat scales: 16 BF16 group scales) before 32w bytes of codes; width 16
  // is 256 BF16 values. Checked against the record sizes the plan uses.
  const int unit_bytes = options.hierarchical_scales ? 2 : 0;
  const int factor_bytes = options.hierarchical_scales ? 1 : 2;  // per group of 16
  for (int i = 0; i < 4; ++i) {
    const int w = kBreakdownWidths[i];
    const int expect = w == 16
                           ? 2 * kSuperGroup
                           : unit_bytes + factor_bytes * kGroupsPerSuperGroup + kSuperGroup * w / 8;
    if (plan.record[i] != expect)
      return fail(error, "bit breakdown: record of %lld bits is %lld bytes, not as FORMAT.md says",
                  w, plan.record[i]);
  }

  for (size_t j = 0; j < plan.n_sg; ++j) {
    const int slot = width_slot(view.widths[j]);
    if (slot < 0)
      return fail(error, "bit breakdown: super-group %lld has width %lld", j, view.widths[j]);
    const int w = kBreakdownWidths[slot];
    const uint64_t valid = std::min<uint64_t>(kSuperGroup, plan.count - j * kSuperGroup);
    const uint64_t groups = (valid + kGroup - 1) / kGroup;
    ++b.sg_by_width[slot];
    b.record_bits_by_width[slot] += 8ull * static_cast<uint64_t>(plan.record[slot]);
    b.values += w * valid;
    b.padding += w * (kSuperGroup - valid);
    if (w != 16) {
      b.units += 8ull * unit_bytes;
      b.group_factors += 8ull * factor_bytes * groups;
      b.padding += 8ull * factor_bytes * (kGroupsPerSuperGroup - groups);
    }
  }
  b.statistics = 16ull * codec.stats_words();
  b.headers = 8ull * kChunkHeaderBytes * static_cast<uint64_t>(plan.n_chunks);
  // Each chunk's body: its records in wire order, no gaps; the rest of its capacity is slack.
  for (int c = 0; c < plan.n_chunks; ++c) {
    uint64_t body = 0;
    if (plan.n_sg > 0)
      for (uint32_t i = view.chunk_first[c]; i < view.chunk_first[c + 1]; ++i)
        body += static_cast<uint64_t>(plan.record[width_slot(view.widths[view.order[i]])]);
    if (body + kChunkHeaderBytes > plan.capacity)
      return fail(error, "bit breakdown: chunk %lld body of %lld bytes exceeds the capacity", c,
                  static_cast<long long>(body));
    b.slack += 8ull * (plan.capacity - kChunkHeaderBytes - body);
  }
  // The parts are every bit of one copy: the codec's own count, exactly.
  const uint64_t copy = 8ull * (2ull * codec.stats_words() +
                                static_cast<uint64_t>(plan.n_chunks) * codec.chunk_capacity());
  if (b.copy_bits() != copy)
    return fail(error, "bit breakdown: the parts sum to %lld bits, one copy is %lld",
                static_cast<long long>(b.copy_bits()), static_cast<long long>(copy));
  if (plan.count > 0 && std::fabs(b.per_coord(b.copy_bits()) - codec.bits_per_coord()) >
                            1e-9 * codec.bits_per_coord())
    return fail(error, "bit breakdown: bits per coordinate disagree with the codec's");
  b.unallocated = b.budget_bits * static_cast<double>(b.count) - static_cast<double>(copy);
  if (b.budget_honest && b.unallocated < 0)
    return fail(error, "bit breakdown: a budget-honest plan over its budget by %lld bits",
                static_cast<long long>(-b.unallocated));
  *out = b;
  return true;
}

bool accumulate_width_error(const Codec& codec, const std::vector<const float*>& rows, int n,
                            const float* decoded, ReduceOp op, BitBreakdown* out,
                            std::string* error) {
  const DynamiqLayoutView view = dynamiq_layout(codec);
  if (view.n_supergroups != out->supergroups || (out->supergroups > 0 && view.widths == nullptr))
    return fail(error, "width error: the codec's layout does not match the breakdown");
  if (n < 1 || static_cast<int>(rows.size()) < n) return fail(error, "width error: %lld rows", n);
  for (size_t j = 0; j < out->supergroups; ++j) {
    const int slot = width_slot(view.widths[j]);
    if (slot < 0)
      return fail(error, "width error: super-group %lld has width %lld", j, view.widths[j]);
    const size_t end = std::min(out->count, (j + 1) * kSuperGroup);
    double err = 0, energy = 0;
    for (size_t k = j * kSuperGroup; k < end; ++k) {
      double exact = 0;
      for (int w = 0; w < n; ++w) exact += rows[w][k];
      if (op == ReduceOp::kAvg) exact /= n;
      const double diff = static_cast<double>(decoded[k]) - exact;
      err += diff * diff;
      energy += exact * exact;
    }
    out->error_by_width[slot] += err;
    out->energy_by_width[slot] += energy;
  }
  ++out->calls;
  return true;
}

}  // namespace dq::sim
