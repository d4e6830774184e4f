// Where a DynamiQ budget's bits go (--bits-breakdown): one compressed copy of the vector (every
// chunk message plus the statistics all-reduce), split by what the bytes carry, read from the
// plan and the per-call layout the codec built (docs/FORMAT.md); and, per width, the share of the
// super-groups and of the measured squared error of the decoded all-reduce.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/codec.h"

namespace dq::sim {

// Widths in the order of DynamiqPlan::record: 2, 4, 8, 16 bits.
inline constexpr int kBreakdownWidths[4] = {2, 4, 8, 16};

struct BitBreakdown {
  size_t count = 0;  // coordinates
  size_t supergroups = 0;
  int chunks = 0;
  double budget_bits = 0;  // the codec's budget, bits per coordinate
  // Bits of one compressed copy, by what they carry. Their sum is `copy_bits()`, the codec's
  // bits_per_coord() times count, exactly (checked when built).
  uint64_t values = 0;         // element codes (width 16: the BF16 values) of real elements
  uint64_t group_factors = 0;  // UINT8 group factors (flat scales: the BF16 group scales)
  uint64_t units = 0;          // BF16 super-group units (hierarchical scales only)
  uint64_t statistics = 0;     // the statistics all-reduce (stats_words() BF16 words)
  uint64_t headers = 0;        // 16-byte chunk headers
  uint64_t padding = 0;        // record bits that cover no element (a partial last super-group)
  uint64_t slack = 0;          // chunk message capacity after the body, unused
  // budget_bits * count - copy_bits(): what the budget's rounding leaves unallocated (the budget
  // is rounded down to whole bytes, less the statistics, then split into P whole-byte messages)
  // (negative when the plan is not budget honest: a tiny tensor gets more room than its budget).
  double unallocated = 0;
  bool budget_honest = true;
  // Per width (index as kBreakdownWidths): super-groups, their record bytes in the chunk
  // messages, and the squared error of the decoded output summed over their elements, against
  // the exact FP64 result (accumulate() adds one call's).
  size_t sg_by_width[4] = {};
  uint64_t record_bits_by_width[4] = {};
  double error_by_width[4] = {};
  double energy_by_width[4] = {};  // ||exact||^2 over the elements of each width's super-groups
  int calls = 0;

  uint64_t copy_bits() const {
    return values + group_factors + units + statistics + headers + padding + slack;
  }
  double per_coord(uint64_t bits) const {
    return count ? static_cast<double>(bits) / static_cast<double>(count) : 0.0;
  }
  double error_total() const {
    return error_by_width[0] + error_by_width[1] + error_by_width[2] + error_by_width[3];
  }
};

// The bit split of `codec` (a DynamiQ codec after plan() and agree(): the layout its agree()
// owns). False with `error` set for any other codec, before agree(), or when the parts do not
// add up to the codec's bits_per_coord() (a bug here or in the codec).
bool bit_breakdown(const Codec& codec, BitBreakdown* out, std::string* error);

// Adds one call's squared error per width: `decoded` is the all-reduce output of `codec`'s call
// (simulate_allreduce's result) and rows[0..n) its inputs of out->count floats; the exact result
// is their FP64 sum (divided by n for AVG). Widths are per call and the same at every hop (the
// layout comes from the all-reduced statistics alone), so each super-group's error goes to the
// one width it had. False with `error` set when the codec's layout does not match `out`.
bool accumulate_width_error(const Codec& codec, const std::vector<const float*>& rows, int n,
                            const float* decoded, ReduceOp op, BitBreakdown* out,
                            std::string* error);

}  // namespace dq::sim
