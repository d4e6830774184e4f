// The host AVX2 helpers of the DynamiQ hot path (kernels/dynamiq_hot.h): eight Philox blocks at
// once, level lookups, (un)packing of one group of 16 codes, stochastic rounding of 8 values.
// Included only inside a target region (kernels/dynamiq_host_avx2.cc: AVX2;
// kernels/dynamiq_host_avx512.cc: AVX-512 at 256 bits), in the namespace of that path
// (DQ_HOST_ISA_NS), so that each translation unit's functions are its own: one linker-merged copy
// compiled for AVX-512 would fault on a CPU with AVX2 alone. Each super-group is
// processed one group of 16 values (two vectors) at a time, with the same IEEE operations in the
// same order as the pointwise functions in dynamiq_math.h, so the bytes equal the device's
// (tests: DeviceMath.HostRecordMatchesPointwiseReference,
// DeviceMath.FusedHopMatchesPointwiseReference).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/codec.h"
#include "kernels/dynamiq_math.h"
#include "kernels/philox.h"

#ifndef DQ_HOST_ISA_NS
#error "define DQ_HOST_ISA_NS (the path's namespace) before including kernels/dynamiq_avx2.h"
#endif

namespace dq::DQ_HOST_ISA_NS::avx2 {

// Host only: eight Philox4x32-10 blocks at once with AVX2, counters {c0 + lane, c1, c2, c3}.
// Lane i of out[w] is word w of philox4x32_10(c0 + i, c1, c2, c3, k0, k1), bit for bit (test
// Philox.EightLanesMatchScalar); the device keeps the scalar function, one block per thread.
struct Philox4x8 {
  __m256i v[4];
};

// The low 32-bit halves of a's and b's four 64-bit lanes, a's in lanes 0-1 and 4-5, b's in 2-3
// and 6-7 (a function, not a lambda: a lambda's function-pointer thunk would not be compiled
// for AVX2).
inline __m256i philox_merge_lanes(__m256i a, __m256i b) {
  return _mm256_castps_si256(
      _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), _MM_SHUFFLE(2, 0, 2, 0)));
}

inline Philox4x8 philox4x32_10_x8(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                  uint32_t k1) {
  // Two sets of four blocks, one per 64-bit lane (value in the low half): _mm256_mul_epu32
  // then yields each full 64-bit product in place, with no even/odd shuffling, and the high
  // halves left behind are never read (products use the low halves only).
  const __m256i mul0 = _mm256_set1_epi64x(0xD2511F53u), mul1 = _mm256_set1_epi64x(0xCD9E8D57u);
  const __m256i base = _mm256_set1_epi64x(c0);
  __m256i x0[2] = {_mm256_add_epi64(base, _mm256_setr_epi64x(0, 1, 4, 5)),   // blocks 0,1,4,5
                   _mm256_add_epi64(base, _mm256_setr_epi64x(2, 3, 6, 7))};  // blocks 2,3,6,7
  __m256i x1[2], x2[2], x3[2];
  for (int s = 0; s < 2; ++s) {
    x1[s] = _mm256_set1_epi64x(c1);
    x2[s] = _mm256_set1_epi64x(c2);
    x3[s] = _mm256_set1_epi64x(c3);
  }
  for (int round = 0; round < 10; ++round) {
    const __m256i key0 = _mm256_set1_epi32(static_cast<int>(k0));
    const __m256i key1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int s = 0; s < 2; ++s) {
      const __m256i p0 = _mm256_mul_epu32(x0[s], mul0);  // {lo0, hi0} per lane
      const __m256i p1 = _mm256_mul_epu32(x2[s], mul1);  // {lo1, hi1}
      x0[s] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), x1[s]), key0);
      x1[s] = p1;
      x2[s] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), x3[s]), key1);
      x3[s] = p0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  // Low halves of {0,1,4,5} and {2,3,6,7}: the 32-bit shuffle restores block order 0..7.
  return Philox4x8{{philox_merge_lanes(x0[0], x0[1]), philox_merge_lanes(x1[0], x1[1]),
                    philox_merge_lanes(x2[0], x2[1]), philox_merge_lanes(x3[0], x3[1])}};
}

// philox_draw() for blocks block .. block + 7.
inline Philox4x8 philox_draw_x8(uint64_t seed, uint64_t call, uint32_t hop, uint32_t stream,
                                uint32_t block) {
  return philox4x32_10_x8(block, (hop & 0x00ffffffu) | (stream << 24), static_cast<uint32_t>(call),
                          static_cast<uint32_t>(call >> 32), static_cast<uint32_t>(seed),
                          static_cast<uint32_t>(seed >> 32));
}

