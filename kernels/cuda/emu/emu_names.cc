// The emulator's names for its faults and for the CUDA error codes it returns.
#include "kernels/cuda/emu/emu.h"

namespace dq::emu {

const char* fault_name(Fault f) {
  switch (f) {
    case Fault::kNone:
      return "no fault";
    case Fault::kBadConfig:
      return "invalid launch configuration";
    case Fault::kNestedLaunch:
      return "launch from inside a kernel";
    case Fault::kDeadlock:
      return "deadlock";
    case Fault::kBarrierDivergence:
      return "divergent __syncthreads";
    case Fault::kWarpMismatch:
      return "warp collective mismatch";
    case Fault::kBadMask:
      return "invalid warp mask";
    case Fault::kLaneOutsideMask:
      return "shuffle reads a lane outside its mask";
    case Fault::kBadWidth:
      return "invalid shuffle width";
    case Fault::kSharedUnderrun:
      return "shared memory out of bounds";
    case Fault::kException:
      return "exception in a kernel";
    case Fault::kNotLoaded:
      return "kernel launched before it was loaded";
  }
  return "?";
}

}  // namespace dq::emu

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure (see dq::emu::last_report())";
  }
  return "unknown error";
}
