// SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mix, for deriving
// well-spread values (sample offsets, tags, test data) from counters and seeds. Not for secrets.
#pragma once

#include <cstdint>

namespace dq {

constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace dq
