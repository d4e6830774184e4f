// The two-level schedule's state of one communicator (docs/ENGINE.md section 11): the node map,
// the node and rail communicators split from the caller's, the engine of the compressed stage
// over the rail, and the shard buffer. Private to the engine's source files.
#pragma once
#include <array>
#include <cstddef>
#include <memory>

#include "shim/engine/engine.h"
#include "topo/node_map.h"

namespace dq::engine {

// Rail engines of a two-level communicator (Engine::Hierarchy::rail): two, so that an
// all-reduce's consecutive pieces overlap.
inline constexpr int kRailEngines = 2;

struct Engine::Hierarchy {
  topo::NodeMap map;
  // Split from the caller's communicator at the handshake (real NCCL: never intercepted):
  // node: the ranks of this node, ordered by local rank; rail: the ranks of this local rank on
  // every node, ordered by node.
  ncclComm_t node_comm = nullptr;
  // kRailEngines rail communicators (the same ranks), one per rail engine.
  ncclComm_t rail_comm[kRailEngines] = {};
  // A second node communicator (the same ranks) for the all-reduce's all-gathers, which run on
  // their own stream while the next piece's reduce-scatter runs on node_comm: two streams never
  // share one communicator.
  ncclComm_t gather_comm = nullptr;
  // Every communicator above, null where its split gave none.
  std::array<ncclComm_t, 2 + kRailEngines> comms() const {
    static_assert(kRailEngines == 2, "the list names every rail communicator");
    return {node_comm, rail_comm[0], rail_comm[1], gather_comm};
  }
  // Set when some rank's split failed or did not settle within DYNAMIQ_TIMEOUT_MS: the
  // communicators are then aborted, never destroyed (ncclCommDestroy of one still being made, or
  // of one whose peer gave up, could wait for it).
  bool abort_comms = false;
  // A split was still in progress at its bound: NCCL may write a handle into this struct later,
  // so it is never freed (release_hierarchy()).
  bool split_pending = false;
  // The compressed stage: full engines (statistics, budget, schedule over the nodes, fused
  // hops, A/B switch, sampled check, metrics) over the rail communicators. Rail calls alternate
  // between them (an all-reduce's piece p on engine p % 2), so one rail call's statistics, their
  // all-reduce, its budget and first compressions run on one engine's streams while the previous
  // call's hops still run on the other's: a rail call waits for the one before it on the same
  // engine only (they share that engine's plan buffers).
  std::unique_ptr<Engine> rail[kRailEngines];
  // The rail engines' compressed calls so far (Engine::shared_call_seq_): keys their rounding.
  uint64_t rail_calls = 0;
  // This rank's shard of a call (device memory): grown, agreed by every rank, when a call needs
  // more; the calls on the engine's comm stream use it in turn.
  void* shard = nullptr;
  size_t shard_bytes = 0;
  // The all-reduce's pipeline (engine_two_level.cc): the node reduce-scatters run on the engine's
  // comm stream, each piece's rail call on rail_stream, the node all-gathers on gather_stream, so
  // piece p+1's reduce-scatter and piece p-1's all-gather overlap piece p's rail hops.
  // One rail stream and one rail-done event per rail engine (an event is recorded on one stream
  // only).
  StreamHandle rail_stream[kRailEngines] = {}, gather_stream = nullptr;
  EventHandle node_done = nullptr, rail_done[kRailEngines] = {}, gather_done = nullptr;
  // Each rail engine's Engine::layouts_done_.
  EventHandle layouts_done[kRailEngines] = {};
};

// Sub-blocks of a rail engine's all-reduce block (Engine::sub_blocks_).
inline constexpr int kRailSubBlocks = 16;

// This host's identity, as NCCL forms it: NCCL_HOSTID when set (how tests make several nodes on
// one machine), else the hostname and the kernel's boot id.
uint64_t node_host_hash();

}  // namespace dq::engine
