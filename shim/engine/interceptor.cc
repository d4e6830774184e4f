#include "shim/engine/interceptor.h"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "config/cuda_staging.h"
#include "config/optin.h"
#include "config/settings.h"
#include "shim/engine/cuda_device_gpu.h"
#include "shim/engine/engine.h"

namespace dq::shim {
namespace {

// The loaded object, other than this library, that defines ncclAllReduce: where a process loaded
// NCCL into a local scope only (a Python extension opened RTLD_LOCAL that needs libnccl.so.2, or
// that links NCCL in statically and exports it), which dlsym(RTLD_NEXT) does not search. The
// application's calls still reach this library (a preloaded library comes first in every
// scope). Its handle stays open: NCCL must outlive the pointers taken from it. Null where none.
void* nccl_in_a_local_scope() {
  Dl_info self{};
  if (dladdr(reinterpret_cast<void*>(&nccl_in_a_local_scope), &self) == 0) return nullptr;
  std::vector<std::string> paths;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        if (info->dlpi_name != nullptr && info->dlpi_name[0] != '\0')
          static_cast<std::vector<std::string>*>(out)->emplace_back(info->dlpi_name);
        return 0;
      },
      &paths);
  for (const std::string& path : paths) {  // bounded by the loaded objects
    void* handle = dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
    if (handle == nullptr) continue;
    Dl_info where{};
    void* f = dlsym(handle, "ncclAllReduce");
    if (f != nullptr && dladdr(f, &where) != 0 && where.dli_fbase != self.dli_fbase) {
      DQ_INFO(Subsys::kShim, "dynamiq: NCCL found outside the global scope, in %s",
              where.dli_fname);
      return handle;
    }
    dlclose(handle);
  }
  return nullptr;
}

// A function of the real NCCL: the next library after ours (dlsym RTLD_NEXT), or, where NCCL is
// in no library after ours, the object nccl_in_a_local_scope() finds. Decided once, by
// ncclAllReduce, for every name.
void* real_symbol(const char* name) {
  static void* const local =
      dlsym(RTLD_NEXT, "ncclAllReduce") != nullptr ? nullptr : nccl_in_a_local_scope();
  return local != nullptr ? dlsym(local, name) : dlsym(RTLD_NEXT, name);
}

template <class F>
void resolve(const char* name, F* out) {
  *out = reinterpret_cast<F>(real_symbol(name));
}

struct CommEntry {
  config::CommIdentity identity;
  bool finalizing = false;
  // identity.size and the opt-in fields below change after creation under identity_mutex, never
  // held across a wait: a shrink reads them while a call may hold `mutex` stuck on a peer.
  std::mutex identity_mutex;
  bool explicit_opt = false;  // dynamiqCommRegister called
  bool explicit_on = false;
  // Made by ncclCommShrink: its parent's opt-in decision and why, which it keeps (it stands in
  // for the parent, whose size-based rule, say, no longer matches its own size); "" otherwise.
  std::string inherited_why;
  bool inherited_on = false;
  std::unique_ptr<engine::Engine> engine;  // made at the first all-reduce
  int cuda_ordinal = -1;                   // >= 0: the engine runs on that CUDA device
  // The engine's device says an abort ends its queued NCCL work (the CUDA device): ncclCommAbort
  // calls the real abort before the engine's teardown (comm_aborted). Read without the entry's
  // lock.
  std::atomic<bool> abort_before_teardown{false};
  std::atomic<bool> aborted{false};  // set before that real abort (or a revoke): the engine
                                     // watches it
  bool revoked = false;              // ncclCommRevoke or NCCL_SHRINK_ABORT: no engine any more
  int shrunk_from = -1;              // made by ncclCommShrink: the parent's index
  // The engine while it exists, for a revoke on another thread than a call holding `mutex`
  // (set and cleared under `mutex`; the application does not destroy a communicator it revokes
  // at the same time).
  std::atomic<engine::Engine*> live_engine{nullptr};
  bool host_engine = false;  // the engine runs on the host device (a CPU NCCL)
  std::shared_ptr<engine::CommMetrics> metrics;
  // `metrics` for readers that must not wait for a call holding `mutex` (the counters' C API, a
  // monitoring thread's): set once, after `metrics`, which keeps it alive for the entry's life.
  std::atomic<engine::CommMetrics*> metrics_view{nullptr};
  ncclComm_t handle = nullptr;
  // From the unique id of an ncclCommInitRank*: NCCL's commId (what its "Init START/COMPLETE"
  // INFO lines print) and its internal commHash; the same on every rank of the communicator.
  bool has_id = false;
  uint64_t comm_id = 0, comm_hash = 0;
  // The engine's asynchronous error as its last call left it: what ncclCommGetAsyncError answers
  // while a call holds `mutex` (it may wait up to DYNAMIQ_TIMEOUT_MS for a peer; a watchdog
  // polling the communicator must not wait with it).
  std::atomic<int> last_async_error{ncclSuccess};
  std::mutex mutex;  // NCCL requires one caller per communicator at a time; this makes sure
};

struct Table {
  std::mutex mutex;
  std::unordered_map<ncclComm_t, std::shared_ptr<CommEntry>> comms;
  int next_index = 0;
};

Table& table() {
  static Table* t = new Table;  // never destroyed: NCCL calls may come from atexit handlers
  return *t;
}

thread_local int t_group_depth = 0;

// A collective held back until the outermost ncclGroupEnd.
struct Deferred {
  engine::CallArgs call;
  ncclComm_t comm;
  std::function<ncclResult_t()> pass;  // the real NCCL call
};
thread_local std::vector<Deferred> t_deferred;
// The communicators of every collective the shim saw in the calling thread's open group, held
// back or not. A group on more than one communicator passes its held calls to NCCL unchanged (in
// one real group, which orders them on the GPU as NCCL orders any group): run one after another
// they could wait for each other (one thread driving several GPUs; members issued in other
// orders on other ranks; GPU work of several communicators enqueued in different orders). Which
// of its calls a rank holds back depends on other communicators' eligibility (a one-rank split
// holds nothing; a size, dtype or opt-in of its own), which its peers in this communicator cannot
// see: counted by held calls alone, one rank compressed what its peers passed to NCCL. Every call
// is seen on every rank of its communicator, so the ranks agree whenever their groups are made
// of the same calls.
thread_local std::vector<ncclComm_t> t_group_comms;

