// The NCCL entry points the engine uses, as a table: the shim fills it with the real NCCL's
// functions (dlsym RTLD_NEXT), tests with the CPU NCCL's. The engine never calls NCCL directly,
// so its own calls never re-enter the interposer.
#pragma once
#include "common/nccl_api.h"

namespace dq::engine {

struct NcclOps {
  ncclResult_t (*group_start)() = nullptr;
  ncclResult_t (*group_end)() = nullptr;
  ncclResult_t (*send)(const void*, size_t, ncclDataType_t, int, ncclComm_t,
                       cudaStream_t) = nullptr;
  ncclResult_t (*recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*all_reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                             cudaStream_t) = nullptr;
  const char* (*error_string)(ncclResult_t) = nullptr;
  // The two-level schedule's (shim/engine/engine_hierarchy.cc): the exact steps inside a node,
  // the rail's pass-through, and the node and rail communicators' lifetime. Optional: without
  // them every communicator runs the flat schedule.
  ncclResult_t (*reduce_scatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                 ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*all_gather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                             cudaStream_t) = nullptr;
  ncclResult_t (*reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t,
                         cudaStream_t) = nullptr;
  ncclResult_t (*comm_split)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_abort)(ncclComm_t) = nullptr;

  bool complete() const {
    return group_start && group_end && send && recv && all_reduce && error_string;
  }
  bool two_level_capable() const {
    return complete() && reduce_scatter && all_gather && reduce && comm_split && comm_destroy &&
           comm_abort;
  }
};

}  // namespace dq::engine
