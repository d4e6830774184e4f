// Where the engine's work runs. The engine only enqueues through this interface, in stream
// order, and never reads device memory between a call's first and last enqueue (docs/ENGINE.md
// section 2). The host device runs the steps on host buffers with the CPU NCCL, on streams of its
// own (ordered work queues); a CUDA device enqueues the same steps as kernels.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "common/nccl_api.h"
#include "common/status.h"
#include "kernels/budget_math.h"
#include "kernels/codec.h"

namespace dq::engine {

using StreamHandle = void*;  // a device stream (cudaStream_t on a GPU)
using EventHandle = void*;

// The per-communicator device error word (mapped memory: the device writes it, the host reads
// it lazily, as NCCL's ncclCommGetAsyncError does). 0 = no error; the first failure wins.
// Layout: bits 16..23 say what failed, bits 0..15 the code.
enum class ErrorSource : uint32_t { kNone = 0, kCodec = 1, kNccl = 2 };
inline uint32_t error_word(ErrorSource source, int code) {
  return (static_cast<uint32_t>(source) << 16) | (static_cast<uint32_t>(code) & 0xffffu);
}
inline ErrorSource error_source(uint32_t word) {
  return static_cast<ErrorSource>(word >> 16);
}
inline int error_code(uint32_t word) {
  return static_cast<int>(word & 0xffffu);
}
// Raises `word` in the error word at `error` unless a failure is there already (first wins);
// nothing when `error` is null. Host and device steps, and the engine, all raise it this way.
inline void set_error(uint32_t* error, uint32_t word) {
  if (error == nullptr) return;
  uint32_t expected = 0;
  __atomic_compare_exchange_n(error, &expected, word, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
inline bool error_set(const uint32_t* error) {
  return error != nullptr && __atomic_load_n(error, __ATOMIC_ACQUIRE) != 0;
}

// Where an enqueued step runs and where it reports a failure found in data. Once the error word
// is set, later steps on the engine's streams do nothing (the call is failing; its peers learn it
// through their own timeouts or the next call's control words).
struct Lane {
  StreamHandle stream = nullptr;
  uint32_t* error = nullptr;  // mapped memory
};

// A planned codec prepared for one device (Device::prepare), once per plan part: what the
// device's steps need beyond the codec's own parameters, worked out once instead of at every
// step (on a CUDA device the kernels' arguments and DynamiQ's level tables). Refers to the codec,
// which must outlive it.
class PreparedCodec {
 public:
  explicit PreparedCodec(const Codec& codec) : codec_(&codec) {}
  virtual ~PreparedCodec() = default;
  const Codec& codec() const { return *codec_; }

 private:
  const Codec* codec_;
};

// One codec part's share of a call's statistics and layouts, fixed when its plan is made.
struct PartSteps {
  const PreparedCodec* codec = nullptr;        // builds the layout
  const PreparedCodec* stats_codec = nullptr;  // computes the statistics; nullptr: none
  size_t offset = 0;                           // the part's first element in the call's input
  size_t count = 0;                            // its elements
  uint16_t* stats = nullptr;                   // its local statistics words (device memory)
  const uint16_t* reduced = nullptr;  // its reduced statistics (device memory; nullptr: none)
  void* layout = nullptr;             // its layout (device memory)
};

// Every part's steps of a plan, prepared for one device (Device::prepare_parts): a CUDA device
// runs each kind as one step over all the parts. `device_memory` (`device_bytes`): what the device
// allocated for them (its kernels' tables), nullptr when nothing; the plan's owner releases it
// with Device::release, stream-ordered, after the plan's last step, like the plan's buffers.
class PreparedParts {
 public:
  PreparedParts(std::vector<PartSteps> parts, DType dtype)
      : parts_(std::move(parts)), dtype_(dtype) {}
  virtual ~PreparedParts() = default;
  const std::vector<PartSteps>& parts() const { return parts_; }
  DType dtype() const { return dtype_; }
  void* device_memory = nullptr;
  size_t device_bytes = 0;

 private:
  std::vector<PartSteps> parts_;
  DType dtype_;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual const char* name() const = 0;

  // ---- memory: plan time, never inside a call -------------------------------------------------
  virtual Status alloc(size_t bytes, void** out) = 0;         // device memory
  virtual Status alloc_mapped(size_t bytes, void** out) = 0;  // host memory the device can write
  // Stream-ordered release: freed once the work enqueued on `stream` so far has completed.
  virtual void release(void* p, StreamHandle stream) = 0;

  // ---- streams and events (CUDA semantics: a wait refers to the event's latest record) -------
  virtual Status create_stream(StreamHandle* out) = 0;
  // Waits for the stream's work, then destroys it.
  virtual void destroy_stream(StreamHandle s) = 0;
  virtual Status create_event(EventHandle* out) = 0;
  virtual void destroy_event(EventHandle e) = 0;
  virtual Status record(EventHandle e, StreamHandle s) = 0;
  virtual Status wait(StreamHandle s, EventHandle e) = 0;
  // The host blocks until `e`'s latest record completed. Used by the blocking steps only: the
  // handshake, a plan's agreement, and the read of the words of the call a control window back.
  virtual Status synchronize(EventHandle e) = 0;
  // The same, bounded: kTimeout when `e` has not completed within timeout_ms (> 0). The engine's
  // host waits on work that involves peers come here with DYNAMIQ_TIMEOUT_MS. The CUDA device
  // polls, since NVIDIA's NCCL waits for a peer that stopped answering forever; a device whose
  // peer calls end by their own timeouts (the host device over the CPU NCCL) may wait as
  // synchronize() does.
  virtual Status synchronize_for(EventHandle e, int64_t timeout_ms) {
    (void)timeout_ms;
    return synchronize(e);
  }
  // True once `e`'s latest record completed (no wait; false on an error too).
  virtual bool query(EventHandle e) = 0;
  // True while `s` (a caller's stream) is being captured into a CUDA graph, and when that cannot be
  // told (CUDA refuses the question for the legacy stream while another stream captures, whose
  // capture a synchronisation of that stream would invalidate): the call then passes through.
  virtual bool capturing(StreamHandle s) const = 0;
  // True when the codec steps are not the host codec's own code (a CUDA device): the engine then
  // checks them against the host codec once per communicator, before its first compressed call
  // (the canary, docs/ENGINE.md section 6). The host device runs the host codec: no canary.
  virtual bool needs_canary() const { return false; }

  // ---- codecs: plan time, never inside a call ------------------------------------------------
  // `codec` (planned) prepared for this device's steps. The host device needs nothing beyond the
  // codec; a CUDA device works out its kernels' arguments here. Steps also accept a codec
  // prepared by another device (they then work those out themselves).
  virtual std::unique_ptr<PreparedCodec> prepare(const Codec& codec) {
    return std::make_unique<PreparedCodec>(codec);
  }

  // ---- enqueued steps ---------------------------------------------------------------------------
  virtual Status local_stats(const PreparedCodec& codec, const ConstTensor& x, uint16_t* stats,
                             Lane lane) = 0;
  virtual Status build_layout(const PreparedCodec& codec, const uint16_t* reduced_stats,
                              uint64_t call, void* layout, Lane lane) = 0;
  virtual Status hop(const PreparedCodec& codec, const void* layout, int chunk,
                     const ConstTensor& own, const ByteView* in, int n_in, uint8_t* out,
                     const RoundingKey& key, Lane lane) = 0;
  virtual Status finish(const PreparedCodec& codec, const void* layout, int chunk, ByteView in,
                        void* out, DType dtype, ReduceOp op, int n_contrib, Lane lane) = 0;
  // The finish of chunks first_chunk .. first_chunk + n_chunks - 1 of one codec, chunk c's
  // message at in + (c - first_chunk) * in_stride (each in_bytes long): finish() of each, in
  // order, as one step (one launch on a CUDA device; then a chunk with an invalid record leaves
  // every chunk of the step unwritten, where the host stops at it).
  virtual Status finish_chunks(const PreparedCodec& codec, const void* layout, int first_chunk,
                               int n_chunks, const uint8_t* in, size_t in_stride, size_t in_bytes,
                               void* out, DType dtype, ReduceOp op, int n_contrib, Lane lane);
  virtual Status copy(void* dst, const void* src, size_t bytes, Lane lane) = 0;

  // ---- a call's statistics and layouts over every codec part --------------------------------
  // `parts` prepared for parts_stats and parts_layouts (plan time). The host device needs nothing
  // beyond the list; a CUDA device plans one launch over all the parts where its kernels allow.
  virtual Status prepare_parts(std::vector<PartSteps> parts, DType dtype,
                               std::unique_ptr<PreparedParts>* out) {
    *out = std::make_unique<PreparedParts>(std::move(parts), dtype);
    return Status::kOk;
  }
  // local_stats of every part with a stats_codec, its values at `input` + offset elements.
  virtual Status parts_stats(const PreparedParts& parts, const void* input, Lane lane);
  // build_layout of every part, for call number `call`.
  virtual Status parts_layouts(const PreparedParts& parts, uint64_t call, Lane lane);
  // build_layout of parts first .. end - 1 only, each its own step: what parts_layouts runs on a
  // device without a batched layout kernel.
  Status part_layouts(const PreparedParts& parts, size_t first, size_t end, uint64_t call,
                      Lane lane);
  // True when parts_layouts is one step over every part (a CUDA device's batched kernels), which
  // the engine then enqueues once, before any hop. False (the host device): each layout is a step
  // of its own anyway, so the engine enqueues a block's layouts just before the block's first
  // codec step, and the first block's messages need not wait for every other block's layout.
  virtual bool batches_layouts() const { return false; }
  // The budget's prediction of a call (DYNAMIQ_BITS=auto and the predicted-vNMSE metrics,
  // docs/ENGINE.md section 10) from its reduced statistics (device memory) into `out` (mapped
  // memory the host reads a control window later): run_budget_job() on the host device, the kernel
  // of kernels/cuda/budget.cu on a CUDA device, with the same bits. `job` (mapped) is not written
  // until the host has waited for this step. `scratch`: `scratch_bytes` of device memory, at
  // least budget_scratch_bytes() of the job's parts (a smaller one fails the step).
  virtual Status predict_budget(const BudgetJob* job, const uint16_t* reduced, void* scratch,
                                size_t scratch_bytes, BudgetResult* out, Lane lane) = 0;
  // Device memory predict_budget needs for a call of `n_parts` codec parts whose
  // budget_key_entries() (kernels/budget_math.h) add up to `key_entries` (0: none).
  virtual size_t budget_scratch_bytes(uint32_t /*n_parts*/, uint64_t /*key_entries*/) const {
    return 0;
  }
  // NCCL calls in stream order. On a GPU NCCL's own calls are stream-ordered, so `calls` runs at
  // once and its result is returned; the host device queues it behind the stream's earlier work
  // and reports a failure through the error word.
  virtual Status nccl(Lane lane, std::function<ncclResult_t()> calls) = 0;
  // True when NCCL's abort of a communicator ends the work this device holds queued on it, so
  // that an abort may come before the wait for that work. On a GPU every NCCL call was issued at
  // enqueue, only NCCL's kernels remain, and ncclCommAbort makes them exit. False on the host
  // device: its streams' threads make NCCL's calls when they reach them, and an abort (which
  // frees the communicator) must not race them; there only a revoke ends them early.
  virtual bool abort_ends_queued_nccl_work() const { return false; }
};

// The process-wide host device: host memory, the CPU NCCL. Streams are ordered work queues, each
// with a worker thread; any other stream handle (the caller's) is the calling thread itself.
Device* host_device();

// Test only: the host device's next `starts` streams start their threads, and every later one
// fails to as at a thread limit (std::system_error, which create_stream turns into
// kSystemError); -1, the default, fails none.
void host_stream_starts_before_failure(int starts);

// A host device that records every host read or write of its memory made between an enqueue
// and the next blocking wait (audit mode: queued work is held back until that wait, and the
// memory is protected meanwhile). For tests.
std::unique_ptr<Device> make_audited_host_device();
// Host accesses the audited device recorded so far (0 for any other device).
uint64_t audited_host_accesses(const Device* device);

}  // namespace dq::engine
