// Inputs the simulator tests share: a synthetic gradient matrix with a pointer per worker row,
// and a schedule that must build.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "tools/sim/gradients.h"
#include "topo/schedule.h"

namespace dq::sim::test_data {

struct Data {
  Matrix m;
  std::vector<const float*> rows;  // rows[r]: worker r's gradient
};

// n workers of `cols` values each; `shared` as SyntheticSpec's (0: independent deviations).
inline Data synthetic(int n, size_t cols, double spread = 1.0, uint64_t seed = 7,
                      double shared = SyntheticSpec{}.shared) {
  Data d;
  SyntheticSpec spec;
  spec.rows = static_cast<size_t>(n);
  spec.cols = cols;
  spec.spread = spread;
  spec.shared = shared;
  spec.seed = seed;
  make_synthetic(spec, &d.m);
  for (int r = 0; r < n; ++r) d.rows.push_back(d.m.row(r));
  return d;
}

inline topo::Schedule schedule(topo::Kind kind, int n) {
  topo::Schedule s;
  EXPECT_EQ(topo::make_schedule(kind, n, &s), Status::kOk);
  return s;
}

}  // namespace dq::sim::test_data
