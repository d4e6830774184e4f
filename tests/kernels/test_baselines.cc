// Unit tests of the comparison baselines (BF16, OCP MX v1.0, uniform stochastic) behind the
// codec interface. Every byte a codec produces is compared with a scalar reference written here
// independently (double arithmetic, table search, its own bit packing), so a wrong rounding,
// scale, layout or RNG keying shows up as a byte difference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/log.h"
#include "config/settings.h"
#include "kernels/baselines/baselines.h"
#include "kernels/baselines/mx_element.h"
#include "kernels/payload.h"
#include "kernels/philox.h"

namespace dq {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------------------------------------
// What the tests know about each codec (independently of the implementation).

enum class Family { kBf16, kMx, kUniform };

struct CodecSpec {
  std::string name;
  Family family;
  MxKind mx = MxKind::kFp8E4M3;
  int uniform_bits = 0;  // B of uniform:B
  size_t block_elems;
  size_t block_bytes;
  double nominal_bits;  // bits per coordinate without header and padding
  uint8_t codec_id;     // header byte 3 (kernels/payload.h)
};

std::vector<CodecSpec> all_specs() {
  return {
      {"bf16", Family::kBf16, MxKind::kFp8E4M3, 0, 1, 2, 16.0, 2},
      {"mxfp8", Family::kMx, MxKind::kFp8E4M3, 0, 32, 33, 8.25, 3},
      {"mxfp6e3m2", Family::kMx, MxKind::kFp6E3M2, 0, 32, 25, 6.25, 4},
      {"mxfp6e2m3", Family::kMx, MxKind::kFp6E2M3, 0, 32, 25, 6.25, 5},
      {"mxfp4", Family::kMx, MxKind::kFp4E2M1, 0, 32, 17, 4.25, 6},
      {"uniform:3", Family::kUniform, MxKind::kFp8E4M3, 3, 16, 6, 3.0, 7},
      {"uniform:5", Family::kUniform, MxKind::kFp8E4M3, 5, 16, 10, 5.0, 7},
      {"uniform:9", Family::kUniform, MxKind::kFp8E4M3, 9, 16, 18, 9.0, 7},
  };
}

std::unique_ptr<Codec> make(const CodecSpec& s) {
  switch (s.family) {
    case Family::kBf16:
      return make_bf16_codec();
    case Family::kMx:
      return make_mx_codec(s.mx);
    default:
      return make_uniform_codec(s.uniform_bits);
  }
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---------------------------------------------------------------------------------------------
// Scalar references.

// LSB-first packing written independently of kernels/bitpack.h.
void ref_pack(const std::vector<uint32_t>& codes, int bits, uint8_t* out) {
  const size_t n_bytes = (codes.size() * bits + 7) / 8;
  std::fill(out, out + n_bytes, 0);
  for (size_t i = 0; i < codes.size(); ++i)
    for (int b = 0; b < bits; ++b)
      if ((codes[i] >> b) & 1u)
        out[(i * bits + b) / 8] |= static_cast<uint8_t>(1u << ((i * bits + b) % 8));
}
uint32_t ref_unpack(const uint8_t* in, size_t i, int bits) {
  uint32_t v = 0;
  for (int b = 0; b < bits; ++b) v |= ((in[(i * bits + b) / 8] >> ((i * bits + b) % 8)) & 1u) << b;
  return v;
}

// BF16, round to nearest even, by comparing distances in double.
uint16_t ref_bf16(float x) {
  if (std::isnan(x)) return static_cast<uint16_t>((bits_of(x) >> 16) | 0x40);
  const uint32_t u = bits_of(x);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);  // truncation toward zero
  if ((u & 0xffff) == 0) return lo;
  const uint16_t hi = static_cast<uint16_t>(lo + 1);  // next magnitude (may be Inf)
  const double a = std::fabs(static_cast<double>(x));
  const double lo_v = std::fabs(static_cast<double>(float_of(static_cast<uint32_t>(lo) << 16)));
  const double hi_v =
      (hi & 0x7fff) == 0x7f80
          ? std::ldexp(1.0, 128)
          : std::fabs(static_cast<double>(float_of(static_cast<uint32_t>(hi) << 16)));
  if (a - lo_v < hi_v - a) return lo;
  if (a - lo_v > hi_v - a) return hi;
  return (lo & 1) ? hi : lo;
}

struct RefMxFormat {
  int e_bits, m_bits, bias, emax;
  double max_value;
};
RefMxFormat ref_fmt(MxKind k) {
  switch (k) {
    case MxKind::kFp8E4M3:
      return {4, 3, 7, 8, 448.0};
    case MxKind::kFp6E3M2:
      return {3, 2, 3, 4, 28.0};
    case MxKind::kFp6E2M3:
      return {2, 3, 1, 2, 7.5};
    default:
      return {2, 1, 1, 2, 6.0};
  }
}
int ref_elem_bits(MxKind k) {
  return 1 + ref_fmt(k).e_bits + ref_fmt(k).m_bits;
}

// Magnitude of a (sign-less) element code, from the format definition.
double ref_elem_magnitude(MxKind k, uint32_t mag) {
  const RefMxFormat f = ref_fmt(k);
  const uint32_t e = mag >> f.m_bits, m = mag & ((1u << f.m_bits) - 1);
  if (e == 0) return std::ldexp(static_cast<double>(m), 1 - f.bias - f.m_bits);
  return std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -f.m_bits),
                    static_cast<int>(e) - f.bias);
}
// Finite magnitudes, indexed by magnitude code (E4M3 drops its NaN code 0x7F).
std::vector<double> ref_magnitudes(MxKind k) {
  const RefMxFormat f = ref_fmt(k);
  std::vector<double> v;
  for (uint32_t mag = 0; mag < (1u << (f.e_bits + f.m_bits)); ++mag) {
    double x = ref_elem_magnitude(k, mag);
    if (x <= f.max_value) v.push_back(x);
  }
  return v;
}

// RNE to the nearest element (ties to the even code), saturating; x finite.
uint32_t ref_mx_encode(MxKind k, double x, const std::vector<double>& mags) {
  const RefMxFormat f = ref_fmt(k);
  const uint32_t sign = std::signbit(x) ? 1u << (f.e_bits + f.m_bits) : 0u;
  const double a = std::fabs(x);
  if (a >= f.max_value) return sign | static_cast<uint32_t>(mags.size() - 1);
  size_t hi = std::lower_bound(mags.begin(), mags.end(), a) - mags.begin();
  if (mags[hi] == a) return sign | static_cast<uint32_t>(hi);
  size_t lo = hi - 1;
  double dlo = a - mags[lo], dhi = mags[hi] - a;
  size_t pick = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
  return sign | static_cast<uint32_t>(pick);
}

