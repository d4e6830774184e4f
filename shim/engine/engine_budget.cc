// The budget's buckets (docs/ENGINE.md section 10): per call shape, the prediction of its latest
// call, auto's choice for the next, and what the metrics and the INFO summary report of them.
#include <algorithm>
#include <cstdio>
#include <new>

#include "kernels/dynamiq_codec.h"
#include "shim/engine/engine_internal.h"

namespace dq::engine {
BucketMetrics* Engine::bucket_metrics(BudgetMetrics& m, const Bucket& b) {
  for (BucketMetrics& k : m.buckets)
    if (k.count == b.count && k.dtype == dtype_label(b.dtype) &&
        k.collective == collective_name(b.collective) && k.root == b.root)
      return &k;
  return nullptr;
}

Engine::Bucket* Engine::bucket_for(const CallArgs& call, DType dtype) {
  for (auto it = buckets_.begin(); it != buckets_.end(); ++it) {
    const Bucket& b = **it;
    if (b.count == call.count && b.dtype == dtype && b.collective == call.collective &&
        b.root == call.root) {
      buckets_.splice(buckets_.begin(), buckets_, it);  // most recently used first
      return buckets_.front().get();
    }
  }
  // Every rank makes the same calls, so every rank creates and evicts the same buckets.
  if (buckets_.size() >= kMaxBuckets) {
    release_bucket(*buckets_.back());
    buckets_.pop_back();
  }
  auto b = std::make_unique<Bucket>();
  b->collective = call.collective;
  b->root = call.root;
  b->count = call.count;
  b->dtype = dtype;
  buckets_.push_front(std::move(b));
  return buckets_.front().get();
}

// The budget's device memory grown to hold a call of `n_parts` codec parts with `key_entries` key
// entries (kernels/cuda/budget.h: 5.5 KB a part and 24 B an entry, at most one a super-group): the
// new block first, so a failure leaves the old one to the buckets it serves; the old one is then
// released in comm stream order, after the predictions queued into it. Run where init_bucket
// runs, so a failure is agreed with the plan.
Status Engine::reserve_budget_scratch(uint32_t n_parts, uint64_t key_entries) {
  const size_t need = device_->budget_scratch_bytes(n_parts, key_entries);
  if (need <= budget_scratch_bytes_ || settings_.codec != "dynamiq") return Status::kOk;
  void* grown = nullptr;
  DQ_CHECK(device_->alloc(need, &grown));
  if (budget_scratch_ != nullptr) device_->release(budget_scratch_, comm_stream_);
  budget_scratch_ = grown;
  budget_scratch_bytes_ = need;
  return Status::kOk;
}

Status Engine::init_bucket(Bucket& b, const Plan& p) {
  size_t n_parts = 0;
  uint64_t key_entries = 0;
  for (const Plan::Block& blk : p.blocks) {
    n_parts += blk.parts.size();
    for (const Plan::Part& part : blk.parts) key_entries += budget_key_entries(part.count);
  }
  DQ_CHECK(reserve_budget_scratch(static_cast<uint32_t>(n_parts), key_entries));
  b.parts.clear();
  b.rung = -1;
  b.stats_pending = false;
  for (const Plan::Block& blk : p.blocks)
    for (const Plan::Part& part : blk.parts) {
      Bucket::Part bp;
      bp.count = part.count;
      bp.stats_offset = part.stats_offset;
      bp.chunks = part.chunks;
      b.parts.push_back(bp);
    }
  b.stats_words = p.stats_words;
  const topo::Schedule& schedule = p.program.schedule;
  const HopTables* hop = nullptr;
  for (const auto& [kind, tables] : hop_tables_)
    if (kind == schedule.kind) hop = &tables;
  if (hop == nullptr) hop = &hop_tables_.emplace_back(schedule.kind, hop_profile(schedule)).second;
  // The mapped block: the job, its parts, the hop tables, the result (each a multiple of 8
  // bytes).
  const size_t parts_at = sizeof(BudgetJob);
  const size_t hop_at = parts_at + b.parts.size() * sizeof(BudgetPartJob);
  const size_t hop_entries = hop->linear.size();
  const size_t result_at = hop_at + 2 * hop_entries * sizeof(double);
  static_assert(sizeof(BudgetJob) % 8 == 0 && sizeof(BudgetPartJob) % 8 == 0, "alignment");
  DQ_CHECK(device_->alloc_mapped(result_at + sizeof(BudgetResult), &b.budget_block));
  auto* base = static_cast<unsigned char*>(b.budget_block);
  b.job = new (base) BudgetJob();
  b.part_jobs = reinterpret_cast<BudgetPartJob*>(base + parts_at);
  auto* hop_linear = reinterpret_cast<double*>(base + hop_at);
  std::copy(hop->linear.begin(), hop->linear.end(), hop_linear);
  std::copy(hop->square.begin(), hop->square.end(), hop_linear + hop_entries);
  b.result = new (base + result_at) BudgetResult();
  b.job->n_parts = static_cast<uint32_t>(b.parts.size());
  b.job->n_workers = comm_.nranks;
  b.job->auto_budget = settings_.bits_auto ? 1 : 0;
  b.job->hop = HopProfile{hop_linear, hop_linear + hop_entries};
  b.job->target = target_;
  b.job->parts = b.part_jobs;
  for (size_t i = 0; i < b.parts.size(); ++i) {
    const Bucket::Part& bp = b.parts[i];
    BudgetPartJob* job = new (&b.part_jobs[i]) BudgetPartJob();
    job->count = bp.count;
    job->stats_offset = bp.stats_offset;
    // Every rung's plan of every part, made once: auto's prediction then costs no codec.
    for (int c = 0; settings_.bits_auto && c < kCandidates; ++c) {
      bool fits = false;
      if (plan_candidate(c, bp.count, bp.chunks, comm_.nranks,
                         candidate_is_mx(c) ? nullptr : &job->rungs[c], &fits))
        job->fits[c] = fits ? 1 : 0;
    }
  }
  if (metrics_) {
    std::lock_guard<std::mutex> lock(metrics_->budget_mutex);
    std::vector<BucketMetrics>& list = metrics_->budget.buckets;
    if (bucket_metrics(metrics_->budget, b) == nullptr) {
      if (list.size() >= kMaxBuckets) list.erase(list.begin());
      BucketMetrics m;
      m.collective = collective_name(b.collective);
      m.dtype = dtype_label(b.dtype);
      m.count = b.count;
      m.root = b.root;
      list.push_back(m);
    }
  }
  return Status::kOk;
}

void Engine::release_bucket(Bucket& b) {
  // Stream-ordered: a prediction into it may still be queued on the comm stream.
  if (b.budget_block != nullptr && device_ != nullptr)
    device_->release(b.budget_block, comm_stream_);
  b.budget_block = nullptr;
  b.job = nullptr;
  b.part_jobs = nullptr;
  b.result = nullptr;
  b.stats_pending = false;
  b.rung = -1;
  b.parts.clear();
  b.calls_since_stats = 0;
}

void Engine::avoid_failed_rung(Bucket& b) {
  b.backoff.failed(b.rung);
  b.rung = -1;  // the next call takes the default, whose plan the bucket's first call made
}

bool Engine::stage_budget(Bucket& b, const Plan& p) {
  if (b.job == nullptr || b.stats_words != p.stats_words) return false;
  b.job->used_mx = p.mx_error;
  size_t i = 0;
  for (const Plan::Block& blk : p.blocks)
    for (const Plan::Part& part : blk.parts) {
      if (i >= b.parts.size() || part.count != b.parts[i].count) return false;
      DynamiqOptions options;
      if (!p.mx_fallback() && !dynamiq_parameters(*part.codec, &options, &b.part_jobs[i].used))
        return false;
      ++i;
    }
  if (i != b.parts.size()) return false;
  b.result->state = kBudgetPending;
  return true;
}

void Engine::read_bucket(Bucket& b) {
  b.stats_pending = false;
  // Complete: the host waited for the control event recorded after the prediction (its sequence
  // number is below control_absorbed_).
  const BudgetResult r = *b.result;
  if (r.state != kBudgetPredicted) {
    // A non-finite statistic (a poisoned call), or a step that did not run (a failed lane): no
    // prediction, the next call takes the fixed default.
    b.rung = -1;
    return;
  }
  const double vnmse = r.used_vnmse;
  const WidthCounts widths = r.used_widths;  // none for a call sent as MX
  if (settings_.bits_auto) {
    const BudgetPrediction& prediction = r.prediction;
    if (prediction.rung != b.rung)
      DQ_TRACE(Subsys::kEngine,
               "dynamiq: rank %d %s count %zu: %s next (predicted vNMSE %.3g, target %s %.3g)",
               comm_.rank, collective_name(b.collective), b.count,
               candidate_spec(prediction.rung).c_str(), prediction.vnmse[prediction.rung],
               budget_target_name(target_).c_str(), prediction.target);
    b.rung = prediction.rung;
    if (!b.backoff.take(b.rung)) b.rung = -1;
  }
  if (check_ && check_->has_call && check_->call_index == b.predicted_call) {
    check_->predicted = vnmse;
    pair_check();  // now, or when the check is read
  }
  ++window_.predicted;
  window_.vnmse += vnmse;
  for (int w = 0; w < 4; ++w) window_.widths[w] += widths.n[w];
  if (!metrics_) return;
  std::lock_guard<std::mutex> lock(metrics_->budget_mutex);
  BudgetMetrics& m = metrics_->budget;
  for (int w = 0; w < 4; ++w) m.widths[w] += widths.n[w];
  ++m.predicted_calls;
  m.predicted_vnmse_sum += vnmse;
  m.predicted_vnmse_last = vnmse;
  if (BucketMetrics* k = bucket_metrics(m, b)) k->predicted_vnmse = vnmse;
}

void Engine::note_budget(Bucket& b, const Plan& p) {
  b.bits = p.bits;
  ++b.calls;
  ++window_.calls;
  window_.bits += p.bits;
  if (p.mx_fallback()) ++window_.mx_calls;
  if (metrics_) {
    std::lock_guard<std::mutex> lock(metrics_->budget_mutex);
    BudgetMetrics& m = metrics_->budget;
    m.bits_sum += p.bits;
    ++m.budget_calls;
    if (p.mx_fallback()) ++m.mx_calls;
    if (BucketMetrics* k = bucket_metrics(m, b)) {
      k->budget_bits = p.bits;
      k->codec = p.mx_fallback() ? codec_spec_text(p.spec) : "dynamiq";
      ++k->calls;
    }
  }
  const int64_t every = settings_.summary_calls;
  if (every <= 0 || window_.calls < static_cast<uint64_t>(every)) return;
  const Window w = window_;
  window_ = Window{};
  const double sgs = static_cast<double>(w.widths[0] + w.widths[1] + w.widths[2] + w.widths[3]);
  auto share = [&](int i) {
    return sgs > 0 ? 100.0 * static_cast<double>(w.widths[i]) / sgs : 0.0;
  };
  char checked[96] = "";
  if (w.checked > 0)
    std::snprintf(checked, sizeof checked, ", sampled check vNMSE %.3g over %llu calls",
                  w.checked_sq_error / w.checked_energy,
                  static_cast<unsigned long long>(w.checked));
  DQ_INFO(Subsys::kEngine,
          "dynamiq: rank %d/%d budget: %llu calls, %s%s mean %.2f bits, %llu sent as MX, widths "
          "2/4/8/16 bits %.1f/%.1f/%.1f/%.1f%% of super-groups, predicted vNMSE mean %.3g over "
          "%llu calls%s",
          comm_.rank, comm_.nranks, static_cast<unsigned long long>(w.calls),
          settings_.bits_auto ? "auto, target " : "fixed",
          settings_.bits_auto ? (budget_target_name(target_) + ",").c_str() : ",",
          w.bits / static_cast<double>(w.calls), static_cast<unsigned long long>(w.mx_calls),
          share(0), share(1), share(2), share(3),
          w.predicted > 0 ? w.vnmse / static_cast<double>(w.predicted) : 0.0,
          static_cast<unsigned long long>(w.predicted), checked);
}

}  // namespace dq::engine
