// Runs n simulated workers through a schedule with a codec: the same hops, the same fused-input
// order and the same rounding keys (seed, call, compressing rank, element) the engine uses.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/codec.h"
#include "topo/schedule.h"

namespace dq::sim {

struct SimOptions {
  uint64_t seed = 1;
  uint64_t call = 0;
  ReduceOp op = ReduceOp::kSum;
  bool per_hop = false;  // also decode every intermediate payload and measure its error
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
  double seconds = 0;
};

// rows[i] is worker i's input of d floats. result (optional) receives the decoded output.
Status simulate_allreduce(Codec& codec, const topo::Schedule& schedule,
                          const std::vector<const float*>& rows, size_t d, const SimOptions& opt,
                          std::vector<float>* result, SimResult* out);

}  // namespace dq::sim