// One MX block (32 values, padding included) -> 1 scale byte + packed codes.
void ref_mx_block(MxKind k, const float* v, uint8_t* out, const std::vector<double>& mags) {
  const RefMxFormat f = ref_fmt(k);
  bool finite = true;
  double amax = 0;
  for (int i = 0; i < 32; ++i) {
    finite &= std::isfinite(v[i]);
    amax = std::max(amax, std::fabs(static_cast<double>(v[i])));
  }
  std::vector<uint32_t> codes(32, 0);
  if (!finite) {
    out[0] = 0xFF;
  } else {
    int e = amax == 0 ? -127 : std::clamp(std::ilogb(amax) - f.emax, -127, 127);
    out[0] = static_cast<uint8_t>(e + 127);
    for (int i = 0; i < 32; ++i)
      codes[i] = ref_mx_encode(k, std::ldexp(static_cast<double>(v[i]), -e), mags);
  }
  ref_pack(codes, ref_elem_bits(k), out + 1);
}
void ref_mx_decode_block(MxKind k, const uint8_t* in, float* v) {
  const int bits = ref_elem_bits(k);
  for (int i = 0; i < 32; ++i) {
    if (in[0] == 0xFF) {
      v[i] = kNaN;
      continue;
    }
    uint32_t c = ref_unpack(in + 1, i, bits);
    uint32_t mag = c & ((1u << (bits - 1)) - 1);
    double x = (k == MxKind::kFp8E4M3 && mag == 0x7F) ? std::nan("") : ref_elem_magnitude(k, mag);
    if (c >> (bits - 1)) x = -x;
    v[i] = static_cast<float>(std::ldexp(x, static_cast<int>(in[0]) - 127));
  }
}

// Uniform group (16 values) -> BF16 scale + packed codes, with the documented float arithmetic:
// S = smallest BF16 >= max|x|; t = fl(fl(x / S) * L); q = floor(t) + (u < t - floor(t)),
// u = uniform24 of Philox word (index % 4) of block (index / 4).
void ref_uniform_group(int total_bits, const float* v, size_t first_index, const RoundingKey& key,
                       uint8_t* out) {
  const int k = total_bits - 1, levels = (1 << (k - 1)) - 1;
  bool finite = true;
  float amax = 0;
  for (int i = 0; i < 16; ++i) {
    finite &= std::isfinite(v[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  std::vector<uint32_t> codes(16, static_cast<uint32_t>(levels));
  uint16_t scale_bits = 0;
  if (!finite) {
    scale_bits = 0x7FC0;
  } else if (amax > 0) {
    scale_bits = static_cast<uint16_t>(bits_of(amax) >> 16);
    if (float_of(static_cast<uint32_t>(scale_bits) << 16) < amax) ++scale_bits;
    const float s = float_of(static_cast<uint32_t>(scale_bits) << 16);
    const float l = static_cast<float>(levels);
    for (int i = 0; i < 16; ++i) {
      const size_t idx = first_index + i;
      Philox4 r = philox_draw(key.seed, key.call, key.rank, kStreamRounding,
                              static_cast<uint32_t>(idx / 4));
      const double u = static_cast<double>(r.v[idx % 4] >> 8) / 16777216.0;
      const float t = std::clamp((v[i] / s) * l, -l, l);
      const float fl = std::floor(t);
      int q = static_cast<int>(fl) + (u < static_cast<double>(t - fl) ? 1 : 0);
      codes[i] = static_cast<uint32_t>(std::min(q, levels) + levels);
    }
  }
  out[0] = static_cast<uint8_t>(scale_bits);
  out[1] = static_cast<uint8_t>(scale_bits >> 8);
  ref_pack(codes, k, out + 2);
}
void ref_uniform_decode_group(int total_bits, const uint8_t* in, float* v) {
  const int k = total_bits - 1, levels = (1 << (k - 1)) - 1;
  const float s = float_of(static_cast<uint32_t>(in[0] | (in[1] << 8)) << 16);
  for (int i = 0; i < 16; ++i) {
    const int q = static_cast<int>(ref_unpack(in + 2, i, k)) - levels;
    v[i] = static_cast<float>(static_cast<double>(q) * s / levels);
  }
}

// Reference encoding of the elements [begin, end) (block-aligned begin) into block bytes.
std::vector<uint8_t> ref_encode(const CodecSpec& spec, const std::vector<float>& x, size_t begin,
                                size_t end, const RoundingKey& key) {
  const size_t n_blocks = (end - begin + spec.block_elems - 1) / spec.block_elems;
  std::vector<uint8_t> out(n_blocks * spec.block_bytes);
  const std::vector<double> mags =
      spec.family == Family::kMx ? ref_magnitudes(spec.mx) : std::vector<double>{};
  std::vector<float> block(spec.block_elems);
  for (size_t b = 0; b < n_blocks; ++b) {
    const size_t e0 = begin + b * spec.block_elems;
    for (size_t i = 0; i < spec.block_elems; ++i) block[i] = e0 + i < end ? x[e0 + i] : 0.0f;
    uint8_t* dst = out.data() + b * spec.block_bytes;
    if (spec.family == Family::kBf16) {
      uint16_t h = ref_bf16(block[0]);
      dst[0] = static_cast<uint8_t>(h);
      dst[1] = static_cast<uint8_t>(h >> 8);
    } else if (spec.family == Family::kMx) {
      ref_mx_block(spec.mx, block.data(), dst, mags);
    } else {
      ref_uniform_group(spec.uniform_bits, block.data(), e0, key, dst);
    }
  }
  return out;
}
// Reference decoding of block bytes back into x[begin, end).
void ref_decode(const CodecSpec& spec, const uint8_t* in, size_t begin, size_t end,
                std::vector<float>* x) {
  const size_t n_blocks = (end - begin + spec.block_elems - 1) / spec.block_elems;
  std::vector<float> block(spec.block_elems);
  for (size_t b = 0; b < n_blocks; ++b) {
    const uint8_t* src = in + b * spec.block_bytes;
    if (spec.family == Family::kBf16)
      block[0] = float_of(static_cast<uint32_t>(src[0] | (src[1] << 8)) << 16);
    else if (spec.family == Family::kMx)
      ref_mx_decode_block(spec.mx, src, block.data());
    else
      ref_uniform_decode_group(spec.uniform_bits, src, block.data());
    const size_t e0 = begin + b * spec.block_elems;
    for (size_t i = 0; i < spec.block_elems && e0 + i < end; ++i) (*x)[e0 + i] = block[i];
  }
}

// ---------------------------------------------------------------------------------------------
// Driving a codec.

ConstTensor f32(const std::vector<float>& v) {
  return ConstTensor{v.data(), DType::kF32, v.size()};
}

size_t expected_capacity(const CodecSpec& s, size_t count, int n_chunks) {
  const size_t blocks = (count + s.block_elems - 1) / s.block_elems;
  return kChunkHeaderBytes + (blocks + n_chunks - 1) / n_chunks * s.block_bytes;
}

std::pair<size_t, size_t> range_of(const Codec& c, int chunk) {
  std::vector<std::pair<size_t, size_t>> r;
  c.chunk_ranges(chunk, &r);
  EXPECT_EQ(r.size(), 1u);
  return r.empty() ? std::pair<size_t, size_t>{0, 0} : r[0];
}

// A chunk message with 16 guard bytes after chunk_capacity() (must stay untouched).
struct Msg {
  std::vector<uint8_t> buf;
  size_t cap;
  explicit Msg(size_t capacity) : buf(capacity + 16, 0xA5), cap(capacity) {}
  uint8_t* data() { return buf.data(); }
  ByteView view() const { return ByteView{buf.data(), cap}; }
  bool guard_intact() const {
    return std::all_of(buf.begin() + cap, buf.end(), [](uint8_t b) { return b == 0xA5; });
  }
};

RoundingKey key_for(uint64_t seed, uint32_t rank, uint32_t n = 4) {
  return RoundingKey{seed, 7, rank, n};
}

// Rejection tests provoke many WARN lines by design; silence them for the test's duration.
struct QuietLog {
  QuietLog() {
    setenv("DYNAMIQ_DEBUG", "NONE", 1);
    config::reload_log_from_env();
  }
  ~QuietLog() {
    unsetenv("DYNAMIQ_DEBUG");
    config::reload_log_from_env();
  }
};

class BaselineTest : public ::testing::TestWithParam<CodecSpec> {};

std::string spec_name(const ::testing::TestParamInfo<CodecSpec>& p) {
  std::string n = p.param.name;
  std::replace(n.begin(), n.end(), ':', '_');
  return n;
}

std::vector<float> random_vector(size_t n, uint32_t seed, float spread = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(-spread, spread);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = nd(rng) * std::exp2(ud(rng) * 4.0f);
  return v;
}

// ---------------------------------------------------------------------------------------------

TEST(BaselineFactory, NamesAndRanges) {
  EXPECT_EQ(make_bf16_codec()->name(), "bf16");
  EXPECT_EQ(make_mx_codec(MxKind::kFp8E4M3)->name(), "mxfp8");
  EXPECT_EQ(make_mx_codec(MxKind::kFp6E3M2)->name(), "mxfp6e3m2");
  EXPECT_EQ(make_mx_codec(MxKind::kFp6E2M3)->name(), "mxfp6e2m3");
  EXPECT_EQ(make_mx_codec(MxKind::kFp4E2M1)->name(), "mxfp4");
  for (int b = 3; b <= 9; ++b) {
    auto c = make_uniform_codec(b);
    ASSERT_NE(c, nullptr) << b;
    EXPECT_EQ(c->name(), "uniform:" + std::to_string(b));
  }
  EXPECT_EQ(make_uniform_codec(2), nullptr);
  EXPECT_EQ(make_uniform_codec(10), nullptr);
  EXPECT_EQ(make_uniform_codec(0), nullptr);
}

TEST(MxElement, MatchesReferenceOnEveryCodeAndGrid) {
  for (MxKind k : {MxKind::kFp8E4M3, MxKind::kFp6E3M2, MxKind::kFp6E2M3, MxKind::kFp4E2M1}) {
    const int bits = ref_elem_bits(k);
    const std::vector<double> mags = ref_magnitudes(k);
    for (uint32_t c = 0; c < (1u << bits); ++c) {
      const float got = mx_decode_element(k, static_cast<uint8_t>(c));
      const uint32_t mag = c & ((1u << (bits - 1)) - 1);
      if (k == MxKind::kFp8E4M3 && mag == 0x7F) {
        EXPECT_TRUE(std::isnan(got)) << c;
        continue;
      }
      double want = ref_elem_magnitude(k, mag) * ((c >> (bits - 1)) ? -1 : 1);
      EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
      EXPECT_EQ(std::signbit(got), (c >> (bits - 1)) != 0) << "code " << c;
      EXPECT_EQ(mx_encode_element(k, got), c) << "code " << c;  // exact values round-trip
    }
    // Dense grid including every midpoint (tie) and its neighbours, and values beyond max.
    const double maxv = ref_fmt(k).max_value;
    for (size_t i = 0; i + 1 < mags.size(); ++i) {
      const float mid = static_cast<float>((mags[i] + mags[i + 1]) / 2);
      for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, kInf), -mid})
        EXPECT_EQ(mx_encode_element(k, x), ref_mx_encode(k, x, mags)) << x;
    }
    for (float x : {static_cast<float>(maxv) * 1.5f, 1e30f, kInf, -kInf, 3.4e38f})
      EXPECT_EQ(mx_encode_element(k, x), ref_mx_encode(k, std::clamp<double>(x, -maxv, maxv), mags))
          << "saturation of " << x;
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> ud(static_cast<float>(-maxv), static_cast<float>(maxv));
    for (int i = 0; i < 20000; ++i) {
      float x = ud(rng) * std::exp2(-static_cast<float>(i % 12));
      EXPECT_EQ(mx_encode_element(k, x), ref_mx_encode(k, x, mags)) << x;
    }
  }
}

