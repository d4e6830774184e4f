// The extern "C" boundary of the CPU NCCL: argument checks, group semantics, error mapping.
// No exception leaves this file; every entry point runs inside guarded().
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "common/abi_guard.h"
#include "common/nccl_api.h"
#include "common/nccl_result.h"
#include "config/cuda_staging.h"
#include "config/settings.h"
#include "tools/cpu-nccl/comm.h"

using dq::Status;
using dq::Subsys;
using dq::cpunccl::CollArgs;
using dq::cpunccl::CollKind;
using dq::cpunccl::Comm;
using dq::cpunccl::DType;
using dq::cpunccl::FailKind;
using dq::cpunccl::P2pArgs;
using dq::cpunccl::RedOp;

namespace {

Comm* impl(ncclComm_t comm) {
  return reinterpret_cast<Comm*>(comm);
}
ncclComm_t handle(Comm* comm) {
  return reinterpret_cast<ncclComm_t>(comm);
}

std::mutex g_last_error_mutex;
char g_last_error[1024] = "";

void set_last_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(g_last_error_mutex);
  std::snprintf(g_last_error, sizeof g_last_error, "%s", message.c_str());
}

template <class F>
ncclResult_t guarded(F&& body) {
  return dq::abi_guard(body, [](dq::AbiFault fault, const char*) {
    if (fault == dq::AbiFault::kOutOfMemory) {
      set_last_error("cpu-nccl: out of memory");
      return ncclSystemError;
    }
    set_last_error("cpu-nccl: internal error (exception)");
    return ncclInternalError;
  });
}

ncclResult_t fail_kind_result(FailKind kind) {
  switch (kind) {
    case FailKind::kNone:
      return ncclSuccess;
    case FailKind::kRemote:
      return ncclRemoteError;
    case FailKind::kInvalid:
      return ncclInvalidArgument;
    case FailKind::kInternal:
      return ncclInternalError;
    case FailKind::kUsage:
      return ncclInvalidUsage;
    case FailKind::kCuda:
      return ncclUnhandledCudaError;
    default:
      return ncclSystemError;
  }
}

// The failure a communicator records for a failed Status: the project's one mapping
// (common/nccl_result.h), kept on the comm so later calls report the same code.
FailKind fail_kind_of(Status s) {
  switch (dq::nccl_result(s)) {
    case ncclSuccess:
      return FailKind::kNone;
    case ncclRemoteError:
      return FailKind::kRemote;
    case ncclInvalidArgument:
      return FailKind::kInvalid;
    case ncclInternalError:
      return FailKind::kInternal;
    case ncclInvalidUsage:
      return FailKind::kUsage;
    default:
      return FailKind::kSystem;
  }
}

ncclResult_t invalid(const char* what) {
  DQ_WARN(Subsys::kCore, "cpu-nccl: invalid argument: %s", what);
  set_last_error(std::string("cpu-nccl: invalid argument: ") + what);
  return ncclInvalidArgument;
}

// Records a failed operation on `comm` and returns what the API reports for it.
ncclResult_t record_failure(Comm* comm, Status s, const char* what) {
  if (s == Status::kInvalidArgument) {
    std::string msg = std::string("cpu-nccl: ") + what + ": invalid arguments (see WARN lines)";
    set_last_error(msg);
    return ncclInvalidArgument;
  }
  const FailKind kind = fail_kind_of(s);
  std::string msg = "cpu-nccl rank " + std::to_string(comm->rank()) + ": " + what +
                    " failed: " + dq::status_name(s) + " (see WARN lines naming the peer)";
  comm->fail(kind, msg);
  set_last_error(msg);
  return fail_kind_result(comm->failure());
}

// A call on a revoked communicator (ncclCommRevoke, or the parent of an NCCL_SHRINK_ABORT).
ncclResult_t revoked_result() {
  set_last_error(
      "cpu-nccl: the communicator was revoked (ncclCommRevoke or NCCL_SHRINK_ABORT): only "
      "ncclCommShrink, ncclCommDestroy and ncclCommAbort remain valid on it");
  return ncclInvalidUsage;
}

