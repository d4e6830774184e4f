// Unit tests of the CPU NCCL's element arithmetic (tools/cpu-nccl/reduce.h), against
// independent references: the compiler's _Float16 conversions, the project's BF16 rounding,
// and exhaustive nearest-value search for the FP8 formats.
#include "tools/cpu-nccl/reduce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/bf16.h"

namespace dq::cpunccl {
namespace {

uint16_t half_bits(_Float16 h) {
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

TEST(CpuNcclReduce, HalfDecodeMatchesCompilerForEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    _Float16 h;
    uint16_t bits = static_cast<uint16_t>(b);
    std::memcpy(&h, &bits, 2);
    double want = static_cast<double>(h);
    double got = narrow_to_double(DType::kFloat16, b);
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(got)) << b;
    else
      EXPECT_EQ(got, want) << b;
  }
}

TEST(CpuNcclReduce, HalfEncodeRoundsLikeCompiler) {
  std::mt19937_64 gen(7);
  std::uniform_int_distribution<uint32_t> pattern(0, 0x7bff);
  std::uniform_real_distribution<double> frac(0.0, 1.0);
  for (int i = 0; i < 200000; ++i) {
    // Points between neighbours, exact midpoints included (ties to even).
    uint32_t b = pattern(gen);
    double lo = narrow_to_double(DType::kFloat16, b), hi = narrow_to_double(DType::kFloat16, b + 1);
    double x = (i % 4 == 0) ? (lo + hi) / 2 : lo + (hi - lo) * frac(gen);
    if (i % 2) x = -x;
    EXPECT_EQ(narrow_from_double(DType::kFloat16, x), half_bits(static_cast<_Float16>(x))) << x;
  }
  EXPECT_EQ(narrow_from_double(DType::kFloat16, 1e6), 0x7c00u);              // overflow -> Inf
  EXPECT_EQ(narrow_from_double(DType::kFloat16, 65519.0), 0x7bffu);          // below the tie
  EXPECT_EQ(narrow_from_double(DType::kFloat16, 65520.0), 0x7c00u);          // tie -> Inf (even)
  EXPECT_EQ(narrow_from_double(DType::kFloat16, std::ldexp(1.0, -25)), 0u);  // tie -> 0 (even)
  EXPECT_EQ(narrow_from_double(DType::kFloat16, std::ldexp(1.5, -25)), 1u);  // smallest subnormal
}

TEST(CpuNcclReduce, Bf16EncodeMatchesProjectRounding) {
  std::mt19937 gen(11);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = bits(gen);
    float f;
    std::memcpy(&f, &u, 4);
    if (!std::isfinite(f)) continue;
    EXPECT_EQ(narrow_from_double(DType::kBfloat16, f), f32_to_bf16_rne(f)) << f;
    EXPECT_EQ(narrow_to_double(DType::kBfloat16, f32_to_bf16_rne(f)),
              static_cast<double>(bf16_to_f32(f32_to_bf16_rne(f))));
  }
}

// FP8: exhaustive check against brute-force nearest with ties to even.
void check_fp8(DType dtype, double max_finite, bool has_inf) {
  std::vector<std::pair<double, uint32_t>> values;
  for (uint32_t b = 0; b < 128; ++b) {
    double v = narrow_to_double(dtype, b);
    if (std::isfinite(v)) values.push_back({v, b});
  }
  ASSERT_EQ(values.back().first, max_finite);
  for (size_t i = 0; i + 1 < values.size(); ++i) {
    double lo = values[i].first, hi = values[i + 1].first;
    for (double t : {0.25, 0.5, 0.75}) {
      double x = lo + (hi - lo) * t;
      uint32_t want = t < 0.5 ? values[i].second
                      : t > 0.5
                          ? values[i + 1].second
                          : ((values[i].second & 1) == 0 ? values[i].second : values[i + 1].second);
      EXPECT_EQ(narrow_from_double(dtype, x), want) << x;
      EXPECT_EQ(narrow_from_double(dtype, -x), want | 0x80u) << -x;
    }
    EXPECT_EQ(narrow_from_double(dtype, lo), values[i].second);
  }
  uint32_t overflow = narrow_from_double(dtype, max_finite * 4);
  if (has_inf)
    EXPECT_TRUE(std::isinf(narrow_to_double(dtype, overflow)));
  else
    EXPECT_TRUE(std::isnan(narrow_to_double(dtype, overflow)));
}

