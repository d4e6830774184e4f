// Planning: a call shape's schedule, program, codec parts and buffers, made once and cached
// (docs/ENGINE.md section 3, step 1), and agreed by every rank before first use (section 2).
#include <algorithm>

#include "shim/engine/engine_internal.h"
#include "shim/engine/program.h"

namespace dq::engine {

topo::Kind Engine::kind_for(Collective collective) const {
  const int n = comm_.nranks;
  const bool pow2 = n > 0 && (n & (n - 1)) == 0;
  if (collective == Collective::kReduceScatter && kind_ == topo::Kind::kButterfly && !pow2)
    return topo::Kind::kRing;
  return kind_;
}

// Blocks of whole super-groups of each part (pipeline_block_elems: at least what their chunk
// messages need to compress, a ring's n chunks for an all-reduce, one for a reduce-scatter's
// part); the last block takes the remainder (up to twice the size). DYNAMIQ_BLOCK_BYTES counts the
// caller's bytes: a reduce-scatter block spans one slice of every rank block.
Status Engine::cut_blocks(const CallArgs& call, Plan& p) {
  const topo::Schedule& sched = p.program.schedule;
  const int n = comm_.nranks, n_chunks = sched.n_chunks;
  const bool scatter = call.collective == Collective::kReduceScatter;
  const size_t esize = dtype_size(p.dtype);
  const size_t span = scatter ? call.count / n : call.count;  // elements a part is cut from
  const size_t block_elems = pipeline_block_elems(static_cast<uint64_t>(settings_.block_bytes),
                                                  esize, scatter ? n : 1, scatter ? 1 : n_chunks);
  const size_t n_blocks = std::max<size_t>(1, span / block_elems);
  const uint64_t padded_span = (span + 255) / 256 * 256;  // keeps key bases multiples of 256
  for (size_t b = 0; b < n_blocks; ++b) {
    Plan::Block blk;
    const size_t begin = b * block_elems;
    const size_t count = b + 1 == n_blocks ? span - begin : block_elems;
    const int subs = sub_blocks_for(call.collective, count, n_chunks);
    for (int part_index = 0; part_index < (scatter ? n_chunks : 1); ++part_index) {
      Plan::Part part;
      const int owner = scatter ? sched.sink_worker[part_index] : 0;
      part.in_begin = static_cast<size_t>(owner) * span + begin;
      part.out_begin = begin;
      part.count = count;
      part.key_base = static_cast<uint64_t>(owner) * padded_span + begin;
      part.codec = make_codec(p.spec);
      if (!part.codec) {
        DQ_WARN(Subsys::kEngine, "dynamiq: codec %s: not in this build",
                codec_spec_text(p.spec).c_str());
        return Status::kInternal;
      }
      const int part_chunks = scatter ? 1 : n_chunks * subs;
      part.chunks = part_chunks;
      if (const Status s = part.codec->plan(count, part_chunks, n); s != Status::kOk) return s;
      part.prepared = device_->prepare(*part.codec);
      if (p.mx_fallback()) {
        part.stats_codec = make_codec(settings_.parsed_codec_spec);
        if (!part.stats_codec) return Status::kInternal;
        if (const Status s = part.stats_codec->plan(count, part_chunks, n); s != Status::kOk)
          return s;
        part.stats_prepared = device_->prepare(*part.stats_codec);
      }
      // Too few super-groups per chunk message (kernels/codec.h) pass through: over_budget.
      p.fits = p.fits && part.codec->fits_budget() && chunks_large_enough(count, part_chunks);
      blk.cap = part.codec->chunk_capacity();  // a function of (count, budget): equal for all
      part.stats_offset = p.stats_words;
      // Its words in the plan's spans: a run of BF16 words, then its byte-summed count words
      // (none below 16 workers), each extending the last span where it is of the same kind (one
      // all-reduce for all of them).
      auto append = [&p](size_t words, bool bytes) {
        if (words == 0) return;
        if (!p.stats_spans.empty() && p.stats_spans.back().bytes == bytes)
          p.stats_spans.back().words += words;
        else
          p.stats_spans.push_back({p.stats_words, words, bytes});
        p.stats_words += words;
      };
      const size_t words = part.stats_source().stats_words();
      const size_t byte_words = part.stats_source().stats_byte_sum_words();
      append(words - byte_words, false);
      append(byte_words, true);
      blk.parts.push_back(std::move(part));
    }
    const size_t cap = blk.cap;
    const int owner = static_cast<int>(p.blocks.size());
    p.blocks.push_back(std::move(blk));
    for (int sub = 1; sub < subs; ++sub) {
      Plan::Block shared;
      shared.cap = cap;
      shared.owner = owner;
      shared.chunk_offset = sub * n_chunks;
      p.blocks.push_back(std::move(shared));
    }
  }
  return Status::kOk;
}

// Sub-blocks of an all-reduce block of `count` elements (Engine::sub_blocks_): as many as asked
// for that leave every chunk of the shared part at least 1024 super-groups; 1 (the block its own
// part) for every other collective, and in a flat engine. Each chunk costs its header and up to
// one widest record of slack (~0.5 KiB) out of the budget, ~0.3% of a 1024-super-group chunk at
// 5 bits; on the real corpus (4 x 2 ranks, butterfly, step 40) 2-MiB-value parts in 16 sub-blocks
// of 4 chunks (128 super-groups each) raised the two-level vNMSE by 12%, in 2 by 1%.
int Engine::sub_blocks_for(Collective collective, size_t count, int n_chunks) const {
  constexpr size_t kMinSuperGroupsPerSubChunk = 1024;
  if (collective != Collective::kAllReduce) return 1;
  const size_t n_sg = (count + 255) / 256;
  int subs = sub_blocks_;
  while (subs > 1 && n_sg / (static_cast<size_t>(n_chunks) * subs) < kMinSuperGroupsPerSubChunk)
    --subs;
  return subs;
}

// The plan's device memory: per block its payload arena and each part's layout, and the two
// statistics buffers. Stops at the first failure; what was allocated is counted in held_bytes
// (retire() releases it).
Status Engine::allocate_plan(Plan& p) {
  Status status = Status::kOk;
  auto alloc = [&](size_t bytes, void** out) {
    if (status != Status::kOk) return;
    status = device_->alloc(std::max<size_t>(bytes, 1), out);
    if (status == Status::kOk) p.held_bytes += std::max<size_t>(bytes, 1);
  };
  double arena_mb = 0;
  size_t n_parts = 0;
  for (Plan::Block& b : p.blocks) {
    n_parts += b.parts.size();
    void* arena = nullptr;
    alloc(static_cast<size_t>(p.program.slots) * b.cap, &arena);
    b.arena = static_cast<uint8_t*>(arena);
    for (Plan::Part& part : b.parts) alloc(part.codec->layout_bytes(), &part.layout);
    arena_mb += 1e-6 * static_cast<double>(p.program.slots) * b.cap;
  }
  void* words = nullptr;
  alloc(p.stats_words * 2, &words);
  p.stats_local = static_cast<uint16_t*>(words);
  words = nullptr;
  alloc(p.stats_words * 2, &words);
  p.stats_reduced = static_cast<uint16_t*>(words);
  if (status == Status::kOk) status = prepare_part_steps(p);
  if (metrics_) metrics_->held_bytes.fetch_add(static_cast<int64_t>(p.held_bytes));
  if (status == Status::kOk)
    DQ_INFO(Subsys::kEngine,
            "dynamiq: plan rank %d/%d %s count %zu, %s at %g bits %s: %s, %zu block(s), %zu "
            "codec part(s), %d chunk(s) of %zu B, %d slots (%.1f MB of payload buffers), %zu "
            "statistics words",
            comm_.rank, comm_.nranks, collective_name(p.collective), p.count,
            codec_spec_text(p.spec).c_str(), p.bits, dtype_label(p.dtype),
            topo::kind_name(kind_for(p.collective)), p.blocks.size(), n_parts,
            p.program.schedule.n_chunks, p.blocks.front().cap, p.program.slots, arena_mb,
            p.stats_words);
  return status;
}

// Every part's statistics and layout steps, prepared for the device once: each kind then runs
// as one step a call. An MX fallback's parts compute their (DynamiQ) statistics only on the
// calls that want them, so its plan holds a second list without them.
Status Engine::prepare_part_steps(Plan& p) {
  std::vector<PartSteps> steps;
  bool any_optional_stats = false;
  for (Plan::Block& b : p.blocks)
    for (Plan::Part& part : b.parts) {
      PartSteps s;
      s.codec = part.prepared.get();
      if (part.stats_source().stats_words() > 0) {
        s.stats_codec = &part.stats_source_prepared();
        any_optional_stats = any_optional_stats || part.stats_codec != nullptr;
      }
      s.offset = part.in_begin;
      s.count = part.count;
      s.stats = p.stats_local + part.stats_offset;
      if (part.codec->stats_words() > 0) s.reduced = p.stats_reduced + part.stats_offset;
      s.layout = part.layout;
      steps.push_back(s);
    }
  std::vector<PartSteps> without_stats;
  if (any_optional_stats) {
    without_stats = steps;
    for (size_t i = 0; i < steps.size(); ++i)
      if (steps[i].stats_codec != steps[i].codec) without_stats[i].stats_codec = nullptr;
  }
  // What a failing prepare_parts allocated is counted and retired with the plan all the same.
  auto prepare = [&](std::vector<PartSteps> list, std::unique_ptr<PreparedParts>* out) {
    const Status s = device_->prepare_parts(std::move(list), p.dtype, out);
    if (*out) p.held_bytes += (*out)->device_bytes;
    return s != Status::kOk || *out ? s : Status::kInternal;
  };
  DQ_CHECK(prepare(std::move(steps), &p.part_steps));
  p.stats_steps[0] = p.stats_steps[1] = p.part_steps.get();
  if (any_optional_stats) {
    DQ_CHECK(prepare(std::move(without_stats), &p.part_steps_without_stats));
    p.stats_steps[0] = p.part_steps_without_stats.get();
  }
  return Status::kOk;
}

std::unique_ptr<Engine::Plan> Engine::build_plan(const CallArgs& call, DType dtype, double bits,
                                                 const CodecSpec& spec, Status* status) {
  auto plan = std::make_unique<Plan>();
  Plan& p = *plan;
  p.collective = call.collective;
  p.root = call.root;
  p.count = call.count;
  p.dtype = dtype;
  p.bits = bits;
  p.spec = spec;
  // An MX candidate of a DynamiQ communicator (auto's fallback) keeps computing the statistics.
  p.mx_error = settings_.codec == "dynamiq" ? mx_rounding_error(codec_spec_text(spec)) : 0.0;
  if ((*status = compile_program(kind_for(call.collective), comm_.nranks, comm_.rank,
                                 static_cast<uint64_t>(settings_.seed), call.collective, call.root,
                                 &p.program)) != Status::kOk)
    return plan;
  if ((*status = cut_blocks(call, p)) != Status::kOk) return plan;
  p.inputs.resize(p.program.max_inputs + 1);
  p.block_wait.assign(p.blocks.size(), nullptr);
  if (!p.fits) return plan;  // passes through: no buffers
  if ((*status = allocate_plan(p)) != Status::kOk) return plan;
  // The events its calls record between the streams, made now, so that a failure to make one is
  // agreed with the plan: made at the call, after its control all-reduce was enqueued, it failed
  // the call on one rank while its peers' messages waited for that rank's.
  *status = ensure_events(2 * p.program.stages.size() * p.blocks.size());
  return plan;
}

void Engine::retire(std::unique_ptr<Plan> plan) {
  if (!plan || device_ == nullptr) return;
  // Stream-ordered: the comm stream waits for the last codec step, then frees.
  device_->wait(comm_stream_, ev_compute_done_);
  for (Plan::Block& b : plan->blocks) {
    device_->release(b.arena, comm_stream_);
    for (Plan::Part& part : b.parts) device_->release(part.layout, comm_stream_);
  }
  device_->release(plan->stats_local, comm_stream_);
  device_->release(plan->stats_reduced, comm_stream_);
  for (auto* steps : {plan->part_steps.get(), plan->part_steps_without_stats.get()})
    if (steps != nullptr) device_->release(steps->device_memory, comm_stream_);
  if (metrics_) metrics_->held_bytes.fetch_sub(static_cast<int64_t>(plan->held_bytes));
  // The host objects last until the comm stream, which now waits for the compute stream's last
  // step, has passed this point: a call still in flight (the host runs a control window ahead)
  // may hold references to them in queued steps.
  reap_retired();
  RetiredPlan r{std::move(plan), nullptr};
  if (device_->create_event(&r.done) != Status::kOk ||
      device_->record(r.done, comm_stream_) != Status::kOk) {
    if (r.done != nullptr) device_->destroy_event(r.done);
    r.done = nullptr;
  }
  retired_.push_back(std::move(r));
}

// Retired plans whose event completed: their host objects go now (no wait).
void Engine::reap_retired() {
  auto it = std::remove_if(retired_.begin(), retired_.end(), [&](RetiredPlan& r) {
    if (r.done == nullptr || !device_->query(r.done)) return false;
    device_->destroy_event(r.done);
    r.plan.reset();
    return true;
  });
  retired_.erase(it, retired_.end());
}

// The canary, at the communicator's first plan (its first call that would be compressed; the same
// call on every rank): this rank's verdict joins the plan's agreement, so no rank compresses
// unless every rank's device matched the host codec. It waits for the device once, here; later
// calls never run it.
CanaryResult Engine::run_canaries() {
  CanaryResult canary;
  if (canary_agreed_ || !device_->needs_canary()) return canary;
  canary = run_canary(device_, settings_.parsed_codec_spec, compute_stream_,
                      static_cast<uint64_t>(settings_.seed));
  // Auto may send a bucket as an MX format: those kernels must match the host codec too.
  for (int c = kLadderRungs; settings_.bits_auto && c < kCandidates && !canary.differs; ++c) {
    CanaryResult mx = run_canary(device_, candidate_specs_[c], compute_stream_,
                                 static_cast<uint64_t>(settings_.seed));
    if (mx.differs) canary = std::move(mx);
  }
  return canary;
}

// The first agreement's canary verdict (any[1]: some rank's canary failed): the communicator's
// canary state, and one warning on each rank when it failed.
void Engine::settle_canary(const CanaryResult& canary, bool any_failed) {
  canary_agreed_ = true;
  canary_ = any_failed ? Canary::kFailed : canary.ran ? Canary::kPassed : Canary::kNotRun;
  if (canary.differs)
    DQ_WARN(Subsys::kEngine,
            "dynamiq: rank %d of %d: canary: %s on the %s device: this communicator passes "
            "every call through to NCCL (the device's kernels do not reproduce the host codec: "
            "a driver, compiler or architecture they were not checked on)",
            comm_.rank, comm_.nranks, canary.describe().c_str(), device_->name());
  else if (any_failed)
    DQ_WARN(Subsys::kEngine,
            "dynamiq: rank %d of %d: canary: another rank's device does not reproduce the host "
            "codec (its warning names the first differing byte): this communicator passes "
            "every call through to NCCL",
            comm_.rank, comm_.nranks);
}

// The shapes of the latest evicted plans (four times as many as the cache holds, at least 64), so
// that a plan made again for one of them counts as a re-plan: the cache is too small for the
// shapes the job cycles through. Every rank makes and evicts the same plans, so every rank counts
// alike.
void Engine::remember_evicted(const Plan& p) {
  evicted_.push_back(p.shape());
  const size_t keep = std::max<size_t>(64, 4 * static_cast<size_t>(settings_.plan_cache));
  while (evicted_.size() > keep) evicted_.pop_front();
}

void Engine::note_plan_miss(const PlanShape& shape) {
  if (metrics_) metrics_->plans_made.fetch_add(1, std::memory_order_relaxed);
  const auto again = std::find(evicted_.begin(), evicted_.end(), shape);
  if (again == evicted_.end()) return;
  evicted_.erase(again);
  ++replans_;
  if (metrics_) metrics_->replans.fetch_add(1, std::memory_order_relaxed);
  if (replans_ == static_cast<uint64_t>(settings_.plan_cache))
    DQ_WARN(Subsys::kEngine,
            "dynamiq: communicator %s: %llu plans were made again after their eviction: the job "
            "cycles through more call shapes than DYNAMIQ_PLAN_CACHE = %lld holds, and each "
            "re-plan waits for the device and allocates new buffers; raise DYNAMIQ_PLAN_CACHE "
            "(every rank alike) to keep them",
            label_.c_str(), static_cast<unsigned long long>(replans_),
            static_cast<long long>(settings_.plan_cache));
}

Engine::Plan* Engine::plan_for(const CallArgs& call, DType dtype, double bits,
                               const CodecSpec& spec, Bucket* bucket, ncclResult_t* nccl_failure) {
  *nccl_failure = ncclSuccess;
  const size_t count = call.count;
  const PlanShape shape{call.collective, call.root, count, dtype, bits, spec};
  for (auto it = plans_.begin(); it != plans_.end(); ++it)
    if ((*it)->shape() == shape) {
      plans_.splice(plans_.begin(), plans_, it);  // most recently used first
      Plan* cached = plans_.front().get();
      // A bucket let go since its plan was made (evicted from the bucket cache) is set up again
      // with the cached plan, agreed as with a new one: otherwise nothing would set it up, and
      // its calls would stay at the default budget without a prediction.
      if (bucket != nullptr && bucket->job == nullptr && cached->fits) {
        const uint32_t local = init_bucket(*bucket, *cached) == Status::kOk ? 0u : 1u;
        uint32_t any = 0;
        *nccl_failure = blocking_max(&local, &any, 1);
        if (*nccl_failure != ncclSuccess) return nullptr;
        if (any != 0) release_bucket(*bucket);  // no prediction this call; the next one retries
      }
      return cached;
    }
  auto failed = std::find_if(failed_shapes_.begin(), failed_shapes_.end(),
                             [&](const FailedShape& f) { return f.shape == shape; });
  // Every rank counts the same calls of the shape: no agreement needed.
  if (failed != failed_shapes_.end() && !failed->backoff.take()) return nullptr;
  note_plan_miss(shape);
  const CanaryResult canary = run_canaries();
  // A new plan is agreed before any rank uses it: a failure on one rank (an allocation) must
  // not send that rank alone down the pass-through path while its peers compress. Word 0: this
  // rank's planning failure; word 1: its canary failed (0 on a device without one, and after the
  // first plan).
  Status status = Status::kOk;
  std::unique_ptr<Plan> plan = build_plan(call, dtype, bits, spec, &status);
  // A bucket's first plan also sets the bucket up (its mapped budget block, the prediction's job
  // and result, may fail to allocate on one rank): agreed with the plan, so no rank alone skips
  // the prediction. A failed plan releases only a bucket it set up: one set up before keeps its
  // predictions (its plans at other budgets stay cached and would not set it up again).
  const bool bucket_set_up_before = bucket != nullptr && bucket->job != nullptr;
  if (status == Status::kOk && bucket != nullptr && bucket->job == nullptr && plan->fits)
    status = init_bucket(*bucket, *plan);
  const uint32_t local[2] = {status == Status::kOk ? 0u : 1u, canary.differs ? 1u : 0u};
  uint32_t any[2] = {0, 0};
  *nccl_failure = blocking_max(local, any, 2);
  if (*nccl_failure == ncclSuccess && !canary_agreed_) settle_canary(canary, any[1] != 0);
  if (*nccl_failure != ncclSuccess || any[0] != 0 || canary_ == Canary::kFailed) {
    // A rung auto chose for a bucket set up before has its own backoff (avoid_failed_rung): the
    // next predictions take the bucket's default instead, so the shape is not held back twice.
    // The default itself (rung -1: a fixed DYNAMIQ_BITS, or auto's fallback) has nothing to
    // fall back on: its shape backs off here.
    const bool rung_backoff = bucket != nullptr && bucket_set_up_before && bucket->rung >= 0;
    if (*nccl_failure == ncclSuccess && any[0] != 0 && rung_backoff)
      DQ_WARN(Subsys::kEngine,
              "dynamiq: rank %d: a plan for %zu elements could not be made on %s (this rank: "
              "%s); the call passes through on every rank, and the bucket avoids this budget "
              "for a while",
              comm_.rank, count, local[0] ? "this rank" : "another rank",
              local[0] ? status_name(status) : "ok");
    if (*nccl_failure == ncclSuccess && any[0] != 0 && !rung_backoff) {
      if (failed == failed_shapes_.end()) {
        failed_shapes_.push_front(FailedShape{shape, Backoff{}});
        if (failed_shapes_.size() > kFailedShapesKept) failed_shapes_.pop_back();
        failed = failed_shapes_.begin();
      }
      failed->backoff.failed();
      DQ_WARN(Subsys::kEngine,
              "dynamiq: rank %d: a plan for %zu elements could not be made on %s (this rank: "
              "%s); the call and the next %u of its shape pass through on every rank, then one "
              "retries",
              comm_.rank, count, local[0] ? "this rank" : "another rank",
              local[0] ? status_name(status) : "ok", failed->backoff.skips_left());
    }
    retire(std::move(plan));
    if (bucket != nullptr && !bucket_set_up_before) release_bucket(*bucket);
    if (bucket != nullptr && bucket_set_up_before) avoid_failed_rung(*bucket);
    return nullptr;
  }
  if (bucket != nullptr) bucket->backoff.made(bucket->rung);
  if (failed != failed_shapes_.end()) failed_shapes_.erase(failed);
  plans_.push_front(std::move(plan));
  if (plans_.size() > static_cast<size_t>(settings_.plan_cache)) {
    remember_evicted(*plans_.back());
    retire(std::move(plans_.back()));
    plans_.pop_back();
  }
  return plans_.front().get();
}

}  // namespace dq::engine
