// The real CUDA device (shim/engine/cuda_device_gpu.cu, built by nvcc into libdynamiq.so when the
// build has CUDA: meson option `cuda`). Plain C++ header: the interceptor (core library, host
// compiler) and the tests include it; nothing of CUDA's headers leaks out.
//
// libdynamiq.so must load and work where there is no GPU and no driver: the CUDA runtime is linked
// statically into it (libcudart_static, as NCCL itself does), and the static runtime dlopens the
// driver (libcuda.so.1) only at the first CUDA call. Without a driver, a device, or a driver new
// enough for the runtime, the device is unavailable: cuda_gpu_device() returns nullptr with the
// reason, and calls pass through as before (PassReason::kNoDevice).
//
// The functions are declared weak: in a build without CUDA (or a program that does not link the
// CUDA device, e.g. the core library's own tests) they are null, and callers check for that first
// (`cuda_gpu_linked()`).
#pragma once
#include <cstddef>
#include <string>

#include "shim/engine/device.h"

namespace dq::engine {

// The process-wide CUDA device for device ordinal `ordinal` (-1: the calling thread's current
// device), made at first use; nullptr when CUDA cannot be used in this process, with `why` saying
// why (e.g. "no CUDA driver (libcuda.so.1): ..."). Never throws, never aborts.
// Where a driver and the device are there but the device could not be set up (its kernels'
// modules, a pool or a stream failed, e.g. short of GPU memory), `standby` receives a device that
// only hands out mapped memory and fails every stream: an engine given it takes the set-up
// failure's path and still answers its peers' handshake, so that this rank's failure, which its
// peers do not share, cannot leave them in a handshake it never joins.
Device* cuda_gpu_device(int ordinal, std::string* why, Device** standby = nullptr)
    __attribute__((weak));

// How the CUDA device can reach a buffer the caller passed.
enum class CudaBuffer {
  kDevice,        // device or managed memory, or host memory mapped into the device (pinned)
  kPageable,      // pageable host memory that the device reads through HMM/ATS
  kInaccessible,  // pageable host memory the device cannot read (neither can NVIDIA's NCCL)
  kUnknown,       // the runtime could not say (its error in `why`)
};
CudaBuffer cuda_gpu_classify(const void* p, int ordinal, std::string* why) __attribute__((weak));

// Whether this program contains the CUDA device at all (a CUDA build's libdynamiq.so does).
inline bool cuda_gpu_linked() {
  return cuda_gpu_device != nullptr && cuda_gpu_classify != nullptr;
}

}  // namespace dq::engine
