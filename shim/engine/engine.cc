#include "shim/engine/engine.h"

#include <sys/stat.h>
#include <tbb/task_group.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>

#include "kernels/bf16.h"

namespace dq::engine {
namespace {

constexpr size_t kMaxPlans = 16;  // distinct (count, dtype) kept: DDP uses a few bucket sizes

// NCCL result of an engine-side failure that is not NCCL's own.
ncclResult_t engine_failure(Status s) {
  return s == Status::kOutOfMemory ? ncclSystemError : ncclInternalError;
}

bool parse_switch(const char* text, bool* on) {
  std::string t(text);
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  size_t b = 0;
  while (b < t.size() && t[b] == ' ') ++b;
  t = t.substr(b);
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t.empty() || t == "1" || t == "on" || t == "true") return *on = true, true;
  if (t == "0" || t == "off" || t == "false") return *on = false, true;
  return false;
}

}  // namespace

topo::Kind choose_topology(const std::string& setting, int nranks) {
  if (setting == "ring") return topo::Kind::kRing;
  if (setting == "butterfly") return topo::Kind::kButterfly;
  const bool pow2 = nranks > 0 && (nranks & (nranks - 1)) == 0;
  return pow2 && nranks >= 4 ? topo::Kind::kButterfly : topo::Kind::kRing;
}

// ---- the plan: everything fixed by (count, dtype) --------------------------------------
struct Engine::Plan {
  struct Xfer {
    int peer;
    std::vector<int> chunks;
    int first_slot;  // payload slots first_slot .. first_slot + chunks.size() - 1
  };
  struct HopJob {
    int chunk;
    std::vector<int> in_slots;
    int out_slot;
    RoundingKey key;  // seed, rank and strata; `call` is set per call
  };
  enum class StageKind { kReduce, kSink, kGather, kFinish };
  struct Stage {
    StageKind kind;
    std::vector<HopJob> hops;
    std::vector<Xfer> sends, recvs;
  };
  struct Block {
    size_t begin = 0, count = 0;  // elements of the caller's buffer
    std::unique_ptr<Codec> codec;
    size_t cap = 0;            // bytes per chunk payload
    size_t stats_offset = 0;   // into the statistics words
    uint8_t* arena = nullptr;  // slots * cap bytes (device memory)
  };

  size_t count = 0;
  DType dtype = DType::kF32;
  topo::Schedule schedule;
  std::vector<Stage> stages;
  int slots = 0;
  std::vector<Block> blocks;
  size_t stats_words = 0;
  uint16_t* stats_local = nullptr;
  uint16_t* stats_reduced = nullptr;
  bool fits = true;
  bool arenas_ok = false;        // payload buffers allocated (retried on the next call if not)
  std::vector<ByteView> inputs;  // scratch for hop inputs (no allocation per call)
  Device* device = nullptr;

  ~Plan() {
    for (Block& b : blocks)
      if (b.arena) device->release(b.arena);
    if (stats_local) device->release(stats_local);
    if (stats_reduced) device->release(stats_reduced);
  }
};

Engine::Engine(const config::Settings& settings, bool settings_valid, CommInfo comm,
               const NcclOps& ops, Device* device, std::shared_ptr<CommMetrics> metrics,
               bool opted_in)
    : settings_(settings),
      settings_valid_(settings_valid),
      comm_(comm),
      ops_(ops),
      device_(device),
      metrics_(std::move(metrics)),
      opted_in_(opted_in),
      kind_(choose_topology(settings.topology, comm.nranks)) {
  control_local_.resize(control_words());
  control_reduced_.resize(control_words());
}

Engine::~Engine() = default;

Status Engine::register_opt_in(bool on) {
  if (state_ != State::kPending)
    DQ_FAIL(Status::kInvalidArgument,
            "dynamiqCommRegister: the communicator already ran an all-reduce; register it before "
            "its first ncclAllReduce (on every rank) so that all ranks agree");
  opted_in_ = on;
  return Status::kOk;
}

