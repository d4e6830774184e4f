// The real CUDA device (shim/engine/cuda_device_gpu.h): the engine's Device on a GPU. Built by
// nvcc (flags of kernels/cuda: --fmad=false -prec-div=true -prec-sqrt=true -ftz=false) into
// libdynamiq.so with the kernels of kernels/cuda/ it launches, and the CUDA runtime linked
// statically (so the library loads without a driver; shim/engine/meson.build).
//
// Compared with the emulated device (shim/engine/cuda_device.cc), which shares its host side
// (shim/engine/cuda_steps.h: parameters, argument checks, flags to Status, level tables):
// - memory: device memory from the device's own stream-ordered pool, which every peer GPU may
//   access (make_pool), allocated on a private stream and waited for (allocation is plan time),
//   released with cudaFreeAsync on the given stream (at teardown, on the private stream); mapped
//   memory from cudaHostAlloc(mapped), never freed but parked for reuse (park_pinned): cudaFree
//   and cudaFreeHost wait for the whole device, other communicators' NCCL kernels too;
// - streams and events: cudaStream_t (non-blocking) and cudaEvent_t (timing off); a wait refers to
//   the event's latest record (cudaStreamWaitEvent);
// - copies: cudaMemcpyAsync on the lane's stream; NCCL calls: issued at once, on the stream the
//   engine passes in them (the lane's), as NVIDIA's NCCL orders them itself;
// - codec steps: argument checks on the host at enqueue (a failure is written to the lane's error
//   word from the host, as the host device does), then the step's kernels on the lane's stream and
//   nothing else: they get the flags of a StepWord in device memory, one per (stream, lane)
//   (kernels/cuda/step_fold.h), which every kernel reads as it starts (armed with kSkipFlag: it
//   writes nothing). The step's last kernel folds the flags into the lane's error word with the
//   host device's encoding (ErrorSource::kCodec, the Status step_status() gives), first failure
//   wins, when its whole grid is done, and re-arms the word for the lane's next step. A word is
//   made at its (stream, lane)'s first step: its image, in pinned memory for the device's life,
//   copied by cudaMemcpyAsync on that stream (a copy, not a launch). The steps' launches are
//   cuda_steps.h's, the emulated device's too, so both launch alike;
// - level tables: built by the host's builder once per option set and copied to device memory
//   by prepare() (plan time), on the device's own allocation stream; an event marks the copy and
//   every DynamiQ step's stream waits for it (a no-op once it completed). The PreparedCodec holds
//   the device tables and the event, so a step makes no allocation and no copy of its own;
// - every host wait polls an event, bounded by DYNAMIQ_TIMEOUT_MS (NVIDIA's NCCL waits for a
//   silent peer forever); nothing waits inside a call; no cudaMalloc/cudaFree/cudaFreeHost
//   anywhere with pools (only the stream-ordered allocator and the parked pinned blocks),
//   pageable level tables copied H2D (staged, no device sync).
#include "shim/engine/cuda_device_gpu.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/log.h"
#include "config/settings.h"
#include "kernels/cuda/budget.h"
#include "shim/engine/cuda_context.h"
#include "shim/engine/cuda_steps.h"
#include "shim/engine/scoped_context.h"

#if DQ_CUDA_EMULATED
#error "shim/engine/cuda_device_gpu.cu is the nvcc build; the emulated device is cuda_device.cc"
#endif

namespace dq::engine {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::kOk;
  cudaGetLastError();  // clear a sticky-free error so it does not show on the next launch
  if (e == cudaErrorMemoryAllocation)
    DQ_FAIL(Status::kOutOfMemory, "cuda device: %s: %s", what, cudaGetErrorString(e));
  DQ_FAIL(Status::kSystemError, "cuda device: %s: %s", what, cudaGetErrorString(e));
}

// The calling thread's stream capture mode set to relaxed for the enclosing scope: plan-time work
// (an allocation, the level tables' upload on the device's own stream) is then neither refused
// nor invalidates a graph capture another thread runs in global mode (PyTorch's default), as
// NCCL does around its own allocations. None of it touches a capturing stream.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// Runs the enclosing scope with the device's primary context current, restoring the thread's own
// context (or none) after: restored by device number instead, a thread with no context would get
// device 0's primary context, about 0.5 GB on GPU 0 for every rank whose abort ran there.
using OnDevice = ScopedContext<cuda_context::Ops>;

