#include "shim/engine/metrics.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <mutex>
#include <vector>

#include "common/log.h"
#include "config/settings.h"

namespace dq::engine {
namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<CommMetrics>> comms;
  std::chrono::steady_clock::time_point last_write{};
  std::atomic<int64_t> next_due_ns{0};
  bool warned = false;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: written from atexit paths too
  return *r;
}

std::string expand_path(const std::string& pattern, int rank) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '%' && i + 1 < pattern.size()) {
      if (pattern[i + 1] == 'r') {
        out += std::to_string(rank);
        ++i;
        continue;
      }
      if (pattern[i + 1] == 'p') {
        out += std::to_string(getpid());
        ++i;
        continue;
      }
    }
    out += pattern[i];
  }
  return out;
}

std::string escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) o += c;
  }
  return o;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string render(const std::vector<std::shared_ptr<CommMetrics>>& comms, bool prom) {
  std::string text;
  if (prom) {
    text += "# TYPE dynamiq_calls_total counter\n";
    for (auto& c : comms)
      for (int k = 0; k < kPassReasonCount; ++k)
        text += "dynamiq_calls_total{comm=\"" + std::to_string(c->index) + "\",name=\"" +
                escape(c->name) + "\",rank=\"" + std::to_string(c->rank) + "\",outcome=\"" +
                reason_name(static_cast<PassReason>(k)) + "\"} " +
                std::to_string(c->calls[k].load()) + "\n";
    const char* kGauges[] = {"bytes_in", "wire_bytes", "seconds"};
    for (int g = 0; g < 3; ++g) {
      text += std::string("# TYPE dynamiq_rerouted_") + kGauges[g] + "_total counter\n";
      for (auto& c : comms) {
        char v[64];
        if (g == 0) std::snprintf(v, sizeof v, "%llu", (unsigned long long)c->bytes_in.load());
        if (g == 1) std::snprintf(v, sizeof v, "%llu", (unsigned long long)c->wire_bytes.load());
        if (g == 2) std::snprintf(v, sizeof v, "%.9f", c->nanoseconds.load() * 1e-9);
        text += std::string("dynamiq_rerouted_") + kGauges[g] + "_total{comm=\"" +
                std::to_string(c->index) + "\",rank=\"" + std::to_string(c->rank) + "\"} " + v +
                "\n";
      }
    }
  } else {
    text += "{\"pid\":" + std::to_string(getpid()) + ",\"communicators\":[";
    for (size_t i = 0; i < comms.size(); ++i) {
      auto& c = comms[i];
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "%s{\"index\":%d,\"name\":\"%s\",\"rank\":%d,\"size\":%d,\"bytes_in\":%llu,"
                    "\"wire_bytes\":%llu,\"seconds\":%.9f,\"calls\":{",
                    i ? "," : "", c->index, escape(c->name).c_str(), c->rank, c->size,
                    (unsigned long long)c->bytes_in.load(),
                    (unsigned long long)c->wire_bytes.load(), c->nanoseconds.load() * 1e-9);
      text += buf;
      for (int k = 0; k < kPassReasonCount; ++k)
        text += std::string(k ? "," : "") + "\"" + reason_name(static_cast<PassReason>(k)) +
                "\":" + std::to_string(c->calls[k].load());
      text += "}}";
    }
    text += "]}\n";
  }
  return text;
}

// Caller holds the registry mutex.
void write_locked(Registry& r) {
  const config::Settings& s = config::global();
  if (s.metrics_file.empty()) return;
  const int rank = r.comms.empty() ? 0 : r.comms.front()->rank;
  const std::string path = expand_path(s.metrics_file, rank);
  const bool prom = path.size() >= 5 && path.compare(path.size() - 5, 5, ".prom") == 0;
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    if (!r.warned) DQ_WARN(Subsys::kShim, "dynamiq: cannot write metrics file %s", tmp.c_str());
    r.warned = true;
    return;
  }
  const std::string text = render(r.comms, prom);
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    if (!r.warned) DQ_WARN(Subsys::kShim, "dynamiq: cannot write metrics file %s", path.c_str());
    r.warned = true;
    std::remove(tmp.c_str());
  }
}

}  // namespace

const char* reason_name(PassReason r) {
  switch (r) {
    case PassReason::kRerouted:
      return "rerouted";
    case PassReason::kDisabled:
      return "disabled";
    case PassReason::kNotOptedIn:
      return "not_opted_in";
    case PassReason::kDtype:
      return "dtype";
    case PassReason::kOp:
      return "op";
    case PassReason::kSmall:
      return "small";
    case PassReason::kSingleRank:
      return "single_rank";
    case PassReason::kInGroup:
      return "in_group";
    case PassReason::kCapturing:
      return "graph_capture";
    case PassReason::kOverBudget:
      return "over_budget";
    case PassReason::kSwitchOff:
      return "switch_off";
    case PassReason::kSettingsDiffer:
      return "settings_differ";
    case PassReason::kNoDevice:
      return "no_device";
    case PassReason::kFailure:
      return "failure";
    case PassReason::kCollective:
      return "collective";
    case PassReason::kCount:
      break;
  }
  return "unknown";
}

std::shared_ptr<CommMetrics> metrics_register(int index, const std::string& name, int rank,
                                              int size) {
  auto m = std::make_shared<CommMetrics>();
  m->index = index;
  m->name = name;
  m->rank = rank;
  m->size = size;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.comms.push_back(m);
  return m;
}

void metrics_unregister(const std::shared_ptr<CommMetrics>& m) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  write_locked(r);
  for (size_t i = 0; i < r.comms.size(); ++i)
    if (r.comms[i] == m) {
      r.comms.erase(r.comms.begin() + static_cast<long>(i));
      break;
    }
}

void metrics_tick() {
  Registry& r = registry();
  const int64_t now = now_ns();
  if (now < r.next_due_ns.load(std::memory_order_relaxed)) return;
  const config::Settings& s = config::global();
  if (s.metrics_file.empty()) {
    r.next_due_ns.store(INT64_MAX);
    return;
  }
  std::lock_guard<std::mutex> lock(r.mutex);
  r.next_due_ns.store(now + static_cast<int64_t>(s.metrics_interval_s * 1e9));
  write_locked(r);
}

void metrics_flush() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  write_locked(r);
}

}  // namespace dq::engine
