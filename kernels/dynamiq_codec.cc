#include "kernels/dynamiq_codec.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/parallel_reduce.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels/payload.h"

namespace dq {

void build_level_table(int bits, float eps, bool nonuniform, LevelTable* t) {
  std::memset(t, 0, sizeof *t);
  const int L = max_magnitude(bits);
  t->max_mag = L;
  const double q = 1.0 + 2.0 * static_cast<double>(eps) * eps;
  const double top = std::pow(q, L) - 1.0;
  for (int r = 0; r <= L; ++r) {
    double f = (nonuniform && L > 1 && eps > 0.0f) ? (std::pow(q, r) - 1.0) / top
                                                   : static_cast<double>(r) / L;
    t->level[r] = static_cast<float>(f);
  }
  t->level[L] = 1.0f;
  t->level[L + 1] = 2.0f;  // sentinel: never <= a magnitude in [0, 1]
  for (int r = 0; r < L; ++r) t->inv_gap[r] = 1.0f / (t->level[r + 1] - t->level[r]);
  t->inv_gap[L] = 0.0f;
  int most = 0;
  for (int cell = 0; cell <= kLevelGrid; ++cell) {
    float lo = static_cast<float>(cell) / kLevelGrid;
    int r = 0;
    while (r < L && t->level[r + 1] <= lo) ++r;
    t->start[cell] = r;
    // Levels strictly inside this cell: each needs one fix-up step in level_floor().
    float hi = static_cast<float>(cell + 1) / kLevelGrid;
    int inside = 0;
    for (int k = r + 1; k <= L; ++k)
      if (t->level[k] < hi) ++inside;
    most = std::max(most, inside);
  }
  t->extra_steps = most;
  for (int code = 0; code <= 2 * L; ++code) {
    const int signed_mag = code - L;
    const float mag = t->level[signed_mag < 0 ? -signed_mag : signed_mag];
    t->decode[code] = signed_mag < 0 ? -mag : mag;
  }
}

namespace {

constexpr int kMaxInputs = 64;  // fused inputs per hop (butterfly: log2(n) + 1 <= 11)

#if !defined(__AVX2__)
// Width-specific code (un)packing, LSB-first in coordinate order; loops the compiler vectorises.
void unpack_supergroup(int bits, const uint8_t* in, uint8_t* codes) {
  if (bits == 8) {
    std::memcpy(codes, in, kSuperGroup);
  } else if (bits == 4) {
    for (int i = 0; i < kSuperGroup / 2; ++i) {
      codes[2 * i] = in[i] & 15;
      codes[2 * i + 1] = in[i] >> 4;
    }
  } else {
    for (int i = 0; i < kSuperGroup / 4; ++i) {
      codes[4 * i] = in[i] & 3;
      codes[4 * i + 1] = (in[i] >> 2) & 3;
      codes[4 * i + 2] = (in[i] >> 4) & 3;
      codes[4 * i + 3] = in[i] >> 6;
    }
  }
}

void pack_supergroup(int bits, const uint8_t* codes, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, codes, kSuperGroup);
  } else if (bits == 4) {
    for (int i = 0; i < kSuperGroup / 2; ++i)
      out[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
  } else {
    for (int i = 0; i < kSuperGroup / 4; ++i)
      out[i] = static_cast<uint8_t>(codes[4 * i] | (codes[4 * i + 1] << 2) |
                                    (codes[4 * i + 2] << 4) | (codes[4 * i + 3] << 6));
  }
}

#endif

#if defined(__AVX2__)
// Host AVX2 hot path. Each super-group is processed one group of 16 values (two vectors) at a
// time: decode + accumulate, magnitude, level floor, stochastic rounding and packing happen in
// registers, with the same IEEE operations in the same order as the pointwise functions in
// dynamiq_math.h (tests: DeviceMath.HostRecordMatchesPointwiseReference,
// DeviceMath.FusedHopMatchesPointwiseReference), so the bytes equal the device's.

// Host-only lookup tables derived from a LevelTable for the 8-bit widths: the grid cell gives
// its first level and the next level's value in one 64-bit gather, and the floor gives its
// level and reciprocal gap in one more (2 x 8 loads per 8 values instead of 4 x 8).
struct CellEntry {
  int32_t start;  // LevelTable::start[cell]
  float next;     // level[start + 1] (sentinel 2 beyond L)
};
struct LevelPair {
  float level;    // level[r]
  float inv_gap;  // inv_gap[r]
};
// One-step widths: each grid cell's first level index and the three levels from it, so that one
// 16-byte load per value gives the floor, its level and the next level (inv_gap is recomputed as
// 1 / (next - level), the same IEEE operations build_level_table() uses). Plain loads and an
// in-register transpose replace the two 64-bit gather pairs, which are slow on Zen 3.
struct CellQuad {
  int32_t start;  // LevelTable::start[cell]
  float level0;   // level[start]
  float level1;   // level[start + 1] (sentinel 2 beyond L)
  float level2;   // level[start + 2] (any value beyond the sentinel: never selected)
};
struct FastLevels {
  alignas(64) CellEntry cell[kLevelGrid + 1];
  alignas(64) LevelPair pair[130];
  alignas(64) CellQuad quad[kLevelGrid + 1];
};

void build_fast_levels(const LevelTable& t, FastLevels* f) {
  for (int c = 0; c <= kLevelGrid; ++c) f->cell[c] = CellEntry{t.start[c], t.level[t.start[c] + 1]};
  for (int r = 0; r < 130; ++r) f->pair[r] = LevelPair{t.level[r], r < 129 ? t.inv_gap[r] : 0.0f};
  for (int c = 0; c <= kLevelGrid; ++c) {
    const int s = t.start[c];
    f->quad[c] = CellQuad{s, t.level[s], t.level[s + 1], s + 2 < 130 ? t.level[s + 2] : 2.0f};
  }
}

// Loads the CellQuad of each lane's cell and transposes them into start / level0..2 vectors.
inline void load_quads(const CellQuad* table, __m256i cell, __m256* start, __m256* l0, __m256* l1,
                       __m256* l2) {
  alignas(32) int32_t idx[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(idx), cell);
  const float* base = reinterpret_cast<const float*>(table);
  auto row = [&](int lo, int hi) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_load_ps(base + 4 * idx[lo])),
                                _mm_load_ps(base + 4 * idx[hi]), 1);
  };
  const __m256 a = row(0, 4), b = row(1, 5), c = row(2, 6), d = row(3, 7);
  const __m256 ab_lo = _mm256_unpacklo_ps(a, b), ab_hi = _mm256_unpackhi_ps(a, b);
  const __m256 cd_lo = _mm256_unpacklo_ps(c, d), cd_hi = _mm256_unpackhi_ps(c, d);
  *start = _mm256_shuffle_ps(ab_lo, cd_lo, _MM_SHUFFLE(1, 0, 1, 0));
  *l0 = _mm256_shuffle_ps(ab_lo, cd_lo, _MM_SHUFFLE(3, 2, 3, 2));
  *l1 = _mm256_shuffle_ps(ab_hi, cd_hi, _MM_SHUFFLE(1, 0, 1, 0));
  *l2 = _mm256_shuffle_ps(ab_hi, cd_hi, _MM_SHUFFLE(3, 2, 3, 2));
}

