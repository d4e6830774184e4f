// Back-off after a plan could not be made (an allocation failed on some rank, agreed on every
// rank, so every rank keeps the same state).
//
// Backoff: one count. After a failure the next 1, 2, 4 .. 64 tries are skipped, doubling at each
// further failure, so that a plan that always fails costs a pass-through now and then, while one
// that failed once is tried again at the next try but one. A plan made starts it again from 1.
// The engine keeps one for each call shape whose plan at the default budget failed
// (Engine::plan_for).
//
// RungBackoff: DYNAMIQ_BITS=auto's rungs of a bucket, a Backoff each, so that the predictions
// that choose a rung whose plan failed take the bucket's default instead (two such rungs that a
// prediction alternates between keep their own counts and so skip no less).
#pragma once

#include <algorithm>
#include <cstdint>

namespace dq::engine {

class Backoff {
 public:
  static constexpr uint32_t kMostSkipped = 64;  // tries

  // The plan could not be made.
  void failed() {
    next_ = next_ == 0 ? 1 : std::min(2 * next_, kMostSkipped);
    skip_ = next_;
  }
  // A plan was made: its next failure is avoided as the first.
  void made() { next_ = 0; }
  // A try: whether it is taken (false: skipped, one skip spent).
  bool take() {
    if (skip_ == 0) return true;
    --skip_;
    return false;
  }
  uint32_t skips_left() const { return skip_; }

 private:
  uint32_t skip_ = 0;  // tries still to skip
  uint32_t next_ = 0;  // the skips the last failure set; 0: none since a plan was made
};

template <int kRungs>
class RungBackoff {
 public:
  // The plan of `rung` could not be made.
  void failed(int rung) {
    if (valid(rung)) rungs_[rung].failed();
  }
  // A plan of `rung` was made: its next failure is avoided as the first.
  void made(int rung) {
    if (valid(rung)) rungs_[rung].made();
  }
  // A prediction chose `rung`: whether it is taken (false: the default instead, one skip spent).
  bool take(int rung) { return !valid(rung) || rungs_[rung].take(); }

 private:
  static bool valid(int rung) { return rung >= 0 && rung < kRungs; }
  Backoff rungs_[kRungs];
};

}  // namespace dq::engine