// ---- the non-blocking model (tests) --------------------------------------------------------
// Operations here finish before the call returns. With DYNAMIQ_CPU_NCCL_IN_PROGRESS_POLLS=K
// (1..1000) a non-blocking communicator (ncclConfig_t blocking 0) still answers as NVIDIA's NCCL
// may: each ungrouped call and each group end that ran operations on it returns ncclInProgress,
// ncclCommGetAsyncError then answers ncclInProgress K times, and a call on it before that is
// refused with ncclInvalidArgument, as NCCL's ncclCommEnsureReady refuses a call while the
// previous one is being issued.
// 0: non-blocking communicators answer as blocking ones. Read once: it is asked at every group.
int in_progress_polls() {
  static const int polls = static_cast<int>(dq::config::current().cpu_nccl_in_progress_polls);
  return polls;
}

ncclResult_t busy_result() {
  set_last_error(
      "cpu-nccl: a call on a non-blocking communicator whose previous operation is still being "
      "issued (poll ncclCommGetAsyncError until it leaves ncclInProgress)");
  return ncclInvalidArgument;
}

// ---- groups ----------------------------------------------------------------------------
struct Task {
  enum Kind { kInit, kColl, kP2p } kind;
  Comm* comm;
  CollArgs coll;
  P2pArgs p2p;
  ncclUniqueId id;
  void* stream;  // the caller's cudaStream_t: orders the staging of device buffers
};

thread_local int t_group_depth = 0;
thread_local std::vector<Task> t_tasks;
// The first call refused inside the open group: NCCL then drops the group's operations and its
// end returns that error (ncclGroupErrCheck), so no peer's operation is left unmatched on one
// rank while the others' run.
thread_local ncclResult_t t_group_error = ncclSuccess;

ncclResult_t noted_in_group(ncclResult_t r) {
  if (r != ncclSuccess && t_group_depth > 0 && t_group_error == ncclSuccess) t_group_error = r;
  return r;
}

// Runs one comm's share of a group: init first, then all point-to-point together, then the
// collectives in the order they were issued.
// A device buffer that could not be staged fails the communicator (its peers then fail fast
// instead of waiting for their timeout).
ncclResult_t staging_failure(Comm* comm, const dq::staging::Staging& st) {
  std::string msg = "cpu-nccl rank " + std::to_string(comm->rank()) + ": " + st.error();
  DQ_WARN(Subsys::kCore, "%s", msg.c_str());
  comm->fail(FailKind::kCuda, msg);
  set_last_error(msg);
  return ncclUnhandledCudaError;
}

// The caller buffers a collective reads and writes (sizes per NCCL's signatures), for staging.
void add_buffers(dq::staging::Staging* st, const CollArgs& a, const Comm& comm, void* stream) {
  const size_t bytes = a.count * dq::cpunccl::dtype_size(a.dtype);
  const size_t all = bytes * static_cast<size_t>(comm.nranks());
  const bool root = a.root == comm.rank();
  size_t send = bytes, recv = bytes;
  switch (a.kind) {
    case CollKind::kAllReduce:
      break;
    case CollKind::kBroadcast:
      send = root ? bytes : 0;
      break;  // sendbuff: the root's only
    case CollKind::kReduce:
      recv = root ? bytes : 0;
      break;  // recvbuff: the root's only
    case CollKind::kAllGather:
      recv = all;
      break;
    case CollKind::kReduceScatter:
      send = all;
      break;
    case CollKind::kAllToAll:
      send = recv = all;
      break;
  }
  st->add(a.sendbuff, send, true, false, stream);
  st->add(a.recvbuff, recv, false, true, stream);
}