void Engine::warn_differs(const std::string& what) {
  if (what == warned_differs_) return;
  warned_differs_ = what;
  DQ_WARN(Subsys::kEngine,
          "dynamiq: ranks of communicator (rank %d of %d) disagree on: %s. Compression is OFF for "
          "this communicator: its calls pass through to NCCL. Give every rank the same DYNAMIQ_* "
          "settings.",
          comm_.rank, comm_.nranks, what.c_str());
}

void Engine::count(PassReason reason) {
  if (metrics_) metrics_->calls[static_cast<int>(reason)].fetch_add(1, std::memory_order_relaxed);
}

bool Engine::read_switch() {
  if (settings_.control_file.empty() || comm_.rank != 0) return true;
  struct stat st;
  if (::stat(settings_.control_file.c_str(), &st) != 0) {
    switch_mtime_ns_ = -1;
    switch_on_ = true;  // a missing file means on
    return switch_on_;
  }
  const int64_t mtime = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  if (mtime == switch_mtime_ns_) return switch_on_;
  switch_mtime_ns_ = mtime;
  char text[64] = {0};
  if (std::FILE* f = std::fopen(settings_.control_file.c_str(), "r")) {
    const size_t n = std::fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    std::fclose(f);
  }
  bool on = switch_on_;
  if (!parse_switch(text, &on)) {
    DQ_WARN(Subsys::kEngine,
            "dynamiq: DYNAMIQ_CONTROL_FILE %s holds '%s'; expected 1/on/true or 0/off/false. "
            "Keeping compression %s.",
            settings_.control_file.c_str(), text, switch_on_ ? "on" : "off");
    return switch_on_;
  }
  if (on != switch_on_)
    DQ_INFO(Subsys::kEngine, "dynamiq: control file switches compression %s", on ? "on" : "off");
  switch_on_ = on;
  return switch_on_;
}

PassReason Engine::screen(const CallArgs& call) const {
  if (comm_.nranks < 2) return PassReason::kSingleRank;
  if (device_ == nullptr) return PassReason::kNoDevice;
  if (state_ == State::kInert)
    return warned_differs_.empty() ? PassReason::kDisabled : PassReason::kSettingsDiffer;
  // Not agreed yet: the handshake only runs outside a group and outside capture.
  if (state_ == State::kPending)
    return call.capturing ? PassReason::kCapturing : PassReason::kInGroup;
  if (!settings_valid_ || !settings_.enable) return PassReason::kDisabled;
  if (!opted_in_) return PassReason::kNotOptedIn;
  size_t esize;
  if (call.dtype == ncclFloat32 && settings_.allow_f32) {
    esize = 4;
  } else if (call.dtype == ncclBfloat16 && settings_.allow_bf16) {
    esize = 2;
  } else {
    return PassReason::kDtype;
  }
  if (call.op != ncclSum && call.op != ncclAvg) return PassReason::kOp;
  if (call.count * esize < static_cast<size_t>(settings_.min_bytes) || call.count == 0)
    return PassReason::kSmall;
  if (call.in_group) return PassReason::kInGroup;
  if (call.capturing) return PassReason::kCapturing;
  if (!device_->owns(call.send) || !device_->owns(call.recv)) return PassReason::kNoDevice;
  return PassReason::kRerouted;
}

