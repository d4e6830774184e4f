// The back-off after failed plans (shim/engine/rung_backoff.h): which predictions of a bucket's
// rung take the default instead, per rung, a call shape's one count, and a made plan starting the
// count again.
#include "shim/engine/rung_backoff.h"

#include <gtest/gtest.h>

#include <string>

namespace dq::engine {
namespace {

// The next `n` predictions of `rung`: T taken, d the default instead.
template <int N>
std::string predictions(RungBackoff<N>& b, int rung, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += b.take(rung) ? 'T' : 'd';
  return out;
}

TEST(RungBackoff, EachFailureOfARungDoublesItsSkipsUpTo64) {
  RungBackoff<4> b;
  EXPECT_EQ(predictions(b, 2, 3), "TTT");  // never failed
  b.failed(2);
  EXPECT_EQ(predictions(b, 2, 3), "dTT");
  b.failed(2);
  EXPECT_EQ(predictions(b, 2, 4), "ddTT");
  for (int i = 0; i < 10; ++i) b.failed(2);
  EXPECT_EQ(predictions(b, 2, 66), std::string(64, 'd') + "TT");
  EXPECT_EQ(predictions(b, 1, 2), "TT");  // another rung is not affected
}

// A prediction that alternates between two rungs whose plans always fail: each has its own count,
// so the skips still grow (one shared count, reset whenever the other rung failed, stayed at 1:
// a pass-through every other call).
TEST(RungBackoff, TwoFailingRungsKeepTheirOwnCounts) {
  RungBackoff<4> b;
  std::string tries;
  for (int prediction = 0; prediction < 64; ++prediction) {
    const int rung = prediction % 2 == 0 ? 1 : 3;
    if (b.take(rung)) {
      tries += static_cast<char>('0' + rung);
      b.failed(rung);  // its plan fails whenever it is tried
    }
  }
  // Rung 1 tried at predictions 0, 4, 10, 20, 38 (skipping 1, 2, 4, 8 of its own); rung 3 alike.
  EXPECT_EQ(tries, "1313131313") << tries;
}

TEST(RungBackoff, AMadePlanStartsTheCountAgain) {
  RungBackoff<4> b;
  for (int i = 0; i < 5; ++i) b.failed(0);
  EXPECT_EQ(predictions(b, 0, 17), std::string(16, 'd') + "T");
  b.made(0);
  b.failed(0);  // evicted later, and failing again: as a first failure
  EXPECT_EQ(predictions(b, 0, 2), "dT");
}

TEST(RungBackoff, NoRungIsAlwaysTaken) {
  RungBackoff<4> b;
  b.failed(-1);  // the default's plan: nothing to avoid
  b.failed(4);   // out of range: ignored
  EXPECT_TRUE(b.take(-1));
  EXPECT_TRUE(b.take(4));
}

// One count alone, as the engine keeps for a call shape whose default plan failed: the skips it
// reports, which the warning names, and a made plan starting again.
TEST(Backoff, OneCountDoublesReportsItsSkipsAndStartsAgain) {
  Backoff b;
  std::string tries;
  for (int i = 0; i < 12; ++i) tries += b.take() ? 'T' : 'd';
  EXPECT_EQ(tries, std::string(12, 'T'));
  b.failed();
  EXPECT_EQ(b.skips_left(), 1u);
  b.failed();
  EXPECT_EQ(b.skips_left(), 2u);
  EXPECT_FALSE(b.take());
  EXPECT_EQ(b.skips_left(), 1u);
  EXPECT_FALSE(b.take());
  EXPECT_TRUE(b.take());
  b.made();
  b.failed();
  EXPECT_EQ(b.skips_left(), 1u);
}

}  // namespace
}  // namespace dq::engine