// Runs one comm's share of a group: init first, then all point-to-point together, then the
// collectives in the order they were issued. Device buffers are staged around each of these
// (cuda_staging.h); host buffers go through unchanged.
ncclResult_t run_comm_tasks(Comm* comm, const std::vector<const Task*>& tasks) {
  using dq::staging::Staging;
  const Comm::BusyScope busy(comm);
  std::vector<P2pArgs> p2p;
  for (const Task* t : tasks) {
    if (t->kind != Task::kInit) continue;
    Status s = comm->init(reinterpret_cast<const unsigned char*>(t->id.internal));
    if (s != Status::kOk) {
      comm->fail(fail_kind_of(s), "cpu-nccl: ncclCommInitRank failed");
      set_last_error("cpu-nccl: ncclCommInitRank failed (see WARN lines)");
      return fail_kind_result(comm->failure());
    }
  }
  if (comm->failure() != FailKind::kNone) return fail_kind_result(comm->failure());
  if (comm->revoked()) return revoked_result();
  Staging p2p_staging;
  for (const Task* t : tasks) {
    if (t->kind != Task::kP2p) continue;
    p2p.push_back(t->p2p);
    p2p_staging.add(t->p2p.buffer, t->p2p.bytes, t->p2p.is_send, !t->p2p.is_send, t->stream);
  }
  if (!p2p.empty()) {
    if (p2p_staging.begin() != Status::kOk) return staging_failure(comm, p2p_staging);
    for (P2pArgs& op : p2p) op.buffer = p2p_staging.host(op.buffer);
    Status s = comm->point_to_point(p2p);
    if (s != Status::kOk) return record_failure(comm, s, "ncclSend/ncclRecv");
    if (p2p_staging.end() != Status::kOk) return staging_failure(comm, p2p_staging);
  }
  for (const Task* t : tasks) {
    if (t->kind != Task::kColl) continue;
    Staging staging;
    add_buffers(&staging, t->coll, *comm, t->stream);
    if (staging.begin() != Status::kOk) return staging_failure(comm, staging);
    CollArgs args = t->coll;
    args.sendbuff = staging.host(args.sendbuff);
    args.recvbuff = staging.host(args.recvbuff);
    Status s = comm->collective(args);
    if (s != Status::kOk) return record_failure(comm, s, "collective");
    if (staging.end() != Status::kOk) return staging_failure(comm, staging);
  }
  return ncclSuccess;
}

ncclResult_t run_group(std::vector<Task> tasks) {
  std::vector<Comm*> comms;
  std::vector<std::vector<const Task*>> per_comm;
  for (const Task& t : tasks) {
    size_t i = 0;
    while (i < comms.size() && comms[i] != t.comm) ++i;
    if (i == comms.size()) {
      comms.push_back(t.comm);
      per_comm.emplace_back();
    }
    per_comm[i].push_back(&t);
  }
  if (comms.empty()) return ncclSuccess;
  // Busy until the answer below has read them too: an abort from another thread waits for that
  // (quiesce()), not only for the operations.
  std::vector<std::unique_ptr<Comm::BusyScope>> busy;
  for (Comm* c : comms) busy.push_back(std::make_unique<Comm::BusyScope>(c));
  // The non-blocking model: a success still being issued on the non-blocking communicators that
  // ran operations (not only their own initialisation).
  auto answer = [&](ncclResult_t r) {
    if (r != ncclSuccess || in_progress_polls() == 0) return r;
    bool in_progress = false;
    for (const Task& t : tasks)
      if (t.kind != Task::kInit && t.comm->blocking() == 0) {
        t.comm->polls_left.store(in_progress_polls());
        in_progress = true;
      }
    return in_progress ? ncclInProgress : r;
  };
  if (comms.size() == 1) return answer(run_comm_tasks(comms[0], per_comm[0]));
  // Several comms in one group (one thread driving several ranks): each progresses in its own
  // thread so that they can wait on each other.
  std::vector<ncclResult_t> results(comms.size(), ncclSuccess);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < comms.size(); ++i) {
    threads.emplace_back(
        [&, i] { results[i] = guarded([&] { return run_comm_tasks(comms[i], per_comm[i]); }); });
  }
  for (auto& th : threads) th.join();
  for (ncclResult_t r : results)
    if (r != ncclSuccess) return r;
  return answer(ncclSuccess);
}

// Queues the task inside a group, runs it at once otherwise.
ncclResult_t submit(Task task) {
  if (t_group_depth > 0) {
    t_tasks.push_back(task);
    return ncclSuccess;
  }
  std::vector<Task> one{task};
  return run_group(std::move(one));
}

ncclResult_t check_comm(Comm* comm) {
  if (!comm) return invalid("comm is NULL");
  if (comm->revoked()) return revoked_result();
  if (comm->polls_left.load() > 0) return busy_result();
  if (comm->failure() != FailKind::kNone) {
    set_last_error(comm->last_error());
    return fail_kind_result(comm->failure());
  }
  return ncclSuccess;
}

// The communicator's asynchronous state, as ncclCommGetAsyncError reports it: ncclInProgress while
// a non-blocking operation is still being issued (`poll`: this look is one of the K polls that
// end it, as a call of ncclCommGetAsyncError is), a revoked one in progress while operations are
// still ending and then quiescent (management calls may follow), else its failure, if any.
ncclResult_t async_state(Comm* comm, bool poll) {
  for (int left = comm->polls_left.load(); left > 0;)
    if (!poll || comm->polls_left.compare_exchange_weak(left, left - 1)) return ncclInProgress;
  if (comm->revoked()) return comm->busy() > 0 ? ncclInProgress : ncclSuccess;
  return fail_kind_result(comm->failure());
}

