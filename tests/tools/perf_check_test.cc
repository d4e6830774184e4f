// dynamiq-perf's checker: narrow-float conversions, and check_result() against an all-reduce
// simulated here in the element type (reverse rank order, rounding at every step).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "tools/perf/perf_check.h"

namespace dq::perf {
namespace {

const DType kAllTypes[] = {DType::kInt8,    DType::kUint8,   DType::kInt32,   DType::kUint32,
                           DType::kInt64,   DType::kUint64,  DType::kFloat16, DType::kFloat32,
                           DType::kFloat64, DType::kBfloat16};
const RedOp kAllOps[] = {RedOp::kSum, RedOp::kProd, RedOp::kMax, RedOp::kMin, RedOp::kAvg};

TEST(HalfConversion, KnownValues) {
  EXPECT_EQ(float_to_half(1.0f), 0x3C00);
  EXPECT_EQ(float_to_half(-2.0f), 0xC000);
  EXPECT_EQ(float_to_half(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_half(65520.0f), 0x7C00);  // halfway to 65536: ties to even = overflow
  EXPECT_EQ(float_to_half(65519.0f), 0x7BFF);
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -25)), 0x0000);         // tie to even: zero
  EXPECT_EQ(float_to_half(std::ldexp(3.0f, -26)), 0x0001);         // above the tie
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -14)), 0x0400);         // smallest normal
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie to even
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(3.0f, -11)), 0x3C02);  // tie to even, up
  EXPECT_EQ(float_to_half(-0.0f), 0x8000);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(std::nanf("")))));
  EXPECT_EQ(half_to_float(0x3555), (1 + 0x155 / 1024.0f) * 0.25f);  // 2^(13-15) * 1.m
}

TEST(HalfConversion, EveryHalfRoundTripsAndDecodesLikeTheFormula) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const auto h = static_cast<uint16_t>(bits);
    const float f = half_to_float(h);
    const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    const double sign = (h & 0x8000) ? -1 : 1;
    if (exponent == 0x1f) {
      EXPECT_TRUE(mantissa ? std::isnan(f) : std::isinf(f)) << bits;
      if (mantissa) continue;
    } else if (exponent == 0) {
      EXPECT_EQ(f, sign * std::ldexp(mantissa, -24)) << bits;
    } else {
      EXPECT_EQ(f, sign * std::ldexp(1024 + mantissa, exponent - 25)) << bits;
    }
    EXPECT_EQ(float_to_half(f), h) << bits;
  }
}

TEST(Bfloat16Conversion, RoundsToNearestEvenAndRoundTrips) {
  EXPECT_EQ(float_to_bfloat16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bfloat16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);  // tie to even
  EXPECT_EQ(float_to_bfloat16(1.0f + std::ldexp(3.0f, -8)), 0x3F82);  // tie to even, up
  EXPECT_EQ(float_to_bfloat16(1.0f + std::ldexp(1.0f, -9) * 3), 0x3F81);
  EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(std::nanf("")))));
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float f = bfloat16_to_float(static_cast<uint16_t>(bits));
    if (std::isnan(f)) continue;
    EXPECT_EQ(float_to_bfloat16(f), bits);
  }
}

// Rounds a value to the element type through a one-element buffer.
template <typename V, typename Load, typename Store>
V load_round(V v, Load load, Store store) {
  unsigned char tmp[8];
  store(tmp, 0, v);
  return load(tmp, 0);
}

// The all-reduce in the element type, ranks combined in reverse order with rounding at each
// step; avg as NCCL does it: floats pre-multiplied by 1/n, integers summed then divided.
template <typename T, typename Load, typename Store>
void simulate(RedOp op, int n, size_t count, const std::vector<std::vector<unsigned char>>& in,
              Load load, Store store, void* out) {
  for (size_t i = 0; i < count; ++i) {
    auto input = [&](int r) { return load(in[r].data(), i); };
    auto acc = input(n - 1);
    if (op == RedOp::kAvg && std::is_floating_point_v<decltype(acc)>)
      acc = load_round(acc * (decltype(acc))(1.0 / n), load, store);
    for (int r = n - 2; r >= 0; --r) {
      auto x = input(r);
      switch (op) {
        case RedOp::kSum:
          acc = load_round(acc + x, load, store);
          break;
        case RedOp::kProd:
          acc = load_round(acc * x, load, store);
          break;
        case RedOp::kMax:
          acc = acc > x ? acc : x;
          break;
        case RedOp::kMin:
          acc = acc < x ? acc : x;
          break;
        case RedOp::kAvg:
          if constexpr (std::is_floating_point_v<decltype(acc)>)
            acc = load_round(acc + load_round(x * (decltype(acc))(1.0 / n), load, store), load,
                             store);
          else
            acc = load_round(acc + x, load, store);
          break;
        case RedOp::kCount:
          break;
      }
    }
    if constexpr (!std::is_floating_point_v<decltype(acc)>)
      if (op == RedOp::kAvg) acc = load_round(acc / static_cast<decltype(acc)>(n), load, store);
    store(out, i, acc);
  }
}

