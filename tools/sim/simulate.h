// Runs n simulated workers through a schedule with a codec: the same hops, the same fused-input
// order and the same rounding keys (seed, call, compressing rank, element) the engine uses.
// Two collectives: the all-reduce (simulate_allreduce; ncclReduce to a root has the same error,
// its root decoding the same final payloads) and the reduce-scatter (simulate_reduce_scatter).
#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

#include "kernels/codec.h"
#include "topo/schedule.h"

namespace dq::sim {

struct SimOptions {
  uint64_t seed = 1;
  uint64_t call = 0;
  ReduceOp op = ReduceOp::kSum;
  bool per_hop =
      false;  // also decode every intermediate payload and measure its error (all-reduce)
  // Reduce-scatter: elements per pipeline block inside each rank block, as the engine cuts a call
  // (reduce_scatter_block_elems); 0 = the whole rank block is one block. Two-level all-reduce
  // (two_level.h): elements per block of each shard's rail all-reduce; 0 = one per shard.
  size_t block_elems = 0;
  // All-reduce only: added to every element index of the rounding keys, for a part of a larger
  // tensor (the shard of a two-level all-reduce, tools/sim/two_level.h); 0 = a whole tensor.
  uint64_t element_base = 0;
  // Two-level all-reduce, a what-if: shard l holds whole super-groups l, l + L, l + 2L, ... of
  // the tensor instead of a contiguous range, so every shard samples the tensor evenly (NCCL's
  // reduce-scatter gives contiguous shards; the engine would need a permuting copy).
  bool interleaved_shards = false;
};

struct SimResult {
  double vnmse = 0;                // ||x^ - x||^2 / ||x||^2 against the exact FP64 result
  double bits_per_coord = 0;       // one compressed copy: every chunk message + statistics
  double wire_bits_per_coord = 0;  // bytes each worker sends over all hops, average, per coord
  bool budget_honest = true;       // false when the tensor is too small for the budget's cuts
  // false below kMinSuperGroupsPerChunk super-groups per chunk message (kernels/codec.h): the
  // result is valid but far worse than at larger sizes, and the engine passes such tensors through
  bool chunks_large_enough = true;
  // hop_error[k-1]: squared error of payloads summing k workers, against their exact partial
  // sums, over ||x||^2 (summed over chunks); only with per_hop.
  std::vector<double> hop_error;
  // Reduce-scatter only: per rank r, the vNMSE of rank r's output block against the exact FP64
  // sum (or average) of that block; `vnmse` is then over all blocks together.
  std::vector<double> block_vnmse;
  // Two-level all-reduce only: what each rank sends inside its node (the exact reduce-scatter
  // and all-gather in FP32), bits per input coordinate; 0 for a flat schedule.
  double intra_node_bits_per_coord = 0;
  double seconds = 0;
};

// rows[i] is worker i's input of d floats. result (optional) receives the decoded output.
Status simulate_allreduce(Codec& codec, const topo::Schedule& schedule,
                          const std::vector<const float*>& rows, size_t d, const SimOptions& opt,
                          std::vector<float>* result, SimResult* out);

// The compressed reduce-scatter as the engine runs it (shim/engine: build_plan with
// Collective::kReduceScatter). rows[i] is worker i's input of n * recvcount floats; rank block r is
// elements [r * recvcount, (r + 1) * recvcount). The schedule must end exactly one chunk at every
// worker (ring; butterfly for a power of two). Chunk c ends at worker owner = sink_worker[c] and
// is its own codec (made from codec_spec) over the owner's rank block, planned with
// plan(block count, 1 chunk, n): statistics over that slice only (summed over workers in rank
// order, rounded to BF16, as for the all-reduce), the hops of chunk c's in-tree, and rounding
// keys with element_base = owner * roundup(recvcount, 256) + the block's offset in the rank block.
// The owner decodes its chunk with finish(): no gather. `result` (optional) receives n *
// recvcount floats, rank block r as rank r outputs it. bits_per_coord counts one compressed copy
// (every chunk message and every statistic) and wire_bits_per_coord what each worker sends (its
// reduce messages plus its share of the statistics all-reduce), both per input coordinate (n *
// recvcount of them).
Status simulate_reduce_scatter(std::string_view codec_spec, const topo::Schedule& schedule,
                               const std::vector<const float*>& rows, size_t recvcount,
                               const SimOptions& opt, std::vector<float>* result, SimResult* out);

// The engine's pipeline blocks of a reduce-scatter (DYNAMIQ_BLOCK_BYTES counts the caller's
// bytes, and a block spans one slice of every rank block): elements per block in a rank block
// (pipeline_block_elems, kernels/codec.h: at least one chunk message's floor).
size_t reduce_scatter_block_elems(uint64_t block_bytes, size_t element_bytes, int n_workers);

}  // namespace dq::sim
