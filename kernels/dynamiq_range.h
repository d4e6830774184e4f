// DynamiQ over the whole finite range of FP32 (docs/FORMAT.md, "Range"), shared by the host and
// the CUDA kernels. A plain sum of squares leaves FP32 for values above about 2^60 (and 2^128 is
// only the largest sum the BF16 statistics word can hold) or below about 2^-75; the width
// bisection's thresholds reach at most FLT_MAX * 257/2^17, so an energy above about 2^119 can only
// be given 2 bits. Three pieces keep every scale working like unit scale, and leave in-range data
// byte for byte as it was:
//  - a worker's energy outside [2^-96, 2^96] travels log-compressed (its bit pattern's distance
//    from the window divided by 8 above, by 16 below), computed from values scaled by a power of
//    two, so it never overflows or flushes to zero; the layout expands it back (as a double);
//  - the width bisection runs on the energies scaled by one power of two per call, so the largest
//    sits where the thresholds have room on both sides;
//  - a super-group whose energy is far from unit scale is coded scaled by a power of two 2^K_j
//    (K_j in the layout, the same on every rank), so its records never meet BF16's subnormal
//    unit or FLT_MAX.
#pragma once
#include <cfloat>
#include <cstdint>
#include <cstring>

#include "kernels/bf16.h"
#include "kernels/dynamiq_math.h"
#include "kernels/hd.h"

namespace dq {

// The energy window sent as it is: bit patterns of 2^-96 and 2^96.
inline constexpr int64_t kEnergyWindowLo = int64_t{127 - 96} << 23;
inline constexpr int64_t kEnergyWindowHi = int64_t{127 + 96} << 23;
inline constexpr int64_t kEnergyCompressHi = 8;   // 2^266 (256 squares of FLT_MAX) -> 2^117.25
inline constexpr int64_t kEnergyCompressLo = 16;  // 2^-298 (one square of 2^-149) -> 2^-108.75

// Keys (summed energies) in [2^-180, 2^180] code at unit scale (K_j = 0): their values lie within
// about [2^-104, 2^100], where BF16 units are normal and no partial sum overflows.
inline constexpr int kUnitScaleKeyLog2 = 180;
inline constexpr int kMaxScaleExponent = 126;  // |K_j|: 2^K_j is a normal float

// The width bisection works on keys scaled so that the largest lies near 2^64, unless it already
// lies within [2^-90, 2^100] (then nothing changes: thresholds reach 2^-14 below and 2^9 above).
inline constexpr int kWidthKeyLo = -90, kWidthKeyHi = 100, kWidthKeyTarget = 64;

DQ_HD float pow2f(int e) {  // 2^e for -126 <= e <= 127
  return f32_from_bits(static_cast<uint32_t>(e + 127) << 23);
}

DQ_HD uint64_t f64_bits_of(double d) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(d));
#else
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
#endif
}

DQ_HD double f64_of_bits(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, 8);
  return d;
#endif
}

DQ_HD double pow2d(int e) {  // 2^e for -1022 <= e <= 1023
  return f64_of_bits(static_cast<uint64_t>(e + 1023) << 52);
}

// floor(log2 x) of a positive finite double.
DQ_HD int floor_log2(double x) {
  return static_cast<int>((f64_bits_of(x) >> 52) & 0x7ff) - 1023;
}

// The exponent e with 2^e <= a < 2^(e+1), for the magnitude bit pattern a (0 < a < 0x7f800000),
// subnormals included.
DQ_HD int magnitude_exponent(uint32_t a) {
  if (a >= 0x00800000u) return static_cast<int>(a >> 23) - 127;
  int e = -126;
  while (a < 0x00800000u) {
    a <<= 1;
    --e;
  }
  return e;
}

// Log-compression of an energy given as its extended bit pattern (that of a float, exponent
// unbounded): inside the window the pattern itself.
DQ_HD float compress_energy(int64_t p) {
  if (p > kEnergyWindowHi) p = kEnergyWindowHi + (p - kEnergyWindowHi) / kEnergyCompressHi;
  if (p < kEnergyWindowLo) p = kEnergyWindowLo - (kEnergyWindowLo - p) / kEnergyCompressLo;
  return f32_from_bits(static_cast<uint32_t>(p));
}

// The inverse on a positive float's pattern, as a double (exponent range 2^-1022..2^1023).
// `dither` (0..0xffff) stands for the pattern's bits the BF16 word dropped: summed energies of
// equal BF16 words would otherwise tie, and a tie cannot be split between two widths.
DQ_HD double expand_energy(float c, uint32_t dither) {
  int64_t p = static_cast<int64_t>(f32_bits(c)) + static_cast<int64_t>(dither) - 0x8000;
  if (p > kEnergyWindowHi) p = kEnergyWindowHi + (p - kEnergyWindowHi) * kEnergyCompressHi;
  if (p < kEnergyWindowLo) p = kEnergyWindowLo - (kEnergyWindowLo - p) * kEnergyCompressLo;
  const int64_t e = (p >> 23) - 127;  // arithmetic shift: floor
  const uint64_t mantissa = static_cast<uint64_t>(p & 0x7fffff);
  return f64_of_bits(static_cast<uint64_t>(e + 1023) << 52 | mantissa << 29);
}

