// DYNAMIQ_BITS=auto: which of a bucket's rungs to avoid for a while after their plan could not be
// made (an allocation failed on some rank, agreed on every rank, so every rank keeps the same
// state). Each rung has its own count: the predictions that choose a rung whose plan failed take
// the bucket's default instead for the next 1, 2, 4 .. 64 of them, doubling at each failure of
// that rung, so that a plan that always fails costs a pass-through now and then (two such rungs
// that a prediction alternates between no less), while one that failed once is tried again at
// the next prediction but one. A rung whose plan is then made starts again from 1.
#pragma once

#include <algorithm>
#include <cstdint>

namespace dq::engine {

template <int kRungs>
class RungBackoff {
 public:
  static constexpr uint32_t kMostSkipped = 64;  // predictions

  // The plan of `rung` could not be made.
  void failed(int rung) {
    if (!valid(rung)) return;
    uint32_t& next = next_[rung];
    next = next == 0 ? 1 : std::min(2 * next, kMostSkipped);
    skip_[rung] = next;
  }
  // A plan of `rung` was made: its next failure is avoided as the first.
  void made(int rung) {
    if (valid(rung)) next_[rung] = 0;
  }
  // A prediction chose `rung`: whether it is taken (false: the default instead, one skip spent).
  bool take(int rung) {
    if (!valid(rung) || skip_[rung] == 0) return true;
    --skip_[rung];
    return false;
  }

 private:
  static bool valid(int rung) { return rung >= 0 && rung < kRungs; }
  uint32_t skip_[kRungs] = {};  // predictions still to skip
  uint32_t next_[kRungs] = {};  // the skips its last failure set; 0: none since its plan was made
};

}  // namespace dq::engine