// Gathers 8 {a, b} pairs (64-bit entries) at indices idx and splits them into a and b vectors.
inline void gather_pairs(const void* table, __m256i idx, __m256i* a, __m256i* b) {
  // Lanes 0,1,4,5 then 2,3,6,7, so that the 32-bit shuffles below restore lane order.
  const __m256i spread = _mm256_permutevar8x32_epi32(idx, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
  const auto* base = static_cast<const long long*>(table);
  const __m256 lo = _mm256_castsi256_ps(_mm256_i32gather_epi64(base, _mm256_castsi256_si128(spread), 8));
  const __m256 hi = _mm256_castsi256_ps(_mm256_i32gather_epi64(base, _mm256_extracti128_si256(spread, 1), 8));
  *a = _mm256_castps_si256(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)));
  *b = _mm256_castps_si256(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}

// How a width's levels are looked up.
enum class Lookup { kRegisters, kOneStep, kGeneric };

struct LevelsX8 {
  const LevelTable* t;
  const FastLevels* fast;
  Lookup lookup;
  __m256 level_lo, gap_lo, decode_lo, decode_hi;  // first 8 levels / gaps, first 16 codes
};

// Unpacks the 16 codes of group g (LSB-first, `bits` wide) into two vectors of 8 lanes.
template <int kBits>
inline void unpack_group(const uint8_t* codes, int g, __m256i* a, __m256i* b) {
  if constexpr (kBits == 8) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * g));
    *a = _mm256_cvtepu8_epi32(x);
    *b = _mm256_cvtepu8_epi32(_mm_srli_si128(x, 8));
  } else if constexpr (kBits == 4) {
    uint32_t w[2];
    std::memcpy(w, codes + 8 * g, 8);
    const __m256i shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), mask = _mm256_set1_epi32(15);
    *a = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w[0])), shift), mask);
    *b = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w[1])), shift), mask);
  } else {
    uint32_t w;
    std::memcpy(&w, codes + 4 * g, 4);
    const __m256i word = _mm256_set1_epi32(static_cast<int>(w)), mask = _mm256_set1_epi32(3);
    *a = _mm256_and_si256(_mm256_srlv_epi32(word, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), mask);
    *b = _mm256_and_si256(_mm256_srlv_epi32(word, _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30)), mask);
  }
}

// Packs two vectors of 8 codes (group g) LSB-first into `bits`-wide fields.
template <int kBits>
inline void pack_group(__m256i a, __m256i b, int g, uint8_t* codes) {
  const __m256i words16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
  const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(words16), _mm256_extracti128_si256(words16, 1));
  if constexpr (kBits == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16 * g), bytes);
  } else if constexpr (kBits == 4) {  // byte i = c[2i] + 16 c[2i+1]  (<= 238)
    const __m128i pairs = _mm_maddubs_epi16(bytes, _mm_set1_epi16(0x1001));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + 8 * g), _mm_packus_epi16(pairs, pairs));
  } else {  // byte i = c[4i] + 4 c[4i+1] + 16 c[4i+2] + 64 c[4i+3]  (<= 170)
    const __m128i pairs = _mm_maddubs_epi16(bytes, _mm_set1_epi16(0x0401));
    const __m128i quads = _mm_madd_epi16(pairs, _mm_set1_epi32(0x00100001));
    const __m128i packed = _mm_shuffle_epi8(quads, _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const uint32_t w = static_cast<uint32_t>(_mm_cvtsi128_si32(packed));
    std::memcpy(codes + 4 * g, &w, 4);
  }
}

// Signed level of each code (decode table), as decode_code() without the scale.
template <Lookup kLookup>
inline __m256 decode_levels(const LevelsX8& lv, __m256i c) {
  if constexpr (kLookup == Lookup::kRegisters) {
    const __m256 from_lo = _mm256_permutevar8x32_ps(lv.decode_lo, c);
    const __m256 from_hi = _mm256_permutevar8x32_ps(lv.decode_hi, c);
    const __m256 use_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(7)));
    return _mm256_blendv_ps(from_lo, from_hi, use_hi);
  }
  return _mm256_i32gather_ps(lv.t->decode, c, 4);
}

// Where 16 random bits leave a rounding undecided (probability 2^-16 per value): the lanes set in
// `tie` get round_up_tie() with their element's tie word. Returns the updated up-mask.
__attribute__((noinline)) __m256i resolve_ties(__m256i up, int tie, __m256 x, __m256i u16,
                                               const RoundingKey& key, uint64_t e0) {
  alignas(32) int32_t up_lanes[8], bits[8];
  alignas(32) float xs[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(up_lanes), up);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bits), u16);
  _mm256_store_ps(xs, x);
  for (int lane = 0; lane < 8; ++lane) {
    if (!((tie >> lane) & 1)) continue;
    const float v = rounding_tie_uniform(key.seed, key.call, key.rank, e0 + lane);
    up_lanes[lane] = round_up_tie(xs[lane], static_cast<uint32_t>(bits[lane]), v) ? -1 : 0;
  }
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(up_lanes));
}