TEST_P(BaselineTest, CapacityRangesAndBitsPerCoord) {
  const CodecSpec spec = GetParam();
  for (size_t count : {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{255},
                       size_t{256}, size_t{257}, (size_t{1} << 20) + 3}) {
    for (int n_chunks : {1, 3, 8, 64}) {
      auto c = make(spec);
      ASSERT_EQ(c->plan(count, n_chunks, 4), Status::kOk);
      const size_t cap = expected_capacity(spec, count, n_chunks);
      EXPECT_EQ(c->chunk_capacity(), cap) << count << " / " << n_chunks;
      if (count > 0) {
        EXPECT_DOUBLE_EQ(c->bits_per_coord(), 8.0 * n_chunks * cap / count);
      }
      // Chunks tile [0, count) in order, cut on block boundaries, balanced to one block.
      size_t next = 0, min_blocks = SIZE_MAX, max_blocks = 0;
      for (int ch = 0; ch < n_chunks; ++ch) {
        auto [b, e] = range_of(*c, ch);
        EXPECT_EQ(b, next);
        EXPECT_LE(b, e);
        EXPECT_EQ(b % spec.block_elems, 0u);
        if (e != count) {
          EXPECT_EQ(e % spec.block_elems, 0u);
        }
        const size_t blocks = (e - b + spec.block_elems - 1) / spec.block_elems;
        min_blocks = std::min(min_blocks, blocks);
        max_blocks = std::max(max_blocks, blocks);
        next = e;
      }
      EXPECT_EQ(next, count);
      EXPECT_LE(max_blocks - min_blocks, 1u);
      EXPECT_EQ(kChunkHeaderBytes + max_blocks * spec.block_bytes, cap);
    }
  }
  // One large chunk: only the header and the last partial block above the nominal rate.
  auto c = make(spec);
  const size_t n = (size_t{1} << 20) + 3;
  ASSERT_EQ(c->plan(n, 1, 2), Status::kOk);
  const double overhead = (128.0 + 8.0 * spec.block_bytes) / n;
  EXPECT_GE(c->bits_per_coord(), spec.nominal_bits);
  EXPECT_LE(c->bits_per_coord(), spec.nominal_bits + overhead);
}

TEST_P(BaselineTest, RejectsBadPlansAndArguments) {
  const CodecSpec spec = GetParam();
  QuietLog quiet;
  auto c = make(spec);
  std::vector<float> x(64, 1.0f);
  Msg m(64 * 4);
  EXPECT_EQ(c->hop(0, f32(x), nullptr, 0, m.data(), key_for(1, 0)), Status::kInvalidArgument);
  EXPECT_EQ(c->plan(64, 0, 4), Status::kInvalidArgument);
  EXPECT_EQ(c->plan(64, 2, 0), Status::kInvalidArgument);
  ASSERT_EQ(c->plan(64, 2, 4), Status::kOk);
  ASSERT_EQ(c->agree(nullptr, 3), Status::kOk);
  EXPECT_EQ(c->stats_words(), 0u);
  EXPECT_EQ(c->hop(2, f32(x), nullptr, 0, m.data(), key_for(1, 0)), Status::kInvalidArgument);
  EXPECT_EQ(c->hop(-1, f32(x), nullptr, 0, m.data(), key_for(1, 0)), Status::kInvalidArgument);
  EXPECT_EQ(c->hop(0, f32(x), nullptr, 0, nullptr, key_for(1, 0)), Status::kInvalidArgument);
  std::vector<float> short_x(63, 1.0f);
  EXPECT_EQ(c->hop(0, f32(short_x), nullptr, 0, m.data(), key_for(1, 0)), Status::kInvalidArgument);
  ASSERT_EQ(c->hop(0, f32(x), nullptr, 0, m.data(), key_for(1, 0)), Status::kOk);
  std::vector<float> out(64);
  EXPECT_EQ(c->finish(0, m.view(), out.data(), DType::kF32, ReduceOp::kSum, 0),
            Status::kInvalidArgument);
  EXPECT_EQ(c->finish(0, m.view(), out.data(), DType::kF32, ReduceOp::kSum, 5),
            Status::kInvalidArgument);
}

