// The emulator's names for its faults, its warp collectives, runs of thread numbers and the CUDA
// error codes it returns.
#include <string>
#include <vector>

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
    case Fault::kMisaligned:
      return "misaligned global-memory access";
    case Fault::kTsanLimit:
      return "too many atomic reads between fences for the TSan build";
  }
  return "?";
}

namespace detail {

const char* collective_name(Op op) {
  switch (op) {
    case Op::kIdx:
      return "__shfl_sync";
    case Op::kUp:
      return "__shfl_up_sync";
    case Op::kDown:
      return "__shfl_down_sync";
    case Op::kXor:
      return "__shfl_xor_sync";
    case Op::kBallot:
      return "__ballot_sync";
    case Op::kAny:
      return "__any_sync";
    case Op::kAll:
      return "__all_sync";
    case Op::kSyncWarp:
      return "__syncwarp";
  }
  return "?";
}

std::string thread_ranges(const std::vector<int>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!s.empty()) s += ", ";
    s += std::to_string(ids[i]);
    if (j > i) {
      s += '-';
      s += std::to_string(ids[j]);
    }
    i = j + 1;
  }
  return s;
}

}  // namespace detail
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