// Runs `fn(load, store)` with the element type's accessors: floats travel as float (half,
// bfloat16, float) or double; integers as int64/uint64, truncated on store.
template <typename Fn>
void with_accessors(DType type, Fn fn) {
  auto ints = [&](auto zero) {
    using T = decltype(zero);
    using Wide = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
    fn([](const void* p, size_t i) { return static_cast<Wide>(static_cast<const T*>(p)[i]); },
       [](void* p, size_t i, Wide v) {
         static_cast<T*>(p)[i] = static_cast<T>(static_cast<uint64_t>(v));
       });
  };
  switch (type) {
    case DType::kInt8:
      return ints(int8_t{});
    case DType::kUint8:
      return ints(uint8_t{});
    case DType::kInt32:
      return ints(int32_t{});
    case DType::kUint32:
      return ints(uint32_t{});
    case DType::kInt64:
      return ints(int64_t{});
    case DType::kUint64:
      return ints(uint64_t{});
    case DType::kFloat16:
      return fn(
          [](const void* p, size_t i) { return half_to_float(static_cast<const uint16_t*>(p)[i]); },
          [](void* p, size_t i, float v) { static_cast<uint16_t*>(p)[i] = float_to_half(v); });
    case DType::kBfloat16:
      return fn(
          [](const void* p, size_t i) {
            return bfloat16_to_float(static_cast<const uint16_t*>(p)[i]);
          },
          [](void* p, size_t i, float v) { static_cast<uint16_t*>(p)[i] = float_to_bfloat16(v); });
    case DType::kFloat32:
      return fn([](const void* p, size_t i) { return static_cast<const float*>(p)[i]; },
                [](void* p, size_t i, float v) { static_cast<float*>(p)[i] = v; });
    case DType::kFloat64:
      return fn([](const void* p, size_t i) { return static_cast<const double*>(p)[i]; },
                [](void* p, size_t i, double v) { static_cast<double*>(p)[i] = v; });
    case DType::kFloat8e4m3:  // not offered by dynamiq-perf
    case DType::kFloat8e5m2:
    case DType::kCount:
      return;
  }
}

std::vector<unsigned char> simulated_allreduce(DType type, RedOp op, int n, size_t count) {
  const size_t bytes = count * dtype_bytes(type);
  std::vector<std::vector<unsigned char>> in(n, std::vector<unsigned char>(bytes));
  for (int r = 0; r < n; ++r) fill_input(type, op, r, count, in[r].data());
  std::vector<unsigned char> out(bytes);
  with_accessors(type, [&](auto load, auto store) {
    using V = decltype(load(nullptr, 0));
    simulate<V>(op, n, count, in, load, store, out.data());
  });
  return out;
}

TEST(CheckResult, AcceptsAnIndependentlyComputedAllReduceOfEveryTypeAndOp) {
  constexpr size_t kCount = 4099;
  for (int n : {1, 2, 3, 4, 8}) {
    for (DType type : kAllTypes) {
      for (RedOp op : kAllOps) {
        auto result = simulated_allreduce(type, op, n, kCount);
        CheckResult c = check_result(type, op, n, kCount, result.data());
        EXPECT_EQ(c.wrong, 0u) << dtype_name(type) << " " << redop_name(op) << " n=" << n;
        EXPECT_EQ(c.nonfinite, 0u);
        const double v = vnmse(c.error_sq, c.exact_sq);
        if (!is_floating(type) || op == RedOp::kMax || op == RedOp::kMin)
          EXPECT_EQ(v, 0.0) << dtype_name(type) << " " << redop_name(op);
        else
          EXPECT_LT(v, 1e-3) << dtype_name(type) << " " << redop_name(op);
      }
    }
  }
}

