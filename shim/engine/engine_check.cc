// The sampled check (DYNAMIQ_CHECK_EVERY, docs/ENGINE.md section 10): 64 super-groups of every
// K-th compressed all-reduce, summed exactly by NCCL, against the call's output; the sampled
// vNMSE paired with the call's predicted vNMSE.
#include <algorithm>
#include <cmath>

#include "common/splitmix.h"
#include "kernels/bf16.h"
#include "shim/engine/engine_internal.h"

namespace dq::engine {

Status Engine::enqueue_check_gather(const CallArgs& call, DType dtype, uint64_t call_index) {
  Check& c = *check_;
  const size_t esize = dtype_size(dtype), bytes = 256 * esize;
  // Whole super-groups only, evenly spaced from an offset drawn per call.
  const size_t full = call.count / 256;
  c.groups = std::min(Check::kSuperGroups, full);
  const size_t stride = full / c.groups;
  const size_t offset = static_cast<size_t>(
      splitmix64(static_cast<uint64_t>(settings_.seed) ^ (call_index << 20)) % full);
  c.first.clear();
  const Lane lane{comm_stream_, control_ + error_word_index()};
  for (size_t i = 0; i < c.groups; ++i) {
    const size_t g = (offset + i * stride) % full;
    c.first.push_back(g * 256);
    DQ_CHECK(device_->copy(static_cast<uint8_t*>(c.in) + i * bytes,
                           static_cast<const uint8_t*>(call.send) + g * bytes, bytes, lane));
  }
  // The codec steps (which may write the output over an in-place input) start after the copies.
  DQ_CHECK(device_->record(c.gathered, comm_stream_));
  DQ_CHECK(device_->wait(compute_stream_, c.gathered));
  c.call_index = call_index;
  c.dtype = dtype;
  c.has_call = true;
  c.sampled = c.predicted = -1;
  c.paired = false;
  return Status::kOk;
}

Status Engine::enqueue_check_finish(const CallArgs& call, uint64_t* wire_bytes) {
  Check& c = *check_;
  const size_t esize = dtype_size(c.dtype), bytes = 256 * esize, elems = c.groups * 256;
  const Lane comm{comm_stream_, control_ + error_word_index()};
  const Lane compute{compute_stream_, control_ + error_word_index()};
  // The exact all-reduce of the sample, after the call's messages on the comm stream (the same
  // place on every rank), with the call's dtype and op.
  const NcclOps ops = ops_;
  ncclComm_t nccl = comm_.comm;
  auto stream = static_cast<cudaStream_t>(comm_stream_);
  const void* in = c.in;
  void* exact = c.exact;
  const ncclDataType_t dtype = call.dtype;
  const ncclRedOp_t op = call.op;
  const int64_t timeout_ms = settings_.timeout_ms;
  DQ_CHECK(enqueue_nccl(comm, [=] {
    return ops.settled(nccl, ops.all_reduce(in, exact, elems, dtype, op, nccl, stream), timeout_ms);
  }));
  DQ_CHECK(device_->copy(c.host_exact, c.exact, elems * esize, comm));
  // The output after the call's last codec step (the compute stream is in order).
  for (size_t i = 0; i < c.groups; ++i)
    DQ_CHECK(device_->copy(static_cast<uint8_t*>(c.host_out) + i * bytes,
                           static_cast<const uint8_t*>(call.recv) + c.first[i] * esize, bytes,
                           compute));
  DQ_CHECK(device_->record(c.gathered, compute_stream_));
  DQ_CHECK(device_->wait(comm_stream_, c.gathered));
  DQ_CHECK(device_->record(c.done, comm_stream_));
  c.state = Check::State::kEnqueued;
  const size_t n = static_cast<size_t>(comm_.nranks);
  *wire_bytes += 2 * elems * esize * (n - 1) / n;
  return Status::kOk;
}

void Engine::read_check() {
  Check& c = *check_;
  c.state = Check::State::kNone;
  double err = 0, energy = 0;
  bool finite = true;
  for (size_t i = 0; i < c.groups * 256 && finite; ++i) {
    double out, exact;
    if (c.dtype == DType::kF32) {
      out = static_cast<const float*>(c.host_out)[i];
      exact = static_cast<const float*>(c.host_exact)[i];
    } else {
      out = bf16_to_f32(static_cast<const uint16_t*>(c.host_out)[i]);
      exact = bf16_to_f32(static_cast<const uint16_t*>(c.host_exact)[i]);
    }
    finite = std::isfinite(out) && std::isfinite(exact);
    err += (out - exact) * (out - exact);
    energy += exact * exact;
  }
  // A non-finite value (the input held one: the output shows it, as it must) or an all-zero
  // sample gives no vNMSE.
  const bool usable = finite && energy > 0;
  if (usable) {
    c.sampled = err / energy;
    ++window_.checked;
    window_.checked_sq_error += err;
    window_.checked_energy += energy;
  }
  if (metrics_) {
    std::lock_guard<std::mutex> lock(metrics_->budget_mutex);
    BudgetMetrics& m = metrics_->budget;
    if (!usable) {
      ++m.checked_nonfinite;
    } else {
      ++m.checked_calls;
      m.checked_sq_error += err;
      m.checked_energy += energy;
      m.checked_vnmse_last = c.sampled;
    }
  }
  DQ_TRACE(Subsys::kEngine,
           "dynamiq: rank %d check of call %llu: sampled vNMSE %.4g over %zu "
           "super-groups",
           comm_.rank, static_cast<unsigned long long>(c.call_index), usable ? c.sampled : -1.0,
           c.groups);
  pair_check();
}

void Engine::pair_check() {
  Check& c = *check_;
  if (c.paired || c.sampled < 0 || c.predicted < 0) return;
  c.paired = true;
  if (metrics_) {
    std::lock_guard<std::mutex> lock(metrics_->budget_mutex);
    BudgetMetrics& m = metrics_->budget;
    ++m.paired_calls;
    m.paired_predicted_sum += c.predicted;
    m.paired_sampled_sum += c.sampled;
  }
  DQ_INFO(Subsys::kEngine,
          "dynamiq: rank %d/%d sampled check of call %llu: vNMSE %.4g over %zu super-groups, "
          "predicted %.4g (sampled/predicted %.2f)",
          comm_.rank, comm_.nranks, static_cast<unsigned long long>(c.call_index), c.sampled,
          c.groups, c.predicted, c.predicted > 0 ? c.sampled / c.predicted : 0.0);
}

}  // namespace dq::engine
