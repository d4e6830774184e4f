// The CUDA driver's contexts, reached through the runtime's driver entry points
// (cudaGetDriverEntryPointByVersion), so libdynamiq.so still links no libcuda. The real CUDA
// device (cuda_device_gpu.cu) runs each call with its GPU's primary context current and restores
// the calling thread's own context after (scoped_context.h). Built by nvcc with that device.
#pragma once
#include <string>

namespace dq::engine::cuda_context {

using Context = void*;  // a CUcontext

// Device `ordinal`'s primary context (the one the runtime uses), retained for the process's life;
// nullptr with the reason in *why when the driver or its entry points are missing.
Context primary(int ordinal, std::string* why);

// ScopedContext's calls on the driver (cuCtxGetCurrent, cuCtxSetCurrent); false where primary()
// never succeeded.
struct Ops {
  using Context = cuda_context::Context;
  bool current(Context* out) const;
  bool set_current(Context c) const;
};

}  // namespace dq::engine::cuda_context