// Stochastic rounding of 8 values of one group (elements e0 .. e0 + 7) to offset-binary codes:
// magnitude_ratio(), level_floor(), round_up_threshold(), round_up_coarse() / round_up_tie()
// and encode_code() of dynamiq_math.h. u16: the elements' 16 random bits.
template <int kBits, Lookup kLookup>
inline __m256i round_codes(const LevelsX8& lv, __m256 v, __m256 scale, __m256i u16, __m256 pi,
                           __m256 strata, const RoundingKey& key, uint64_t e0) {
  constexpr int kMaxMag = (1 << (kBits - 1)) - 1;
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  // min(q, 1) returns 1 for NaN, as magnitude_ratio() does.
  const __m256 m = _mm256_min_ps(_mm256_div_ps(magnitude, scale), _mm256_set1_ps(1.0f));
  __m256i r;
  __m256 level, inv_gap;
  if constexpr (kLookup == Lookup::kRegisters) {  // r = number of levels 1..L at or below m
    r = _mm256_setzero_si256();
    for (int i = 1; i <= kMaxMag; ++i)
      r = _mm256_sub_epi32(r, _mm256_castps_si256(_mm256_cmp_ps(_mm256_set1_ps(lv.t->level[i]), m, _CMP_LE_OQ)));
    level = _mm256_permutevar8x32_ps(lv.level_lo, r);
    inv_gap = _mm256_permutevar8x32_ps(lv.gap_lo, r);
  } else {
    const __m256i cell = _mm256_cvttps_epi32(_mm256_mul_ps(m, _mm256_set1_ps(static_cast<float>(kLevelGrid))));
    if constexpr (kLookup == Lookup::kOneStep) {
      __m256 start, l0, l1, l2;
      load_quads(lv.fast->quad, cell, &start, &l0, &l1, &l2);
      const __m256 step = _mm256_cmp_ps(l1, m, _CMP_LE_OQ);
      r = _mm256_sub_epi32(_mm256_castps_si256(start), _mm256_castps_si256(step));
      level = _mm256_blendv_ps(l0, l1, step);
      // inv_gap[r] exactly (build_level_table()); at r = L it gives 1, not 0, but there m = 1 =
      // level[L], so frac = 0 * inv_gap = +0 either way.
      inv_gap = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sub_ps(_mm256_blendv_ps(l1, l2, step), level));
    } else {
      r = _mm256_i32gather_epi32(lv.t->start, cell, 4);
      for (int step = 0; step < lv.t->extra_steps; ++step) {
        const __m256 next = _mm256_i32gather_ps(lv.t->level + 1, r, 4);
        r = _mm256_sub_epi32(r, _mm256_castps_si256(_mm256_cmp_ps(next, m, _CMP_LE_OQ)));
      }
    }
    if constexpr (kLookup != Lookup::kOneStep) {
      __m256i level_bits, gap_bits;
      gather_pairs(lv.fast->pair, r, &level_bits, &gap_bits);
      level = _mm256_castsi256_ps(level_bits);
      inv_gap = _mm256_castsi256_ps(gap_bits);
    }
  }
  const __m256 frac = _mm256_mul_ps(_mm256_sub_ps(m, level), inv_gap);
  const __m256 x = _mm256_sub_ps(_mm256_mul_ps(frac, strata), pi);
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(65536.0f));
  const __m256 k = _mm256_cvtepi32_ps(u16);
  __m256i up = _mm256_castps_si256(_mm256_cmp_ps(_mm256_add_ps(k, _mm256_set1_ps(1.0f)), y, _CMP_LE_OQ));
  const __m256 below = _mm256_cmp_ps(k, y, _CMP_LT_OQ);
  const int tie = _mm256_movemask_ps(_mm256_andnot_ps(_mm256_castsi256_ps(up), below));
  if (__builtin_expect(tie != 0, 0)) up = resolve_ties(up, tie, x, u16, key, e0);
  const __m256i mag = _mm256_sub_epi32(r, up);
  const __m256i max_mag = _mm256_set1_epi32(kMaxMag);
  const __m256 negative = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_blendv_epi8(_mm256_add_epi32(max_mag, mag), _mm256_sub_epi32(max_mag, mag),
                            _mm256_castps_si256(negative));
}

// Calls f(width constant, lookup constant) so that each width runs straight-line code.
template <typename F>
inline auto with_width(int bits, Lookup lookup, F&& f) {
  using W2 = std::integral_constant<int, 2>;
  using W4 = std::integral_constant<int, 4>;
  using W8 = std::integral_constant<int, 8>;
  using Reg = std::integral_constant<Lookup, Lookup::kRegisters>;
  using One = std::integral_constant<Lookup, Lookup::kOneStep>;
  using Gen = std::integral_constant<Lookup, Lookup::kGeneric>;
  if (bits == 2) return f(W2{}, Reg{});
  if (bits == 4) return f(W4{}, Reg{});
  if (lookup == Lookup::kOneStep) return f(W8{}, One{});
  return f(W8{}, Gen{});
}
#endif

inline float load_value(const void* base, DType t, size_t i) {
  if (t == DType::kF32) return static_cast<const float*>(base)[i];
  return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
}

uint32_t fnv1a(uint32_t h, uint32_t v) {
  for (int i = 0; i < 4; ++i) {
    h ^= (v >> (8 * i)) & 0xffu;
    h *= 16777619u;
  }
  return h;
}

class DynamiqCodec final : public Codec {
 public:
  DynamiqCodec(const DynamiqCodec&) = delete;  // levels_x8_ points into this object
  DynamiqCodec& operator=(const DynamiqCodec&) = delete;
  explicit DynamiqCodec(const DynamiqOptions& o) : opt_(o) {
    const int bits[3] = {2, 4, 8};
    for (int i = 0; i < 3; ++i) build_level_table(bits[i], o.eps[i], o.nonuniform_levels, &levels_[i]);
#if defined(__AVX2__)
    for (int i = 0; i < 3; ++i) {
      const LevelTable& t = levels_[i];
      build_fast_levels(t, &fast_[i]);
      LevelsX8& lv = levels_x8_[i];
      lv.t = &t;
      lv.fast = &fast_[i];
      lv.lookup = t.max_mag <= 7 ? Lookup::kRegisters : t.extra_steps <= 1 ? Lookup::kOneStep : Lookup::kGeneric;
      lv.level_lo = _mm256_loadu_ps(t.level);
      lv.gap_lo = _mm256_loadu_ps(t.inv_gap);
      lv.decode_lo = _mm256_loadu_ps(t.decode);
      lv.decode_hi = _mm256_loadu_ps(t.decode + 8);
    }
#endif
    for (int b : {2, 4, 8, 16}) record_[width_index(b)] = record_bytes(b, o.hierarchical_scales);
  }

  std::string name() const override {
    char buf[160];
    std::snprintf(buf, sizeof buf, "dynamiq:%g%s%s%s%s%s", opt_.budget_bits,
                  opt_.correlated_rounding ? "" : ":corr=0",
                  opt_.nonuniform_levels ? "" : ":levels=uniform",
                  opt_.hierarchical_scales ? "" : ":scales=flat",
                  opt_.variable_widths ? "" : ":widths=fixed", opt_.mean_subtraction ? "" : ":mean=0");
    return buf;
  }