// The draw's words in memory: words[w][i] = word w of block i.
inline void store_words(const Philox4x8& draw, uint32_t words[4][8]) {
  for (int w = 0; w < 4; ++w) _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[w]), draw.v[w]);
}

// mix32() of eight words at once (32-bit multiplies wrap as the scalar's do).
inline __m256i mix32_x8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// One swap-or-not round of shuffle_position() in each lane (x: the lane's position so far).
inline __m256i shuffle_round_x8(__m256i key, __m256i x, __m256i n, __m256i n64, int round) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i round_key = mix32_x8(_mm256_add_epi32(
      key, _mm256_set1_epi32(static_cast<int>(0x9E3779B9u * static_cast<uint32_t>(round + 1)))));
  // pivot = the high half of round_key * strata: the even lanes' products, then the odd ones'
  // (each 64-bit product's high half sits in its odd 32-bit lane).
  const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(round_key, n64), 32);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(round_key, 32), n64);
  const __m256i pivot = _mm256_blend_epi32(even, odd, 0xAA);
  // partner = (pivot - x) mod strata: pivot - x where pivot >= x (unsigned), else + strata
  const __m256i at_least = _mm256_cmpeq_epi32(_mm256_max_epu32(pivot, x), pivot);
  const __m256i difference = _mm256_sub_epi32(pivot, x);
  const __m256i partner = _mm256_blendv_epi8(_mm256_add_epi32(difference, n), difference, at_least);
  const __m256i hi = _mm256_max_epu32(x, partner);
  const __m256i bit = _mm256_and_si256(
      mix32_x8(_mm256_xor_si256(
          round_key, _mm256_mullo_epi32(hi, _mm256_set1_epi32(static_cast<int>(0x27d4eb2fu))))),
      one);
  return _mm256_blendv_epi8(x, partner, _mm256_cmpeq_epi32(bit, one));
}

// positions[i] = shuffle_position(keys[i], member, strata) for 16 keys, as two vectors of 8: the
// same integer operations (test Correlated.LanesMatchScalar). Each round waits on the one before
// (five dependent multiplies), so the two vectors are interleaved. The scalar shuffle, 24 mixes a
// group, took 29% of a correlated leaf's time on one core (tests/kernels/bench_codec,
// docs/results/host-isa.md).
inline void shuffle_positions_x16(const uint32_t keys[16], uint32_t member, uint32_t strata,
                                  uint32_t positions[16]) {
  const __m256i n = _mm256_set1_epi32(static_cast<int>(strata));
  const __m256i n64 = _mm256_set1_epi64x(strata);  // the multiplier of _mm256_mul_epu32
  const __m256i key[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys)),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + 8))};
  __m256i x[2];
  x[0] = x[1] = _mm256_set1_epi32(static_cast<int>(member % strata));
  for (int round = 0; round < kShuffleRounds; ++round) {
    x[0] = shuffle_round_x8(key[0], x[0], n, n64, round);
    x[1] = shuffle_round_x8(key[1], x[1], n, n64, round);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(positions), x[0]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(positions + 8), x[1]);
}

// Rows r[0..7] of an 8 x 8 matrix (lane j of r[i]: element (i, j)) transposed in place.
inline void transpose8x8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Eight consecutive values as FP32: FP32 as they are, BF16 widened (bf16_to_f32()).
inline __m256 load8_f32(const float* x) {
  return _mm256_loadu_ps(x);
}
inline __m256 load8_f32(const uint16_t* x) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Each group's sum and sum of squares, for the eight groups of 16 values at x (lane g: group
// g), and whether any value differs from 0 (NaN included): lane g adds its group's values one by
// one in order, as the scalar supergroup_sums() does, so the sums are the same floats. The
// groups' values are transposed so that one vector holds value k of all eight groups.
template <typename T>
inline void group_sums_x8(const T* x, __m256* sum, __m256* sum_sq, __m256* non_zero) {
  __m256 first[8], second[8];  // values 0-7 and 8-15 of each group, then transposed
  for (int g = 0; g < 8; ++g) {
    first[g] = load8_f32(x + kGroup * g);
    second[g] = load8_f32(x + kGroup * g + 8);
  }
  transpose8x8(first);
  transpose8x8(second);
  __m256 s = _mm256_setzero_ps(), q = _mm256_setzero_ps(), nz = _mm256_setzero_ps();
  for (int k = 0; k < kGroup; ++k) {
    const __m256 v = k < 8 ? first[k] : second[k - 8];
    s = _mm256_add_ps(s, v);
    q = _mm256_add_ps(q, _mm256_mul_ps(v, v));
    nz = _mm256_or_ps(nz, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_NEQ_UQ));
  }
  *sum = s;
  *sum_sq = q;
  *non_zero = nz;
}

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

