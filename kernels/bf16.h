// BF16 <-> FP32 conversions, bit-exact on host and device (integer arithmetic only).
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/hd.h"

namespace dq {

inline constexpr uint16_t kBf16One = 0x3F80;  // 1.0

DQ_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

DQ_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

DQ_HD float bf16_to_f32(uint16_t h) {
  return f32_from_bits(static_cast<uint32_t>(h) << 16);
}

// Round to nearest, ties to even; NaN stays NaN (quiet), Inf stays Inf.
DQ_HD uint16_t f32_to_bf16_rne(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Round toward +infinity in magnitude for non-negative finite inputs (used for scales, so a
// decoded scale is never smaller than the value it must cover). Saturates at the largest
// finite BF16 instead of producing Inf.
DQ_HD uint16_t f32_to_bf16_up(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) >= 0x7f800000u) return static_cast<uint16_t>(u >> 16);  // Inf/NaN
  uint32_t h = u >> 16;
  if ((u & 0xffffu) != 0 && !(u >> 31)) h += 1;  // positive with discarded bits: bump up
  if ((h & 0x7fffu) == 0x7f80u) h -= 1;          // would be Inf: saturate to max finite
  return static_cast<uint16_t>(h);
}

// Saturating round-to-nearest for finite values (statistics): never turns a finite value into Inf.
DQ_HD uint16_t f32_to_bf16_sat(float f) {
  uint16_t h = f32_to_bf16_rne(f);
  if ((f32_bits(f) & 0x7fffffffu) < 0x7f800000u && (h & 0x7fffu) == 0x7f80u) h -= 1;
  return h;
}

// Stochastic rounding: round the magnitude up with probability (discarded bits) / 2^16, using
// the low 16 bits of `random`. Unbiased; exact when the value is already a BF16. NaN stays NaN.
DQ_HD uint16_t f32_to_bf16_stochastic(float f, uint32_t random) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t discarded = u & 0xffffu;
  return static_cast<uint16_t>((u >> 16) + ((random & 0xffffu) < discarded ? 1u : 0u));
}

// The uniform baseline's decoded value (q * S) / L (docs/FORMAT.md): q * S is exact, one rounding.
// Where q * S would overflow (S above 2^100, so within a factor L of FLT_MAX) the same quotient
// is formed 2^64 lower and scaled back (exact), so a finite result stays finite.
DQ_HD float uniform_level_value(int q, float scale, float levels) {
  if (scale > 0x1p100f) return ((static_cast<float>(q) * (scale * 0x1p-64f)) / levels) * 0x1p64f;
  return (static_cast<float>(q) * scale) / levels;
}

}  // namespace dq