  Status plan(size_t count, int n_chunks, int n_workers) override {
    if (n_chunks < 1 || n_workers < 1 || n_chunks > 65535 || n_workers > 65535)
      DQ_FAIL(Status::kInvalidArgument, "dynamiq plan: n_chunks=%d n_workers=%d out of range 1..65535",
              n_chunks, n_workers);
    count_ = count;
    n_chunks_ = n_chunks;
    n_workers_ = n_workers;
    n_sg_ = (count + kSuperGroup - 1) / kSuperGroup;
    const size_t max_record = static_cast<size_t>(record_[opt_.allow_width16 ? 3 : 2]);
    const size_t min_record = static_cast<size_t>(record_[0]);
    if (n_sg_ == 0) {
      capacity_ = kChunkHeaderBytes;
      stride_ = 0;
      honest_ = true;
    } else {
      // Bytes the budget allows for one compressed copy, minus the statistics (2 BF16 / SG).
      const double budget_bytes = std::floor(opt_.budget_bits * static_cast<double>(count) / 8.0);
      const double for_chunks = budget_bytes - 4.0 * static_cast<double>(n_sg_);
      const size_t by_budget = for_chunks > 0 ? static_cast<size_t>(for_chunks) / n_chunks : 0;
      // Cuts fall where a record starts: a chunk holds at most stride - 1 + max_record bytes.
      auto capacity_for = [&](size_t record) {
        const size_t per_chunk = (record * n_sg_ + n_chunks - 1) / n_chunks;
        return kChunkHeaderBytes + max_record - 1 + std::max<size_t>(1, per_chunk);
      };
      // Too small for the budget (a few super-groups per chunk): compressing cannot pay, so
      // give every super-group room for the widest record rather than starving it at 2 bits.
      honest_ = by_budget >= capacity_for(min_record);
      capacity_ = honest_ ? by_budget : capacity_for(max_record);
      stride_ = capacity_ - kChunkHeaderBytes - max_record + 1;
    }
    mean_.assign(n_sg_, 0.0f);
    restore_.assign(n_sg_, 0.0f);
    key_.assign(n_sg_, 0.0f);
    poisoned_.assign(n_sg_, 0);
    width_.assign(n_sg_, 2);
    order_.assign(n_sg_, 0);
    offset_.assign(n_sg_, 0);
    position_.assign(n_sg_, 0);
    by_index_.assign(n_sg_, 0);
    cursor_.assign(n_chunks, 0);
    chunk_first_.assign(n_chunks + 1, 0);
    chunk_check_.assign(n_chunks, 0);
    chunk_content_.assign(n_chunks, 0);
    return Status::kOk;
  }

  size_t stats_words() const override { return 2 * n_sg_; }

