// DynamiQ arithmetic shared by the host implementation and the CUDA kernels. Only IEEE basic
// operations (add, mul, div, compare) and integer ops, no libm and no FMA contraction, so the
// host is a bit-exact reference for the device. Constants: METHOD.md section 3.
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

DQ_HD int width_index(int bits) { return bits == 2 ? 0 : bits == 4 ? 1 : bits == 8 ? 2 : 3; }
DQ_HD int max_magnitude(int bits) { return (1 << (bits - 1)) - 1; }  // L: codes -L..L

// Bytes of one super-group record (docs/FORMAT.md): hierarchical scales = BF16 unit + 16 UINT8
// group scales; flat scales (ablation) = 16 BF16 group scales.
DQ_HD int record_bytes(int bits, bool hierarchical_scales) {
  if (bits == 16) return 2 * kSuperGroup;
  int scale_bytes = hierarchical_scales ? 2 + kGroupsPerSuperGroup : 2 * kGroupsPerSuperGroup;
  return scale_bytes + kSuperGroup * bits / 8;
}

// Magnitude levels of one width: level[r] = f(eps, r), r = 0..L, plus lookup tables.
// Built once on the host (kernels/dynamiq_levels.cc) and copied to the device as plain data.
struct LevelTable {
  int max_mag;                      // L
  int extra_steps;                  // most levels inside one grid cell (fix-up iterations)
  float level[130];                 // level[L+1] = sentinel > 1
  float inv_gap[129];               // 1 / (level[r+1] - level[r]); 0 at r = L
  uint8_t start[kLevelGrid + 1];    // largest r with level[r] <= cell / kLevelGrid
};

// Magnitude m in [0, 1] -> lower level index r with level[r] <= m < level[r+1] (r = L at m = 1).
DQ_HD int level_floor(const LevelTable& t, float m) {
  int cell = static_cast<int>(m * static_cast<float>(kLevelGrid));
  int r = t.start[cell];
  for (int k = 0; k < t.extra_steps; ++k) r += (t.level[r + 1] <= m) ? 1 : 0;
  return r;
}

// Stochastic rounding of magnitude m between adjacent levels. The uniform u in [0,1) is
// formed as (pi + gamma) / strata: with strata = 1 it is plain unbiased rounding; with strata =
// n and pi a shared permutation index it is correlated rounding (one u per 1/n stratum).
// Returns the magnitude code 0..L.
DQ_HD int round_magnitude(const LevelTable& t, float m, float pi, float gamma, float strata) {
  int r = level_floor(t, m);
  float frac = (m - t.level[r]) * t.inv_gap[r];
  return r + ((pi + gamma < frac * strata) ? 1 : 0);
}

// Offset-binary code with an exact zero: sign and magnitude -> 0..2L.
DQ_HD uint32_t encode_code(int mag, bool negative, int max_mag) {
  return static_cast<uint32_t>(negative ? max_mag - mag : max_mag + mag);
}

DQ_HD float decode_code(const LevelTable& t, uint32_t code, float scale) {
  int signed_mag = static_cast<int>(code) - t.max_mag;
  float mag = t.level[signed_mag < 0 ? -signed_mag : signed_mag];
  return (signed_mag < 0 ? -mag : mag) * scale;
}

// |v| / scale clamped to [0, 1]; NaN (from an overflowed partial sum) maps to 1 so the lookup
// stays in bounds while the record's Inf/NaN scale keeps the result non-finite.
DQ_HD float magnitude_ratio(float v, float scale) {
  float q = (v < 0.0f ? -v : v) / scale;
  return (q < 1.0f) ? q : 1.0f;
}

// Hierarchical scales. unit = BF16 rounded up of sgmax / 255, so 255 * unit >= sgmax and no
// value can overflow its level range; group factor g = ceil(gmax / unit) in [1, 255].
DQ_HD uint16_t supergroup_unit_bf16(float sgmax) { return f32_to_bf16_up(sgmax / 255.0f); }

DQ_HD uint8_t group_factor(float gmax, float unit) {
  if (!(unit > 0.0f)) return 1;             // zero super-group (or NaN unit): any factor decodes 0/NaN
  float q = gmax / unit;
  if (!(q < 255.0f)) return 255;            // also catches Inf/NaN
  int g = static_cast<int>(q);
  if (static_cast<float>(g) < q) ++g;       // ceil without libm
  return static_cast<uint8_t>(g < 1 ? 1 : g);
}

// Uniform in [0,1) for element `e` of a rounding keyed (seed, call, hop): one 32-bit Philox word
// per element, 4 elements per counter block.
DQ_HD float rounding_uniform(uint64_t seed, uint64_t call, uint32_t hop, uint64_t e) {
  Philox4 w = philox_draw(seed, call, hop, kStreamRounding, static_cast<uint32_t>(e >> 2));
  return uniform24(w.v[e & 3]);
}

// Correlated rounding: stratum of hop `rank` among `strata` for group `group` (16 values).
// pi = (rank + shift) mod strata, shift drawn from a stream shared by all hops (hop field 0), so
// the hops that meet in one coordinate take distinct strata: a shared cyclic permutation.
DQ_HD uint32_t correlated_stratum(uint64_t seed, uint64_t call, uint64_t group, uint32_t rank,
                                  uint32_t strata) {
  Philox4 w = philox_draw(seed, call, 0, kStreamPermutation, static_cast<uint32_t>(group >> 2));
  uint32_t shift = static_cast<uint32_t>((static_cast<uint64_t>(w.v[group & 3]) * strata) >> 32);
  uint32_t pi = rank % strata + shift;
  return pi >= strata ? pi - strata : pi;
}

// Statistics of one super-group in a canonical order (sequential within each group of 16,
// then sequential over groups) so host and device agree bit for bit.
struct SuperGroupStats {
  float mean;
  float sum_sq;
};

}  // namespace dq