void note_group_comm(ncclComm_t comm) {
  if (t_group_depth > 0 &&
      std::find(t_group_comms.begin(), t_group_comms.end(), comm) == t_group_comms.end())
    t_group_comms.push_back(comm);
}

std::shared_ptr<CommEntry> find(ncclComm_t comm) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.comms.find(comm);
  return it == t.comms.end() ? nullptr : it->second;
}

// The CUDA device for a CPU NCCL communicator whose first call (`call`) gives device memory,
// when this libdynamiq.so has one and CUDA works here; nullptr (the host device serves it, on
// host copies of device buffers) otherwise, with the reason in `why` when a device buffer was
// seen. The buffers are classified through the driver the CPU NCCL stages with
// (config/cuda_staging.h), which never initialises CUDA: a process that has not used CUDA has no
// device buffers and never starts the runtime here.
engine::Device* cuda_device_for_cpu_nccl(const engine::CallArgs& call, int* ordinal,
                                         std::string* why) {
  *ordinal = -1;
  if (!staging::available()) return nullptr;
  for (const void* p : {call.send, static_cast<const void*>(call.recv)})
    if (*ordinal < 0) *ordinal = staging::device_ordinal(p);
  if (*ordinal < 0) return nullptr;
  if (!engine::cuda_gpu_linked()) {
    *why = "this build of libdynamiq.so has no CUDA device";
    return nullptr;
  }
  return engine::cuda_gpu_device(*ordinal, why);
}

// Whether the communicator opts in, and by what: dynamiqCommRegister, or the DYNAMIQ_COMMS term
// that selects it, or (not opted in) the rule and the identity none of its terms matches.
// `identity`: e's, or a copy completed by the caller. Under e.identity_mutex.
bool opt_in_decision(const CommEntry& e, const config::CommIdentity& identity,
                     const config::Settings& s, std::string* why) {
  if (e.explicit_opt) {
    *why = std::string("dynamiqCommRegister(comm, ") + (e.explicit_on ? "1" : "0") + ")";
    return e.explicit_on;
  }
  if (!e.inherited_why.empty()) {
    *why = e.inherited_why;
    return e.inherited_on;
  }
  config::OptInRules rules;
  std::string ignored;
  const std::string term = config::parse_opt_in(s.comms, &rules, &ignored) == Status::kOk
                               ? config::matching_term(rules, identity)
                               : "";
  if (!term.empty()) {
    *why = "DYNAMIQ_COMMS term " + term;
    return true;
  }
  *why = "DYNAMIQ_COMMS=" + s.comms + " matches none of name '" + identity.name + "', size " +
         std::to_string(identity.size) + ", index " + std::to_string(identity.index) + ", color " +
         std::to_string(identity.color) + "; dynamiqCommRegister(comm, 1) opts one in";
  return false;
}

// "index 0 name 'grad' color -1 rank 1/4 comm 0x... commId 0x... commHash 0x...": what ties the
// decision line to the application's communicator and to NCCL's own lines.
std::string comm_label(const CommEntry& e, const engine::CommInfo& info) {
  char ids[160];
  if (e.has_id)
    std::snprintf(ids, sizeof ids, "comm %p commId 0x%llx commHash 0x%llx",
                  static_cast<void*>(e.handle), static_cast<unsigned long long>(e.comm_id),
                  static_cast<unsigned long long>(e.comm_hash));
  else
    std::snprintf(ids, sizeof ids, "comm %p", static_cast<void*>(e.handle));
  std::string label = "index " + std::to_string(e.identity.index) + " name '" + e.identity.name +
                      "' color " + std::to_string(e.identity.color) + " rank " +
                      std::to_string(info.rank) + "/" + std::to_string(info.nranks) + " " + ids;
  if (e.shrunk_from >= 0) label += " (shrunk from index " + std::to_string(e.shrunk_from) + ")";
  return label;
}

// NCCL's two hashes of a unique id (facts of its init.cc): the commId its INFO lines print
// (hashUniqueId) and comm->commHash (getHash, DJB2a). Both read the id's bytes as signed chars.
uint64_t nccl_comm_id(const ncclUniqueId& id) {
  uint64_t h = 0xdeadbeef;
  for (char c : id.internal) {
    h ^= h >> 32;
    h *= 0x8db3db47fa2994adull;
    h += static_cast<uint64_t>(static_cast<int64_t>(static_cast<signed char>(c)));
  }
  return h;
}
uint64_t nccl_comm_hash(const ncclUniqueId& id) {
  uint64_t h = 5381;
  for (char c : id.internal)
    h = ((h << 5) + h) ^ static_cast<uint64_t>(static_cast<int64_t>(static_cast<signed char>(c)));
  return h;
}

int g_nccl_version = -1;
std::string& unsupported_text() {
  static std::string& text = *new std::string;
  return text;
}

