// The one C-ABI boundary of libdynamiq-capi.so: every entry point validates its arguments,
// converts dq::Status to an int and catches every exception, so nothing C++ leaks to callers.
#include <tbb/global_control.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "common/abi_guard.h"
#include "tools/capi/dynamiq_capi.h"
#include "tools/sim/auto_choice.h"
#include "tools/sim/simulate.h"

#define DQ_CAPI_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using dq::Status;

int set_error(char* err, size_t err_len, Status s, const std::string& what) {
  if (err && err_len > 0) std::snprintf(err, err_len, "%s", what.c_str());
  return static_cast<int>(s);
}

// Converts whatever escaped the body into a result code and a message.
template <typename Body>
int guarded(char* err, size_t err_len, Body&& body) {
  if (err && err_len > 0) err[0] = '\0';
  return dq::abi_guard(body, [err, err_len](dq::AbiFault fault, const char* what) {
    switch (fault) {
      case dq::AbiFault::kOutOfMemory:
        return set_error(err, err_len, Status::kOutOfMemory, "out of host memory");
      case dq::AbiFault::kException:
        return set_error(err, err_len, Status::kInternal, std::string("exception: ") + what);
      case dq::AbiFault::kUnknown:
        break;
    }
    return set_error(err, err_len, Status::kInternal, "unknown exception");
  });
}

// The arguments every call of n worker rows takes: validated, the rows as a list, the schedule.
int load_call(const char* topo, int n_workers, const float* const* rows, size_t d,
              std::vector<const float*>* row_list, dq::topo::Schedule* schedule, char* err,
              size_t err_len) {
  if (!topo || !rows)
    return set_error(err, err_len, Status::kInvalidArgument, "topo and rows must not be NULL");
  if (n_workers < 1 || n_workers > dq::topo::kMaxWorkers)
    return set_error(err, err_len, Status::kInvalidArgument,
                     "n_workers must be 1.." + std::to_string(dq::topo::kMaxWorkers) + ", got " +
                         std::to_string(n_workers));
  if (d == 0) return set_error(err, err_len, Status::kInvalidArgument, "d must be positive");
  row_list->assign(rows, rows + n_workers);
  for (int w = 0; w < n_workers; ++w)
    if (!(*row_list)[w])
      return set_error(err, err_len, Status::kInvalidArgument,
                       "rows[" + std::to_string(w) + "] is NULL");
  dq::topo::Kind kind;
  if (dq::topo::parse_kind(topo, &kind) != Status::kOk)
    return set_error(err, err_len, Status::kInvalidArgument,
                     std::string("unknown topology '") + topo + "' (ring, butterfly)");
  const Status s = dq::topo::make_schedule(kind, n_workers, schedule);
  if (s != Status::kOk)
    return set_error(err, err_len, s,
                     "make_schedule failed for " + std::to_string(n_workers) + " workers");
  return 0;
}

std::mutex g_threads_mutex;
std::unique_ptr<tbb::global_control> g_thread_cap;  // guarded by g_threads_mutex

}  // namespace

DQ_CAPI_EXPORT int dq_capi_abi_version(void) {
  return DQ_CAPI_ABI_VERSION;
}

DQ_CAPI_EXPORT const char* dq_status_name(int code) {
  if (code < 0 || code > static_cast<int>(Status::kUnsupported)) return "unknown status";
  return dq::status_name(static_cast<Status>(code));
}

DQ_CAPI_EXPORT int dq_set_max_threads(int threads, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    if (threads < 0 || threads > 1024)
      return set_error(err, err_len, Status::kInvalidArgument,
                       "threads must be 0 (no cap) .. 1024, got " + std::to_string(threads));
    std::lock_guard<std::mutex> lock(g_threads_mutex);
    g_thread_cap.reset();
    if (threads > 0)
      g_thread_cap = std::make_unique<tbb::global_control>(
          tbb::global_control::max_allowed_parallelism, static_cast<size_t>(threads));
    return 0;
  });
}

DQ_CAPI_EXPORT int dq_allreduce_sim(const char* codec_spec, const char* topo, int n_workers,
                                    const float* const* rows, size_t d, uint64_t seed,
                                    uint64_t call, int average, float* out, dq_sim_stats* stats,
                                    char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    if (!codec_spec)
      return set_error(err, err_len, Status::kInvalidArgument, "codec_spec must not be NULL");
    std::vector<const float*> row_list;
    dq::topo::Schedule schedule;
    if (int rc = load_call(topo, n_workers, rows, d, &row_list, &schedule, err, err_len)) return rc;
    std::string why;
    std::unique_ptr<dq::Codec> codec = dq::make_codec(codec_spec, &why);
    if (!codec) return set_error(err, err_len, Status::kInvalidArgument, why);
    Status s = Status::kOk;

    dq::sim::SimOptions opt;
    opt.seed = seed;
    opt.call = call;
    opt.op = average ? dq::ReduceOp::kAvg : dq::ReduceOp::kSum;
    dq::sim::SimResult result;
    std::vector<float> decoded;
    s = dq::sim::simulate_allreduce(*codec, schedule, row_list, d, opt, out ? &decoded : nullptr,
                                    &result);
    if (s != Status::kOk)
      return set_error(err, err_len, s,
                       std::string("simulate_allreduce(") + codec_spec + ", " + topo +
                           ") failed: " + dq::status_name(s) + " (details on stderr)");
    if (out) {
      if (decoded.size() != d)
        return set_error(err, err_len, Status::kInternal, "decoded result has the wrong length");
      std::memcpy(out, decoded.data(), d * sizeof(float));
    }
    if (stats) {
      stats->vnmse = result.vnmse;
      stats->bits_per_coord = result.bits_per_coord;
      stats->wire_bits_per_coord = result.wire_bits_per_coord;
      stats->seconds = result.seconds;
      stats->budget_honest = result.budget_honest ? 1 : 0;
    }
    return 0;
  });
}

DQ_CAPI_EXPORT int dq_auto_choose(const char* target, const char* topo, int n_workers,
                                  const float* const* rows, size_t d, char* spec_out,
                                  size_t spec_len, double* predicted_vnmse, char* err,
                                  size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    if (!target || !spec_out || spec_len == 0)
      return set_error(err, err_len, Status::kInvalidArgument,
                       "target and spec_out (spec_len > 0) must not be NULL");
    dq::BudgetTarget parsed;
    if (!dq::parse_budget_target(target, &parsed))
      return set_error(err, err_len, Status::kInvalidArgument,
                       std::string("unknown target '") + target + "' (mxfp8, mxfp6, vnmse:X)");
    std::vector<const float*> row_list;
    dq::topo::Schedule schedule;
    if (int rc = load_call(topo, n_workers, rows, d, &row_list, &schedule, err, err_len)) return rc;
    dq::BudgetPrediction prediction;
    std::string why;
    const Status s = dq::sim::predict_auto(row_list, d, schedule, parsed, &prediction, &why);
    if (s != Status::kOk) return set_error(err, err_len, s, why);
    const std::string spec = dq::candidate_spec(prediction.rung);
    if (spec.size() + 1 > spec_len)
      return set_error(err, err_len, Status::kInvalidArgument,
                       "spec_out holds " + std::to_string(spec_len) + " bytes, " +
                           std::to_string(spec.size() + 1) + " needed");
    std::memcpy(spec_out, spec.c_str(), spec.size() + 1);
    if (predicted_vnmse) *predicted_vnmse = prediction.vnmse[prediction.rung];
    return 0;
  });
}
