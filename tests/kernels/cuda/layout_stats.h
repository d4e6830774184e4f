// What the layout kernels' tests against the host share (grid_kernels_test.cc,
// layout_batch_test.cc): reduced statistics, BF16 words as the statistics all-reduce leaves them,
// and the byte comparison of two layouts.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/dynamiq_layout.h"

namespace dq::cuda::test {

// Summed all-zero count words (kernels/dynamiq_layout.h) of super-groups whose counts are
// `counts`, appended to `out`; now and then (about 1 word in 16) a bad one, as a peer's bad word
// would be: NaN, negative, above n where one count is a word, and where several share it not an
// integer or above 8 bits; where the counts are bytes, a byte above n.
inline void append_count_words(const std::vector<unsigned>& counts, int n_workers,
                               std::mt19937* rng, std::vector<uint16_t>* out) {
  const int per = zero_counts_per_word(n_workers), bits = zero_count_bits(n_workers);
  for (size_t first = 0; first < counts.size(); first += static_cast<size_t>(per)) {
    unsigned value = 0;
    for (int i = 0; i < per && first + i < counts.size(); ++i)
      value += counts[first + i] << (bits * i);
    const uint32_t pick = (*rng)() % 64;
    if (zero_counts_are_bytes(n_workers)) {
      if (pick < 4) value |= pick < 2 ? 0xffu : 0xff00u;  // a byte above n, in either lane
      out->push_back(static_cast<uint16_t>(value));
      continue;
    }
    const float word = pick == 0   ? std::nanf("")
                       : pick == 1 ? -1.0f
                       : pick == 2 ? (per == 1 ? static_cast<float>(n_workers + 3) : 300.0f)
                       : pick == 3 && per > 1 ? static_cast<float>(value) + 0.5f
                                              : static_cast<float>(value);
    out->push_back(f32_to_bf16_rne(word));
  }
}

// Reduced statistics of n_sg super-groups: scales over `decades` orders of magnitude, some all
// zero, some poisoned (an Inf or NaN energy) where `poison`, zero counts now and then out of range.
inline std::vector<uint16_t> make_stats(size_t n_sg, int n_workers, double decades, bool poison,
                                        uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<uint16_t> out;
  std::vector<unsigned> counts(n_sg);
  for (size_t j = 0; j < n_sg; ++j) {
    const double scale = std::pow(10.0, decades * normal(rng) / 2.0);
    const bool zero = rng() % 16 == 0;
    const double mean = zero ? 0.0 : scale * normal(rng);
    double energy = zero ? 0.0 : 256.0 * n_workers * scale * scale * (1.0 + 0.1 * normal(rng));
    out.push_back(f32_to_bf16_rne(static_cast<float>(mean)));
    uint16_t e = f32_to_bf16_rne(static_cast<float>(std::fabs(energy)));
    if (poison && rng() % 97 == 0) e = rng() % 2 ? 0x7fc0 : 0x7f80;
    out.push_back(e);
    counts[j] = zero ? 0u : static_cast<unsigned>(rng() % static_cast<unsigned>(n_workers));
  }
  append_count_words(counts, n_workers, &rng, &out);
  return out;
}

// The first byte at which two layouts (8-byte words) differ, or -1.
inline long first_difference(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b) {
  const auto* x = reinterpret_cast<const unsigned char*>(a.data());
  const auto* y = reinterpret_cast<const unsigned char*>(b.data());
  for (size_t i = 0; i < a.size() * 8; ++i)
    if (x[i] != y[i]) return static_cast<long>(i);
  return -1;
}

}  // namespace dq::cuda::test