// The wrapped NCCL's version, once: logged, and checked against the supported range.
void check_nccl_version() {
  using GetVersion = ncclResult_t (*)(int*);
  const auto get = reinterpret_cast<GetVersion>(real_symbol("ncclGetVersion"));
  int code = -1;
  if (get == nullptr || get(&code) != ncclSuccess) code = -1;
  g_nccl_version = code;
  const std::string text = log_nccl_version_text(code);
  DQ_INFO(Subsys::kShim, "dynamiq: wrapping NCCL %s (ncclGetVersion %d); supported %s to %s",
          text.c_str(), code, log_nccl_version_text(kMinNcclVersion).c_str(),
          log_nccl_version_text(kMaxNcclVersion).c_str());
  if (code >= kMinNcclVersion && code <= kMaxNcclVersion) return;
  unsupported_text() = "NCCL " + text + " is outside the versions this build supports (" +
                       log_nccl_version_text(kMinNcclVersion) + " to " +
                       log_nccl_version_text(kMaxNcclVersion) + ")";
  const bool allowed = config::global().untested_nccl;
  DQ_WARN(Subsys::kShim, "dynamiq: %s: %s", unsupported_text().c_str(),
          allowed ? "compressing anyway (DYNAMIQ_UNTESTED_NCCL=1)"
                  : "every call passes through to NCCL (DYNAMIQ_UNTESTED_NCCL=1 overrides)");
}

// Creates the engine on first use (rank and size are only certain once init completed); `call`
// is that first call.
engine::Engine* engine_for(CommEntry& e, ncclComm_t comm, const RealNccl& real,
                           const engine::CallArgs& call) {
  if (e.engine) return e.engine.get();
  engine::CommInfo info{comm, 0, 1};
  if (real.comm_user_rank(comm, &info.rank) != ncclSuccess ||
      real.comm_count(comm, &info.nranks) != ncclSuccess)
    return nullptr;
  // The process's rank in the first communicator it serves names it in log lines (and, with its
  // size, decides the debug file's %r).
  static std::once_flag rank_named;
  std::call_once(rank_named, [&] { log_set_rank(info.rank, info.nranks); });
  const config::Settings& s = config::global();
  std::string opt_in_why;
  bool opted = false;
  {
    std::lock_guard<std::mutex> identity_lock(e.identity_mutex);
    e.identity.size = info.nranks;
    opted = opt_in_decision(e, e.identity, s, &opt_in_why);
  }
  // Which device serves the communicator, fixed here for its life (docs/ENGINE.md section 2):
  // - dynamiq's CPU NCCL (it exports dqCpuNcclCommName, which NVIDIA's does not): the CUDA device
  //   of the first call's buffers when they are device memory and CUDA works here (several
  //   processes sharing one GPU in tests: the kernels run, the CPU NCCL stages the hops'
  //   buffers); otherwise the host device, which computes on host copies of any device buffers
  //   (run_host_staged). Both produce the same bytes, so ranks may differ in this;
  // - any other NCCL is NVIDIA's (same ABI): the CUDA device of the communicator's GPU
  //   (ncclCommCuDevice) when this libdynamiq.so has one (a CUDA build) and CUDA works in this
  //   process (a driver new enough for the runtime linked into it, a device); otherwise none,
  //   and every call passes through (kNoDevice), with one line saying why.
  // Every input here is the same on every rank of a job that runs one build of the shim on one
  // driver version; a rank whose CUDA device is unavailable while its peers' is available would
  // pass through while they compress (there is no device memory to take part in their handshake
  // with), so that one case, a job mixing drivers too old for the shim's runtime, is unsupported
  // and its line is a warning.
  engine::Device* device = nullptr;
  std::string why;
  if (real.cpu_nccl_comm_name) {
    int ordinal = -1;
    if (info.nranks >= 2) device = cuda_device_for_cpu_nccl(call, &ordinal, &why);
    if (device != nullptr) {
      e.cuda_ordinal = ordinal;
      DQ_INFO(Subsys::kShim, "dynamiq: communicator index %d: CPU NCCL, device buffers: the %s",
              e.identity.index, device->name());
    } else {
      if (ordinal >= 0)
        DQ_INFO(Subsys::kShim,
                "dynamiq: communicator index %d: CPU NCCL, device buffers but no CUDA device "
                "(%s): the host device, on host copies of them",
                e.identity.index, why.c_str());
      device = engine::host_device();
      e.host_engine = true;
    }
  } else if (info.nranks < 2) {
    why = "a 1-rank communicator";  // passes through anyway (kSingleRank): CUDA is not touched
  } else if (!engine::cuda_gpu_linked()) {
    why = "this build of libdynamiq.so has no CUDA device (built without CUDA)";
  } else {
    using CuDevice = ncclResult_t (*)(ncclComm_t, int*);
    static const auto cu_device = reinterpret_cast<CuDevice>(real_symbol("ncclCommCuDevice"));
    int ordinal = -1;
    if (cu_device == nullptr || cu_device(comm, &ordinal) != ncclSuccess) ordinal = -1;
    engine::Device* standby = nullptr;
    device = engine::cuda_gpu_device(ordinal, &why, &standby);
    if (device != nullptr) {
      e.cuda_ordinal = ordinal;
      e.abort_before_teardown = device->abort_ends_queued_nccl_work();
      DQ_INFO(Subsys::kShim, "dynamiq: communicator index %d: NVIDIA's NCCL, the %s device",
              e.identity.index, device->name());
    } else if (standby != nullptr) {
      // This rank alone may have failed (its peers' devices set up): its engine fails its own
      // set-up on the standby and answers their handshake, so every rank passes through alike.
      DQ_INFO(Subsys::kShim, "dynamiq: communicator index %d: NVIDIA's NCCL, %s: the standby",
              e.identity.index, why.c_str());
      device = standby;
    }
  }
  static std::once_flag device_named;  // the first CUDA device served names the log's [dev]
  if (e.cuda_ordinal >= 0) std::call_once(device_named, [&] { log_set_device(e.cuda_ordinal); });
  static std::once_flag no_device_note;
  if (device == nullptr && s.enable && info.nranks >= 2)
    // A warning either way: compression was asked for (DYNAMIQ_ENABLE=1) and none will run. A
    // build without CUDA is most often one whose nvcc was off PATH at its setup.
    std::call_once(no_device_note, [&] {
      if (engine::cuda_gpu_linked())
        DQ_WARN(Subsys::kShim,
                "dynamiq: the NCCL in this process is not dynamiq's CPU NCCL and the CUDA device "
                "is unavailable (%s): every call passes through unchanged",
                why.c_str());
      else
        DQ_WARN(Subsys::kShim,
                "dynamiq: the NCCL in this process is not dynamiq's CPU NCCL and %s: every call "
                "passes through unchanged (rebuild with nvcc on PATH: tools/setup.sh looks in "
                "/usr/local/cuda/bin)",
                why.c_str());
    });
  e.metrics = engine::metrics_register(e.identity.index, e.identity.name, info.rank, info.nranks,
                                       e.has_id ? e.comm_id : 0);
  e.metrics_view.store(e.metrics.get(), std::memory_order_release);
  e.engine = std::make_unique<engine::Engine>(s, config::global_valid(), info, real.ops, device,
                                              e.metrics, opted);
  e.engine->watch_abort(&e.aborted);
  e.live_engine.store(e.engine.get(), std::memory_order_release);
  e.engine->describe_comm(comm_label(e, info), opt_in_why);
  if (!nccl_unsupported().empty() && !s.untested_nccl) e.engine->block_locally(nccl_unsupported());
  if (info.nranks < 2)
    e.engine->log_decision_without_handshake("a 1-rank communicator");
  else if (device == nullptr)
    e.engine->log_decision_without_handshake("no device serves it (" + why + ")");
  return e.engine.get();
}

}  // namespace