// Every chunk of a leaf compression: bytes == reference, nothing written past capacity,
// zero padding, header fields, and finish() == reference decode (F32 and BF16 outputs).
TEST_P(BaselineTest, LeafMatchesReferenceAtEverySize) {
  const CodecSpec spec = GetParam();
  for (size_t count : {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{255},
                       size_t{256}, size_t{257}, (size_t{1} << 20) + 3}) {
    for (int n_chunks : {1, 5}) {
      SCOPED_TRACE(std::to_string(count) + " elements, " + std::to_string(n_chunks) + " chunks");
      auto c = make(spec);
      ASSERT_EQ(c->plan(count, n_chunks, 3), Status::kOk);
      ASSERT_EQ(c->agree(nullptr, 0x1234567890ull), Status::kOk);
      const std::vector<float> x = random_vector(count, 11 + static_cast<uint32_t>(count));
      const RoundingKey key = key_for(42, 1);
      std::vector<float> got(count, -7.0f), got_bf16_as_f32(count), want(count, -7.0f);
      std::vector<uint16_t> got_bf16(count, 0xDEAD);
      for (int ch = 0; ch < n_chunks; ++ch) {
        auto [b, e] = range_of(*c, ch);
        Msg m(c->chunk_capacity());
        ASSERT_EQ(c->hop(ch, f32(x), nullptr, 0, m.data(), key), Status::kOk);
        EXPECT_TRUE(m.guard_intact());
        const std::vector<uint8_t> ref = ref_encode(spec, x, b, e, key);
        ASSERT_TRUE(std::equal(ref.begin(), ref.end(), m.data() + kChunkHeaderBytes))
            << "chunk " << ch << " differs from the scalar reference";
        EXPECT_TRUE(std::all_of(m.data() + kChunkHeaderBytes + ref.size(), m.data() + m.cap,
                                [](uint8_t v) { return v == 0; }))
            << "padding not zero";
        EXPECT_EQ(m.data()[0] | (m.data()[1] << 8), kPayloadMagic);
        EXPECT_EQ(m.data()[2], kPayloadVersion);
        EXPECT_EQ(m.data()[3], spec.codec_id);
        EXPECT_EQ(m.data()[4] | (m.data()[5] << 8), ch);
        EXPECT_EQ(m.data()[6] | (m.data()[7] << 8), 1);  // n_contrib of a leaf
        EXPECT_EQ(static_cast<uint32_t>(m.data()[8] | (m.data()[9] << 8) | (m.data()[10] << 16) |
                                        (static_cast<uint32_t>(m.data()[11]) << 24)),
                  0x34567890u);  // low 32 bits of the agreed call
        ASSERT_EQ(c->finish(ch, m.view(), got.data(), DType::kF32, ReduceOp::kSum, 1), Status::kOk);
        ASSERT_EQ(c->finish(ch, m.view(), got_bf16.data(), DType::kBF16, ReduceOp::kSum, 1),
                  Status::kOk);
        ref_decode(spec, m.data() + kChunkHeaderBytes, b, e, &want);
      }
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(bits_of(got[i]), bits_of(want[i])) << "element " << i;
        ASSERT_EQ(got_bf16[i], ref_bf16(want[i])) << "element " << i;
      }
    }
  }
}

// Worker w holds x_w; a chain 0 -> 1 -> 2 -> 3 (decode, add own in FP32, re-encode) and a
// two-input tree hop, compared byte for byte with the scalar reference at every hop.
TEST_P(BaselineTest, ThreeHopChainAndTreeMatchReference) {
  const CodecSpec spec = GetParam();
  QuietLog quiet;  // the over-count rejections below warn by design
  for (size_t count : {size_t{257}, (size_t{1} << 20) + 3}) {
    SCOPED_TRACE(count);
    const int n_chunks = 3, n_workers = 4;
    auto c = make(spec);
    ASSERT_EQ(c->plan(count, n_chunks, n_workers), Status::kOk);
    ASSERT_EQ(c->agree(nullptr, 9), Status::kOk);
    std::vector<std::vector<float>> x;
    for (int w = 0; w < n_workers; ++w) x.push_back(random_vector(count, 100 + w, 1.0f + w));
    std::vector<float> got(count), want(count), got_avg(count);
    for (int ch = 0; ch < n_chunks; ++ch) {
      auto [b, e] = range_of(*c, ch);
      // Chain.
      Msg prev(c->chunk_capacity());
      ASSERT_EQ(c->hop(ch, f32(x[0]), nullptr, 0, prev.data(), key_for(5, 0)), Status::kOk);
      std::vector<uint8_t> ref = ref_encode(spec, x[0], b, e, key_for(5, 0));
      std::vector<float> partial(count);
      for (int w = 1; w < n_workers; ++w) {
        Msg next(c->chunk_capacity());
        ByteView in = prev.view();
        ASSERT_EQ(c->hop(ch, f32(x[w]), &in, 1, next.data(), key_for(5, w)), Status::kOk);
        EXPECT_EQ(next.data()[6], w + 1);
        ref_decode(spec, ref.data(), b, e, &partial);
        for (size_t i = b; i < e; ++i) partial[i] = x[w][i] + partial[i];
        ref = ref_encode(spec, partial, b, e, key_for(5, w));
        ASSERT_TRUE(std::equal(ref.begin(), ref.end(), next.data() + kChunkHeaderBytes))
            << "chunk " << ch << " hop " << w;
        prev = next;
      }
      ASSERT_EQ(c->finish(ch, prev.view(), got.data(), DType::kF32, ReduceOp::kSum, n_workers),
                Status::kOk);
      ASSERT_EQ(c->finish(ch, prev.view(), got_avg.data(), DType::kF32, ReduceOp::kAvg, n_workers),
                Status::kOk);
      EXPECT_EQ(c->finish(ch, prev.view(), got.data(), DType::kF32, ReduceOp::kSum, n_workers - 1),
                Status::kMalformedPayload);
      ref_decode(spec, ref.data(), b, e, &want);
      for (size_t i = b; i < e; ++i) {
        ASSERT_EQ(bits_of(got[i]), bits_of(want[i])) << i;
        ASSERT_EQ(bits_of(got_avg[i]), bits_of(want[i] / 4.0f)) << i;
      }

      // Tree: leaves 1 and 2 feed worker 0's hop (own + in[0] + in[1], in that order).
      Msg l1(c->chunk_capacity()), l2(c->chunk_capacity()), root(c->chunk_capacity());
      ASSERT_EQ(c->hop(ch, f32(x[1]), nullptr, 0, l1.data(), key_for(6, 1)), Status::kOk);
      ASSERT_EQ(c->hop(ch, f32(x[2]), nullptr, 0, l2.data(), key_for(6, 2)), Status::kOk);
      ByteView ins[2] = {l1.view(), l2.view()};
      ASSERT_EQ(c->hop(ch, f32(x[0]), ins, 2, root.data(), key_for(6, 0)), Status::kOk);
      EXPECT_EQ(root.data()[6], 3);
      std::vector<float> d1(count), d2(count);
      ref_decode(spec, l1.data() + kChunkHeaderBytes, b, e, &d1);
      ref_decode(spec, l2.data() + kChunkHeaderBytes, b, e, &d2);
      for (size_t i = b; i < e; ++i) partial[i] = (x[0][i] + d1[i]) + d2[i];
      ref = ref_encode(spec, partial, b, e, key_for(6, 0));
      ASSERT_TRUE(std::equal(ref.begin(), ref.end(), root.data() + kChunkHeaderBytes))
          << "tree hop, chunk " << ch;
      // Summing more workers than the plan has is rejected.
      ByteView four[3] = {root.view(), l1.view(), l1.view()};
      EXPECT_EQ(c->hop(ch, f32(x[3]), four, 3, l2.data(), key_for(6, 3)),
                Status::kMalformedPayload);
    }
  }
}