// ---- planning ---------------------------------------------------------------------------
Engine::Plan* Engine::plan_for(size_t count, DType dtype, Status* status) {
  *status = Status::kOk;
  for (auto it = plans_.begin(); it != plans_.end(); ++it)
    if ((*it)->count == count && (*it)->dtype == dtype) {
      plans_.splice(plans_.begin(), plans_, it);  // most recently used first
      return plans_.front().get();
    }
  auto plan = std::make_unique<Plan>();
  Plan& p = *plan;
  p.count = count;
  p.dtype = dtype;
  p.device = device_;
  const int n = comm_.nranks, me = comm_.rank;
  if ((*status = topo::make_schedule(kind_, n, &p.schedule)) != Status::kOk) return nullptr;

  // Blocks of whole super-groups; the last one takes the remainder (up to twice the size), so no
  // block is so small that it cannot meet the budget.
  const size_t esize = dtype_size(dtype);
  size_t block_elems = static_cast<size_t>(settings_.block_bytes) / esize / 256 * 256;
  block_elems = std::max<size_t>(block_elems, 256);
  const size_t n_blocks = std::max<size_t>(1, count / block_elems);
  std::string error;
  for (size_t b = 0; b < n_blocks; ++b) {
    Plan::Block blk;
    blk.begin = b * block_elems;
    blk.count = b + 1 == n_blocks ? count - blk.begin : block_elems;
    blk.codec = make_codec(settings_.codec_spec, &error);
    if (!blk.codec) {
      *status = Status::kInternal;
      DQ_WARN(Subsys::kEngine, "dynamiq: codec %s: %s", settings_.codec_spec.c_str(),
              error.c_str());
      return nullptr;
    }
    if ((*status = blk.codec->plan(blk.count, p.schedule.n_chunks, n)) != Status::kOk)
      return nullptr;
    // Too few super-groups per chunk message (kernels/codec.h) pass through: reason over_budget.
    p.fits = p.fits && blk.codec->fits_budget() &&
             chunks_large_enough(blk.count, p.schedule.n_chunks);
    blk.cap = blk.codec->chunk_capacity();
    blk.stats_offset = p.stats_words;
    p.stats_words += blk.codec->stats_words();
    p.blocks.push_back(std::move(blk));
  }

  // This rank's program: payload slots (final results first), then per stage its hops and
  // messages, straight from the schedule.
  const topo::Schedule& s = p.schedule;
  int slot = s.n_chunks;  // slots 0 .. n_chunks-1 hold the final payload of each chunk
  std::map<std::pair<int, int>, int> rx_slot;  // (chunk, sender) -> slot
  for (const topo::Step& step : s.reduce) {
    Plan::Stage st{Plan::StageKind::kReduce, {}, {}, {}};
    for (const topo::Transfer& t : step.transfers) {
      if (t.src == me) {
        st.sends.push_back({t.dst, t.chunks, slot});
        for (size_t j = 0; j < t.chunks.size(); ++j)
          st.hops.push_back({t.chunks[j], {}, slot + static_cast<int>(j), {}});
        slot += static_cast<int>(t.chunks.size());
      }
      if (t.dst == me) {
        st.recvs.push_back({t.src, t.chunks, slot});
        for (size_t j = 0; j < t.chunks.size(); ++j)
          rx_slot[{t.chunks[j], t.src}] = slot + static_cast<int>(j);
        slot += static_cast<int>(t.chunks.size());
      }
    }
    p.stages.push_back(std::move(st));
  }
  Plan::Stage sink{Plan::StageKind::kSink, {}, {}, {}};
  for (int c = 0; c < s.n_chunks; ++c)
    if (s.sink_worker[c] == me) sink.hops.push_back({c, {}, c, {}});
  p.stages.push_back(std::move(sink));
  // Gather messages of consecutive chunks go straight from / into the final slots (slot c holds
  // chunk c); others are staged so that each message is one contiguous buffer.
  auto consecutive = [](const std::vector<int>& chunks) {
    for (size_t j = 1; j < chunks.size(); ++j)
      if (chunks[j] != chunks[0] + static_cast<int>(j)) return false;
    return !chunks.empty();
  };
  for (const topo::Step& step : s.gather) {
    Plan::Stage st{Plan::StageKind::kGather, {}, {}, {}};
    for (const topo::Transfer& t : step.transfers) {
      if (t.src != me && t.dst != me) continue;
      int first = t.chunks.empty() ? 0 : t.chunks[0];
      if (!consecutive(t.chunks)) {
        first = slot;
        slot += static_cast<int>(t.chunks.size());
      }
      (t.src == me ? st.sends : st.recvs).push_back({t.src == me ? t.dst : t.src, t.chunks, first});
    }
    p.stages.push_back(std::move(st));
  }
  p.stages.push_back(Plan::Stage{Plan::StageKind::kFinish, {}, {}, {}});
  p.slots = slot;

  // Hop inputs and rounding keys from each chunk's in-tree (node index == worker).
  for (Plan::Stage& st : p.stages)
    for (Plan::HopJob& h : st.hops) {
      const topo::ChunkTree& tree = s.trees[h.chunk];
      const topo::TreeNode& node = tree.nodes[me];
      for (int child : node.children) {
        auto it = rx_slot.find({h.chunk, tree.nodes[child].worker});
        if (it == rx_slot.end()) {
          *status = Status::kInternal;
          DQ_WARN(Subsys::kEngine, "dynamiq: schedule gives rank %d no message for chunk %d", me,
                  h.chunk);
          return nullptr;
        }
        h.in_slots.push_back(it->second);
      }
      topo::RoundingStrata strata;
      topo::rounding_strata(tree, &strata);
      h.key = RoundingKey{static_cast<uint64_t>(settings_.seed),
                          0,
                          static_cast<uint32_t>(me),
                          static_cast<uint32_t>(strata.member[me]),
                          static_cast<uint32_t>(strata.size[me]),
                          static_cast<uint32_t>(strata.klass[me])};
    }
  size_t max_inputs = 0;
  for (const Plan::Stage& st : p.stages)
    for (const Plan::HopJob& h : st.hops) max_inputs = std::max(max_inputs, h.in_slots.size());
  p.inputs.resize(max_inputs + 1);

  allocate_arenas(p);
  void* words = nullptr;
  if ((*status = device_->alloc(std::max<size_t>(p.stats_words, 1) * 2, &words)) != Status::kOk)
    return nullptr;
  p.stats_local = static_cast<uint16_t*>(words);
  if ((*status = device_->alloc(std::max<size_t>(p.stats_words, 1) * 2, &words)) != Status::kOk)
    return nullptr;
  p.stats_reduced = static_cast<uint16_t*>(words);

  double arena_mb = 0;
  for (const Plan::Block& b : p.blocks) arena_mb += 1e-6 * static_cast<double>(p.slots) * b.cap;
  DQ_INFO(Subsys::kEngine,
          "dynamiq: plan rank %d/%d count %zu %s: %s, %zu block(s), %d chunk(s) of %zu B, %d "
          "slots (%.1f MB of payload buffers), %zu statistics words, fits budget: %s",
          me, n, count, dtype == DType::kF32 ? "float32" : "bfloat16", topo::kind_name(kind_),
          p.blocks.size(), s.n_chunks, p.blocks.front().cap, p.slots, arena_mb, p.stats_words,
          p.fits ? "yes" : "no");
  plans_.push_front(std::move(plan));
  if (plans_.size() > kMaxPlans) plans_.pop_back();
  return plans_.front().get();
}