int nccl_version() {
  real_nccl();
  return g_nccl_version;
}

const std::string& nccl_unsupported() {
  real_nccl();
  return unsupported_text();
}

const RealNccl* real_nccl() {
  static RealNccl real;
  static bool ok = false;
  static std::once_flag once;
  std::call_once(once, [] {
    resolve("ncclGroupStart", &real.ops.group_start);
    resolve("ncclGroupEnd", &real.ops.group_end);
    resolve("ncclSend", &real.ops.send);
    resolve("ncclRecv", &real.ops.recv);
    resolve("ncclAllReduce", &real.ops.all_reduce);
    resolve("ncclGetErrorString", &real.ops.error_string);
    resolve("ncclCommInitRank", &real.comm_init_rank);
    resolve("ncclCommInitRankConfig", &real.comm_init_rank_config);
    resolve("ncclCommInitRankScalable", &real.comm_init_rank_scalable);
    resolve("ncclCommInitAll", &real.comm_init_all);
    resolve("ncclCommSplit", &real.comm_split);
    resolve("ncclCommShrink", &real.comm_shrink);
    resolve("ncclCommRevoke", &real.comm_revoke);
    resolve("ncclGroupSimulateEnd", &real.group_simulate_end);
    real.ops.comm_revoke = real.comm_revoke;
    resolve("ncclCommFinalize", &real.comm_finalize);
    resolve("ncclCommDestroy", &real.comm_destroy);
    resolve("ncclCommAbort", &real.comm_abort);
    resolve("ncclCommCount", &real.comm_count);
    resolve("ncclCommUserRank", &real.comm_user_rank);
    resolve("ncclCommGetAsyncError", &real.comm_get_async_error);
    resolve("ncclGetLastError", &real.get_last_error);
    real.ops.comm_get_async_error = real.comm_get_async_error;  // non-blocking communicators
    resolve("ncclReduceScatter", &real.reduce_scatter);
    resolve("ncclReduce", &real.reduce);
    resolve("dqCpuNcclCommName", &real.cpu_nccl_comm_name);
    real.ops.reduce_scatter = real.reduce_scatter;
    real.ops.reduce = real.reduce;
    real.ops.comm_split = real.comm_split;
    real.ops.comm_destroy = real.comm_destroy;
    real.ops.comm_abort = real.comm_abort;
    resolve("ncclAllGather", &real.ops.all_gather);
    real.stream_is_capturing =
        reinterpret_cast<int (*)(cudaStream_t, int*)>(dlsym(RTLD_DEFAULT, "cudaStreamIsCapturing"));
    ok = real.ops.complete() && real.comm_count && real.comm_user_rank;
    if (!ok)
      DQ_WARN(Subsys::kShim,
              "dynamiq: libdynamiq.so is preloaded but no NCCL library follows it (ncclAllReduce, "
              "ncclSend, ... not found): link or preload libnccl.so.2 after it");
    // Parse and report the settings once, at the first NCCL call.
    config::global();
    if (ok) check_nccl_version();
  });
  return ok ? &real : nullptr;
}

void comm_created(ncclComm_t comm, const ncclConfig_t* config, int color, ncclComm_t parent,
                  const ncclUniqueId* id) {
  if (comm == nullptr) return;
  auto e = std::make_shared<CommEntry>();
  e->handle = comm;
  if (id != nullptr) {
    e->has_id = true;
    e->comm_id = nccl_comm_id(*id);
    e->comm_hash = nccl_comm_hash(*id);
  }
  // ncclConfig_t grew over releases: read commName only if this caller's struct has it.
  if (config && config->magic == DQ_NCCL_CONFIG_MAGIC &&
      config->size >= offsetof(ncclConfig_t, commName) + sizeof(const char*) && config->commName)
    e->identity.name = config->commName;
  e->identity.color = color;
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  if (e->identity.name.empty() && parent) {
    auto it = t.comms.find(parent);
    if (it != t.comms.end()) e->identity.name = it->second->identity.name;
  }
  e->identity.index = t.next_index++;
  t.comms[comm] = e;
}

void comm_finalizing(ncclComm_t comm) {
  if (auto e = find(comm)) {
    std::lock_guard<std::mutex> lock(e->mutex);
    e->finalizing = true;
  }
}

namespace {

// Takes the communicator out of the table: later calls on its handle (or on a new communicator
// at the same address) find no engine.
std::shared_ptr<CommEntry> detach_comm(ncclComm_t comm) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.comms.find(comm);
  if (it == t.comms.end()) return nullptr;
  std::shared_ptr<CommEntry> e = it->second;
  t.comms.erase(it);
  return e;
}

