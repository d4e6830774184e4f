#include "plugin/net_devices.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>

#include "plugin/net_env.h"

namespace dq::net {
namespace {

int read_speed_mbps(const std::string& ifname) {
  std::string path = "/sys/class/net/" + ifname + "/speed";
  FILE* f = std::fopen(path.c_str(), "r");
  int speed = -1;
  if (f != nullptr) {
    if (std::fscanf(f, "%d", &speed) != 1) speed = -1;
    std::fclose(f);
  }
  return speed > 0 ? speed : 10000;  // virtual NICs and loopback report nothing useful
}

std::string read_pci_path(const std::string& ifname) {
  std::string link = "/sys/class/net/" + ifname + "/device";
  char resolved[PATH_MAX];
  if (realpath(link.c_str(), resolved) == nullptr) return {};
  return resolved;
}

struct Candidate {
  NetDevice dev;
  bool loopback = false;
  bool ipv4 = false;
};

}  // namespace

std::string read_first_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (f) std::getline(f, s);
  return s;
}

std::string first_active_verbs_port() {
  DIR* d = opendir("/sys/class/infiniband");
  if (d == nullptr) return "";
  std::string found;
  int devices = 0;
  while (found.empty() && devices++ < 64) {
    const dirent* e = readdir(d);
    if (e == nullptr) break;
    if (e->d_name[0] == '.') continue;
    for (int port = 1; port <= 4 && found.empty(); ++port) {
      const std::string state = read_first_line(std::string("/sys/class/infiniband/") + e->d_name +
                                                "/ports/" + std::to_string(port) + "/state");
      if (state.find("ACTIVE") != std::string::npos)
        found = std::string(e->d_name) + ":" + std::to_string(port);
    }
  }
  closedir(d);
  return found;
}

std::string addr_to_string(const sockaddr* addr) {
  char host[INET6_ADDRSTRLEN] = "?";
  char out[INET6_ADDRSTRLEN + 16];
  if (addr->sa_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(addr);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    std::snprintf(out, sizeof(out), "%s<%d>", host, ntohs(a->sin_port));
  } else if (addr->sa_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(addr);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    std::snprintf(out, sizeof(out), "[%s]<%d>", host, ntohs(a->sin6_port));
  } else {
    std::snprintf(out, sizeof(out), "<family %d>", addr->sa_family);
  }
  return out;
}

Status discover_devices(const std::string& ifname_spec, std::vector<NetDevice>* out) {
  out->clear();
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    DQ_WARN(Subsys::kNet, "getifaddrs failed: %s", std::strerror(errno));
    return Status::kSystemError;
  }
  std::vector<Candidate> cands;  // one per interface, in first-seen order
  for (ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr || (ifa->ifa_flags & IFF_UP) == 0) continue;
    int family = ifa->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (family == AF_INET6) {
      const auto* a6 = reinterpret_cast<const sockaddr_in6*>(ifa->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&a6->sin6_addr)) continue;
    }
    std::string name = ifa->ifa_name;
    if (!ifname_matches(ifname_spec, name)) continue;
    Candidate* slot = nullptr;
    for (auto& c : cands) {
      if (c.dev.name == name) slot = &c;
    }
    if (slot != nullptr && (slot->ipv4 || family == AF_INET6)) continue;  // keep IPv4 first
    if (slot == nullptr) {
      cands.emplace_back();
      slot = &cands.back();
    }
    slot->dev.name = name;
    slot->loopback = (ifa->ifa_flags & IFF_LOOPBACK) != 0;
    slot->ipv4 = family == AF_INET;
    size_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    std::memset(&slot->dev.addr, 0, sizeof(slot->dev.addr));
    std::memcpy(&slot->dev.addr, ifa->ifa_addr, len);
    slot->dev.addr_len = static_cast<socklen_t>(len);
  }
  freeifaddrs(list);

  bool spec_given = !ifname_spec.empty();
  bool have_non_loopback = false;
  for (const auto& c : cands) have_non_loopback |= !c.loopback;
  for (auto& c : cands) {
    // Loopback only when asked for by name or when it is all there is.
    if (c.loopback && !spec_given && have_non_loopback) continue;
    c.dev.speed_mbps = read_speed_mbps(c.dev.name);
    c.dev.pci_path = read_pci_path(c.dev.name);
    c.dev.guid = std::hash<std::string>{}(c.dev.name);
    out->push_back(c.dev);
  }
  if (out->empty()) {
    DQ_WARN(Subsys::kNet, "no usable network interface (DYNAMIQ_NET_IFNAME=\"%s\")",
            ifname_spec.c_str());
    return Status::kUnsupported;
  }
  return Status::kOk;
}

}  // namespace dq::net
