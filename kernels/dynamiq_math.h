// DynamiQ arithmetic shared by the host implementation and the CUDA kernels. Only IEEE basic
// operations (add, mul, div, compare) and integer ops, no libm and no FMA contraction, so the
// host is a bit-exact reference for the device. The record layout the constants size is in
// docs/FORMAT.md.
#pragma once
#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/hd.h"
#include "kernels/philox.h"

namespace dq {

constexpr int kSuperGroup = 256;  // values sharing a width and a BF16 scale
constexpr int kGroup = 16;        // values sharing a UINT8 scale
constexpr int kGroupsPerSuperGroup = kSuperGroup / kGroup;
constexpr int kLevelGrid = 1024;  // cells of the magnitude -> level lookup grid

// Width codes: bits per value. 16 = raw BF16 (exact for BF16-representable values).
enum Width : uint8_t { kW2 = 2, kW4 = 4, kW8 = 8, kW16 = 16 };

DQ_HD int width_index(int bits) {
  return bits == 2 ? 0 : bits == 4 ? 1 : bits == 8 ? 2 : 3;
}
DQ_HD int max_magnitude(int bits) {
  return (1 << (bits - 1)) - 1;
}  // L: codes -L..L

// Bytes of one super-group record (docs/FORMAT.md): hierarchical scales = BF16 unit + 16 UINT8
// group scales; flat scales (ablation) = 16 BF16 group scales.
DQ_HD int record_bytes(int bits, bool hierarchical_scales) {
  if (bits == 16) return 2 * kSuperGroup;
  int scale_bytes = hierarchical_scales ? 2 + kGroupsPerSuperGroup : 2 * kGroupsPerSuperGroup;
  return scale_bytes + kSuperGroup * bits / 8;
}

// Magnitude levels of one width: level[r] = f(eps, r), r = 0..L, plus lookup tables.
// Built once per codec on the host (build_level_table in kernels/dynamiq_codec.cc) and copied to
// the device as plain data.
struct LevelTable {
  int max_mag;                    // L
  int extra_steps;                // most levels inside one grid cell (fix-up iterations)
  float level[130];               // level[L+1] = sentinel > 1
  float inv_gap[129];             // 1 / (level[r+1] - level[r]); 0 at r = L
  int32_t start[kLevelGrid + 1];  // largest r with level[r] <= cell / kLevelGrid
  float decode[256];              // signed level of each code 0..2L (offset binary), 0 beyond
};

// level_floor()'s fix-up steps after the first, for levels with two or more inside one grid cell
// (none at the default levels). One copy on the device: the trip count is read at run time, and
// nvcc unrolled the loop 4 ways with a remainder in each of the fused hop's 8 unrolled values
// (1,584 of the hop's 5,096 sm_90 instructions).
DQ_HD int level_floor_further_steps(const LevelTable& t, float m, int r) {
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
  for (int k = 1; k < t.extra_steps; ++k) r += (t.level[r + 1] <= m) ? 1 : 0;
  return r;
}

// Magnitude m in [0, 1] -> lower level index r with level[r] <= m < level[r+1] (r = L at m = 1).
// The grid cell's first level, then extra_steps fix-ups: the first without a loop (the default
// levels need at most one), where a loop's control cost about as much as the step in the hop.
// The first step is taken whatever extra_steps is: with no level inside any cell (extra_steps 0)
// it adds nothing, since level[r + 1] then lies at or above the cell's upper edge, which m is
// below (cell = floor(m 2^10), exact), or is the sentinel 2 at r = L; a test of extra_steps there
// cost the hop a branch a value.
DQ_HD int level_floor(const LevelTable& t, float m) {
  int cell = static_cast<int>(m * static_cast<float>(kLevelGrid));
  int r = t.start[cell];
  r += (t.level[r + 1] <= m) ? 1 : 0;
  if (t.extra_steps > 1) r = level_floor_further_steps(t, m, r);
  return r;
}

// Stochastic rounding of magnitude m between adjacent levels: round up iff u < x, where
// x = frac * strata - pi (frac = normalized distance above the lower level) and u is uniform on
// [0, 1). That is u' = (pi + u) / strata < frac: with strata = 1, pi = 0 plain unbiased
// rounding; with strata = n and pi a shared permutation index, correlated rounding (one u' per
// 1/n stratum). x is exact in FP32 where it matters (0 <= x < 1: frac*strata lies within
// [pi, pi + 1), so the subtraction is exact by Sterbenz's lemma).
DQ_HD float round_up_threshold(const LevelTable& t, float m, int r, float pi, float strata) {
  const float frac = (m - t.level[r]) * t.inv_gap[r];
  return frac * strata - pi;
}

// u is drawn 16 bits at a time: u = (u16 + v) * 2^-16 with v uniform on [0, 1), and v is only
// drawn when the 16 bits leave the decision open (probability 2^-16), so P(up) = x to 2^-40,
// finer than the 24-bit uniform it replaces, at half the Philox work.
// Returns 1 (up), 0 (down), or -1 (tie: decide with round_up_tie()).
DQ_HD int round_up_coarse(float x, uint32_t u16) {
  const float y = x * 65536.0f;  // exact: power-of-two scaling
  const float k = static_cast<float>(u16);
  if (k + 1.0f <= y) return 1;
  if (!(k < y)) return 0;
  return -1;
}

// The tie: y - u16 lies in (0, 1) and is exact (Sterbenz); v = uniform24 of the tie word.
DQ_HD int round_up_tie(float x, uint32_t u16, float v) {
  return (v < x * 65536.0f - static_cast<float>(u16)) ? 1 : 0;
}

// Offset-binary code with an exact zero: sign and magnitude -> 0..2L.
DQ_HD uint32_t encode_code(int mag, bool negative, int max_mag) {
  return static_cast<uint32_t>(negative ? max_mag - mag : max_mag + mag);
}

DQ_HD float decode_code(const LevelTable& t, uint32_t code, float scale) {
  return t.decode[code & 0xffu] * scale;
}

// |v| / scale clamped to [0, 1]; NaN (from an overflowed partial sum) maps to 1 so the lookup
// stays in bounds while the record's Inf/NaN scale keeps the result non-finite.
DQ_HD float magnitude_ratio(float v, float scale) {
  float q = (v < 0.0f ? -v : v) / scale;
  return (q < 1.0f) ? q : 1.0f;
}

// Hierarchical scales. unit = BF16 rounded up of sgmax / 255, so 255 * unit >= sgmax and no
// value can overflow its level range; group factor g = ceil(gmax / unit) in [1, 255].
DQ_HD uint16_t supergroup_unit_bf16(float sgmax) {
  return f32_to_bf16_up(sgmax / 255.0f);
}

DQ_HD uint8_t group_factor(float gmax, float unit) {
  if (!(unit > 0.0f)) return 1;  // zero super-group (or NaN unit): any factor decodes 0/NaN
  float q = gmax / unit;
  if (!(q < 255.0f)) return 255;  // also catches Inf/NaN
  int g = static_cast<int>(q);
  if (static_cast<float>(g) < q) ++g;  // ceil without libm
  return static_cast<uint8_t>(g < 1 ? 1 : g);
}

// Random bits for stochastic rounding: 16 bits per element, keyed by (seed, call, hop). Within
// super-group j, element k (group g = k / 16, position p = k % 16) takes half (p / 8) of word
// g / 4 of counter block j*32 + 8*(g % 4) + (p % 8): eight consecutive blocks feed four groups,
// low halves the first eight values of a group, high halves the last eight.
DQ_HD uint32_t rounding_block(uint64_t element) {
  return static_cast<uint32_t>((element >> 8) * 32 + ((element >> 4) & 3) * 8 + (element & 7));
}
DQ_HD int rounding_word(uint64_t element) {
  return static_cast<int>((element >> 6) & 3);
}
DQ_HD int rounding_half(uint64_t element) {
  return static_cast<int>((element >> 3) & 1);
}

DQ_HD uint32_t rounding_bits16(uint64_t seed, uint64_t call, uint32_t hop, uint64_t e) {
  const Philox4 w = philox_draw(seed, call, hop, kStreamRounding, rounding_block(e));
  return (philox_word(w, rounding_word(e)) >> (16 * rounding_half(e))) & 0xffffu;
}

// The tie word of element e (drawn with probability 2^-16): word e % 4 of block e / 4 of the
// tie stream.
DQ_HD float rounding_tie_uniform(uint64_t seed, uint64_t call, uint32_t hop, uint64_t e) {
  const Philox4 w = philox_draw(seed, call, hop, kStreamRoundingTie, static_cast<uint32_t>(e >> 2));
  return uniform24(philox_word(w, static_cast<uint32_t>(e)));
}

// Stochastic rounding of magnitude m of element e: the magnitude code 0..L.
DQ_HD int round_magnitude(const LevelTable& t, float m, float pi, float strata, uint64_t seed,
                          uint64_t call, uint32_t hop, uint64_t e) {
  const int r = level_floor(t, m);
  const float x = round_up_threshold(t, m, r, pi, strata);
  const uint32_t u16 = rounding_bits16(seed, call, hop, e);
  int up = round_up_coarse(x, u16);
  if (up < 0) up = round_up_tie(x, u16, rounding_tie_uniform(seed, call, hop, e));
  return r + up;
}

// 32-bit integer mixer (murmur3 finalizer): decorrelates consecutive inputs.
DQ_HD uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

constexpr int kShuffleRounds = 12;  // swap-or-not rounds; pairs of outputs ~ uniform distinct

// Correlated rounding: the stratum of member `member` among `strata` for group `group` (16
// values). pi is one random permutation of 0..strata-1 per group and class, shared by the
// class's members and evaluated pointwise with a swap-or-not shuffle (Hoang, Morris,
// Rogaway 2012), a bijection on any domain size. Distinct hops therefore take distinct strata,
// and a pair of hops lands on a near-uniform pair of distinct strata, so their rounding errors
// are negatively correlated (a fixed cyclic shift would correlate neighbours positively).
DQ_HD uint32_t shuffle_position(uint32_t key, uint32_t member, uint32_t strata) {
  uint32_t x = member % strata;
#if defined(__CUDA_ARCH__)
#pragma unroll
#elif !defined(__CUDACC__)  // nvcc's host pass does not know GCC pragmas
#pragma GCC unroll 12
#endif
  for (int round = 0; round < kShuffleRounds; ++round) {
    const uint32_t round_key = mix32(key + 0x9E3779B9u * static_cast<uint32_t>(round + 1));
    const uint32_t pivot = static_cast<uint32_t>((static_cast<uint64_t>(round_key) * strata) >> 32);
    const uint32_t partner = pivot >= x ? pivot - x : pivot + strata - x;  // (pivot - x) mod n
    const uint32_t hi = x > partner ? x : partner;
    x = (mix32(round_key ^ (hi * 0x27d4eb2fu)) & 1u) ? partner : x;
  }
  return x;
}

// The permutation key of group `group` (16 values) for one stratum class: 4 groups per Philox
// block; the class sits in the hop field, so each class shuffles independently.
DQ_HD uint32_t permutation_key(uint64_t seed, uint64_t call, uint32_t stratum_class,
                               uint64_t group) {
  return philox_word(
      philox_draw(seed, call, stratum_class, kStreamPermutation, static_cast<uint32_t>(group >> 2)),
      static_cast<uint32_t>(group));
}

DQ_HD uint32_t correlated_stratum(uint64_t seed, uint64_t call, uint32_t stratum_class,
                                  uint64_t group, uint32_t member, uint32_t strata) {
  if (strata <= 1) return 0;
  return shuffle_position(permutation_key(seed, call, stratum_class, group), member, strata);
}

// Statistics of one super-group in a canonical order (sequential within each group of 16,
// then sequential over groups) so host and device agree bit for bit.
struct SuperGroupStats {
  float mean;
  float sum_sq;
};

}  // namespace dq