TEST_P(BaselineTest, Bf16OwnInputEqualsConvertedF32) {
  const CodecSpec spec = GetParam();
  const size_t count = 1000;
  auto c = make(spec);
  ASSERT_EQ(c->plan(count, 2, 2), Status::kOk);
  ASSERT_EQ(c->agree(nullptr, 1), Status::kOk);
  std::vector<float> x = random_vector(count, 3);
  std::vector<uint16_t> xb(count);
  for (size_t i = 0; i < count; ++i) {
    xb[i] = ref_bf16(x[i]);
    x[i] = float_of(static_cast<uint32_t>(xb[i]) << 16);
  }
  for (int ch = 0; ch < 2; ++ch) {
    Msg a(c->chunk_capacity()), b(c->chunk_capacity());
    ASSERT_EQ(c->hop(ch, f32(x), nullptr, 0, a.data(), key_for(2, 0)), Status::kOk);
    ASSERT_EQ(c->hop(ch, ConstTensor{xb.data(), DType::kBF16, count}, nullptr, 0, b.data(),
                     key_for(2, 0)),
              Status::kOk);
    EXPECT_EQ(a.buf, b.buf);
  }
}

TEST_P(BaselineTest, DeterministicBytesAndSeedDependence) {
  const CodecSpec spec = GetParam();
  const size_t count = 4099;
  auto c = make(spec);
  ASSERT_EQ(c->plan(count, 1, 2), Status::kOk);
  ASSERT_EQ(c->agree(nullptr, 1), Status::kOk);
  const std::vector<float> x = random_vector(count, 8);
  Msg a(c->chunk_capacity()), b(c->chunk_capacity()), d(c->chunk_capacity());
  ASSERT_EQ(c->hop(0, f32(x), nullptr, 0, a.data(), key_for(10, 0)), Status::kOk);
  ASSERT_EQ(c->hop(0, f32(x), nullptr, 0, b.data(), key_for(10, 0)), Status::kOk);
  EXPECT_EQ(a.buf, b.buf);
  ASSERT_EQ(c->hop(0, f32(x), nullptr, 0, d.data(), key_for(11, 0)), Status::kOk);
  if (spec.family == Family::kUniform)
    EXPECT_NE(a.buf, d.buf) << "stochastic rounding ignores the seed";
  else
    EXPECT_EQ(a.buf, d.buf) << "a deterministic codec depends on the seed";
  // A fresh codec object with the same plan produces the same bytes.
  auto c2 = make(spec);
  ASSERT_EQ(c2->plan(count, 1, 2), Status::kOk);
  ASSERT_EQ(c2->agree(nullptr, 1), Status::kOk);
  ASSERT_EQ(c2->hop(0, f32(x), nullptr, 0, b.data(), key_for(10, 0)), Status::kOk);
  EXPECT_EQ(a.buf, b.buf);
}

// A pipeline block (a codec planned over a slice, key.element_base = its first element in the
// whole tensor) encodes exactly what the whole tensor's codec encodes for those elements; and two
// blocks holding the same values under the same key draw different uniforms (stochastic codecs).
TEST_P(BaselineTest, ElementBaseKeysDrawsByIndexInTheWholeTensor) {
  const CodecSpec spec = GetParam();
  const size_t block = 4096 + 256, whole = 3 * block;  // bases: multiples of 256
  const std::vector<float> x = random_vector(whole, 21);
  auto w = make(spec);
  ASSERT_EQ(w->plan(whole, 1, 2), Status::kOk);
  ASSERT_EQ(w->agree(nullptr, 5), Status::kOk);
  Msg all(w->chunk_capacity());
  ASSERT_EQ(w->hop(0, f32(x), nullptr, 0, all.data(), key_for(3, 1)), Status::kOk);
  std::vector<std::vector<uint8_t>> bodies;
  for (size_t k = 0; k < 3; ++k) {
    SCOPED_TRACE("block " + std::to_string(k));
    const std::vector<float> slice(x.begin() + k * block, x.begin() + (k + 1) * block);
    auto b = make(spec);
    ASSERT_EQ(b->plan(block, 1, 2), Status::kOk);
    ASSERT_EQ(b->agree(nullptr, 5), Status::kOk);
    Msg m(b->chunk_capacity());
    RoundingKey key = key_for(3, 1);
    key.element_base = k * block;
    ASSERT_EQ(b->hop(0, f32(slice), nullptr, 0, m.data(), key), Status::kOk);
    const size_t body = block / spec.block_elems * spec.block_bytes;
    const uint8_t* from = all.data() + kChunkHeaderBytes + k * body;
    EXPECT_TRUE(std::equal(from, from + body, m.data() + kChunkHeaderBytes));
    EXPECT_EQ(
        ref_encode(spec, x, k * block, (k + 1) * block, key_for(3, 1)),
        std::vector<uint8_t>(m.data() + kChunkHeaderBytes, m.data() + kChunkHeaderBytes + body));
    // The same values again as the next block: other draws.
    key.element_base = (k + 1) * block;
    Msg next(b->chunk_capacity());
    ASSERT_EQ(b->hop(0, f32(slice), nullptr, 0, next.data(), key), Status::kOk);
    if (spec.family == Family::kUniform)
      EXPECT_NE(m.buf, next.buf) << "two blocks reused the same uniforms";
    else
      EXPECT_EQ(m.buf, next.buf) << "a deterministic codec depends on element_base";
  }
}

TEST_P(BaselineTest, ElementBaseMustBeAMultipleOf256WithinTheIndexLimit) {
  const CodecSpec spec = GetParam();
  QuietLog quiet;
  auto c = make(spec);
  ASSERT_EQ(c->plan(1024, 1, 1), Status::kOk);
  ASSERT_EQ(c->agree(nullptr, 0), Status::kOk);
  const std::vector<float> x = random_vector(1024, 2);
  Msg m(c->chunk_capacity());
  RoundingKey key = key_for(1, 0);
  for (uint64_t base : {uint64_t{32}, uint64_t{1000}, kMaxElementIndex - 768, kMaxElementIndex}) {
    key.element_base = base;
    EXPECT_EQ(c->hop(0, f32(x), nullptr, 0, m.data(), key), Status::kInvalidArgument) << base;
  }
  key.element_base = kMaxElementIndex - 1024;
  EXPECT_EQ(c->hop(0, f32(x), nullptr, 0, m.data(), key), Status::kOk);
}

