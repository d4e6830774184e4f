// The node map the two-level schedule is derived from: every rank's view, the fallbacks.
#include "topo/node_map.h"

#include <gtest/gtest.h>

namespace {

using dq::topo::make_node_map;
using dq::topo::NodeMap;

std::vector<uint64_t> hashes_of(const std::vector<int>& node_of_rank) {
  std::vector<uint64_t> h;
  for (int k : node_of_rank) h.push_back(0x9e3779b97f4a7c15ull * static_cast<uint64_t>(k + 1));
  return h;
}

TEST(NodeMap, UniformConsecutiveNodes) {
  const auto h = hashes_of({0, 0, 0, 1, 1, 1});  // 2 x 3
  for (int r = 0; r < 6; ++r) {
    const NodeMap m = make_node_map(h, r);
    ASSERT_TRUE(m.uniform) << m.why;
    EXPECT_EQ(m.nodes, 2);
    EXPECT_EQ(m.local_size, 3);
    EXPECT_EQ(m.node, r / 3);
    EXPECT_EQ(m.local_rank, r % 3);
  }
}

TEST(NodeMap, NodesNumberedByTheirFirstRank) {
  // Hash values in any order: the node holding rank 0 is node 0.
  const std::vector<uint64_t> h = {50, 50, 7, 7, 99, 99};
  const NodeMap m = make_node_map(h, 4);
  ASSERT_TRUE(m.uniform);
  EXPECT_EQ(m.nodes, 3);
  EXPECT_EQ(m.node, 2);
  EXPECT_EQ(m.local_rank, 0);
}

TEST(NodeMap, OneNodeAndOneRankPerNode) {
  const NodeMap one = make_node_map(hashes_of({0, 0, 0, 0}), 1);
  EXPECT_TRUE(one.uniform);
  EXPECT_EQ(one.nodes, 1);
  EXPECT_EQ(one.local_size, 4);
  const NodeMap each = make_node_map(hashes_of({0, 1, 2, 3}), 2);
  EXPECT_TRUE(each.uniform);
  EXPECT_EQ(each.nodes, 4);
  EXPECT_EQ(each.local_size, 1);
  EXPECT_EQ(each.node, 2);
}

TEST(NodeMap, DifferentNodeSizesFallBack) {
  for (int r = 0; r < 4; ++r) {
    const NodeMap m = make_node_map(hashes_of({0, 0, 0, 1}), r);
    EXPECT_FALSE(m.uniform);
    EXPECT_EQ(m.why, "node 0 holds 3 ranks but node 1 holds 1");
    EXPECT_EQ(m.nodes, 2);
  }
}

TEST(NodeMap, InterleavedRanksFallBack) {
  // Equal sizes, but node 0 holds ranks 0 and 2: a rank's block is not (node, local rank).
  const NodeMap m = make_node_map(hashes_of({0, 1, 0, 1}), 0);
  EXPECT_FALSE(m.uniform);
  EXPECT_NE(m.why.find("not consecutive"), std::string::npos) << m.why;
}

TEST(NodeMap, NoRanks) {
  EXPECT_FALSE(make_node_map({}, 0).uniform);
  EXPECT_FALSE(make_node_map(hashes_of({0, 0}), 2).uniform);
}

}  // namespace
