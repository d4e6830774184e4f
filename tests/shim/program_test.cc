// Each rank's compiled program (shim/engine/program.cc), checked across all ranks at once.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <vector>

#include "shim/engine/program.h"

namespace dq::engine {
namespace {

// Correlated rounding lives in the keys the program gives each hop: on a butterfly the roundings
// of equal height in a chunk's tree (which never feed one another) share a stratum class, and
// their positions cover 0 .. size-1 exactly once; on a ring every rounding is plain.
void expect_strata(topo::Kind kind, int n) {
  std::vector<Program> programs(n);
  for (int me = 0; me < n; ++me)
    ASSERT_EQ(compile_program(kind, n, me, 24301, Collective::kAllReduce, 0, &programs[me]),
              Status::kOk);
  const int n_chunks = programs[0].schedule.n_chunks;
  int stratified = 0;
  for (int c = 0; c < n_chunks; ++c) {
    std::map<uint32_t, std::vector<RoundingKey>> by_class;  // stratum_class -> keys
    for (int me = 0; me < n; ++me)
      for (const Program::Stage& st : programs[me].stages)
        for (const Program::HopJob& h : st.hops)
          if (h.chunk == c) {
            EXPECT_EQ(h.key.rank, static_cast<uint32_t>(me));
            EXPECT_EQ(h.key.seed, 24301u);
            by_class[h.key.stratum_class].push_back(h.key);
          }
    int hops = 0;
    for (auto& [klass, keys] : by_class) {
      hops += static_cast<int>(keys.size());
      std::set<uint32_t> positions;
      for (const RoundingKey& k : keys) {
        EXPECT_EQ(k.strata, keys.size()) << "chunk " << c << " class " << klass;
        positions.insert(k.stratum);
      }
      EXPECT_EQ(positions.size(), keys.size()) << "chunk " << c << " class " << klass;
      EXPECT_EQ(*positions.rbegin(), keys.size() - 1);
      if (keys.size() > 1) stratified += static_cast<int>(keys.size());
      if (kind == topo::Kind::kRing) {
        EXPECT_EQ(keys.size(), 1u);
      }
    }
    EXPECT_EQ(hops, n) << "every worker compresses chunk " << c << " once";
  }
  // A butterfly of 4 or more stratifies: its leaves (height 0) are n/2 per chunk at least.
  if (kind == topo::Kind::kButterfly) {
    EXPECT_GE(stratified, n_chunks * n / 2);
  }
}

TEST(Program, HopKeysStratifyEqualHeightRoundingsOnTheButterfly) {
  for (int n : {4, 8, 16}) expect_strata(topo::Kind::kButterfly, n);
}
TEST(Program, HopKeysArePlainOnTheRing) {
  for (int n : {2, 3, 4, 8}) expect_strata(topo::Kind::kRing, n);
}

TEST(Program, ReduceScatterDecodesTheRanksOwnChunkAndReduceOnlyAtTheRoot) {
  for (int n : {2, 3, 4, 8}) {
    for (int me = 0; me < n; ++me) {
      Program rs, reduce;
      ASSERT_EQ(compile_program(topo::Kind::kRing, n, me, 1, Collective::kReduceScatter, 0, &rs),
                Status::kOk);
      ASSERT_EQ(rs.finish_chunks.size(), 1u);
      EXPECT_EQ(rs.schedule.sink_worker[rs.finish_chunks[0]], me);
      for (const Program::Stage& st : rs.stages)
        EXPECT_NE(st.kind, Program::StageKind::kGather) << "a reduce-scatter gathers nothing";
      ASSERT_EQ(compile_program(topo::Kind::kRing, n, me, 1, Collective::kReduce, n - 1, &reduce),
                Status::kOk);
      EXPECT_EQ(reduce.finish_chunks.size(), me == n - 1 ? static_cast<size_t>(n) : 0u);
    }
  }
  // A butterfly of 3 ends no chunk at its extra rank: no reduce-scatter on it.
  Program p;
  EXPECT_EQ(compile_program(topo::Kind::kButterfly, 3, 0, 1, Collective::kReduceScatter, 0, &p),
            Status::kInvalidArgument);
}

}  // namespace
}  // namespace dq::engine
