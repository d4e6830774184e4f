// The shim's logic behind the extern "C" boundary (shim/exports.cc): the real NCCL's entry
// points, the table of communicators this process created, and the per-call routing decision.
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "common/nccl_api.h"
#include "shim/engine/metrics.h"
#include "shim/engine/nccl_ops.h"

namespace dq::shim {

// The real NCCL's functions, resolved once: the next library after ours (dlsym RTLD_NEXT), or the
// loaded object that defines them where NCCL is only in a local scope (interceptor.cc).
struct RealNccl {
  engine::NcclOps ops;
  ncclResult_t (*comm_init_rank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*comm_init_rank_config)(ncclComm_t*, int, ncclUniqueId, int,
                                        ncclConfig_t*) = nullptr;
  ncclResult_t (*comm_init_rank_scalable)(ncclComm_t*, int, int, int, ncclUniqueId*,
                                          ncclConfig_t*) = nullptr;
  ncclResult_t (*comm_init_all)(ncclComm_t*, int, const int*) = nullptr;
  ncclResult_t (*comm_split)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*) = nullptr;
  // NCCL 2.27+ and 2.28+: null before.
  ncclResult_t (*comm_shrink)(ncclComm_t, int*, int, ncclComm_t*, ncclConfig_t*, int) = nullptr;
  ncclResult_t (*comm_revoke)(ncclComm_t, int) = nullptr;
  ncclResult_t (*group_simulate_end)(ncclSimInfo_t*) = nullptr;  // NCCL 2.22+
  ncclResult_t (*comm_finalize)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_abort)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_count)(const ncclComm_t, int*) = nullptr;
  const char* (*get_last_error)(ncclComm_t) = nullptr;  // NCCL 2.13+
  ncclResult_t (*comm_user_rank)(const ncclComm_t, int*) = nullptr;
  ncclResult_t (*comm_get_async_error)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*reduce_scatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                 ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t,
                         cudaStream_t) = nullptr;
  // Present only when the real NCCL is dynamiq's CPU NCCL: host buffers, the host engine.
  const char* (*cpu_nccl_comm_name)(ncclComm_t) = nullptr;
  // Present only when libcudart is loaded: graph capture shows through it.
  int (*stream_is_capturing)(cudaStream_t, int*) = nullptr;
};

// Resolves once; nullptr (with one WARN) when the next library is not an NCCL.
const RealNccl* real_nccl();

// The NCCL versions this build supports (ncclGetVersion codes, major*10000 + minor*100 + patch):
// every entry point, enum value and ncclConfig_t field the shim uses has the ABI of the NCCL 2.28
// headers it is built against from 2.18 (ncclCommSplit) on. Outside: one WARN and every
// communicator passes through, unless DYNAMIQ_UNTESTED_NCCL=1.
inline constexpr int kMinNcclVersion = 21800;
inline constexpr int kMaxNcclVersion = 22899;
// The wrapped NCCL's ncclGetVersion code (-1: none), and "" or why this build does not compress
// on it; read once, at real_nccl().
int nccl_version();
const std::string& nccl_unsupported();

// Lifecycle: record identity at creation (name, split color, creation order) and drop the
// engine before the real destroy (after the real abort on the CUDA device: comm_aborted).
// `id`: the unique id it was made from (ncclCommInitRank*), for NCCL's commId and commHash in
// the decision line; null for a split or ncclCommInitAll.
void comm_created(ncclComm_t comm, const ncclConfig_t* config, int color, ncclComm_t parent,
                  const ncclUniqueId* id = nullptr);
void comm_finalizing(ncclComm_t comm);
void comm_destroyed(ncclComm_t comm);
// ncclCommAbort: on the CUDA device the real abort (`real_abort`) comes before the engine's
// teardown, which would otherwise wait forever for NCCL work stuck on a dead peer; on the host
// device after it, as for a destroy, with a revoke of the communicator first (an NCCL that has
// one) so that the host device's calls stuck on a peer end at once. Either way the engine's own
// node and rail communicators are revoked before the teardown waits for its streams.
ncclResult_t comm_aborted(ncclComm_t comm, const std::function<ncclResult_t()>& real_abort);
// ncclCommRevoke: a call in progress on another thread enqueues nothing more, the real revoke
// ends the communicator's operations in flight (the engine's among them), the engine's own node
// and rail communicators are revoked too, and the engine is torn down; later calls on the
// communicator go to the real NCCL, which refuses them. The entry stays (its identity) until the
// communicator is destroyed or aborted.
ncclResult_t comm_revoked(ncclComm_t comm, const std::function<ncclResult_t()>& real_revoke);
// ncclCommShrink: with NCCL_SHRINK_ABORT the parent is first retired as by a revoke (the real
// shrink ends its operations); the new communicator stands in for the parent: it takes the
// parent's opt-in decision (by DYNAMIQ_COMMS or dynamiqCommRegister: a size= rule would no
// longer match its size), name and split color; its size and creation index are its own.
ncclResult_t comm_shrunk(ncclComm_t comm, int shrink_flags, ncclComm_t* newcomm,
                         const ncclConfig_t* config,
                         const std::function<ncclResult_t()>& real_shrink);

// Group depth of the calling thread (ncclGroupStart/End pass through us). Gradient collectives
// a framework coalesces in a group (Megatron: every bucket) that the engine may compress are held
// back and run, in order, when the outermost group ends, after the real ncclGroupEnd: group
// members are independent by NCCL's contract. A group whose calls (held back or not) are on more
// than one communicator has its held calls issued unchanged in a second real group instead.
// docs/ENGINE.md section 8.
void group_started();
ncclResult_t group_end(const RealNccl& real);
// ncclGroupSimulateEnd closes the group as ncclGroupEnd does, but nothing in it runs: the calls
// held back join the real group unchanged (NCCL estimates them as it would run them), and none
// is left to run at a later group's end.
ncclResult_t group_simulate_end(const RealNccl& real, ncclSimInfo_t* sim_info);

// The interposed gradient collectives: each reroutes through the engine or forwards to the real
// NCCL.
ncclResult_t all_reduce(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                        ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t reduce_scatter(const void* send, void* recv, size_t recvcount, ncclDataType_t dtype,
                            ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t reduce(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                    ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);

// ncclCommGetAsyncError: the real NCCL's answer, or else the engine's asynchronous error (a
// failure found by an enqueued step; docs/ENGINE.md section 4).
ncclResult_t comm_async_error(ncclComm_t comm, ncclResult_t* async_error);

// ncclGetLastError: after a call that failed in dynamiq (an engine's error, not NCCL's), that
// failure's warning ("dynamiq: ..."), until a call passed to NCCL fails; otherwise NCCL's own
// text. Frameworks put it in their exception (PyTorch: "Last error:"), where NCCL's would
// describe an older, unrelated failure or nothing.
const char* last_error(ncclComm_t comm);

// dynamiqCommRegister: explicit opt-in (1) or opt-out (0) before the first all-reduce.
ncclResult_t register_comm(ncclComm_t comm, int enable);

// Calls on `comm` so far: compressed, and passed through (any reason).
ncclResult_t comm_counters(ncclComm_t comm, uint64_t* rerouted, uint64_t* passed);
// Caller bytes of compressed calls and the bytes this rank sent for them.
ncclResult_t comm_bytes(ncclComm_t comm, uint64_t* bytes_in, uint64_t* wire_bytes);
// A copy of the budget metrics of `comm` (dynamiqCommBudget).
ncclResult_t comm_budget(ncclComm_t comm, engine::BudgetMetrics* out);

}  // namespace dq::shim
