// Device memory for the kernel-vs-host tests, so that one test source runs both under the CPU
// emulation (kernels/cuda/EMULATION.md: kernels take host pointers) and, compiled by nvcc
// (tests/gpu/meson.build), on a real device:
//  - DeviceArray<T>: a host array as the kernels see it. Under the emulation it is the host
//    array itself, and fetch() does nothing, so the emulated tests run exactly as before. Under
//    CUDA it is a cudaMalloc'ed copy written from the host array when made; fetch() waits for
//    the device and copies it back into a host array.
//  - MappedArray<T>: the same for memory the host and the device both read (a job the host
//    sizes grids from, a result the host reads): under CUDA, mapped pinned memory
//    (cudaHostAllocMapped; with unified addressing its pointer is the device's too).
//  - kernel_fault(): what went wrong in the last launch, for a test's failure message.
//  - launches_so_far(), DQ_EXPECT_LAUNCHES(made, expected): the emulator counts launches; a real
//    device does not (0), and there the comparison is compiled but never made.
//  - reduced_matrix(): DQ_KERNEL_TESTS_REDUCED=1 (set by tests/gpu/check.sh under
//    compute-sanitizer, which is slow) leaves out the largest cases of the matrix.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_compat.h"

namespace dq::cuda::test {

inline bool reduced_matrix() {
  const char* v = std::getenv("DQ_KERNEL_TESTS_REDUCED");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

#if DQ_CUDA_EMULATED

inline std::string kernel_fault() {
  return emu::last_report().message;
}

inline uint64_t launches_so_far() {
  return emu::launches();
}
#define DQ_EXPECT_LAUNCHES(made, expected) EXPECT_EQ(made, expected)

template <class T>
class DeviceArray {
 public:
  DeviceArray(const T* host, size_t n) : ptr_(const_cast<T*>(host)), n_(n) {}
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.data(), host.size()) {}
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  // The kernels wrote the host array itself; only a different destination needs a copy.
  cudaError_t fetch(T* host) const {
    if (host != ptr_ && n_ > 0) std::memcpy(host, ptr_, n_ * sizeof(T));
    return cudaSuccess;
  }
  cudaError_t fetch(std::vector<T>& host) const { return fetch(host.data()); }

 private:
  T* ptr_;
  size_t n_;
};

// Host memory is the emulator's device memory: the host array itself, as DeviceArray.
template <class T>
using MappedArray = DeviceArray<T>;

#else  // real CUDA

inline std::string kernel_fault() {
  const cudaError_t e = cudaPeekAtLastError();
  return std::string("CUDA: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

inline uint64_t launches_so_far() {
  return 0;
}
// As gtest's own assertions guard their else: safe after an if without braces. `made` is still
// evaluated (once), so a call that does the work under test may be passed: it runs on a device
// too, only its count goes unchecked.
#define DQ_EXPECT_LAUNCHES(made, expected) \
  switch (0)                               \
  case 0:                                  \
  default:                                 \
    if (true) {                            \
      (void)(made);                        \
    } else                                 \
      EXPECT_EQ(made, expected)

template <class T>
class DeviceArray {
 public:
  DeviceArray(const T* host, size_t n) : n_(n) {
    if (n == 0) return;
    void* p = nullptr;
    status_ = cudaMalloc(&p, n * sizeof(T));
    if (status_ != cudaSuccess) return;
    ptr_ = static_cast<T*>(p);
    status_ = cudaMemcpy(ptr_, host, n * sizeof(T), cudaMemcpyHostToDevice);
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.data(), host.size()) {}
  DeviceArray(DeviceArray&& o) noexcept : ptr_(o.ptr_), n_(o.n_), status_(o.status_) {
    o.ptr_ = nullptr;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray& operator=(DeviceArray&&) = delete;
  ~DeviceArray() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  // nullptr for an empty array or a failed allocation (fetch() then returns the error).
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  // Waits for the device, then copies the array into `host` (n elements). Returns the first
  // error: the allocation's, the device's (a kernel that faulted) or the copy's.
  cudaError_t fetch(T* host) const {
    if (status_ != cudaSuccess) return status_;
    const cudaError_t sync = cudaDeviceSynchronize();
    if (sync != cudaSuccess || n_ == 0) return sync;
    return cudaMemcpy(host, ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
  }
  cudaError_t fetch(std::vector<T>& host) const { return fetch(host.data()); }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
  cudaError_t status_ = cudaSuccess;
};

template <class T>
class MappedArray {
 public:
  MappedArray(const T* host, size_t n) : n_(n) {
    if (n == 0) return;
    void* p = nullptr;
    status_ = cudaHostAlloc(&p, n * sizeof(T), cudaHostAllocMapped);
    if (status_ != cudaSuccess) return;
    ptr_ = static_cast<T*>(p);
    std::memcpy(static_cast<void*>(ptr_), host, n * sizeof(T));
    // The one pointer must serve both sides (the host reads a job the device reads too).
    void* dev = nullptr;
    status_ = cudaHostGetDevicePointer(&dev, p, 0);
    if (status_ == cudaSuccess && dev != p) status_ = cudaErrorNotSupported;
  }
  explicit MappedArray(const std::vector<T>& host) : MappedArray(host.data(), host.size()) {}
  MappedArray(const MappedArray&) = delete;
  MappedArray& operator=(const MappedArray&) = delete;
  ~MappedArray() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
  }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  // Waits for the device, then copies the array into `host` (n elements); the first error.
  cudaError_t fetch(T* host) const {
    if (status_ != cudaSuccess) return status_;
    const cudaError_t sync = cudaDeviceSynchronize();
    if (sync != cudaSuccess || n_ == 0) return sync;
    std::memcpy(static_cast<void*>(host), ptr_, n_ * sizeof(T));
    return cudaSuccess;
  }
  cudaError_t fetch(std::vector<T>& host) const { return fetch(host.data()); }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
  cudaError_t status_ = cudaSuccess;
};

#endif

}  // namespace dq::cuda::test