  Status local_stats(const ConstTensor& x, uint16_t* stats) const override {
    if (x.count != count_)
      DQ_FAIL(Status::kInvalidArgument, "dynamiq stats: tensor has %zu elements, plan has %zu",
              x.count, count_);
    tbb::parallel_for(tbb::blocked_range<size_t>(0, n_sg_, 256), [&](const auto& range) {
      for (size_t j = range.begin(); j != range.end(); ++j) {
        const size_t base = j * kSuperGroup;
        const int valid = static_cast<int>(std::min<size_t>(kSuperGroup, count_ - base));
        float sum = 0.0f, sum_sq = 0.0f;
        for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
          float gs = 0.0f, gq = 0.0f;
          for (int k = g * kGroup; k < std::min(valid, (g + 1) * kGroup); ++k) {
            float v = load_value(x.data, x.dtype, base + k);
            gs += v;
            gq += v * v;
          }
          sum += gs;
          sum_sq += gq;
        }
        stats[2 * j] = f32_to_bf16_sat(sum / static_cast<float>(valid));
        stats[2 * j + 1] = f32_to_bf16_sat(sum_sq);
      }
    });
    return Status::kOk;
  }

  Status agree(const uint16_t* reduced, uint64_t call) override {
    if (n_sg_ > 0 && reduced == nullptr)
      DQ_FAIL(Status::kInvalidArgument, "dynamiq agree: statistics missing");
    call_ = call;
    const float n = static_cast<float>(n_workers_);
    for (size_t j = 0; j < n_sg_; ++j) {
      float mu = bf16_to_f32(reduced[2 * j]) / n;
      bool finite_mu = std::isfinite(mu);
      poisoned_[j] = finite_mu ? 0 : 1;
      mean_[j] = (opt_.mean_subtraction && finite_mu) ? mu : 0.0f;
      restore_[j] = finite_mu ? mean_[j] : mu;  // a non-finite mean poisons the output
      float f = bf16_to_f32(reduced[2 * j + 1]);
      key_[j] = (f >= 0.0f && f <= FLT_MAX) ? f : FLT_MAX;
    }
    const uint64_t budget = static_cast<uint64_t>(stride_) * n_chunks_;
    if (opt_.variable_widths) {
      // Smallest threshold offset (float bit pattern, monotone for non-negative floats) whose
      // widths fit: bytes(theta) never increases with theta and bytes(+inf) = all 2-bit fits.
      uint32_t lo = 0, hi = 0x7f800000u;
      while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (bytes_for(f32_from_bits(mid)) <= budget) hi = mid;
        else lo = mid + 1;
      }
      const float theta = f32_from_bits(lo);
      for (size_t j = 0; j < n_sg_; ++j) width_[j] = static_cast<uint8_t>(width_for(j, theta));
    } else {
      int fixed = 2;
      for (int b : {16, 8, 4}) {
        if (b == 16 && !opt_.allow_width16) continue;
        uint64_t need = 0;
        for (size_t j = 0; j < n_sg_; ++j) need += record_[width_index(poisoned_[j] ? 2 : b)];
        if (need <= budget) { fixed = b; break; }
      }
      for (size_t j = 0; j < n_sg_; ++j) width_[j] = static_cast<uint8_t>(poisoned_[j] ? 2 : fixed);
    }
    // Reorder by width, widest first, stable (counting sort), then cut in byte space.
    size_t pos = 0;
    for (int b : {16, 8, 4, 2})
      for (size_t j = 0; j < n_sg_; ++j)
        if (width_[j] == b) order_[pos++] = static_cast<uint32_t>(j);
    uint64_t start = 0;
    int chunk = 0;
    uint64_t chunk_start = 0;
    chunk_first_[0] = 0;
    for (size_t i = 0; i < n_sg_; ++i) {
      while (chunk + 1 < n_chunks_ && start >= static_cast<uint64_t>(stride_) * (chunk + 1)) {
        chunk_content_[chunk] = start - chunk_start;
        chunk_first_[++chunk] = static_cast<uint32_t>(i);
        chunk_start = start;
      }
      offset_[i] = static_cast<uint32_t>(start - chunk_start);
      start += record_[width_index(width_[order_[i]])];
    }
    chunk_content_[chunk] = start - chunk_start;
    while (chunk + 1 <= n_chunks_ - 1) {
      chunk_first_[++chunk] = static_cast<uint32_t>(n_sg_);
      chunk_content_[chunk] = 0;
    }
    chunk_first_[n_chunks_] = static_cast<uint32_t>(n_sg_);
    // Each chunk's records in super-group order (by_index_), so the hot loops read the tensor
    // front to back, a stream the hardware prefetcher follows, rather than width class by
    // width class.
    for (size_t i = 0; i < n_sg_; ++i) position_[order_[i]] = static_cast<uint32_t>(i);
    for (int c = 0; c < n_chunks_; ++c) cursor_[c] = chunk_first_[c];
    for (size_t j = 0; j < n_sg_; ++j) {
      const uint32_t i = position_[j];
      const int c = static_cast<int>(std::upper_bound(chunk_first_.begin(), chunk_first_.end() - 1, i) -
                                     chunk_first_.begin()) - 1;
      by_index_[cursor_[c]++] = i;
    }
    for (int c = 0; c < n_chunks_; ++c) {
      if (chunk_content_[c] + kChunkHeaderBytes > capacity_)
        DQ_FAIL(Status::kInternal, "dynamiq layout: chunk %d needs %llu bytes, capacity %zu", c,
                static_cast<unsigned long long>(chunk_content_[c] + kChunkHeaderBytes), capacity_);
      uint32_t h = fnv1a(2166136261u, static_cast<uint32_t>(c));
      h = fnv1a(h, static_cast<uint32_t>(count_));
      for (uint32_t i = chunk_first_[c]; i < chunk_first_[c + 1]; ++i)
        h = fnv1a(h, order_[i] * 32u + width_[order_[i]] + (poisoned_[order_[i]] ? 1u : 0u));
      chunk_check_[c] = h;
    }
    return Status::kOk;
  }

  size_t chunk_capacity() const override { return capacity_; }
  bool fits_budget() const override { return honest_; }

  Status hop(int chunk, const ConstTensor& own, const ByteView* in, int n_in, uint8_t* out,
             const RoundingKey& key) const override {
    DQ_CHECK(check_chunk_arg(chunk));
    if (own.count != count_ || (own.data == nullptr && count_ > 0))
      DQ_FAIL(Status::kInvalidArgument, "dynamiq hop: own tensor has %zu elements, plan has %zu",
              own.count, count_);
    if (n_in < 0 || n_in > kMaxInputs)
      DQ_FAIL(Status::kInvalidArgument, "dynamiq hop: %d inputs, at most %d", n_in, kMaxInputs);
    if (key.strata < 1 || key.stratum >= key.strata)
      DQ_FAIL(Status::kInvalidArgument, "dynamiq hop: stratum %u of %u", key.stratum, key.strata);
    int contrib = 1;
    const uint8_t* inputs[kMaxInputs];
    for (int i = 0; i < n_in; ++i) {
      ChunkHeader h;
      DQ_CHECK(check_input(chunk, in[i], &h));
      contrib += h.n_contrib;
      inputs[i] = in[i].data + kChunkHeaderBytes;
    }
    if (contrib > n_workers_)
      DQ_FAIL(Status::kMalformedPayload, "dynamiq hop: inputs sum %d workers, only %d exist",
              contrib, n_workers_);
    write_chunk_header(out, ChunkHeader{CodecId::kDynamiq, static_cast<uint16_t>(chunk),
                                        static_cast<uint16_t>(contrib),
                                        static_cast<uint32_t>(call_), chunk_check_[chunk]});
    uint8_t* body = out + kChunkHeaderBytes;
    std::memset(body + chunk_content_[chunk], 0,
                capacity_ - kChunkHeaderBytes - chunk_content_[chunk]);
    std::atomic<bool> malformed{false};
    const uint32_t first = chunk_first_[chunk], last = chunk_first_[chunk + 1];
    tbb::parallel_for(tbb::blocked_range<uint32_t>(first, last, 16), [&](const auto& range) {
      const uint8_t* recs[kMaxInputs];
      for (uint32_t t = range.begin(); t != range.end(); ++t) {
        const uint32_t i = by_index_[t];  // wire position, visited in super-group order
        // The records of the four width classes are four interleaved streams: fetch them and
        // the own values kPrefetchAhead super-groups ahead.
        if (t + kPrefetchAhead < last) {
          const uint32_t ahead = by_index_[t + kPrefetchAhead];
          prefetch_own(own, order_[ahead]);
          for (int k = 0; k < n_in; ++k) prefetch_line(reinterpret_cast<const char*>(inputs[k] + offset_[ahead]));
        }
        for (int k = 0; k < n_in; ++k) recs[k] = inputs[k] + offset_[i];
        if (!fuse_supergroup(order_[i], own, recs, n_in, body + offset_[i], key))
          malformed.store(true, std::memory_order_relaxed);
      }
    });
    if (malformed.load())
      DQ_FAIL(Status::kMalformedPayload, "dynamiq hop: chunk %d input holds invalid codes or scales",
              chunk);
    return Status::kOk;
  }

  Status finish(int chunk, ByteView in, void* out, DType out_dtype, ReduceOp op,
                int n_contrib) const override {
    DQ_CHECK(check_chunk_arg(chunk));
    ChunkHeader h;
    DQ_CHECK(check_input(chunk, in, &h));
    if (h.n_contrib != n_contrib)
      DQ_FAIL(Status::kMalformedPayload, "dynamiq finish: payload sums %u workers, expected %d",
              h.n_contrib, n_contrib);
    const uint8_t* body = in.data + kChunkHeaderBytes;
    std::atomic<bool> malformed{false};
    const float contributors = static_cast<float>(n_contrib);
    tbb::parallel_for(
        tbb::blocked_range<uint32_t>(chunk_first_[chunk], chunk_first_[chunk + 1], 16),
        [&](const auto& range) {
          float v[kSuperGroup];
          for (uint32_t t = range.begin(); t != range.end(); ++t) {
            const uint32_t i = by_index_[t];  // the output is written front to back
            const uint32_t j = order_[i];
            std::fill(v, v + kSuperGroup, 0.0f);
            if (!accumulate_record(width_[j], body + offset_[i], v))
              malformed.store(true, std::memory_order_relaxed);
            const size_t base = static_cast<size_t>(j) * kSuperGroup;
            const int valid = static_cast<int>(std::min<size_t>(kSuperGroup, count_ - base));
            const float shift = width_[j] == 16 ? 0.0f : contributors * restore_[j];
            for (int k = 0; k < valid; ++k) {
              float s = v[k] + shift;
              if (op == ReduceOp::kAvg) s = s / contributors;
              if (out_dtype == DType::kF32) static_cast<float*>(out)[base + k] = s;
              else static_cast<uint16_t*>(out)[base + k] = f32_to_bf16_rne(s);
            }
          }
        });
    if (malformed.load())
      DQ_FAIL(Status::kMalformedPayload, "dynamiq finish: chunk %d holds invalid codes or scales",
              chunk);
    return Status::kOk;
  }

  void chunk_ranges(int chunk, std::vector<std::pair<size_t, size_t>>* ranges) const override {
    ranges->clear();
    if (chunk < 0 || chunk >= n_chunks_) return;
    std::vector<uint32_t> sgs(order_.begin() + chunk_first_[chunk],
                              order_.begin() + chunk_first_[chunk + 1]);
    std::sort(sgs.begin(), sgs.end());
    for (uint32_t j : sgs) {
      size_t b = static_cast<size_t>(j) * kSuperGroup, e = std::min(count_, b + kSuperGroup);
      if (!ranges->empty() && ranges->back().second == b) ranges->back().second = e;
      else ranges->emplace_back(b, e);
    }
  }

  DynamiqLayoutView view() const {
    return DynamiqLayoutView{width_.data(), order_.data(), chunk_first_.data(), n_sg_, honest_};
  }

 private:
  int width_for(size_t j, float theta) const {
    if (poisoned_[j]) return 2;
    // Equal error saved per extra bit fixes the threshold ratios (METHOD.md section 3).
    const float t48 = theta * (257.0f / 131072.0f);
    const float t24 = t48 * (17.0f / 512.0f);
    const float f = key_[j];
    if (f >= theta && opt_.allow_width16) return 16;
    if (f >= t48) return 8;
    if (f >= t24) return 4;
    return 2;
  }

  uint64_t bytes_for(float theta) const {
    return tbb::parallel_reduce(
        tbb::blocked_range<size_t>(0, n_sg_, 4096), uint64_t{0},
        [&](const auto& range, uint64_t acc) {
          for (size_t j = range.begin(); j != range.end(); ++j)
            acc += record_[width_index(width_for(j, theta))];
          return acc;
        },
        [](uint64_t a, uint64_t b) { return a + b; });
  }

  Status check_chunk_arg(int chunk) const {
    if (chunk < 0 || chunk >= n_chunks_)
      DQ_FAIL(Status::kInvalidArgument, "dynamiq: chunk %d outside 0..%d", chunk, n_chunks_ - 1);
    return Status::kOk;
  }

  Status check_input(int chunk, ByteView in, ChunkHeader* h) const {
    const size_t need = kChunkHeaderBytes + chunk_content_[chunk];
    if (in.data == nullptr || in.size < need)
      DQ_FAIL(Status::kMalformedPayload, "dynamiq: chunk %d payload has %zu bytes, layout needs %zu",
              chunk, in.size, need);
    ChunkHeader expect{CodecId::kDynamiq, static_cast<uint16_t>(chunk), 0,
                       static_cast<uint32_t>(call_), chunk_check_[chunk]};
    return check_chunk_header(in, expect, n_workers_, h);
  }

  // Super-groups (1 KiB of FP32 each) ahead: 2 left the fused hop at 3.9 ns/value on 64 MiB,
  // 6..12 gave 2.9..3.1 (in-cache compute: 2.45), on the 2-core development machine.
  static constexpr uint32_t kPrefetchAhead = 8;

  // Always inlined: GCC's IPA marks a function holding only prefetches as const and then
  // deletes its calls.
  __attribute__((always_inline)) void prefetch_own(const ConstTensor& own, uint32_t j) const {
    if (static_cast<size_t>(j + 1) * kSuperGroup > count_) return;  // partial: not worth it
    const char* p = static_cast<const char*>(own.data) +
                    static_cast<size_t>(j) * kSuperGroup * dtype_size(own.dtype);
    if (own.dtype == DType::kF32) {
      for (int line = 0; line < kSuperGroup * 4 / 64; ++line) prefetch_line(p + 64 * line);
    } else {
      for (int line = 0; line < kSuperGroup * 2 / 64; ++line) prefetch_line(p + 64 * line);
    }
  }
  __attribute__((always_inline)) static void prefetch_line(const char* p) {
#if defined(__AVX2__)
    _mm_prefetch(p, _MM_HINT_T0);
#else
    __builtin_prefetch(p, 0, 3);
#endif
  }

  // Decodes one record and adds it into v[0..255]. Returns false on invalid content.
  bool accumulate_record(int bits, const uint8_t* rec, float* v) const {
    if (bits == 16) {
      for (int k = 0; k < kSuperGroup; ++k)
        v[k] += bf16_to_f32(static_cast<uint16_t>(rec[2 * k] | (rec[2 * k + 1] << 8)));
      return true;
    }
    [[maybe_unused]] const LevelTable& t = levels_[width_index(bits)];
    float scale[kGroupsPerSuperGroup];
    const uint8_t* codes;
    bool ok = true;
    if (opt_.hierarchical_scales) {
      const float unit = bf16_to_f32(static_cast<uint16_t>(rec[0] | (rec[1] << 8)));
      ok &= (rec[1] & 0x80) == 0;  // negative unit: never written
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
        ok &= rec[2 + g] != 0;
        scale[g] = static_cast<float>(rec[2 + g]) * unit;
      }
      codes = rec + 2 + kGroupsPerSuperGroup;
    } else {
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
        ok &= (rec[2 * g + 1] & 0x80) == 0;
        scale[g] = bf16_to_f32(static_cast<uint16_t>(rec[2 * g] | (rec[2 * g + 1] << 8)));
      }
      codes = rec + 2 * kGroupsPerSuperGroup;
    }