bool Engine::allocate_arenas(Plan& p) {
  for (Plan::Block& b : p.blocks) {
    if (b.arena != nullptr) continue;
    void* arena = nullptr;
    if (device_->alloc(static_cast<size_t>(p.slots) * b.cap, &arena) != Status::kOk) return false;
    b.arena = static_cast<uint8_t*>(arena);
  }
  p.arenas_ok = true;
  return true;
}

// ---- agreement ----------------------------------------------------------------------------
ncclResult_t Engine::handshake(cudaStream_t stream) {
  LocalControl local{&settings_, settings_valid_, opted_in_, comm_.rank == 0, true, false};
  pack_control(local, control_local_.data());
  const ncclResult_t r =
      ops_.all_reduce(control_local_.data(), control_reduced_.data(), control_local_.size(),
                      ncclUint32, ncclMax, comm_.comm, stream);
  if (r != ncclSuccess) {
    DQ_WARN(Subsys::kEngine, "dynamiq: handshake all-reduce failed: %s", ops_.error_string(r));
    return r;
  }
  const ControlDecision d = decide_control(control_reduced_.data());
  if (!d.agreed) {
    warn_differs(d.differs);
    state_ = State::kInert;
  } else {
    state_ = d.enabled ? State::kAgreed : State::kInert;
  }
  DQ_INFO(Subsys::kEngine, "dynamiq: handshake rank %d/%d: %s", comm_.rank, comm_.nranks,
          state_ == State::kAgreed ? "compression on" : "pass-through");
  return ncclSuccess;
}

