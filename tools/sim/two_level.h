// The two-level all-reduce (DYNAMIQ_HIERARCHY=node, docs/ENGINE.md): `nodes` x `ranks_per_node`
// ranks, rank r on node r / ranks_per_node at local index r % ranks_per_node.
//   1. An exact reduce-scatter inside each node: local rank l holds shard l of its node's sum.
//      Modelled in FP32 (the caller's dtype of the simulator's inputs): each node's ranks added in
//      local-rank order, one FP32 rounding per add, as a ring of FP32 adds does; no compression.
//   2. Per shard l, the full compressed all-reduce among the ranks of local index l (one per node,
//      the shard's rail): simulate_allreduce over `inter`, the schedule of the nodes, with the
//      node sums as the workers' rows. Statistics, widths, hops and the sink's final compression
//      are those of a flat all-reduce of `nodes` workers on that shard; the rounding keys name the
//      node's index (the rank in the rail) and the element's index in the whole tensor.
//   3. An exact all-gather inside the node: every rank ends with every shard's decoded result,
//      identical bytes on every rank.
// With one node nothing is compressed (no byte leaves a node): the result is the FP32 sum. With
// one rank per node the node sums are the ranks' rows, there is one shard, and the result is the
// flat all-reduce's over `inter`, byte for byte. AVG: the shards are summed, then each value is
// divided by nodes x ranks_per_node in FP32.
#pragma once
#include <cstddef>
#include <string_view>
#include <vector>

#include "tools/sim/simulate.h"
#include "topo/schedule.h"

namespace dq::sim {

// Elements per shard of a d-element tensor over `ranks_per_node` local ranks: ceil(d / L)
// rounded up to whole 256-value super-groups, so a shard's codec cuts the same super-groups as
// the tensor's; the last shard takes what is left (fewer, or none when d is small).
size_t two_level_shard_elems(size_t d, int ranks_per_node);

// rows: nodes x ranks_per_node rows of d floats (node-major). `result` (optional) receives the d
// values every rank holds. bits_per_coord: one compressed copy of every shard, per coordinate of
// the tensor; wire_bits_per_coord: what each rank sends between nodes (its rail), averaged over
// the ranks, per coordinate of the tensor; intra_node_bits_per_coord: what each rank sends inside
// its node (reduce-scatter and all-gather, FP32: 2 x 32 x (L - 1) / L). kInvalidArgument for
// per_hop (not modelled) or fewer rows than ranks.
Status simulate_two_level_allreduce(std::string_view codec_spec, const topo::Schedule& inter,
                                    int ranks_per_node, const std::vector<const float*>& rows,
                                    size_t d, const SimOptions& opt, std::vector<float>* result,
                                    SimResult* out);

// Step 1 alone: each node's FP32 sum of its ranks' rows, as step 1 forms it (sums[g] has d values).
void node_sums(const std::vector<const float*>& rows, size_t d, int nodes, int ranks_per_node,
               std::vector<std::vector<float>>* sums);

}  // namespace dq::sim