#if defined(__AVX2__)
    const LevelsX8& lv = levels_x8_[width_index(bits)];
    const bool codes_ok = with_width(bits, lv.lookup, [&](auto width, auto lookup) {
      constexpr int kBits = decltype(width)::value;
      constexpr Lookup kLookup = decltype(lookup)::value;
      const __m256i max_code = _mm256_set1_epi32(2 * ((1 << (kBits - 1)) - 1));
      __m256i bad = _mm256_setzero_si256();
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
        __m256i a, b;
        unpack_group<kBits>(codes, g, &a, &b);
        bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_cmpgt_epi32(a, max_code), _mm256_cmpgt_epi32(b, max_code)));
        const __m256 s = _mm256_set1_ps(scale[g]);
        float* vg = v + g * kGroup;
        _mm256_storeu_ps(vg, _mm256_add_ps(_mm256_loadu_ps(vg), _mm256_mul_ps(decode_levels<kLookup>(lv, a), s)));
        _mm256_storeu_ps(vg + 8, _mm256_add_ps(_mm256_loadu_ps(vg + 8), _mm256_mul_ps(decode_levels<kLookup>(lv, b), s)));
      }
      return _mm256_testz_si256(bad, bad) != 0;
    });
    return ok && codes_ok;
#else
    uint8_t unpacked[kSuperGroup];
    unpack_supergroup(bits, codes, unpacked);
    const uint8_t max_code = static_cast<uint8_t>(2 * t.max_mag);
    uint8_t bad = 0;
    for (int k = 0; k < kSuperGroup; ++k) {
      bad |= unpacked[k] > max_code ? 1 : 0;
      v[k] += decode_code(t, unpacked[k], scale[k / kGroup]);
    }
    return ok && bad == 0;