// The engine's teardown waits for its streams' work, then frees its memory.
void release_engine(CommEntry& e) {
  std::lock_guard<std::mutex> lock(e.mutex);
  e.live_engine.store(nullptr, std::memory_order_release);
  e.engine.reset();
  if (e.metrics) engine::metrics_unregister(e.metrics);
}

// A revoke, or the abort of a shrink's parent: no call enqueues more on the communicator,
// `real` ends its operations in flight (the engine's too), the engine's own communicators are
// revoked without waiting for a call that holds the entry (its waits then end), and the engine is
// torn down. The metrics stay registered until the communicator is destroyed.
ncclResult_t retire_engine(CommEntry& e, const std::function<ncclResult_t()>& real) {
  e.aborted.store(true, std::memory_order_release);
  const ncclResult_t r = real();
  engine::Engine* live = e.live_engine.load(std::memory_order_acquire);
  if (live != nullptr) live->revoke_own_communicators();
  std::lock_guard<std::mutex> lock(e.mutex);
  e.revoked = true;
  if (e.engine) {
    if (e.engine.get() != live) e.engine->revoke_own_communicators();  // made after the load
    DQ_INFO(Subsys::kShim,
            "dynamiq: communicator index %d revoked: its engine is torn down, later calls go to "
            "NCCL",
            e.identity.index);
  }
  e.live_engine.store(nullptr, std::memory_order_release);
  e.engine.reset();
  return r;
}

}  // namespace

void comm_destroyed(ncclComm_t comm) {
  if (std::shared_ptr<CommEntry> e = detach_comm(comm)) release_engine(*e);
}

ncclResult_t comm_aborted(ncclComm_t comm, const std::function<ncclResult_t()>& real_abort) {
  std::shared_ptr<CommEntry> e = detach_comm(comm);
  if (e == nullptr) return real_abort();
  // Not under the entry's lock: a caller's thread may hold it in a (bounded) wait on the
  // engine's streams; the flag stops that call from enqueuing on the aborted communicator once
  // its wait returns.
  e->aborted.store(true, std::memory_order_release);
  // The engine's own node and rail communicators (two levels) hold operations that may wait for
  // a peer that never answers: revoked (NCCL 2.28+), they end at once, and the teardown's waits
  // for the streams return then instead of at DYNAMIQ_TIMEOUT_MS.
  auto revoke_own = [&] {
    if (engine::Engine* live = e->live_engine.load(std::memory_order_acquire))
      live->revoke_own_communicators();
  };
  if (e->abort_before_teardown.load()) {
    // The engine's queued NCCL calls on this communicator end only when NCCL aborts it.
    const ncclResult_t r = real_abort();
    revoke_own();
    release_engine(*e);
    return r;
  }
  // The CPU NCCL's (and the host device's) threads run this communicator's queued calls: they
  // finish before the abort frees it. A revoke first ends those waiting on a peer at once, where
  // they would otherwise wait for the CPU NCCL's timeout. Only there (dqCpuNcclCommName tells
  // it): on NVIDIA's NCCL a communicator without a device has no calls of the engine queued, and
  // the application asked for an abort, not a revoke (which can wait for its kernels).
  if (const RealNccl* real = real_nccl();
      real != nullptr && real->cpu_nccl_comm_name != nullptr && real->comm_revoke != nullptr)
    real->comm_revoke(comm, 0);
  revoke_own();
  release_engine(*e);
  return real_abort();
}

ncclResult_t comm_revoked(ncclComm_t comm, const std::function<ncclResult_t()>& real_revoke) {
  std::shared_ptr<CommEntry> e = find(comm);
  if (e == nullptr) return real_revoke();
  return retire_engine(*e, real_revoke);
}

ncclResult_t comm_shrunk(ncclComm_t comm, int shrink_flags, ncclComm_t* newcomm,
                         const ncclConfig_t* config,
                         const std::function<ncclResult_t()>& real_shrink) {
  std::shared_ptr<CommEntry> parent = find(comm);
  // The parent's opt-in decision, from its identity as it is now (its size read from NCCL if no
  // call has yet), before a shrink with NCCL_SHRINK_ABORT retires it.
  bool parent_on = false;
  std::string parent_why;
  config::CommIdentity inherited;
  if (parent != nullptr) {
    std::lock_guard<std::mutex> lock(parent->identity_mutex);
    inherited = parent->identity;
    const RealNccl* real = real_nccl();
    int size = 0;
    if (inherited.size == 0 && real != nullptr && real->comm_count(comm, &size) == ncclSuccess)
      inherited.size = size;
    parent_on = opt_in_decision(*parent, inherited, config::global(), &parent_why);
  }
  ncclResult_t r;
  if (parent != nullptr && (shrink_flags & DQ_NCCL_SHRINK_ABORT) != 0)
    r = retire_engine(*parent, real_shrink);
  else
    r = real_shrink();
  if ((r != ncclSuccess && r != ncclInProgress) || newcomm == nullptr || *newcomm == nullptr)
    return r;
  comm_created(*newcomm, config, -1, comm);
  if (parent == nullptr) return r;
  std::shared_ptr<CommEntry> child = find(*newcomm);
  if (child == nullptr) return r;
  std::lock_guard<std::mutex> lock(child->identity_mutex);
  if (child->identity.name.empty()) child->identity.name = inherited.name;
  child->identity.color = inherited.color;
  child->inherited_on = parent_on;
  child->inherited_why = "as communicator index " + std::to_string(inherited.index) +
                         ", which it replaces: " + parent_why;
  child->shrunk_from = inherited.index;
  return r;
}

void group_started() {
  ++t_group_depth;
}

