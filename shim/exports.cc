// The extern "C" boundary of libdynamiq.so: the interposed NCCL entry points and dynamiq's C
// API. Each entry catches every exception (none crosses into the application), runs under the
// format's floating-point environment and the C locale (the application's are restored on return,
// whatever it set: common/float_env.h, common/c_locale.h) and forwards to the real NCCL whatever
// dynamiq does not reroute.
#include <cstring>
#include <new>
#include <string>

#include "common/abi_guard.h"
#include "common/c_locale.h"
#include "common/float_env.h"
#include "common/log.h"
#include "common/nccl_api.h"
#include "shim/dynamiq.h"
#include "shim/engine/interceptor.h"
#include "shim/engine/metrics.h"

#define DQ_SHIM_API extern "C" __attribute__((visibility("default")))

namespace {

using dq::shim::real_nccl;

template <class F>
ncclResult_t guarded(const char* what, F&& body) {
  // Threads the engine starts inside inherit this environment too (not the locale: each of
  // dynamiq's threads sets its own).
  const dq::DefaultFloatEnvironment float_env;
  const dq::CNumericLocale c_numbers;
  return dq::abi_guard(body, [what](dq::AbiFault fault, const char*) {
    if (fault == dq::AbiFault::kOutOfMemory) {
      DQ_WARN(dq::Subsys::kShim, "dynamiq: %s: out of memory", what);
      return ncclSystemError;
    }
    DQ_WARN(dq::Subsys::kShim, "dynamiq: %s: internal error (exception)", what);
    return ncclInternalError;
  });
}

#define DQ_REAL_OR_FAIL(fn)                     \
  const dq::shim::RealNccl* real = real_nccl(); \
  if (real == nullptr || real->fn == nullptr) return ncclSystemError

// Depth of NCCL calls this thread has in progress below us. An NCCL may call its own public
// entry points internally (the CPU NCCL's ncclCommInitRank calls ncclCommInitRankConfig), and
// those resolve to ours: they must go straight through, without bookkeeping.
thread_local int t_below = 0;
struct Below {
  Below() { ++t_below; }
  ~Below() { --t_below; }
};

}  // namespace

DQ_SHIM_API ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count,
                                       ncclDataType_t dtype, ncclRedOp_t op, ncclComm_t comm,
                                       cudaStream_t stream) {
  return guarded("ncclAllReduce", [&] {
    if (t_below > 0) {
      DQ_REAL_OR_FAIL(ops.all_reduce);
      return real->ops.all_reduce(send, recv, count, dtype, op, comm, stream);
    }
    Below below;  // the engine's own NCCL calls, and NCCL's internal ones, pass straight through
    return dq::shim::all_reduce(send, recv, count, dtype, op, comm, stream);
  });
}

DQ_SHIM_API ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount,
                                           ncclDataType_t dtype, ncclRedOp_t op, ncclComm_t comm,
                                           cudaStream_t stream) {
  return guarded("ncclReduceScatter", [&] {
    if (t_below > 0) {
      DQ_REAL_OR_FAIL(reduce_scatter);
      return real->reduce_scatter(send, recv, recvcount, dtype, op, comm, stream);
    }
    Below below;
    return dq::shim::reduce_scatter(send, recv, recvcount, dtype, op, comm, stream);
  });
}

DQ_SHIM_API ncclResult_t ncclReduce(const void* send, void* recv, size_t count,
                                    ncclDataType_t dtype, ncclRedOp_t op, int root, ncclComm_t comm,
                                    cudaStream_t stream) {
  return guarded("ncclReduce", [&] {
    if (t_below > 0) {
      DQ_REAL_OR_FAIL(reduce);
      return real->reduce(send, recv, count, dtype, op, root, comm, stream);
    }
    Below below;
    return dq::shim::reduce(send, recv, count, dtype, op, root, comm, stream);
  });
}

DQ_SHIM_API ncclResult_t ncclGroupStart(void) {
  return guarded("ncclGroupStart", [&] {
    DQ_REAL_OR_FAIL(ops.group_start);
    if (t_below > 0) return real->ops.group_start();
    Below below;
    const ncclResult_t r = real->ops.group_start();
    if (r == ncclSuccess) dq::shim::group_started();
    return r;
  });
}

DQ_SHIM_API ncclResult_t ncclGroupEnd(void) {
  return guarded("ncclGroupEnd", [&] {
    DQ_REAL_OR_FAIL(ops.group_end);
    if (t_below > 0) return real->ops.group_end();
    Below below;
    return dq::shim::group_end(*real);
  });
}

DQ_SHIM_API ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t* sim_info) {
  return guarded("ncclGroupSimulateEnd", [&] {
    DQ_REAL_OR_FAIL(group_simulate_end);
    if (t_below > 0) return real->group_simulate_end(sim_info);
    Below below;
    return dq::shim::group_simulate_end(*real, sim_info);
  });
}