// What NCCL's ncclCommEnsureReady answers before ncclCommCount, ncclCommUserRank and
// ncclCommCuDevice read the communicator: ncclInvalidArgument while it is in progress, else its
// asynchronous error, if any. Not a poll: a refused query does not bring an operation's end
// closer.
ncclResult_t ensure_ready(Comm* comm) {
  const ncclResult_t state = async_state(comm, false);
  if (state == ncclInProgress) return busy_result();
  if (state != ncclSuccess) set_last_error(comm->last_error());
  return state;
}

ncclResult_t checked_submit_coll(const CollArgs& args, Comm* comm, bool needs_op,
                                 cudaStream_t stream) {
  if (ncclResult_t r = check_comm(comm); r != ncclSuccess) return r;
  if (!dq::cpunccl::dtype_valid(static_cast<int>(args.dtype))) return invalid("datatype");
  if (needs_op && !dq::cpunccl::redop_valid(static_cast<int>(args.op)))
    return invalid("reduction op (only sum, prod, max, min, avg are supported)");
  if ((args.kind == CollKind::kBroadcast || args.kind == CollKind::kReduce) &&
      (args.root < 0 || args.root >= comm->nranks()))
    return invalid("root out of range");
  if (args.count > 0) {
    const bool is_root = args.root == comm->rank();
    const bool needs_send = !(args.kind == CollKind::kBroadcast && !is_root);
    const bool needs_recv = !(args.kind == CollKind::kReduce && !is_root);
    if (needs_send && !args.sendbuff) return invalid("sendbuff is NULL");
    if (needs_recv && !args.recvbuff) return invalid("recvbuff is NULL");
  }
  Task t{};
  t.kind = Task::kColl;
  t.comm = comm;
  t.coll = args;
  t.stream = stream;
  return submit(t);
}

ncclResult_t checked_submit_p2p(bool is_send, void* buffer, size_t count, ncclDataType_t dtype,
                                int peer, Comm* comm, cudaStream_t stream) {
  if (ncclResult_t r = check_comm(comm); r != ncclSuccess) return r;
  if (!dq::cpunccl::dtype_valid(dtype)) return invalid("datatype");
  if (peer < 0 || peer >= comm->nranks()) return invalid("peer out of range");
  if (count > 0 && !buffer) return invalid("buffer is NULL");
  Task t{};
  t.kind = Task::kP2p;
  t.comm = comm;
  t.p2p =
      P2pArgs{is_send, peer, buffer, count * dq::cpunccl::dtype_size(static_cast<DType>(dtype))};
  t.stream = stream;
  return submit(t);
}

ncclResult_t submit_coll(const CollArgs& args, Comm* comm, bool needs_op, cudaStream_t stream) {
  return noted_in_group(checked_submit_coll(args, comm, needs_op, stream));
}

ncclResult_t submit_p2p(bool is_send, void* buffer, size_t count, ncclDataType_t dtype, int peer,
                        Comm* comm, cudaStream_t stream) {
  return noted_in_group(checked_submit_p2p(is_send, buffer, count, dtype, peer, comm, stream));
}

// The config's commName, or null: none set, or a struct not made by NCCL_CONFIG_INITIALIZER or
// too old to have the field.
const char* config_comm_name(const ncclConfig_t* config) {
  if (!config || config->magic != DQ_NCCL_CONFIG_MAGIC ||
      config->size < offsetof(ncclConfig_t, commName) + sizeof(const char*))
    return nullptr;
  return config->commName;
}

// A split's or shrink's name: the config's commName, else the parent's.
std::string child_name(const Comm& parent, const ncclConfig_t* config) {
  const char* name = config_comm_name(config);
  return name != nullptr ? name : parent.name();
}

