// The compression engine of one communicator: a compressed all-reduce built from the codec
// (kernels/), a schedule (topo/), NCCL point-to-point in groups, and one small grouped
// all-reduce of statistics + control words. Plans (codec sizes, this rank's program, buffers)
// are made once per (count, dtype) and cached; the per-call path allocates nothing.
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "config/settings.h"
#include "shim/engine/control.h"
#include "shim/engine/device.h"
#include "shim/engine/metrics.h"
#include "shim/engine/nccl_ops.h"
#include "topo/schedule.h"

namespace dq::engine {

struct CommInfo {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int nranks = 1;
};

struct CallArgs {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  ncclDataType_t dtype = ncclFloat32;
  ncclRedOp_t op = ncclSum;
  cudaStream_t stream = nullptr;
  bool in_group = false;
  bool capturing = false;
};

class Engine {
 public:
  // `settings_valid` false: this rank's environment failed to parse (it still takes part in the
  // agreement, so the other ranks learn it and everyone passes through).
  Engine(const config::Settings& settings, bool settings_valid, CommInfo comm, const NcclOps& ops,
         Device* device, std::shared_ptr<CommMetrics> metrics, bool opted_in);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  enum class State { kPending, kAgreed, kInert };

  // The whole rerouting decision and, when it says so, the compressed all-reduce. On return
  // *reason says whether the call was compressed (kRerouted) or must now be passed through by
  // the caller (nothing was written to recv). A non-success result is an NCCL or peer failure
  // to hand to the caller.
  //
  // The first call on a communicator (outside a group or capture) runs a handshake: a MAX
  // all-reduce of the control words, so every rank learns whether the agreed settings and the
  // opt-in match before any rank screens a call by them. A mismatch makes the communicator
  // pass everything through, with one warning naming what differs.
  ncclResult_t all_reduce(const CallArgs& call, PassReason* reason);

  // Decision from the call's arguments and this communicator's agreed state alone.
  PassReason screen(const CallArgs& call) const;
  // Explicit opt-in (dynamiqCommRegister): only before the handshake, so it cannot diverge.
  Status register_opt_in(bool on);

 private:
  struct Plan;
  Plan* plan_for(size_t count, DType dtype, Status* status);
  bool allocate_arenas(Plan& plan);
  ncclResult_t handshake(cudaStream_t stream);
  ncclResult_t exchange(Plan* plan, const CallArgs& call, ControlDecision* decision);
  ncclResult_t compressed(Plan& plan, const CallArgs& call, uint64_t* wire_bytes);
  ncclResult_t stage_comm(Plan& plan, int block, int stage, cudaStream_t stream,
                          uint64_t* wire_bytes);
  Status stage_compute(Plan& plan, int block, int stage, const CallArgs& call);
  void warn_differs(const std::string& what);
  // The A/B switch as rank 0 reads it (control file); always on for other ranks.
  bool read_switch();
  // Counts one call under `reason` in this communicator's metrics.
  void count(PassReason reason);

  config::Settings settings_;
  bool settings_valid_;
  CommInfo comm_;
  NcclOps ops_;
  Device* device_;
  std::shared_ptr<CommMetrics> metrics_;
  bool opted_in_ = false;
  State state_ = State::kPending;
  topo::Kind kind_;
  uint64_t call_seq_ = 0;  // agreed calls so far: keys the rounding generator
  std::string warned_differs_;
  std::list<std::unique_ptr<Plan>> plans_;  // most recently used first
  std::vector<uint32_t> control_local_, control_reduced_;
  // Control file state (rank 0 only).
  int64_t switch_mtime_ns_ = -1;
  bool switch_on_ = true;
};

// Chooses the schedule for `nranks` under DYNAMIQ_TOPO.
topo::Kind choose_topology(const std::string& setting, int nranks);

}  // namespace dq::engine
