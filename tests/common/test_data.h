// Reproducible test data shared by the soak and the fault campaign's worker: every rank draws
// the same sequence from the same seed, and sums of the values are exact in FP32 and BF16.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/bf16.h"

namespace dq::test {

// splitmix64's output function: a well-mixed 64-bit value from any 64-bit input.
inline uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// What rank r contributes at element i of the call keyed `key`: an integer in -30..30,
// bell-shaped (a sum of four nibbles), so every sum and average over a few ranks is exact.
inline int bell_value(uint64_t key, int r, size_t i) {
  const uint64_t h = splitmix(key ^ (static_cast<uint64_t>(r) << 56) ^ i);
  return static_cast<int>((h & 15) + ((h >> 4) & 15) + ((h >> 8) & 15) + ((h >> 12) & 15)) - 30;
}

// The exact reduction over ranks 0..n-1 of bell_value(key, r, i): their maximum when `max`,
// else their sum (exact in double, FP32 and BF16 for a few ranks).
inline double bell_reduced(uint64_t key, int n, size_t i, bool max) {
  double want = max ? -1e9 : 0;
  for (int r = 0; r < n; ++r) {
    const int v = bell_value(key, r, i);
    want = max ? std::max(want, static_cast<double>(v)) : want + v;
  }
  return want;
}

// The same sequence on every rank that starts from the same state.
struct Rng {
  uint64_t s;
  uint64_t next() { return s = splitmix(s); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
  size_t between(size_t lo, size_t hi) { return lo + next() % (hi - lo + 1); }  // inclusive
};

// Element i of a buffer of FP32 or BF16 values (bf16), as float; and stored from a float (BF16
// rounds to nearest even).
inline float load_element(const void* data, size_t i, bool bf16) {
  const auto* p = static_cast<const unsigned char*>(data);
  if (bf16) {
    uint16_t b;
    std::memcpy(&b, p + i * 2, 2);
    return bf16_to_f32(b);
  }
  float f;
  std::memcpy(&f, p + i * 4, 4);
  return f;
}
inline void store_element(void* data, size_t i, bool bf16, float v) {
  auto* p = static_cast<unsigned char*>(data);
  if (bf16) {
    const uint16_t b = f32_to_bf16_rne(v);
    std::memcpy(p + i * 2, &b, 2);
  } else {
    std::memcpy(p + i * 4, &v, 4);
  }
}

}  // namespace dq::test