void apply_config(Comm* comm, const ncclConfig_t* config) {
  if (!config) return;
  if (config->magic != DQ_NCCL_CONFIG_MAGIC) {
    DQ_WARN(Subsys::kCore,
            "cpu-nccl: ncclConfig_t not initialised with NCCL_CONFIG_INITIALIZER "
            "(magic %#x); ignoring it",
            config->magic);
    return;
  }
  if (const char* name = config_comm_name(config)) comm->set_name(name);
  if (config->blocking != DQ_NCCL_CONFIG_UNDEF_INT) comm->set_blocking(config->blocking);
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (!version) return invalid("version is NULL");
  *version = DQ_NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* unique_id) {
  return guarded([&] {
    if (!unique_id) return invalid("uniqueId is NULL");
    Status s = Comm::make_unique_id(reinterpret_cast<unsigned char*>(unique_id->internal));
    if (s != Status::kOk) {
      set_last_error("cpu-nccl: ncclGetUniqueId failed (net plugin unavailable?)");
      return ncclSystemError;
    }
    return ncclSuccess;
  });
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId comm_id, int rank,
                                    ncclConfig_t* config) {
  return guarded([&] {
    if (!comm) return invalid("comm is NULL");
    *comm = nullptr;
    if (nranks < 1) return invalid("nranks < 1");
    if (rank < 0 || rank >= nranks) return invalid("rank out of range");
    auto made = std::make_unique<Comm>(rank, nranks);
    apply_config(made.get(), config);
    Task t{};
    t.kind = Task::kInit;
    t.comm = made.get();
    t.id = comm_id;
    if (t_group_depth > 0) {  // initialised at the outermost ncclGroupEnd
      t_tasks.push_back(t);
      *comm = handle(made.release());
      return ncclSuccess;
    }
    Status s = made->init(reinterpret_cast<const unsigned char*>(comm_id.internal));
    if (s != Status::kOk) {
      set_last_error("cpu-nccl: ncclCommInitRank failed (see WARN lines)");
      return dq::nccl_result(s);
    }
    *comm = handle(made.release());
    return ncclSuccess;
  });
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId comm_id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, comm_id, rank, nullptr);
}

ncclResult_t ncclCommInitRankScalable(ncclComm_t* comm, int nranks, int rank, int n_ids,
                                      ncclUniqueId* comm_ids, ncclConfig_t* config) {
  if (n_ids < 1 || !comm_ids) return invalid("no unique id");
  // One bootstrap root suffices on a single host: every rank uses the first id.
  return ncclCommInitRankConfig(comm, nranks, comm_ids[0], rank, config);
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* /*devlist*/) {
  return guarded([&] {
    if (!comms) return invalid("comms is NULL");
    if (ndev < 1) return invalid("ndev < 1");
    ncclUniqueId id;
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return r;
    std::vector<ncclResult_t> results(ndev, ncclSuccess);
    std::vector<std::thread> threads;
    for (int i = 0; i < ndev; ++i) {
      threads.emplace_back([&, i] { results[i] = ncclCommInitRank(&comms[i], ndev, id, i); });
    }
    for (auto& th : threads) th.join();
    for (int i = 0; i < ndev; ++i) {
      if (results[i] != ncclSuccess) {
        for (int j = 0; j < ndev; ++j) {
          delete impl(comms[j]);
          comms[j] = nullptr;
        }
        return results[i];
      }
    }
    return ncclSuccess;
  });
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                           ncclConfig_t* config) {
  return guarded([&] {
    if (!newcomm) return invalid("newcomm is NULL");
    *newcomm = nullptr;
    Comm* parent = impl(comm);
    if (ncclResult_t r = check_comm(parent); r != ncclSuccess) return r;
    if (color < 0 && color != DQ_NCCL_SPLIT_NOCOLOR) return invalid("negative color");
    // The split runs collectives on the parent: an abort from another thread (a watchdog's, while
    // a peer never joins) revokes them and frees the parent only after this has left it.
    const Comm::BusyScope busy(parent);
    Comm* child = nullptr;
    Status s = Comm::split(parent, color, key, child_name(*parent, config), &child);
    if (s != Status::kOk) return record_failure(parent, s, "ncclCommSplit");
    // The config's settings over the parent's, as NCCL's: a non-blocking split of a blocking
    // parent (the engine's node and rail communicators) is non-blocking.
    if (child != nullptr) apply_config(child, config);
    *newcomm = handle(child);
    return ncclSuccess;
  });
}

