// dq::sim::simulate_two_level_allreduce: the exact sum inside each node, the compressed
// all-reduce of each shard among the nodes, the exact all-gather. One node is exact, one rank
// per node is the flat all-reduce byte for byte, and the compressed stage has the error of a flat
// all-reduce over the nodes, not over the ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "tests/tools/sim_test_data.h"
#include "tools/sim/simulate.h"
#include "tools/sim/two_level.h"
#include "topo/schedule.h"

namespace dq::sim {
namespace {

using test_data::Data;
using test_data::schedule;

// Independent deviations: every rank adds its own error-bearing energy.
Data synthetic(int n, size_t cols, double spread = 1.0, uint64_t seed = 7) {
  return test_data::synthetic(n, cols, spread, seed, 0.0);
}

SimResult two_level(const Data& d, topo::Kind kind, int nodes, int local, const SimOptions& o,
                    std::vector<float>* out, const char* spec = "dynamiq:5") {
  SimResult r;
  EXPECT_EQ(simulate_two_level_allreduce(spec, schedule(kind, nodes), local, d.rows, d.m.cols, o,
                                         out, &r),
            Status::kOk);
  return r;
}

SimResult flat(const Data& d, topo::Kind kind, int n, const SimOptions& o, std::vector<float>* out,
               const char* spec = "dynamiq:5") {
  std::string error;
  const std::unique_ptr<Codec> codec = make_codec(spec, &error);
  SimResult r;
  EXPECT_EQ(simulate_allreduce(*codec, schedule(kind, n), d.rows, d.m.cols, o, out, &r),
            Status::kOk);
  return r;
}

// nodes x 1: the node sums are the ranks' rows and there is one shard: the flat all-reduce over
// the same schedule, every byte, for SUM and AVG, on both topologies and an odd node count.
TEST(SimTwoLevel, OneRankPerNodeIsTheFlatAllReduceByteForByte) {
  const Data d = synthetic(4, 50000);
  for (topo::Kind kind : {topo::Kind::kRing, topo::Kind::kButterfly})
    for (int nodes : {2, 3, 4})
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        SimOptions o;
        o.op = op;
        o.call = 3;
        std::vector<float> a, b;
        const SimResult ra = two_level(d, kind, nodes, 1, o, &a);
        const SimResult rb = flat(d, kind, nodes, o, &b);
        ASSERT_EQ(a.size(), b.size());
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
            << topo::kind_name(kind) << " nodes " << nodes;
        EXPECT_EQ(ra.vnmse, rb.vnmse);
        EXPECT_EQ(ra.bits_per_coord, rb.bits_per_coord);
        EXPECT_EQ(ra.wire_bits_per_coord, rb.wire_bits_per_coord);
        EXPECT_EQ(ra.intra_node_bits_per_coord, 0.0);
      }
}

// One node: nothing leaves it, nothing is compressed; every rank holds the FP32 sum of the ranks
// in local order (AVG: divided by the ranks).
TEST(SimTwoLevel, OneNodeIsTheExactSum) {
  const Data d = synthetic(4, 30000);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    SimOptions o;
    o.op = op;
    std::vector<float> out;
    const SimResult r = two_level(d, topo::Kind::kRing, 1, 4, o, &out);
    ASSERT_EQ(out.size(), d.m.cols);
    for (size_t k = 0; k < d.m.cols; ++k) {
      float s = d.rows[0][k];
      for (int w = 1; w < 4; ++w) s += d.rows[w][k];
      if (op == ReduceOp::kAvg) s /= 4.0f;
      ASSERT_EQ(out[k], s) << k;
    }
    EXPECT_LT(r.vnmse, 1e-12);
    EXPECT_EQ(r.bits_per_coord, 0.0);
    EXPECT_EQ(r.wire_bits_per_coord, 0.0);
    EXPECT_EQ(r.intra_node_bits_per_coord, 48.0);  // 2 x 32 x 3/4
  }
}