TEST_P(BaselineTest, ZeroAndDenormalBlocks) {
  const CodecSpec spec = GetParam();
  const size_t count = 96;
  auto c = make(spec);
  ASSERT_EQ(c->plan(count, 1, 1), Status::kOk);
  ASSERT_EQ(c->agree(nullptr, 0), Status::kOk);
  std::vector<float> x(count, 0.0f);
  for (size_t i = 32; i < 64; ++i)
    x[i] = float_of(static_cast<uint32_t>(1 + 977 * i) & 0x7fffffu) * ((i & 1) ? -1.f : 1.f);
  for (size_t i = 64; i < 96; ++i) x[i] = (i % 3 == 0) ? 1e-38f * static_cast<float>(i) : 0.0f;
  Msg m(c->chunk_capacity());
  ASSERT_EQ(c->hop(0, f32(x), nullptr, 0, m.data(), key_for(1, 0)), Status::kOk);
  const std::vector<uint8_t> ref = ref_encode(spec, x, 0, count, key_for(1, 0));
  ASSERT_TRUE(std::equal(ref.begin(), ref.end(), m.data() + kChunkHeaderBytes));
  std::vector<float> out(count);
  ASSERT_EQ(c->finish(0, m.view(), out.data(), DType::kF32, ReduceOp::kSum, 1), Status::kOk);
  for (size_t i = 0; i < 32; ++i) EXPECT_EQ(out[i], 0.0f) << i;
  if (spec.family == Family::kMx) {
    EXPECT_EQ(m.data()[kChunkHeaderBytes], 0x00) << "all-zero block: scale 2^-127";
    EXPECT_EQ(m.data()[kChunkHeaderBytes + spec.block_bytes], 0x00) << "denormal block clamps";
  }
  if (spec.family == Family::kBf16) {
    for (size_t i = 32; i < count; ++i)
      EXPECT_EQ(out[i], float_of(static_cast<uint32_t>(ref_bf16(x[i])) << 16));
  }
  if (spec.family == Family::kUniform) {  // within one level of the input, and finite
    const int levels = (1 << (spec.uniform_bits - 2)) - 1;
    for (size_t g = 2; g < 6; ++g) {
      const uint8_t* grp = m.data() + kChunkHeaderBytes + g * spec.block_bytes;
      const float s = float_of(static_cast<uint32_t>(grp[0] | (grp[1] << 8)) << 16);
      float amax = 0;
      for (size_t i = 16 * g; i < 16 * g + 16; ++i) amax = std::max(amax, std::fabs(x[i]));
      EXPECT_GE(s, amax);
      EXPECT_GT(s, 0.0f);
      // One level step (S / L), plus one FP32 denormal ulp for the rounding of the decode.
      for (size_t i = 16 * g; i < 16 * g + 16; ++i)
        EXPECT_LE(std::fabs(out[i] - x[i]), s / levels * 1.0001f + 1e-45f) << i;
    }
  }
  for (float v : out) EXPECT_TRUE(std::isfinite(v));
}

TEST_P(BaselineTest, NonFiniteInputPoisonsItsBlockOnly) {
  const CodecSpec spec = GetParam();
  const size_t count = 320;  // 10 MX blocks, 20 uniform groups
  for (float bad : {kNaN, kInf, -kInf}) {
    for (int where : {0, 1, 3}) {  // leaf, second hop, last hop
      auto c = make(spec);
      ASSERT_EQ(c->plan(count, 1, 4), Status::kOk);
      ASSERT_EQ(c->agree(nullptr, 2), Status::kOk);
      std::vector<std::vector<float>> x;
      for (int w = 0; w < 4; ++w) x.push_back(random_vector(count, 50 + w));
      const size_t bad_index = 100;
      x[where][bad_index] = bad;
      Msg prev(c->chunk_capacity());
      ASSERT_EQ(c->hop(0, f32(x[0]), nullptr, 0, prev.data(), key_for(1, 0)), Status::kOk);
      for (int w = 1; w < 4; ++w) {
        Msg next(c->chunk_capacity());
        ByteView in = prev.view();
        ASSERT_EQ(c->hop(0, f32(x[w]), &in, 1, next.data(), key_for(1, w)), Status::kOk);
        prev = next;
      }
      std::vector<float> out(count);
      ASSERT_EQ(c->finish(0, prev.view(), out.data(), DType::kF32, ReduceOp::kSum, 4), Status::kOk);
      std::vector<uint16_t> out16(count);
      ASSERT_EQ(c->finish(0, prev.view(), out16.data(), DType::kBF16, ReduceOp::kAvg, 4),
                Status::kOk);
      const size_t b0 = bad_index / spec.block_elems * spec.block_elems;
      for (size_t i = 0; i < count; ++i) {
        const bool in_block = i >= b0 && i < b0 + spec.block_elems;
        EXPECT_EQ(std::isfinite(out[i]), !in_block) << "element " << i << ", bad at hop " << where;
        EXPECT_EQ((out16[i] & 0x7f80) != 0x7f80, !in_block) << "bf16 element " << i;
      }
    }
  }
}

// Every truncation of a payload, and every corrupted header byte, is rejected without reading
// past the bytes given (the truncated copy lives in an exactly sized heap block, so a sanitizer
// build catches an overread).
TEST_P(BaselineTest, TruncatedAndCorruptedPayloadsRejected) {
  const CodecSpec spec = GetParam();
  QuietLog quiet;
  const size_t count = 70;
  auto c = make(spec);
  ASSERT_EQ(c->plan(count, 2, 4), Status::kOk);
  ASSERT_EQ(c->agree(nullptr, 77), Status::kOk);
  const std::vector<float> x = random_vector(count, 1);
  for (int ch = 0; ch < 2; ++ch) {
    auto [b, e] = range_of(*c, ch);
    const size_t needed =
        kChunkHeaderBytes + (e - b + spec.block_elems - 1) / spec.block_elems * spec.block_bytes;
    Msg m(c->chunk_capacity());
    ASSERT_EQ(c->hop(ch, f32(x), nullptr, 0, m.data(), key_for(1, 0)), Status::kOk);
    std::vector<float> out(count, 123.0f);
    for (size_t len = 0; len < needed; ++len) {
      std::unique_ptr<uint8_t[]> copy(new uint8_t[len > 0 ? len : 1]);
      std::memcpy(copy.get(), m.data(), len);
      ByteView v{copy.get(), len};
      Msg o(c->chunk_capacity());
      EXPECT_EQ(c->hop(ch, f32(x), &v, 1, o.data(), key_for(1, 1)), Status::kMalformedPayload)
          << "length " << len;
      EXPECT_EQ(c->finish(ch, v, out.data(), DType::kF32, ReduceOp::kSum, 1),
                Status::kMalformedPayload)
          << "length " << len;
    }
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == 123.0f; }));
    // Exactly the needed bytes (no padding) are enough.
    std::unique_ptr<uint8_t[]> exact(new uint8_t[needed]);
    std::memcpy(exact.get(), m.data(), needed);
    EXPECT_EQ(
        c->finish(ch, ByteView{exact.get(), needed}, out.data(), DType::kF32, ReduceOp::kSum, 1),
        Status::kOk);
    // Any single-bit flip in the header is caught by finish (n_contrib must match exactly).
    for (size_t byte = 0; byte < kChunkHeaderBytes; ++byte)
      for (int bit = 0; bit < 8; ++bit) {
        Msg bad = m;
        bad.data()[byte] ^= static_cast<uint8_t>(1u << bit);
        EXPECT_EQ(c->finish(ch, bad.view(), out.data(), DType::kF32, ReduceOp::kSum, 1),
                  Status::kMalformedPayload)
            << "header byte " << byte << " bit " << bit;
      }
    // n_contrib of 0 or above the worker count is rejected by hop too.
    for (uint8_t n : {0, 5, 255}) {
      Msg bad = m;
      bad.data()[6] = n;
      ByteView v = bad.view();
      Msg o(c->chunk_capacity());
      EXPECT_EQ(c->hop(ch, f32(x), &v, 1, o.data(), key_for(1, 1)), Status::kMalformedPayload);
    }
  }
  // Payloads of another chunk, call, plan or codec are rejected.
  Msg m0(c->chunk_capacity()), m1(c->chunk_capacity());
  ASSERT_EQ(c->hop(0, f32(x), nullptr, 0, m0.data(), key_for(1, 0)), Status::kOk);
  ASSERT_EQ(c->hop(1, f32(x), nullptr, 0, m1.data(), key_for(1, 0)), Status::kOk);
  std::vector<float> out(count);
  EXPECT_EQ(c->finish(0, m1.view(), out.data(), DType::kF32, ReduceOp::kSum, 1),
            Status::kMalformedPayload);
  ASSERT_EQ(c->agree(nullptr, 78), Status::kOk);
  EXPECT_EQ(c->finish(0, m0.view(), out.data(), DType::kF32, ReduceOp::kSum, 1),
            Status::kMalformedPayload);
  ASSERT_EQ(c->agree(nullptr, 77), Status::kOk);
  auto other_plan = make(spec);
  ASSERT_EQ(other_plan->plan(count + spec.block_elems, 2, 4), Status::kOk);
  ASSERT_EQ(other_plan->agree(nullptr, 77), Status::kOk);
  std::vector<float> out2(count + spec.block_elems);
  EXPECT_EQ(other_plan->finish(0, m0.view(), out2.data(), DType::kF32, ReduceOp::kSum, 1),
            Status::kMalformedPayload);
  for (const CodecSpec& other : all_specs()) {
    if (other.name == spec.name) continue;
    auto o = make(other);
    ASSERT_EQ(o->plan(count, 2, 4), Status::kOk);
    ASSERT_EQ(o->agree(nullptr, 77), Status::kOk);
    std::vector<uint8_t> big(std::max(o->chunk_capacity(), m0.cap), 0);
    std::memcpy(big.data(), m0.data(), m0.cap);
    EXPECT_EQ(
        o->finish(0, ByteView{big.data(), big.size()}, out.data(), DType::kF32, ReduceOp::kSum, 1),
        Status::kMalformedPayload)
        << other.name << " accepted a " << spec.name << " payload";
  }
}

