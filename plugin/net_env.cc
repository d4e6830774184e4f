#include "plugin/net_env.h"

#include <string_view>
#include <vector>

#include "config/settings.h"

namespace dq::net {

NetEnv read_net_env() {
  const config::Settings s = config::current();
  NetEnv env;
  env.ifname = s.net_ifname;
  env.nsocks = static_cast<int>(s.net_nsocks);
  env.timeout_ms = s.net_timeout_ms;
  env.backend = s.net_backend;
  env.ib_disable = s.net_ib_disable;
  env.ib_hca = s.net_ib_hca;
  env.ib_gid_index = std::stoi(s.net_ib_gid_index);  // validated: -1 or 0..255
  env.ib_gdr = s.net_ib_gdr;
  env.ib_qps = static_cast<int>(s.net_ib_qps);
  env.ib_tc = static_cast<int>(s.net_ib_tc);
  env.ib_sl = static_cast<int>(s.net_ib_sl);
  env.ib_timeout = static_cast<int>(s.net_ib_timeout);
  env.ib_retry_cnt = static_cast<int>(s.net_ib_retry_cnt);
  env.ib_relaxed_ordering = static_cast<int>(s.net_ib_pci_relaxed_ordering);
  return env;
}

bool ifname_matches(const std::string& spec, const std::string& name) {
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