inline void build_fast_levels(const LevelTable& t, FastLevels* f) {
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
  const __m256i spread =
      _mm256_permutevar8x32_epi32(idx, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
  const auto* base = static_cast<const long long*>(table);
  const __m256 lo =
      _mm256_castsi256_ps(_mm256_i32gather_epi64(base, _mm256_castsi256_si128(spread), 8));
  const __m256 hi =
      _mm256_castsi256_ps(_mm256_i32gather_epi64(base, _mm256_extracti128_si256(spread, 1), 8));
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
    const __m256i shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
                  mask = _mm256_set1_epi32(15);
    *a =
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w[0])), shift), mask);
    *b =
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w[1])), shift), mask);
  } else {
    uint32_t w;
    std::memcpy(&w, codes + 4 * g, 4);
    const __m256i word = _mm256_set1_epi32(static_cast<int>(w)), mask = _mm256_set1_epi32(3);
    *a = _mm256_and_si256(_mm256_srlv_epi32(word, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                          mask);
    *b = _mm256_and_si256(
        _mm256_srlv_epi32(word, _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30)), mask);
  }
}

// Packs two vectors of 8 codes (group g) LSB-first into `bits`-wide fields.
template <int kBits>
inline void pack_group(__m256i a, __m256i b, int g, uint8_t* codes) {
  const __m256i words16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
  const __m128i bytes =
      _mm_packus_epi16(_mm256_castsi256_si128(words16), _mm256_extracti128_si256(words16, 1));
  if constexpr (kBits == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16 * g), bytes);
  } else if constexpr (kBits == 4) {  // byte i = c[2i] + 16 c[2i+1]  (<= 238)
    const __m128i pairs = _mm_maddubs_epi16(bytes, _mm_set1_epi16(0x1001));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + 8 * g), _mm_packus_epi16(pairs, pairs));
  } else {  // byte i = c[4i] + 4 c[4i+1] + 16 c[4i+2] + 64 c[4i+3]  (<= 170)
    const __m128i pairs = _mm_maddubs_epi16(bytes, _mm_set1_epi16(0x0401));
    const __m128i quads = _mm_madd_epi16(pairs, _mm_set1_epi32(0x00100001));
    const __m128i packed = _mm_shuffle_epi8(
        quads, _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
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
inline __attribute__((noinline)) __m256i resolve_ties(__m256i up, int tie, __m256 x, __m256i u16,
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

// Stochastic rounding of 8 values of one group (elements e0 .. e0 + 7, indices in the caller's
// whole tensor: they key the tie words) to offset-binary codes:
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
      r = _mm256_sub_epi32(
          r, _mm256_castps_si256(_mm256_cmp_ps(_mm256_set1_ps(lv.t->level[i]), m, _CMP_LE_OQ)));
    level = _mm256_permutevar8x32_ps(lv.level_lo, r);
    inv_gap = _mm256_permutevar8x32_ps(lv.gap_lo, r);
  } else {
    const __m256i cell =
        _mm256_cvttps_epi32(_mm256_mul_ps(m, _mm256_set1_ps(static_cast<float>(kLevelGrid))));
    if constexpr (kLookup == Lookup::kOneStep) {
      __m256 start, l0, l1, l2;
      load_quads(lv.fast->quad, cell, &start, &l0, &l1, &l2);
      const __m256 step = _mm256_cmp_ps(l1, m, _CMP_LE_OQ);
      r = _mm256_sub_epi32(_mm256_castps_si256(start), _mm256_castps_si256(step));
      level = _mm256_blendv_ps(l0, l1, step);
      // inv_gap[r] exactly (build_level_table()); at r = L it gives 1, not 0, but there m = 1 =
      // level[L], so frac = 0 * inv_gap = +0 either way.
      inv_gap =
          _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sub_ps(_mm256_blendv_ps(l1, l2, step), level));
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
  __m256i up =
      _mm256_castps_si256(_mm256_cmp_ps(_mm256_add_ps(k, _mm256_set1_ps(1.0f)), y, _CMP_LE_OQ));
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

// The register and table form of one width's levels.
inline void init_levels_x8(const LevelTable& t, const FastLevels& fast, LevelsX8* lv) {
  lv->t = &t;
  lv->fast = &fast;
  lv->lookup = t.max_mag <= 7       ? Lookup::kRegisters
               : t.extra_steps <= 1 ? Lookup::kOneStep
                                    : Lookup::kGeneric;
  lv->level_lo = _mm256_loadu_ps(t.level);
  lv->gap_lo = _mm256_loadu_ps(t.inv_gap);
  lv->decode_lo = _mm256_loadu_ps(t.decode);
  lv->decode_hi = _mm256_loadu_ps(t.decode + 8);
}

}  // namespace dq::DQ_HOST_ISA_NS::avx2