INSTANTIATE_TEST_SUITE_P(AllBaselines, BaselineTest, ::testing::ValuesIn(all_specs()), spec_name);

// ---------------------------------------------------------------------------------------------
// MX specifics.

class MxTest : public ::testing::TestWithParam<MxKind> {};

// Blocks made of element values times 2^e, whose largest magnitude sits in the top binade (so
// the computed scale is exactly 2^e), come back bit-exact through hop + finish.
TEST_P(MxTest, RepresentableValuesDecodeExactly) {
  const MxKind k = GetParam();
  const std::vector<double> mags = ref_magnitudes(k);
  const double top = std::ldexp(1.0, ref_fmt(k).emax);
  std::mt19937 rng(17);
  for (int e : {-127, -126, -100, -20, -1, 0, 1, 30, 100, 127 - ref_fmt(k).emax}) {
    const size_t count = 32 * 8;
    std::vector<float> x(count);
    for (size_t i = 0; i < count; ++i) {
      double m = mags[rng() % mags.size()];
      if (i % 32 == 5) m = mags[mags.size() - 1 - rng() % 2];  // anchors the top binade
      x[i] = static_cast<float>(std::ldexp((rng() & 1) ? -m : m, e));
    }
    bool representable = true;  // FP32 denormals hold every element * 2^-127 exactly
    for (size_t i = 0; i < count; ++i)
      representable &=
          std::fabs(static_cast<double>(x[i])) ==
          std::ldexp(mags[ref_mx_encode(k, std::ldexp(static_cast<double>(x[i]), -e), mags) &
                          ((1u << (ref_elem_bits(k) - 1)) - 1)],
                     e);
    ASSERT_GE(std::fabs(static_cast<double>(x[5])), std::ldexp(top, e));
    auto c = make_mx_codec(k);
    ASSERT_EQ(c->plan(count, 1, 1), Status::kOk);
    ASSERT_EQ(c->agree(nullptr, 0), Status::kOk);
    Msg m(c->chunk_capacity());
    ASSERT_EQ(c->hop(0, f32(x), nullptr, 0, m.data(), key_for(1, 0)), Status::kOk);
    std::vector<float> out(count);
    ASSERT_EQ(c->finish(0, m.view(), out.data(), DType::kF32, ReduceOp::kSum, 1), Status::kOk);
    for (size_t b = 0; b < count / 32; ++b) {
      EXPECT_EQ(m.data()[kChunkHeaderBytes + b * (c->chunk_capacity() - kChunkHeaderBytes) / 8],
                e + 127)
          << "scale byte of block " << b << " at 2^" << e;
    }
    ASSERT_TRUE(representable) << "test input not exactly element * 2^" << e;
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(bits_of(out[i]), bits_of(x[i])) << i << " 2^" << e;
  }
}

TEST_P(MxTest, SaturatesAtElementMax) {
  const MxKind k = GetParam();
  const RefMxFormat f = ref_fmt(k);
  // amax = 1.99 * 2^(emax) * X rounds above the element max: it must clamp to max * X, not wrap.
  for (int e : {-10, 0, 10}) {
    std::vector<float> x(32, 0.0f);
    x[0] = static_cast<float>(std::ldexp(1.99, f.emax + e));
    x[1] = -x[0];
    x[2] = static_cast<float>(std::ldexp(f.max_value, e));
    x[3] = static_cast<float>(std::ldexp(1.0, e));
    auto c = make_mx_codec(k);
    ASSERT_EQ(c->plan(32, 1, 1), Status::kOk);
    ASSERT_EQ(c->agree(nullptr, 0), Status::kOk);
    Msg m(c->chunk_capacity());
    ASSERT_EQ(c->hop(0, f32(x), nullptr, 0, m.data(), key_for(1, 0)), Status::kOk);
    std::vector<float> out(32);
    ASSERT_EQ(c->finish(0, m.view(), out.data(), DType::kF32, ReduceOp::kSum, 1), Status::kOk);
    const float sat = static_cast<float>(std::ldexp(f.max_value, e));
    EXPECT_EQ(out[0], sat);
    EXPECT_EQ(out[1], -sat);
    EXPECT_EQ(out[2], sat);
    EXPECT_EQ(out[3], static_cast<float>(std::ldexp(1.0, e)));
    EXPECT_EQ(m.data()[kChunkHeaderBytes], e + 127);  // floor(log2 amax) - emax = e
  }
}

INSTANTIATE_TEST_SUITE_P(AllMx, MxTest,
                         ::testing::Values(MxKind::kFp8E4M3, MxKind::kFp6E3M2, MxKind::kFp6E2M3,
                                           MxKind::kFp4E2M1));

// ---------------------------------------------------------------------------------------------
// Uniform specifics.

