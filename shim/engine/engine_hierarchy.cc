// The two-level schedule (docs/ENGINE.md section 11): exact inside a node through NCCL, the
// DynamiQ compressed collective of each local rank's shard among the ranks of the same local
// index on every node (one hop per node), exact again inside the node. Set up at the handshake,
// identically on every rank; any rank-local failure is agreed, and then every rank runs flat.
#include "shim/engine/engine_hierarchy.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "common/fnv1a.h"
#include "shim/engine/engine_internal.h"

namespace dq::engine {
namespace {

// NCCL_CONFIG_INITIALIZER's values (every field undefined: NCCL's defaults) with blocking 0: the
// children are non-blocking communicators (their calls are settled()). Whether the split itself
// blocks follows the parent in NVIDIA's NCCL, not this config (setup_hierarchy()).
ncclConfig_t nonblocking_split_config() {
  ncclConfig_t c = DQ_NCCL_CONFIG_INITIALIZER;
  c.blocking = 0;
  return c;
}

}  // namespace

uint64_t node_host_hash() {
  if (const char* id = std::getenv("NCCL_HOSTID"); id != nullptr && id[0] != '\0')
    return fnv1a64(id);
  char host[256] = {0};
  if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return fnv1a64(std::string(host) + boot);
}

// Every rank's host hash (and whether its NCCL has the calls the two-level schedule needs),
// gathered with MAX all-reduces of the control scratch: each rank fills its own two words, the
// others contribute zeros. Several rounds when the words do not fit the scratch.
ncclResult_t Engine::gather_host_hashes(std::vector<uint64_t>* hashes, bool* all_capable) {
  const int n = comm_.nranks;
  std::vector<uint32_t> words(2 * static_cast<size_t>(n) + 1, 0u), reduced(words.size(), 0u);
  const uint64_t mine = node_host_hash();
  words[2 * comm_.rank] = static_cast<uint32_t>(mine >> 32);
  words[2 * comm_.rank + 1] = static_cast<uint32_t>(mine);
  words.back() = ops_.two_level_capable() ? 0u : 1u;
  const size_t step = static_cast<size_t>(scratch_words());
  for (size_t at = 0; at < words.size(); at += step) {
    const int len = static_cast<int>(std::min(step, words.size() - at));
    if (const ncclResult_t r = blocking_max(words.data() + at, reduced.data() + at, len);
        r != ncclSuccess)
      return r;
  }
  hashes->resize(n);
  for (int r = 0; r < n; ++r)
    (*hashes)[r] = (static_cast<uint64_t>(reduced[2 * r]) << 32) | reduced[2 * r + 1];
  *all_capable = reduced.back() == 0u;
  return ncclSuccess;
}

// Called at the handshake on every rank of an agreed communicator. Returns an NCCL failure of
// the agreement itself; every other outcome leaves the flat schedule (hierarchy_ null) or the
// two-level one, the same on every rank.
ncclResult_t Engine::setup_hierarchy() {
  const std::string& mode = settings_.hierarchy;
  // Two levels need >= 2 nodes and, for auto, a node of >= 2 ranks: >= 4 ranks (2 for node).
  if (mode == "flat" || comm_.nranks < (mode == "node" ? 2 : 4)) return ncclSuccess;
  std::vector<uint64_t> hashes;
  bool capable = false;
  if (const ncclResult_t r = gather_host_hashes(&hashes, &capable); r != ncclSuccess) return r;
  const topo::NodeMap map = topo::make_node_map(hashes, comm_.rank);
  std::string why;
  if (!capable)
    why = "some rank's NCCL lacks ncclReduceScatter, ncclAllGather, ncclReduce or ncclCommSplit";
  else if (!map.uniform)
    why = map.why;
  else if (map.nodes < 2)
    why = "all ranks run on one node";
  else if (mode == "auto" && map.local_size < 2)
    why = "every node holds one rank";
  if (!why.empty()) {
    DQ_INFO(Subsys::kEngine, "dynamiq: rank %d/%d: flat schedule (DYNAMIQ_HIERARCHY=%s): %s",
            comm_.rank, comm_.nranks, mode.c_str(), why.c_str());
    return ncclSuccess;
  }
  auto h = std::make_unique<Hierarchy>();
  h->map = map;
  // Every split on every rank, whatever the others returned: a rank that skipped one would leave
  // its peers waiting in it. In NVIDIA's NCCL whether a split blocks follows the parent, and the
  // child's handle is written only once the child is made:
  // - a blocking parent (the frameworks' default): the split returns once every rank of the
  //   parent took part, without a bound, as NCCL's own splits; every rank took part in the
  //   handshake just before, so only a peer that hangs between the two can hold it;
  // - a non-blocking parent: ncclInProgress with the handle still NULL; the parent's
  //   ncclCommGetAsyncError is polled until it leaves that state (as NCCL documents for a
  //   non-blocking communicator's operations), within DYNAMIQ_TIMEOUT_MS, and the handle is then
  //   written. Still in progress at the bound, NCCL may write it later: the Hierarchy that holds
  //   it is then never freed (Hierarchy::split_pending);
  // - a child made but still initialising (the CPU NCCL's non-blocking splits): the child is
  //   polled likewise.
  // A peer that never reaches a split costs this rank one timeout, and then every rank runs
  // flat. No split is issued once an abort of the communicator began (its parent may be freed).
  auto split_settled = [&](int color, int key, ncclComm_t* child) {
    if (aborting()) return stop_for_abort("before splitting the node and rail communicators");
    ncclConfig_t config = nonblocking_split_config();
    ncclResult_t r = ops_.comm_split(comm_.comm, color, key, child, &config);
    if (r == ncclInProgress && *child == nullptr) {
      r = ops_.settled(comm_.comm, r, settings_.timeout_ms);
      if (*child == nullptr) {
        if (r != ncclSuccess) h->split_pending = true;
        return r == ncclSuccess ? ncclInternalError : r;  // done, yet no communicator
      }
    }
    return *child != nullptr ? ops_.settled(*child, r, settings_.timeout_ms) : r;
  };
  const ncclResult_t node_split = split_settled(map.node, map.local_rank, &h->node_comm);
  ncclResult_t rail_split = ncclSuccess;
  bool streams = true;
  for (int e = 0; e < kRailEngines; ++e) {
    const ncclResult_t r = split_settled(map.local_rank, map.node, &h->rail_comm[e]);
    if (rail_split == ncclSuccess) rail_split = r;
    if (h->rail_comm[e] == nullptr && rail_split == ncclSuccess) rail_split = ncclInternalError;
    streams = streams && device_->create_stream(&h->rail_stream[e]) == Status::kOk &&
              device_->create_event(&h->rail_done[e]) == Status::kOk &&
              device_->create_event(&h->layouts_done[e]) == Status::kOk;
  }
  const ncclResult_t gather_split = split_settled(map.node, map.local_rank, &h->gather_comm);
  streams = streams && device_->create_stream(&h->gather_stream) == Status::kOk &&
            device_->create_event(&h->node_done) == Status::kOk &&
            device_->create_event(&h->gather_done) == Status::kOk;
  const bool split = node_split == ncclSuccess && rail_split == ncclSuccess &&
                     gather_split == ncclSuccess && h->node_comm != nullptr &&
                     h->gather_comm != nullptr;
  const uint32_t local = split && streams ? 0u : 1u;
  uint32_t any = 0;
  const ncclResult_t agreed = blocking_max(&local, &any, 1);
  hierarchy_ = std::move(h);  // released below, or by the teardown, with its communicators
  {
    std::lock_guard<std::mutex> lock(own_comms_mutex_);
    for (ncclComm_t c : hierarchy_->comms())
      if (c != nullptr) {
        own_comms_.push_back(c);
        if (own_comms_revoked_ && ops_.comm_revoke != nullptr) ops_.comm_revoke(c, 0);
      }
  }
  if (agreed != ncclSuccess || any != 0) {
    hierarchy_->abort_comms = true;  // a peer's split may still be pending on its side
    DQ_WARN(Subsys::kEngine,
            "dynamiq: rank %d/%d: splitting the node and rail communicators (or making their "
            "streams) failed on %s (%s, %s): flat schedule",
            comm_.rank, comm_.nranks, local ? "this rank" : "another rank",
            ops_.error_string(node_split), ops_.error_string(rail_split));
    release_hierarchy();
    return agreed;
  }
  config::Settings rail_settings = settings_;
  rail_settings.hierarchy = "flat";
  rail_settings.min_bytes = 0;  // the caller's call was screened whole
  // The rail engine's blocks: the shard of one caller's DYNAMIQ_BLOCK_BYTES block, so that each
  // rail block has the budget of the share of a block the flat engine would give it (a
  // reduce-scatter's rail block: one slice of every rank block, as the flat engine cuts it). An
  // all-reduce piece (piece_elements: the same size in elements, up to twice that for the last
  // piece) then runs as one rail block, one codec part, in sub-blocks. At least 64 super-groups of
  // FP32 per rail chunk (the budget's floor), as piece_elements.
  const int64_t floor_bytes = static_cast<int64_t>(kMinSuperGroupsPerChunk) * 256 * 4 * map.nodes;
  rail_settings.block_bytes =
      std::max<int64_t>(settings_.block_bytes / map.local_size, floor_bytes);
  for (int e = 0; e < kRailEngines; ++e) {
    auto rail = std::make_unique<Engine>(rail_settings, true,
                                         CommInfo{hierarchy_->rail_comm[e], map.node, map.nodes},
                                         ops_, device_, metrics_, true);  // with the abort flag
    rail->counts_calls_ = false;
    // A rail call is serialized with the next one on the same engine (they share its plan
    // buffers), so the rail engine pipelines inside it: up to 16 sub-blocks sharing the block's
    // one codec part, as many as leave 1024 super-groups per chunk (more chunks cost budget:
    // Engine::sub_blocks_for).
    rail->sub_blocks_ = kRailSubBlocks;
    // Both engines number their calls from one counter, in the order the pieces are enqueued
    // (the same on every rank): the rounding keys one rail engine gave.
    rail->shared_call_seq_ = &hierarchy_->rail_calls;
    rail->layouts_done_ = hierarchy_->layouts_done[e];
    hierarchy_->rail[e] = std::move(rail);
  }
  DQ_INFO(Subsys::kEngine,
          "dynamiq: rank %d/%d: two-level schedule: %d nodes x %d ranks, node %d local rank %d; "
          "the compressed stage runs over %d ranks (%s)",
          comm_.rank, comm_.nranks, map.nodes, map.local_size, map.node, map.local_rank, map.nodes,
          topo::kind_name(choose_topology(settings_.topology, map.nodes)));
  return ncclSuccess;
}

void Engine::revoke_own_communicators() {
  std::lock_guard<std::mutex> lock(own_comms_mutex_);
  // Once: those published since were revoked as they were published.
  if (own_comms_revoked_) return;
  own_comms_revoked_ = true;
  if (ops_.comm_revoke == nullptr) return;
  for (ncclComm_t c : own_comms_) ops_.comm_revoke(c, 0);
}

void Engine::release_hierarchy() {
  if (!hierarchy_) return;
  Hierarchy& h = *hierarchy_;
  bool revoked = false;
  {
    std::lock_guard<std::mutex> lock(own_comms_mutex_);
    revoked = own_comms_revoked_;
  }
  const bool broken = broken_ != ncclSuccess || h.abort_comms || revoked || aborting();
  // Broken after the communicators carried work, their queued operations may wait for a peer
  // that never answers, and each wait for the streams below would run to DYNAMIQ_TIMEOUT_MS (the
  // streams, then each rail engine's, one after another). So they are ended first: revoked where
  // NCCL can (2.28+; the operations end, the streams drain, and the abort below frees them);
  // without a revoke, aborted where that ends the device's queued work (a GPU: every NCCL call
  // was issued at enqueue, only NCCL's kernels remain). The host device's threads make its NCCL
  // calls, which an abort must not race: there, without a revoke, the waits run their course.
  // (A split that failed at set-up left no work, and a peer's split may still be pending.)
  std::array<ncclComm_t, 2 + kRailEngines> comms = h.comms();
  if (broken && !h.abort_comms) {
    if (ops_.comm_revoke != nullptr) {
      revoke_own_communicators();  // the same four, published at set-up; none if revoked already
    } else if (device_ != nullptr && device_->abort_ends_queued_nccl_work()) {
      for (ncclComm_t& c : comms)
        if (c != nullptr) ops_.comm_abort(c), c = nullptr;
    }
  }
  {
    std::lock_guard<std::mutex> lock(own_comms_mutex_);
    own_comms_.clear();  // destroyed below: no revoke may reach them any more
  }
  if (device_ != nullptr) {
    // Destroying a stream waits for its work (bounded: every NCCL call in it has a timeout), and
    // the all-gathers' stream waits for the rail engine's events: both go before that engine.
    if (comm_stream_ != nullptr && device_->record(ev_comm_done_, comm_stream_) == Status::kOk)
      device_->synchronize_for(ev_comm_done_, settings_.timeout_ms);
    static_assert(kRailEngines == 2, "the lists below name every rail engine's stream and event");
    for (StreamHandle st : {h.rail_stream[0], h.rail_stream[1], h.gather_stream})
      if (st != nullptr) device_->destroy_stream(st);
  }
  for (std::unique_ptr<Engine>& rail : h.rail) rail.reset();  // waits for its streams' work
  if (device_ != nullptr) {
    for (EventHandle e : {h.node_done, h.rail_done[0], h.rail_done[1], h.layouts_done[0],
                          h.layouts_done[1], h.gather_done})
      if (e != nullptr) device_->destroy_event(e);
    if (h.shard != nullptr && comm_stream_ != nullptr) device_->release(h.shard, comm_stream_);
    if (metrics_) metrics_->held_bytes.fetch_sub(static_cast<int64_t>(h.shard_bytes));
  }
  for (ncclComm_t c : comms)
    if (c != nullptr) broken ? ops_.comm_abort(c) : ops_.comm_destroy(c);
  if (h.split_pending) {
    // NCCL may still write a child's handle into it (setup_hierarchy()): left allocated, a few
    // hundred bytes once on a job whose peer never joined a split.
    DQ_WARN(Subsys::kEngine,
            "dynamiq: rank %d/%d: a split of the node and rail communicators was still in "
            "progress after DYNAMIQ_TIMEOUT_MS = %lld ms; NCCL finishes or abandons it",
            comm_.rank, comm_.nranks, static_cast<long long>(settings_.timeout_ms));
    (void)hierarchy_.release();
    return;
  }
  hierarchy_.reset();
}

ncclResult_t Engine::rail_async_error() {
  if (!hierarchy_) return ncclSuccess;
  for (const std::unique_ptr<Engine>& rail : hierarchy_->rail)
    if (rail)
      if (const ncclResult_t r = rail->async_error(); r != ncclSuccess) return r;
  return ncclSuccess;
}

// The shard buffer for `bytes`: grown on every rank at the same call (the call shape is the
// same everywhere) and agreed, so that a failed allocation passes the call through everywhere.
// Kept only where every rank has it: the size decides whether the next call grows it again, with
// an agreement all ranks must join, so every rank's size stays the same.
ncclResult_t Engine::ensure_shard(size_t bytes, bool* ok) {
  Hierarchy& h = *hierarchy_;
  *ok = true;
  if (bytes <= h.shard_bytes) return ncclSuccess;
  if (h.shard != nullptr) device_->release(h.shard, comm_stream_);
  if (metrics_) metrics_->held_bytes.fetch_sub(static_cast<int64_t>(h.shard_bytes));
  h.shard = nullptr;
  h.shard_bytes = 0;
  void* p = nullptr;
  const uint32_t local = device_->alloc(bytes, &p) == Status::kOk ? 0u : 1u;
  uint32_t any = 0;
  const ncclResult_t r = blocking_max(&local, &any, 1);
  *ok = r == ncclSuccess && any == 0u;
  if (*ok) {
    h.shard = p, h.shard_bytes = bytes;
    if (metrics_) metrics_->held_bytes.fetch_add(static_cast<int64_t>(bytes));
  } else if (p != nullptr) {
    device_->release(p, comm_stream_);
  }
  return r;
}

}  // namespace dq::engine
