// A CPU NCCL communicator: bootstrap over the net plugin, a full mesh of plugin connections
// (one send and one receive comm per peer), and the collective algorithms on host memory.
// Implemented in comm.cc (the object), root.cc (the bootstrap root), mesh.cc (init, split and
// the mesh) and collectives.cc (data movement).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "tools/cpu-nccl/net.h"
#include "tools/cpu-nccl/reduce.h"

namespace dq::cpunccl {

constexpr size_t kUniqueIdBytes = 128;
struct Incoming;  // comm_internal.h

enum class CollKind { kAllReduce, kBroadcast, kReduce, kAllGather, kReduceScatter, kAllToAll };

struct CollArgs {
  CollKind kind;
  const void* sendbuff;
  void* recvbuff;
  size_t count;  // per NCCL's signature of each collective (recvcount, sendcount, ...)
  DType dtype;
  RedOp op;
  int root;
};

// One send or receive of a grouped point-to-point batch.
struct P2pArgs {
  bool is_send;
  int peer;
  void* buffer;
  size_t bytes;
};

// Why an operation failed, as the API reports it.
// kCuda: a device buffer could not be staged (cuda_staging.h): ncclUnhandledCudaError.
enum class FailKind { kNone = 0, kRemote, kSystem, kInvalid, kInternal, kUsage, kCuda };

class Comm {
 public:
  Comm(int rank, int nranks) : rank_(rank), nranks_(nranks) {}
  ~Comm();

  // Unique id: [0,8) magic, [8,16) job id, [16,128) the bootstrap root's listen handle.
  // Starts a root thread in this process that introduces the ranks to each other.
  static Status make_unique_id(unsigned char id[kUniqueIdBytes]);

  // Bootstrap from a unique id: every rank connects to the root, receives every rank's listen
  // handle, then connects to every peer.
  Status init(const unsigned char id[kUniqueIdBytes]);
  // Collective over `parent`: ranks with the same color form *child (ordered by key, then by
  // parent rank); color < 0 gives *child = nullptr.
  static Status split(Comm* parent, int color, int key, const std::string& name, Comm** child);
  // Not collective over `parent`: only the ranks not in `excluded` call it, each with the same
  // set, and form *child in parent-rank order. It needs neither the parent's connections nor
  // the excluded ranks (they may be dead): the survivors connect to each other's listeners, which
  // the child shares with the parent. `abort_parent` (NCCL_SHRINK_ABORT) revokes the parent
  // first.
  static Status shrink(Comm* parent, const std::vector<int>& excluded, bool abort_parent,
                       const std::string& name, Comm** child);

  Status collective(const CollArgs& args);
  // All sends and receives progress together; returns when every one completed.
  Status point_to_point(const std::vector<P2pArgs>& ops);

  // Closes every connection so that peers blocked on us fail fast; idempotent.
  void abort_connections();
  // ncclCommRevoke: operations in flight end with kUnsupported at their next poll (the
  // connections are then closed by the thread that ran the operation, never under it), later ones
  // are refused. Idempotent.
  void revoke() { revoked_.store(true, std::memory_order_release); }
  bool revoked() const { return revoked_.load(std::memory_order_acquire); }
  // Operations running on this communicator now (ncclCommGetAsyncError after a revoke: in
  // progress until they have ended).
  int busy() const { return busy_.load(std::memory_order_acquire); }
  struct BusyScope {
    explicit BusyScope(Comm* c) : comm(c) { comm->busy_.fetch_add(1); }
    ~BusyScope() { comm->busy_.fetch_sub(1); }
    BusyScope(const BusyScope&) = delete;
    BusyScope& operator=(const BusyScope&) = delete;
    Comm* comm;
  };
  // Records the first failure; the comm refuses further work afterwards.
  void fail(FailKind kind, const std::string& message);

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  FailKind failure() const { return failure_.load(); }
  std::string last_error() const;
  const std::string& name() const { return name_; }
  void set_name(const std::string& name) { name_ = name; }
  void set_blocking(int blocking) { blocking_ = blocking; }
  int blocking() const { return blocking_; }
  // The non-blocking model's state (api.cc, in_progress_polls()): polls of ncclCommGetAsyncError
  // still to answer ncclInProgress; calls are refused until they are spent.
  std::atomic<int> polls_left{0};
  int timeout_ms() const { return timeout_ms_; }

 private:
  struct Hello;
  struct MeshBuilder;  // the state and steps of one build_mesh (mesh.cc)
  // The plugin listen comm peers connect to and the plugin communicator id its connections are
  // checked against (connecting needs a context with the same id). Communicators made by
  // ncclCommShrink share their parent's, and it is closed with the last one using it; so a hello
  // can reach another build than its own: it is parked here for the build with its tag, and a
  // connection whose hello had not arrived when its build ended is left to the next build (a
  // bounded number of each).
  struct Listener {
    struct Parked {
      void* comm;  // the accepted receive connection, its hello read
      uint64_t comm_tag;
      int rank, nranks;
    };
    Net* net = nullptr;
    void* comm = nullptr;
    uint64_t net_comm_id = 0;
    Listener() = default;
    Listener(const Listener&) = delete;
    Listener& operator=(const Listener&) = delete;
    ~Listener();
    // False when full (the caller closes the connection).
    bool park(const Parked& p);
    std::vector<Parked> claim(uint64_t comm_tag);
    // Takes `in` (its receive still posted) when there is room; false: the caller closes it.
    bool leave_unread(std::unique_ptr<Incoming>& in);
    std::vector<std::unique_ptr<Incoming>> adopt_unread();

   private:
    std::mutex mutex_;
    std::vector<Parked> parked_;
    std::vector<std::unique_ptr<Incoming>> unread_;
  };
  // Opens this communicator's own listener on ctx_ (made with net_comm_id).
  Status open_listener(uint64_t net_comm_id, NetHandle* handle);
  // A split's or a shrink's last step, its rank, size, plugin and listener set: takes the
  // parent's settings, `comm_tag` and `name`, and connects to every member at `handles` (by rank).
  Status join_child_mesh(const Comm& parent, uint64_t comm_tag, const std::string& name,
                         std::vector<NetHandle> handles);
  Status init_plugin(uint64_t comm_tag);
  // Accepts peers and connects to `handles[p]` for every p != rank until the mesh is complete.
  // With `handles_from_root`, the handles first arrive from the bootstrap root.
  Status build_mesh(std::vector<NetHandle>* handles, bool handles_from_root);

  Status ring(const CollArgs& args);
  Status chain_broadcast(const CollArgs& args);
  Status chain_reduce(const CollArgs& args);

  const int rank_;
  const int nranks_;
  uint64_t comm_tag_ = 0;
  uint64_t split_count_ = 0;
  uint64_t shrink_count_ = 0;
  std::string name_;
  int blocking_ = 1;
  int timeout_ms_ = 60000;
  size_t chunk_bytes_ = size_t{1} << 20;
  Net* net_ = nullptr;
  void* ctx_ = nullptr;
  std::shared_ptr<Listener> listener_;
  std::vector<NetHandle> peer_handles_;  // every rank's listener address, by rank
  std::vector<void*> send_comms_;        // by peer rank
  std::vector<void*> recv_comms_;
  std::atomic<FailKind> failure_{FailKind::kNone};
  std::atomic<bool> revoked_{false};
  std::atomic<int> busy_{0};
  mutable std::mutex error_mutex_;
  std::string last_error_;
};

// Environment knobs (read each time a comm is created).
int timeout_ms_from_env();

}  // namespace dq::cpunccl
