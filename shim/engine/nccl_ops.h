// The NCCL entry points the engine uses, as a table: the shim fills it with the real NCCL's
// functions (dlsym RTLD_NEXT), tests with the CPU NCCL's. The engine never calls NCCL directly,
// so its own calls never re-enter the interposer.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

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
  // Optional (NCCL 2.28+): revoke_own_communicators() ends the node and rail communicators'
  // operations in flight with it.
  ncclResult_t (*comm_revoke)(ncclComm_t, int) = nullptr;
  // Optional (the CPU NCCL's communicators are all blocking): for settled().
  ncclResult_t (*comm_get_async_error)(ncclComm_t, ncclResult_t*) = nullptr;
  // Set once another thread began aborting the communicator (Engine::watch_abort): settled()
  // then stops polling it, since NVIDIA's abort frees it. Null: never (the shim's own table).
  const std::atomic<bool>* abort_flag = nullptr;

  // `r`, what an NCCL call on `comm` returned, once NCCL has issued it. A non-blocking
  // communicator answers ncclInProgress while the operation is still being issued, which is not
  // a failure: as NCCL documents, the caller polls ncclCommGetAsyncError until the state leaves
  // ncclInProgress, and that state is the result. Bounded by timeout_ms, then ncclRemoteError (a
  // peer that never joined, as every other wait of the engine for its peers reports it): never
  // ncclInProgress, which stored as a communicator's error, or returned from a group's end whose
  // held calls were not all issued, would have the application poll for good. 20 us between polls
  // after the first thousand. An abort begun on another thread ends the polling with
  // ncclInvalidUsage (what the engine's calls return once it aborts): the communicator's memory
  // may be gone, and the wait would otherwise last until timeout_ms, the aborting thread's
  // teardown waiting with it.
  ncclResult_t settled(ncclComm_t comm, ncclResult_t r, int64_t timeout_ms) const {
    if (r != ncclInProgress || comm_get_async_error == nullptr) return r;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (uint64_t poll = 0;; ++poll) {
      if (abort_flag != nullptr && abort_flag->load(std::memory_order_acquire))
        return ncclInvalidUsage;
      ncclResult_t state = ncclInProgress;
      if (const ncclResult_t q = comm_get_async_error(comm, &state); q != ncclSuccess) return q;
      if (state != ncclInProgress) return state;
      if (std::chrono::steady_clock::now() >= deadline) return ncclRemoteError;
      if (poll >= 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  bool complete() const {
    return group_start && group_end && send && recv && all_reduce && error_string;
  }
  bool two_level_capable() const {
    return complete() && reduce_scatter && all_gather && reduce && comm_split && comm_destroy &&
           comm_abort;
  }
};

}  // namespace dq::engine