ncclResult_t Engine::exchange(Plan* plan, const CallArgs& call, ControlDecision* decision) {
  Plan& p = *plan;
  bool failure = !p.arenas_ok && !allocate_arenas(p);
  for (Plan::Block& b : p.blocks) {
    if (b.codec->stats_words() == 0) continue;
    const ConstTensor own{static_cast<const uint8_t*>(call.send) + b.begin * dtype_size(p.dtype),
                          p.dtype, b.count};
    if (device_->local_stats(*b.codec, own, p.stats_local + b.stats_offset, call.stream) !=
        Status::kOk)
      failure = true;
  }
  LocalControl local{&settings_,      settings_valid_, opted_in_,
                     comm_.rank == 0, read_switch(),   failure};
  pack_control(local, control_local_.data());
  ncclResult_t r = ops_.group_start();
  if (r == ncclSuccess && p.stats_words > 0)
    r = ops_.all_reduce(p.stats_local, p.stats_reduced, p.stats_words, ncclBfloat16, ncclSum,
                        comm_.comm, call.stream);
  if (r == ncclSuccess)
    r = ops_.all_reduce(control_local_.data(), control_reduced_.data(), control_local_.size(),
                        ncclUint32, ncclMax, comm_.comm, call.stream);
  const ncclResult_t end = ops_.group_end();
  if (r == ncclSuccess) r = end;
  if (r != ncclSuccess) {
    DQ_WARN(Subsys::kEngine, "dynamiq: statistics all-reduce failed on rank %d: %s", comm_.rank,
            ops_.error_string(r));
    return r;
  }
  *decision = decide_control(control_reduced_.data());
  return ncclSuccess;
}

// ---- the compressed all-reduce --------------------------------------------------------------
Status Engine::stage_compute(Plan& p, int block, int stage, const CallArgs& call) {
  Plan::Block& b = p.blocks[block];
  const Plan::Stage& st = p.stages[stage];
  const size_t esize = dtype_size(p.dtype);
  const ConstTensor own{static_cast<const uint8_t*>(call.send) + b.begin * esize, p.dtype, b.count};
  switch (st.kind) {
    case Plan::StageKind::kReduce:
    case Plan::StageKind::kSink:
      for (const Plan::HopJob& h : st.hops) {
        for (size_t i = 0; i < h.in_slots.size(); ++i)
          p.inputs[i] = ByteView{b.arena + static_cast<size_t>(h.in_slots[i]) * b.cap, b.cap};
        RoundingKey key = h.key;
        key.call = call_seq_;
        DQ_CHECK(device_->hop(*b.codec, h.chunk, own, p.inputs.data(),
                              static_cast<int>(h.in_slots.size()),
                              b.arena + static_cast<size_t>(h.out_slot) * b.cap, key, call.stream));
      }
      return Status::kOk;
    case Plan::StageKind::kGather:
      for (const Plan::Xfer& x : st.sends)
        for (size_t j = 0; j < x.chunks.size() && x.first_slot != x.chunks[0]; ++j)
          DQ_CHECK(device_->copy(b.arena + (x.first_slot + j) * b.cap,
                                 b.arena + static_cast<size_t>(x.chunks[j]) * b.cap, b.cap,
                                 call.stream));
      return Status::kOk;
    case Plan::StageKind::kFinish: {
      const ReduceOp op = call.op == ncclAvg ? ReduceOp::kAvg : ReduceOp::kSum;
      void* out = static_cast<uint8_t*>(call.recv) + b.begin * esize;
      // finish() writes the chunk's elements at their positions in a tensor of b.count elements.
      for (int c = 0; c < p.schedule.n_chunks; ++c)
        DQ_CHECK(device_->finish(*b.codec, c,
                                 ByteView{b.arena + static_cast<size_t>(c) * b.cap, b.cap}, out,
                                 p.dtype, op, comm_.nranks, call.stream));
      return Status::kOk;
    }
  }
  return Status::kInternal;
}

