// Philox4x32-10 (Salmon et al., SC'11): a counter-based generator, so any rank and the GPU can
// regenerate the random bits of any (seed, call, hop, element) without state.
#pragma once
#include <cstdint>

#include "kernels/hd.h"

namespace dq {

struct Philox4 {
  uint32_t v[4];
};

// Word i & 3 of a draw, chosen by selects: indexing v by a runtime word makes nvcc place the draw
// in local memory (a stack frame, and a store and a load per draw in the fused hop).
DQ_HD uint32_t philox_word(const Philox4& w, uint32_t i) {
  i &= 3;
  return i == 0 ? w.v[0] : i == 1 ? w.v[1] : i == 2 ? w.v[2] : w.v[3];
}

DQ_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Counter (c0..c3) and 64-bit key (k0,k1). Constants from the Philox specification.
DQ_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                            uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#elif !defined(__CUDACC__)  // nvcc's host pass does not know GCC pragmas
#pragma GCC unroll 10
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kMul0, c0, &hi0, &lo0);
    philox_mulhilo(kMul1, c2, &hi1, &lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Stream tags keep independent draws of the same call apart (counter word 1, high 8 bits).
enum : uint32_t {
  kStreamRounding = 1u,     // per-element 16-bit uniforms for stochastic rounding
  kStreamPermutation = 2u,  // per-group shift of the shared permutation (correlated rounding)
  kStreamScale = 3u,        // reserved
  kStreamRoundingTie = 4u,  // further uniform bits where 16 bits leave a rounding undecided
};

// Four 32-bit words for counter block `block` of `stream`, keyed by (seed, call, hop).
// Counter layout: c0 = block, c1 = hop | stream << 24, c2 = call low, c3 = call high.
DQ_HD Philox4 philox_draw(uint64_t seed, uint64_t call, uint32_t hop, uint32_t stream,
                          uint32_t block) {
  return philox4x32_10(block, (hop & 0x00ffffffu) | (stream << 24), static_cast<uint32_t>(call),
                       static_cast<uint32_t>(call >> 32), static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32));
}

// A uniform float in [0, 1) from the top 24 bits of a word (exact in FP32).
DQ_HD float uniform24(uint32_t word) {
  return static_cast<float>(word >> 8) * 0x1p-24f;
}

// The host's eight-lane AVX2 form of philox_draw(): kernels/dynamiq_avx2.h.

}  // namespace dq