ncclResult_t ncclCommShrink(ncclComm_t comm, int* exclude_ranks, int exclude_count,
                            ncclComm_t* newcomm, ncclConfig_t* config, int shrink_flags) {
  return guarded([&] {
    if (!newcomm) return invalid("newcomm is NULL");
    *newcomm = nullptr;
    Comm* parent = impl(comm);
    if (!parent) return invalid("comm is NULL");
    if (exclude_count < 0 || (exclude_count > 0 && !exclude_ranks))
      return invalid("excludeRanksList is NULL or excludeRanksCount negative");
    if (shrink_flags != DQ_NCCL_SHRINK_DEFAULT && shrink_flags != DQ_NCCL_SHRINK_ABORT)
      return invalid("shrinkFlags (NCCL_SHRINK_DEFAULT or NCCL_SHRINK_ABORT)");
    // A parent that failed (a dead peer) or was revoked may be shrunk: that is what it is for.
    const std::vector<int> excluded(exclude_ranks, exclude_ranks + exclude_count);
    const Comm::BusyScope busy(parent);  // as ncclCommSplit's
    Comm* child = nullptr;
    const Status s = Comm::shrink(parent, excluded, shrink_flags == DQ_NCCL_SHRINK_ABORT,
                                  child_name(*parent, config), &child);
    if (s == Status::kInvalidArgument) return invalid("ncclCommShrink (see the WARN line)");
    if (s != Status::kOk) {
      set_last_error("cpu-nccl: ncclCommShrink failed (see WARN lines)");
      return dq::nccl_result(s);
    }
    apply_config(child, config);
    *newcomm = handle(child);
    return ncclSuccess;
  });
}

ncclResult_t ncclCommRevoke(ncclComm_t comm, int revoke_flags) {
  return guarded([&] {
    if (!comm) return invalid("comm is NULL");
    if (revoke_flags != DQ_NCCL_REVOKE_DEFAULT) return invalid("revokeFlags (must be 0)");
    impl(comm)->revoke();
    return ncclSuccess;
  });
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  // Every operation completes before its call returns: nothing is left to flush.
  if (!comm) return invalid("comm is NULL");
  if (impl(comm)->revoked()) return revoked_result();  // NCCL: invalid after a revoke
  return ncclSuccess;
}

// Whether no operation runs on `c` any more. Another thread may still be inside one (a watchdog
// aborts while the application's thread waits in a collective, as on a GPU, where that thread
// has long returned): revoked, it ends at once, and `c` is freed only after it has. Bounded by
// the CPU NCCL's timeout and a second; past that, false: `c` is left allocated rather than freed
// under that thread.
bool quiesce(Comm* c) {
  if (c->busy() == 0) return true;
  c->revoke();
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(c->timeout_ms()) + 1000);
  while (c->busy() > 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (c->busy() == 0) return true;
  DQ_WARN(Subsys::kCore,
          "cpu-nccl rank %d: an operation on the communicator did not end within %d ms of its "
          "revoke; the communicator is left allocated",
          c->rank(), c->timeout_ms() + 1000);
  return false;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  return guarded([&] {
    if (Comm* c = impl(comm); c != nullptr && quiesce(c)) delete c;
    return ncclSuccess;
  });
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  return guarded([&] {
    Comm* c = impl(comm);
    if (c == nullptr || !quiesce(c)) return ncclSuccess;
    c->abort_connections();
    delete c;
    return ncclSuccess;
  });
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (!comm || !count) return invalid("comm or count is NULL");
  if (const ncclResult_t r = ensure_ready(impl(comm)); r != ncclSuccess) return r;
  *count = impl(comm)->nranks();
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (!comm || !device) return invalid("comm or device is NULL");
  if (const ncclResult_t r = ensure_ready(impl(comm)); r != ncclSuccess) return r;
  *device = 0;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (!comm || !rank) return invalid("comm or rank is NULL");
  if (const ncclResult_t r = ensure_ready(impl(comm)); r != ncclSuccess) return r;
  *rank = impl(comm)->rank();
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  if (!comm || !async_error) return invalid("comm or asyncError is NULL");
  *async_error = async_state(impl(comm), true);
  return ncclSuccess;
}

ncclResult_t ncclCommRegister(const ncclComm_t comm, void* buff, size_t /*size*/, void** handle) {
  if (!comm || !handle) return invalid("comm or handle is NULL");
  *handle = buff;  // host memory needs no registration; the plugin registers per operation
  return ncclSuccess;
}

ncclResult_t ncclCommDeregister(const ncclComm_t comm, void* /*handle*/) {
  return comm ? ncclSuccess : invalid("comm is NULL");
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError:
      return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError:
      return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument:
      return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage:
      return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t /*comm*/) {
  std::lock_guard<std::mutex> lock(g_last_error_mutex);
  return g_last_error;
}

