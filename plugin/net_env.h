// The net plugin's settings, entries of the settings table (config/settings.def:
// DYNAMIQ_NET_IFNAME, DYNAMIQ_NET_NSOCKS, DYNAMIQ_NET_TIMEOUT_MS, DYNAMIQ_NET_BACKEND,
// DYNAMIQ_NET_IB_HCA, DYNAMIQ_NET_IB_GID_INDEX, DYNAMIQ_NET_IB_GDR, DYNAMIQ_NET_IB_QPS, with
// DYNAMIQ_TIMEOUT_MS and NCCL_SOCKET_IFNAME as their fallbacks), parsed and validated there; an
// invalid value is warned about once per process and leaves that setting at its default.
#pragma once

#include <cstdint>
#include <string>

namespace dq::net {

// Filled by read_net_env(); the defaults are the table's.
struct NetEnv {
  std::string ifname;      // DYNAMIQ_NET_IFNAME, else NCCL_SOCKET_IFNAME; empty: the default choice
  int nsocks = 0;          // DYNAMIQ_NET_NSOCKS
  int64_t timeout_ms = 0;  // DYNAMIQ_NET_TIMEOUT_MS, else DYNAMIQ_TIMEOUT_MS
  std::string backend;     // DYNAMIQ_NET_BACKEND: socket, ib or auto
  bool ib_disable = false;  // DYNAMIQ_NET_IB_DISABLE (or NCCL_IB_DISABLE): auto never picks ib
  std::string ib_hca;       // DYNAMIQ_NET_IB_HCA; empty: every active verbs port
  int ib_gid_index = -1;    // DYNAMIQ_NET_IB_GID_INDEX; -1: the first IPv4-mapped RoCE v2 GID
  std::string ib_gdr;       // DYNAMIQ_NET_IB_GDR: auto, off or flush-all
  int ib_qps = 1;           // DYNAMIQ_NET_IB_QPS: queue pairs per verbs connection, 1..8
  // The queue pairs' attributes (DYNAMIQ_NET_IB_TC, _SL, _TIMEOUT, _RETRY_CNT, or NCCL's
  // NCCL_IB_* of the same names): traffic class, service level, acknowledgement timeout
  // exponent (4.096 us x 2^value), retries.
  int ib_tc = 0;
  int ib_sl = 0;
  int ib_timeout = 18;
  int ib_retry_cnt = 7;
  int ib_relaxed_ordering = 2;  // DYNAMIQ_NET_IB_PCI_RELAXED_ORDERING: 0 off, 1 on, 2 auto
};

// The values the environment gives now (config::current(): parsed again only when a variable
// changed since the last call; tests change them between calls).
NetEnv read_net_env();

// NCCL_SOCKET_IFNAME-style matching of one interface name against a spec ("" matches all).
bool ifname_matches(const std::string& spec, const std::string& name);

}  // namespace dq::net
