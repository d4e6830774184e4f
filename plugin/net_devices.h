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

// One address of an up interface, as getifaddrs lists it (IPv4 or IPv6 in ss_family).
struct InterfaceAddress {
  std::string name;
  sockaddr_storage addr{};
};

// The interfaces to use among `addrs`, in first-seen order, each with one address: IPv4 where
// it has one; IPv6 link-local addresses are skipped. With `ifname_spec` (NCCL_SOCKET_IFNAME
// syntax) every interface it matches. Without, NCCL's own default: the interfaces named ib*;
// where there is none, all but docker* and lo*; else docker*; else lo*. A Docker bridge has the
// same address on every host, so a peer given it connects to its own bridge.
std::vector<NetDevice> select_interfaces(const std::string& ifname_spec,
                                         const std::vector<InterfaceAddress>& addrs);

// The up interfaces select_interfaces() picks, with their speed, PCI path and GUID.
Status discover_devices(const std::string& ifname_spec, std::vector<NetDevice>* out);

// "a.b.c.d<port>" / "[v6]<port>" for logs.
std::string addr_to_string(const sockaddr* addr);

// The first line of a (sysfs) file, without its newline; empty if it cannot be read.
std::string read_first_line(const std::string& path);

// The first active verbs port the kernel lists ("dev:port"), from sysfs alone (libibverbs is not
// loaded for it); empty if none. At most 64 devices and 4 ports each are looked at.
std::string first_active_verbs_port();

}  // namespace dq::net
