#include "tools/cpu-nccl/reduce.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

#include "kernels/bf16.h"

namespace dq::cpunccl {
namespace {

// A narrow IEEE-like float format: exponent and mantissa widths; `has_inf` false means the
// "fn" convention of e4m3 (no Inf; only all-ones exponent and mantissa is NaN).
struct NarrowFormat {
  int exp_bits;
  int man_bits;
  bool has_inf;
};
constexpr NarrowFormat kHalf{5, 10, true};
constexpr NarrowFormat kBf16{8, 7, true};
constexpr NarrowFormat kE4m3{4, 3, false};
constexpr NarrowFormat kE5m2{5, 2, true};

NarrowFormat format_of(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return kHalf;
    case DType::kBfloat16:
      return kBf16;
    case DType::kFloat8e4m3:
      return kE4m3;
    default:
      return kE5m2;
  }
}

double decode(const NarrowFormat& f, uint32_t bits) {
  const uint32_t sign = (bits >> (f.exp_bits + f.man_bits)) & 1u;
  const uint32_t exp_field = (bits >> f.man_bits) & ((1u << f.exp_bits) - 1);
  const uint32_t mantissa = bits & ((1u << f.man_bits) - 1);
  const int bias = (1 << (f.exp_bits - 1)) - 1;
  const uint32_t exp_all_ones = (1u << f.exp_bits) - 1;
  double magnitude;
  if (f.has_inf && exp_field == exp_all_ones) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else if (!f.has_inf && exp_field == exp_all_ones && mantissa == (1u << f.man_bits) - 1) {
    magnitude = NAN;
  } else if (exp_field == 0) {
    magnitude = std::ldexp(static_cast<double>(mantissa), 1 - bias - f.man_bits);
  } else {
    magnitude = std::ldexp(static_cast<double>(mantissa | (1u << f.man_bits)),
                           static_cast<int>(exp_field) - bias - f.man_bits);
  }
  return sign ? -magnitude : magnitude;
}

uint32_t encode(const NarrowFormat& f, double value) {
  const int sign_shift = f.exp_bits + f.man_bits;
  const uint32_t sign = std::signbit(value) ? 1u : 0u;
  const uint32_t exp_all_ones = (1u << f.exp_bits) - 1;
  const uint32_t nan_code = f.has_inf ? (exp_all_ones << f.man_bits) | (1u << (f.man_bits - 1))
                                      : (exp_all_ones << f.man_bits) | ((1u << f.man_bits) - 1);
  const uint32_t overflow_code = f.has_inf ? (exp_all_ones << f.man_bits) : nan_code;
  if (std::isnan(value)) return (sign << sign_shift) | nan_code;
  const double magnitude = std::fabs(value);
  if (std::isinf(magnitude)) return (sign << sign_shift) | overflow_code;
  if (magnitude == 0.0) return sign << sign_shift;
  const int bias = (1 << (f.exp_bits - 1)) - 1;
  const int min_exp = 1 - bias;  // exponent of the smallest normal
  const int top_exp_field =
      f.has_inf ? static_cast<int>(exp_all_ones) - 1 : static_cast<int>(exp_all_ones);
  const uint32_t top_mantissa = f.has_inf ? (1u << f.man_bits) - 1 : (1u << f.man_bits) - 2;
  const double max_finite = std::ldexp(static_cast<double>(top_mantissa | (1u << f.man_bits)),
                                       top_exp_field - bias - f.man_bits);
  int frexp_exp;
  std::frexp(magnitude, &frexp_exp);
  const int exponent = frexp_exp - 1;  // magnitude in [2^exponent, 2^(exponent+1))
  int quantum_exp = (exponent < min_exp ? min_exp : exponent) - f.man_bits;
  // Scaling by a power of two is exact; nearbyint rounds ties to even (default FP mode).
  const double units = std::nearbyint(std::ldexp(magnitude, -quantum_exp));
  if (units == 0.0) return sign << sign_shift;
  if (std::ldexp(units, quantum_exp) > max_finite) return (sign << sign_shift) | overflow_code;
  uint32_t n = static_cast<uint32_t>(units);
  if (n >= (2u << f.man_bits)) {  // rounded up to the next power of two
    n >>= 1;
    ++quantum_exp;
  }
  if (n < (1u << f.man_bits)) return (sign << sign_shift) | n;  // subnormal
  const uint32_t exp_field = static_cast<uint32_t>(quantum_exp + f.man_bits + bias);
  return (sign << sign_shift) | (exp_field << f.man_bits) | (n - (1u << f.man_bits));
}

// Decode tables: every 8-bit and 16-bit pattern, built once.
struct DecodeTables {
  std::vector<double> e4m3, e5m2;
  DecodeTables() : e4m3(256), e5m2(256) {
    for (uint32_t b = 0; b < 256; ++b) {
      e4m3[b] = decode(kE4m3, b);
      e5m2[b] = decode(kE5m2, b);
    }
  }
};
const DecodeTables& tables() {
  static const DecodeTables t;
  return t;
}

template <class T>
T apply_int(RedOp op, T a, T b) {
  using U = std::make_unsigned_t<T>;
  switch (op) {
    case RedOp::kProd:
      return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
    case RedOp::kMax:
      return a > b ? a : b;
    case RedOp::kMin:
      return a < b ? a : b;
    default:
      return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  }
}

template <class T>
void reduce_native(RedOp op, const void* incoming, const void* local, void* out, size_t count) {
  const T* a = static_cast<const T*>(incoming);
  const T* b = static_cast<const T*>(local);
  T* o = static_cast<T*>(out);
  // One loop per operator so the compiler vectorises each.
  switch (op) {
    case RedOp::kProd:
      for (size_t i = 0; i < count; ++i) {
        if constexpr (std::is_integral_v<T>)
          o[i] = apply_int<T>(RedOp::kProd, a[i], b[i]);
        else
          o[i] = a[i] * b[i];
      }
      break;
    case RedOp::kMax:
      for (size_t i = 0; i < count; ++i) o[i] = a[i] > b[i] ? a[i] : b[i];
      break;
    case RedOp::kMin:
      for (size_t i = 0; i < count; ++i) o[i] = a[i] < b[i] ? a[i] : b[i];
      break;
    default:
      for (size_t i = 0; i < count; ++i) {
        if constexpr (std::is_integral_v<T>)
          o[i] = apply_int<T>(RedOp::kSum, a[i], b[i]);
        else
          o[i] = a[i] + b[i];
      }
      break;
  }
}

uint16_t half_from_float(float f) {
#if defined(__FLT16_MAX__)
  // The compiler's conversion rounds to nearest even (checked against our encoder in tests).
  _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
#else
  return static_cast<uint16_t>(encode(kHalf, f));
#endif
}

// One correctly rounded double -> half conversion.
uint16_t half_from_double(double x) {
#if defined(__FLT16_MAX__)
  _Float16 h = static_cast<_Float16>(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
#else
  return static_cast<uint16_t>(encode(kHalf, x));
#endif
}

// double -> float rounding to odd: a later round-to-nearest-even to a format with at least two
// fewer mantissa bits (bf16) then rounds exactly as one direct rounding would.
float float_round_to_odd(double x) {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) == x || !std::isfinite(f)) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.0f);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u |= 1u;
  std::memcpy(&f, &u, 4);
  return f;
}

