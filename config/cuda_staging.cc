// CUDA device buffers on the CPU NCCL through host copies (see cuda_staging.h). The driver API
// is used, not the runtime: libcuda.so.1 is the one CUDA library every machine with a GPU has
// at a fixed name (the runtime's soname changes with the toolkit, and a program may link it
// statically), and it is what shim/engine/cuda_device_gpu.cu looks for too. Streams and
// contexts of the runtime are the driver's (a cudaStream_t is a CUstream).
#include "config/cuda_staging.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "common/log.h"
#include "config/settings.h"

namespace dq::staging {
namespace {

// The few driver API types and values used here (cuda.h is not needed to build this library).
using CUresult = int;
using CUdeviceptr = unsigned long long;
using CUcontext = void*;
using CUstream = void*;
using CUdevice = int;
constexpr CUresult kCudaSuccess = 0;
constexpr int kAttrContext = 1;            // CU_POINTER_ATTRIBUTE_CONTEXT
constexpr int kAttrMemoryType = 2;         // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kAttrDeviceOrdinal = 9;      // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemoryTypeDevice = 2;  // CU_MEMORYTYPE_DEVICE

struct Driver {
  CUresult (*pointer_get_attribute)(void*, int, CUdeviceptr) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  CUresult (*memcpy_dtoh_async)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*memcpy_htod_async)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*stream_synchronize)(CUstream) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;  // optional
  CUresult (*stream_is_capturing)(CUstream, int*) = nullptr;     // optional
  bool loaded = false;
  std::string why;  // when not loaded
};

std::string driver_library() {
  const std::string name = config::current().cpu_nccl_cuda_driver;  // DYNAMIQ_CPU_NCCL_CUDA_DRIVER
  return name.empty() ? "libcuda.so.1" : name;
}

template <class F>
bool resolve(void* h, const char* name, F* out, std::string* why) {
  *out = reinterpret_cast<F>(dlsym(h, name));
  if (*out == nullptr && why->empty()) *why = std::string("the CUDA driver lacks ") + name;
  return *out != nullptr;
}

// Loaded at first use, kept for the life of the process (never dlclosed: CUDA's own exit
// handlers may run after ours).
const Driver& driver() {
  static const Driver* d = [] {
    auto* drv = new Driver;
    const std::string lib = driver_library();
    void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* err = dlerror();
      drv->why = std::string("no CUDA driver: ") + lib + " cannot be loaded (" + (err ? err : "?") +
                 "); every buffer is host memory";
      DQ_INFO(Subsys::kCore, "cpu-nccl: %s", drv->why.c_str());
      return drv;
    }
    bool ok = resolve(h, "cuPointerGetAttribute", &drv->pointer_get_attribute, &drv->why);
    ok = resolve(h, "cuCtxPushCurrent_v2", &drv->ctx_push, &drv->why) && ok;
    ok = resolve(h, "cuCtxPopCurrent_v2", &drv->ctx_pop, &drv->why) && ok;
    ok = resolve(h, "cuMemcpyDtoHAsync_v2", &drv->memcpy_dtoh_async, &drv->why) && ok;
    ok = resolve(h, "cuMemcpyHtoDAsync_v2", &drv->memcpy_htod_async, &drv->why) && ok;
    ok = resolve(h, "cuStreamSynchronize", &drv->stream_synchronize, &drv->why) && ok;
    ok = resolve(h, "cuDeviceGet", &drv->device_get, &drv->why) && ok;
    ok = resolve(h, "cuDevicePrimaryCtxRetain", &drv->primary_ctx_retain, &drv->why) && ok;
    drv->get_error_name =
        reinterpret_cast<CUresult (*)(CUresult, const char**)>(dlsym(h, "cuGetErrorName"));
    drv->stream_is_capturing =
        reinterpret_cast<CUresult (*)(CUstream, int*)>(dlsym(h, "cuStreamIsCapturing"));
    if (!ok) {
      drv->why += std::string(" (") + lib + "); device buffers cannot be staged, every buffer " +
                  "is host memory";
      DQ_WARN(Subsys::kCore, "cpu-nccl: %s", drv->why.c_str());
      return drv;
    }
    drv->loaded = true;
    DQ_INFO(Subsys::kCore, "cpu-nccl: CUDA driver %s loaded: device buffers are staged",
            lib.c_str());
    return drv;
  }();
  return *d;
}

