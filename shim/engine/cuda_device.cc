// The CUDA device (shim/engine/cuda_device.h): the engine's codec steps as the kernels of
// kernels/cuda/, with the host codec's bytes. This file is built by the host compiler against the
// CPU emulation of CUDA (kernels/cuda/EMULATION.md) for the tests; the nvcc build is part 3.
//
// What is common to both builds (shim/engine/cuda_steps.h, shared with the real device of
// shim/engine/cuda_device_gpu.cu): from a planned codec the kernels' parameters (the codec's own
// options and plan, kernels/cuda/dynamiq.h) and its level tables (built once per option set, by
// the host's builder, and kept for the device's life); the host codec's argument checks, with the
// host codec's Status; the kernels' error flags turned into that Status; and the Lane contract of
// device.h: a step does nothing once the lane's error word is
// set, and a failing step writes error_word(ErrorSource::kCodec, status) there, first failure
// wins, exactly as the host device does.
//
// What the emulated build does (below, "backend"): an emulated launch runs the whole grid on the
// calling thread before it returns, so a kernel step is a host function queued in stream order.
// Memory, streams, events, copies and NCCL calls are a host device's; a step on one of its streams
// goes into that stream's ordered queue through Device::nccl (the interface's one "run this in
// stream order" entry, in the place cudaLaunchHostFunc would have), and runs there on the
// stream's worker thread: check, launch (the step's last kernel folds its flags into the error
// word, as on a GPU), read the folded flags for the Status. On any other stream (the caller's) it
// runs at once and returns its Status, as on the host device.
//
// The real-CUDA device is a separate file (shim/engine/cuda_device_gpu.cu, nvcc): cudaMalloc /
// cudaHostAlloc(mapped) memory, cudaStream_t and cudaEvent_t, cudaMemcpyAsync copies, NCCL calls
// issued at once; each kernel step launched onto the lane's stream with a device StepWord per
// (stream, lane) whose last kernel folds the flags into the lane's mapped error word (the same
// kernels and launches as here: a step is its kernels, nothing else); the level tables copied to
// device memory once per option set. Its argument checks run at
// enqueue (the same functions as here) and a failure is written to the error word from the host.
#include "shim/engine/cuda_device.h"

#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kernels/cuda/budget.h"
#include "shim/engine/cuda_steps.h"

#if !DQ_CUDA_EMULATED
#error "shim/engine/cuda_device.cc is the emulated CUDA device; nvcc builds cuda_device_gpu.cu"
#endif

namespace dq::engine {
namespace {

// Held while a step's kernels run, by every emulated device of the process.
std::mutex& step_mutex() {
  static std::mutex m;
  return m;
}

// ---- steps: common to both builds -------------------------------------------------------------

using cuda_steps::step_status;

class CudaDevice final : public Device {
 public:
  // Loads every kernel, as the real device does at set-up; from then on the emulation refuses a
  // kernel that was not (dq::emu::require_loaded), so a kernel missing from the set-up list fails
  // the tests instead of loading mid-call on a GPU.
  CudaDevice(Device* host, EmulatedCudaFault fault) : host_(host), fault_(fault) {
    cuda_steps::load_kernels();  // cannot fail in the emulation
    dq::emu::require_loaded(true);
  }
  const char* name() const override { return "cuda (emulated)"; }
  // Kernels, not the host codec's code: the engine checks them once per communicator.
  bool needs_canary() const override { return true; }
  // One launch lays out every part of a call (or one step a part where no batch was prepared).
  bool batches_layouts() const override { return true; }

