// OCP Microscaling v1.0 element and E8M0 scale arithmetic, bit-exact on host and device
// (integer and basic IEEE operations only, no libm), shared by the host codec and CUDA kernels.
#pragma once
#include <cstdint>

#include "kernels/baselines/baselines.h"
#include "kernels/bf16.h"
#include "kernels/hd.h"

namespace dq {

struct MxFormat {
  int exp_bits;
  int man_bits;
  int bias;
  int emax;           // exponent of the largest normal element (emax_elem of the spec)
  uint32_t max_code;  // magnitude code of the largest finite element
  uint32_t max_f32;   // FP32 bits of that element
  bool has_nan;       // E4M3 only: magnitude code 0x7F is NaN
};

DQ_HD MxFormat mx_format(MxKind kind) {
  switch (kind) {
    case MxKind::kFp8E4M3:
      return MxFormat{4, 3, 7, 8, 0x7Eu, 0x43E00000u, true};  // 448
    case MxKind::kFp6E3M2:
      return MxFormat{3, 2, 3, 4, 0x1Fu, 0x41E00000u, false};  // 28
    case MxKind::kFp6E2M3:
      return MxFormat{2, 3, 1, 2, 0x1Fu, 0x40F00000u, false};  // 7.5
    default:
      return MxFormat{2, 1, 1, 2, 0x7u, 0x40C00000u, false};  // 6
  }
}

DQ_HD int mx_element_bits(MxKind kind) {
  MxFormat f = mx_format(kind);
  return 1 + f.exp_bits + f.man_bits;
}

DQ_HD int mx_clz32(uint32_t x) {  // x != 0
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(x));
#else
  return __builtin_clz(x);
#endif
}

// floor(log2(|f|)) for a finite non-zero magnitude given as FP32 bits (sign cleared),
// denormals included (-149 .. 127).
DQ_HD int mx_floor_log2(uint32_t magnitude_bits) {
  if (magnitude_bits >= 0x00800000u) return static_cast<int>(magnitude_bits >> 23) - 127;
  return (31 - mx_clz32(magnitude_bits)) - 149;
}

// 2^k as FP32 for k in [-149, 127] (denormal powers included).
DQ_HD float mx_pow2(int k) {
  if (k >= -126) return f32_from_bits(static_cast<uint32_t>(k + 127) << 23);
  return f32_from_bits(1u << (k + 149));
}

// Encodes an already scaled value with the format hoisted (branch-free, so a loop over a block
// vectorises): round to nearest, ties to even, saturating to the largest finite magnitude (Inf
// included). NaN becomes the E4M3 NaN code, or 0 in formats without NaN (the block's E8M0 scale
// then carries the NaN).
DQ_HD uint8_t mx_encode_element(const MxFormat& f, float scaled_value) {
  const uint32_t u = f32_bits(scaled_value);
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t sign_code = (u >> 31) << (f.exp_bits + f.man_bits);
  const int emin = 1 - f.bias;  // exponent of the smallest normal element (>= -6)
  // a = sig * 2^lsb_exp exactly. Only max(floor(log2 a), emin) matters below, and every FP32
  // denormal lies under 2^emin, so the biased exponent field is all that is needed (no clz).
  const int biased = static_cast<int>(a >> 23);
  const uint32_t sig = (a & 0x007fffffu) | (biased != 0 ? 0x00800000u : 0u);
  const int lsb_exp = (biased != 0 ? biased : 1) - 150;
  const int e_a = biased - 127;
  // Quantum of the element format at this magnitude (subnormal spacing below emin).
  const int quantum_exp = (e_a > emin ? e_a : emin) - f.man_bits;
  int shift = quantum_exp - lsb_exp;  // >= 23 - man_bits for normal a
  // From 25 on, a < half the quantum: clamping keeps the shifts defined and still gives 0.
  shift = shift < 25 ? shift : 25;
  uint32_t n = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  n += (rem > half || (rem == half && (n & 1u))) ? 1u : 0u;
  // n quanta of 2^quantum_exp: in the first binade the code is n itself, and each binade above
  // adds 2^man_bits (a carry into the next binade lands on the right code too).
  uint32_t mag = (static_cast<uint32_t>(quantum_exp - (emin - f.man_bits)) << f.man_bits) + n;
  mag = (a >= f.max_f32 || mag > f.max_code) ? f.max_code : mag;
  const uint32_t nan_code = f.has_nan ? (sign_code | 0x7Fu) : 0u;
  return static_cast<uint8_t>(a > 0x7f800000u ? nan_code : (sign_code | mag));
}

DQ_HD uint8_t mx_encode_element(MxKind kind, float scaled_value) {
  return mx_encode_element(mx_format(kind), scaled_value);
}

// Decodes an element code (bits above the element width are ignored).
DQ_HD float mx_decode_element(MxKind kind, uint8_t code) {
  const MxFormat f = mx_format(kind);
  const int mag_bits = f.exp_bits + f.man_bits;
  const uint32_t mag = code & ((1u << mag_bits) - 1u);
  const uint32_t sign = (static_cast<uint32_t>(code) >> mag_bits) & 1u;
  if (f.has_nan && mag == 0x7Fu) return f32_from_bits((sign << 31) | 0x7fc00000u);
  const int e = static_cast<int>(mag >> f.man_bits);
  const uint32_t m = mag & ((1u << f.man_bits) - 1u);
  const uint32_t significand = e == 0 ? m : (m | (1u << f.man_bits));
  const int exponent = (e == 0 ? 1 : e) - f.bias - f.man_bits;
  const float v = static_cast<float>(significand) * mx_pow2(exponent);  // exact
  return f32_from_bits(f32_bits(v) | (sign << 31));
}

constexpr uint8_t kMxScaleNaN = 0xFF;

// E8M0 scale byte of a block from the largest magnitude's FP32 bits (sign cleared):
// 2^(floor(log2 amax) - emax) with the exponent clamped to [-127, 127]; NaN (0xFF) when the
// block holds a NaN or Inf; 2^-127 (0x00) for an all-zero block.
DQ_HD uint8_t mx_scale_byte(MxKind kind, uint32_t amax_bits) {
  if (amax_bits >= 0x7f800000u) return kMxScaleNaN;
  if (amax_bits == 0) return 0;
  int e = mx_floor_log2(amax_bits) - mx_format(kind).emax;
  if (e < -127) e = -127;
  if (e > 127) e = 127;
  return static_cast<uint8_t>(e + 127);
}

// Decoded E8M0 scale (NaN for 0xFF).
DQ_HD float mx_scale_value(uint8_t scale_byte) {
  if (scale_byte == kMxScaleNaN) return f32_from_bits(0x7fc00000u);
  return mx_pow2(static_cast<int>(scale_byte) - 127);
}

// 1 / scale, exact (a power of two in [2^-127, 2^127]); only for finite scales.
DQ_HD float mx_inverse_scale(uint8_t scale_byte) {
  return mx_pow2(127 - static_cast<int>(scale_byte));
}

}  // namespace dq
