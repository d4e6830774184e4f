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

namespace dq::cuda::test {

// Reduced statistics of n_sg super-groups: scales over `decades` orders of magnitude, some all
// zero, some poisoned (an Inf or NaN energy) where `poison`, zero counts now and then out of range.
inline std::vector<uint16_t> make_stats(size_t n_sg, int n_workers, double decades, bool poison,
                                        uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<uint16_t> out;
  for (size_t j = 0; j < n_sg; ++j) {
    const double scale = std::pow(10.0, decades * normal(rng) / 2.0);
    const bool zero = rng() % 16 == 0;
    const double mean = zero ? 0.0 : scale * normal(rng);
    double energy = zero ? 0.0 : 256.0 * n_workers * scale * scale * (1.0 + 0.1 * normal(rng));
    out.push_back(f32_to_bf16_rne(static_cast<float>(mean)));
    uint16_t e = f32_to_bf16_rne(static_cast<float>(std::fabs(energy)));
    if (poison && rng() % 97 == 0) e = rng() % 2 ? 0x7fc0 : 0x7f80;
    out.push_back(e);
    const uint32_t pick = rng() % 64;
    const float count = zero        ? 0.0f
                        : pick == 0 ? static_cast<float>(n_workers + 3)
                                    : static_cast<float>(rng() % n_workers);
    out.push_back(f32_to_bf16_rne(count));
  }
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