  // ---- backend: memory, streams and events are the host device's ----------------------------
  // Calls CUDA refuses while a graph capture runs (global mode) fail here too, and invalidate it.
  Status alloc(size_t bytes, void** out) override {
    if (refused_in_capture("an allocation (cudaMalloc)")) return Status::kSystemError;
    return host_->alloc(bytes, out);
  }
  Status alloc_mapped(size_t bytes, void** out) override {
    if (refused_in_capture("a mapped allocation (cudaHostAlloc)")) return Status::kSystemError;
    return host_->alloc_mapped(bytes, out);
  }
  void release(void* p, StreamHandle stream) override {
    refused_in_capture("a release (cudaFree)");  // CUDA refuses it; the memory is freed anyway
    host_->release(p, stream);
  }
  Status create_stream(StreamHandle* out) override {
    {
      std::lock_guard<std::mutex> lock(m_);
      if (fault_.streams_before_failure >= 0 && streams_made_ >= fault_.streams_before_failure)
        return Status::kSystemError;
      ++streams_made_;
    }
    DQ_CHECK(host_->create_stream(out));
    std::lock_guard<std::mutex> lock(m_);
    streams_.insert(*out);
    return Status::kOk;
  }
  void destroy_stream(StreamHandle s) override {
    {
      std::lock_guard<std::mutex> lock(m_);
      streams_.erase(s);
    }
    host_->destroy_stream(s);
  }
  Status create_event(EventHandle* out) override { return host_->create_event(out); }
  void destroy_event(EventHandle e) override { host_->destroy_event(e); }
  Status record(EventHandle e, StreamHandle s) override {
    if (captured(s, "an event record")) return Status::kSystemError;
    return host_->record(e, s);
  }
  Status wait(StreamHandle s, EventHandle e) override {
    if (captured(s, "an event wait")) return Status::kSystemError;
    return host_->wait(s, e);
  }
  Status synchronize(EventHandle e) override {
    if (refused_in_capture("cudaEventSynchronize")) return Status::kSystemError;
    return host_->synchronize(e);
  }
  Status synchronize_for(EventHandle e, int64_t timeout_ms) override {
    if (refused_in_capture("cudaEventQuery")) return Status::kSystemError;
    return host_->synchronize_for(e, timeout_ms);
  }
  bool query(EventHandle e) override {
    if (refused_in_capture("cudaEventQuery")) return false;
    return host_->query(e);
  }
  bool capturing(StreamHandle s) const override {
    std::lock_guard<std::mutex> lock(capture_m_);
    return (capture_.active && capture_.stream == s) || host_->capturing(s);
  }
  Status copy(void* dst, const void* src, size_t bytes, Lane lane) override {
    if (captured(lane.stream, "a copy")) return Status::kSystemError;
    return host_->copy(dst, src, bytes, lane);
  }
  Status nccl(Lane lane, std::function<ncclResult_t()> calls) override {
    if (captured(lane.stream, "an NCCL call")) return Status::kSystemError;
    return host_->nccl(lane, std::move(calls));
  }

  // ---- graph capture, modelled for the tests (make_emulated_cuda_device's comment) ----------
  Status begin_capture(StreamHandle s) {
    std::lock_guard<std::mutex> lock(capture_m_);
    if (capture_.active) return Status::kInvalidArgument;
    capture_ = Capture{true, s, {}};
    return Status::kOk;
  }
  Status end_capture(std::string* why) {
    std::lock_guard<std::mutex> lock(capture_m_);
    if (!capture_.active) return Status::kInvalidArgument;
    capture_.active = false;
    if (why) *why = capture_.invalidated_by;
    return capture_.invalidated_by.empty() ? Status::kOk : Status::kSystemError;
  }
  size_t budget_scratch_bytes(uint32_t n_parts, uint64_t key_entries) const override {
    return cuda::budget_scratch_bytes(n_parts, key_entries);
  }
  Status predict_budget(const BudgetJob* job, const uint16_t* reduced, void* scratch,
                        size_t scratch_bytes, BudgetResult* out, Lane lane) override {
    // The budget kernel reads the lane's error word itself, as on a GPU (it raises no flags).
    return run(lane, "budget", &counts_.budgets,
               [job, reduced, scratch, scratch_bytes, out, error = lane.error](cudaStream_t stream,
                                                                               unsigned*) {
                 return cuda_steps::step_status(
                     cuda::launch_budget(job, reduced, scratch, scratch_bytes, out, error, stream),
                     0, "budget");
               });
  }

  // ---- steps ------------------------------------------------------------------------------------
  // Each one: the codec's kernels (DynamiQ or a baseline) through cuda_steps.h's launches, which
  // check the arguments as the host codec does; a codec without kernels runs on the host codec.
  // The kernels' arguments and level tables, worked out once per plan part.
  std::unique_ptr<PreparedCodec> prepare(const Codec& codec) override {
    auto prepared = std::make_unique<Prepared>(codec);
    prepared->kernels = kernel_args(codec, &prepared->args);
    return prepared;
  }

