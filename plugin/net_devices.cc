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

std::vector<NetDevice> select_interfaces(const std::string& ifname_spec,
                                         const std::vector<InterfaceAddress>& addrs) {
  std::vector<NetDevice> found;  // one per interface, in first-seen order
  std::vector<bool> has_ipv4;
  for (const InterfaceAddress& a : addrs) {
    const int family = a.addr.ss_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (family == AF_INET6) {
      const auto* a6 = reinterpret_cast<const sockaddr_in6*>(&a.addr);
      if (IN6_IS_ADDR_LINKLOCAL(&a6->sin6_addr)) continue;
    }
    size_t i = 0;
    while (i < found.size() && found[i].name != a.name) ++i;
    if (i < found.size() && (has_ipv4[i] || family == AF_INET6)) continue;  // keep IPv4 first
    if (i == found.size()) {
      found.emplace_back();
      has_ipv4.push_back(false);
    }
    found[i].name = a.name;
    has_ipv4[i] = family == AF_INET;
    const size_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    std::memset(&found[i].addr, 0, sizeof(found[i].addr));
    std::memcpy(&found[i].addr, &a.addr, len);
    found[i].addr_len = static_cast<socklen_t>(len);
  }
  // An explicit spec is taken as given; without one, the first of NCCL's choices that has an
  // interface (its socket transport's order, in its own NCCL_SOCKET_IFNAME syntax): a libvirt
  // bridge (virbr0, 192.168.122.1 on every such host) is never taken, as a Docker bridge is only
  // when nothing else but loopback is there.
  std::vector<std::string> choices = {ifname_spec};
  if (ifname_spec.empty()) choices = {"ib", "^docker,lo,virbr", "docker", "lo"};
  std::vector<NetDevice> out;
  for (const std::string& spec : choices) {
    for (const NetDevice& d : found) {
      if (ifname_matches(spec, d.name)) out.push_back(d);
    }
    if (!out.empty()) break;
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
  std::vector<InterfaceAddress> addrs;
  for (ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr || (ifa->ifa_flags & IFF_UP) == 0) continue;
    const int family = ifa->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    InterfaceAddress a;
    a.name = ifa->ifa_name;
    std::memcpy(&a.addr, ifa->ifa_addr,
                family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
    addrs.push_back(std::move(a));
  }
  freeifaddrs(list);

  *out = select_interfaces(ifname_spec, addrs);
  for (NetDevice& d : *out) {
    d.speed_mbps = read_speed_mbps(d.name);
    d.pci_path = read_pci_path(d.name);
    d.guid = std::hash<std::string>{}(d.name);
  }
  if (out->empty()) {
    DQ_WARN(Subsys::kNet, "no usable network interface (DYNAMIQ_NET_IFNAME=\"%s\")",
            ifname_spec.c_str());
    return Status::kUnsupported;
  }
  return Status::kOk;
}

}  // namespace dq::net
