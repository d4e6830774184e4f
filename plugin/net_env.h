// Environment knobs of the net plugin (all optional):
//   DYNAMIQ_NET_IFNAME     interfaces to use, NCCL_SOCKET_IFNAME syntax: comma-separated name
//                          prefixes; a leading '^' excludes, a leading '=' asks for exact names.
//                          Unset: NCCL_SOCKET_IFNAME if set, else every up, non-loopback
//                          interface (loopback only when there is no other).
//   DYNAMIQ_NET_NSOCKS     TCP sockets per connection, 1..8 (default 2).
//   DYNAMIQ_NET_TIMEOUT_MS bound on every wait on a peer: connect/handshake, and a transfer that
//                          stops making progress mid-message (default 30000 ms).
//   DYNAMIQ_NET_BACKEND    transport behind the tables: "socket" (default; the only one so far).
#pragma once

#include <cstdint>
#include <string>

namespace dq::net {

struct NetEnv {
  std::string ifname;          // DYNAMIQ_NET_IFNAME, empty when unset
  int nsocks = 2;              // DYNAMIQ_NET_NSOCKS
  int64_t timeout_ms = 30000;  // DYNAMIQ_NET_TIMEOUT_MS
  std::string backend = "socket";
};

// Reads the environment on every call (tests change it between calls).
NetEnv ReadNetEnv();

// NCCL_SOCKET_IFNAME-style matching of one interface name against a spec ("" matches all).
bool IfnameMatches(const std::string& spec, const std::string& name);

}  // namespace dq::net