class CudaGpuDevice final : public Device {
 public:
  explicit CudaGpuDevice(int ordinal) : ordinal_(ordinal) {
    std::snprintf(name_, sizeof name_, "cuda (device %d)", ordinal);
  }
  // At a communicator's first call, which may be captured (no eager warm-up): relaxed, so the
  // pool, the kernels' loading and the stream neither fail nor invalidate that capture.
  Status init() {
    std::string why;
    primary_ = cuda_context::primary(ordinal_, &why);
    if (primary_ == nullptr)
      DQ_FAIL(Status::kSystemError, "cuda device %d: %s", ordinal_, why.c_str());
    OnDevice on(primary_);
    RelaxedCapture relaxed;
    int pools = 0;
    if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, ordinal_) != cudaSuccess)
      pools = 0;
    pools_ = pools != 0;
    if (pools_) DQ_CHECK(make_pool());
    // Every kernel loaded now, not at its first launch mid-call (cuda_steps::load_kernels).
    DQ_CHECK(cuda_status(cuda_steps::load_kernels(), "loading the kernels"));
    return cuda_status(cudaStreamCreateWithFlags(&alloc_stream_, cudaStreamNonBlocking),
                       "the allocation stream");
  }

  // After a failed init(): kept only to hand out mapped memory for the handshake's stand-in
  // (cuda_gpu_device()'s `standby`); every stream fails, so an engine given it takes the set-up
  // failure's path.
  void make_standby() {
    standby_ = true;
    std::snprintf(name_, sizeof name_, "cuda (device %d, not set up)", ordinal_);
  }

  const char* name() const override { return name_; }
  bool needs_canary() const override { return true; }
  // One launch lays out every part of a call (or one step a part where no batch was prepared).
  bool batches_layouts() const override { return true; }
  // NCCL's calls are issued at enqueue (nccl() below): an abort ends their kernels.
  bool abort_ends_queued_nccl_work() const override { return true; }

  // ---- memory -------------------------------------------------------------------------------
  Status alloc(size_t bytes, void** out) override {
    OnDevice on(primary_);
    RelaxedCapture relaxed;  // plan time: may run while another thread captures
    *out = nullptr;
    if (!pools_) return cuda_status(cudaMalloc(out, bytes), "cudaMalloc");
    // Plan time: waiting for the private stream makes the memory usable on any stream at once.
    cudaError_t e = cudaMallocFromPoolAsync(out, bytes, pool_, alloc_stream_);
    if (e == cudaErrorMemoryAllocation) {  // the pool keeps retired plans' memory: hand it back
      (void)cudaGetLastError();
      (void)drain(alloc_stream_, "an allocation");  // the frees queued so far, complete
      cudaMemPoolTrimTo(pool_, 0);
      e = cudaMallocFromPoolAsync(out, bytes, pool_, alloc_stream_);
    }
    DQ_CHECK(cuda_status(e, "cudaMallocFromPoolAsync"));
    return drain(alloc_stream_, "an allocation");
  }
  Status alloc_mapped(size_t bytes, void** out) override {
    OnDevice on(primary_);
    RelaxedCapture relaxed;
    std::lock_guard<std::mutex> lock(m_);
    DQ_CHECK(pinned(bytes, out));
    mapped_[*out] = bytes;
    return Status::kOk;
  }
  void release(void* p, StreamHandle stream) override {
    if (p == nullptr) return;
    OnDevice on(primary_);
    RelaxedCapture relaxed;  // an event recorded, a free queued: never another thread's capture
    auto s = static_cast<cudaStream_t>(stream);
    size_t mapped_bytes = 0;
    {
      std::lock_guard<std::mutex> lock(m_);
      const auto m = mapped_.find(p);
      if (m != mapped_.end()) {
        mapped_bytes = m->second;
        mapped_.erase(m);
      }
      // A later word at the same address is another lane's, with StepWords of its own; these
      // are freed with their stream (their kernels may still be queued).
      for (auto it = words_.begin(); it != words_.end();)
        if (it->first.second == p) {
          retired_.push_back(it->second);
          it = words_.erase(it);
        } else {
          ++it;
        }
      if (s == nullptr && leak_.load()) return;  // a stream's work may still use it
      if (mapped_bytes != 0) {
        park_pinned(p, mapped_bytes, s);  // reused once `s`'s work so far is done
        return;
      }
    }
    if (pools_) {
      // Stream-ordered, never a device-wide wait: at teardown on the private stream (the
      // engine's streams were drained before it releases without one).
      cudaFreeAsync(p, s != nullptr ? s : alloc_stream_);
    } else {
      cudaFree(p);  // no pools (CUDA below 11.2's allocator): cudaFree waits for the device
    }
  }

  // ---- streams and events -------------------------------------------------------------------
  Status create_stream(StreamHandle* out) override {
    if (standby_) return Status::kUnsupported;
    OnDevice on(primary_);
    RelaxedCapture relaxed;  // the engine's set-up, at a call that may be captured
    cudaStream_t s = nullptr;
    DQ_CHECK(cuda_status(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"));
    *out = s;
    return Status::kOk;
  }
  void destroy_stream(StreamHandle stream) override {
    OnDevice on(primary_);
    RelaxedCapture relaxed;
    auto s = static_cast<cudaStream_t>(stream);
    std::vector<StepSlot> words;  // the stream's StepWords
    {
      std::lock_guard<std::mutex> lock(m_);
      for (auto it = words_.begin(); it != words_.end();)
        if (it->first.first == stream) {
          words.push_back(it->second);
          it = words_.erase(it);
        } else {
          ++it;
        }
      for (auto it = retired_.begin(); it != retired_.end();)
        if (it->stream == stream) {
          words.push_back(*it);
          it = retired_.erase(it);
        } else {
          ++it;
        }
    }
    // The engine frees its memory after destroying its streams: their work must be done, waited
    // for at most DYNAMIQ_TIMEOUT_MS. Work that does not end in time (a peer that never answers,
    // no abort) may still use that memory: from then on this device frees nothing it is asked
    // to release without a stream (left allocated, one warning).
    const bool done = drain(s, "destroying a stream") == Status::kOk;
    if (!done) leak_.store(true);
    for (const StepSlot& w : words) {
      if (pools_) cudaFreeAsync(w.device, s);
      if (!pools_ && done) cudaFree(w.device);
      if (done) {
        std::lock_guard<std::mutex> lock(m_);
        park_pinned(w.image, sizeof(cuda::StepWord), nullptr);
      }
    }
    cudaStreamDestroy(s);
  }
  // Relaxed capture mode in these and in synchronize_for: another thread of the job may capture a
  // graph in global mode (PyTorch's default) meanwhile, and CUDA then refuses a query or an event
  // call made in this thread's default mode, invalidating that thread's capture.
  Status create_event(EventHandle* out) override {
    OnDevice on(primary_);
    RelaxedCapture relaxed;
    cudaEvent_t e = nullptr;
    DQ_CHECK(cuda_status(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate"));
    *out = e;
    return Status::kOk;
  }
  void destroy_event(EventHandle e) override {
    OnDevice on(primary_);
    RelaxedCapture relaxed;
    cudaEventDestroy(static_cast<cudaEvent_t>(e));
  }
  Status record(EventHandle e, StreamHandle s) override {
    OnDevice on(primary_);
    return cuda_status(cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s)),
                       "cudaEventRecord");
  }
  Status wait(StreamHandle s, EventHandle e) override {
    OnDevice on(primary_);
    return cuda_status(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e), 0),
        "cudaStreamWaitEvent");
  }
  // Bounded too (DYNAMIQ_TIMEOUT_MS): the canary's and the handshake's waits involve NCCL calls.
  Status synchronize(EventHandle e) override { return synchronize_for(e, timeout_ms_); }
  bool query(EventHandle e) override {
    OnDevice on(primary_);
    RelaxedCapture relaxed;
    if (cudaEventQuery(static_cast<cudaEvent_t>(e)) == cudaSuccess) return true;
    cudaGetLastError();  // cudaErrorNotReady, or a failure: not complete either way
    return false;
  }
  // Polls: cudaEventSynchronize cannot be bounded, and NVIDIA's NCCL waits for a silent peer
  // forever. Spins first (the control window's wait mostly finds the event complete, or completing
  // within microseconds), then sleeps 50 us between queries; the loop ends by the deadline.
  Status synchronize_for(EventHandle e, int64_t timeout_ms) override {
    if (timeout_ms <= 0) timeout_ms = timeout_ms_;
    OnDevice on(primary_);
    RelaxedCapture relaxed;
    const auto event = static_cast<cudaEvent_t>(e);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (uint64_t query = 0;; ++query) {
      const cudaError_t r = cudaEventQuery(event);
      if (r == cudaSuccess) return Status::kOk;
      if (r != cudaErrorNotReady) return cuda_status(r, "cudaEventQuery");
      if (std::chrono::steady_clock::now() >= deadline) return Status::kTimeout;
      if (query >= 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  bool capturing(StreamHandle s) const override {
    OnDevice on(primary_);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(static_cast<cudaStream_t>(s), &status) != cudaSuccess) {
      cudaGetLastError();
      return true;  // cudaErrorStreamCaptureImplicit: the legacy stream, another stream capturing
    }
    return status != cudaStreamCaptureStatusNone;
  }

  // ---- copies and NCCL calls ----------------------------------------------------------------
  Status copy(void* dst, const void* src, size_t bytes, Lane lane) override {
    if (error_set(lane.error) || bytes == 0) return Status::kOk;
    OnDevice on(primary_);
    const Status s = cuda_status(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(lane.stream)),
        "cudaMemcpyAsync");
    if (s != Status::kOk)
      set_error(lane.error, error_word(ErrorSource::kCodec, static_cast<int>(s)));
    return s;
  }
  // The budget's prediction: kernels/cuda/budget.cu's kernels (a constant number a call), which
  // reads the job and writes the result in mapped memory and skips itself when the lane's error
  // word is set.
  size_t budget_scratch_bytes(uint32_t n_parts, uint64_t key_entries) const override {
    return cuda::budget_scratch_bytes(n_parts, key_entries);
  }
  Status predict_budget(const BudgetJob* job, const uint16_t* reduced, void* scratch,
                        size_t scratch_bytes, BudgetResult* out, Lane lane) override {
    if (error_set(lane.error)) return Status::kOk;
    OnDevice on(primary_);
    const Status s =
        cuda_status(cuda::launch_budget(job, reduced, scratch, scratch_bytes, out, lane.error,
                                        static_cast<cudaStream_t>(lane.stream)),
                    "budget kernel");
    if (s != Status::kOk)
      set_error(lane.error, error_word(ErrorSource::kCodec, static_cast<int>(s)));
    return s;
  }
  // NVIDIA's NCCL orders its calls on the stream they name: issued now, result returned (and,
  // as on the host device, a failure written to the error word).
  Status nccl(Lane lane, std::function<ncclResult_t()> calls) override {
    if (error_set(lane.error)) return Status::kOk;
    OnDevice on(primary_);
    const ncclResult_t r = calls();
    if (r == ncclSuccess) return Status::kOk;
    set_error(lane.error, error_word(ErrorSource::kNccl, r));
    return Status::kSystemError;
  }

  // ---- codec steps --------------------------------------------------------------------------
  // The kernels' arguments, worked out once per plan part, and DynamiQ's level tables in device
  // memory (uploaded once per option set, on the allocation stream; `ready` marks the copy). An
  // upload that fails leaves `levels` null: every step of the codec then fails (the canary
  // fails, the communicator passes through).
  std::unique_ptr<PreparedCodec> prepare(const Codec& codec) override {
    auto prepared = std::make_unique<Prepared>(codec);
    prepared->family = cuda_steps::step_params(codec, &prepared->args);
    if (prepared->family == cuda_steps::Family::kDynamiq)
      prepared->upload =
          upload_levels(prepared->args.options, &prepared->args.levels, &prepared->ready);
    return prepared;
  }

  Status local_stats(const PreparedCodec& codec, const ConstTensor& x, uint16_t* stats,
                     Lane lane) override {
    return step(codec, lane, "statistics",
                [&](const cuda_steps::StepParams& k, cudaStream_t stream, unsigned* flags) {
                  return cuda_steps::launch_stats(k, x, stats, flags, stream);
                });
  }

  Status build_layout(const PreparedCodec& codec, const uint16_t* reduced, uint64_t call,
                      void* layout, Lane lane) override {
    return step(codec, lane, "layout",
                [&](const cuda_steps::StepParams& k, cudaStream_t stream, unsigned* flags) {
                  return cuda_steps::launch_layout(k, reduced, call, layout, flags, stream);
                });
  }

  // The batch kernels' jobs (cuda_steps::PartBatch), their table copied to device memory once,
  // on the allocation stream (never a caller's, which may be capturing).
  Status prepare_parts(std::vector<PartSteps> parts, DType dtype,
                       std::unique_ptr<PreparedParts>* out) override {
    auto prepared = cuda_steps::batched_parts(
        std::move(parts), dtype, [this](const PreparedCodec& c, cuda_steps::StepParams* k) {
          if (const auto* p = dynamic_cast<const Prepared*>(&c)) {
            *k = p->args;
            return p->family != cuda_steps::Family::kNone && p->upload == Status::kOk;
          }
          return false;  // prepared by another device: part by part
        });
    // Handed out before the copy: memory allocated for a copy that fails is the caller's to
    // release (with the plan), not lost.
    cuda_steps::BatchedParts* p = prepared.get();
    *out = std::move(prepared);
    const std::vector<unsigned char>& image = p->batch.image;
    if (image.empty()) return Status::kOk;
    DQ_CHECK(alloc(image.size(), &p->device_memory));
    p->device_bytes = image.size();
    OnDevice on(primary_);
    RelaxedCapture relaxed;
    DQ_CHECK(cuda_status(cudaMemcpyAsync(p->device_memory, image.data(), image.size(),
                                         cudaMemcpyHostToDevice, alloc_stream_),
                         "the batch table"));
    return drain(alloc_stream_, "the batch table");
  }

  Status parts_stats(const PreparedParts& parts, const void* input, Lane lane) override {
    bool empty;
    const auto* p = cuda_steps::stats_batch(parts, &empty);
    if (p == nullptr) return empty ? Status::kOk : Device::parts_stats(parts, input, lane);
    const bool bf16 = parts.dtype() == DType::kBF16;
    return kernel_step(lane, [&](cudaStream_t stream, unsigned* flags) {
      return cuda_steps::launch_part_stats(p->batch, p->device_memory, input, bf16, flags, stream);
    });
  }

  Status parts_layouts(const PreparedParts& parts, uint64_t call, Lane lane) override {
    const auto* p = cuda_steps::layout_batch(parts);
    if (p == nullptr) return Device::parts_layouts(parts, call, lane);
    return kernel_step(lane, [&](cudaStream_t stream, unsigned* flags) {
      return cuda_steps::launch_part_layouts(p->batch, p->device_memory, call, flags, stream);
    });
  }

  Status finish_chunks(const PreparedCodec& codec, const void* layout, int first_chunk,
                       int n_chunks, const uint8_t* in, size_t in_stride, size_t in_bytes,
                       void* out, DType dtype, ReduceOp op, int n_contrib, Lane lane) override {
    return step(codec, lane, "finish",
                [&](const cuda_steps::StepParams& k, cudaStream_t stream, unsigned* flags) {
                  return cuda_steps::launch_finish_chunks(k, layout, first_chunk, n_chunks, in,
                                                          in_stride, in_bytes, out, dtype, op,
                                                          n_contrib, flags, stream);
                });
  }

  Status hop(const PreparedCodec& codec, const void* layout, int chunk, const ConstTensor& own,
             const ByteView* in, int n_in, uint8_t* out, const RoundingKey& key,
             Lane lane) override {
    return step(codec, lane, "hop",
                [&](const cuda_steps::StepParams& k, cudaStream_t stream, unsigned* flags) {
                  return cuda_steps::launch_hop(k, layout, chunk, own, in, n_in, out, key, flags,
                                                stream);
                });
  }

  Status finish(const PreparedCodec& codec, const void* layout, int chunk, ByteView in, void* out,
                DType dtype, ReduceOp op, int n_contrib, Lane lane) override {
    return step(codec, lane, "finish",
                [&](const cuda_steps::StepParams& k, cudaStream_t stream, unsigned* flags) {
                  return cuda_steps::launch_finish(k, layout, chunk, in, out, dtype, op, n_contrib,
                                                   flags, stream);
                });
  }

 private:
  // A codec prepared here: which kernels serve it, and their arguments.
  struct Prepared final : PreparedCodec {
    using PreparedCodec::PreparedCodec;
    cuda_steps::Family family = cuda_steps::Family::kNone;
    cuda_steps::StepParams args;  // kDynamiq: args.levels, the device tables
    cudaEvent_t ready = nullptr;  // kDynamiq: their upload's event
    Status upload = Status::kOk;  // kDynamiq: the upload's result
  };

  // One codec step on the lane's stream: skipped when the lane's error word is already set (as
  // seen from the host); the kernels' parameters (and DynamiQ's level tables); `body`'s launches
  // with the (stream, lane)'s StepWord, which the step's last kernel folds into the error word.
  // A failure found on the host is written to the error word here, with the host device's
  // encoding.
  template <class Body>
  Status step(const PreparedCodec& codec, Lane lane, const char* what, Body&& body) {
    if (error_set(lane.error)) return Status::kOk;
    OnDevice on(primary_);
    auto stream = static_cast<cudaStream_t>(lane.stream);
    Status s = Status::kOk;
    cuda_steps::StepParams k;
    cuda_steps::Family family;
    cudaEvent_t ready = nullptr;
    if (const auto* p = dynamic_cast<const Prepared*>(&codec)) {
      k = p->args;
      family = p->family;
      ready = p->ready;
      s = p->upload;
    } else {  // prepared by another device: worked out now (the tables: once per option set)
      family = cuda_steps::step_params(codec.codec(), &k);
      if (family == cuda_steps::Family::kDynamiq) s = upload_levels(k.options, &k.levels, &ready);
    }
    if (s == Status::kOk && family == cuda_steps::Family::kNone) {
      // No kernels serve this codec: the step fails, so the canary fails and the communicator
      // passes through on every rank.
      s = Status::kUnsupported;
      DQ_WARN(Subsys::kEngine, "cuda device %s: codec %s has no kernel steps on this device", what,
              codec.codec().name().c_str());
    }
    if (s == Status::kOk && ready != nullptr)
      s = cuda_status(cudaStreamWaitEvent(stream, ready, 0), "level tables");
    if (s != Status::kOk) {
      set_error(lane.error, error_word(ErrorSource::kCodec, static_cast<int>(s)));
      return s;
    }
    return kernel_step(lane, [&](cudaStream_t st, unsigned* flags) { return body(k, st, flags); });
  }

  // A step's launches, `body(stream, flags)`, with the (stream, lane)'s StepWord: skipped when the
  // lane's error word is already set; a failure found on the host is written to the error word.
  // Launches per step: its kernels alone (cuda_steps.h), as on the emulated device.
  template <class Body>
  Status kernel_step(Lane lane, Body&& body) {
    if (error_set(lane.error)) return Status::kOk;
    OnDevice on(primary_);
    auto stream = static_cast<cudaStream_t>(lane.stream);
    unsigned* flags = nullptr;
    Status s = word_for(lane.stream, stream, lane.error, &flags);
    if (s == Status::kOk) s = body(stream, flags);
    if (s != Status::kOk)
      set_error(lane.error, error_word(ErrorSource::kCodec, static_cast<int>(s)));
    return s;
  }

  // The level tables of `o` in device memory and the event that marks their upload: copied once
  // per option set, on the allocation stream (never a caller's, which may be capturing), with
  // the thread's capture mode relaxed. The host tables stay in `levels_` for the device's life,
  // so the asynchronous copy may read them after this returns.
  Status upload_levels(const DynamiqOptions& o, const LevelTable** out, cudaEvent_t* ready) {
    *out = nullptr;
    *ready = nullptr;
    OnDevice on(primary_);
    RelaxedCapture relaxed;
    Status made = Status::kOk;
    cuda_steps::LevelSet* l = levels_.get(o, [&](cuda_steps::LevelSet& set) {
      void* d = nullptr;
      cudaEvent_t done = nullptr;
      made = pools_
                 ? cuda_status(cudaMallocFromPoolAsync(&d, sizeof set.table, pool_, alloc_stream_),
                               "cudaMallocAsync")
                 : cuda_status(cudaMalloc(&d, sizeof set.table), "cudaMalloc");
      if (made == Status::kOk)
        made = cuda_status(
            cudaMemcpyAsync(d, set.table, sizeof set.table, cudaMemcpyHostToDevice, alloc_stream_),
            "level tables");
      if (made == Status::kOk)
        made = cuda_status(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "event");
      if (made == Status::kOk) made = cuda_status(cudaEventRecord(done, alloc_stream_), "event");
      if (made != Status::kOk) {
        if (done) cudaEventDestroy(done);
        if (d != nullptr && pools_) cudaFreeAsync(d, alloc_stream_);
        if (d != nullptr && !pools_) cudaFree(d);
        return false;
      }
      set.device = static_cast<const LevelTable*>(d);
      set.ready = done;
      return true;
    });
    if (l == nullptr) return made != Status::kOk ? made : Status::kSystemError;
    *out = l->device;
    *ready = static_cast<cudaEvent_t>(l->ready);
    return Status::kOk;
  }

  // The device's own memory pool (stream-ordered allocations): readable and writable by every
  // peer GPU that can access this one, since in a single-process multi-GPU job NCCL's P2P
  // transport writes into a peer's payload buffers directly. The default pool grants no peer
  // access, and changing it would change the application's allocations too. Memory freed back
  // to the pool is kept for reuse (the release threshold), as plans come and go.
  Status make_pool() {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = ordinal_;
    DQ_CHECK(cuda_status(cudaMemPoolCreate(&pool_, &props), "cudaMemPoolCreate"));
    uint64_t keep = UINT64_MAX;
    DQ_CHECK(cuda_status(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep),
                         "cudaMemPoolSetAttribute"));
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    for (int peer = 0; peer < count; ++peer) {
      int can = 0;
      if (peer == ordinal_ || cudaDeviceCanAccessPeer(&can, peer, ordinal_) != cudaSuccess || !can)
        continue;
      cudaMemAccessDesc access{};
      access.location.type = cudaMemLocationTypeDevice;
      access.location.id = peer;
      access.flags = cudaMemAccessFlagsProtReadWrite;
      DQ_CHECK(cuda_status(cudaMemPoolSetAccess(pool_, &access, 1), "cudaMemPoolSetAccess"));
    }
    return Status::kOk;
  }

  // Waits for the work enqueued on `s` so far, at most DYNAMIQ_TIMEOUT_MS (an event recorded now,
  // polled); kTimeout with a warning naming `what` when it does not complete.
  Status drain(cudaStream_t s, const char* what) {
    RelaxedCapture relaxed;
    cudaEvent_t e = nullptr;
    Status st =
        cuda_status(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    if (st == Status::kOk) st = cuda_status(cudaEventRecord(e, s), "cudaEventRecord");
    if (st == Status::kOk) st = synchronize_for(e, timeout_ms_);
    if (e != nullptr) cudaEventDestroy(e);
    if (st == Status::kTimeout)
      DQ_WARN(Subsys::kEngine,
              "cuda device %d: %s: the stream's work did not complete within DYNAMIQ_TIMEOUT_MS "
              "= %lld ms; its memory is left allocated",
              ordinal_, what, static_cast<long long>(timeout_ms_));
    return st;
  }

  // The flags of the (stream, lane)'s StepWord, made at its first step: device memory,
  // stream-ordered, filled from a pinned image by a copy on the stream (armed: the host saw the
  // lane's word clear). The step's last kernel re-arms it for the next step, so it is never
  // written from the host again; a lane keeps its word on each stream it uses.
  Status word_for(StreamHandle key, cudaStream_t stream, uint32_t* error, unsigned** out) {
    RelaxedCapture relaxed;  // the allocations must not disturb another thread's capture
    std::lock_guard<std::mutex> lock(m_);
    auto it = words_.find({key, error});
    if (it != words_.end()) {
      *out = &it->second.device->flags;
      return Status::kOk;
    }
    StepSlot w;
    w.stream = key;
    void* image = nullptr;
    void* d = nullptr;
    Status s = pinned(sizeof(cuda::StepWord), &image);
    if (s == Status::kOk)
      s = pools_ ? cuda_status(cudaMallocFromPoolAsync(&d, sizeof(cuda::StepWord), pool_, stream),
                               "cudaMallocAsync")
                 : cuda_status(cudaMalloc(&d, sizeof(cuda::StepWord)), "cudaMalloc");
    if (s == Status::kOk) {
      w.image = static_cast<cuda::StepWord*>(image);
      *w.image = cuda_steps::step_word(error);
      w.device = static_cast<cuda::StepWord*>(d);
      s = cuda_status(cudaMemcpyAsync(w.device, w.image, sizeof(cuda::StepWord),
                                      cudaMemcpyHostToDevice, stream),
                      "a step word");
    }
    if (s != Status::kOk) {  // nothing of it reached the stream but the allocation
      if (d != nullptr && pools_) cudaFreeAsync(d, stream);
      if (d != nullptr && !pools_) cudaFree(d);
      if (image != nullptr) park_pinned(image, sizeof(cuda::StepWord), nullptr);
      return s;
    }
    words_[{key, error}] = w;
    *out = &w.device->flags;
    return Status::kOk;
  }

  // Pinned, mapped host memory of at least `bytes` (m_ held): a parked block whose stream work
  // is done, of at most twice the size, else a new one (cudaHostAlloc).
  Status pinned(size_t bytes, void** out) {
    *out = nullptr;
    for (auto it = parked_.begin(); it != parked_.end(); ++it) {
      if (it->bytes < bytes || it->bytes > 2 * bytes) continue;
      if (it->after != nullptr) {
        const cudaError_t q = cudaEventQuery(it->after);
        if (q != cudaSuccess) {
          if (q != cudaErrorNotReady) (void)cudaGetLastError();
          continue;
        }
        cudaEventDestroy(it->after);
      }
      *out = it->p;
      parked_.erase(it);
      return Status::kOk;
    }
    return cuda_status(cudaHostAlloc(out, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                       "cudaHostAlloc");
  }
  // Keeps a released pinned block for pinned() (m_ held), usable once what `after` has queued
  // is done (nullptr: at once); left allocated, never reused, when no event can be recorded.
  void park_pinned(void* p, size_t bytes, cudaStream_t after) {
    cudaEvent_t e = nullptr;
    if (after != nullptr) {
      if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess ||
          cudaEventRecord(e, after) != cudaSuccess) {
        (void)cudaGetLastError();
        if (e != nullptr) cudaEventDestroy(e);
        return;
      }
    }
    parked_.push_back(Parked{p, bytes, e});
  }

  const int ordinal_;
  bool standby_ = false;                                    // make_standby()
  cuda_context::Context primary_ = nullptr;                 // the GPU's primary context (init)
  const int64_t timeout_ms_ = config::global().timeout_ms;  // every host wait's bound
  char name_[32];
  bool pools_ = false;
  std::atomic<bool> leak_{false};  // a stream's work outlived its teardown: free nothing unordered
  cudaMemPool_t pool_ = nullptr;   // pools_: the device's own (make_pool)
  cudaStream_t alloc_stream_ = nullptr;
  std::mutex m_;
  std::unordered_map<void*, size_t> mapped_;  // mapped blocks handed out, and their bytes
  // Released pinned blocks (park_pinned), each usable once its event completed.
  struct Parked {
    void* p;
    size_t bytes;
    cudaEvent_t after;  // nullptr: at once
  };
  std::vector<Parked> parked_;
  // A StepWord (kernels/cuda/step_fold.h) in device memory and the pinned image it was filled
  // from, on `stream`.
  struct StepSlot {
    StreamHandle stream = nullptr;
    cuda::StepWord* device = nullptr;
    cuda::StepWord* image = nullptr;
  };
  std::map<std::pair<StreamHandle, const uint32_t*>, StepSlot> words_;  // by (stream, lane)
  std::vector<StepSlot> retired_;  // of released lane words, freed with their stream
  cuda_steps::LevelSets levels_;
};