// Values strictly between levels: the mean over 2000 seeds is within 4 standard errors of the
// input for every element, each output is one of the two neighbouring levels, and the roundings
// of different elements are uncorrelated.
TEST(UniformTest, UnbiasedPerElementAndUncorrelated) {
  for (int total_bits : {3, 5, 9}) {
    const int levels = (1 << (total_bits - 2)) - 1;
    const size_t count = 48;
    std::vector<float> x(count);
    std::mt19937 rng(total_bits);
    std::uniform_real_distribution<float> frac(0.05f, 0.95f);
    for (size_t i = 0; i < count; ++i) {
      if (i % 16 == 0) {
        x[i] = 1.0f;  // group max: scale exactly 1, level step 1/L
        continue;
      }
      const int lvl = static_cast<int>(rng() % (2 * levels)) - levels;  // lower level, -L..L-1
      x[i] = (static_cast<float>(lvl) + frac(rng)) / static_cast<float>(levels);
    }
    auto c = make_uniform_codec(total_bits);
    ASSERT_EQ(c->plan(count, 1, 1), Status::kOk);
    ASSERT_EQ(c->agree(nullptr, 0), Status::kOk);
    const int n_seeds = 2000;
    std::vector<double> sum(count, 0.0);
    int both_up = 0, both_up_same_block = 0;
    Msg m(c->chunk_capacity());
    std::vector<float> out(count);
    for (int s = 0; s < n_seeds; ++s) {
      ASSERT_EQ(c->hop(0, f32(x), nullptr, 0, m.data(),
                       RoundingKey{static_cast<uint64_t>(s) * 7919u, 3, 0, 1}),
                Status::kOk);
      ASSERT_EQ(c->finish(0, m.view(), out.data(), DType::kF32, ReduceOp::kSum, 1), Status::kOk);
      for (size_t i = 0; i < count; ++i) {
        const double t = static_cast<double>(x[i]) * levels;
        const double q = static_cast<double>(out[i]) * levels;
        ASSERT_TRUE(std::fabs(q - std::floor(t)) < 1e-4 || std::fabs(q - std::floor(t) - 1) < 1e-4)
            << "element " << i << " decoded to level " << q << " from " << t;
        sum[i] += out[i];
      }
      // Elements 1 and 2 are in the same group, 17 in another.
      both_up += (out[1] > x[1]) && (out[17] > x[17]);
      both_up_same_block += (out[1] > x[1]) && (out[2] > x[2]);  // words 1, 2 of one draw
    }
    for (size_t i = 0; i < count; ++i) {
      const double t = static_cast<double>(x[i]) * levels;
      const double p = t - std::floor(t);
      const double se = std::sqrt(p * (1 - p) / n_seeds) / levels;
      EXPECT_LE(std::fabs(sum[i] / n_seeds - x[i]), 4 * se + 1e-7)
          << "uniform:" << total_bits << " element " << i;
    }
    const double p1 = x[1] * levels - std::floor(x[1] * levels);
    const double p17 = x[17] * levels - std::floor(x[17] * levels);
    const double pj = p1 * p17;
    EXPECT_LE(std::fabs(both_up / static_cast<double>(n_seeds) - pj),
              4 * std::sqrt(pj * (1 - pj) / n_seeds));
    const double p2 = x[2] * levels - std::floor(x[2] * levels), pk = p1 * p2;
    EXPECT_LE(std::fabs(both_up_same_block / static_cast<double>(n_seeds) - pk),
              4 * std::sqrt(pk * (1 - pk) / n_seeds));
  }
}

TEST(UniformTest, GarbageCodesAndScalesRejected) {
  QuietLog quiet;
  for (int total_bits : {3, 5, 9}) {
    const int k = total_bits - 1;
    const size_t count = 40, group_bytes = 2 + 2 * k;
    auto c = make_uniform_codec(total_bits);
    ASSERT_EQ(c->plan(count, 1, 2), Status::kOk);
    ASSERT_EQ(c->agree(nullptr, 0), Status::kOk);
    const std::vector<float> x = random_vector(count, 4);
    Msg m(c->chunk_capacity());
    ASSERT_EQ(c->hop(0, f32(x), nullptr, 0, m.data(), key_for(1, 0)), Status::kOk);
    std::vector<float> out(count, 5.0f);
    for (size_t g = 0; g < 3; ++g)
      for (int i = 0; i < 16; ++i) {
        Msg bad = m;
        uint8_t* codes = bad.data() + kChunkHeaderBytes + g * group_bytes + 2;
        for (int b = 0; b < k; ++b)
          codes[(i * k + b) / 8] |= static_cast<uint8_t>(1u << ((i * k + b) % 8));
        EXPECT_EQ(c->finish(0, bad.view(), out.data(), DType::kF32, ReduceOp::kSum, 1),
                  Status::kMalformedPayload)
            << "all-ones code at group " << g << " element " << i;
        ByteView v = bad.view();
        Msg o(c->chunk_capacity());
        EXPECT_EQ(c->hop(0, f32(x), &v, 1, o.data(), key_for(1, 1)), Status::kMalformedPayload);
      }
    for (uint16_t scale : {uint16_t{0xBF80} /* -1 */, uint16_t{0x7F80} /* +Inf */,
                           uint16_t{0x8001} /* negative denormal */}) {
      Msg bad = m;
      bad.data()[kChunkHeaderBytes + group_bytes] = static_cast<uint8_t>(scale);
      bad.data()[kChunkHeaderBytes + group_bytes + 1] = static_cast<uint8_t>(scale >> 8);
      EXPECT_EQ(c->finish(0, bad.view(), out.data(), DType::kF32, ReduceOp::kSum, 1),
                Status::kMalformedPayload)
          << std::hex << scale;
    }
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == 5.0f; }))
        << "a rejected payload wrote output";
  }
}

// The scale is max|x| rounded up to BF16, so a group max far from a BF16 value never overflows
// the top level and the error stays within one level step.
TEST(UniformTest, ScaleRoundsUpAndErrorWithinOneStep) {
  const size_t count = 16 * 64;
  std::vector<float> x = random_vector(count, 21, 3.0f);
  for (size_t i = 0; i < count; i += 16) x[i] = float_of(0x3f80ffffu + static_cast<uint32_t>(i));
  for (int total_bits = 3; total_bits <= 9; ++total_bits) {
    const int levels = (1 << (total_bits - 2)) - 1;
    auto c = make_uniform_codec(total_bits);
    ASSERT_EQ(c->plan(count, 1, 1), Status::kOk);
    ASSERT_EQ(c->agree(nullptr, 0), Status::kOk);
    Msg m(c->chunk_capacity());
    ASSERT_EQ(c->hop(0, f32(x), nullptr, 0, m.data(), key_for(3, 0)), Status::kOk);
    std::vector<float> out(count);
    ASSERT_EQ(c->finish(0, m.view(), out.data(), DType::kF32, ReduceOp::kSum, 1), Status::kOk);
    for (size_t g = 0; g < count / 16; ++g) {
      const uint8_t* grp = m.data() + kChunkHeaderBytes + g * (2 + 2 * (total_bits - 1));
      const float s = float_of(static_cast<uint32_t>(grp[0] | (grp[1] << 8)) << 16);
      float amax = 0;
      for (size_t i = 16 * g; i < 16 * g + 16; ++i) amax = std::max(amax, std::fabs(x[i]));
      EXPECT_GE(s, amax);
      EXPECT_LT(s, amax * (1 + 1.0f / 128));
      for (size_t i = 16 * g; i < 16 * g + 16; ++i)
        EXPECT_LE(std::fabs(out[i] - x[i]), s / levels * 1.0001f) << i;
    }
  }
}

}  // namespace
}  // namespace dq