DQ_SHIM_API ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return guarded("ncclCommInitRank", [&] {
    DQ_REAL_OR_FAIL(comm_init_rank);
    if (t_below > 0) return real->comm_init_rank(comm, nranks, id, rank);
    Below below;
    const ncclResult_t r = real->comm_init_rank(comm, nranks, id, rank);
    if ((r == ncclSuccess || r == ncclInProgress) && comm)
      dq::shim::comm_created(*comm, nullptr, -1, nullptr, &id);
    return r;
  });
}

DQ_SHIM_API ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                                int rank, ncclConfig_t* config) {
  return guarded("ncclCommInitRankConfig", [&] {
    DQ_REAL_OR_FAIL(comm_init_rank_config);
    if (t_below > 0) return real->comm_init_rank_config(comm, nranks, id, rank, config);
    Below below;
    const ncclResult_t r = real->comm_init_rank_config(comm, nranks, id, rank, config);
    if ((r == ncclSuccess || r == ncclInProgress) && comm)
      dq::shim::comm_created(*comm, config, -1, nullptr, &id);
    return r;
  });
}

DQ_SHIM_API ncclResult_t ncclCommInitRankScalable(ncclComm_t* comm, int nranks, int rank, int n_ids,
                                                  ncclUniqueId* ids, ncclConfig_t* config) {
  return guarded("ncclCommInitRankScalable", [&] {
    DQ_REAL_OR_FAIL(comm_init_rank_scalable);
    if (t_below > 0) return real->comm_init_rank_scalable(comm, nranks, rank, n_ids, ids, config);
    Below below;
    const ncclResult_t r = real->comm_init_rank_scalable(comm, nranks, rank, n_ids, ids, config);
    if ((r == ncclSuccess || r == ncclInProgress) && comm)
      dq::shim::comm_created(*comm, config, -1, nullptr, n_ids > 0 ? ids : nullptr);
    return r;
  });
}

DQ_SHIM_API ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  return guarded("ncclCommInitAll", [&] {
    DQ_REAL_OR_FAIL(comm_init_all);
    if (t_below > 0) return real->comm_init_all(comms, ndev, devlist);
    Below below;
    const ncclResult_t r = real->comm_init_all(comms, ndev, devlist);
    if (r == ncclSuccess && comms)
      for (int i = 0; i < ndev; ++i) dq::shim::comm_created(comms[i], nullptr, -1, nullptr);
    return r;
  });
}

DQ_SHIM_API ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                       ncclConfig_t* config) {
  return guarded("ncclCommSplit", [&] {
    DQ_REAL_OR_FAIL(comm_split);
    if (t_below > 0) return real->comm_split(comm, color, key, newcomm, config);
    Below below;
    const ncclResult_t r = real->comm_split(comm, color, key, newcomm, config);
    if ((r == ncclSuccess || r == ncclInProgress) && newcomm && *newcomm)
      dq::shim::comm_created(*newcomm, config, color < 0 ? -1 : color, comm);
    return r;
  });
}

DQ_SHIM_API ncclResult_t ncclCommShrink(ncclComm_t comm, int* exclude_ranks, int exclude_count,
                                        ncclComm_t* newcomm, ncclConfig_t* config,
                                        int shrink_flags) {
  return guarded("ncclCommShrink", [&] {
    DQ_REAL_OR_FAIL(comm_shrink);
    auto real_shrink = [&] {
      return real->comm_shrink(comm, exclude_ranks, exclude_count, newcomm, config, shrink_flags);
    };
    if (t_below > 0) return real_shrink();
    Below below;
    return dq::shim::comm_shrunk(comm, shrink_flags, newcomm, config, real_shrink);
  });
}

DQ_SHIM_API ncclResult_t ncclCommRevoke(ncclComm_t comm, int revoke_flags) {
  return guarded("ncclCommRevoke", [&] {
    DQ_REAL_OR_FAIL(comm_revoke);
    if (t_below > 0) return real->comm_revoke(comm, revoke_flags);
    Below below;
    return dq::shim::comm_revoked(comm, [&] { return real->comm_revoke(comm, revoke_flags); });
  });
}

DQ_SHIM_API ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  return guarded("ncclCommFinalize", [&] {
    DQ_REAL_OR_FAIL(comm_finalize);
    if (t_below > 0) return real->comm_finalize(comm);
    Below below;
    dq::shim::comm_finalizing(comm);
    return real->comm_finalize(comm);
  });
}

DQ_SHIM_API ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  return guarded("ncclCommDestroy", [&] {
    DQ_REAL_OR_FAIL(comm_destroy);
    if (t_below > 0) return real->comm_destroy(comm);
    Below below;
    dq::shim::comm_destroyed(comm);
    return real->comm_destroy(comm);
  });
}

DQ_SHIM_API ncclResult_t ncclCommAbort(ncclComm_t comm) {
  return guarded("ncclCommAbort", [&] {
    DQ_REAL_OR_FAIL(comm_abort);
    if (t_below > 0) return real->comm_abort(comm);
    Below below;
    return dq::shim::comm_aborted(comm, [&] { return real->comm_abort(comm); });
  });
}

