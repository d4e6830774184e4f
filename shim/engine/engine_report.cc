// What the engine tells an operator about its communicator: one decision line after the handshake
// (compressed with what, or pass-through with the one reason), each per-call pass-through reason
// once, and one warning when an opted-in communicator compresses none of its first calls for
// their size or type (docs/ENGINE.md section 2).
#include <cstdio>

#include "kernels/codec.h"
#include "shim/engine/engine_hierarchy.h"
#include "shim/engine/engine_internal.h"

namespace dq::engine {
namespace {

// Calls after the handshake watched for the warning: an opted-in communicator whose first this
// many calls all pass through for their size or type compresses nothing a job will notice.
constexpr int kQuietCalls = 16;

// "16 MiB", "1 GiB", "4000 B": a byte count as the settings are usually written.
std::string bytes_text(uint64_t b) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  double v = static_cast<double>(b);
  while (v >= 1024 && u < 4 && b % (1ull << (10 * (u + 1))) == 0) v /= 1024, ++u;
  char out[48];
  std::snprintf(out, sizeof out, "%.0f %s", v, kUnits[u]);
  return out;
}

const char* dtype_text(ncclDataType_t t) {
  static const char* kNames[] = {"int8",    "uint8",    "int32",      "uint32",
                                 "int64",   "uint64",   "float16",    "float32",
                                 "float64", "bfloat16", "float8e4m3", "float8e5m2"};
  const int i = static_cast<int>(t);
  return i >= 0 && i < 12 ? kNames[i] : "an unknown type";
}

}  // namespace

void Engine::describe_comm(std::string label, std::string opt_in) {
  label_ = std::move(label);
  opt_in_why_ = std::move(opt_in);
}

void Engine::block_locally(std::string why) {
  local_block_ = std::move(why);
  settings_valid_ = false;
}

std::string Engine::compressed_text() const {
  std::string codec = settings_.codec == "dynamiq" || settings_.codec == "uniform"
                          ? settings_.codec + " at " +
                                (settings_.bits_auto ? "auto bits (target " + settings_.target + ")"
                                                     : settings_.bits + " bits per value")
                          : settings_.codec;
  // Two-level: the compressed stage's schedule runs over the nodes, one rail per local rank.
  const std::string topology =
      hierarchy_ ? std::string(topo::kind_name(
                       choose_topology(settings_.topology, hierarchy_->map.nodes))) +
                       " over " + std::to_string(hierarchy_->map.nodes) + " nodes (two-level, " +
                       std::to_string(hierarchy_->map.local_size) + " ranks per node)"
                 : std::string(topo::kind_name(kind_));
  return "compressed: codec " + codec + ", topology " + topology + ", blocks of " +
         bytes_text(static_cast<uint64_t>(settings_.block_bytes)) + ", calls of at least " +
         bytes_text(static_cast<uint64_t>(settings_.min_bytes)) + " of " + settings_.dtypes +
         " by " + settings_.collectives + ", the host up to " +
         std::to_string(settings_.control_window) + " calls ahead of the device (" + opt_in_why_ +
         ")";
}

void Engine::log_decision(const ControlDecision& d) const {
  if (!log_enabled(LogLevel::kInfo, Subsys::kEngine)) return;
  std::string what;
  if (!d.agreed) {
    what = "pass-through: ranks disagree on " + d.differs + " (give every rank the same settings)";
  } else if (!d.all_valid) {
    what = local_block_.empty()
               ? "pass-through: a rank's DYNAMIQ_* settings are invalid or its NCCL is not "
                 "supported (see that rank's WARN lines)"
               : "pass-through: " + local_block_;
  } else if (!d.settings_enabled) {
    what = "pass-through: disabled (DYNAMIQ_ENABLE=0)";
  } else if (!d.enabled) {
    what = "pass-through: not opted in (" + opt_in_why_ + ")";
  } else if (!d.switch_on) {
    what = "pass-through: the A/B switch (DYNAMIQ_CONTROL_FILE " + settings_.control_file +
           ") is off; calls compress from DYNAMIQ_CONTROL_WINDOW = " +
           std::to_string(settings_.control_window) + " eligible calls after it is switched on";
  } else {
    what = compressed_text();
  }
  DQ_INFO(Subsys::kEngine, "dynamiq: communicator %s: %s", label_.c_str(), what.c_str());
}