  Status local_stats(const PreparedCodec& codec, const ConstTensor& x, uint16_t* stats,
                     Lane lane) override {
    cuda_steps::StepParams k;
    if (!args_of(codec, &k))
      return fallback([&] { return host_->local_stats(codec, x, stats, lane); });
    return run(lane, "statistics", &counts_.stats,
               [k, x, stats](cudaStream_t stream, unsigned* flags) {
                 return cuda_steps::launch_stats(k, x, stats, flags, stream);
               });
  }

  Status build_layout(const PreparedCodec& codec, const uint16_t* reduced, uint64_t call,
                      void* layout, Lane lane) override {
    cuda_steps::StepParams k;
    if (!args_of(codec, &k))
      return fallback([&] { return host_->build_layout(codec, reduced, call, layout, lane); });
    return run(lane, "layout", &counts_.layouts,
               [k, reduced, call, layout](cudaStream_t stream, unsigned* flags) {
                 return cuda_steps::launch_layout(k, reduced, call, layout, flags, stream);
               });
  }

  // The batch kernels' jobs, in a table of the device's memory (here the host's).
  Status prepare_parts(std::vector<PartSteps> parts, DType dtype,
                       std::unique_ptr<PreparedParts>* out) override {
    auto prepared = cuda_steps::batched_parts(
        std::move(parts), dtype,
        [this](const PreparedCodec& c, cuda_steps::StepParams* k) { return args_of(c, k); });
    const std::vector<unsigned char>& image = prepared->batch.image;
    if (!image.empty()) {
      DQ_CHECK(alloc(image.size(), &prepared->device_memory));
      prepared->device_bytes = image.size();
      std::memcpy(prepared->device_memory, image.data(), image.size());
    }
    *out = std::move(prepared);
    return Status::kOk;
  }

  Status parts_stats(const PreparedParts& parts, const void* input, Lane lane) override {
    bool empty;
    const auto* p = cuda_steps::stats_batch(parts, &empty);
    if (p == nullptr) return empty ? Status::kOk : Device::parts_stats(parts, input, lane);
    const bool bf16 = parts.dtype() == DType::kBF16;
    return run(lane, "statistics", &counts_.stats,
               [p, input, bf16](cudaStream_t stream, unsigned* flags) {
                 return cuda_steps::launch_part_stats(p->batch, p->device_memory, input, bf16,
                                                      flags, stream);
               });
  }

  Status parts_layouts(const PreparedParts& parts, uint64_t call, Lane lane) override {
    const auto* p = cuda_steps::layout_batch(parts);
    if (p == nullptr) return Device::parts_layouts(parts, call, lane);
    return run(lane, "layout", &counts_.layouts, [p, call](cudaStream_t stream, unsigned* flags) {
      return cuda_steps::launch_part_layouts(p->batch, p->device_memory, call, flags, stream);
    });
  }

  Status finish_chunks(const PreparedCodec& codec, const void* layout, int first_chunk,
                       int n_chunks, const uint8_t* in, size_t in_stride, size_t in_bytes,
                       void* out, DType dtype, ReduceOp op, int n_contrib, Lane lane) override {
    cuda_steps::StepParams k;
    if (!args_of(codec, &k))
      return fallback([&] {
        return host_->finish_chunks(codec, layout, first_chunk, n_chunks, in, in_stride, in_bytes,
                                    out, dtype, op, n_contrib, lane);
      });
    return run(lane, "finish", &counts_.finishes,
               [k, layout, first_chunk, n_chunks, in, in_stride, in_bytes, out, dtype, op,
                n_contrib](cudaStream_t stream, unsigned* flags) {
                 return cuda_steps::launch_finish_chunks(k, layout, first_chunk, n_chunks, in,
                                                         in_stride, in_bytes, out, dtype, op,
                                                         n_contrib, flags, stream);
               });
  }

