// Network devices the plugin offers: one per selected interface, with the address we listen on.
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace dq::net {

struct NetDevice {
  std::string name;         // interface name, e.g. "eth0"
  std::string pci_path;     // realpath of /sys/class/net/<name>/device, empty if virtual
  sockaddr_storage addr{};  // the address we bind to (port 0)
  socklen_t addr_len = 0;
  int speed_mbps = 10000;  // from sysfs; 10000 when unknown
  uint64_t guid = 0;       // stable per interface name
};

// Enumerates up interfaces matching `ifname_spec` (NCCL_SOCKET_IFNAME syntax). Loopback is
// used only when the spec selects it or when no other interface exists. IPv4 is preferred
// per interface; IPv6 link-local addresses are skipped.
Status discover_devices(const std::string& ifname_spec, std::vector<NetDevice>* out);

// "a.b.c.d<port>" / "[v6]<port>" for logs.
std::string addr_to_string(const sockaddr* addr);

// The first line of a (sysfs) file, without its newline; empty if it cannot be read.
std::string read_first_line(const std::string& path);

// The first active verbs port the kernel lists ("dev:port"), from sysfs alone (libibverbs is not
// loaded for it); empty if none. At most 64 devices and 4 ports each are looked at.
std::string first_active_verbs_port();

}  // namespace dq::net
