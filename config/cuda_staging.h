// CUDA device buffers on the CPU NCCL: an operation given device memory runs on host copies of
// it, made in the order of the caller's stream (so that in tests several processes can share one
// GPU through the CPU NCCL). The shim's host engine, which serves CPU NCCL communicators, computes
// on the same host copies (shim/engine/interceptor.cc, run_host_staged). The CUDA driver is loaded
// with dlopen at first use (libcuda.so.1, or $DYNAMIQ_CPU_NCCL_CUDA_DRIVER), never linked: without
// it every buffer is host memory, and the only cost per operation is one check of a cached flag.
// It sits in config/ because the driver's name is a setting (config/settings.def).
//
// What is staged: memory the driver reports as CU_MEMORYTYPE_DEVICE (cudaMalloc,
// cudaMallocAsync, managed memory). Pinned or registered host memory and memory CUDA does not
// know are used in place (no wait on the stream: the caller synchronises, as
// it always had to with this library). The CPU NCCL never initialises CUDA itself (no cuInit):
// in a process that has not used CUDA no pointer can be device memory, so host-only programs on
// a machine with a driver see no CUDA call beyond cuPointerGetAttribute answering "not
// initialised".
//
// Stream order, by blocking the calling host thread (acceptable for a test NCCL, and the CPU
// NCCL completes every operation before its call returns anyway): before the operation each
// device region is copied to the host with cuMemcpyDtoHAsync on the caller's stream followed by
// cuStreamSynchronize (so the copy sees all work enqueued on that stream before the call);
// after it, each region the operation wrote is copied back with cuMemcpyHtoDAsync on the same
// stream and the stream synchronised again, so work the caller enqueues next sees the result.
// Inside a group every operation is staged when it runs at ncclGroupEnd, on its own stream.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "common/status.h"

namespace dq::staging {

// Whether the driver library was loaded with every function staging needs; `why` gets the
// reason when not. Loaded once per process (the answer is cached).
bool available(std::string* why = nullptr);

// What a pointer is to the staging code.
enum class MemKind { kHost, kDevice };
// kDevice only for memory the (loaded, initialised) driver reports as device memory.
MemKind classify(const void* p);
// The CUDA device ordinal of device memory at `p`; -1 for anything classify() calls host.
int device_ordinal(const void* p);

// The host copies of one operation's caller buffers. Usage: add() every buffer the operation
// reads or writes, begin(), run the operation on host(ptr) for each of them, end().
class Staging {
 public:
  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  // A buffer of `bytes` at `p` the operation reads (`reads`: copied in) and/or writes
  // (`writes`: copied back), in the order of `stream` (a cudaStream_t; 0 is the legacy default
  // stream). Null or empty buffers are ignored. Without the driver this returns at once.
  void add(const void* p, size_t bytes, bool reads, bool writes, void* stream);
  // Classifies the buffers and copies the device ones in. Overlapping device buffers (in-place
  // operations) share one host copy, so aliasing is kept. kSystemError on a CUDA error (the
  // message in error()); kInvalidArgument, touching nothing, when a buffer's stream is being
  // captured into a CUDA graph.
  Status begin();
  // Where the operation finds `p`: p itself unless it lies in a staged region. Null stays null.
  void* host(const void* p) const;
  // Copies written regions back and waits for them. Safe to call once after a successful begin.
  Status end();
  // Whether any buffer was staged (device memory).
  bool active() const { return !regions_.empty(); }
  const std::string& error() const { return error_; }

 private:
  struct Pending {
    const char* p;
    size_t bytes;
    bool reads, writes;
    void* stream;
  };
  struct Region {
    const char* device;  // start of the merged device range
    size_t bytes;
    bool reads, writes;
    void* stream;   // the first buffer's stream
    void* context;  // CUcontext the copies run in
    std::vector<char> copy;
  };
  std::vector<Pending> pending_;
  std::vector<Region> regions_;
  std::string error_;
};

}  // namespace dq::staging