#endif
  }

  // One super-group of the fused hop: own (mean-subtracted) + decoded inputs -> record.
  bool fuse_supergroup(uint32_t j, const ConstTensor& own, const uint8_t* const* recs, int n_in,
                       uint8_t* out, const RoundingKey& key) const {
    const int bits = width_[j];
    const size_t base = static_cast<size_t>(j) * kSuperGroup;
    const int valid = static_cast<int>(std::min<size_t>(kSuperGroup, count_ - base));
    if (poisoned_[j]) {  // the non-finite mean carries the result; keep the record inert
      const int scale_bytes = record_[0] - kSuperGroup * 2 / 8;
      std::memset(out, 0, scale_bytes);                                  // unit / scales 0
      if (opt_.hierarchical_scales) std::memset(out + 2, 1, kGroupsPerSuperGroup);  // factors 1
      std::memset(out + scale_bytes, 0x55, kSuperGroup * 2 / 8);         // 2-bit code 1 = zero
      return true;
    }
    alignas(32) float v[kSuperGroup];
    const float mu = bits == 16 ? 0.0f : mean_[j];
    if (own.dtype == DType::kF32) {
      const float* x = static_cast<const float*>(own.data) + base;
      for (int k = 0; k < valid; ++k) v[k] = x[k] - mu;
    } else {
      const uint16_t* x = static_cast<const uint16_t*>(own.data) + base;
      for (int k = 0; k < valid; ++k) v[k] = bf16_to_f32(x[k]) - mu;
    }
    for (int k = valid; k < kSuperGroup; ++k) v[k] = 0.0f;
    bool ok = true;
    for (int i = 0; i < n_in; ++i) ok &= accumulate_record(bits, recs[i], v);
    if (bits == 16) {
      write_bf16_record(j, v, out, key);
      return ok;
    }
    quantize_supergroup(j, bits, v, out, key);
    return ok;
  }

  // The 16 random bits of each of super-group j's 256 elements (rounding_bits16()).
  static void rounding_bits(uint32_t j, const RoundingKey& key, uint16_t* bits) {
    const uint32_t block0 = rounding_block(static_cast<uint64_t>(j) * kSuperGroup);
    for (int q = 0; q < 4; ++q) {
      uint32_t words[4][8];
#if defined(__AVX2__)
      const Philox4x8 w = philox_draw_x8(key.seed, key.call, key.rank, kStreamRounding, block0 + 8 * q);
      for (int word = 0; word < 4; ++word)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[word]), w.v[word]);
#else
      for (int i = 0; i < 8; ++i) {
        const Philox4 w = philox_draw(key.seed, key.call, key.rank, kStreamRounding, block0 + 8 * q + i);
        for (int word = 0; word < 4; ++word) words[word][i] = w.v[word];
      }
#endif
      for (int word = 0; word < 4; ++word)
        for (int p = 0; p < kGroup; ++p)
          bits[(4 * word + q) * kGroup + p] = static_cast<uint16_t>(words[word][p & 7] >> (16 * (p >> 3)));
    }
  }

  // Width 16: stochastic rounding to BF16 with the element's 16 random bits: unbiased (exactly
  // 16 bits are discarded) and exact for BF16-representable sums.
  static void write_bf16_record(uint32_t j, const float* v, uint8_t* out, const RoundingKey& key) {
    uint16_t bits[kSuperGroup];
    rounding_bits(j, key, bits);
    for (int k = 0; k < kSuperGroup; ++k) {
      const uint16_t h = f32_to_bf16_stochastic(v[k], bits[k]);
      out[2 * k] = static_cast<uint8_t>(h);
      out[2 * k + 1] = static_cast<uint8_t>(h >> 8);
    }
  }

  void quantize_supergroup(uint32_t j, int bits, const float* v, uint8_t* out,
                           const RoundingKey& key) const {
    [[maybe_unused]] const LevelTable& t = levels_[width_index(bits)];
    // Group maxima on the magnitude bit patterns: ordered like the floats, NaN above Inf.
    uint32_t gmax_bits[kGroupsPerSuperGroup];
    uint32_t sgmax_bits = 0;
#if defined(__AVX2__)
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
      const __m256i* vg = reinterpret_cast<const __m256i*>(v + g * kGroup);
      const __m256i m8 = _mm256_max_epu32(_mm256_and_si256(_mm256_loadu_si256(vg), abs_mask),
                                          _mm256_and_si256(_mm256_loadu_si256(vg + 1), abs_mask));
      __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(m8), _mm256_extracti128_si256(m8, 1));
      m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(1, 0, 3, 2)));
      m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(2, 3, 0, 1)));
      gmax_bits[g] = static_cast<uint32_t>(_mm_cvtsi128_si32(m4));
    }
    for (int g = 0; g < kGroupsPerSuperGroup; ++g) sgmax_bits = std::max(sgmax_bits, gmax_bits[g]);
#else
    for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
      uint32_t m = 0;
      for (int i = 0; i < kGroup; ++i) {
        const uint32_t a = f32_bits(v[g * kGroup + i]) & 0x7fffffffu;
        m = a > m ? a : m;
      }
      gmax_bits[g] = m;
      sgmax_bits = m > sgmax_bits ? m : sgmax_bits;
    }
