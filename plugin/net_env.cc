#include "plugin/net_env.h"

#include <cstdlib>
#include <string_view>
#include <vector>

#include "common/log.h"

namespace dq::net {
namespace {

int64_t EnvInt(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long long parsed = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || parsed < lo || parsed > hi) {
    DQ_WARN(Subsys::kEnv, "%s=%s is not an integer in [%lld, %lld]; using %lld", name, v,
            static_cast<long long>(lo), static_cast<long long>(hi),
            static_cast<long long>(fallback));
    return fallback;
  }
  return parsed;
}

}  // namespace

NetEnv ReadNetEnv() {
  NetEnv env;
  if (const char* v = std::getenv("DYNAMIQ_NET_IFNAME")) {
    env.ifname = v;
  } else if (const char* nccl = std::getenv("NCCL_SOCKET_IFNAME")) {
    env.ifname = nccl;  // what an NCCL user already set for NCCL's own socket transport
  }
  env.nsocks = static_cast<int>(EnvInt("DYNAMIQ_NET_NSOCKS", 2, 1, 8));
  // DYNAMIQ_TIMEOUT_MS (the shim's one bound on every wait) applies unless the plugin has its own.
  env.timeout_ms = EnvInt("DYNAMIQ_NET_TIMEOUT_MS",
                          EnvInt("DYNAMIQ_TIMEOUT_MS", 30000, 10, 24LL * 3600 * 1000), 10,
                          24LL * 3600 * 1000);
  if (const char* v = std::getenv("DYNAMIQ_NET_BACKEND"); v != nullptr && *v != '\0') {
    env.backend = v;
  }
  return env;
}

bool IfnameMatches(const std::string& spec, const std::string& name) {
  if (spec.empty()) return true;
  std::string_view list = spec;
  bool exclude = false;
  bool exact = false;
  if (!list.empty() && list.front() == '^') {
    exclude = true;
    list.remove_prefix(1);
  }
  if (!list.empty() && list.front() == '=') {
    exact = true;
    list.remove_prefix(1);
  }
  bool hit = false;
  // Bounded by the number of commas in the spec.
  while (!list.empty()) {
    size_t comma = list.find(',');
    std::string_view item = list.substr(0, comma);
    if (!item.empty()) {
      if (exact ? (name == item) : (std::string_view(name).substr(0, item.size()) == item)) {
        hit = true;
        break;
      }
    }
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return exclude ? !hit : hit;
}

}  // namespace dq::net