std::string cuda_error(const Driver& d, CUresult r, const char* what) {
  const char* name = nullptr;
  if (d.get_error_name == nullptr || d.get_error_name(r, &name) != kCudaSuccess) name = nullptr;
  return std::string("cpu-nccl: ") + what + " failed: CUDA error " + std::to_string(r) +
         (name ? std::string(" (") + name + ")" : std::string());
}

// The context a device pointer's copies run in: its own (CU_POINTER_ATTRIBUTE_CONTEXT), else
// (stream-ordered or managed allocations may have none) its device's primary context, which is
// the one the runtime uses. Null when neither can be had.
CUcontext context_of(const Driver& d, const void* p) {
  CUcontext ctx = nullptr;
  const auto dp = reinterpret_cast<CUdeviceptr>(p);
  if (d.pointer_get_attribute(&ctx, kAttrContext, dp) == kCudaSuccess && ctx != nullptr) return ctx;
  int ordinal = -1;
  if (d.pointer_get_attribute(&ordinal, kAttrDeviceOrdinal, dp) != kCudaSuccess || ordinal < 0)
    return nullptr;
  static std::mutex m;
  static auto* primary = new std::map<int, CUcontext>;  // retained once, never released
  std::lock_guard<std::mutex> lock(m);
  auto it = primary->find(ordinal);
  if (it != primary->end()) return it->second;
  CUdevice dev = 0;
  if (d.device_get(&dev, ordinal) != kCudaSuccess ||
      d.primary_ctx_retain(&ctx, dev) != kCudaSuccess)
    return nullptr;
  return (*primary)[ordinal] = ctx;
}

// Runs fn with `ctx` current on this thread (the operation may run on a thread of the CPU
// NCCL's own, which has none), restoring the previous one.
template <class F>
CUresult in_context(const Driver& d, CUcontext ctx, F&& fn) {
  CUresult r = d.ctx_push(ctx);
  if (r != kCudaSuccess) return r;
  r = fn();
  CUcontext popped = nullptr;
  const CUresult pop = d.ctx_pop(&popped);
  return r != kCudaSuccess ? r : pop;
}

}  // namespace

bool available(std::string* why) {
  const Driver& d = driver();
  if (!d.loaded && why) *why = d.why;
  return d.loaded;
}

MemKind classify(const void* p) {
  const Driver& d = driver();
  if (!d.loaded || p == nullptr) return MemKind::kHost;
  unsigned type = 0;
  // Not initialised (the process never used CUDA), or a pointer CUDA does not know
  // (CUDA_ERROR_INVALID_VALUE): host memory.
  if (d.pointer_get_attribute(&type, kAttrMemoryType, reinterpret_cast<CUdeviceptr>(p)) !=
      kCudaSuccess)
    return MemKind::kHost;
  return type == kMemoryTypeDevice ? MemKind::kDevice : MemKind::kHost;
}

int device_ordinal(const void* p) {
  if (classify(p) != MemKind::kDevice) return -1;
  int ordinal = -1;
  if (driver().pointer_get_attribute(&ordinal, kAttrDeviceOrdinal,
                                     reinterpret_cast<CUdeviceptr>(p)) != kCudaSuccess)
    return -1;
  return ordinal;
}

void Staging::add(const void* p, size_t bytes, bool reads, bool writes, void* stream) {
  if (p == nullptr || bytes == 0 || !driver().loaded) return;
  pending_.push_back(Pending{static_cast<const char*>(p), bytes, reads, writes, stream});
}