// True when a worker's plain FP32 sum of squares stands for its energy as it is.
DQ_HD bool energy_in_window(float sum_sq) {
  const int64_t p = static_cast<int64_t>(f32_bits(sum_sq));
  return p >= kEnergyWindowLo && p <= kEnergyWindowHi;
}

// A worker's statistics words for a super-group whose plain sum of squares left the window
// (docs/FORMAT.md, "Statistics"): load(k) gives value k of `valid`; mean is the plain FP32 mean,
// replaced when it overflowed. A non-finite value keeps the plain words (the super-group is
// poisoned); all zero keeps 0. Sequential sums, the same on host and device.
template <class Load>
DQ_HD void wide_statistics(Load load, int valid, float sum_sq, float* mean, uint16_t* energy_word) {
  uint32_t amax = 0;
  for (int k = 0; k < valid; ++k) {
    const uint32_t a = f32_bits(load(k)) & 0x7fffffffu;
    amax = a > amax ? a : amax;
  }
  if (amax >= 0x7f800000u || amax == 0) {
    *energy_word = f32_to_bf16_sat(sum_sq);
    return;
  }
  // Scale the largest magnitude to [1, 2) in two exact steps (each factor a normal float).
  const int e = magnitude_exponent(amax);
  const float scale_a = pow2f(-e / 2), scale_b = pow2f(-e - (-e / 2));
  float q = 0.0f;
  for (int k = 0; k < valid; ++k) {
    const float y = load(k) * scale_a * scale_b;
    q += y * y;
  }
  *energy_word = f32_to_bf16_sat(
      compress_energy(static_cast<int64_t>(f32_bits(q)) + (static_cast<int64_t>(2 * e) << 23)));
  if (!(*mean - *mean == 0.0f)) {  // the plain sum overflowed: sum values / 256 (exact scaling)
    float s = 0.0f;
    for (int k = 0; k < valid; ++k) s += load(k) * (1.0f / 256.0f);
    *mean = (s / static_cast<float>(valid)) * 256.0f;
  }
}

// The energy key of a super-group from its summed words: the summed energy (as plain BF16 when
// the mean per contributing worker lies in the window, as before; else expanded per worker and
// multiplied back), or -1 when non-finite (a non-finite input: the super-group is poisoned).
// `contributors`: workers whose values are not all zero (1 .. n); j the super-group (its dither).
DQ_HD double energy_key(uint16_t energy_word, float contributors, uint32_t j) {
  const float w = bf16_to_f32(energy_word);
  if (!(w >= 0.0f && w <= FLT_MAX)) return -1.0;
  if (w == 0.0f) return 0.0;
  const float per_worker = w / contributors;
  if (energy_in_window(per_worker)) return static_cast<double>(w);
  return static_cast<double>(contributors) * expand_energy(per_worker, mix32(j) >> 16);
}

// Workers whose values are not all zero, from the summed all-zero word (a sum of ones; a word out
// of range counts as none all zero).
DQ_HD float contributing_workers(uint16_t all_zero_word, int n_workers) {
  const float zeros = bf16_to_f32(all_zero_word);
  if (!(zeros >= 0.0f && zeros <= static_cast<float>(n_workers - 1))) return n_workers;
  return static_cast<float>(n_workers - static_cast<int>(zeros + 0.5f));
}

// The call's width-key shift s (keys are compared as float(key * 2^-s)) from the largest
// floor(log2 key) of its super-groups (INT32_MIN-like when none is positive).
DQ_HD int width_key_shift(int largest_log2) {
  if (largest_log2 < -1100) return 0;  // no positive key
  if (largest_log2 >= kWidthKeyLo && largest_log2 <= kWidthKeyHi) return 0;
  return largest_log2 - kWidthKeyTarget;
}

DQ_HD float width_key(double key, int shift) {
  if (!(key > 0.0)) return 0.0f;
  if (shift == 0) return static_cast<float>(key);
  return static_cast<float>(key * pow2d(-shift));
}

// K_j: the power of two a super-group's values are coded at (0 near unit scale).
DQ_HD int8_t scale_exponent(double key) {
  if (!(key > 0.0)) return 0;
  const int e = floor_log2(key);
  if (e >= -kUnitScaleKeyLog2 && e <= kUnitScaleKeyLog2) return 0;
  int k = -(e >> 1);  // floor(e / 2): sqrt(key) near 1 after scaling
  k = k < -kMaxScaleExponent ? -kMaxScaleExponent : k > kMaxScaleExponent ? kMaxScaleExponent : k;
  return static_cast<int8_t>(k);
}

}  // namespace dq
