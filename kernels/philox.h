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
#elif !defined(__CUDACC__)  // nvcc's host pass does not know GCC pragmas
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

inline Philox4x8 philox4x32_10_x8(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                  uint32_t k0, uint32_t k1) {
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
  auto merge = [](__m256i a, __m256i b) {
    return _mm256_castps_si256(
        _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), _MM_SHUFFLE(2, 0, 2, 0)));
  };
  return Philox4x8{{merge(x0[0], x0[1]), merge(x1[0], x1[1]), merge(x2[0], x2[1]),
                    merge(x3[0], x3[1])}};
}

// philox_draw() for blocks block .. block + 7.
inline Philox4x8 philox_draw_x8(uint64_t seed, uint64_t call, uint32_t hop, uint32_t stream,
                                uint32_t block) {
  return philox4x32_10_x8(block, (hop & 0x00ffffffu) | (stream << 24),
                          static_cast<uint32_t>(call), static_cast<uint32_t>(call >> 32),
                          static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

#endif

}  // namespace dq
