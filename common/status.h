// Result codes and the one checking macro used at every call site (NCCL style):
// a failing call logs file:line and the expression, so a WARN shows the whole call chain.
#pragma once
#include "common/log.h"

namespace dq {

enum class Status : int {
  kOk = 0,
  kInvalidArgument = 1,   // caller passed something we cannot honour (named in the log)
  kMalformedPayload = 2,  // bytes from a peer failed validation; nothing was read out of bounds
  kOutOfMemory = 3,
  kSystemError = 4,  // errno / CUDA failure, converted where it happened
  kTimeout = 5,      // a peer did not answer within the configured timeout
  kInternal = 6,     // a broken invariant: a bug in dynamiq
  kUnsupported = 7,  // valid request this build or configuration cannot serve
};

const char* status_name(Status s);

}  // namespace dq

// Evaluate a call returning dq::Status; on failure log where and propagate.
#define DQ_CHECK(call)                                                                      \
  do {                                                                                      \
    ::dq::Status dq_check_status_ = (call);                                                 \
    if (dq_check_status_ != ::dq::Status::kOk) {                                            \
      DQ_WARN(::dq::Subsys::kCore, "%s -> %s", #call, ::dq::status_name(dq_check_status_)); \
      return dq_check_status_;                                                              \
    }                                                                                       \
  } while (0)

// Fail with a status and a message naming what was wrong.
#define DQ_FAIL(status, ...)                   \
  do {                                         \
    DQ_WARN(::dq::Subsys::kCore, __VA_ARGS__); \
    return (status);                           \
  } while (0)
