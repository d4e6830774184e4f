// LSB-first bit packing of small unsigned codes (1..8 bits), shared by host and device.
// Code i of width w occupies bits [i*w, (i+1)*w) of the little-endian byte stream.
#pragma once
#include <cstdint>

#include "kernels/hd.h"

namespace dq {

// Packs n codes of `bits` width into out (ceil(n*bits/8) bytes, all written).
DQ_HD void pack_codes(const uint8_t* codes, int n, int bits, uint8_t* out) {
  uint32_t acc = 0;
  int filled = 0, o = 0;
  for (int i = 0; i < n; ++i) {
    acc |= static_cast<uint32_t>(codes[i]) << filled;
    filled += bits;
    while (filled >= 8) {
      out[o++] = static_cast<uint8_t>(acc);
      acc >>= 8;
      filled -= 8;
    }
  }
  if (filled > 0) out[o] = static_cast<uint8_t>(acc);
}

// Reads code i of width `bits` from a packed stream.
DQ_HD uint32_t unpack_code(const uint8_t* in, int i, int bits) {
  uint32_t bit = static_cast<uint32_t>(i) * bits;
  uint32_t byte = bit >> 3, shift = bit & 7;
  uint32_t word = in[byte];
  if (shift + bits > 8) word |= static_cast<uint32_t>(in[byte + 1]) << 8;
  return (word >> shift) & ((1u << bits) - 1u);
}

}  // namespace dq
