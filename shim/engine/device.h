// Where the engine's work runs. The engine only enqueues through this interface, in stream
// order; it never waits on the device. The host implementation runs each step at once on host
// buffers (with the CPU NCCL); a CUDA implementation enqueues the same steps as kernels on the
// caller's stream, with the same codec arithmetic (kernels/dynamiq_math.h).
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "kernels/codec.h"

namespace dq::engine {

class Device {
 public:
  virtual ~Device() = default;
  virtual const char* name() const = 0;
  // Engine-owned buffers (payloads, statistics): device memory on a GPU.
  virtual Status alloc(size_t bytes, void** out) = 0;
  virtual void release(void* p) = 0;
  // True while `stream` is being captured into a CUDA graph (such calls pass through).
  virtual bool capturing(void* stream) const = 0;
  // True when `p` is memory this device can read and write (host memory for the host device).
  virtual bool owns(const void* p) const = 0;

  virtual Status local_stats(const Codec& codec, const ConstTensor& x, uint16_t* stats,
                             void* stream) = 0;
  virtual Status agree(Codec& codec, const uint16_t* reduced_stats, uint64_t call,
                       void* stream) = 0;
  virtual Status hop(const Codec& codec, int chunk, const ConstTensor& own, const ByteView* in,
                     int n_in, uint8_t* out, const RoundingKey& key, void* stream) = 0;
  virtual Status finish(const Codec& codec, int chunk, ByteView in, void* out, DType dtype,
                        ReduceOp op, int n_contrib, void* stream) = 0;
  virtual Status copy(void* dst, const void* src, size_t bytes, void* stream) = 0;
};

// Host memory, work done synchronously on the calling thread (codec kernels use TBB inside).
Device* host_device();

}  // namespace dq::engine
