// shim/engine/cuda_context.h on the CUDA driver, through the runtime's entry points.
#include "shim/engine/cuda_context.h"

#include <cuda.h>
#include <cuda_runtime.h>

namespace dq::engine::cuda_context {
namespace {

using CtxGetCurrent = CUresult (*)(CUcontext*);
using CtxSetCurrent = CUresult (*)(CUcontext);
using DeviceGet = CUresult (*)(CUdevice*, int);
using PrimaryRetain = CUresult (*)(CUcontext*, CUdevice);

struct Entries {
  CtxGetCurrent get_current = nullptr;
  CtxSetCurrent set_current = nullptr;
  DeviceGet device_get = nullptr;
  PrimaryRetain primary_retain = nullptr;
  std::string missing;  // the first entry point not found, empty when all were
};

// These four exist in every driver since CUDA 4.0; asked for as of 12.0 (their ABI since).
template <class F>
void resolve(const char* name, F* out, std::string* missing) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    if (missing->empty()) *missing = name;
    return;
  }
  *out = reinterpret_cast<F>(p);
}

const Entries& entries() {
  static const Entries* e = [] {
    auto* x = new Entries;  // never destroyed: used at exit by communicators' teardown
    resolve("cuCtxGetCurrent", &x->get_current, &x->missing);
    resolve("cuCtxSetCurrent", &x->set_current, &x->missing);
    resolve("cuDeviceGet", &x->device_get, &x->missing);
    resolve("cuDevicePrimaryCtxRetain", &x->primary_retain, &x->missing);
    return x;
  }();
  return *e;
}

}  // namespace

Context primary(int ordinal, std::string* why) {
  const Entries& e = entries();
  if (!e.missing.empty()) {
    if (why) *why = "the driver has no entry point " + e.missing;
    return nullptr;
  }
  CUdevice device = 0;
  CUcontext ctx = nullptr;
  CUresult r = e.device_get(&device, ordinal);
  if (r == CUDA_SUCCESS) r = e.primary_retain(&ctx, device);
  if (r != CUDA_SUCCESS || ctx == nullptr) {
    if (why)
      *why = "cuDevicePrimaryCtxRetain of device " + std::to_string(ordinal) +
             " failed with CUresult " + std::to_string(static_cast<int>(r));
    return nullptr;
  }
  return ctx;
}

bool Ops::current(Context* out) const {
  const Entries& e = entries();
  CUcontext c = nullptr;
  if (e.get_current == nullptr || e.get_current(&c) != CUDA_SUCCESS) return false;
  *out = c;
  return true;
}

bool Ops::set_current(Context c) const {
  const Entries& e = entries();
  return e.set_current != nullptr && e.set_current(static_cast<CUcontext>(c)) == CUDA_SUCCESS;
}

}  // namespace dq::engine::cuda_context
