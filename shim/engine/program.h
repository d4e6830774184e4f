// One rank's program for a compressed all-reduce: which hops it runs and which messages it sends
// and receives, stage by stage, compiled once per plan from the schedule (topo/). Payload slots
// index the plan's buffers; slots 0 .. n_chunks-1 hold each chunk's final payload.
#pragma once
#include <cstdint>
#include <vector>

#include "common/nccl_types.h"
#include "common/status.h"
#include "kernels/codec.h"
#include "topo/schedule.h"

namespace dq::engine {

// The collectives the engine compresses. All three share the reduce phase of the schedule; they
// differ in what follows the sink's final compression: an all-gather of the final payloads
// (all-reduce), nothing (reduce-scatter: each rank decodes the chunk it sank, which holds its own
// block), or one step sending every final payload to the root (reduce).
using Collective = ::dq::Collective;
const char* collective_name(Collective c);

struct Program {
  struct Xfer {
    int peer;
    std::vector<int> chunks;
    int first_slot;  // payload slots first_slot .. first_slot + chunks.size() - 1
  };
  struct HopJob {
    int chunk;
    std::vector<int> in_slots;
    int out_slot;
    RoundingKey key;  // seed, rank and strata; `call` and `element_base` are set per call/block
  };
  enum class StageKind { kReduce, kSink, kGather, kFinish };
  struct Stage {
    StageKind kind;
    std::vector<HopJob> hops;
    std::vector<Xfer> sends, recvs;
  };

  topo::Schedule schedule;
  std::vector<Stage> stages;
  int slots = 0;
  size_t max_inputs = 0;           // most inputs of one hop
  std::vector<int> finish_chunks;  // the chunks this rank decodes into the caller's buffer
};

// Compiles rank `me`'s program for `collective` (`root`: ncclReduce's) over the schedule `kind`
// of `nranks` ranks. A reduce-scatter needs every rank to sink exactly one chunk (the ring; the
// butterfly for a power of two): kInvalidArgument otherwise.
Status compile_program(topo::Kind kind, int nranks, int me, uint64_t seed, Collective collective,
                       int root, Program* out);

// True when a gather message's chunks are consecutive, so it goes straight from / into the
// final slots; otherwise it is staged through slots of its own.
bool gather_in_place(const Program::Xfer& x);

}  // namespace dq::engine