TEST(CpuNcclReduce, Fp8E4m3) {
  check_fp8(DType::kFloat8e4m3, 448.0, false);
}
TEST(CpuNcclReduce, Fp8E5m2) {
  check_fp8(DType::kFloat8e5m2, 57344.0, true);
}

TEST(CpuNcclReduce, IntegerOpsWrapAndAverageTruncates) {
  int8_t a[4] = {100, -100, 7, -7}, b[4] = {100, -100, -3, 3}, o[4];
  reduce_elements(DType::kInt8, RedOp::kSum, a, b, o, 4);
  EXPECT_EQ(o[0], static_cast<int8_t>(200));
  EXPECT_EQ(o[1], static_cast<int8_t>(-200));
  reduce_elements(DType::kInt8, RedOp::kProd, a, b, o, 4);
  EXPECT_EQ(o[2], -21);
  reduce_elements(DType::kInt8, RedOp::kMax, a, b, o, 4);
  EXPECT_EQ(o[2], 7);
  EXPECT_EQ(o[3], 3);
  reduce_elements(DType::kInt8, RedOp::kMin, a, b, o, 4);
  EXPECT_EQ(o[2], -3);
  int32_t s[3] = {7, -7, 8};
  finish_average(DType::kInt32, s, 3, 2);
  EXPECT_EQ(s[0], 3);
  EXPECT_EQ(s[1], -3);
  EXPECT_EQ(s[2], 4);
  uint64_t big[2] = {~0ull, 5}, one[2] = {1, 5}, r[2];
  reduce_elements(DType::kUint64, RedOp::kSum, big, one, r, 2);
  EXPECT_EQ(r[0], 0u);
  EXPECT_EQ(r[1], 10u);
}

// AVG of 8-bit integers over more ranks than the type holds: divided by the rank count itself,
// not by it narrowed to the type (negative for int8 from 129, 0 at 256: SIGFPE).
TEST(CpuNcclReduce, IntegerAverageOverManyRanks) {
  int8_t s8[2] = {100, -100};
  finish_average(DType::kInt8, s8, 2, 200);
  EXPECT_EQ(s8[0], 0);
  EXPECT_EQ(s8[1], 0);
  uint8_t u8[2] = {255, 200};
  finish_average(DType::kUint8, u8, 1, 256);
  EXPECT_EQ(u8[0], 0);
  finish_average(DType::kUint8, u8 + 1, 1, 100);
  EXPECT_EQ(u8[1], 2);
  uint8_t w[1] = {200};
  finish_average(DType::kUint8, w, 1, 300);
  EXPECT_EQ(w[0], 0);
}

TEST(CpuNcclReduce, HalfSumRoundsOncePerStep) {
  // 2048 + 1 is a tie in half (spacing 2 there): ties to even gives 2048; 2050 + 1 -> 2052.
  uint16_t a[2] = {half_bits(static_cast<_Float16>(2048.0)),
                   half_bits(static_cast<_Float16>(2050.0))};
  uint16_t b[2] = {half_bits(static_cast<_Float16>(1.0)), half_bits(static_cast<_Float16>(1.0))};
  uint16_t o[2];
  reduce_elements(DType::kFloat16, RedOp::kSum, a, b, o, 2);
  EXPECT_EQ(narrow_to_double(DType::kFloat16, o[0]), 2048.0);
  EXPECT_EQ(narrow_to_double(DType::kFloat16, o[1]), 2052.0);
  uint16_t avg[1] = {half_bits(static_cast<_Float16>(5.0))};
  finish_average(DType::kFloat16, avg, 1, 3);
  EXPECT_EQ(avg[0], half_bits(static_cast<_Float16>(5.0 / 3.0)));
}

