// SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mix, for deriving
// well-spread values (sample offsets, tags, test data) from counters and seeds. Not for secrets.
#pragma once

#include <cstdint>

namespace dq {

// The generator's step (2^64 / golden ratio) and its finaliser alone, for a caller that keeps
// the state itself: splitmix64(x) == splitmix64_finalise(x + kSplitMix64Step).
constexpr uint64_t kSplitMix64Step = 0x9E3779B97F4A7C15ull;
constexpr uint64_t splitmix64_finalise(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr uint64_t splitmix64(uint64_t x) {
  return splitmix64_finalise(x + kSplitMix64Step);
}

}  // namespace dq