DQ_SHIM_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  return guarded("ncclCommGetAsyncError", [&] {
    if (async_error == nullptr) return ncclInvalidArgument;
    if (t_below > 0) {
      DQ_REAL_OR_FAIL(comm_get_async_error);
      return real->comm_get_async_error(comm, async_error);
    }
    Below below;
    return dq::shim::comm_async_error(comm, async_error);
  });
}

DQ_SHIM_API const char* ncclGetLastError(ncclComm_t comm) {
  try {
    return dq::shim::last_error(comm);
  } catch (...) {  // a mutex that failed to lock: nothing to say rather than an exception
    return "";
  }
}

DQ_SHIM_API int dynamiqCommRegister(void* comm, int enable) {
  return guarded("dynamiqCommRegister", [&] {
    if (real_nccl() == nullptr) return ncclSystemError;
    return dq::shim::register_comm(static_cast<ncclComm_t>(comm), enable);
  });
}

DQ_SHIM_API int dynamiqCommCounters(void* comm, unsigned long long* rerouted,
                                    unsigned long long* passed) {
  return guarded("dynamiqCommCounters", [&] {
    uint64_t r = 0, p = 0;
    const ncclResult_t res = dq::shim::comm_counters(static_cast<ncclComm_t>(comm), &r, &p);
    if (rerouted) *rerouted = r;
    if (passed) *passed = p;
    return res;
  });
}

DQ_SHIM_API int dynamiqCommBytes(void* comm, unsigned long long* bytes_in,
                                 unsigned long long* wire_bytes) {
  return guarded("dynamiqCommBytes", [&] {
    uint64_t in = 0, wire = 0;
    const ncclResult_t res = dq::shim::comm_bytes(static_cast<ncclComm_t>(comm), &in, &wire);
    if (bytes_in) *bytes_in = in;
    if (wire_bytes) *wire_bytes = wire;
    return res;
  });
}

DQ_SHIM_API int dynamiqCommBudget(void* comm, unsigned long long* widths,
                                  unsigned long long* predicted_calls, double* predicted_vnmse_mean,
                                  double* predicted_vnmse_last, double* mean_bits) {
  return guarded("dynamiqCommBudget", [&] {
    dq::engine::BudgetMetrics b;
    const ncclResult_t res = dq::shim::comm_budget(static_cast<ncclComm_t>(comm), &b);
    if (widths)
      for (int w = 0; w < 4; ++w) widths[w] = b.widths[w];
    if (predicted_calls) *predicted_calls = b.predicted_calls;
    if (predicted_vnmse_mean)
      *predicted_vnmse_mean =
          b.predicted_calls ? b.predicted_vnmse_sum / static_cast<double>(b.predicted_calls) : -1.0;
    if (predicted_vnmse_last) *predicted_vnmse_last = b.predicted_vnmse_last;
    if (mean_bits)
      *mean_bits = b.budget_calls ? b.bits_sum / static_cast<double>(b.budget_calls) : 0.0;
    return res;
  });
}

DQ_SHIM_API int dynamiqCommCheck(void* comm, unsigned long long* mx_calls,
                                 unsigned long long* checked_calls, double* sampled_vnmse,
                                 unsigned long long* paired_calls, double* paired_predicted_mean,
                                 double* paired_sampled_mean) {
  return guarded("dynamiqCommCheck", [&] {
    dq::engine::BudgetMetrics b;
    const ncclResult_t res = dq::shim::comm_budget(static_cast<ncclComm_t>(comm), &b);
    const double paired = static_cast<double>(b.paired_calls);
    if (mx_calls) *mx_calls = b.mx_calls;
    if (checked_calls) *checked_calls = b.checked_calls;
    if (sampled_vnmse)
      *sampled_vnmse = b.checked_energy > 0 ? b.checked_sq_error / b.checked_energy : -1.0;
    if (paired_calls) *paired_calls = b.paired_calls;
    if (paired_predicted_mean)
      *paired_predicted_mean = b.paired_calls ? b.paired_predicted_sum / paired : -1.0;
    if (paired_sampled_mean)
      *paired_sampled_mean = b.paired_calls ? b.paired_sampled_sum / paired : -1.0;
    return res;
  });
}

DQ_SHIM_API int dynamiqMetricsFlush(void) {
  return guarded("dynamiqMetricsFlush",
                 [&] { return dq::engine::metrics_flush() ? ncclSuccess : ncclSystemError; });
}

DQ_SHIM_API int dynamiqMetricsPath(char* path, size_t bytes) {
  return guarded("dynamiqMetricsPath", [&] {
    if (path == nullptr || bytes == 0) return ncclInvalidArgument;
    const std::string now = dq::engine::metrics_path_now();
    if (now.empty() || now.size() + 1 > bytes) {
      path[0] = '\0';
      return ncclInvalidArgument;
    }
    std::memcpy(path, now.c_str(), now.size() + 1);
    return ncclSuccess;
  });
}