float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

const float* half_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t b = 0; b < 65536; ++b) t[b] = static_cast<float>(decode(kHalf, b));
    return t;
  }();
  return table.data();
}

// 16-bit floats: a binary operation on two half / bf16 values is exact in float except where
// it cannot matter (see the argument in README.md), so float arithmetic followed by one
// round-to-nearest-even gives the correctly rounded result. Max/min pick one operand's bits.
template <bool kIsHalf>
void reduce_16(RedOp op, const uint16_t* a, const uint16_t* b, uint16_t* o, size_t count) {
  const float* ht = kIsHalf ? half_table() : nullptr;
  auto dec = [ht](uint16_t v) { return kIsHalf ? ht[v] : bf16_to_float(v); };
  auto enc = [](float f) { return kIsHalf ? half_from_float(f) : f32_to_bf16_rne(f); };
  switch (op) {
    case RedOp::kMax:
      for (size_t i = 0; i < count; ++i) o[i] = dec(a[i]) > dec(b[i]) ? a[i] : b[i];
      return;
    case RedOp::kMin:
      for (size_t i = 0; i < count; ++i) o[i] = dec(a[i]) < dec(b[i]) ? a[i] : b[i];
      return;
    case RedOp::kProd:
      for (size_t i = 0; i < count; ++i) {
        const float p = dec(a[i]) * dec(b[i]);
        // bf16 products below float's normal range were rounded twice: redo them exactly.
        if (!kIsHalf && p != 0.0f && std::fabs(p) < std::numeric_limits<float>::min())
          o[i] = static_cast<uint16_t>(encode(kBf16, static_cast<double>(dec(a[i])) * dec(b[i])));
        else
          o[i] = enc(p);
      }
      return;
    default:
      for (size_t i = 0; i < count; ++i) o[i] = enc(dec(a[i]) + dec(b[i]));
      return;
  }
}