// A reduce-scatter's block r is elements r x recvcount .. of the all-reduce: check_result's
// offset. Checking the block against another offset finds it wrong.
TEST(CheckResult, ReduceScatterBlockAtItsOffset) {
  constexpr size_t kRecv = 1000;
  for (int n : {2, 3, 4}) {
    for (DType type : {DType::kFloat32, DType::kInt32, DType::kBfloat16, DType::kFloat16}) {
      for (RedOp op : {RedOp::kSum, RedOp::kAvg, RedOp::kMax}) {
        auto all = simulated_allreduce(type, op, n, kRecv * n);
        const size_t esize = dtype_bytes(type);
        for (int r = 0; r < n; ++r) {
          const unsigned char* block = all.data() + r * kRecv * esize;
          CheckResult c = check_result(type, op, n, kRecv, block, r * kRecv);
          EXPECT_EQ(c.wrong, 0u) << dtype_name(type) << " " << redop_name(op) << " r=" << r;
          CheckResult other = check_result(type, op, n, kRecv, block, ((r + 1) % n) * kRecv);
          EXPECT_GT(other.wrong, kRecv / 2) << dtype_name(type) << " " << redop_name(op);
        }
      }
    }
  }
}

// nccl-tests' sizes and bandwidths: all_reduce_perf, reduce_scatter_perf, reduce_perf.
TEST(CollCounts, NcclTestsConventions) {
  // Reduce-scatter: recvcount = (bytes / element / n) rounded down to 16 bytes of elements.
  CollCounts c = coll_counts(Collective::kReduceScatter, 1 << 20, 4, 4);
  EXPECT_EQ(c.recv, 65536u);
  EXPECT_EQ(c.param, 65536u);
  EXPECT_EQ(c.send, 262144u);
  c = coll_counts(Collective::kReduceScatter, 1000, 4, 3);  // 250 / 3 = 83 -> 80
  EXPECT_EQ(c.recv, 80u);
  EXPECT_EQ(c.send, 240u);
  c = coll_counts(Collective::kReduceScatter, 1000, 2, 3);  // 500 / 3 = 166 -> 160
  EXPECT_EQ(c.recv, 160u);
  c = coll_counts(Collective::kReduceScatter, 1000, 1, 3);  // 333 -> 320
  EXPECT_EQ(c.recv, 320u);
  c = coll_counts(Collective::kReduceScatter, 100, 8, 8);  // 12 / 8 = 1 -> 0
  EXPECT_EQ(c.recv, 0u);
  for (Collective k : {Collective::kAllReduce, Collective::kReduce}) {
    c = coll_counts(k, 1002, 4, 3);
    EXPECT_EQ(c.send, 250u);
    EXPECT_EQ(c.recv, 250u);
    EXPECT_EQ(c.param, 250u);
  }
  // algbw over the send buffer (n x recvcount for a reduce-scatter, the message for a reduce);
  // busbw factors 2(n-1)/n, (n-1)/n, 1.
  c = coll_counts(Collective::kReduceScatter, 1 << 20, 4, 4);
  EXPECT_DOUBLE_EQ(alg_bandwidth(Collective::kReduceScatter, c, 4, 1e-3), 1048576 / 1e-3 / 1e9);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::kReduceScatter, 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::kAllReduce, 4), 1.5);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::kReduce, 4), 1.0);
  c = coll_counts(Collective::kReduce, 4000, 4, 8);
  EXPECT_DOUBLE_EQ(alg_bandwidth(Collective::kReduce, c, 4, 2.0), 4000 / 2.0 / 1e9);
  EXPECT_EQ(alg_bandwidth(Collective::kAllReduce, c, 4, 0.0), 0.0);
}

TEST(CheckResult, CountsACorruptedElement) {
  constexpr size_t kCount = 1000;
  for (DType type : kAllTypes) {
    for (RedOp op : kAllOps) {
      auto result = simulated_allreduce(type, op, 4, kCount);
      // Far beyond any rounding tolerance for floats, an exact mismatch for integers.
      with_accessors(type, [&](auto load, auto store) {
        auto v = load(result.data(), 17);
        if constexpr (std::is_floating_point_v<decltype(v)>)
          store(result.data(), 17, v + 0.5f * (1 + std::fabs(v)));
        else
          store(result.data(), 17, v + 1);
      });
      CheckResult c = check_result(type, op, 4, kCount, result.data());
      EXPECT_EQ(c.wrong, 1u) << dtype_name(type) << " " << redop_name(op);
      EXPECT_GT(vnmse(c.error_sq, c.exact_sq), 0.0);
    }
  }
}