// The driver library the static runtime loads (a test may name a missing one).
const char* driver_library() {
  const char* name = std::getenv("DQ_TEST_CUDA_DRIVER_LIB");
  return name != nullptr && *name != '\0' ? name : "libcuda.so.1";
}

// Whether CUDA can run in this process at all, asked before any runtime call: the runtime would
// load the driver itself, but this gives the clearer reason.
bool driver_present(std::string* why) {
  const char* lib = driver_library();
  void* h = dlopen(lib, RTLD_LAZY | RTLD_LOCAL);
  if (h == nullptr) {
    const char* err = dlerror();
    *why = std::string("no CUDA driver: ") + lib + " cannot be loaded (" + (err ? err : "?") + ")";
    return false;
  }
  dlclose(h);
  return true;
}

std::string runtime_reason(cudaError_t e, const char* what) {
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  char line[320];
  std::snprintf(line, sizeof line,
                "%s: %s (%s; runtime %d.%d linked into libdynamiq.so, driver %d.%d)", what,
                cudaGetErrorName(e), cudaGetErrorString(e), runtime / 1000, runtime % 1000 / 10,
                driver / 1000, driver % 1000 / 10);
  return line;
}

}  // namespace

Device* cuda_gpu_device(int ordinal, std::string* why, Device** standby) {
  static std::mutex* m = new std::mutex;
  static auto* devices = new std::map<int, CudaGpuDevice*>;   // never destroyed (atexit NCCL calls)
  static auto* standbys = new std::map<int, CudaGpuDevice*>;  // likewise
  if (standby) *standby = nullptr;
  std::string reason;
  std::lock_guard<std::mutex> lock(*m);
  if (!driver_present(&reason)) {
    if (why) *why = reason;
    return nullptr;
  }
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count < 1) {
    cudaGetLastError();
    if (why) *why = e != cudaSuccess ? runtime_reason(e, "cudaGetDeviceCount") : "no CUDA device";
    return nullptr;
  }
  if (ordinal < 0 && (e = cudaGetDevice(&ordinal)) != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = runtime_reason(e, "cudaGetDevice");
    return nullptr;
  }
  if (ordinal >= count) {
    if (why) *why = "device " + std::to_string(ordinal) + " of " + std::to_string(count);
    return nullptr;
  }
  auto it = devices->find(ordinal);
  if (it != devices->end()) return it->second;
  auto device = std::make_unique<CudaGpuDevice>(ordinal);
  if (device->init() != Status::kOk) {
    if (why)
      *why = "cannot set up device " + std::to_string(ordinal) +
             " (its kernels' modules, the allocation stream)";
    // The next communicator tries init() again; one standby a device serves them all meanwhile.
    CudaGpuDevice*& kept = (*standbys)[ordinal];
    if (kept == nullptr) {
      device->make_standby();
      kept = device.release();
    }
    if (standby) *standby = kept;
    return nullptr;
  }
  return (*devices)[ordinal] = device.release();
}

CudaBuffer cuda_gpu_classify(const void* p, int ordinal, std::string* why) {
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = runtime_reason(e, "cudaPointerGetAttributes");
    return CudaBuffer::kUnknown;
  }
  switch (a.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged:
      return CudaBuffer::kDevice;
    case cudaMemoryTypeHost:  // pinned: the kernels read it at the same address (UVA)
      return a.devicePointer == p ? CudaBuffer::kDevice : CudaBuffer::kInaccessible;
    default: {
      int pageable = 0;
      if (ordinal < 0 && cudaGetDevice(&ordinal) != cudaSuccess) ordinal = 0;
      if (cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, ordinal) !=
          cudaSuccess) {
        cudaGetLastError();
        pageable = 0;
      }
      if (pageable) return CudaBuffer::kPageable;
      if (why) *why = "pageable host memory, and the device cannot access pageable memory";
      return CudaBuffer::kInaccessible;
    }
  }
}

}  // namespace dq::engine