// FP8: every (a, b) pair of a sum or product is precomputed exactly (64 KiB per table).
const uint8_t* fp8_table(DType dtype, RedOp op) {
  static std::once_flag once[2][2];
  static std::vector<uint8_t> tables[2][2];
  const int f = dtype == DType::kFloat8e4m3 ? 0 : 1;
  const int k = op == RedOp::kProd ? 1 : 0;
  std::call_once(once[f][k], [&] {
    const NarrowFormat fmt = format_of(dtype);
    std::vector<uint8_t>& t = tables[f][k];
    t.resize(65536);
    for (uint32_t x = 0; x < 256; ++x)
      for (uint32_t y = 0; y < 256; ++y) {
        const double dx = decode(fmt, x), dy = decode(fmt, y);
        t[x * 256 + y] = static_cast<uint8_t>(encode(fmt, k ? dx * dy : dx + dy));
      }
  });
  return tables[f][k].data();
}

void reduce_fp8(DType dtype, RedOp op, const uint8_t* a, const uint8_t* b, uint8_t* o,
                size_t count) {
  const DecodeTables& t = tables();
  const double* dec = dtype == DType::kFloat8e4m3 ? t.e4m3.data() : t.e5m2.data();
  switch (op) {
    case RedOp::kMax:
      for (size_t i = 0; i < count; ++i) o[i] = dec[a[i]] > dec[b[i]] ? a[i] : b[i];
      return;
    case RedOp::kMin:
      for (size_t i = 0; i < count; ++i) o[i] = dec[a[i]] < dec[b[i]] ? a[i] : b[i];
      return;
    default: {
      const uint8_t* table = fp8_table(dtype, op);
      for (size_t i = 0; i < count; ++i) o[i] = table[a[i] * 256u + b[i]];
      return;
    }
  }
}

// Divided in 64 bits: the rank count narrowed to an 8-bit type would be negative (int8 from 129
// ranks), zero (256: SIGFPE) or another number.
template <class T>
void average_int(void* data, size_t count, int nranks) {
  using Wide = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
  T* d = static_cast<T*>(data);
  const Wide n = static_cast<Wide>(nranks);
  for (size_t i = 0; i < count; ++i) d[i] = static_cast<T>(static_cast<Wide>(d[i]) / n);
}

}  // namespace

bool dtype_valid(int dtype) {
  return dtype >= 0 && dtype < static_cast<int>(DType::kCount);
}
bool redop_valid(int op) {
  return op >= 0 && op < static_cast<int>(RedOp::kCount);
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kInt8:
    case DType::kUint8:
    case DType::kFloat8e4m3:
    case DType::kFloat8e5m2:
      return 1;
    case DType::kFloat16:
    case DType::kBfloat16:
      return 2;
    case DType::kInt32:
    case DType::kUint32:
    case DType::kFloat32:
      return 4;
    default:
      return 8;
  }
}

const char* dtype_name(DType dtype) {
  static const char* const kNames[] = {"int8", "uint8", "int32",  "uint32",   "int64",   "uint64",
                                       "half", "float", "double", "bfloat16", "fp8e4m3", "fp8e5m2"};
  return dtype_valid(static_cast<int>(dtype)) ? kNames[static_cast<int>(dtype)] : "?";
}

