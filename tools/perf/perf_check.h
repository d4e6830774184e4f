// Deterministic per-rank inputs and the exact local check of an all-reduce result.
// Every rank can regenerate every other rank's input, so each computes the exact reference
// (FP64 for floating types, wrap-around integer arithmetic for integer types) by itself.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tools/perf/perf_options.h"

namespace dq::perf {

// Writes rank `rank`'s input of `count` elements of `type`, chosen for `op` so that
// integer sums of up to 8 ranks do not wrap and float products stay in range.
void fill_input(DType type, RedOp op, int rank, size_t count, void* out);

struct CheckResult {
  uint64_t wrong = 0;      // elements outside the dtype tolerance of the exact result
  uint64_t nonfinite = 0;  // elements that are Inf/NaN (every input is finite)
  double error_sq = 0;     // sum over elements of (result - exact)^2, exact in FP64
  double exact_sq = 0;     // sum over elements of exact^2
  uint64_t hash = 0;       // hash_bytes() of the result
};

// Compares `result` (count elements) with elements offset .. offset + count - 1 of the
// all-reduce of fill_input() over `num_ranks` (a reduce-scatter's block r: offset r x recvcount).
CheckResult check_result(DType type, RedOp op, int num_ranks, size_t count, const void* result,
                         size_t offset = 0);

// ||result - exact||^2 / ||exact||^2; 0 when both are 0, +inf when only the error is not.
double vnmse(double error_sq, double exact_sq);

// 64-bit hash of a byte string; any single changed word changes it.
uint64_t hash_bytes(const void* data, size_t bytes);

// IEEE binary16 and bfloat16 conversions, round-to-nearest-even.
float half_to_float(uint16_t bits);
uint16_t float_to_half(float value);
float bfloat16_to_float(uint16_t bits);
uint16_t float_to_bfloat16(float value);

}  // namespace dq::perf
