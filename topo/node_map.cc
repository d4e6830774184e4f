#include "topo/node_map.h"

#include <cstdio>
#include <unordered_map>

namespace dq::topo {

NodeMap make_node_map(const std::vector<uint64_t>& hashes, int rank) {
  NodeMap m;
  const int n = static_cast<int>(hashes.size());
  if (n == 0 || rank < 0 || rank >= n) {
    m.why = "no rank";
    return m;
  }
  // Nodes numbered in the order of their first rank; sizes counted.
  std::unordered_map<uint64_t, int> index;
  std::vector<int> node_of(n), sizes;
  for (int r = 0; r < n; ++r) {
    auto [it, fresh] = index.emplace(hashes[r], static_cast<int>(sizes.size()));
    if (fresh) sizes.push_back(0);
    node_of[r] = it->second;
    ++sizes[it->second];
  }
  m.nodes = static_cast<int>(sizes.size());
  m.node = node_of[rank];
  char text[160];
  for (int k = 1; k < m.nodes; ++k)
    if (sizes[k] != sizes[0]) {
      std::snprintf(text, sizeof text, "node 0 holds %d ranks but node %d holds %d", sizes[0], k,
                    sizes[k]);
      m.why = text;
      return m;
    }
  const int local = sizes[0];
  for (int r = 0; r < n; ++r)
    if (node_of[r] != r / local) {
      std::snprintf(text, sizeof text,
                    "rank %d runs on node %d, not on node %d: the ranks of a node are not "
                    "consecutive",
                    r, node_of[r], r / local);
      m.why = text;
      return m;
    }
  m.uniform = true;
  m.local_size = local;
  m.local_rank = rank % local;
  return m;
}

}  // namespace dq::topo