ncclResult_t Engine::stage_comm(Plan& p, int block, int stage, cudaStream_t stream,
                                uint64_t* wire_bytes) {
  Plan::Block& b = p.blocks[block];
  const Plan::Stage& st = p.stages[stage];
  if (st.sends.empty() && st.recvs.empty()) return ncclSuccess;
  ncclResult_t r = ops_.group_start();
  for (const Plan::Xfer& x : st.sends) {
    if (r != ncclSuccess) break;
    const size_t bytes = x.chunks.size() * b.cap;
    r = ops_.send(b.arena + static_cast<size_t>(x.first_slot) * b.cap, bytes, ncclUint8, x.peer,
                  comm_.comm, stream);
    *wire_bytes += bytes;
  }
  for (const Plan::Xfer& x : st.recvs) {
    if (r != ncclSuccess) break;
    r = ops_.recv(b.arena + static_cast<size_t>(x.first_slot) * b.cap, x.chunks.size() * b.cap,
                  ncclUint8, x.peer, comm_.comm, stream);
  }
  const ncclResult_t end = ops_.group_end();
  if (r == ncclSuccess) r = end;
  if (r != ncclSuccess) return r;
  if (st.kind == Plan::StageKind::kGather)
    for (const Plan::Xfer& x : st.recvs)
      for (size_t j = 0; j < x.chunks.size() && x.first_slot != x.chunks[0]; ++j)
        if (device_->copy(b.arena + static_cast<size_t>(x.chunks[j]) * b.cap,
                          b.arena + (x.first_slot + j) * b.cap, b.cap, stream) != Status::kOk)
          return ncclInternalError;
  return ncclSuccess;
}

ncclResult_t Engine::compressed(Plan& p, const CallArgs& call, uint64_t* wire_bytes) {
  // Units (stage, block) in stage-major order. compute(u + 1) depends on comm(u) only when both
  // belong to the same block, so with several blocks the next block's hops run while this
  // block's messages are in flight.
  const int n_blocks = static_cast<int>(p.blocks.size());
  const int n_units = static_cast<int>(p.stages.size()) * n_blocks;
  auto unit_block = [&](int u) { return u % n_blocks; };
  auto unit_stage = [&](int u) { return u / n_blocks; };
  Status computed = stage_compute(p, 0, 0, call);
  if (computed != Status::kOk) return engine_failure(computed);
  tbb::task_group overlap;
  for (int u = 0; u < n_units; ++u) {
    const int next = u + 1;
    const bool has_next = next < n_units;
    const bool parallel = has_next && n_blocks > 1;
    Status next_status = Status::kOk;
    if (parallel)
      overlap.run(
          [&] { next_status = stage_compute(p, unit_block(next), unit_stage(next), call); });
    const ncclResult_t r = stage_comm(p, unit_block(u), unit_stage(u), call.stream, wire_bytes);
    if (parallel) overlap.wait();
    if (r != ncclSuccess) {
      DQ_WARN(Subsys::kEngine, "dynamiq: rank %d: point-to-point failed in stage %d: %s",
              comm_.rank, unit_stage(u), ops_.error_string(r));
      return r;
    }
    if (has_next && !parallel)
      next_status = stage_compute(p, unit_block(next), unit_stage(next), call);
    if (next_status != Status::kOk) {
      DQ_WARN(Subsys::kEngine, "dynamiq: rank %d: codec step failed in stage %d", comm_.rank,
              unit_stage(next));
      return engine_failure(next_status);
    }
  }
  return ncclSuccess;
}

