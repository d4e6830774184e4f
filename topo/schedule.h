// Aggregation schedules as plain data: which worker sends which chunks to whom at every step
// of a reduce-scatter + all-gather, and, per chunk, the in-tree of hops those steps form.
// The codec simulator and the engine both walk the same Schedule, so their hop order and the
// hop index keying the rounding RNG (the compressing worker's rank) agree by construction.
#pragma once
#include <string_view>
#include <vector>

#include "common/status.h"

namespace dq::topo {

enum class Kind { kRing, kButterfly };

inline constexpr int kMaxWorkers = 1024;

// One message; the payloads of `chunks` are concatenated in this order.
struct Transfer {
  int src;
  int dst;
  std::vector<int> chunks;
};

// The transfers of one step run concurrently; a (src, dst) pair appears at most once per step.
struct Step {
  std::vector<Transfer> transfers;
};

struct TreeNode {
  int worker;
  int parent;                 // index into ChunkTree::nodes, -1 for the sink
  int send_step;              // reduce step at which this node sends to parent; -1 for the sink
  std::vector<int> children;  // nodes whose payloads this node fuses, in the order received
};

// In-tree of one chunk. Every worker compresses every chunk exactly once, so the tree has one
// node per worker; make_schedule places worker w at node index w (validate_schedule checks it).
struct ChunkTree {
  std::vector<TreeNode> nodes;
  int sink;  // node index
};

struct Schedule {
  Kind kind;
  int n_workers;
  int n_chunks;
  // Reduce-scatter. A worker sending chunk c at step s sends the fused hop of its own part of c
  // and every payload of c it received at steps < s.
  std::vector<Step> reduce;
  // All-gather: the sink's final payload of each chunk, forwarded unchanged.
  std::vector<Step> gather;
  std::vector<ChunkTree> trees;  // one per chunk, derived from `reduce`
  std::vector<int> sink_worker;  // per chunk
};

// Builds the schedule for n_workers in 1..kMaxWorkers; kInvalidArgument (logged) otherwise.
Status make_schedule(Kind kind, int n_workers, Schedule* out);

// Checks every structural invariant the engine relies on (each contribution reduced exactly
// once, each worker compresses each chunk once, everyone receives every result once, trees
// match the steps); kInternal with a WARN naming the first violation found.
Status validate_schedule(const Schedule& s);

// Ring: n chunks. Butterfly: the largest power of two <= n. 0 when n is out of range.
int chunks_for(Kind kind, int n_workers);

// Correlated rounding may only stratify roundings that do not feed one another; nodes of equal
// height (0 = leaf, else 1 + the highest child) are such a set. Per node: its class (height),
// its position in the class (by worker) and the class size. Ring classes all have one member.
struct RoundingStrata {
  std::vector<int> klass, member, size;
};
void rounding_strata(const ChunkTree& tree, RoundingStrata* out);

Status parse_kind(std::string_view name, Kind* out);  // "ring", "butterfly"
const char* kind_name(Kind k);                        // "unknown" for an invalid value

}  // namespace dq::topo