// The compressed stage runs over the nodes: nodes x 2 ranks has about the error of a flat
// all-reduce over `nodes` workers holding sums of two ranks, and less than the flat all-reduce
// over all the ranks. The hop profiles (budget_model.h) say by how much: a ring of 8 rounds the
// energy (8+1)/2 times on average, a ring of 4 (4+1)/2 times (0.56x); a butterfly of 8 20/8
// times, of 4 8/4 times (0.8x). Averaged over calls so that one rounding's luck does not decide.
TEST(SimTwoLevel, ErrorIsOfTheNodesNotOfTheRanks) {
  const int nodes = 4, local = 2, n = nodes * local;
  const Data d = synthetic(n, 1 << 17, 1.0, 11);
  // The same energy per worker, over `nodes` workers: rows summed in pairs.
  Matrix pairs;
  pairs.rows = nodes;
  pairs.cols = d.m.cols;
  pairs.data.assign(static_cast<size_t>(nodes) * d.m.cols, 0.0f);
  std::vector<const float*> pair_rows;
  for (int g = 0; g < nodes; ++g) {
    for (size_t k = 0; k < d.m.cols; ++k)
      pairs.data[g * d.m.cols + k] = d.rows[2 * g][k] + d.rows[2 * g + 1][k];
    pair_rows.push_back(pairs.row(g));
  }
  const Data over_nodes{pairs, pair_rows};
  for (topo::Kind kind : {topo::Kind::kRing, topo::Kind::kButterfly}) {
    double two = 0, ranks = 0, of_nodes = 0;
    for (uint64_t call = 0; call < 4; ++call) {
      SimOptions o;
      o.call = call;
      two += two_level(d, kind, nodes, local, o, nullptr).vnmse;
      ranks += flat(d, kind, n, o, nullptr).vnmse;
      of_nodes += flat(over_nodes, kind, nodes, o, nullptr).vnmse;
    }
    EXPECT_LT(two, (kind == topo::Kind::kRing ? 0.7 : 0.92) * ranks) << topo::kind_name(kind);
    EXPECT_GT(two / of_nodes, 0.8) << topo::kind_name(kind);
    EXPECT_LT(two / of_nodes, 1.25) << topo::kind_name(kind);
  }
}

// Bytes: each shard is one budget-exact copy; a rank sends its rail's share of its own shard
// between nodes (2 (N - 1) / N of the copy over L ranks, plus the statistics) and the FP32
// reduce-scatter and all-gather inside the node.
TEST(SimTwoLevel, BitsOnTheRailsAndInsideTheNode) {
  const Data d = synthetic(8, 1 << 17);
  const SimResult r = two_level(d, topo::Kind::kRing, 4, 2, SimOptions{}, nullptr);
  EXPECT_LE(r.bits_per_coord, 5.0);
  EXPECT_GT(r.bits_per_coord, 4.9);
  const double stats = 3 * 16 / 256.0;  // per coordinate of one copy
  // ring of 4 on each shard: 2 x 3/4 of the copy, statistics as a ring all-reduce too
  const double expect = 2 * 0.75 * (r.bits_per_coord - stats) / 2 + 2 * 0.75 * stats / 2;
  EXPECT_NEAR(r.wire_bits_per_coord, expect, 0.02);
  EXPECT_EQ(r.intra_node_bits_per_coord, 32.0);
  const SimResult f = flat(d, topo::Kind::kRing, 8, SimOptions{}, nullptr);
  EXPECT_LT(r.wire_bits_per_coord, f.wire_bits_per_coord / 2);
}

// Every shard's rounding keys name the element's index in the whole tensor: two shards holding
// the same values round them differently (a shard keyed from 0 would repeat shard 0's noise).
TEST(SimTwoLevel, ShardsAreKeyedByTheirPlaceInTheTensor) {
  const size_t half = two_level_shard_elems(2 * 40960, 2);
  ASSERT_EQ(half, 40960u);
  Data d = synthetic(4, 2 * half);
  for (size_t r = 0; r < 4; ++r)
    std::copy(d.m.data.begin() + r * d.m.cols, d.m.data.begin() + r * d.m.cols + half,
              d.m.data.begin() + r * d.m.cols + half);
  std::vector<float> out;
  two_level(d, topo::Kind::kRing, 2, 2, SimOptions{}, &out);
  EXPECT_NE(std::memcmp(out.data(), out.data() + half, half * sizeof(float)), 0);
  size_t same = 0;
  for (size_t k = 0; k < half; ++k) same += out[k] == out[half + k];
  EXPECT_LT(same, half / 2);  // stochastic rounding: most values differ
}

