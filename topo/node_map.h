// Which node each rank of a communicator runs on, and whether the two-level schedule (exact
// inside a node, compressed between nodes) can run on it: plain data, derived from every rank's
// host hash, so every rank that holds the same hashes derives the same map.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dq::topo {

struct NodeMap {
  // True when the two-level schedule can run: every node holds the same number of ranks and
  // each node's ranks are consecutive (node k holds ranks k*local_size .. k*local_size +
  // local_size - 1), so a rank's block in a reduce-scatter is (node, local rank) in row order.
  bool uniform = false;
  std::string why;     // when not uniform: the reason, for the one INFO line
  int nodes = 1;       // distinct hosts
  int local_size = 1;  // ranks per node (uniform only)
  int node = 0;        // this rank's node, numbered by its first rank
  int local_rank = 0;  // this rank's index inside its node
};

// `hashes[r]`: rank r's host hash. `rank`: this rank.
NodeMap make_node_map(const std::vector<uint64_t>& hashes, int rank);

}  // namespace dq::topo