// The fast paths (float arithmetic for half/bf16, lookup tables for fp8) against one exact
// operation in double followed by one rounding.
TEST(CpuNcclReduce, NarrowOpsEqualExactOperationRoundedOnce) {
  std::mt19937_64 gen(5);
  for (DType dtype : {DType::kFloat16, DType::kBfloat16, DType::kFloat8e4m3, DType::kFloat8e5m2}) {
    const size_t width = dtype_size(dtype);
    const uint32_t mask = width == 2 ? 0xffffu : 0xffu;
    const size_t n = 100000;
    std::vector<uint8_t> a(n * width), b(n * width), o(n * width);
    for (auto& x : a) x = static_cast<uint8_t>(gen());
    for (auto& x : b) x = static_cast<uint8_t>(gen());
    for (RedOp op : {RedOp::kSum, RedOp::kProd, RedOp::kMax, RedOp::kMin}) {
      reduce_elements(dtype, op, a.data(), b.data(), o.data(), n);
      for (size_t i = 0; i < n; ++i) {
        uint32_t xa = 0, xb = 0, xo = 0;
        std::memcpy(&xa, &a[i * width], width);
        std::memcpy(&xb, &b[i * width], width);
        std::memcpy(&xo, &o[i * width], width);
        const double da = narrow_to_double(dtype, xa & mask),
                     db = narrow_to_double(dtype, xb & mask);
        double exact = op == RedOp::kSum    ? da + db
                       : op == RedOp::kProd ? da * db
                       : op == RedOp::kMax  ? (da > db ? da : db)
                                            : (da < db ? da : db);
        const double got = narrow_to_double(dtype, xo);
        if (std::isnan(exact)) {
          if (op == RedOp::kSum || op == RedOp::kProd) {
            EXPECT_TRUE(std::isnan(got));
          }
          continue;
        }
        EXPECT_EQ(xo, narrow_from_double(dtype, exact))
            << dtype_name(dtype) << " " << redop_name(op) << " " << da << " " << db;
      }
    }
  }
}

// Average of half / bf16: one correctly rounded division, for every rank count tried.
TEST(CpuNcclReduce, NarrowAverageRoundsOnce) {
  std::mt19937 gen(9);
  for (DType dtype : {DType::kFloat16, DType::kBfloat16}) {
    for (int n : {2, 3, 5, 7, 8, 1000}) {
      std::vector<uint16_t> v(50000);
      for (auto& x : v) x = static_cast<uint16_t>(gen());
      std::vector<uint16_t> avg = v;
      finish_average(dtype, avg.data(), avg.size(), n);
      for (size_t i = 0; i < v.size(); ++i) {
        const double exact = narrow_to_double(dtype, v[i]) / n;
        if (std::isnan(exact)) continue;
        EXPECT_EQ(avg[i], narrow_from_double(dtype, exact)) << dtype_name(dtype) << " " << n;
      }
    }
  }
}

TEST(CpuNcclReduce, FloatOpsInPlace) {
  std::vector<float> a = {1.5f, -2.0f, 3.0f}, b = {0.25f, 4.0f, -1.0f};
  reduce_elements(DType::kFloat32, RedOp::kProd, a.data(), b.data(), a.data(), 3);
  EXPECT_EQ(a[0], 0.375f);
  EXPECT_EQ(a[1], -8.0f);
  EXPECT_EQ(a[2], -3.0f);
  std::vector<double> c = {1.0, 2.0}, d = {3.0, -5.0};
  reduce_elements(DType::kFloat64, RedOp::kMin, c.data(), d.data(), d.data(), 2);
  EXPECT_EQ(d[0], 1.0);
  EXPECT_EQ(d[1], -5.0);
  EXPECT_EQ(dtype_size(DType::kBfloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kFloat8e5m2), 1u);
  EXPECT_FALSE(dtype_valid(12));
  EXPECT_FALSE(redop_valid(5));
}

}  // namespace
}  // namespace dq::cpunccl
