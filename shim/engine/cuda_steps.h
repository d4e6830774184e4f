// The host side of the CUDA device's codec steps, shared by its two builds: the emulated device
// (shim/engine/cuda_device.cc, the kernels under the CPU emulation, for the tests) and the real
// one (shim/engine/cuda_device_gpu.cu, nvcc, in libdynamiq.so). Both must check a step's arguments
// exactly alike and turn the kernels' flags into the same Status and error word, so that one
// engine behaves the same on either; only where the kernels run differs.
//
// What is here: the kernels' parameters for a planned DynamiQ codec, the host codec's argument
// checks in its order and with its Status, the kernels' flags as a Status (and as the error word
// the real device's fold kernel writes), and the level tables built once per option set.
// Include after nothing special: kernels/cuda/cuda_compat.h picks the CUDA runtime under nvcc and
// the emulation otherwise.
#pragma once
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>

#include "common/status.h"
#include "kernels/cuda/dynamiq.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_layout.h"
#include "kernels/payload.h"
#include "shim/engine/device.h"

namespace dq::engine::cuda_steps {

// The kernels' flags that mean the data was malformed (the host codec's kMalformedPayload); any
// other flag is a broken invariant (kInternal).
constexpr unsigned kMalformedFlags =
    cuda::kDynamiqBadHeader | cuda::kDynamiqBadRecord | cuda::kDynamiqTooManyWorkers;

// The Status of a step whose kernels raised `flags` (no logging; see step_status).
inline Status flags_status(unsigned flags) {
  if (flags & kMalformedFlags) return Status::kMalformedPayload;
  if (flags != 0) return Status::kInternal;
  return Status::kOk;
}

// The error word a step whose kernels raised malformed-data flags writes, and the one for any
// other flag: what the host device writes for the same Status (device.h's encoding).
inline uint32_t malformed_word() {
  return error_word(ErrorSource::kCodec, static_cast<int>(Status::kMalformedPayload));
}
inline uint32_t internal_word() {
  return error_word(ErrorSource::kCodec, static_cast<int>(Status::kInternal));
}

// The host codec's Status for a launch's result and the error flags its kernels raised. Call it
// with the launch's result in a variable: as two arguments of one call, the flags could be read
// before the launch (unspecified order; g++ does), and every failure would read as none.
inline Status step_status(cudaError_t launch, unsigned flags, const char* kernel) {
  if (launch == cudaErrorInvalidValue)
    DQ_FAIL(Status::kInvalidArgument, "cuda device: %s: invalid launch arguments", kernel);
  if (launch != cudaSuccess)
    DQ_FAIL(Status::kSystemError, "cuda device: %s: %s", kernel, cudaGetErrorString(launch));
  if (flags & kMalformedFlags)
    DQ_FAIL(Status::kMalformedPayload, "cuda device: %s: malformed input (flags 0x%x)", kernel,
            flags);
  if (flags & cuda::kDynamiqChunkOverCapacity)
    DQ_FAIL(Status::kInternal, "cuda device: %s: a chunk exceeds its message (flags 0x%x)", kernel,
            flags);
  if (flags != 0) DQ_FAIL(Status::kInternal, "cuda device: %s: flags 0x%x", kernel, flags);
  return Status::kOk;
}

// The kernels' parameters for `codec`; false when it has no kernels (not DynamiQ).
inline bool kernel_params(const Codec& codec, DynamiqOptions* o, cuda::DynamiqDeviceParams* out) {
  DynamiqPlan plan;
  if (!dynamiq_parameters(codec, o, &plan)) return false;
  *out = cuda::dynamiq_device_params(plan.count, plan.n_chunks, plan.n_workers, plan.capacity, *o);
  return true;
}

// ---- the host codec's argument checks, in its order, with its Status ---------------------------

inline Status check_chunk(const DynamiqPlan& p, int chunk) {
  if (chunk < 0 || chunk >= p.n_chunks)
    DQ_FAIL(Status::kInvalidArgument, "cuda device: chunk %d outside 0..%d", chunk,
            p.n_chunks - 1);
  return Status::kOk;
}

// The kernels read a whole chunk message (its length is in the layout, on the device): the
// engine's payload slots are chunk_capacity() bytes. The host codec accepts a shorter view
// that still holds the chunk's body; this device does not, with the host's Status.
inline Status check_message(const DynamiqPlan& p, int chunk, ByteView m, const char* what) {
  if (m.data == nullptr || m.size < p.capacity)
    DQ_FAIL(Status::kMalformedPayload,
            "cuda device %s: chunk %d message has %zu bytes, the plan's messages %zu", what, chunk,
            m.size, p.capacity);
  return Status::kOk;
}

inline Status check_stats(const DynamiqPlan& p, const ConstTensor& x) {
  if (x.count != p.count)
    DQ_FAIL(Status::kInvalidArgument, "cuda device stats: tensor has %zu elements, plan has %zu",
            x.count, p.count);
  return Status::kOk;
}

// The fused hop's arguments; `ptrs` receives the input messages' data for the launch.
inline Status check_hop(const DynamiqPlan& p, const void* layout, int chunk, const ConstTensor& own,
                        const ByteView* in, int n_in, const uint8_t* out, const RoundingKey& key,
                        const uint8_t* ptrs[cuda::kMaxHopInputs]) {
  DQ_CHECK(check_chunk(p, chunk));
  if (layout == nullptr) DQ_FAIL(Status::kInvalidArgument, "cuda device hop: no layout");
  if (own.count != p.count || (own.data == nullptr && p.count > 0))
    DQ_FAIL(Status::kInvalidArgument, "cuda device hop: own tensor has %zu elements, plan has %zu",
            own.count, p.count);
  if (n_in < 0 || n_in > cuda::kMaxHopInputs || (n_in > 0 && in == nullptr))
    DQ_FAIL(Status::kInvalidArgument, "cuda device hop: %d inputs, at most %d", n_in,
            cuda::kMaxHopInputs);
  if (out == nullptr) DQ_FAIL(Status::kInvalidArgument, "cuda device hop: no output buffer");
  if (key.strata < 1 || key.stratum >= key.strata)
    DQ_FAIL(Status::kInvalidArgument, "cuda device hop: stratum %u of %u", key.stratum,
            key.strata);
  DQ_CHECK(check_element_base(key, p.count));
  for (int i = 0; i < n_in; ++i) {
    DQ_CHECK(check_message(p, chunk, in[i], "hop"));
    ptrs[i] = in[i].data;
  }
  return Status::kOk;
}

inline Status check_finish(const DynamiqPlan& p, const void* layout, int chunk, ByteView in) {
  DQ_CHECK(check_chunk(p, chunk));
  if (layout == nullptr) DQ_FAIL(Status::kInvalidArgument, "cuda device finish: no layout");
  DQ_CHECK(check_message(p, chunk, in, "finish"));
  return Status::kOk;
}

// ---- level tables: built once per option set, by the host's builder ----------------------------

// The three tables (widths 2, 4, 8) of one option set, and what a device made of them (the real
// device: their copy in device memory, and the event that says the copy is done).
struct LevelSet {
  float eps[3];
  bool nonuniform;
  LevelTable table[3];
  const LevelTable* device = nullptr;  // what the kernels read (the emulated build: `table`)
  void* ready = nullptr;               // the real build: the upload's event
};

class LevelSets {
 public:
  // The set of `o`, made on first use; `made(set)` (under the lock, once per set) prepares it for
  // the device and may fail, in which case the set is dropped and nullptr returned. The address
  // is stable for the object's life (kernels hold pointers into it).
  template <class Made>
  LevelSet* get(const DynamiqOptions& o, Made&& made) {
    std::lock_guard<std::mutex> lock(m_);
    for (LevelSet& l : sets_)
      if (std::memcmp(l.eps, o.eps, sizeof l.eps) == 0 && l.nonuniform == o.nonuniform_levels)
        return &l;
    LevelSet& l = sets_.emplace_back();
    std::memcpy(l.eps, o.eps, sizeof l.eps);
    l.nonuniform = o.nonuniform_levels;
    cuda::dynamiq_level_tables(o, l.table);
    if (!made(l)) {
      sets_.pop_back();
      return nullptr;
    }
    return &l;
  }
  template <class F>
  void for_each(F&& f) {
    std::lock_guard<std::mutex> lock(m_);
    for (LevelSet& l : sets_) f(l);
  }

 private:
  std::mutex m_;
  std::deque<LevelSet> sets_;
};

}  // namespace dq::engine::cuda_steps
