// A call on the two-level schedule (docs/ENGINE.md section 11), in stream order on the engine's
// comm stream: the exact step inside the node, the rail engine's compressed collective of this
// rank's shard, the exact step back inside the node, and the tail the shards leave (fewer
// elements than ranks per node) exact on the caller's communicator. No host wait of its own but
// NCCL's issue: the split communicators are non-blocking (engine_hierarchy.cc), so each call on
// one is settled (NcclOps::settled) before the next is issued, as NCCL requires.
#include <algorithm>

#include "shim/engine/engine_hierarchy.h"
#include "shim/engine/engine_internal.h"

namespace dq::engine {
namespace {

// A call's geometry on the two levels, in elements.
struct Shape {
  size_t per_rank = 0;  // reduce-scatter: elements each rank receives
  size_t shard = 0;     // this rank's shard: what the rail engine all-reduces or reduces
  size_t tail = 0;      // all-reduce and reduce: the elements past local_size shards
};

Shape shape_of(const CallArgs& call, const topo::NodeMap& map, int nranks) {
  Shape s;
  if (call.collective == Collective::kReduceScatter) {
    // The rail's blocks: this local rank's block of every node, one after the other.
    s.per_rank = call.count / static_cast<size_t>(nranks);
    s.shard = s.per_rank * static_cast<size_t>(map.nodes);
  } else {
    s.shard = call.count / static_cast<size_t>(map.local_size);
    s.tail = call.count - s.shard * static_cast<size_t>(map.local_size);
  }
  return s;
}

const uint8_t* at(const void* p, size_t elements, size_t esize) {
  return static_cast<const uint8_t*>(p) + elements * esize;
}
uint8_t* at(void* p, size_t elements, size_t esize) {
  return p == nullptr ? nullptr : static_cast<uint8_t*>(p) + elements * esize;
}

}  // namespace

// Step (a): the exact reduce-scatter inside the node into this rank's shard. A reduce-scatter
// runs one per node of the caller's blocks, so the shard holds this local rank's block of every
// node in node order.
Status Engine::enqueue_node_reduce(const CallArgs& call, Lane lane) {
  const Hierarchy& h = *hierarchy_;
  const Shape s = shape_of(call, h.map, comm_.nranks);
  const size_t esize = call.dtype == ncclFloat32 ? 4 : 2;
  const NcclOps ops = ops_;
  const ncclComm_t node = h.node_comm;
  const auto stream = static_cast<cudaStream_t>(comm_stream_);
  void* shard = h.shard;
  const int nodes = h.map.nodes, local = h.map.local_size;
  const CallArgs c = call;
  const int64_t timeout_ms = settings_.timeout_ms;
  return enqueue_nccl(lane, [=] {
    if (c.collective != Collective::kReduceScatter)
      return ops.settled(node,
                         ops.reduce_scatter(c.send, shard, s.shard, c.dtype, c.op, node, stream),
                         timeout_ms);
    for (int k = 0; k < nodes; ++k) {
      const size_t first = static_cast<size_t>(k) * static_cast<size_t>(local) * s.per_rank;
      const ncclResult_t r =
          ops.settled(node,
                      ops.reduce_scatter(at(c.send, first, esize), at(shard, k * s.per_rank, esize),
                                         s.per_rank, c.dtype, c.op, node, stream),
                      timeout_ms);
      if (r != ncclSuccess) return r;
    }
    return ncclSuccess;
  });
}

// Step (b)'s arguments for a reduce-scatter or a reduce (an all-reduce runs in pieces,
// enqueue_piece): the rail engine's call on this rank's shard, on the comm stream.
CallArgs Engine::rail_call(const CallArgs& call) const {
  const Hierarchy& h = *hierarchy_;
  const Shape s = shape_of(call, h.map, comm_.nranks);
  const size_t esize = call.dtype == ncclFloat32 ? 4 : 2;
  CallArgs r = call;
  r.send = h.shard;
  r.count = s.shard;
  r.stream = static_cast<cudaStream_t>(comm_stream_);
  r.in_group = false;
  r.capturing = false;
  if (call.collective == Collective::kReduceScatter) {
    r.recv = call.recv;
  } else {
    // The root's node holds the sum, shard by shard, on its ranks; the root's own shard lands in
    // place in its receive buffer.
    r.root = call.root / h.map.local_size;
    r.recv = comm_.rank == call.root
                 ? at(call.recv, static_cast<size_t>(h.map.local_rank) * s.shard, esize)
                 : h.shard;
  }
  return r;
}

// Step (b) without compression (the rail engine passed its call through: the A/B switch, a
// shard too small for the budget): the same collective, exact, on the rail communicator.
Status Engine::enqueue_rail_exact(const CallArgs& rc, int engine, Lane lane) {
  const NcclOps ops = ops_;
  const ncclComm_t rail = hierarchy_->rail_comm[engine];
  const size_t nodes = static_cast<size_t>(hierarchy_nodes());
  const int64_t timeout_ms = settings_.timeout_ms;
  return enqueue_nccl(lane, [=] {
    ncclResult_t r;
    if (rc.collective == Collective::kAllReduce)
      r = ops.all_reduce(rc.send, rc.recv, rc.count, rc.dtype, rc.op, rail, rc.stream);
    else if (rc.collective == Collective::kReduceScatter)
      r = ops.reduce_scatter(rc.send, rc.recv, rc.count / nodes, rc.dtype, rc.op, rail, rc.stream);
    else
      r = ops.reduce(rc.send, rc.recv, rc.count, rc.dtype, rc.op, rc.root, rail, rc.stream);
    return ops.settled(rail, r, timeout_ms);
  });
}

// Step (c) of a reduce: the root's node sends its shards to the root; and the tail, exact on the
// caller's communicator. (A reduce-scatter has no step (c).)
Status Engine::enqueue_node_gather(const CallArgs& call, Lane lane) {
  const Hierarchy& h = *hierarchy_;
  const Shape s = shape_of(call, h.map, comm_.nranks);
  const size_t esize = call.dtype == ncclFloat32 ? 4 : 2;
  const NcclOps ops = ops_;
  const ncclComm_t node = h.node_comm, whole = comm_.comm;
  const auto stream = static_cast<cudaStream_t>(comm_stream_);
  const void* shard = h.shard;
  const topo::NodeMap map = h.map;
  const bool is_root = comm_.rank == call.root;
  const CallArgs c = call;
  const size_t shards_end = s.shard * static_cast<size_t>(map.local_size);
  const int64_t timeout_ms = settings_.timeout_ms;
  return enqueue_nccl(lane, [=] {
    ncclResult_t r = ncclSuccess;
    if (c.collective != Collective::kReduce) return r;
    if (map.node == c.root / map.local_size) {
      const int root_local = c.root % map.local_size;
      r = ops.group_start();
      for (int l = 0; l < map.local_size && r == ncclSuccess; ++l) {
        if (is_root && l != root_local)
          r = ops.recv(at(c.recv, static_cast<size_t>(l) * s.shard, esize), s.shard, c.dtype, l,
                       node, stream);
        else if (!is_root && l == root_local)
          r = ops.send(shard, s.shard, c.dtype, l, node, stream);
      }
      const ncclResult_t end = ops.settled(node, ops.group_end(), timeout_ms);
      if (r == ncclSuccess) r = end;
    }
    if (r == ncclSuccess && s.tail > 0)
      r = ops.settled(whole,
                      ops.reduce(at(c.send, shards_end, esize), at(c.recv, shards_end, esize),
                                 s.tail, c.dtype, c.op, c.root, whole, stream),
                      timeout_ms);
    return r;
  });
}

int Engine::hierarchy_nodes() const {
  return hierarchy_ ? hierarchy_->map.nodes : 1;
}

// Elements of this rank's shard per pipeline piece of an all-reduce: the shard of one
// DYNAMIQ_BLOCK_BYTES block of the caller's buffer (as the flat engine cuts its blocks; the
// last piece takes the remainder), whole super-groups, at least 64 super-groups per rail chunk
// (the budget's floor, kMinSuperGroupsPerChunk). Each piece is one rail call and the rail engine
// runs it as one block, so the piece's shard gets one budget: the width allocation spans the
// same share of a block as the flat engine's does. Smaller budget units (a quarter block each)
// could not move bits from a shard's all-zero super-groups to its dense ones, and lost to flat
// on the real corpus (docs/results/accuracy.md, section "two-level").
size_t Engine::piece_elements(DType dtype) const {
  const Hierarchy& h = *hierarchy_;
  const size_t floor = kMinSuperGroupsPerChunk * 256 * static_cast<size_t>(h.map.nodes);
  const size_t per_block = static_cast<size_t>(settings_.block_bytes) / dtype_size(dtype) /
                           static_cast<size_t>(h.map.local_size) / 256 * 256;
  return std::max(per_block, floor);
}

// One piece of a pipelined all-reduce: elements [L*first, L*(first+n)) of the caller's buffers,
// whose shards are elements [first, first+n) of the shard buffer. Its node reduce-scatter on the
// comm stream, its rail call on the rail stream, its all-gather on the gather stream.
Status Engine::enqueue_piece(const CallArgs& call, size_t p, size_t first, size_t n,
                             ncclResult_t* rail, PassReason* rail_reason) {
  Hierarchy& h = *hierarchy_;
  // Piece p on rail engine p % 2: piece p + 1's statistics, their all-reduce, its budget and
  // first compressions run while piece p still sends (Hierarchy::rail).
  const int e = static_cast<int>(p % kRailEngines);
  const size_t esize = dtype_size(call.dtype == ncclFloat32 ? DType::kF32 : DType::kBF16);
  const size_t local = static_cast<size_t>(h.map.local_size);
  const NcclOps ops = ops_;
  const ncclComm_t node = h.node_comm, gather = h.gather_comm;
  const ncclDataType_t dt = call.dtype;
  const ncclRedOp_t op = call.op;
  const uint8_t* send = at(call.send, local * first, esize);
  uint8_t* recv = at(call.recv, local * first, esize);
  uint8_t* shard = at(h.shard, first, esize);
  uint32_t* error = control_ + error_word_index();
  auto comm = static_cast<cudaStream_t>(comm_stream_);
  auto gather_stream = static_cast<cudaStream_t>(h.gather_stream);
  const int64_t timeout_ms = settings_.timeout_ms;
  // The second piece's reduce-scatter waits until the first piece's rail call has its layouts:
  // until then nothing is on the rail, and the first piece's statistics, their all-reduce and
  // budget (its path to its first message) do not share the device with it. Later pieces' do
  // not wait: a piece's prologue then overlaps the previous piece's messages anyway, and a wait
  // would tie each rank's reduce-scatter to its node-mates' rails.
  if (p == 1) DQ_CHECK(device_->wait(comm_stream_, h.layouts_done[0]));
  DQ_CHECK(enqueue_nccl(Lane{comm_stream_, error}, [=] {
    return ops.settled(node, ops.reduce_scatter(send, shard, n, dt, op, node, comm), timeout_ms);
  }));
  DQ_CHECK(device_->record(h.node_done, comm_stream_));
  // The piece's rail call on rail engine e, whose stream waits for its reduce-scatter and for
  // that engine's previous rail call only: the other engine's call (the previous piece) may
  // still be sending.
  DQ_CHECK(device_->wait(h.rail_stream[e], h.node_done));
  CallArgs rc = call;
  rc.send = shard;
  rc.recv = shard;
  rc.count = n;
  rc.stream = static_cast<cudaStream_t>(h.rail_stream[e]);
  rc.in_group = rc.capturing = false;
  if ((*rail = h.rail[e]->run(rc, rail_reason)) != ncclSuccess) return Status::kOk;
  if (*rail_reason != PassReason::kRerouted)
    DQ_CHECK(enqueue_rail_exact(rc, e, Lane{h.rail_stream[e], error}));
  DQ_CHECK(device_->record(h.rail_done[e], h.rail_stream[e]));
  DQ_CHECK(device_->wait(h.gather_stream, h.rail_done[e]));
  return enqueue_nccl(Lane{h.gather_stream, error}, [=] {
    return ops.settled(gather, ops.all_gather(shard, recv, n, dt, gather, gather_stream),
                       timeout_ms);
  });
}

// The all-reduce in pieces (docs/ENGINE.md section 11), then the tail on the caller's
// communicator; the caller's stream waits for the comm and gather streams. *reason: rerouted when
// some piece was compressed, else the first piece's reason.
ncclResult_t Engine::run_two_level_all_reduce(const CallArgs& call, PassReason* reason) {
  Hierarchy& h = *hierarchy_;
  const DType dtype = call.dtype == ncclFloat32 ? DType::kF32 : DType::kBF16;
  const size_t esize = dtype_size(dtype);
  const size_t local = static_cast<size_t>(h.map.local_size);
  const size_t shard = call.count / local, tail = call.count - shard * local;
  const size_t piece = piece_elements(dtype);
  const size_t pieces = std::max<size_t>(1, shard / piece);
  Status st = device_->record(ev_start_, call.stream);
  if (st == Status::kOk) st = device_->wait(comm_stream_, ev_start_);
  ncclResult_t rail = ncclSuccess;
  for (size_t p = 0; p < pieces && st == Status::kOk && rail == ncclSuccess; ++p) {
    const size_t first = p * piece;
    PassReason piece_reason = PassReason::kRerouted;
    st = enqueue_piece(call, p, first, p + 1 == pieces ? shard - first : piece, &rail,
                       &piece_reason);
    if (p == 0 || piece_reason == PassReason::kRerouted) *reason = piece_reason;
  }
  if (rail != ncclSuccess) {
    if (broken_ == ncclSuccess) broken_ = rail;
    return rail;
  }
  const NcclOps ops = ops_;
  const ncclComm_t whole = comm_.comm;
  auto comm = static_cast<cudaStream_t>(comm_stream_);
  const CallArgs c = call;
  const size_t end = shard * local;
  const int64_t timeout_ms = settings_.timeout_ms;
  if (st == Status::kOk && tail > 0)
    st = enqueue_nccl(Lane{comm_stream_, control_ + error_word_index()}, [=] {
      return ops.settled(whole,
                         ops.all_reduce(at(c.send, end, esize), at(c.recv, end, esize), tail,
                                        c.dtype, c.op, whole, comm),
                         timeout_ms);
    });
  if (st == Status::kOk) st = device_->record(ev_comm_done_, comm_stream_);
  if (st == Status::kOk) st = device_->record(h.gather_done, h.gather_stream);
  if (st == Status::kOk) st = device_->wait(call.stream, ev_comm_done_);
  if (st == Status::kOk) st = device_->wait(call.stream, h.gather_done);
  return st == Status::kOk ? ncclSuccess : fail_call(st);
}

ncclResult_t Engine::run_two_level(const CallArgs& call, PassReason* reason) {
  Hierarchy& h = *hierarchy_;
  const Shape s = shape_of(call, h.map, comm_.nranks);
  if (s.shard == 0) {
    *reason = PassReason::kSmall;
    count(*reason);
    return ncclSuccess;
  }
  // The shard stays the previous all-reduce's until its all-gathers (and the rail calls they
  // wait for) are done. The comm stream, where this call writes the shard first and where a
  // grown shard's old buffer is freed, waits for them: one caller stream orders the calls
  // already, but calls from two streams, or that free, would not be.
  if (const Status st = device_->wait(comm_stream_, h.gather_done); st != Status::kOk)
    return fail_call(st);
  bool ok = false;
  const size_t esize = call.dtype == ncclFloat32 ? 4 : 2;
  if (const ncclResult_t r = ensure_shard(s.shard * esize, &ok); r != ncclSuccess) return r;
  if (!ok) {
    *reason = PassReason::kFailure;
    count(*reason);
    return ncclSuccess;
  }
  // The caller's call: exact or compressed, the engine ran it (the interceptor passes nothing
  // through); counted once, under the rail's reason.
  PassReason rail_reason = PassReason::kRerouted;
  if (call.collective == Collective::kAllReduce) {
    if (const ncclResult_t r = run_two_level_all_reduce(call, &rail_reason); r != ncclSuccess)
      return r;
    count(rail_reason);
    *reason = PassReason::kRerouted;
    return async_error();
  }
  const Lane lane{comm_stream_, control_ + error_word_index()};
  Status st = device_->record(ev_start_, call.stream);
  if (st == Status::kOk) st = device_->wait(comm_stream_, ev_start_);
  if (st == Status::kOk) st = enqueue_node_reduce(call, lane);
  if (st != Status::kOk) return fail_call(st);
  const CallArgs rc = rail_call(call);
  const int e = 0;  // one rail call: rail engine 0
  if (const ncclResult_t r = h.rail[e]->run(rc, &rail_reason); r != ncclSuccess) {
    if (broken_ == ncclSuccess) broken_ = r;
    return r;
  }
  if (rail_reason != PassReason::kRerouted) st = enqueue_rail_exact(rc, e, lane);
  if (st == Status::kOk) st = enqueue_node_gather(call, lane);
  if (st == Status::kOk) st = device_->record(ev_comm_done_, comm_stream_);
  if (st == Status::kOk) st = device_->wait(call.stream, ev_comm_done_);
  if (st != Status::kOk) return fail_call(st);
  count(rail_reason);
  *reason = PassReason::kRerouted;
  return async_error();
}

}  // namespace dq::engine