  Status hop(const PreparedCodec& codec, const void* layout, int chunk, const ConstTensor& own,
             const ByteView* in, int n_in, uint8_t* out, const RoundingKey& key,
             Lane lane) override {
    cuda_steps::StepParams k;
    if (!args_of(codec, &k))
      return fallback(
          [&] { return host_->hop(codec, layout, chunk, own, in, n_in, out, key, lane); });
    std::vector<ByteView> inputs;  // the caller reuses its array
    if (n_in > 0 && in != nullptr) inputs.assign(in, in + n_in);
    const size_t capacity = codec.codec().chunk_capacity();
    return run(lane, "hop", &counts_.hops,
               [this, k, layout, chunk, own, inputs = std::move(inputs), n_in, out, key, capacity](
                   cudaStream_t stream, unsigned* flags) -> Status {
                 DQ_CHECK(cuda_steps::launch_hop(
                     k, layout, chunk, own, n_in > 0 && inputs.empty() ? nullptr : inputs.data(),
                     n_in, out, key, flags, stream));
                 // The test-only corrupted kernel (make_emulated_cuda_device's `fault`).
                 const bool hit = fault_.stratified_leaves ? n_in == 0 && key.strata > 1 : n_in > 0;
                 if (hit && !cuda::step_failed(*flags) && fault_.hop_output_byte >= 0 &&
                     static_cast<uint64_t>(fault_.hop_output_byte) < capacity)
                   out[fault_.hop_output_byte] ^= fault_.mask;
                 return Status::kOk;
               });
  }

  Status finish(const PreparedCodec& codec, const void* layout, int chunk, ByteView in, void* out,
                DType dtype, ReduceOp op, int n_contrib, Lane lane) override {
    cuda_steps::StepParams k;
    if (!args_of(codec, &k))
      return fallback(
          [&] { return host_->finish(codec, layout, chunk, in, out, dtype, op, n_contrib, lane); });
    return run(
        lane, "finish", &counts_.finishes,
        [k, layout, chunk, in, out, dtype, op, n_contrib](cudaStream_t stream, unsigned* flags) {
          return cuda_steps::launch_finish(k, layout, chunk, in, out, dtype, op, n_contrib, flags,
                                           stream);
        });
  }

  CudaDeviceCounts counts() const {
    CudaDeviceCounts c;
    c.stats = counts_.stats.load();
    c.layouts = counts_.layouts.load();
    c.hops = counts_.hops.load();
    c.finishes = counts_.finishes.load();
    c.host_fallbacks = counts_.host_fallbacks.load();
    c.budgets = counts_.budgets.load();
    c.launches = counts_.launches.load();
    c.hop_launches = counts_.hop_launches.load();
    return c;
  }

 private:
  // A codec prepared here: whether kernels serve it, and their arguments.
  struct Prepared final : PreparedCodec {
    using PreparedCodec::PreparedCodec;
    bool kernels = false;
    cuda_steps::StepParams args;
  };

  // The kernels' arguments of a prepared codec (worked out now for one another device prepared);
  // false when no kernels serve it.
  bool args_of(const PreparedCodec& codec, cuda_steps::StepParams* k) {
    if (const auto* p = dynamic_cast<const Prepared*>(&codec)) {
      *k = p->args;
      return p->kernels;
    }
    return kernel_args(codec.codec(), k);
  }

  // The kernels' arguments for `codec`; false when no kernels serve it.
  bool kernel_args(const Codec& codec, cuda_steps::StepParams* k) {
    const cuda_steps::Family family = cuda_steps::step_params(codec, k);
    if (family == cuda_steps::Family::kNone) return false;
    // Emulated kernels read the host tables in place.
    if (family == cuda_steps::Family::kDynamiq)
      k->levels = levels_
                      .get(k->options,
                           [](cuda_steps::LevelSet& l) {
                             l.device = l.table;
                             return true;
                           })
                      ->device;
    return true;
  }

  // A codec without kernels: the host device's step, unchanged (same stream, same error word).
  template <class F>
  Status fallback(F&& step) {
    counts_.host_fallbacks.fetch_add(1, std::memory_order_relaxed);
    return step();
  }

  // Graph capture (global mode): `what`, a call CUDA refuses during any capture, fails and
  // invalidates the capture. True when refused.
  bool refused_in_capture(const char* what) {
    std::lock_guard<std::mutex> lock(capture_m_);
    if (!capture_.active) return false;
    if (capture_.invalidated_by.empty()) capture_.invalidated_by = what;
    return true;
  }
  // Work on the capturing stream would be recorded into the application's graph and replayed
  // with the plan, call number and switch of this call: the engine must enqueue nothing there.
  // Stricter than CUDA (which would capture it): it fails and invalidates the capture.
  bool captured(StreamHandle s, const char* what) {
    std::lock_guard<std::mutex> lock(capture_m_);
    if (!capture_.active || capture_.stream != s) return false;
    if (capture_.invalidated_by.empty())
      capture_.invalidated_by = std::string(what) + " on the capturing stream";
    return true;
  }

