// The compressed collective in stream order (docs/ENGINE.md section 3): statistics, their
// all-reduce with the call's control word, the layouts, then the units (stage, block), codec
// steps on the compute stream and messages on the comm stream.
#include <algorithm>

#include "shim/engine/engine_internal.h"

namespace dq::engine {

Status Engine::enqueue_compute(Plan& p, int block, int stage, const CallArgs& call,
                               uint64_t call_index) {
  Plan::Block& b = p.blocks[block];
  const Program::Stage& st = p.program.stages[stage];
  const Lane lane{compute_stream_, control_ + error_word_index()};
  const size_t esize = dtype_size(p.dtype);
  auto slot = [&](int s) { return b.arena + static_cast<size_t>(s) * b.cap; };
  switch (st.kind) {
    case Program::StageKind::kReduce:
    case Program::StageKind::kSink:
      for (const Program::HopJob& h : st.hops) {
        int local = 0;
        const Plan::Part& part = p.part_of(b, h.chunk, &local);
        const ConstTensor own{static_cast<const uint8_t*>(call.send) + part.in_begin * esize,
                              p.dtype, part.count};
        for (size_t i = 0; i < h.in_slots.size(); ++i)
          p.inputs[i] = ByteView{slot(h.in_slots[i]), b.cap};
        RoundingKey key = h.key;
        key.call = call_index;
        key.element_base = part.key_base;  // draws keyed by the element, never by the block
        DQ_CHECK(device_->hop(*part.prepared, part.layout, local, own, p.inputs.data(),
                              static_cast<int>(h.in_slots.size()), slot(h.out_slot), key, lane));
      }
      return Status::kOk;
    case Program::StageKind::kGather:
      for (const Program::Xfer& x : st.sends)
        if (!gather_in_place(x))
          for (size_t j = 0; j < x.chunks.size(); ++j)
            DQ_CHECK(device_->copy(slot(x.first_slot + static_cast<int>(j)), slot(x.chunks[j]),
                                   b.cap, lane));
      return Status::kOk;
    case Program::StageKind::kFinish: {
      const ReduceOp op = call.op == ncclAvg ? ReduceOp::kAvg : ReduceOp::kSum;
      // finish() writes the chunk's elements at their positions in a tensor of part.count
      // elements starting at out_begin.
      // A run of chunks of one part whose local indices and slots both follow on is one step
      // (an all-reduce's finish stage: every chunk of the block's part, in order).
      const std::vector<int>& chunks = p.program.finish_chunks;
      for (size_t i = 0; i < chunks.size();) {
        int local = 0;
        const Plan::Part& part = p.part_of(b, chunks[i], &local);
        size_t run = 1;
        for (int next_local = 0; i + run < chunks.size(); ++run) {
          const int c = chunks[i + run];
          if (c != chunks[i] + static_cast<int>(run) || &p.part_of(b, c, &next_local) != &part ||
              next_local != local + static_cast<int>(run))
            break;
        }
        void* out = static_cast<uint8_t*>(call.recv) + part.out_begin * esize;
        DQ_CHECK(device_->finish_chunks(*part.prepared, part.layout, local, static_cast<int>(run),
                                        slot(chunks[i]), b.cap, b.cap, out, p.dtype, op,
                                        comm_.nranks, lane));
        i += run;
      }
      return Status::kOk;
    }
  }
  return Status::kInternal;
}

Status Engine::enqueue_comm(Plan& p, int block, int stage, uint64_t* wire_bytes) {
  Plan::Block& b = p.blocks[block];
  const Program::Stage& st = p.program.stages[stage];
  const Lane lane{comm_stream_, control_ + error_word_index()};
  auto slot = [&](int s) { return b.arena + static_cast<size_t>(s) * b.cap; };
  struct Message {
    uint8_t* buffer;
    size_t bytes;
    int peer;
    bool send;
  };
  std::vector<Message> messages;
  for (const Program::Xfer& x : st.sends) {
    messages.push_back({slot(x.first_slot), x.chunks.size() * b.cap, x.peer, true});
    *wire_bytes += x.chunks.size() * b.cap;
  }
  for (const Program::Xfer& x : st.recvs)
    messages.push_back({slot(x.first_slot), x.chunks.size() * b.cap, x.peer, false});
  const NcclOps ops = ops_;
  ncclComm_t comm = comm_.comm;
  auto stream = static_cast<cudaStream_t>(comm_stream_);
  const int64_t timeout_ms = settings_.timeout_ms;
  DQ_CHECK(enqueue_nccl(lane, [=] {
    ncclResult_t r = ops.group_start();
    for (const Message& m : messages) {
      if (r != ncclSuccess) break;
      r = m.send ? ops.send(m.buffer, m.bytes, ncclUint8, m.peer, comm, stream)
                 : ops.recv(m.buffer, m.bytes, ncclUint8, m.peer, comm, stream);
    }
    const ncclResult_t end = ops.settled(comm, ops.group_end(), timeout_ms);
    return r == ncclSuccess ? end : r;
  }));
  if (st.kind == Program::StageKind::kGather)
    for (const Program::Xfer& x : st.recvs)
      if (!gather_in_place(x))
        for (size_t j = 0; j < x.chunks.size(); ++j)
          DQ_CHECK(device_->copy(slot(x.chunks[j]), slot(x.first_slot + static_cast<int>(j)), b.cap,
                                 lane));
  return Status::kOk;
}

Status Engine::enqueue_compressed(Plan& p, const CallArgs& call, uint64_t call_index,
                                  bool with_stats, Bucket* predict, uint64_t* wire_bytes) {
  const Lane compute{compute_stream_, control_ + error_word_index()};
  // Statistics on the compute stream, their all-reduce (with the call's control word) on the
  // comm stream, then every block's layout from the reduced statistics: each one step over all
  // the parts. An MX fallback's statistics (its codec needs none) only `with_stats`.
  DQ_CHECK(device_->parts_stats(*p.stats_steps[with_stats ? 1 : 0], call.send, compute));
  DQ_CHECK(device_->record(ev_stats_, compute_stream_));
  DQ_CHECK(device_->wait(comm_stream_, ev_stats_));
  const bool skip_stats = p.mx_fallback() && !with_stats;
  static const std::vector<StatsSpan> kNoStatistics;
  DQ_CHECK(enqueue_call_control(p.stats_local, p.stats_reduced,
                                skip_stats ? kNoStatistics : p.stats_spans,
                                skip_stats ? nullptr : predict, wire_bytes, ev_reduced_));
  DQ_CHECK(device_->wait(compute_stream_, ev_reduced_));
  const int n_blocks = static_cast<int>(p.blocks.size());
  const int n_stages = static_cast<int>(p.program.stages.size());
  // The layouts: one step before every hop where the device batches them, else each block's
  // just before its first codec step (a block's parts follow the earlier blocks' in
  // p.part_steps; a block sharing an earlier block's part has none), so on the host the first
  // block's messages start after one layout instead of all of them (25-40 ms earlier for a
  // 256 MiB call of 16 blocks at 4 ranks on 2 cores, docs/results/speed.md).
  const size_t n_parts = p.part_steps->parts().size();
  const bool layouts_by_block = !device_->batches_layouts() && n_stages > 0;
  size_t laid_out = 0;  // parts whose layout is enqueued
  // Parts laid_out .. end - 1 (batched: all of them, one step); layouts_done_ once all are.
  auto enqueue_layouts = [&](size_t end) -> Status {
    DQ_CHECK(layouts_by_block
                 ? device_->part_layouts(*p.part_steps, laid_out, end, call_index, compute)
                 : device_->parts_layouts(*p.part_steps, call_index, compute));
    laid_out = end;
    if (laid_out == n_parts && layouts_done_ != nullptr)
      DQ_CHECK(device_->record(layouts_done_, compute_stream_));
    return Status::kOk;
  };
  if (!layouts_by_block) DQ_CHECK(enqueue_layouts(n_parts));

  // Units (stage, block) in stage-major order: codec steps on the compute stream, messages on
  // the comm stream. A block's step waits for its own previous messages only, so the compute
  // stream runs ahead (the next block's hops, all leaf compressions) while messages fly.
  DQ_CHECK(ensure_events(2 * static_cast<size_t>(n_stages) * n_blocks));
  std::fill(p.block_wait.begin(), p.block_wait.end(), nullptr);
  for (int s = 0; s < n_stages; ++s)
    for (int b = 0; b < n_blocks; ++b) {
      const size_t u = static_cast<size_t>(s) * n_blocks + b;
      if (s == 0 && layouts_by_block && !p.blocks[b].parts.empty())
        DQ_CHECK(enqueue_layouts(laid_out + p.blocks[b].parts.size()));
      if (p.block_wait[b]) DQ_CHECK(device_->wait(compute_stream_, p.block_wait[b]));
      p.block_wait[b] = nullptr;
      DQ_CHECK(enqueue_compute(p, b, s, call, call_index));
      const Program::Stage& st = p.program.stages[s];
      if (st.sends.empty() && st.recvs.empty()) continue;
      DQ_CHECK(device_->record(ev_units_[2 * u], compute_stream_));
      DQ_CHECK(device_->wait(comm_stream_, ev_units_[2 * u]));
      DQ_CHECK(enqueue_comm(p, b, s, wire_bytes));
      DQ_CHECK(device_->record(ev_units_[2 * u + 1], comm_stream_));
      p.block_wait[b] = ev_units_[2 * u + 1];
    }
  if (laid_out != n_parts) DQ_FAIL(Status::kInternal, "%zu of %zu layouts", laid_out, n_parts);
  return Status::kOk;
}

}  // namespace dq::engine
