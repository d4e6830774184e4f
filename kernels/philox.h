// Philox4x32-10 (Salmon et al., SC'11): a counter-based generator, so any rank and the GPU can
// regenerate the random bits of any (seed, call, hop, element) without state.
#pragma once
#include <cstdint>

#include "kernels/hd.h"

#if defined(__AVX2__) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

namespace dq {

struct Philox4 {
  uint32_t v[4];
};

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
#else
#pragma GCC unroll 10
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kMul0, c0, &hi0, &lo0);
    philox_mulhilo(kMul1, c2, &hi1, &lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
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
DQ_HD float uniform24(uint32_t word) { return static_cast<float>(word >> 8) * 0x1p-24f; }

#if defined(__AVX2__) && !defined(__CUDACC__)
// Host only: eight Philox4x32-10 blocks at once with AVX2, counters {c0 + lane, c1, c2, c3}.
// Lane i of out[w] is word w of philox4x32_10(c0 + i, c1, c2, c3, k0, k1), bit for bit (test
// Philox.EightLanesMatchScalar); the device keeps the scalar function, one block per thread.
struct Philox4x8 {
  __m256i v[4];
};

// Sixteen blocks as two interleaved sets of eight (out[0]: c0 + 0..7, out[1]: c0 + 8..15): two
// independent dependency chains keep the multipliers busy where one chain waits on latency.
inline void philox4x32_10_x16(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                              uint32_t k1, Philox4x8 out[2]) {
  const __m256i mul0 = _mm256_set1_epi64x(0xD2511F53u), mul1 = _mm256_set1_epi64x(0xCD9E8D57u);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i x0[2], x1[2], x2[2], x3[2];
  for (int s = 0; s < 2; ++s) {
    x0[s] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(c0 + 8u * s)), lane);
    x1[s] = _mm256_set1_epi32(static_cast<int>(c1));
    x2[s] = _mm256_set1_epi32(static_cast<int>(c2));
    x3[s] = _mm256_set1_epi32(static_cast<int>(c3));
  }
  for (int round = 0; round < 10; ++round) {
    const __m256i key0 = _mm256_set1_epi32(static_cast<int>(k0));
    const __m256i key1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int s = 0; s < 2; ++s) {
      // 32x32 -> 64-bit products of the even lanes, then of the odd lanes (moved down).
      const __m256i even0 = _mm256_mul_epu32(x0[s], mul0);
      const __m256i odd0 = _mm256_mul_epu32(_mm256_srli_epi64(x0[s], 32), mul0);
      const __m256i even1 = _mm256_mul_epu32(x2[s], mul1);
      const __m256i odd1 = _mm256_mul_epu32(_mm256_srli_epi64(x2[s], 32), mul1);
      const __m256i lo0 = _mm256_blend_epi32(even0, _mm256_slli_epi64(odd0, 32), 0xAA);
      const __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(even0, 32), odd0, 0xAA);
      const __m256i lo1 = _mm256_blend_epi32(even1, _mm256_slli_epi64(odd1, 32), 0xAA);
      const __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(even1, 32), odd1, 0xAA);
      x0[s] = _mm256_xor_si256(_mm256_xor_si256(hi1, x1[s]), key0);
      x1[s] = lo1;
      x2[s] = _mm256_xor_si256(_mm256_xor_si256(hi0, x3[s]), key1);
      x3[s] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int s = 0; s < 2; ++s) out[s] = Philox4x8{{x0[s], x1[s], x2[s], x3[s]}};
}

inline Philox4x8 philox4x32_10_x8(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                  uint32_t k0, uint32_t k1) {
  const __m256i mul0 = _mm256_set1_epi64x(0xD2511F53u), mul1 = _mm256_set1_epi64x(0xCD9E8D57u);
  __m256i x0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(c0)),
                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i x1 = _mm256_set1_epi32(static_cast<int>(c1));
  __m256i x2 = _mm256_set1_epi32(static_cast<int>(c2));
  __m256i x3 = _mm256_set1_epi32(static_cast<int>(c3));
  for (int round = 0; round < 10; ++round) {
    const __m256i even0 = _mm256_mul_epu32(x0, mul0);
    const __m256i odd0 = _mm256_mul_epu32(_mm256_srli_epi64(x0, 32), mul0);
    const __m256i even1 = _mm256_mul_epu32(x2, mul1);
    const __m256i odd1 = _mm256_mul_epu32(_mm256_srli_epi64(x2, 32), mul1);
    const __m256i lo0 = _mm256_blend_epi32(even0, _mm256_slli_epi64(odd0, 32), 0xAA);
    const __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(even0, 32), odd0, 0xAA);
    const __m256i lo1 = _mm256_blend_epi32(even1, _mm256_slli_epi64(odd1, 32), 0xAA);
    const __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(even1, 32), odd1, 0xAA);
    x0 = _mm256_xor_si256(_mm256_xor_si256(hi1, x1), _mm256_set1_epi32(static_cast<int>(k0)));
    x1 = lo1;
    x2 = _mm256_xor_si256(_mm256_xor_si256(hi0, x3), _mm256_set1_epi32(static_cast<int>(k1)));
    x3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4x8{{x0, x1, x2, x3}};
}

// philox_draw() for blocks block .. block + 7.
inline Philox4x8 philox_draw_x8(uint64_t seed, uint64_t call, uint32_t hop, uint32_t stream,
                                uint32_t block) {
  return philox4x32_10_x8(block, (hop & 0x00ffffffu) | (stream << 24),
                          static_cast<uint32_t>(call), static_cast<uint32_t>(call >> 32),
                          static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// philox_draw() for blocks block .. block + 15 (out[0]: the first eight).
inline void philox_draw_x16(uint64_t seed, uint64_t call, uint32_t hop, uint32_t stream,
                            uint32_t block, Philox4x8 out[2]) {
  philox4x32_10_x16(block, (hop & 0x00ffffffu) | (stream << 24), static_cast<uint32_t>(call),
                    static_cast<uint32_t>(call >> 32), static_cast<uint32_t>(seed),
                    static_cast<uint32_t>(seed >> 32), out);
}
#endif

}  // namespace dq
