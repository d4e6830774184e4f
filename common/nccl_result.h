// The one mapping from dq::Status to the NCCL result every layer returns: the shim's engine, the
// net plugin (dqNetResult has NCCL's values) and the CPU NCCL. docs/ENGINE.md ("Errors: the device
// error word") has the table; tests/errors pins it.
#pragma once

#include "common/nccl_api.h"
#include "common/status.h"

namespace dq {

constexpr ncclResult_t nccl_result(Status s) {
  switch (s) {
    case Status::kOk:
      return ncclSuccess;
    case Status::kInvalidArgument:
      return ncclInvalidArgument;
    case Status::kUnsupported:
      return ncclInvalidUsage;
    case Status::kMalformedPayload:  // a peer's bytes failed validation
    case Status::kTimeout:           // a peer did not answer
      return ncclRemoteError;
    case Status::kSystemError:
    case Status::kOutOfMemory:
      return ncclSystemError;
    case Status::kInternal:
      return ncclInternalError;
  }
  return ncclInternalError;  // not a Status: a bug
}

}  // namespace dq