namespace {

// A call on a communicator served by the CUDA device: its buffers are classified
// (cudaPointerGetAttributes, each call: a lookup in the driver, and a cache by address range
// would go stale when memory is freed and reused as another kind). This never makes one rank
// pass a call through while its peers compress it (docs/ENGINE.md section 2): every buffer that
// NVIDIA's NCCL can use (device or managed memory, pinned host memory mapped into the device, or
// pageable memory on a device that reads it through HMM/ATS) is one the kernels read and write
// at the same address, so the decision stays the call's arguments' and the agreed state's. A
// buffer the device cannot reach is one NVIDIA's NCCL cannot use either: the call fails on this
// rank with ncclInvalidArgument (what NCCL's own pointer check returns), where NCCL would fail
// or fault, and its peers time out as they would with NCCL. The same holds on a CPU NCCL
// communicator that the CUDA device serves (its first call gave device buffers): its later calls
// must give buffers the device can reach. Only calls the engine may compress
// are classified (or the first one, before the handshake).
ncclResult_t check_cuda_buffers(CommEntry& e, const engine::Engine& eng,
                                const engine::CallArgs& call, const engine::Screening& screening) {
  const engine::PassReason r = eng.decide(call, screening);
  if (r != engine::PassReason::kRerouted && r != engine::PassReason::kInGroup) return ncclSuccess;
  const void* recv = engine::uses_recv_buffer(call, eng.rank()) ? call.recv : nullptr;
  for (const void* p : {call.send, recv}) {
    if (p == nullptr) continue;
    std::string why;
    const engine::CudaBuffer kind = engine::cuda_gpu_classify(p, e.cuda_ordinal, &why);
    if (kind == engine::CudaBuffer::kDevice || kind == engine::CudaBuffer::kPageable) continue;
    DQ_WARN(Subsys::kShim,
            "dynamiq: communicator index %d: buffer %p cannot be used on CUDA device %d, which "
            "serves this communicator (%s); NVIDIA's NCCL cannot use it either: the call fails "
            "with ncclInvalidArgument",
            e.identity.index, p, e.cuda_ordinal, why.c_str());
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

size_t eligible_element_bytes(ncclDataType_t dtype) {
  return dtype == ncclFloat32 ? 4 : dtype == ncclBfloat16 ? 2 : 0;
}

// A call on a CPU NCCL communicator (the host device) whose buffers may be CUDA device memory:
// the CPU NCCL given a CUDA driver (DYNAMIQ_CPU_NCCL_CUDA_DRIVER, config/cuda_staging.h) accepts
// them, but the host device's steps read and write the caller's buffers directly, and device
// memory is not host memory. The engine then runs on host copies made in the order of the
// caller's stream, and the result is copied back after it (the host device has completed the
// call when run() returns). The copies move bytes, never decisions: a rank with device buffers
// and one with host buffers take the same branch and produce the same bytes. When the engine
// does not reroute the call the copies are dropped unwritten, and the call goes to the CPU NCCL
// with the caller's own pointers (which stages them itself).
ncclResult_t run_host_staged(CommEntry& e, engine::Engine& eng, const engine::CallArgs& call,
                             const engine::Screening& screening, engine::PassReason* reason) {
  const engine::PassReason screened = eng.decide(call, screening);
  const size_t esize = eligible_element_bytes(call.dtype);
  if (call.in_group || esize == 0 || !staging::available() ||
      (screened != engine::PassReason::kRerouted && screened != engine::PassReason::kInGroup))
    return eng.run(call, screening, reason);
  size_t recv_count = call.count;
  if (call.collective == engine::Collective::kReduceScatter)
    recv_count = call.count / static_cast<size_t>(std::max(e.identity.size, 1));
  staging::Staging st;
  st.add(call.send, call.count * esize, /*reads=*/true, /*writes=*/false, call.stream);
  // Copied in as well (the staging copies in every region): what goes back is then the caller's
  // own bytes wherever the engine wrote none. Not a reduce's on a rank other than the root, which
  // NCCL ignores (it may be NULL or point anywhere) and the engine never writes.
  if (engine::uses_recv_buffer(call, eng.rank()))
    st.add(call.recv, recv_count * esize, /*reads=*/false, /*writes=*/true, call.stream);
  if (st.begin() != Status::kOk) {
    DQ_WARN(Subsys::kShim, "dynamiq: communicator index %d: staging device buffers failed: %s",
            e.identity.index, st.error().c_str());
    return ncclUnhandledCudaError;
  }
  if (!st.active()) return eng.run(call, screening, reason);
  engine::CallArgs host_call = call;
  host_call.send = st.host(call.send);
  host_call.recv = st.host(call.recv);
  const ncclResult_t result = eng.run(host_call, screening, reason);
  if (result != ncclSuccess || *reason != engine::PassReason::kRerouted) return result;
  if (st.end() != Status::kOk) {
    DQ_WARN(Subsys::kShim, "dynamiq: communicator index %d: copying the result back failed: %s",
            e.identity.index, st.error().c_str());
    return ncclUnhandledCudaError;
  }
  return ncclSuccess;
}

// A communicator the shim did not see made, at its first call: registered then, as any other
// (its handshake agrees its opt-in with its peers). NVIDIA's NCCL writes a split's or shrink's
// handle only when the split completes: at the outermost group end for one made inside a group
// (one thread driving several GPUs must split so), later, from NCCL's thread, for one of a
// non-blocking communicator. The shim's split saw a null handle and registered nothing, so the
// child passed every call through, silently, on the ranks that split that way. It has no split
// color or name here: a DYNAMIQ_COMMS rule by color or name does not match it. nullptr where NCCL
// does not know `comm` either.
std::shared_ptr<CommEntry> adopt(ncclComm_t comm, const RealNccl& real) {
  int size = 0;
  if (comm == nullptr || real.comm_count == nullptr || real.comm_count(comm, &size) != ncclSuccess)
    return nullptr;
  comm_created(comm, nullptr, -1, nullptr);
  std::shared_ptr<CommEntry> e = find(comm);
  if (e != nullptr)
    DQ_INFO(Subsys::kShim,
            "dynamiq: communicator %p (%d ranks) first seen at a call, registered now as index %d "
            "(a split made inside a group or of a non-blocking communicator, whose handle NCCL "
            "writes after the split returns); it has no split color or name",
            static_cast<void*>(comm), size, e->identity.index);
  return e;
}

// The text last_error() gives while g_own_error holds: the warning of the last call that failed
// in dynamiq, as "dynamiq: ...". One for the process, as NCCL's own.
std::mutex g_last_error_mutex;
bool g_own_error = false;
char g_last_error[1100] = "";

// A call failed in dynamiq: its warning on this thread, when it gave one (a sticky error returned
// again keeps the first call's).
void note_own_error() {
  const std::string warning = log_last_warning();
  if (warning.empty()) return;
  std::lock_guard<std::mutex> lock(g_last_error_mutex);
  std::snprintf(g_last_error, sizeof g_last_error, "dynamiq: %s", warning.c_str());
  g_own_error = true;
}

// A call NCCL itself failed: its last error is the newer one.
void note_nccl_error(ncclResult_t r) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  std::lock_guard<std::mutex> lock(g_last_error_mutex);
  g_own_error = false;
}

// Runs `call` through the communicator's engine; forwards it with `pass` unless the engine
// rerouted it or failed.
template <class Pass>
ncclResult_t route(engine::CallArgs call, ncclComm_t comm, const RealNccl& real, Pass&& pass) {
  note_group_comm(comm);
  std::shared_ptr<CommEntry> e = find(comm);
  if (e == nullptr) e = adopt(comm, real);
  if (e == nullptr) return pass();
  ncclResult_t result = ncclSuccess;
  engine::PassReason reason = engine::PassReason::kDisabled;
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    const LogDeviceScope device_in_log(e->cuda_ordinal);
    engine::Engine* eng = e->finalizing || e->revoked ? nullptr : engine_for(*e, comm, real, call);
    // Asked once for this call; every check below decides from it.
    const engine::Screening screening =
        eng != nullptr ? eng->screen_call(call) : engine::Screening{};
    if (eng != nullptr && t_group_depth > 0) {
      // Inside the caller's group: hold back what the engine may compress once the group ends
      // (a communicator still before its handshake included); everything else joins the group.
      const engine::PassReason outside = eng->decide(call, screening);
      if (outside == engine::PassReason::kRerouted ||
          outside == engine::PassReason::kInGroup /* handshake still to come */) {
        t_deferred.push_back(Deferred{call, comm, std::function<ncclResult_t()>(pass)});
        return ncclSuccess;
      }
      call.in_group = true;
    }
    if (eng != nullptr) {
      log_clear_last_warning();
      int capturing = 0;
      if (real.stream_is_capturing && call.stream &&
          real.stream_is_capturing(call.stream, &capturing) == 0)
        call.capturing = capturing != 0;
      if (e->cuda_ordinal >= 0) result = check_cuda_buffers(*e, *eng, call, screening);
      if (result == ncclSuccess)
        result = e->host_engine ? run_host_staged(*e, *eng, call, screening, &reason)
                                : eng->run(call, screening, &reason);
      e->last_async_error.store(eng->async_error(), std::memory_order_release);
    }
  }
  engine::metrics_tick();
  if (result != ncclSuccess) note_own_error();
  if (result != ncclSuccess || reason == engine::PassReason::kRerouted) return result;
  const ncclResult_t passed = pass();
  note_nccl_error(passed);
  return passed;
}

}  // namespace

