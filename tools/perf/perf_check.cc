#include "tools/perf/perf_check.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "common/splitmix.h"

namespace dq::perf {
namespace {

using dq::splitmix64;

// The random word behind element i of rank r; the (type, op) salt gives every combination
// its own data so that a stale buffer from the previous test cannot pass the check.
uint64_t element_random(DType type, RedOp op, int rank, size_t i) {
  const uint64_t salt = static_cast<uint64_t>(type) * 8 + static_cast<uint64_t>(op);
  return splitmix64(static_cast<uint64_t>(i) ^ (static_cast<uint64_t>(rank + 1) << 44) ^
                    (salt << 57));
}

// ---- integers -------------------------------------------------------------------------------

template <typename T>
T int_input(RedOp op, uint64_t u) {
  constexpr int kBits = 8 * sizeof(T);
  switch (op) {
    case RedOp::kMax:
    case RedOp::kMin:
      return static_cast<T>(u);  // every bit pattern
    case RedOp::kProd: {
      T magnitude = static_cast<T>(1 + u % 3);
      if constexpr (std::is_signed_v<T>)
        if ((u >> 62) & 1) return static_cast<T>(-magnitude);
      return magnitude;
    }
    default: {
      // |x| <= range keeps sums of up to 8 ranks (2^3) clear of wrap-around.
      const uint64_t range = kBits == 8 ? 15 : (uint64_t{1} << (kBits - 11)) - 1;
      const uint64_t pick = u % (2 * range + 1);
      if constexpr (std::is_signed_v<T>)
        return static_cast<T>(static_cast<int64_t>(pick) - static_cast<int64_t>(range));
      return static_cast<T>(pick);
    }
  }
}

// NCCL's integer semantics: sums and products wrap modulo 2^bits; avg divides the wrapped sum
// by the rank count, truncating toward zero.
template <typename T>
T int_reference(DType type, RedOp op, int num_ranks, size_t i) {
  T best = int_input<T>(op, element_random(type, op, 0, i));
  uint64_t sum = 0, product = 1;
  for (int r = 0; r < num_ranks; ++r) {
    const T x = r == 0 ? best : int_input<T>(op, element_random(type, op, r, i));
    const auto widened = static_cast<uint64_t>(static_cast<int64_t>(x));
    sum += widened;
    product *= widened;
    if (op == RedOp::kMax) best = std::max(best, x);
    if (op == RedOp::kMin) best = std::min(best, x);
  }
  switch (op) {
    case RedOp::kSum:
      return static_cast<T>(sum);
    case RedOp::kProd:
      return static_cast<T>(product);
    case RedOp::kAvg:
      if constexpr (std::is_signed_v<T>)
        return static_cast<T>(static_cast<int64_t>(static_cast<T>(sum)) / num_ranks);
      else
        return static_cast<T>(static_cast<uint64_t>(static_cast<T>(sum)) /
                              static_cast<uint64_t>(num_ranks));
    default:
      return best;
  }
}

template <typename T>
void fill_int(DType type, RedOp op, int rank, size_t count, void* out) {
  T* data = static_cast<T*>(out);
  for (size_t i = 0; i < count; ++i) data[i] = int_input<T>(op, element_random(type, op, rank, i));
}

template <typename T>
CheckResult check_int(DType type, RedOp op, int num_ranks, size_t count, const void* result,
                      size_t offset) {
  CheckResult c;
  const T* got = static_cast<const T*>(result);
  for (size_t i = 0; i < count; ++i) {
    const T want = int_reference<T>(type, op, num_ranks, offset + i);
    // long double holds any 64-bit integer exactly, so a difference of 1 survives.
    const auto diff =
        static_cast<double>(static_cast<long double>(got[i]) - static_cast<long double>(want));
    if (got[i] != want) ++c.wrong;
    c.error_sq += diff * diff;
    c.exact_sq += static_cast<double>(want) * static_cast<double>(want);
  }
  return c;
}

// ---- floating point -------------------------------------------------------------------------

struct FloatFormat {
  int precision;      // significand bits including the implicit one
  double denorm_min;  // smallest positive subnormal
};

FloatFormat format_of(DType type) {
  switch (type) {
    case DType::kFloat16:
      return {11, std::ldexp(1.0, -24)};
    case DType::kBfloat16:
      return {8, std::ldexp(1.0, -133)};
    case DType::kFloat32:
      return {24, std::ldexp(1.0, -149)};
    default:
      return {53, std::numeric_limits<double>::denorm_min()};
  }
}

// Inputs are exact in the element type: k / 2^(p-1) in [-1, 1) for sums, averages, max and
// min; +-[0.5, 2) for products so that products of a few ranks neither overflow nor underflow.
double float_input(DType type, RedOp op, uint64_t u) {
  const int p = format_of(type).precision;
  const uint64_t scale = uint64_t{1} << (p - 1);
  if (op == RedOp::kProd) {
    double magnitude = static_cast<double>(scale + u % scale) / static_cast<double>(scale);
    if ((u >> 62) & 1) magnitude *= 0.5;
    return ((u >> 63) & 1) ? -magnitude : magnitude;
  }
  const int64_t k = static_cast<int64_t>(u % (2 * scale)) - static_cast<int64_t>(scale);
  return static_cast<double>(k) / static_cast<double>(scale);
}

void store_float(DType type, double value, void* out, size_t i) {
  switch (type) {
    case DType::kFloat16:
      static_cast<uint16_t*>(out)[i] = float_to_half(static_cast<float>(value));
      break;
    case DType::kBfloat16:
      static_cast<uint16_t*>(out)[i] = float_to_bfloat16(static_cast<float>(value));
      break;
    case DType::kFloat32:
      static_cast<float*>(out)[i] = static_cast<float>(value);
      break;
    default:
      static_cast<double*>(out)[i] = value;
      break;
  }
}

double load_float(DType type, const void* data, size_t i) {
  switch (type) {
    case DType::kFloat16:
      return half_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kBfloat16:
      return bfloat16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kFloat32:
      return static_cast<const float*>(data)[i];
    default:
      return static_cast<const double*>(data)[i];
  }
}

CheckResult check_float(DType type, RedOp op, int num_ranks, size_t count, const void* result,
                        size_t offset) {
  CheckResult c;
  const FloatFormat format = format_of(type);
  const double eps = std::ldexp(1.0, -format.precision);  // unit roundoff of the element type
  const double n = num_ranks;
  // Each of the n-1 combining steps and the final rounding may add eps times the running
  // magnitude; the FP64 reference itself may be off by as much for double data: 2(n+1) eps.
  const double steps = 2 * (n + 1);
  const double floor = n * format.denorm_min;  // subnormal flushing or rounding at each step
  for (size_t i = 0; i < count; ++i) {
    double sum = 0, magnitude = 0, product = 1;
    const size_t at = offset + i;  // the element's index in every rank's input
    double best = float_input(type, op, element_random(type, op, 0, at));
    for (int r = 0; r < num_ranks; ++r) {
      const double x = r == 0 ? best : float_input(type, op, element_random(type, op, r, at));
      sum += x;
      magnitude += std::fabs(x);
      product *= x;
      if (op == RedOp::kMax) best = std::max(best, x);
      if (op == RedOp::kMin) best = std::min(best, x);
    }
    double exact = 0, tolerance = 0;
    switch (op) {
      case RedOp::kSum:
        exact = sum;
        tolerance = steps * eps * magnitude + floor;
        break;
      case RedOp::kAvg:
        exact = sum / n;
        tolerance = (steps * eps * magnitude) / n + eps * std::fabs(exact) + floor;
        break;
      case RedOp::kProd:
        exact = product;
        tolerance = steps * eps * std::fabs(product) + floor;
        break;
      default:
        exact = best;
        tolerance = 0;
        break;  // max and min pick an input: exact
    }
    const double got = load_float(type, result, i);
    if (!std::isfinite(got)) {
      ++c.nonfinite;
      ++c.wrong;
      c.error_sq = std::numeric_limits<double>::infinity();
    } else {
      const double diff = got - exact;
      if (!(std::fabs(diff) <= tolerance)) ++c.wrong;
      c.error_sq += diff * diff;
    }
    c.exact_sq += exact * exact;
  }
  return c;
}

}  // namespace

float half_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1f;
  const uint32_t mantissa = bits & 0x3ff;
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

uint16_t float_to_half(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const int exponent = static_cast<int>((bits >> 23) & 0xff);
  const uint32_t mantissa = bits & 0x7fffff;
  if (exponent == 0xff)  // Inf stays Inf, NaN stays a (quiet) NaN
    return static_cast<uint16_t>(sign | 0x7c00 | (mantissa ? 0x200 | (mantissa >> 13) : 0));
  const int half_exponent = exponent - 127 + 15;
  if (half_exponent >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00);
  uint32_t significand, shift;
  uint32_t biased = 0;
  if (half_exponent <= 0) {  // half subnormal (or zero): unit 2^-24
    shift = static_cast<uint32_t>(14 - half_exponent);
    if (shift > 25) return sign;
    significand = mantissa | (exponent ? 0x800000u : 0);
  } else {
    shift = 13;
    significand = mantissa;
    biased = static_cast<uint32_t>(half_exponent) << 10;
  }
  uint32_t rounded = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1);
  const uint32_t halfway = 1u << (shift - 1);
  if (remainder > halfway || (remainder == halfway && (rounded & 1))) ++rounded;
  // A carry out of the mantissa correctly bumps the exponent (up to Inf).
  return static_cast<uint16_t>(sign | (biased + rounded));
}