ncclResult_t Engine::all_reduce(const CallArgs& call, PassReason* reason) {
  const auto t0 = std::chrono::steady_clock::now();
  *reason = PassReason::kSingleRank;
  if (comm_.nranks >= 2 && device_ != nullptr && state_ == State::kPending && !call.in_group &&
      !call.capturing) {
    const ncclResult_t r = handshake(call.stream);
    if (r != ncclSuccess) return r;
  }
  *reason = screen(call);
  if (*reason != PassReason::kRerouted) {
    count(*reason);
    return ncclSuccess;
  }
  const DType dtype = call.dtype == ncclFloat32 ? DType::kF32 : DType::kBF16;
  Status status;
  Plan* plan = plan_for(call.count, dtype, &status);
  if (plan == nullptr || !plan->fits) {
    // Identical on every rank: planning depends on (count, dtype, settings) alone. (A failed
    // payload allocation is local; it keeps the plan and travels in the control words.)
    *reason = plan == nullptr ? PassReason::kFailure : PassReason::kOverBudget;
    count(*reason);
    return ncclSuccess;
  }
  ControlDecision decision;
  const auto t_plan = std::chrono::steady_clock::now();
  {
    const ncclResult_t r = exchange(plan, call, &decision);
    if (r != ncclSuccess) return r;
  }
  const auto t_exchange = std::chrono::steady_clock::now();
  const uint64_t call_index = call_seq_++;
  if (!decision.agreed) {
    warn_differs(decision.differs);
    *reason = PassReason::kSettingsDiffer;
  } else if (decision.any_failure) {
    *reason = PassReason::kFailure;
  } else if (!decision.switch_on) {
    *reason = PassReason::kSwitchOff;
  } else if (!decision.enabled) {
    *reason = PassReason::kDisabled;
  }
  if (*reason != PassReason::kRerouted) {
    count(*reason);
    return ncclSuccess;
  }
  for (Plan::Block& b : plan->blocks)
    if (device_->agree(*b.codec,
                       b.codec->stats_words() ? plan->stats_reduced + b.stats_offset : nullptr,
                       call_index, call.stream) != Status::kOk)
      return ncclInternalError;  // deterministic on agreed bytes: every rank fails alike
  uint64_t wire = 2 * plan->stats_words * (comm_.nranks - 1) * 2 / comm_.nranks +
                  control_local_.size() * 4;  // statistics as a ring all-reduce would send them
  const auto t_agree = std::chrono::steady_clock::now();
  const ncclResult_t r = compressed(*plan, call, &wire);
  if (r != ncclSuccess) return r;
  if (log_enabled(LogLevel::kTrace, Subsys::kEngine)) {
    auto ms = [](auto a, auto b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    const auto t_end = std::chrono::steady_clock::now();
    DQ_TRACE(Subsys::kEngine,
             "dynamiq: call %llu rank %d count %zu: plan %.2f ms, statistics + control %.2f ms, "
             "agree %.2f ms, hops + messages %.2f ms, %llu bytes sent",
             static_cast<unsigned long long>(call_index), comm_.rank, call.count, ms(t0, t_plan),
             ms(t_plan, t_exchange), ms(t_exchange, t_agree), ms(t_agree, t_end),
             static_cast<unsigned long long>(wire));
  }
  count(PassReason::kRerouted);
  if (metrics_) {
    metrics_->bytes_in.fetch_add(call.count * dtype_size(dtype), std::memory_order_relaxed);
    metrics_->wire_bytes.fetch_add(wire, std::memory_order_relaxed);
    metrics_->nanoseconds.fetch_add(
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - t0)
                                  .count()),
        std::memory_order_relaxed);
  }
  return ncclSuccess;
}

}  // namespace dq::engine