const char* redop_name(RedOp op) {
  static const char* const kNames[] = {"sum", "prod", "max", "min", "avg"};
  return redop_valid(static_cast<int>(op)) ? kNames[static_cast<int>(op)] : "?";
}

void reduce_elements(DType dtype, RedOp op, const void* incoming, const void* local, void* out,
                     size_t count) {
  switch (dtype) {
    case DType::kInt8:
      return reduce_native<int8_t>(op, incoming, local, out, count);
    case DType::kUint8:
      return reduce_native<uint8_t>(op, incoming, local, out, count);
    case DType::kInt32:
      return reduce_native<int32_t>(op, incoming, local, out, count);
    case DType::kUint32:
      return reduce_native<uint32_t>(op, incoming, local, out, count);
    case DType::kInt64:
      return reduce_native<int64_t>(op, incoming, local, out, count);
    case DType::kUint64:
      return reduce_native<uint64_t>(op, incoming, local, out, count);
    case DType::kFloat32:
      return reduce_native<float>(op, incoming, local, out, count);
    case DType::kFloat64:
      return reduce_native<double>(op, incoming, local, out, count);
    case DType::kFloat16:
      return reduce_16<true>(op, static_cast<const uint16_t*>(incoming),
                             static_cast<const uint16_t*>(local), static_cast<uint16_t*>(out),
                             count);
    case DType::kBfloat16:
      return reduce_16<false>(op, static_cast<const uint16_t*>(incoming),
                              static_cast<const uint16_t*>(local), static_cast<uint16_t*>(out),
                              count);
    default:
      return reduce_fp8(dtype, op, static_cast<const uint8_t*>(incoming),
                        static_cast<const uint8_t*>(local), static_cast<uint8_t*>(out), count);
  }
}

void finish_average(DType dtype, void* data, size_t count, int nranks) {
  switch (dtype) {
    case DType::kInt8:
      return average_int<int8_t>(data, count, nranks);
    case DType::kUint8:
      return average_int<uint8_t>(data, count, nranks);
    case DType::kInt32:
      return average_int<int32_t>(data, count, nranks);
    case DType::kUint32:
      return average_int<uint32_t>(data, count, nranks);
    case DType::kInt64:
      return average_int<int64_t>(data, count, nranks);
    case DType::kUint64:
      return average_int<uint64_t>(data, count, nranks);
    case DType::kFloat32: {
      float* d = static_cast<float*>(data);
      const float n = static_cast<float>(nranks);
      for (size_t i = 0; i < count; ++i) d[i] = d[i] / n;
      return;
    }
    case DType::kFloat64: {
      double* d = static_cast<double*>(data);
      const double n = static_cast<double>(nranks);
      for (size_t i = 0; i < count; ++i) d[i] = d[i] / n;
      return;
    }
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(data);
      const float* table = half_table();
      for (size_t i = 0; i < count; ++i)
        d[i] = half_from_double(static_cast<double>(table[d[i]]) / nranks);
      return;
    }
    case DType::kBfloat16: {
      uint16_t* d = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < count; ++i)
        d[i] =
            f32_to_bf16_rne(float_round_to_odd(static_cast<double>(bf16_to_float(d[i])) / nranks));
      return;
    }
    default: {
      const size_t width = dtype_size(dtype);
      unsigned char* bytes = static_cast<unsigned char*>(data);
      for (size_t i = 0; i < count; ++i) {
        uint32_t bits = 0;
        std::memcpy(&bits, bytes + i * width, width);  // little endian
        bits = narrow_from_double(dtype, narrow_to_double(dtype, bits) / nranks);
        std::memcpy(bytes + i * width, &bits, width);
      }
      return;
    }
  }
}

double narrow_to_double(DType dtype, uint32_t bits) {
  return decode(format_of(dtype), bits);
}
uint32_t narrow_from_double(DType dtype, double value) {
  return encode(format_of(dtype), value);
}

}  // namespace dq::cpunccl