  bool ours(StreamHandle s) {
    std::lock_guard<std::mutex> lock(m_);
    return streams_.count(s) != 0;
  }

  // ---- backend: a kernel step in stream order -----------------------------------------------
  // `body(stream, flags)` checks and launches (flags: the step's StepWord, armed as it starts,
  // folded into the lane's error word by the step's last kernel) and returns their Status; the
  // flags the kernels folded then give the step's Status, as the host codec's,
  // and a step that succeeds is counted in `count`. Skipped once the lane's error word is set; a
  // failure sets it (ErrorSource::kCodec, as the host device). On a stream of ours it is queued
  // behind the stream's earlier work; on the caller's it runs at once.
  template <class F>
  Status run(Lane lane, const char* what, std::atomic<uint64_t>* count, F&& body) {
    auto step = [this, body = std::forward<F>(body), error = lane.error, what, count]() -> Status {
      if (error_set(error)) return Status::kOk;
      // Armed: the lane's word was not set. On the stack: an emulated launch is synchronous.
      cuda::StepWord word = cuda_steps::step_word(error);
      // The emulator runs one launch at a time anyway; one step at a time in the process makes
      // the launch count of each step exact (no other stream's launch falls in between).
      std::unique_lock<std::mutex> one_step(step_mutex());
      const uint64_t launched = dq::emu::launches();
      Status s = body(static_cast<cudaStream_t>(nullptr), &word.flags);  // streams are ignored
      const uint64_t n = dq::emu::launches() - launched;
      one_step.unlock();
      if (s == Status::kOk) s = step_status(cudaSuccess, word.raised, what);
      if (s == Status::kOk) {
        count->fetch_add(1, std::memory_order_relaxed);
        counts_.launches.fetch_add(n, std::memory_order_relaxed);
        if (count == &counts_.hops) counts_.hop_launches.fetch_add(n, std::memory_order_relaxed);
      }
      if (s != Status::kOk && error)
        set_error(error, error_word(ErrorSource::kCodec, static_cast<int>(s)));
      return s;
    };
    if (!ours(lane.stream)) return step();
    // The host stream's queue runs it in order; it never fails as an NCCL call (its own failure
    // is in the error word already, with the codec's source).
    return host_->nccl(lane, [step = std::move(step)]() mutable {
      step();
      return ncclSuccess;
    });
  }

  struct Capture {
    bool active = false;
    StreamHandle stream = nullptr;
    std::string invalidated_by;  // the first call that invalidated it; empty: intact
  };
  mutable std::mutex capture_m_;
  Capture capture_;
  Device* host_;
  const EmulatedCudaFault fault_;
  int streams_made_ = 0;  // guarded by m_
  std::mutex m_;
  std::unordered_set<StreamHandle> streams_;
  cuda_steps::LevelSets levels_;  // stable addresses: kernels hold pointers into it
  struct {
    std::atomic<uint64_t> stats{0}, layouts{0}, hops{0}, finishes{0}, host_fallbacks{0}, budgets{0};
    std::atomic<uint64_t> launches{0}, hop_launches{0};
  } counts_;
};

}  // namespace

std::unique_ptr<Device> make_emulated_cuda_device(Device* host, EmulatedCudaFault fault) {
  return std::make_unique<CudaDevice>(host ? host : host_device(), fault);
}

Status emulated_cuda_begin_capture(Device* device, StreamHandle stream) {
  auto* d = dynamic_cast<CudaDevice*>(device);
  return d ? d->begin_capture(stream) : Status::kInvalidArgument;
}

Status emulated_cuda_end_capture(Device* device, std::string* why) {
  auto* d = dynamic_cast<CudaDevice*>(device);
  return d ? d->end_capture(why) : Status::kInvalidArgument;
}

CudaDeviceCounts cuda_device_counts(const Device* device) {
  const auto* d = dynamic_cast<const CudaDevice*>(device);
  return d ? d->counts() : CudaDeviceCounts{};
}

}  // namespace dq::engine