ncclResult_t group_end(const RealNccl& real) {
  if (t_group_depth > 0) --t_group_depth;  // the group is closed even when NCCL reports an error
  const ncclResult_t end = real.ops.group_end();
  if (t_group_depth > 0) return end;
  // Whether the group held calls on more than one communicator: every collective the shim saw in
  // it counts, held back or not (see t_group_comms).
  const bool one_comm = t_group_comms.size() <= 1;
  t_group_comms.clear();
  if (t_deferred.empty()) return end;
  std::vector<Deferred> held;
  held.swap(t_deferred);
  // Non-blocking communicators' group still being issued: complete before the held calls.
  if (end == ncclInProgress)
    for (const Deferred& d : held)
      if (const ncclResult_t settled = real.ops.settled(d.comm, end, config::global().timeout_ms);
          settled != ncclSuccess)
        return settled;
  if (end != ncclSuccess && end != ncclInProgress) return end;  // the held calls never ran
  ncclResult_t result = ncclSuccess;
  if (!one_comm) {
    if ((result = real.ops.group_start()) != ncclSuccess) return result;
    for (Deferred& d : held)
      if (result == ncclSuccess) result = d.pass();
    const ncclResult_t again = real.ops.group_end();
    return result == ncclSuccess ? again : result;
  }
  // Each held call settled before the next: on a non-blocking communicator a call the engine
  // passes through may answer ncclInProgress, which is no failure, and NCCL refuses the next call
  // until it has settled. (Taken as one, it left the later held calls never issued, their
  // buffers unreduced, while the caller's polls found the communicator healthy.)
  const int64_t timeout_ms = config::global().timeout_ms;
  for (Deferred& d : held) {
    if (result != ncclSuccess) break;
    result = real.ops.settled(d.comm, route(d.call, d.comm, real, d.pass), timeout_ms);
  }
  // The caller's group was still being issued: the caller polls its communicators, as NCCL
  // documents (those of the held calls have settled).
  return result == ncclSuccess && end == ncclInProgress ? ncclInProgress : result;
}

ncclResult_t group_simulate_end(const RealNccl& real, ncclSimInfo_t* sim_info) {
  if (t_group_depth > 0) --t_group_depth;
  ncclResult_t result = ncclSuccess;
  if (t_group_depth == 0) {
    t_group_comms.clear();
    std::vector<Deferred> held;
    held.swap(t_deferred);
    for (Deferred& d : held)
      if (const ncclResult_t r = d.pass(); r != ncclSuccess && result == ncclSuccess) result = r;
  }
  const ncclResult_t end = real.group_simulate_end(sim_info);  // closes the real group whatever
  return result != ncclSuccess ? result : end;
}