TEST(CheckResult, MissingRankIsWrongAlmostEverywhere) {
  constexpr size_t kCount = 1000;
  for (DType type : {DType::kFloat32, DType::kFloat16, DType::kInt32, DType::kBfloat16}) {
    auto partial = simulated_allreduce(type, RedOp::kSum, 3, kCount);  // one rank short
    CheckResult c = check_result(type, RedOp::kSum, 4, kCount, partial.data());
    EXPECT_GT(c.wrong, kCount * 3 / 4) << dtype_name(type);
  }
}

TEST(CheckResult, FlagsNonFiniteResults) {
  constexpr size_t kCount = 64;
  auto result = simulated_allreduce(DType::kFloat32, RedOp::kSum, 2, kCount);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(result.data() + 5 * sizeof(float), &nan, sizeof nan);
  CheckResult c = check_result(DType::kFloat32, RedOp::kSum, 2, kCount, result.data());
  EXPECT_EQ(c.nonfinite, 1u);
  EXPECT_EQ(c.wrong, 1u);
  EXPECT_TRUE(std::isinf(vnmse(c.error_sq, c.exact_sq)));
}

TEST(CheckResult, IntegerAverageTruncatesTowardZero) {
  // Three int8 ranks: find an element whose sum is negative and not a multiple of 3, where
  // floor division would differ from truncation.
  constexpr size_t kCount = 256;
  std::vector<std::vector<int8_t>> in(3, std::vector<int8_t>(kCount));
  for (int r = 0; r < 3; ++r) fill_input(DType::kInt8, RedOp::kAvg, r, kCount, in[r].data());
  std::vector<int8_t> truncated(kCount), floored(kCount);
  bool found_negative_remainder = false;
  for (size_t i = 0; i < kCount; ++i) {
    int sum = in[0][i] + in[1][i] + in[2][i];
    truncated[i] = static_cast<int8_t>(sum / 3);
    floored[i] = static_cast<int8_t>(std::floor(sum / 3.0));
    found_negative_remainder |= sum < 0 && sum % 3 != 0;
  }
  ASSERT_TRUE(found_negative_remainder);
  EXPECT_EQ(check_result(DType::kInt8, RedOp::kAvg, 3, kCount, truncated.data()).wrong, 0u);
  EXPECT_GT(check_result(DType::kInt8, RedOp::kAvg, 3, kCount, floored.data()).wrong, 0u);
}

TEST(FillInput, DiffersByRankAndIsReproducible) {
  std::vector<float> a(512), b(512), c(512);
  fill_input(DType::kFloat32, RedOp::kSum, 0, a.size(), a.data());
  fill_input(DType::kFloat32, RedOp::kSum, 1, b.size(), b.data());
  fill_input(DType::kFloat32, RedOp::kSum, 0, c.size(), c.data());
  EXPECT_EQ(a, c);
  EXPECT_NE(a, b);
  for (float x : a) EXPECT_TRUE(x >= -1.0f && x < 1.0f);
}

TEST(HashBytes, AnySingleByteChangeChangesTheHash) {
  std::vector<unsigned char> data(1003);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 7);
  const uint64_t base = hash_bytes(data.data(), data.size());
  EXPECT_EQ(hash_bytes(data.data(), data.size()), base);
  EXPECT_NE(hash_bytes(data.data(), data.size() - 1), base);
  for (size_t i = 0; i < data.size(); ++i) {
    data[i] ^= 1;
    EXPECT_NE(hash_bytes(data.data(), data.size()), base) << i;
    data[i] ^= 1;
  }
}

TEST(Vnmse, EdgeCases) {
  EXPECT_EQ(vnmse(0, 0), 0);
  EXPECT_EQ(vnmse(0, 5), 0);
  EXPECT_TRUE(std::isinf(vnmse(1, 0)));
  EXPECT_DOUBLE_EQ(vnmse(2, 8), 0.25);
}

}  // namespace
}  // namespace dq::perf