#endif
    float scale[kGroupsPerSuperGroup];
    uint8_t* codes_out;
    if (opt_.hierarchical_scales) {
      const uint16_t unit_bits = supergroup_unit_bf16(f32_from_bits(sgmax_bits));
      const float unit = bf16_to_f32(unit_bits);
      out[0] = static_cast<uint8_t>(unit_bits);
      out[1] = static_cast<uint8_t>(unit_bits >> 8);
#if defined(__AVX2__)
      if (unit > 0.0f) {  // group_factor() for 8 groups at a time
        const __m256 vunit = _mm256_set1_ps(unit);
        __m256i factor[2];
        for (int h = 0; h < 2; ++h) {
          const __m256 gmax = _mm256_loadu_ps(reinterpret_cast<const float*>(gmax_bits + 8 * h));
          const __m256 q = _mm256_div_ps(gmax, vunit);
          __m256i f = _mm256_cvttps_epi32(q);
          // ceil: one up where truncation dropped a fraction
          f = _mm256_sub_epi32(f, _mm256_castps_si256(_mm256_cmp_ps(_mm256_cvtepi32_ps(f), q, _CMP_LT_OQ)));
          f = _mm256_max_epi32(f, _mm256_set1_epi32(1));
          const __m256 below = _mm256_cmp_ps(q, _mm256_set1_ps(255.0f), _CMP_LT_OQ);  // false for NaN
          f = _mm256_blendv_epi8(_mm256_set1_epi32(255), f, _mm256_castps_si256(below));
          _mm256_storeu_ps(scale + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(f), vunit));
          factor[h] = f;
        }
        const __m256i words16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(factor[0], factor[1]), 0xD8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2),
                         _mm_packus_epi16(_mm256_castsi256_si128(words16), _mm256_extracti128_si256(words16, 1)));
      } else
#endif
      {
        for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
          const uint8_t f = group_factor(f32_from_bits(gmax_bits[g]), unit);
          out[2 + g] = f;
          scale[g] = static_cast<float>(f) * unit;
        }
      }
      codes_out = out + 2 + kGroupsPerSuperGroup;
    } else {
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
        const uint16_t s = f32_to_bf16_up(f32_from_bits(gmax_bits[g]));
        out[2 * g] = static_cast<uint8_t>(s);
        out[2 * g + 1] = static_cast<uint8_t>(s >> 8);
        scale[g] = bf16_to_f32(s);
      }
      codes_out = out + 2 * kGroupsPerSuperGroup;
    }
    float pi[kGroupsPerSuperGroup];
    const bool corr = opt_.correlated_rounding && key.strata > 1;
    const float strata = corr ? static_cast<float>(key.strata) : 1.0f;
    if (corr) {
      uint32_t perm_key[kGroupsPerSuperGroup];
      const uint64_t group0 = static_cast<uint64_t>(j) * kGroupsPerSuperGroup;
      for (int q = 0; q < kGroupsPerSuperGroup / 4; ++q) {
        const Philox4 w = philox_draw(key.seed, key.call, key.stratum_class, kStreamPermutation,
                                      static_cast<uint32_t>((group0 >> 2) + q));
        for (int i = 0; i < 4; ++i) perm_key[4 * q + i] = w.v[i];
      }
      for (int g = 0; g < kGroupsPerSuperGroup; ++g)
        pi[g] = static_cast<float>(shuffle_position(perm_key[g], key.stratum, key.strata));
    } else {
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) pi[g] = 0.0f;
    }
#if defined(__AVX2__)
    // Blocks j*32 + 8q .. +7 hold the random bits of groups q, 4+q, 8+q, 12+q (word g / 4, low
    // halves then high halves; rounding_block()), so each 8-lane draw feeds four groups.
    const LevelsX8& lv = levels_x8_[width_index(bits)];
    const __m256 strata_v = _mm256_set1_ps(strata);
    const uint32_t block0 = rounding_block(static_cast<uint64_t>(j) * kSuperGroup);
    with_width(bits, lv.lookup, [&](auto width, auto lookup) {
      constexpr int kBits = decltype(width)::value;
      constexpr Lookup kLookup = decltype(lookup)::value;
      const __m256i low16 = _mm256_set1_epi32(0xffff);
      for (int q = 0; q < 4; ++q) {
        const Philox4x8 w = philox_draw_x8(key.seed, key.call, key.rank, kStreamRounding, block0 + 8 * q);
        for (int word = 0; word < 4; ++word) {
          const int g = 4 * word + q;
          const uint64_t e0 = static_cast<uint64_t>(j) * kSuperGroup + g * kGroup;
          const __m256 s = _mm256_set1_ps(scale[g]), p = _mm256_set1_ps(pi[g]);
          const __m256i a = round_codes<kBits, kLookup>(lv, _mm256_loadu_ps(v + g * kGroup), s,
                                                        _mm256_and_si256(w.v[word], low16), p, strata_v, key, e0);
          const __m256i b = round_codes<kBits, kLookup>(lv, _mm256_loadu_ps(v + g * kGroup + 8), s,
                                                        _mm256_srli_epi32(w.v[word], 16), p, strata_v, key, e0 + 8);
          pack_group<kBits>(a, b, g, codes_out);
        }
      }
    });
#else
    uint8_t codes[kSuperGroup];
    for (int k = 0; k < kSuperGroup; ++k) {
      const int g = k / kGroup;
      const int mag = round_magnitude(t, magnitude_ratio(v[k], scale[g]), pi[g], strata, key.seed,
                                      key.call, key.rank, static_cast<uint64_t>(j) * kSuperGroup + k);
      codes[k] = static_cast<uint8_t>(encode_code(mag, v[k] < 0.0f, t.max_mag));
    }
    pack_supergroup(bits, codes, codes_out);
#endif
  }

  DynamiqOptions opt_;
  LevelTable levels_[3];
#if defined(__AVX2__)
  FastLevels fast_[3];
  LevelsX8 levels_x8_[3];
#endif
  int record_[4];
  size_t n_sg_ = 0;
  size_t capacity_ = 0;  // bytes of every chunk message
  size_t stride_ = 0;    // cut spacing in the record stream (bytes)
  bool honest_ = true;
  uint64_t call_ = 0;
  std::vector<float> mean_, restore_, key_;
  std::vector<uint8_t> poisoned_, width_;
  std::vector<uint32_t> order_, offset_, chunk_first_, chunk_check_;
  // position_[j]: wire position of super-group j; by_index_: each chunk's wire positions in
  // super-group order (same chunk_first_ bounds); cursor_: scratch for building it.
  std::vector<uint32_t> position_, by_index_, cursor_;
  std::vector<uint64_t> chunk_content_;
};

}  // namespace

std::unique_ptr<Codec> make_dynamiq_codec(const DynamiqOptions& options) {
  return std::make_unique<DynamiqCodec>(options);
}

DynamiqLayoutView dynamiq_layout(const Codec& codec) {
  const auto* d = dynamic_cast<const DynamiqCodec*>(&codec);
  return d ? d->view() : DynamiqLayoutView{};
}

}  // namespace dq