namespace {

engine::CallArgs call_args(engine::Collective collective, const void* send, void* recv,
                           size_t count, ncclDataType_t dtype, ncclRedOp_t op,
                           cudaStream_t stream) {
  engine::CallArgs call;
  call.collective = collective;
  call.send = send;
  call.recv = recv;
  call.count = count;
  call.dtype = dtype;
  call.op = op;
  call.stream = stream;
  return call;
}

}  // namespace

// The real calls are captured by value: a call held back in a group runs after these return.
ncclResult_t all_reduce(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                        ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  const RealNccl* real = real_nccl();
  if (real == nullptr) return ncclSystemError;
  return route(call_args(engine::Collective::kAllReduce, send, recv, count, dtype, op, stream),
               comm, *real,
               [=] { return real->ops.all_reduce(send, recv, count, dtype, op, comm, stream); });
}

ncclResult_t reduce_scatter(const void* send, void* recv, size_t recvcount, ncclDataType_t dtype,
                            ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  const RealNccl* real = real_nccl();
  if (real == nullptr || real->reduce_scatter == nullptr) return ncclSystemError;
  auto pass = [=] { return real->reduce_scatter(send, recv, recvcount, dtype, op, comm, stream); };
  note_group_comm(comm);  // counted in the caller's group even where it goes straight to NCCL
  int nranks = 0;
  if (real->comm_count(comm, &nranks) != ncclSuccess || nranks < 1) return pass();
  const size_t count = recvcount * static_cast<size_t>(nranks);  // the engine counts the input
  return route(call_args(engine::Collective::kReduceScatter, send, recv, count, dtype, op, stream),
               comm, *real, pass);
}

ncclResult_t reduce(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                    ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  const RealNccl* real = real_nccl();
  if (real == nullptr || real->reduce == nullptr) return ncclSystemError;
  engine::CallArgs call =
      call_args(engine::Collective::kReduce, send, recv, count, dtype, op, stream);
  call.root = root;
  return route(call, comm, *real,
               [=] { return real->reduce(send, recv, count, dtype, op, root, comm, stream); });
}

// The counters' C API: atomics and the budget's own short lock, never the entry's `mutex`, which a
// call holds through its waits (up to DYNAMIQ_TIMEOUT_MS): a monitoring thread never waits for one.
ncclResult_t comm_counters(ncclComm_t comm, uint64_t* rerouted, uint64_t* passed) {
  std::shared_ptr<CommEntry> e = find(comm);
  if (e == nullptr) return ncclInvalidArgument;
  *rerouted = *passed = 0;
  const engine::CommMetrics* m = e->metrics_view.load(std::memory_order_acquire);
  if (m == nullptr) return ncclSuccess;
  for (int k = 0; k < engine::kPassReasonCount; ++k)
    (k == 0 ? *rerouted : *passed) += m->calls[k].load();
  return ncclSuccess;
}

ncclResult_t comm_bytes(ncclComm_t comm, uint64_t* bytes_in, uint64_t* wire_bytes) {
  std::shared_ptr<CommEntry> e = find(comm);
  if (e == nullptr) return ncclInvalidArgument;
  const engine::CommMetrics* m = e->metrics_view.load(std::memory_order_acquire);
  *bytes_in = m != nullptr ? m->bytes_in.load() : 0;
  *wire_bytes = m != nullptr ? m->wire_bytes.load() : 0;
  return ncclSuccess;
}

ncclResult_t comm_budget(ncclComm_t comm, engine::BudgetMetrics* out) {
  std::shared_ptr<CommEntry> e = find(comm);
  if (e == nullptr) return ncclInvalidArgument;
  *out = engine::BudgetMetrics{};
  engine::CommMetrics* m = e->metrics_view.load(std::memory_order_acquire);
  if (m == nullptr) return ncclSuccess;
  std::lock_guard<std::mutex> budget_lock(m->budget_mutex);
  *out = m->budget;
  return ncclSuccess;
}

ncclResult_t comm_async_error(ncclComm_t comm, ncclResult_t* async_error) {
  const RealNccl* real = real_nccl();
  if (real == nullptr || real->comm_get_async_error == nullptr) return ncclSystemError;
  const ncclResult_t r = real->comm_get_async_error(comm, async_error);
  if (r != ncclSuccess || *async_error != ncclSuccess) return r;
  if (std::shared_ptr<CommEntry> e = find(comm)) {
    // Never waits for a call in progress: its last known state instead.
    std::unique_lock<std::mutex> lock(e->mutex, std::try_to_lock);
    if (!lock.owns_lock()) {
      *async_error = static_cast<ncclResult_t>(e->last_async_error.load(std::memory_order_acquire));
    } else if (e->engine) {
      *async_error = e->engine->async_error();
      e->last_async_error.store(*async_error, std::memory_order_release);
    }
  }
  return ncclSuccess;
}

const char* last_error(ncclComm_t comm) {
  {
    std::lock_guard<std::mutex> lock(g_last_error_mutex);
    if (g_own_error) return g_last_error;
  }
  const RealNccl* real = real_nccl();
  return real != nullptr && real->get_last_error != nullptr ? real->get_last_error(comm) : "";
}

ncclResult_t register_comm(ncclComm_t comm, int enable) {
  std::shared_ptr<CommEntry> e = find(comm);
  if (e == nullptr) {
    DQ_WARN(Subsys::kShim,
            "dynamiqCommRegister: %p is not a communicator created in this process "
            "after libdynamiq.so was loaded",
            static_cast<void*>(comm));
    return ncclInvalidArgument;
  }
  std::lock_guard<std::mutex> lock(e->mutex);
  if (e->engine && e->engine->register_opt_in(enable != 0) != Status::kOk) return ncclInvalidUsage;
  std::lock_guard<std::mutex> identity_lock(e->identity_mutex);
  e->explicit_opt = true;  // also what a communicator shrunk from this one inherits
  e->explicit_on = enable != 0;
  return ncclSuccess;
}

}  // namespace dq::shim