ncclResult_t ncclMemAlloc(void** ptr, size_t size) {
  if (!ptr) return invalid("ptr is NULL");
  *ptr = std::malloc(size ? size : 1);
  return *ptr ? ncclSuccess : ncclSystemError;
}

ncclResult_t ncclMemFree(void* ptr) {
  std::free(ptr);
  return ncclSuccess;
}

ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t*, void*, ncclDataType_t, ncclScalarResidence_t,
                                      ncclComm_t) {
  set_last_error("cpu-nccl: ncclRedOpCreatePreMulSum is not implemented");
  return ncclInvalidUsage;
}

ncclResult_t ncclRedOpDestroy(ncclRedOp_t, ncclComm_t) {
  return ncclInvalidUsage;
}

ncclResult_t ncclGroupStart(void) {
  ++t_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  return guarded([&] {
    if (t_group_depth <= 0) return invalid("ncclGroupEnd without ncclGroupStart");
    if (--t_group_depth > 0) return ncclSuccess;
    std::vector<Task> tasks;
    tasks.swap(t_tasks);
    if (const ncclResult_t refused = t_group_error; refused != ncclSuccess) {
      // The group's operations are dropped; communicators created in it are still made.
      t_group_error = ncclSuccess;
      std::vector<Task> inits;
      for (const Task& t : tasks)
        if (t.kind == Task::kInit) inits.push_back(t);
      (void)run_group(std::move(inits));
      return refused;
    }
    return run_group(std::move(tasks));
  });
}

ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t* sim_info) {
  return guarded([&] {
    if (!sim_info || sim_info->magic != DQ_NCCL_SIM_INFO_MAGIC ||
        sim_info->size < sizeof(ncclSimInfo_t))
      return invalid("simInfo not initialised with NCCL_SIM_INFO_INITIALIZER");
    if (t_group_depth <= 0) return invalid("ncclGroupSimulateEnd without ncclGroupStart");
    if (--t_group_depth > 0) return ncclSuccess;
    t_group_error = ncclSuccess;
    // The group's operations never run. Communicators created in it are, as at ncclGroupEnd:
    // the caller holds their handles. No time model: the estimate is 0 us.
    std::vector<Task> tasks;
    tasks.swap(t_tasks);
    std::vector<Task> inits;
    for (const Task& t : tasks)
      if (t.kind == Task::kInit) inits.push_back(t);
    sim_info->estimatedTime = 0.0f;
    return run_group(std::move(inits));
  });
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return guarded([&] {
    return submit_p2p(true, const_cast<void*>(sendbuff), count, datatype, peer, impl(comm), stream);
  });
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return guarded(
      [&] { return submit_p2p(false, recvbuff, count, datatype, peer, impl(comm), stream); });
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  return guarded([&] {
    return submit_coll({CollKind::kAllReduce, sendbuff, recvbuff, count,
                        static_cast<DType>(datatype), static_cast<RedOp>(op), 0},
                       impl(comm), true, stream);
  });
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  return guarded([&] {
    return submit_coll({CollKind::kBroadcast, sendbuff, recvbuff, count,
                        static_cast<DType>(datatype), RedOp::kSum, root},
                       impl(comm), false, stream);
  });
}

ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                       cudaStream_t stream) {
  return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return guarded([&] {
    return submit_coll({CollKind::kReduce, sendbuff, recvbuff, count, static_cast<DType>(datatype),
                        static_cast<RedOp>(op), root},
                       impl(comm), true, stream);
  });
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return guarded([&] {
    return submit_coll({CollKind::kAllGather, sendbuff, recvbuff, sendcount,
                        static_cast<DType>(datatype), RedOp::kSum, 0},
                       impl(comm), false, stream);
  });
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return guarded([&] {
    return submit_coll({CollKind::kReduceScatter, sendbuff, recvbuff, recvcount,
                        static_cast<DType>(datatype), static_cast<RedOp>(op), 0},
                       impl(comm), true, stream);
  });
}

ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count,
                          ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return guarded([&] {
    return submit_coll({CollKind::kAllToAll, sendbuff, recvbuff, count,
                        static_cast<DType>(datatype), RedOp::kSum, 0},
                       impl(comm), false, stream);
  });
}

const char* dqCpuNcclCommName(ncclComm_t comm) {
  return comm ? impl(comm)->name().c_str() : "";
}

}  // extern "C"