float bfloat16_to_float(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

uint16_t float_to_bfloat16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

void fill_input(DType type, RedOp op, int rank, size_t count, void* out) {
  switch (type) {
    case DType::kInt8:
      return fill_int<int8_t>(type, op, rank, count, out);
    case DType::kUint8:
      return fill_int<uint8_t>(type, op, rank, count, out);
    case DType::kInt32:
      return fill_int<int32_t>(type, op, rank, count, out);
    case DType::kUint32:
      return fill_int<uint32_t>(type, op, rank, count, out);
    case DType::kInt64:
      return fill_int<int64_t>(type, op, rank, count, out);
    case DType::kUint64:
      return fill_int<uint64_t>(type, op, rank, count, out);
    default:
      for (size_t i = 0; i < count; ++i)
        store_float(type, float_input(type, op, element_random(type, op, rank, i)), out, i);
  }
}

CheckResult check_result(DType type, RedOp op, int num_ranks, size_t count, const void* result,
                         size_t offset) {
  CheckResult c;
  switch (type) {
    case DType::kInt8:
      c = check_int<int8_t>(type, op, num_ranks, count, result, offset);
      break;
    case DType::kUint8:
      c = check_int<uint8_t>(type, op, num_ranks, count, result, offset);
      break;
    case DType::kInt32:
      c = check_int<int32_t>(type, op, num_ranks, count, result, offset);
      break;
    case DType::kUint32:
      c = check_int<uint32_t>(type, op, num_ranks, count, result, offset);
      break;
    case DType::kInt64:
      c = check_int<int64_t>(type, op, num_ranks, count, result, offset);
      break;
    case DType::kUint64:
      c = check_int<uint64_t>(type, op, num_ranks, count, result, offset);
      break;
    default:
      c = check_float(type, op, num_ranks, count, result, offset);
      break;
  }
  c.hash = hash_bytes(result, count * dtype_bytes(type));
  return c;
}

double vnmse(double error_sq, double exact_sq) {
  if (error_sq == 0) return 0;
  if (exact_sq == 0) return std::numeric_limits<double>::infinity();
  return error_sq / exact_sq;
}

uint64_t hash_bytes(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 0x6A09E667F3BCC908ull ^ bytes;
  size_t i = 0;
  // Each step is a bijection of h for a fixed word, so one changed word always changes h.
  for (; i + 8 <= bytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    h = std::rotl(h ^ word, 29) * 0x9E3779B97F4A7C15ull;
  }
  uint64_t tail = 0;
  if (i < bytes) std::memcpy(&tail, p + i, bytes - i);
  h = std::rotl(h ^ tail, 29) * 0x9E3779B97F4A7C15ull;
  return splitmix64(h);
}

}  // namespace dq::perf