void Engine::log_decision_without_handshake(const std::string& why) const {
  DQ_INFO(Subsys::kEngine, "dynamiq: communicator %s: pass-through: %s", label_.c_str(),
          why.c_str());
}

std::string Engine::call_reason_text(PassReason reason, const CallArgs& call) const {
  const uint64_t esize = call.dtype == ncclBfloat16 ? 2 : 4;
  switch (reason) {
    case PassReason::kDtype:
      return std::string("element type ") + dtype_text(call.dtype) +
             " is not one DYNAMIQ_DTYPES allows (" + settings_.dtypes + ")";
    case PassReason::kOp:
      return "reduction " + std::to_string(static_cast<int>(call.op)) +
             " is not a sum or an average";
    case PassReason::kSmall:
      return std::to_string(call.count * esize) + " bytes, below DYNAMIQ_MIN_BYTES = " +
             bytes_text(static_cast<uint64_t>(settings_.min_bytes));
    case PassReason::kCollective:
      return std::string(collective_name(call.collective)) + " is not in DYNAMIQ_COLLECTIVES (" +
             settings_.collectives + ") or its root is not a rank";
    case PassReason::kInGroup:
      return "inside the caller's ncclGroupStart/End with members on other communicators, or "
             "before the communicator's handshake";
    case PassReason::kCapturing:
      return "during CUDA graph capture";
    case PassReason::kOverBudget:
      return "too few elements for the budget";
    case PassReason::kSwitchOff:
      return "the A/B switch (DYNAMIQ_CONTROL_FILE) is off";
    case PassReason::kFailure:
      return "a rank could not run the compressed path (see the WARN lines)";
    case PassReason::kCanaryFailed:
      return "the device's canary differed from the host codec (see the WARN lines)";
    case PassReason::kLarge:
      return std::to_string(call.count) + " elements, more than the " +
             std::to_string(kMaxElementIndex) + " the codec's rounding keys index";
    default:
      return "";  // communicator-wide reasons: the decision line says them
  }
}

void Engine::note_outcome(PassReason reason, const CallArgs& call) {
  if (state_ != State::kAgreed) return;  // the decision line covers a communicator that is off
  if (!quiet_done_) {
    if (reason == PassReason::kSmall || reason == PassReason::kDtype) {
      ++(reason == PassReason::kSmall ? quiet_small_ : quiet_dtype_);
      if (++quiet_seen_ == kQuietCalls && opted_in_) {
        quiet_done_ = true;
        DQ_WARN(Subsys::kEngine,
                "dynamiq: communicator %s is opted in, but its first %d calls all passed through "
                "(%d below DYNAMIQ_MIN_BYTES = %s, %d of a type DYNAMIQ_DTYPES = %s excludes): "
                "nothing of them was compressed",
                label_.c_str(), kQuietCalls, quiet_small_,
                bytes_text(static_cast<uint64_t>(settings_.min_bytes)).c_str(), quiet_dtype_,
                settings_.dtypes.c_str());
      }
    } else {
      quiet_done_ = true;  // a compressed call, or another reason: not a size or type problem
    }
  }
  const uint32_t bit = 1u << static_cast<int>(reason);
  if (reason == PassReason::kRerouted || (noted_reasons_ & bit) != 0) return;
  noted_reasons_ |= bit;
  const std::string why = call_reason_text(reason, call);
  if (!why.empty())
    DQ_INFO(Subsys::kEngine,
            "dynamiq: communicator %s: a call (%s, %zu elements) passed through: %s (the first; "
            "each is counted as outcome=\"%s\" in the metrics)",
            label_.c_str(), collective_name(call.collective), call.count, why.c_str(),
            reason_name(reason));
}

}  // namespace dq::engine