Status Staging::begin() {
  if (pending_.empty()) return Status::kOk;
  const Driver& d = driver();
  // Device buffers only, merged where they overlap (ncclAllGather in place: the send buffer is
  // a slice of the receive buffer; ncclReduceScatter the other way round).
  std::vector<Pending> device;
  for (const Pending& b : pending_)
    if (classify(b.p) == MemKind::kDevice) device.push_back(b);
  pending_.clear();
  if (device.empty()) return Status::kOk;
  std::sort(device.begin(), device.end(),
            [](const Pending& a, const Pending& b) { return a.p < b.p; });
  for (const Pending& b : device) {
    if (!regions_.empty() && b.p < regions_.back().device + regions_.back().bytes) {
      Region& r = regions_.back();
      r.bytes = std::max(r.bytes, static_cast<size_t>(b.p + b.bytes - r.device));
      r.reads = r.reads || b.reads;
      r.writes = r.writes || b.writes;
      continue;
    }
    Region r;
    r.device = b.p;
    r.bytes = b.bytes;
    r.reads = b.reads;
    r.writes = b.writes;
    r.stream = b.stream;
    r.context = context_of(d, b.p);
    if (r.context == nullptr) {
      error_ = "device buffer " + std::to_string(reinterpret_cast<uintptr_t>(b.p)) +
               " has no CUDA context to copy it in";
      regions_.clear();
      return Status::kSystemError;
    }
    regions_.push_back(std::move(r));
  }
  // A stream being captured into a CUDA graph: the copies would be captured and never run, and
  // the synchronisation CUDA refuses (it would invalidate the application's capture). The CPU
  // NCCL cannot take part in a graph: refused before touching the stream.
  // A query that fails is refused alike: the legacy stream asked while another stream captures
  // answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and synchronising it would invalidate that capture.
  for (const Region& r : regions_) {
    if (d.stream_is_capturing == nullptr) break;
    int capturing = 0;
    const CUresult q = in_context(d, r.context, [&] {
      return d.stream_is_capturing(static_cast<CUstream>(r.stream), &capturing);
    });
    if (q == kCudaSuccess && capturing == 0) continue;
    error_ = q == kCudaSuccess
                 ? "the caller's stream is being captured into a CUDA graph; the CPU NCCL cannot "
                   "run inside a capture"
                 : cuda_error(d, q, "asking whether the caller's stream is being captured") +
                       " (the legacy stream while another stream captures?): it is not touched";
    regions_.clear();
    return Status::kInvalidArgument;
  }
  // Copies in, each region on its stream: the copy follows the work enqueued there before the
  // call; the synchronisation makes the host copy complete before the operation reads it. A
  // region the operation only writes is copied in too (a few bytes of the operation's output may
  // not be produced on every rank, and what is copied back must then be what was there).
  for (Region& r : regions_) {
    r.copy.resize(r.bytes);
    const CUresult res = in_context(d, r.context, [&] {
      CUresult e = d.memcpy_dtoh_async(r.copy.data(), reinterpret_cast<CUdeviceptr>(r.device),
                                       r.bytes, static_cast<CUstream>(r.stream));
      return e != kCudaSuccess ? e : d.stream_synchronize(static_cast<CUstream>(r.stream));
    });
    if (res != kCudaSuccess) {
      error_ = cuda_error(d, res, "copying a device buffer to the host (cuMemcpyDtoHAsync)");
      regions_.clear();
      return Status::kSystemError;
    }
  }
  return Status::kOk;
}

void* Staging::host(const void* p) const {
  const char* c = static_cast<const char*>(p);
  for (const Region& r : regions_)
    if (c != nullptr && c >= r.device && c < r.device + r.bytes)
      return const_cast<char*>(r.copy.data()) + (c - r.device);
  return const_cast<void*>(p);
}

Status Staging::end() {
  const Driver& d = driver();
  Status s = Status::kOk;
  for (Region& r : regions_) {
    if (!r.writes) continue;
    // Back on the caller's stream, then waited for: the host copy is freed when this returns,
    // and work the caller enqueues after the call must see the result.
    const CUresult res = in_context(d, r.context, [&] {
      CUresult e = d.memcpy_htod_async(reinterpret_cast<CUdeviceptr>(r.device), r.copy.data(),
                                       r.bytes, static_cast<CUstream>(r.stream));
      return e != kCudaSuccess ? e : d.stream_synchronize(static_cast<CUstream>(r.stream));
    });
    if (res != kCudaSuccess && s == Status::kOk) {
      error_ = cuda_error(d, res, "copying a result back to the device (cuMemcpyHtoDAsync)");
      s = Status::kSystemError;
    }
  }
  regions_.clear();
  return s;
}

}  // namespace dq::staging