TEST(SimTwoLevel, ShardsCoverTheTensorInWholeSuperGroups) {
  EXPECT_EQ(two_level_shard_elems(1000, 1), 1024u);
  EXPECT_EQ(two_level_shard_elems(1000, 2), 512u);
  EXPECT_EQ(two_level_shard_elems(100000, 3), 33536u);  // ceil(33333.3 / 256) x 256
  // A tensor smaller than the shards: the later shards are empty, the result still complete.
  const Data d = synthetic(4, 300);
  std::vector<float> out;
  const SimResult r = two_level(d, topo::Kind::kRing, 2, 2, SimOptions{}, &out, "bf16");
  ASSERT_EQ(out.size(), 300u);
  EXPECT_LT(r.vnmse, 1e-4);
}

// Rail blocks: each its own codec and budget inside the shard; one block as large as the shard is
// the unblocked result, byte for byte; smaller blocks round other values, within the budget.
TEST(SimTwoLevel, RailBlocksCutEachShard) {
  const Data d = synthetic(4, 1 << 17);
  std::vector<float> whole, one, cut;
  two_level(d, topo::Kind::kRing, 2, 2, SimOptions{}, &whole);
  SimOptions o;
  o.block_elems = 1 << 16;  // the shard
  two_level(d, topo::Kind::kRing, 2, 2, o, &one);
  EXPECT_EQ(std::memcmp(whole.data(), one.data(), whole.size() * sizeof(float)), 0);
  o.block_elems = 1 << 14;
  const SimResult r = two_level(d, topo::Kind::kRing, 2, 2, o, &cut);
  EXPECT_NE(std::memcmp(whole.data(), cut.data(), whole.size() * sizeof(float)), 0);
  EXPECT_LE(r.bits_per_coord, 5.0);
  EXPECT_GT(r.vnmse, 0.0);
}

// Interleaved shards (a what-if): the same values and bits, another cut; with one rank per node
// there is one shard and nothing to interleave. Every value is decoded in its own place.
TEST(SimTwoLevel, InterleavedShardsKeepEveryValueInPlace) {
  const Data d = synthetic(4, 70000);  // 273 whole super-groups and a partial one
  SimOptions o;
  o.interleaved_shards = true;
  std::vector<float> flat_out, one, cut, contiguous;
  flat(d, topo::Kind::kRing, 4, SimOptions{}, &flat_out);
  two_level(d, topo::Kind::kRing, 4, 1, o, &one);
  EXPECT_EQ(std::memcmp(flat_out.data(), one.data(), one.size() * sizeof(float)), 0);
  const SimResult r = two_level(d, topo::Kind::kRing, 2, 2, o, &cut);
  const SimResult c = two_level(d, topo::Kind::kRing, 2, 2, SimOptions{}, &contiguous);
  EXPECT_NE(std::memcmp(cut.data(), contiguous.data(), cut.size() * sizeof(float)), 0);
  EXPECT_GT(r.vnmse / c.vnmse, 0.7);  // synthetic data: the shards look alike either way
  EXPECT_LT(r.vnmse / c.vnmse, 1.4);
  EXPECT_LE(r.bits_per_coord, 5.0);
}

TEST(SimTwoLevel, Refusals) {
  const Data d = synthetic(4, 4096);
  SimResult r;
  SimOptions per_hop;
  per_hop.per_hop = true;
  EXPECT_EQ(simulate_two_level_allreduce("dynamiq:5", schedule(topo::Kind::kRing, 2), 2, d.rows,
                                         d.m.cols, per_hop, nullptr, &r),
            Status::kInvalidArgument);
  // 3 nodes x 2 ranks from 4 rows
  EXPECT_EQ(simulate_two_level_allreduce("dynamiq:5", schedule(topo::Kind::kRing, 3), 2, d.rows,
                                         d.m.cols, SimOptions{}, nullptr, &r),
            Status::kInvalidArgument);
  EXPECT_EQ(simulate_two_level_allreduce("nonsense", schedule(topo::Kind::kRing, 2), 2, d.rows,
                                         d.m.cols, SimOptions{}, nullptr, &r),
            Status::kInvalidArgument);
}

}  // namespace
}  // namespace dq::sim
