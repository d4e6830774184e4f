// Discovery of the verbs ports the ibverbs backend offers (one device of the plugin per active,
// selected port with an address), their GPUDirect capabilities, and the backend's init and
// device properties.
#include <endian.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "plugin/ibverbs/ib_internal.h"
#include "plugin/net_devices.h"

namespace dq::net::ib {
namespace {

// Fork support, asked for once per process before any verbs resource exists (ibv_fork_init
// refuses once memory is registered). Jobs fork after NCCL's set-up (PyTorch's DataLoader
// workers, under Linux's default fork start method). On a kernel without RDMA copy-on-fork
// (before 5.13) a registered page the parent writes after a fork is copied for the parent while
// the adapter keeps the old one, now the child's: received bytes no longer reach the parent.
// ibv_fork_init has registered pages left out of forked children instead, as NCCL's own IB
// transport asks. Not asked where the kernel copies registered pages itself. False: asked for
// and refused (*what says why).
bool ask_fork_support(std::string* what) {
  if (verbs().is_fork_initialized != nullptr &&
      verbs().is_fork_initialized() == IBV_FORK_UNNEEDED) {
    *what = "not needed (the kernel copies registered pages at fork)";
    return true;
  }
  if (verbs().fork_init == nullptr) {
    *what = "not available (libibverbs has no ibv_fork_init): do not fork after NCCL's set-up";
    return false;
  }
  const int r = verbs().fork_init();  // 0, or an errno value
  if (r != 0) {
    *what = std::string("ibv_fork_init failed (") + std::strerror(r) +
            "): a process that forks after NCCL's set-up may lose received bytes";
    return false;
  }
  *what = "enabled (registered pages are left out of forked children)";
  return true;
}

// Whether NVIDIA's peer-memory module is loaded (nvidia-peermem, or the older nv_peer_mem):
// then ibv_reg_mr accepts CUDA device pointers. *why: what was looked for.
bool peer_memory_loaded(std::string* why) {
  for (const char* path : {"/sys/kernel/mm/memory_peers/nv_mem/version",
                           "/sys/module/nvidia_peermem/version", "/sys/module/nvidia_peermem"}) {
    if (access(path, F_OK) == 0) {
      *why = std::string("peer memory: ") + path;
      return true;
    }
  }
  *why = "no peer-memory module (nvidia-peermem) loaded";
  return false;
}

// Whether the device takes DMA-BUF registrations: a registration of no fd (-1) fails with
// EOPNOTSUPP / EPROTONOSUPPORT where the device or kernel cannot, with another error (EBADF)
// where it can. *why: the answer's reason.
bool dma_buf_accepted(ibv_pd* pd, std::string* why) {
  if (verbs().reg_dmabuf_mr == nullptr) {
    *why = "libibverbs has no ibv_reg_dmabuf_mr";
    return false;
  }
  errno = 0;
  ibv_mr* mr = verbs().reg_dmabuf_mr(pd, 0, 0, 0, -1, 0);
  if (mr != nullptr) {  // cannot happen with fd -1; undo it if a provider accepts it anyway
    verbs().dereg_mr(mr);
    *why = "DMA-BUF accepted";
    return true;
  }
  const int e = errno;
  if (e == EOPNOTSUPP || e == EPROTONOSUPPORT) {
    *why = std::string("the device refuses DMA-BUF (") + std::strerror(e) + ")";
    return false;
  }
  *why = std::string("DMA-BUF accepted (a probe without a buffer failed with: ") +
         std::strerror(e) + ")";
  return true;
}

// Per-lane rate of enum ibv_port_attr::active_speed, in Mbps.
int lane_mbps(uint8_t speed) {
  switch (speed) {
    case 1:
      return 2500;  // SDR
    case 2:
      return 5000;  // DDR
    case 4:
      return 10000;  // QDR
    case 8:
      return 10000;  // FDR10
    case 16:
      return 14000;  // FDR
    case 32:
      return 25000;  // EDR
    case 64:
      return 50000;  // HDR
    case 128:
      return 100000;  // NDR
    // XDR (256) does not fit this 8-bit field: rdma-core reports it only in active_speed_ex,
    // which this loader does not read, so an XDR port is counted at the default below.
    default:
      return 10000;
  }
}

// Lanes of enum ibv_port_attr::active_width.
int lanes(uint8_t width) {
  switch (width) {
    case 1:
      return 1;
    case 2:
      return 4;
    case 4:
      return 8;
    case 8:
      return 12;
    case 16:
      return 2;
    default:
      return 1;
  }
}

bool ipv4_mapped(const ibv_gid& g) {
  for (int i = 0; i < 10; ++i) {
    if (g.raw[i] != 0) return false;
  }
  return g.raw[10] == 0xff && g.raw[11] == 0xff;
}

bool gid_zero(const ibv_gid& g) {
  for (uint8_t b : g.raw) {
    if (b != 0) return false;
  }
  return true;
}

// The RoCE GID this port uses: `wanted` when >= 0, else the first IPv4-mapped RoCE v2 entry
// (sysfs names each entry's type), else the first IPv4-mapped one of unknown type.
bool pick_roce_gid(ibv_context* ctx, const std::string& dev, int port, int table_len, int wanted,
                   int* index, ibv_gid* gid) {
  if (wanted >= 0) {
    if (wanted >= table_len ||
        verbs().query_gid(ctx, static_cast<uint8_t>(port), wanted, gid) != 0 || gid_zero(*gid)) {
      NET_WARN(
          "%s:%d: GID index %d (DYNAMIQ_NET_IB_GID_INDEX, else NCCL_IB_GID_INDEX) is empty or out "
          "of the table (%d)",
          dev.c_str(), port, wanted, table_len);
      return false;
    }
    *index = wanted;
    return true;
  }
  int fallback = -1;
  ibv_gid fallback_gid{};
  for (int i = 0; i < table_len; ++i) {
    ibv_gid g{};
    if (verbs().query_gid(ctx, static_cast<uint8_t>(port), i, &g) != 0 || !ipv4_mapped(g)) continue;
    std::string type =
        read_first_line("/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port) +
                        "/gid_attrs/types/" + std::to_string(i));
    if (type.find("v2") != std::string::npos) {
      *index = i;
      *gid = g;
      return true;
    }
    if (type.empty() && fallback < 0) {
      fallback = i;
      fallback_gid = g;
    }
  }
  if (fallback < 0) return false;
  *index = fallback;
  *gid = fallback_gid;
  return true;
}

// NCCL_IB_HCA-style filter on "dev" and "dev:port".
bool hca_selected(const std::string& spec, const std::string& dev, int port) {
  if (spec.empty()) return true;
  const std::string with_port = dev + ":" + std::to_string(port);
  const bool exclude = spec[0] == '^';
  if (exclude) return ifname_matches(spec, dev) && ifname_matches(spec, with_port);
  // A port-qualified item must name this port; a bare device name selects every port.
  std::string list = spec[0] == '=' ? spec.substr(1) : spec;
  const bool exact = spec[0] == '=';
  size_t start = 0;
  while (start <= list.size()) {  // bounded by the commas in the spec
    size_t comma = list.find(',', start);
    std::string item = list.substr(start, comma == std::string::npos ? comma : comma - start);
    if (!item.empty()) {
      bool has_port = item.find(':') != std::string::npos;
      const std::string& name = has_port ? with_port : dev;
      if (exact ? name == item : name.compare(0, item.size(), item) == 0) return true;
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return false;
}

// Fills `d` from port `port` of the open device `ctx` (named `name`): false, logged at INFO,
// when the port is not selected, not active, or has no address (LID, or a RoCE GID).
bool describe_port(const NetEnv& env, ibv_device* device, ibv_context* ctx, const std::string& name,
                   int port, const ibv_device_attr& attr, IbDevice* d) {
  if (!hca_selected(env.ib_hca, name, port)) return false;
  ibv_port_attr pa{};
  if (verbs().query_port(ctx, static_cast<uint8_t>(port), &pa) != 0) return false;
  if (pa.state != IBV_PORT_ACTIVE) {
    NET_INFO("verbs port %s:%d is not active (state %d); skipped", name.c_str(), port,
             static_cast<int>(pa.state));
    return false;
  }
  d->name = name;
  d->port = port;
  d->link_layer = pa.link_layer;
  d->lid = pa.lid;
  d->mtu = pa.active_mtu;
  d->max_qp = attr.max_qp;
  if (pa.max_msg_sz > 0) d->max_write = std::min<size_t>(kMaxWriteBytes, pa.max_msg_sz);
  d->speed_mbps = lane_mbps(pa.active_speed) * lanes(pa.active_width);
  d->guid = be64toh(verbs().get_device_guid(device));
  d->traffic_class = static_cast<uint8_t>(env.ib_tc);  // ranges checked by the settings
  d->service_level = static_cast<uint8_t>(env.ib_sl);
  d->ack_timeout = static_cast<uint8_t>(env.ib_timeout);
  d->retry_count = static_cast<uint8_t>(env.ib_retry_cnt);
  char real[PATH_MAX];
  std::string sys = "/sys/class/infiniband/" + name + "/device";
  if (realpath(sys.c_str(), real) != nullptr) d->pci_path = real;
  if (pa.link_layer == IBV_LINK_LAYER_ETHERNET) {
    if (!pick_roce_gid(ctx, name, port, pa.gid_tbl_len, env.ib_gid_index, &d->gid_index, &d->gid)) {
      NET_INFO(
          "verbs port %s:%d (RoCE) has no usable GID (an IPv4 address on its netdev, or "
          "DYNAMIQ_NET_IB_GID_INDEX); skipped",
          name.c_str(), port);
      return false;
    }
  } else if (pa.lid == 0) {
    NET_INFO("verbs port %s:%d (InfiniBand) has no LID yet (subnet manager?); skipped",
             name.c_str(), port);
    return false;
  }
  return true;
}

// What GPUDirect RDMA the device of `d` offers (DYNAMIQ_NET_IB_GDR). The peer-memory module is
// the machine's (`peer_memory`, `peer_why`), DMA-BUF the device's: *dmabuf is -1 until the first
// port of the device probes it (with its protection domain), then 0 or 1 with *dmabuf_why.
void describe_gpudirect(const NetEnv& env, bool peer_memory, const std::string& peer_why,
                        int* dmabuf, std::string* dmabuf_why, IbDevice* d) {
  if (env.ib_gdr == "off") {
    NET_INFO("verbs port %s:%d: host memory only (DYNAMIQ_NET_IB_GDR=off)", d->name.c_str(),
             d->port);
    return;
  }
  if (*dmabuf < 0) *dmabuf = dma_buf_accepted(d->pd, dmabuf_why) ? 1 : 0;
  d->gdr = peer_memory;
  d->dmabuf = *dmabuf == 1;
  d->flush_all = env.ib_gdr == "flush-all";
  NET_INFO("verbs port %s:%d GPUDirect RDMA: GPU memory %s (%s); DMA-BUF %s (%s)%s",
           d->name.c_str(), d->port, d->gdr ? "yes" : "no", peer_why.c_str(),
           d->dmabuf ? "yes" : "no", dmabuf_why->c_str(),
           d->flush_all ? "; every receive flushed (DYNAMIQ_NET_IB_GDR=flush-all)" : "");
}

}  // namespace

Status discover_ib_devices(const NetEnv& env, std::deque<IbDevice>* out, std::string* why) {
  // Loaded once per process; a failure is remembered with its reason.
  static std::string load_error;
  static const bool loaded = load_verbs(&verbs(), &load_error);
  if (!loaded) {
    *why = load_error;
    return Status::kUnsupported;
  }
  // Once per process, before any other verbs call: fork support, then relaxed ordering.
  static const bool prepared = [&] {
    std::string fork_support;
    if (ask_fork_support(&fork_support)) {
      NET_INFO("verbs fork support: %s", fork_support.c_str());
    } else {
      NET_WARN("verbs fork support: %s", fork_support.c_str());
    }
    set_relaxed_ordering(env.ib_relaxed_ordering);
    return true;
  }();
  (void)prepared;
  int n = 0;
  ibv_device** list = verbs().get_device_list(&n);
  if (list == nullptr) {
    *why = std::string("ibv_get_device_list failed: ") + std::strerror(errno);
    return Status::kUnsupported;
  }
  std::string peer_why;
  const bool peer_memory = env.ib_gdr != "off" && peer_memory_loaded(&peer_why);
  for (int i = 0; i < n; ++i) {
    const std::string name = verbs().get_device_name(list[i]);
    ibv_context* ctx = verbs().open_device(list[i]);
    if (ctx == nullptr) {
      NET_INFO("verbs device %s: cannot open (%s); skipped", name.c_str(), std::strerror(errno));
      continue;
    }
    ibv_device_attr attr{};
    if (verbs().query_device(ctx, &attr) != 0) {
      NET_INFO("verbs device %s: query_device failed; skipped", name.c_str());
      verbs().close_device(ctx);
      continue;
    }
    ibv_pd* pd = nullptr;
    int dmabuf = -1;
    std::string dmabuf_why;
    const size_t first = out->size();
    for (int port = 1; port <= attr.phys_port_cnt; ++port) {
      IbDevice d;
      if (!describe_port(env, list[i], ctx, name, port, attr, &d)) continue;
      if (pd == nullptr) pd = verbs().alloc_pd(ctx);
      if (pd == nullptr) {
        NET_INFO("verbs device %s: cannot allocate a protection domain; skipped", name.c_str());
        break;
      }
      d.ctx = ctx;
      d.pd = pd;
      describe_gpudirect(env, peer_memory, peer_why, &dmabuf, &dmabuf_why, &d);
      out->push_back(d);
    }
    if (out->size() == first) {  // no port of this device is used: release it
      if (pd != nullptr) verbs().dealloc_pd(pd);
      verbs().close_device(ctx);
    }
  }
  verbs().free_device_list(list);
  if (out->empty()) {
    *why = n == 0 ? "no verbs device" : "no active, selected verbs port with an address";
    return Status::kUnsupported;
  }
  return Status::kOk;
}

Status IbNet::init() {
  std::lock_guard<std::mutex> lock(init_mu_);
  // A forked child (the multirank tests, launchers that fork workers) must not use its
  // parent's verbs contexts: it discovers the devices again (the parent's stay with it).
  if (init_pid_ == getpid()) return init_status_;
  init_pid_ = getpid();
  devices_.clear();
  why_.clear();
  NetEnv env = read_net_env();
  init_status_ = discover_ib_devices(env, &devices_, &why_);
  if (init_status_ != Status::kOk) return init_status_;
  for (size_t i = 0; i < devices_.size(); ++i) {
    const IbDevice& d = devices_[i];
    NET_INFO("verbs device %zu: %s:%d %s, %d Mbps, GID index %d, LID %u", i, d.name.c_str(), d.port,
             d.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "InfiniBand", d.speed_mbps,
             d.gid_index, d.lid);
  }
  return init_status_;
}

void IbNet::use_device_for_testing(const IbDevice& d) {
  std::lock_guard<std::mutex> lock(init_mu_);
  init_pid_ = getpid();
  init_status_ = Status::kOk;
  why_.clear();
  devices_.assign(1, d);
}

Status IbNet::devices(int* ndev) {
  DQ_CHECK(init());
  *ndev = static_cast<int>(devices_.size());
  return Status::kOk;
}

Status IbNet::get_properties(int dev, dqNetPropertiesV11* props) {
  DQ_CHECK(check_dev(dev));
  const IbDevice& d = devices_[static_cast<size_t>(dev)];
  fill_common_properties(dev, d.name, d.pci_path, d.guid, d.speed_mbps, props);
  props->ptrSupport =
      NCCL_PTR_HOST | (d.gdr ? NCCL_PTR_CUDA : 0) | (d.dmabuf ? NCCL_PTR_DMABUF : 0);
  props->forceFlush = d.flush_all ? 1 : 0;
  props->port = d.port;
  props->maxComms = d.max_qp;
  return Status::kOk;
}

Status IbNet::check_dev(int dev) {
  DQ_CHECK(init());
  return check_device_index("verbs device", dev, devices_.size());
}

}  // namespace dq::net::ib
