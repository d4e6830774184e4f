// The statistics all-reduce of several workers on the host (the simulator, the engine's canary,
// tests): what NCCL computes for the engine, with one rounding. Each BF16 word is summed in FP32
// and rounded once at the end; the byte-summed words (Codec::stats_byte_sum_words(), DynamiQ's
// all-zero counts from 16 to 255 workers) are summed lane by lane modulo 256, as ncclUint8.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/dynamiq_layout.h"

namespace dq {

class StatsSum {
 public:
  // `words` statistics words a worker, the last `byte_sum_words` of them byte-summed.
  StatsSum(size_t words, size_t byte_sum_words)
      : float_words_(byte_sum_words <= words ? words - byte_sum_words : 0),
        sum_(float_words_, 0.0f),
        bytes_(words - float_words_, 0) {}
  void add(const uint16_t* worker_words) {
    for (size_t i = 0; i < float_words_; ++i) sum_[i] += bf16_to_f32(worker_words[i]);
    for (size_t i = 0; i < bytes_.size(); ++i)
      bytes_[i] = byte_lanes_sum(bytes_[i], worker_words[float_words_ + i]);
  }
  // The reduced words: BF16 words rounded to nearest even, or (`saturate`) a finite sum never
  // rounded to infinity, as the engine's canary and the kernels' tests round.
  void result(uint16_t* out, bool saturate) const {
    for (size_t i = 0; i < float_words_; ++i)
      out[i] = saturate ? f32_to_bf16_sat(sum_[i]) : f32_to_bf16_rne(sum_[i]);
    for (size_t i = 0; i < bytes_.size(); ++i) out[float_words_ + i] = bytes_[i];
  }

 private:
  size_t float_words_;
  std::vector<float> sum_;
  std::vector<uint16_t> bytes_;
};

}  // namespace dq
