// The CUDA device: the engine's codec steps as the CUDA kernels of kernels/cuda/ (statistics,
// layout build, fused hop, finish), enqueued in stream order, with the bytes of the host codec.
//
// This is the emulated CUDA device: cuda_device.cc compiled by the host compiler runs the kernels
// under the CPU emulation of CUDA's execution model (kernels/cuda/EMULATION.md) on host memory, so
// the whole engine runs them over the CPU NCCL in CI. It is test-only (tests/shim/meson.build),
// never part of the core library or libdynamiq.so. The real CUDA device, which launches the same
// kernels compiled by nvcc on cudaStream_t/cudaEvent_t and device memory, is
// shim/engine/cuda_device_gpu.{h,cu}; both share their host side (shim/engine/cuda_steps.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "shim/engine/device.h"

namespace dq::engine {

// What an emulated CUDA device has run so far, per step kind: as kernels (DynamiQ and the
// baselines; a baseline's statistics step has nothing to launch and counts as run), or on the
// host codec (a codec no kernels serve).
struct CudaDeviceCounts {
  uint64_t stats = 0, layouts = 0, hops = 0, finishes = 0;  // kernel steps run
  uint64_t host_fallbacks = 0;                              // codec steps run by the host codec
  uint64_t budgets = 0;                                     // budget predictions run as kernels
  // Kernel launches of the steps counted above (the emulator's count): all, and the hops' alone.
  uint64_t launches = 0, hop_launches = 0;
};

// A device whose codec steps are the CUDA kernels run under the emulation, and whose memory,
// streams, events, copies and NCCL calls are `host`'s (nullptr: host_device()): an emulated
// launch is a host function that runs the whole grid before it returns, queued on `host`'s
// stream in order. DynamiQ and the baselines (bf16, mxfp8, mxfp6e3m2/e2m3, mxfp4, uniform:B) run
// as kernels; a codec without kernels runs its steps through `host` unchanged, counted in
// host_fallbacks.
//
// `fault` (tests only, and only in this emulated build): a deliberately corrupted kernel, for the
// canary's test (docs/ENGINE.md section 6).
struct EmulatedCudaFault {
  // Every fused hop with at least one input has this byte of its output XORed with `mask` after
  // the kernel ran (-1: none; a byte past the chunk's capacity: none).
  int64_t hop_output_byte = -1;
  uint8_t mask = 0x02;
  // Instead of those hops: every stratified leaf (no input, RoundingKey::strata > 1), a fault only
  // a canary that runs correlated rounding's stratified path finds.
  bool stratified_leaves = false;
  // Streams the device creates before every later create_stream fails (-1: none fails): an
  // engine whose device cannot be set up, while the caller's own streams exist.
  int streams_before_failure = -1;
};
std::unique_ptr<Device> make_emulated_cuda_device(Device* host = nullptr,
                                                  EmulatedCudaFault fault = {});

// Graph capture on a device from make_emulated_cuda_device(), modelled on CUDA's global capture
// mode, for the tests: while it runs, capturing(stream) is true, and any call CUDA refuses during
// a capture (an allocation or release, an event query or synchronisation) fails and invalidates
// it; so does any work enqueued on the capturing stream (stricter than CUDA, which would record
// it into the graph: a rerouted call's work must never be replayed). One capture at a time.
// end: kOk when nothing invalidated the capture, else kSystemError with the first offending call
// in `why`.
Status emulated_cuda_begin_capture(Device* device, StreamHandle stream);
Status emulated_cuda_end_capture(Device* device, std::string* why);

// The counts of a device from make_emulated_cuda_device() (zeros for any other device).
CudaDeviceCounts cuda_device_counts(const Device* device);

}  // namespace dq::engine
