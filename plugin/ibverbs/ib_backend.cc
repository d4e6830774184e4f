// ibverbs backend of the net plugin: RC queue pairs, the receiver posting its buffers into a
// remote-writable FIFO on the sender, the sender writing with RDMA WRITE (+ immediate). Wire
// formats and the protocol: ib_wire.h. libibverbs is dlopen'ed (libibverbs.so.1), so the plugin
// loads on machines without it; the types come from <infiniband/verbs.h>.
#include <dlfcn.h>
#include <endian.h>
#include <infiniband/verbs.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "plugin/ibverbs/ib_wire.h"
#include "plugin/net_backend.h"
#include "plugin/net_env.h"
#include "plugin/net_log.h"
#include "plugin/socket/socket_io.h"

namespace dq::net {
namespace {

using Clock = std::chrono::steady_clock;
using ibwire::Ctl;
using ibwire::FifoSlot;
using ibwire::kFifoDepth;

constexpr uint32_t kListenMagic = 0x4c494e44;
constexpr uint32_t kSendMagic = 0x53494e44;
constexpr uint32_t kRecvMagic = 0x52494e44;
constexpr uint32_t kSendReqMagic = 0x73494e44;
constexpr uint32_t kRecvReqMagic = 0x72494e44;
constexpr uint32_t kMrMagic = 0x6d494e44;
constexpr uint32_t kFlushReqMagic = 0x66494e44;
constexpr size_t kMaxSendsPerComm = 1024;                // isend returns a NULL request beyond this
constexpr int kSqDepth = 512;                            // send work requests per QP
constexpr int kRqDepth = kFifoDepth * kMaxGroupedRecvs;  // one per grouped receive in flight
// Completions per QP of a connection: its sends and, on a receiver, its pool of receives.
constexpr int kCqDepthPerQp = kSqDepth + kRqDepth;
constexpr size_t kMaxWriteBytes = 1u << 30;  // one RDMA WRITE at most (and the port's max_msg_sz)
constexpr size_t kMinChunkBytes = 1u << 20;  // RDMA WRITE size below which a message is one write
constexpr uint64_t kWrFifo = 1;              // wr_id of the receiver's FIFO writes
constexpr uint64_t kWrRecv = 2;              // wr_id of receive work requests
constexpr int kSideTag = 0;                  // tag of every side-channel message
constexpr uint8_t kRnrTimer = 12;            // 0.64 ms (IB spec table)
// Local ACK timeout 4.096 us * 2^18 = 1.07 s, 7 retries: a peer QP that is not yet ready to
// receive (still finishing its connect) gets about 7 s before the transfer fails.
constexpr uint8_t kAckTimeout = 18;
constexpr uint8_t kRetryCount = 7;
constexpr uint8_t kRnrRetry = 7;  // 7 = retry forever (receives are always posted first anyway)

int64_t ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// ---------------------------------------------------------------- libibverbs, loaded at run time

struct Verbs {
  void* lib = nullptr;
  ibv_device** (*get_device_list)(int*) = nullptr;
  void (*free_device_list)(ibv_device**) = nullptr;
  const char* (*get_device_name)(ibv_device*) = nullptr;
  __be64 (*get_device_guid)(ibv_device*) = nullptr;
  ibv_context* (*open_device)(ibv_device*) = nullptr;
  int (*close_device)(ibv_context*) = nullptr;
  int (*query_device)(ibv_context*, ibv_device_attr*) = nullptr;
  int (*query_port)(ibv_context*, uint8_t, ibv_port_attr*) = nullptr;
  int (*query_gid)(ibv_context*, uint8_t, int, ibv_gid*) = nullptr;
  ibv_pd* (*alloc_pd)(ibv_context*) = nullptr;
  int (*dealloc_pd)(ibv_pd*) = nullptr;
  ibv_mr* (*reg_mr)(ibv_pd*, void*, size_t, int) = nullptr;
  int (*dereg_mr)(ibv_mr*) = nullptr;
  ibv_cq* (*create_cq)(ibv_context*, int, void*, ibv_comp_channel*, int) = nullptr;
  int (*destroy_cq)(ibv_cq*) = nullptr;
  ibv_qp* (*create_qp)(ibv_pd*, ibv_qp_init_attr*) = nullptr;
  int (*destroy_qp)(ibv_qp*) = nullptr;
  int (*modify_qp)(ibv_qp*, ibv_qp_attr*, int) = nullptr;
  const char* (*wc_status_str)(ibv_wc_status) = nullptr;
  // Optional (rdma-core 34 and later): device memory exported as a DMA-BUF.
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd*, uint64_t offset, size_t length, uint64_t iova, int fd,
                           int access) = nullptr;
};

template <typename Fn>
bool load_sym(void* lib, const char* name, Fn* out, std::string* why) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*out == nullptr) *why = std::string("libibverbs.so.1 lacks ") + name;
  return *out != nullptr;
}

bool load_verbs(Verbs* v, std::string* why) {
  v->lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
  if (v->lib == nullptr) {
    const char* e = dlerror();
    *why = std::string("cannot load libibverbs.so.1: ") + (e != nullptr ? e : "unknown error");
    return false;
  }
  const bool required =
      load_sym(v->lib, "ibv_get_device_list", &v->get_device_list, why) &&
      load_sym(v->lib, "ibv_free_device_list", &v->free_device_list, why) &&
      load_sym(v->lib, "ibv_get_device_name", &v->get_device_name, why) &&
      load_sym(v->lib, "ibv_get_device_guid", &v->get_device_guid, why) &&
      load_sym(v->lib, "ibv_open_device", &v->open_device, why) &&
      load_sym(v->lib, "ibv_close_device", &v->close_device, why) &&
      load_sym(v->lib, "ibv_query_device", &v->query_device, why) &&
      load_sym(v->lib, "ibv_query_port", &v->query_port, why) &&
      load_sym(v->lib, "ibv_query_gid", &v->query_gid, why) &&
      load_sym(v->lib, "ibv_alloc_pd", &v->alloc_pd, why) &&
      load_sym(v->lib, "ibv_dealloc_pd", &v->dealloc_pd, why) &&
      load_sym(v->lib, "ibv_reg_mr", &v->reg_mr, why) &&
      load_sym(v->lib, "ibv_dereg_mr", &v->dereg_mr, why) &&
      load_sym(v->lib, "ibv_create_cq", &v->create_cq, why) &&
      load_sym(v->lib, "ibv_destroy_cq", &v->destroy_cq, why) &&
      load_sym(v->lib, "ibv_create_qp", &v->create_qp, why) &&
      load_sym(v->lib, "ibv_destroy_qp", &v->destroy_qp, why) &&
      load_sym(v->lib, "ibv_modify_qp", &v->modify_qp, why) &&
      load_sym(v->lib, "ibv_wc_status_str", &v->wc_status_str, why);
  if (!required) return false;
  // Optional: absent from older libibverbs (then no DMA-BUF).
  v->reg_dmabuf_mr =
      reinterpret_cast<decltype(v->reg_dmabuf_mr)>(dlsym(v->lib, "ibv_reg_dmabuf_mr"));
  return true;
}

Verbs& V() {
  static Verbs* v = new Verbs;  // never destroyed: comms may outlive statics
  return *v;
}

// ---------------------------------------------------------------- devices

struct IbDevice {
  std::string name;      // verbs device, e.g. "mlx5_0" or "rxe0"
  std::string pci_path;  // realpath of /sys/class/infiniband/<name>/device; empty if virtual
  uint64_t guid = 0;     // node GUID (host order)
  int port = 1;
  int speed_mbps = 0;
  uint8_t link_layer = IBV_LINK_LAYER_INFINIBAND;
  int gid_index = 0;
  ibv_gid gid{};
  uint16_t lid = 0;
  ibv_mtu mtu = IBV_MTU_1024;
  int max_qp = 0;
  size_t max_write = kMaxWriteBytes;
  ibv_context* ctx = nullptr;  // shared by the ports of one device, kept open
  ibv_pd* pd = nullptr;        // one per verbs device, shared by every comm on it
  // GPUDirect RDMA (DYNAMIQ_NET_IB_GDR): GPU memory registered through the peer-memory module;
  // DMA-BUF registration accepted by the device; every receive flushed (flush-all).
  bool gdr = false;
  bool dmabuf = false;
  bool flush_all = false;
};

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
  if (V().reg_dmabuf_mr == nullptr) {
    *why = "libibverbs has no ibv_reg_dmabuf_mr";
    return false;
  }
  errno = 0;
  ibv_mr* mr = V().reg_dmabuf_mr(pd, 0, 0, 0, -1, 0);
  if (mr != nullptr) {  // cannot happen with fd -1; undo it if a provider accepts it anyway
    V().dereg_mr(mr);
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
      return 200000;  // XDR
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

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (f) std::getline(f, s);
  return s;
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
    if (wanted >= table_len || V().query_gid(ctx, static_cast<uint8_t>(port), wanted, gid) != 0 ||
        gid_zero(*gid)) {
      NET_WARN("%s:%d: GID index %d (DYNAMIQ_NET_IB_GID_INDEX) is empty or out of the table (%d)",
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
    if (V().query_gid(ctx, static_cast<uint8_t>(port), i, &g) != 0 || !ipv4_mapped(g)) continue;
    std::string type = read_line("/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port) +
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

Status discover_ib_devices(const NetEnv& env, std::deque<IbDevice>* out, std::string* why) {
  // Loaded once per process; a failure is remembered with its reason.
  static std::string load_error;
  static const bool loaded = load_verbs(&V(), &load_error);
  if (!loaded) {
    *why = load_error;
    return Status::kUnsupported;
  }
  int n = 0;
  ibv_device** list = V().get_device_list(&n);
  if (list == nullptr) {
    *why = std::string("ibv_get_device_list failed: ") + std::strerror(errno);
    return Status::kUnsupported;
  }
  // GPUDirect: the peer-memory module is the machine's (looked up once), DMA-BUF the device's
  // (probed once per device, with its protection domain).
  const bool gdr_on = env.ib_gdr != "off";
  std::string peer_why;
  const bool peer_memory = gdr_on && peer_memory_loaded(&peer_why);
  for (int i = 0; i < n; ++i) {
    const std::string name = V().get_device_name(list[i]);
    ibv_context* ctx = V().open_device(list[i]);
    if (ctx == nullptr) {
      NET_INFO("verbs device %s: cannot open (%s); skipped", name.c_str(), std::strerror(errno));
      continue;
    }
    ibv_device_attr attr{};
    if (V().query_device(ctx, &attr) != 0) {
      NET_INFO("verbs device %s: query_device failed; skipped", name.c_str());
      V().close_device(ctx);
      continue;
    }
    ibv_pd* pd = nullptr;
    int dmabuf = -1;  // probed at the device's first usable port
    std::string dmabuf_why;
    size_t first = out->size();
    for (int port = 1; port <= attr.phys_port_cnt; ++port) {
      if (!hca_selected(env.ib_hca, name, port)) continue;
      ibv_port_attr pa{};
      if (V().query_port(ctx, static_cast<uint8_t>(port), &pa) != 0) continue;
      if (pa.state != IBV_PORT_ACTIVE) {
        NET_INFO("verbs port %s:%d is not active (state %d); skipped", name.c_str(), port,
                 static_cast<int>(pa.state));
        continue;
      }
      IbDevice d;
      d.name = name;
      d.port = port;
      d.link_layer = pa.link_layer;
      d.lid = pa.lid;
      d.mtu = pa.active_mtu;
      d.max_qp = attr.max_qp;
      if (pa.max_msg_sz > 0) d.max_write = std::min<size_t>(kMaxWriteBytes, pa.max_msg_sz);
      d.speed_mbps = lane_mbps(pa.active_speed) * lanes(pa.active_width);
      d.guid = be64toh(V().get_device_guid(list[i]));
      char real[PATH_MAX];
      std::string sys = "/sys/class/infiniband/" + name + "/device";
      if (realpath(sys.c_str(), real) != nullptr) d.pci_path = real;
      if (pa.link_layer == IBV_LINK_LAYER_ETHERNET) {
        if (!pick_roce_gid(ctx, name, port, pa.gid_tbl_len, env.ib_gid_index, &d.gid_index, &d.gid)) {
          NET_INFO(
              "verbs port %s:%d (RoCE) has no usable GID (an IPv4 address on its netdev, or "
              "DYNAMIQ_NET_IB_GID_INDEX); skipped",
              name.c_str(), port);
          continue;
        }
      } else if (pa.lid == 0) {
        NET_INFO("verbs port %s:%d (InfiniBand) has no LID yet (subnet manager?); skipped",
                 name.c_str(), port);
        continue;
      }
      if (pd == nullptr) pd = V().alloc_pd(ctx);
      if (pd == nullptr) {
        NET_INFO("verbs device %s: cannot allocate a protection domain; skipped", name.c_str());
        break;
      }
      d.ctx = ctx;
      d.pd = pd;
      if (gdr_on) {
        if (dmabuf < 0) dmabuf = dma_buf_accepted(pd, &dmabuf_why) ? 1 : 0;
        d.gdr = peer_memory;
        d.dmabuf = dmabuf == 1;
        d.flush_all = env.ib_gdr == "flush-all";
        NET_INFO("verbs port %s:%d GPUDirect RDMA: GPU memory %s (%s); DMA-BUF %s (%s)%s",
                 name.c_str(), port, d.gdr ? "yes" : "no", peer_why.c_str(),
                 d.dmabuf ? "yes" : "no", dmabuf_why.c_str(),
                 d.flush_all ? "; every receive flushed (DYNAMIQ_NET_IB_GDR=flush-all)" : "");
      } else {
        NET_INFO("verbs port %s:%d: host memory only (DYNAMIQ_NET_IB_GDR=off)", name.c_str(),
                 port);
      }
      out->push_back(d);
    }
    if (out->size() == first) {
      if (pd != nullptr) V().dealloc_pd(pd);
      V().close_device(ctx);
    }
  }
  V().free_device_list(list);
  if (out->empty()) {
    *why = n == 0 ? "no verbs device" : "no active, selected verbs port with an address";
    return Status::kUnsupported;
  }
  return Status::kOk;
}

// ---------------------------------------------------------------- registered memory

struct IbMr {
  uint32_t magic = kMrMagic;
  ibv_mr* mr = nullptr;
  const char* base = nullptr;
  size_t size = 0;
  int type = NCCL_PTR_HOST;  // NCCL_PTR_CUDA: device memory (a receive into it is flushed)
};

constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

Status register_bytes(ibv_pd* pd, void* data, size_t size, ibv_mr** out) {
  *out = V().reg_mr(pd, data, size, kAccess);
  if (*out == nullptr) {
    NET_WARN("ibv_reg_mr of %p+%zu failed: %s", data, size, std::strerror(errno));
    return Status::kSystemError;
  }
  return Status::kOk;
}

Status check_region(void* mhandle, const void* data, size_t size) {
  if (mhandle == nullptr) return Status::kOk;
  auto* m = static_cast<IbMr*>(mhandle);
  const char* p = static_cast<const char*>(data);
  if (m->magic != kMrMagic) {
    NET_WARN("memory handle %p is not registered with this plugin", mhandle);
    return Status::kInvalidArgument;
  }
  if (size > 0 && (p < m->base || p + size > m->base + m->size)) {
    NET_WARN("buffer %p+%zu lies outside its registered region %p+%zu", data, size,
             static_cast<const void*>(m->base), m->size);
    return Status::kInvalidArgument;
  }
  return Status::kOk;
}

// ---------------------------------------------------------------- one endpoint (QP + CQ)

// What every connection has: its QPs (qps[0] also carries the FIFO and the size records), one
// CQ for all of them, the side channel, the failure state.
struct Conn {
  uint32_t magic = 0;  // first: kSendMagic or kRecvMagic (dev_of reads it)
  const IbDevice* dev = nullptr;
  std::string peer;  // for logs: "verbs device <- side channel peer"
  int64_t timeout_ms = 30000;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;        // qps[0]
  std::vector<ibv_qp*> qps;    // 1..kMaxQps
  std::vector<uint32_t> psns;  // their initial packet sequence numbers
  int qp_used[ibwire::kMaxQps] = {};  // per QP: send work requests posted and not yet retired
  void* side_send = nullptr;  // socket send comm to the peer
  void* side_recv = nullptr;  // socket receive comm from the peer
  void* bye_req = nullptr;    // receive posted on side_recv: kBye, or an error when the peer dies
  Ctl bye{};
  std::vector<ibv_mr*> mrs;   // the comm's own regions (FIFO, size records)
  std::vector<void*> blocks;  // their memory (posix_memalign)

  std::mutex mu;
  bool failed = false;
  Status fail_status = Status::kSystemError;
  bool peer_closed = false;
  int sq_used = 0;  // send work requests posted and not yet retired, all QPs
  Clock::time_point last_progress = Clock::now();

  void fail(const std::string& why, bool warn = true) {  // mu held
    if (failed) return;
    failed = true;
    if (warn) {
      NET_WARN("verbs connection with %s failed: %s", peer.c_str(), why.c_str());
    } else {
      NET_INFO("verbs connection with %s ended: %s", peer.c_str(), why.c_str());
    }
  }

  // Side channel: the peer's kBye (orderly close) or its death (error on the posted receive).
  void poll_side() {  // mu held
    if (bye_req == nullptr || failed) return;
    int done = 0;
    Status st = socket_backend().test(bye_req, &done, nullptr);
    if (st != Status::kOk) {
      bye_req = nullptr;
      fail("the side channel failed (peer died or closed without notice)");
      return;
    }
    if (!done) return;
    bye_req = nullptr;
    const char* bad = ibwire::check_ctl(bye, ibwire::kBye);
    if (bad != nullptr) {
      fail_status = Status::kMalformedPayload;
      fail(std::string("malformed control message: ") + bad);
      return;
    }
    peer_closed = true;
  }

  Status post_side_recv() {
    void* data = &bye;
    size_t size = sizeof(bye);
    int tag = kSideTag;
    DQ_CHECK(socket_backend().irecv(side_recv, 1, &data, &size, &tag, nullptr, &bye_req));
    if (bye_req == nullptr) return Status::kInternal;
    return Status::kOk;
  }

  void* alloc(size_t bytes) {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, bytes) != 0) return nullptr;
    std::memset(p, 0, bytes);
    blocks.push_back(p);
    return p;
  }

  // `nqps` RC QPs on one CQ. remote_access: what the peer's work requests may do to this
  // connection's memory (the flush QP, whose peer is itself, reads).
  Status make_qps(uint32_t nqps, int remote_access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE) {
    cq = V().create_cq(dev->ctx, kCqDepthPerQp * static_cast<int>(nqps), nullptr, nullptr, 0);
    if (cq == nullptr) {
      NET_WARN("ibv_create_cq on %s failed: %s", dev->name.c_str(), std::strerror(errno));
      return Status::kSystemError;
    }
    for (uint32_t i = 0; i < nqps; ++i) {
      ibv_qp_init_attr ia{};
      ia.send_cq = cq;
      ia.recv_cq = cq;
      ia.qp_type = IBV_QPT_RC;
      ia.cap.max_send_wr = kSqDepth;
      ia.cap.max_recv_wr = kRqDepth;
      ia.cap.max_send_sge = 1;
      ia.cap.max_recv_sge = 1;
      ibv_qp* q = V().create_qp(dev->pd, &ia);
      if (q == nullptr) {
        NET_WARN("ibv_create_qp on %s failed: %s", dev->name.c_str(), std::strerror(errno));
        return Status::kSystemError;
      }
      qps.push_back(q);
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_INIT;
      a.pkey_index = 0;
      a.port_num = static_cast<uint8_t>(dev->port);
      a.qp_access_flags = static_cast<unsigned>(remote_access);
      if (V().modify_qp(q, &a,
                        IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) {
        NET_WARN("QP to INIT on %s failed: %s", dev->name.c_str(), std::strerror(errno));
        return Status::kSystemError;
      }
      psns.push_back(static_cast<uint32_t>(random_u64() & 0xffffff));
    }
    qp = qps[0];
    return Status::kOk;
  }

  // Index of the QP of a work completion (wc.qp_num) in qps, or -1.
  int qp_index(uint32_t qp_num) const {
    for (size_t i = 0; i < qps.size(); ++i) {
      if (qps[i]->qp_num == qp_num) return static_cast<int>(i);
    }
    return -1;
  }

  void fill_ctl(Ctl* c, uint16_t kind) const {
    std::memset(c, 0, sizeof(*c));
    c->magic = ibwire::kCtlMagic;
    c->version = ibwire::kVersion;
    c->kind = kind;
    c->nqps = static_cast<uint32_t>(qps.size());
    for (size_t i = 0; i < qps.size(); ++i) {
      c->qpn[i] = qps[i]->qp_num;
      c->psn[i] = psns[i];
    }
    std::memcpy(c->gid, dev->gid.raw, 16);
    c->lid = dev->lid;
    c->link_layer = dev->link_layer;
    c->mtu = static_cast<uint8_t>(dev->mtu);
    c->fifo_depth = kFifoDepth;
    c->max_recvs = kMaxGroupedRecvs;
  }

  // Every QP INIT -> RTR -> RTS towards its peer QP described by `c` (already checked).
  Status connect(const Ctl& c, int traffic_class) {
    if (c.link_layer != dev->link_layer) {
      NET_WARN("peer %s uses link layer %u, this port %u", peer.c_str(), c.link_layer,
               dev->link_layer);
      return Status::kInvalidArgument;
    }
    if (c.nqps != qps.size()) {
      NET_WARN("peer %s has %u queue pairs for this connection, this end %zu", peer.c_str(),
               c.nqps, qps.size());
      return Status::kMalformedPayload;
    }
    for (size_t i = 0; i < qps.size(); ++i) DQ_CHECK(connect_qp(i, c, traffic_class));
    return Status::kOk;
  }

  Status connect_qp(size_t i, const Ctl& c, int traffic_class) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = static_cast<ibv_mtu>(std::min<int>(c.mtu, dev->mtu));
    a.dest_qp_num = c.qpn[i];
    a.rq_psn = c.psn[i];
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = kRnrTimer;
    a.ah_attr.port_num = static_cast<uint8_t>(dev->port);
    if (dev->link_layer == IBV_LINK_LAYER_ETHERNET) {
      a.ah_attr.is_global = 1;
      std::memcpy(a.ah_attr.grh.dgid.raw, c.gid, 16);
      a.ah_attr.grh.sgid_index = static_cast<uint8_t>(dev->gid_index);
      a.ah_attr.grh.hop_limit = 255;
      a.ah_attr.grh.traffic_class =
          traffic_class >= 0 ? static_cast<uint8_t>(traffic_class) : uint8_t{0};
    } else {
      a.ah_attr.is_global = 0;
      a.ah_attr.dlid = c.lid;
    }
    if (V().modify_qp(qps[i], &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0) {
      NET_WARN("QP to RTR towards %s failed: %s", peer.c_str(), std::strerror(errno));
      return Status::kSystemError;
    }
    std::memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = psns[i];
    a.timeout = kAckTimeout;
    a.retry_cnt = kRetryCount;
    a.rnr_retry = kRnrRetry;
    a.max_rd_atomic = 1;
    if (V().modify_qp(qps[i], &a,
                      IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                          IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC) != 0) {
      NET_WARN("QP to RTS towards %s failed: %s", peer.c_str(), std::strerror(errno));
      return Status::kSystemError;
    }
    return Status::kOk;
  }

  // Orderly close: kBye to the peer (bounded wait), then the side channel, QP, CQ, regions.
  void close() {
    {
      std::lock_guard<std::mutex> lock(mu);
      poll_side();
    }
    if (side_send != nullptr) {
      Ctl c{};
      c.magic = ibwire::kCtlMagic;
      c.version = ibwire::kVersion;
      c.kind = ibwire::kBye;
      void* req = nullptr;
      if (!failed && !peer_closed &&
          socket_backend().isend(side_send, &c, sizeof(c), kSideTag, nullptr, &req) == Status::kOk &&
          req != nullptr) {
        Clock::time_point t = Clock::now();
        int done = 0;
        // Bounded: a small message on an idle socket; at most 1 s or the timeout.
        while (!done && ms_since(t) < std::min<int64_t>(timeout_ms, 1000)) {
          if (socket_backend().test(req, &done, nullptr) != Status::kOk) break;
          if (!done) usleep(100);
        }
      }
      socket_backend().close_send(side_send);
      side_send = nullptr;
    }
    if (side_recv != nullptr) socket_backend().close_recv(side_recv);
    side_recv = nullptr;
    for (ibv_qp* q : qps) V().destroy_qp(q);
    qps.clear();
    qp = nullptr;
    if (cq != nullptr) V().destroy_cq(cq);
    cq = nullptr;
    for (ibv_mr* m : mrs) V().dereg_mr(m);
    mrs.clear();
    for (void* b : blocks) free(b);
    blocks.clear();
  }

  std::string wc_error(const ibv_wc& wc) const {
    return std::string("work completion error: ") + V().wc_status_str(wc.status) + " (status " +
           std::to_string(wc.status) + ", vendor error " + std::to_string(wc.vendor_err) + ")";
  }
};

// ---------------------------------------------------------------- send side

struct SendComm;

struct SendReq {
  uint32_t magic = kSendReqMagic;
  SendComm* comm = nullptr;
  int tag = 0;
  char* data = nullptr;
  size_t size = 0;
  uint32_t lkey = 0;
  ibv_mr* own_mr = nullptr;  // registered for this request only (no mhandle given)
  int wr_left = 0;           // work requests posted for it and not completed yet
  bool posted = false;
  bool done = false;
};

struct SendComm : Conn {
  SendComm() { magic = kSendMagic; }
  FifoSlot* fifo = nullptr;     // written by the receiver
  uint64_t* records = nullptr;  // size records, source of the WRITE WITH IMM
  uint32_t records_lkey = 0;
  uint64_t remote_records = 0;  // the receiver's size record array
  uint32_t remote_records_rkey = 0;
  FifoSlot snap[kFifoDepth] = {};     // per slot: the last posting whose check word matched
  uint64_t cur_seq[kFifoDepth] = {};  // per slot: that posting's seq (0: none yet)
  uint8_t used[kFifoDepth] = {};      // per slot: bit i = entry i of snap matched
  uint64_t frontier = 0;  // every posting with seq <= frontier has been taken into snap
  std::deque<SendReq*> waiting;       // isend order, not matched yet
  std::unordered_set<SendReq*> reqs;

  ~SendComm() {
    for (SendReq* r : reqs) {
      if (r->own_mr != nullptr) V().dereg_mr(r->own_mr);
      delete r;
    }
  }

  // Takes slot `pos` if the receiver wrote a new posting there and all of it has landed (its
  // check word matches): false while there is none or it is still arriving.
  bool take_new_posting(uint32_t pos) {
    const auto* src = reinterpret_cast<const volatile uint64_t*>(&fifo[pos]);
    if (src[offsetof(FifoSlot, seq) / 8] == cur_seq[pos]) return false;
    uint64_t w[sizeof(FifoSlot) / 8];
    for (size_t i = 0; i < sizeof(FifoSlot) / 8; ++i) w[i] = src[i];
    std::atomic_thread_fence(std::memory_order_acquire);
    FifoSlot copy;
    std::memcpy(&copy, w, sizeof(copy));
    if (copy.seq == 0 || copy.seq == cur_seq[pos]) return false;
    if (ibwire::slot_check(w, ibwire::kSlotCheckedWords) != copy.check) return false;
    snap[pos] = copy;
    cur_seq[pos] = copy.seq;
    used[pos] = 0;
    return true;
  }

  // Payload bytes per RDMA WRITE: every write is signaled, so the stall bound
  // (DYNAMIQ_NET_TIMEOUT_MS) sees progress within a large message; at most 256 writes a stripe.
  size_t chunk_bytes(size_t size) const {
    return std::min(dev->max_write, std::max<size_t>(kMinChunkBytes, (size + 255) / 256));
  }
  // How a message of `size` bytes (0 when it does not fit: only its size record travels) is cut:
  // its stripes, and the work requests stripe i takes on QP i (its writes and its immediate).
  uint32_t stripes_for(size_t size) const {
    return ibwire::stripe_count(size, static_cast<uint32_t>(qps.size()));
  }
  int stripe_work_requests(size_t size, uint32_t stripes, uint32_t i) const {
    uint64_t off = 0, len = 0;
    ibwire::stripe_range(size, stripes, i, &off, &len);
    return static_cast<int>((len + chunk_bytes(len) - 1) / chunk_bytes(len)) + 1;
  }
  bool fits(size_t size) const {  // room on every QP the message's stripes take
    const uint32_t k = stripes_for(size);
    for (uint32_t i = 0; i < k; ++i) {
      if (qp_used[i] + stripe_work_requests(size, k, i) > kSqDepth) return false;
    }
    return true;
  }

  // Posts the payload write(s) and the stripes' immediates for `r` into entry `e` of slot `pos`.
  Status post(SendReq* r, uint32_t pos, int e) {
    const ibwire::FifoEntry& fe = snap[pos].e[e];
    const bool fits = r->size <= fe.size;
    const size_t payload = fits ? r->size : 0;
    const uint32_t idx = static_cast<uint32_t>(pos * kMaxGroupedRecvs + static_cast<size_t>(e));
    records[idx] = fits ? r->size : (r->size | ibwire::kOversize);
    const uint32_t stripes = stripes_for(payload);
    std::vector<ibv_send_wr> wrs;
    std::vector<ibv_sge> sges;
    int posted = 0;
    for (uint32_t q = 0; q < stripes; ++q) {
      uint64_t begin = 0, len = 0;
      ibwire::stripe_range(payload, stripes, q, &begin, &len);
      const size_t chunk = chunk_bytes(len);
      const size_t chunks = (len + chunk - 1) / chunk;
      wrs.assign(chunks + 1, ibv_send_wr{});
      sges.assign(chunks + 1, ibv_sge{});
      for (size_t c = 0; c < chunks; ++c) {
        const size_t off = begin + c * chunk;
        sges[c].addr = reinterpret_cast<uint64_t>(r->data + off);
        sges[c].length = static_cast<uint32_t>(std::min<uint64_t>(chunk, begin + len - off));
        sges[c].lkey = r->lkey;
        wrs[c].wr_id = reinterpret_cast<uint64_t>(r);
        wrs[c].sg_list = &sges[c];
        wrs[c].num_sge = 1;
        wrs[c].opcode = IBV_WR_RDMA_WRITE;
        wrs[c].send_flags = IBV_SEND_SIGNALED;
        wrs[c].wr.rdma.remote_addr = fe.addr + off;
        wrs[c].wr.rdma.rkey = fe.rkey;
        wrs[c].next = &wrs[c + 1];
      }
      // The stripe's end: QP 0 writes the size record, the others nothing; each immediate tells
      // the receiver one more stripe of the entry is in place (RC: after this QP's writes).
      ibv_send_wr& last = wrs[chunks];
      if (q == 0) {
        sges[chunks].addr = reinterpret_cast<uint64_t>(&records[idx]);
        sges[chunks].length = sizeof(uint64_t);
        sges[chunks].lkey = records_lkey;
        last.sg_list = &sges[chunks];
        last.num_sge = 1;
      }
      last.wr_id = reinterpret_cast<uint64_t>(r);
      last.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      last.send_flags = IBV_SEND_SIGNALED;
      last.imm_data = htobe32(ibwire::stripe_imm(idx, stripes));
      last.wr.rdma.remote_addr = remote_records + idx * sizeof(uint64_t);
      last.wr.rdma.rkey = remote_records_rkey;
      last.next = nullptr;
      ibv_send_wr* bad = nullptr;
      int rc = ibv_post_send(qps[q], wrs.data(), &bad);
      if (rc != 0) {
        fail(std::string("ibv_post_send failed: ") + std::strerror(rc));
        return Status::kSystemError;
      }
      qp_used[q] += static_cast<int>(chunks + 1);
      posted += static_cast<int>(chunks + 1);
    }
    if (sq_used == 0) last_progress = Clock::now();
    r->wr_left = posted;
    sq_used += posted;
    r->posted = true;
    return Status::kOk;
  }

  // Completions, matching of waiting sends to posted receives, fault detection.
  void progress() {  // mu held
    if (failed) return;
    ibv_wc wc[16];
    int n = 0;
    while ((n = ibv_poll_cq(cq, 16, wc)) > 0) {  // bounded by the work requests in flight
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) return fail(wc_error(wc[i]));
        auto* r = reinterpret_cast<SendReq*>(wc[i].wr_id);
        const int q = qp_index(wc[i].qp_num);
        if (reqs.count(r) == 0 || q < 0) return fail("completion for an unknown request");
        --sq_used;
        --qp_used[q];
        last_progress = Clock::now();
        // Done when the work requests of every stripe, on every QP, have completed.
        if (--r->wr_left == 0) r->done = true;
      }
    }
    if (n < 0) return fail("ibv_poll_cq failed");
    // The receiver reuses a slot only once every entry of it has been received, so a slot whose
    // seq changed is a new posting. Postings are matched strictly in seq (posting) order: the
    // scan below reads the slots one after another while the receiver's writes keep landing, so
    // it can see posting k + 1 and miss posting k (its slot read a moment before it landed);
    // k + 1 waits for k (taking it first paired the wrong send and receive: wrong data, size
    // mismatches). A slot cannot be reposted before its posting was matched, so a posting
    // beyond the frontier stays in its slot until the gap fills.
    std::pair<uint64_t, uint32_t> live[kFifoDepth];  // (seq, slot)
    int nlive = 0;
    for (uint32_t pos = 0; pos < kFifoDepth; ++pos) {
      if (take_new_posting(pos)) {
        const uint32_t nrecv = snap[pos].n;
        if (nrecv < 1 || nrecv > static_cast<uint32_t>(kMaxGroupedRecvs) ||
            cur_seq[pos] <= frontier) {
          fail_status = Status::kMalformedPayload;
          return fail("malformed FIFO slot: posting " + std::to_string(cur_seq[pos]) + " with " +
                      std::to_string(nrecv) + " grouped receives (postings up to " +
                      std::to_string(frontier) + " already taken)");
        }
      }
      if (cur_seq[pos] == 0) continue;
      if (used[pos] != (1u << snap[pos].n) - 1) live[nlive++] = {cur_seq[pos], pos};
    }
    std::sort(live, live + nlive);
    for (int l = 0; l < nlive; ++l) {
      if (live[l].first == frontier + 1) ++frontier;
    }
    while (nlive > 0 && live[nlive - 1].first > frontier) --nlive;  // not in order yet
    // Match in isend order; each send takes the oldest unused posted entry with its tag.
    bool sq_full = false;
    for (auto it = waiting.begin(); it != waiting.end() && !sq_full && !failed;) {
      SendReq* r = *it;
      bool matched = false;
      for (int l = 0; l < nlive && !matched && !sq_full; ++l) {
        const uint32_t pos = live[l].second;
        const uint32_t nrecv = snap[pos].n;
        for (uint32_t e = 0; e < nrecv; ++e) {
          if (((used[pos] >> e) & 1u) != 0 || snap[pos].e[e].tag != r->tag) continue;
          if (!fits(r->size <= snap[pos].e[e].size ? r->size : 0)) {
            sq_full = true;
            break;
          }
          if (post(r, pos, static_cast<int>(e)) != Status::kOk) return;
          used[pos] = static_cast<uint8_t>(used[pos] | (1u << e));
          matched = true;
          break;
        }
      }
      it = matched ? waiting.erase(it) : it + 1;
    }
    poll_side();
    if (failed) return;
    if (sq_used > 0 && ms_since(last_progress) > timeout_ms) {
      fail_status = Status::kTimeout;
      return fail("no completion for " + std::to_string(timeout_ms) +
                  " ms (DYNAMIQ_NET_TIMEOUT_MS) with " + std::to_string(sq_used) +
                  " work requests in flight");
    }
    // kBye travels on TCP, the ACKs of our last writes on the QP: a receiver that got every
    // message and closed may overtake them, so writes in flight are left to their completions
    // (success, or an error once the retries to the destroyed peer QP run out) and the stall
    // bound above. A send no posted receive took can never complete.
    if (peer_closed && !waiting.empty()) {
      fail("the peer closed the connection with " + std::to_string(waiting.size()) +
           " sends that no receive of its took");
    }
  }
};

// ---------------------------------------------------------------- receive side

struct RecvComm;

struct RecvReq {
  uint32_t magic = kRecvReqMagic;
  RecvComm* comm = nullptr;
  int n = 0;
  int remaining = 0;
  uint64_t seq = 0;  // receive index (the FIFO slot's seq - 1)
  size_t capacity[kMaxGroupedRecvs] = {};
  int tag[kMaxGroupedRecvs] = {};
  size_t received[kMaxGroupedRecvs] = {};
  bool got[kMaxGroupedRecvs] = {};
  ibwire::StripeTracker stripes[kMaxGroupedRecvs];
  ibv_mr* own_mr[kMaxGroupedRecvs] = {};
};

// An iflush: RDMA READs of one byte from each received buffer into a scratch word, on a QP
// connected to itself. A READ completes only after the HCA's earlier writes to that memory are
// visible to the reader, so for GPU memory it orders the received bytes before the GPU's use.
struct FlushReq {
  uint32_t magic = kFlushReqMagic;
  RecvComm* comm = nullptr;
  bool done = false;
  int wrs = 0;  // send queue entries its READs hold until the signalled last one completes
  Clock::time_point start = Clock::now();
};

struct RecvComm : Conn {
  RecvComm() { magic = kRecvMagic; }
  // The flush QP (made at the first iflush that needs one; peer: itself) and its scratch.
  std::unique_ptr<Conn> flush;
  uint32_t* flush_scratch = nullptr;
  uint32_t flush_lkey = 0;
  std::unordered_set<FlushReq*> flushes;

  Status make_flush_qp() {  // mu held
    auto f = std::make_unique<Conn>();
    f->dev = dev;
    f->peer = dev->name + " (its own flush QP)";
    f->timeout_ms = timeout_ms;
    DQ_CHECK(f->make_qps(1, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE));
    ibwire::Ctl self{};
    f->fill_ctl(&self, ibwire::kConnect);
    DQ_CHECK(f->connect(self, -1));
    void* scratch = f->alloc(64);
    ibv_mr* mr = nullptr;
    if (scratch == nullptr) return Status::kOutOfMemory;
    DQ_CHECK(register_bytes(dev->pd, scratch, 64, &mr));
    f->mrs.push_back(mr);
    flush_scratch = static_cast<uint32_t*>(scratch);
    flush_lkey = mr->lkey;
    flush = std::move(f);
    return Status::kOk;
  }

  // Polls the flush QP's completions into their requests.
  Status poll_flushes() {  // mu held
    if (!flush) return Status::kOk;
    ibv_wc wc[16];
    int n = 0;
    while ((n = ibv_poll_cq(flush->cq, 16, wc)) > 0) {  // bounded by the READs in flight
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) {
          fail("flush: " + wc_error(wc[i]));
          return Status::kSystemError;
        }
        auto* r = reinterpret_cast<FlushReq*>(wc[i].wr_id);
        if (flushes.count(r) == 0) {
          fail("flush: a completion names no pending flush");
          return Status::kInternal;
        }
        r->done = true;
        flush->sq_used -= r->wrs;
      }
    }
    if (n < 0) {
      fail("flush: ibv_poll_cq failed");
      return Status::kSystemError;
    }
    return Status::kOk;
  }
  FifoSlot* fifo_src = nullptr;  // local copy of each slot, source of the FIFO writes
  uint32_t fifo_src_lkey = 0;
  uint64_t* records = nullptr;  // written by the sender (size records)
  uint64_t remote_fifo = 0;
  uint32_t remote_fifo_rkey = 0;
  uint64_t next_seq = 0;
  RecvReq* by_slot[kFifoDepth] = {};
  std::unordered_set<RecvReq*> reqs;

  ~RecvComm() {
    if (flush) flush->close();
    for (FlushReq* f : flushes) delete f;
    for (RecvReq* r : reqs) {
      for (ibv_mr* m : r->own_mr) {
        if (m != nullptr) V().dereg_mr(m);
      }
      delete r;
    }
  }

  // Posts n zero-length receives on QP q: each takes one WRITE WITH IMM. Every QP keeps
  // kRqDepth posted (one per grouped receive the FIFO can hold; an entry takes at most one per
  // QP), topped up as they complete, so a stripe never meets an empty receive queue.
  Status post_receives(size_t q, int n) {
    ibv_recv_wr rw[16];
    while (n > 0) {
      const int k = std::min(n, 16);
      for (int i = 0; i < k; ++i) {
        rw[i] = ibv_recv_wr{};
        rw[i].wr_id = kWrRecv;
        rw[i].next = i + 1 < k ? &rw[i + 1] : nullptr;
      }
      ibv_recv_wr* bad = nullptr;
      const int e = ibv_post_recv(qps[q], rw, &bad);
      if (e != 0) {
        fail(std::string("posting receives failed: ") + std::strerror(e));
        return Status::kSystemError;
      }
      n -= k;
    }
    return Status::kOk;
  }

  void progress() {  // mu held
    if (failed) return;
    ibv_wc wc[16];
    int n = 0;
    while ((n = ibv_poll_cq(cq, 16, wc)) > 0) {  // bounded by the work requests in flight
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) return fail(wc_error(wc[i]));
        last_progress = Clock::now();
        if (wc[i].wr_id == kWrFifo) {
          --sq_used;
          continue;
        }
        const int q = qp_index(wc[i].qp_num);
        if (wc[i].wr_id != kWrRecv || wc[i].opcode != IBV_WC_RECV_RDMA_WITH_IMM || q < 0) {
          return fail("unexpected completion (opcode " + std::to_string(wc[i].opcode) + ")");
        }
        if (post_receives(static_cast<size_t>(q), 1) != Status::kOk) return;
        const uint32_t imm = be32toh(wc[i].imm_data);
        const uint32_t idx = ibwire::imm_index(imm);
        const uint32_t slot = idx / kMaxGroupedRecvs;
        const int e = static_cast<int>(idx % kMaxGroupedRecvs);
        RecvReq* r = slot < kFifoDepth ? by_slot[slot] : nullptr;
        if (r == nullptr || e >= r->n || r->got[e] || ibwire::imm_stripes(imm) > ibwire::kMaxQps) {
          fail_status = Status::kMalformedPayload;
          return fail("immediate " + std::to_string(idx) + " (slot " + std::to_string(slot) +
                      ", entry " + std::to_string(e) + ") names no pending receive: " +
                      (r == nullptr ? std::string("the slot is free")
                                    : "posting " + std::to_string(r->seq) + " of " +
                                          std::to_string(r->n) + " entries, entry " +
                                          (e >= r->n ? "out of range"
                                           : r->got[e] ? "already received"
                                                       : "stripe count out of range")) +
                      " (next posting " + std::to_string(next_seq) + ", local QP " +
                      std::to_string(wc[i].qp_num) + ", " + std::to_string(wc[i].byte_len) +
                      " bytes)");
        }
        bool complete = false;
        const char* refused = r->stripes[e].take(static_cast<uint32_t>(q), ibwire::imm_stripes(imm),
                                                  static_cast<uint32_t>(qps.size()), &complete);
        if (refused != nullptr) {
          fail_status = Status::kMalformedPayload;
          return fail("immediate " + std::to_string(imm) + " on QP " + std::to_string(q) +
                      " for posting " + std::to_string(r->seq) + ", entry " + std::to_string(e) +
                      ": " + refused);
        }
        if (!complete) continue;  // the size record came with QP 0's stripe
        const uint64_t rec = records[idx];
        const uint64_t size = rec & ~ibwire::kOversize;
        if ((rec & ibwire::kOversize) != 0 || size > r->capacity[e]) {
          return fail("message with tag " + std::to_string(r->tag[e]) + " carries " +
                      std::to_string(size) + " bytes but the posted receive holds only " +
                      std::to_string(r->capacity[e]));
        }
        r->got[e] = true;
        r->received[e] = size;
        // The sender matched every entry of the slot: it may carry the next posting.
        if (--r->remaining == 0) by_slot[slot] = nullptr;
      }
    }
    if (n < 0) return fail("ibv_poll_cq failed");
    poll_side();
    if (failed) return;
    if (sq_used > 0 && ms_since(last_progress) > timeout_ms) {
      fail_status = Status::kTimeout;
      return fail("no completion of a receive posting for " + std::to_string(timeout_ms) +
                  " ms (DYNAMIQ_NET_TIMEOUT_MS)");
    }
    bool pending = std::any_of(reqs.begin(), reqs.end(), [](RecvReq* r) { return r->remaining; });
    if (peer_closed && pending) fail("the peer closed the connection with receives pending");
  }
};

// ---------------------------------------------------------------- connection setup

struct ListenComm {
  uint32_t magic = kListenMagic;
  const IbDevice* dev = nullptr;
  CommContext ctx;
  int64_t timeout_ms = 30000;
  void* sock_lc = nullptr;
  std::mutex mu;
  struct Pending {
    std::unique_ptr<RecvComm> rc;
    Ctl in{};
    Ctl out{};
    void* req = nullptr;  // side-channel request in progress
    char reply[NCCL_NET_HANDLE_MAXSIZE] = {};
    int stage = 0;  // 0: receiving kConnect, 1: connecting back, 2: sending kAccept
    Clock::time_point start = Clock::now();
  };
  std::vector<std::unique_ptr<Pending>> pending;

  ~ListenComm() {
    for (auto& p : pending) p->rc->close();
    if (sock_lc != nullptr) socket_backend().close_listen(sock_lc);
  }
};

struct PendingConnect {
  std::unique_ptr<SendComm> sc;
  CommContext ctx;
  char sock_handle[NCCL_NET_HANDLE_MAXSIZE] = {};  // the listener's, progress of its connect
  char reply_handle[NCCL_NET_HANDLE_MAXSIZE] = {};
  void* reply_lc = nullptr;
  Ctl out{};
  Ctl in{};
  void* req = nullptr;
  int stage = 0;  // 0: connecting, 1: sending kConnect, 2: accepting the reply, 3: receiving it
  Clock::time_point start = Clock::now();

  ~PendingConnect() {
    if (reply_lc != nullptr) socket_backend().close_listen(reply_lc);
    if (sc) sc->close();
  }
};

// Connects in progress, keyed by the pointer stored in the caller's handle (as the socket
// backend's; never destroyed for the same reason).
struct PendingConnects {
  std::mutex mu;
  std::unordered_set<PendingConnect*> set;
};
PendingConnects& pending_connects() {
  static auto* registry = new PendingConnects;
  return *registry;
}

// Sends `c` on a socket send comm; *req carries the progress across calls.
Status send_ctl(void* comm, Ctl* c, void** req, bool* done) {
  *done = false;
  if (*req == nullptr) {
    DQ_CHECK(socket_backend().isend(comm, c, sizeof(*c), kSideTag, nullptr, req));
    if (*req == nullptr) return Status::kOk;
  }
  int d = 0;
  DQ_CHECK(socket_backend().test(*req, &d, nullptr));
  if (d) *req = nullptr;
  *done = d != 0;
  return Status::kOk;
}

Status recv_ctl(void* comm, Ctl* c, void** req, bool* done) {
  *done = false;
  if (*req == nullptr) {
    void* data = c;
    size_t size = sizeof(*c);
    int tag = kSideTag;
    DQ_CHECK(socket_backend().irecv(comm, 1, &data, &size, &tag, nullptr, req));
    if (*req == nullptr) return Status::kOk;
  }
  int d = 0;
  int got = 0;
  DQ_CHECK(socket_backend().test(*req, &d, &got));
  if (!d) return Status::kOk;
  *req = nullptr;
  if (got != static_cast<int>(sizeof(*c))) {
    NET_WARN("control message of %d bytes, expected %zu", got, sizeof(*c));
    return Status::kMalformedPayload;
  }
  *done = true;
  return Status::kOk;
}

// ---------------------------------------------------------------- the backend

class IbNet final : public NetBackend {
 public:
  Status init() override {
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
      NET_INFO("verbs device %zu: %s:%d %s, %d Mbps, GID index %d, LID %u", i, d.name.c_str(),
               d.port, d.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "InfiniBand",
               d.speed_mbps, d.gid_index, d.lid);
    }
    return init_status_;
  }

  const std::string& why() const { return why_; }

  Status devices(int* ndev) override {
    DQ_CHECK(init());
    *ndev = static_cast<int>(devices_.size());
    return Status::kOk;
  }

  Status get_properties(int dev, dqNetPropertiesV11* props) override {
    DQ_CHECK(check_dev(dev));
    const IbDevice& d = devices_[static_cast<size_t>(dev)];
    std::memset(props, 0, sizeof(*props));
    props->name = const_cast<char*>(d.name.c_str());
    props->pciPath = d.pci_path.empty() ? nullptr : const_cast<char*>(d.pci_path.c_str());
    props->guid = d.guid;
    props->ptrSupport = NCCL_PTR_HOST | (d.gdr ? NCCL_PTR_CUDA : 0) |
                        (d.dmabuf ? NCCL_PTR_DMABUF : 0);
    props->regIsGlobal = 0;
    props->forceFlush = d.flush_all ? 1 : 0;
    props->speed = d.speed_mbps;
    props->port = d.port;
    props->latency = 0;
    props->maxComms = d.max_qp;
    props->maxRecvs = kMaxGroupedRecvs;
    props->netDeviceType = DQNET_DEVICE_HOST;
    props->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION;
    props->vProps.ndevs = 1;
    props->vProps.devs[0] = dev;
    props->maxP2pBytes = 1ull << 30;  // sizes reported by test() are int
    props->maxCollBytes = 1ull << 30;
    props->maxMultiRequestSize = 1;
    return Status::kOk;
  }

  Status listen(const CommContext& ctx, int dev, void* handle, void** listen_comm) override {
    *listen_comm = nullptr;
    DQ_CHECK(check_dev(dev));
    auto lc = std::make_unique<ListenComm>();
    lc->dev = &devices_[static_cast<size_t>(dev)];
    lc->ctx = ctx;
    lc->timeout_ms = read_net_env().timeout_ms;
    char sock[NCCL_NET_HANDLE_MAXSIZE] = {};
    DQ_CHECK(side_listen(ctx, sock, &lc->sock_lc));
    ibwire::Handle h{};
    std::memcpy(&h.sock, sock, sizeof(h.sock));
    h.sock.nsocks = 1;
    h.magic = ibwire::kHandleMagic;
    h.version = ibwire::kVersion;
    std::memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
    std::memcpy(handle, &h, sizeof(h));
    NET_INFO("verbs listen on %s:%d", lc->dev->name.c_str(), lc->dev->port);
    *listen_comm = lc.release();
    return Status::kOk;
  }

  Status connect(const CommContext& ctx, int dev, void* handle, void** send_comm) override {
    *send_comm = nullptr;
    DQ_CHECK(check_dev(dev));
    ibwire::Handle h;
    std::memcpy(&h, handle, sizeof(h));
    if (h.magic != ibwire::kHandleMagic || h.version != ibwire::kVersion) {
      NET_WARN("connect: the handle is not a dynamiq verbs listen handle (magic %#x, version %u)",
               h.magic, h.version);
      return Status::kInvalidArgument;
    }
    PendingConnect* pc = nullptr;
    {
      std::lock_guard<std::mutex> lock(pending_connects().mu);
      auto it = pending_connects().set.find(reinterpret_cast<PendingConnect*>(h.connect_state));
      if (h.connect_state != 0 && it != pending_connects().set.end()) pc = *it;
    }
    if (pc == nullptr) {
      auto fresh = std::make_unique<PendingConnect>();
      fresh->ctx = ctx;
      h.connect_state = 0;
      std::memcpy(fresh->sock_handle, &h.sock, sizeof(h.sock));
      Status st = start_connect(&devices_[static_cast<size_t>(dev)], fresh.get());
      if (st != Status::kOk) return st;
      pc = fresh.release();
      std::lock_guard<std::mutex> lock(pending_connects().mu);
      pending_connects().set.insert(pc);
      h.connect_state = reinterpret_cast<uint64_t>(pc);
      std::memcpy(handle, &h, sizeof(h));
    }
    Status st = progress_connect(pc, send_comm);
    if (st == Status::kOk && *send_comm == nullptr && ms_since(pc->start) > pc->sc->timeout_ms) {
      NET_WARN("verbs connect to %s timed out after %lld ms (DYNAMIQ_NET_TIMEOUT_MS) in stage %d",
               pc->sc->peer.c_str(), static_cast<long long>(pc->sc->timeout_ms), pc->stage);
      st = Status::kTimeout;
    }
    if (st != Status::kOk || *send_comm != nullptr) {
      {
        std::lock_guard<std::mutex> lock(pending_connects().mu);
        pending_connects().set.erase(pc);
      }
      delete pc;
      h.connect_state = 0;
      std::memcpy(handle, &h, sizeof(h));
    }
    return st;
  }

  Status accept(void* listen_comm, void** recv_comm) override {
    *recv_comm = nullptr;
    auto* lc = static_cast<ListenComm*>(listen_comm);
    if (lc == nullptr || lc->magic != kListenMagic) {
      NET_WARN("accept: not a verbs listen comm");
      return Status::kInvalidArgument;
    }
    std::lock_guard<std::mutex> lock(lc->mu);
    void* side_recv = nullptr;
    DQ_CHECK(socket_backend().accept(lc->sock_lc, &side_recv));
    if (side_recv != nullptr) {
      auto p = std::make_unique<ListenComm::Pending>();
      p->rc = std::make_unique<RecvComm>();
      p->rc->dev = lc->dev;
      p->rc->timeout_ms = lc->timeout_ms;
      p->rc->side_recv = side_recv;
      p->rc->peer = lc->dev->name + " (side channel accepted)";
      lc->pending.push_back(std::move(p));
    }
    for (size_t i = 0; i < lc->pending.size(); ++i) {
      ListenComm::Pending& p = *lc->pending[i];
      bool ready = false;
      Status st = progress_accept(lc, &p, &ready);
      if (st == Status::kOk && !ready && ms_since(p.start) > lc->timeout_ms) {
        NET_WARN("verbs accept: connection setup with %s timed out after %lld ms in stage %d",
                 p.rc->peer.c_str(), static_cast<long long>(lc->timeout_ms), p.stage);
        st = Status::kTimeout;
      }
      if (st != Status::kOk) {
        // One bad or slow peer does not fail the listener: drop it and go on.
        p.rc->close();
        lc->pending.erase(lc->pending.begin() + static_cast<long>(i));
        --i;
        continue;
      }
      if (ready) {
        RecvComm* rc = p.rc.release();
        lc->pending.erase(lc->pending.begin() + static_cast<long>(i));
        NET_INFO("verbs connection accepted from %s", rc->peer.c_str());
        *recv_comm = rc;
        return Status::kOk;
      }
    }
    return Status::kOk;
  }

  Status reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) override {
    *mhandle = nullptr;
    const IbDevice* dev = dev_of(comm);
    if (dev == nullptr) {
      NET_WARN("regMr: not a verbs comm");
      return Status::kInvalidArgument;
    }
    if (type != NCCL_PTR_HOST && !(type == NCCL_PTR_CUDA && dev->gdr)) {
      NET_WARN("regMr: memory type %d is not supported on %s (GPU memory needs the peer-memory "
               "module, and DYNAMIQ_NET_IB_GDR not off)",
               type, dev->name.c_str());
      return Status::kInvalidArgument;
    }
    auto m = std::make_unique<IbMr>();
    m->base = static_cast<const char*>(data);
    m->size = size;
    m->type = type;
    if (size > 0) DQ_CHECK(register_bytes(dev->pd, data, size, &m->mr));
    *mhandle = m.release();
    return Status::kOk;
  }

  Status reg_mr_dma_buf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                     void** mhandle) override {
    *mhandle = nullptr;
    if (type == NCCL_PTR_HOST) return reg_mr(comm, data, size, type, mhandle);
    const IbDevice* dev = dev_of(comm);
    if (dev == nullptr) {
      NET_WARN("regMrDmaBuf: not a verbs comm");
      return Status::kInvalidArgument;
    }
    if (type != NCCL_PTR_CUDA || !dev->dmabuf || fd < 0) {
      NET_WARN("regMrDmaBuf: memory type %d, fd %d not supported on %s (DMA-BUF %s)", type, fd,
               dev->name.c_str(), dev->dmabuf ? "accepted" : "not accepted by the device");
      return Status::kInvalidArgument;
    }
    auto m = std::make_unique<IbMr>();
    m->base = static_cast<const char*>(data);
    m->size = size;
    m->type = type;
    if (size > 0) {
      m->mr = V().reg_dmabuf_mr(dev->pd, offset, size, reinterpret_cast<uint64_t>(data), fd,
                                kAccess);
      if (m->mr == nullptr) {
        NET_WARN("ibv_reg_dmabuf_mr of %p+%zu (fd %d, offset %llu) failed: %s", data, size, fd,
                 static_cast<unsigned long long>(offset), std::strerror(errno));
        return Status::kSystemError;
      }
    }
    *mhandle = m.release();
    return Status::kOk;
  }

  Status iflush(void* recv_comm, int n, void** data, const int* sizes, void** mhandles,
                void** request) override {
    *request = nullptr;
    RecvComm* rc = nullptr;
    if (Status st = grouped_call("iflush", recv_comm, n, 0, &rc); st != Status::kOk) return st;
    // The buffers that need one: received bytes in GPU memory (or any, with flush-all).
    ibv_sge sge[kMaxGroupedRecvs];
    ibv_send_wr wr[kMaxGroupedRecvs];
    int k = 0;
    for (int i = 0; i < n; ++i) {
      auto* m = mhandles != nullptr ? static_cast<IbMr*>(mhandles[i]) : nullptr;
      if (sizes[i] <= 0) continue;
      if (m == nullptr || m->magic != kMrMagic || m->mr == nullptr) {
        if (!rc->dev->flush_all) continue;  // unregistered host memory: nothing to flush
        NET_WARN("iflush: buffer %d (%p) has no memory handle of this plugin", i, data[i]);
        return Status::kInvalidArgument;
      }
      if (m->type == NCCL_PTR_HOST && !rc->dev->flush_all) continue;
      DQ_CHECK(check_region(m, data[i], 1));
      sge[k] = ibv_sge{0, 1, 0};  // address and key below, when the scratch exists
      wr[k] = ibv_send_wr{};
      wr[k].opcode = IBV_WR_RDMA_READ;
      wr[k].wr.rdma.remote_addr = reinterpret_cast<uint64_t>(data[i]);
      wr[k].wr.rdma.rkey = m->mr->rkey;
      ++k;
    }
    if (k == 0) return Status::kOk;  // nothing to wait for
    std::lock_guard<std::mutex> lock(rc->mu);
    if (rc->failed) return rc->fail_status;
    if (!rc->flush) DQ_CHECK(rc->make_flush_qp());
    DQ_CHECK(rc->poll_flushes());
    if (rc->flush->sq_used + k > kSqDepth) return Status::kOk;  // NULL: retry later
    auto r = std::make_unique<FlushReq>();
    r->comm = rc;
    for (int j = 0; j < k; ++j) {
      sge[j].addr = reinterpret_cast<uint64_t>(rc->flush_scratch);
      sge[j].lkey = rc->flush_lkey;
      wr[j].sg_list = &sge[j];
      wr[j].num_sge = 1;
      wr[j].next = j + 1 < k ? &wr[j + 1] : nullptr;
      // Only the last is signalled: READs on one QP complete in order.
      wr[j].send_flags = j + 1 == k ? IBV_SEND_SIGNALED : 0;
      wr[j].wr_id = j + 1 == k ? reinterpret_cast<uint64_t>(r.get()) : 0;
    }
    ibv_send_wr* bad = nullptr;
    const int e = ibv_post_send(rc->flush->qp, wr, &bad);
    if (e != 0) {
      NET_WARN("iflush: ibv_post_send failed: %s", std::strerror(e));
      return Status::kSystemError;
    }
    // Unsignalled READs still take send queue entries until the signalled one completes.
    r->wrs = k;
    rc->flush->sq_used += k;
    FlushReq* raw = r.release();
    rc->flushes.insert(raw);
    *request = raw;
    return Status::kOk;
  }

  Status dereg_mr(void* /*comm*/, void* mhandle) override {
    auto* m = static_cast<IbMr*>(mhandle);
    if (m == nullptr) return Status::kOk;
    if (m->magic != kMrMagic) {
      NET_WARN("deregMr: not a memory handle of this plugin");
      return Status::kInvalidArgument;
    }
    if (m->mr != nullptr && V().dereg_mr(m->mr) != 0) {
      NET_WARN("ibv_dereg_mr failed: %s", std::strerror(errno));
    }
    m->magic = 0;
    delete m;
    return Status::kOk;
  }

  Status isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
               void** request) override {
    *request = nullptr;
    auto* sc = static_cast<SendComm*>(send_comm);
    if (sc == nullptr || sc->magic != kSendMagic) {
      NET_WARN("isend: not a verbs send comm");
      return Status::kInvalidArgument;
    }
    DQ_CHECK(check_region(mhandle, data, size));
    if (size > INT_MAX || (size > 0 && data == nullptr)) {
      NET_WARN("isend: invalid buffer %p of %zu bytes (at most %d)", data, size, INT_MAX);
      return Status::kInvalidArgument;
    }
    std::lock_guard<std::mutex> lock(sc->mu);
    sc->progress();
    if (sc->failed) {
      NET_WARN("isend to %s: the connection has failed", sc->peer.c_str());
      return sc->fail_status;
    }
    if (sc->reqs.size() >= kMaxSendsPerComm) return Status::kOk;  // NULL: retry later
    auto r = std::make_unique<SendReq>();
    r->comm = sc;
    r->tag = tag;
    r->data = static_cast<char*>(data);
    r->size = size;
    if (size > 0) {
      auto* m = static_cast<IbMr*>(mhandle);
      if (m != nullptr && m->mr != nullptr) {
        r->lkey = m->mr->lkey;
      } else {
        DQ_CHECK(register_bytes(sc->dev->pd, data, size, &r->own_mr));
        r->lkey = r->own_mr->lkey;
      }
    }
    SendReq* raw = r.release();
    sc->reqs.insert(raw);
    sc->waiting.push_back(raw);
    sc->progress();  // match now if the receive is already posted
    *request = raw;
    return Status::kOk;
  }

  Status irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
               void** mhandles, void** request) override {
    *request = nullptr;
    RecvComm* rc = nullptr;
    if (Status st = grouped_call("irecv", recv_comm, n, 1, &rc); st != Status::kOk) return st;
    for (int i = 0; i < n; ++i) {
      DQ_CHECK(check_region(mhandles != nullptr ? mhandles[i] : nullptr, data[i], sizes[i]));
      if (sizes[i] > 0 && data[i] == nullptr) {
        NET_WARN("irecv: NULL buffer for %zu bytes", sizes[i]);
        return Status::kInvalidArgument;
      }
    }
    std::lock_guard<std::mutex> lock(rc->mu);
    rc->progress();
    if (rc->failed || rc->peer_closed) {
      NET_WARN("irecv from %s: the connection has %s", rc->peer.c_str(),
               rc->failed ? "failed" : "been closed by the peer");
      return rc->failed ? rc->fail_status : Status::kSystemError;
    }
    // Any free slot: a receive that stays posted long (an end marker, a control message) holds
    // its slot only, not the ring.
    size_t pos = kFifoDepth;
    for (size_t i = 0; i < kFifoDepth && pos == kFifoDepth; ++i) {
      size_t cand = (rc->next_seq + i) % kFifoDepth;
      if (rc->by_slot[cand] == nullptr) pos = cand;
    }
    if (pos == kFifoDepth || rc->sq_used >= kSqDepth) return Status::kOk;  // NULL: retry
    auto r = std::make_unique<RecvReq>();
    r->comm = rc;
    r->n = n;
    r->remaining = n;
    r->seq = rc->next_seq;
    FifoSlot& s = rc->fifo_src[pos];
    std::memset(&s, 0, sizeof(s));
    for (int i = 0; i < n; ++i) {
      r->capacity[i] = sizes[i];
      r->tag[i] = tags[i];
      uint32_t rkey = 0;
      auto* m = mhandles != nullptr ? static_cast<IbMr*>(mhandles[i]) : nullptr;
      if (sizes[i] > 0) {
        if (m != nullptr && m->mr != nullptr) {
          rkey = m->mr->rkey;
        } else {
          Status st = register_bytes(rc->dev->pd, data[i], sizes[i], &r->own_mr[i]);
          if (st != Status::kOk) {
            for (ibv_mr* own : r->own_mr) {
              if (own != nullptr) V().dereg_mr(own);
            }
            return st;
          }
          rkey = r->own_mr[i]->rkey;
        }
      }
      s.e[i].addr = reinterpret_cast<uint64_t>(data[i]);
      s.e[i].size = sizes[i];
      s.e[i].rkey = rkey;
      s.e[i].tag = tags[i];
    }
    s.n = static_cast<uint32_t>(n);
    s.seq = rc->next_seq + 1;
    s.check = ibwire::slot_check(reinterpret_cast<const uint64_t*>(&s), ibwire::kSlotCheckedWords);
    // The immediates' receive work requests are the QPs' standing pool (post_receives).
    ibv_sge sge{reinterpret_cast<uint64_t>(&s), sizeof(s), rc->fifo_src_lkey};
    ibv_send_wr w{};
    w.wr_id = kWrFifo;
    w.sg_list = &sge;
    w.num_sge = 1;
    w.opcode = IBV_WR_RDMA_WRITE;
    w.send_flags = IBV_SEND_SIGNALED;
    w.wr.rdma.remote_addr = rc->remote_fifo + pos * sizeof(FifoSlot);
    w.wr.rdma.rkey = rc->remote_fifo_rkey;
    ibv_send_wr* bad_s = nullptr;
    const int e = ibv_post_send(rc->qp, &w, &bad_s);
    if (e != 0) {
      rc->fail(std::string("posting a receive failed: ") + std::strerror(e));
      for (ibv_mr* own : r->own_mr) {
        if (own != nullptr) V().dereg_mr(own);
      }
      return Status::kSystemError;
    }
    if (rc->sq_used == 0) rc->last_progress = Clock::now();
    ++rc->sq_used;
    ++rc->next_seq;
    RecvReq* raw = r.release();
    rc->by_slot[pos] = raw;
    rc->reqs.insert(raw);
    *request = raw;
    return Status::kOk;
  }

  Status test(void* request, int* done, int* sizes) override {
    *done = 0;
    auto* magic = static_cast<uint32_t*>(request);
    if (magic == nullptr) {
      NET_WARN("test: NULL request");
      return Status::kInvalidArgument;
    }
    if (*magic == kSendReqMagic) {
      auto* r = static_cast<SendReq*>(request);
      SendComm* sc = r->comm;
      std::lock_guard<std::mutex> lock(sc->mu);
      if (!r->done) sc->progress();
      if (r->done) {
        *done = 1;
        if (sizes != nullptr) sizes[0] = static_cast<int>(r->size);
        if (r->own_mr != nullptr) V().dereg_mr(r->own_mr);
        sc->reqs.erase(r);
        r->magic = 0;
        delete r;
        return Status::kOk;
      }
      return sc->failed ? sc->fail_status : Status::kOk;
    }
    if (*magic == kFlushReqMagic) {
      auto* r = static_cast<FlushReq*>(request);
      RecvComm* rc = r->comm;
      std::lock_guard<std::mutex> lock(rc->mu);
      Status st = r->done ? Status::kOk : rc->poll_flushes();
      if (r->done) {
        *done = 1;
        if (sizes != nullptr) sizes[0] = 0;
        rc->flushes.erase(r);
        r->magic = 0;
        delete r;
        return Status::kOk;
      }
      if (st == Status::kOk && ms_since(r->start) > rc->timeout_ms) {
        rc->fail_status = Status::kTimeout;
        rc->fail("a flush did not complete within " + std::to_string(rc->timeout_ms) +
                 " ms (DYNAMIQ_NET_TIMEOUT_MS)");
        return Status::kTimeout;
      }
      return rc->failed ? rc->fail_status : st;
    }
    if (*magic == kRecvReqMagic) {
      auto* r = static_cast<RecvReq*>(request);
      RecvComm* rc = r->comm;
      std::lock_guard<std::mutex> lock(rc->mu);
      if (r->remaining > 0) rc->progress();
      if (r->remaining == 0) {
        *done = 1;
        for (int i = 0; sizes != nullptr && i < r->n; ++i) {
          sizes[i] = static_cast<int>(r->received[i]);
        }
        for (ibv_mr* own : r->own_mr) {
          if (own != nullptr) V().dereg_mr(own);
        }
        rc->reqs.erase(r);
        r->magic = 0;
        delete r;
        return Status::kOk;
      }
      return rc->failed ? rc->fail_status : Status::kOk;
    }
    NET_WARN("test: %p is not a request of this plugin", request);
    return Status::kInvalidArgument;
  }

  Status close_send(void* send_comm) override {
    return close_comm(static_cast<SendComm*>(send_comm), kSendMagic,
                     "closeSend: not a verbs send comm");
  }

  // `recv_comm` as a verbs receive comm for a call on n grouped buffers (min_n..maxRecvs).
  static Status grouped_call(const char* call, void* recv_comm, int n, int min_n, RecvComm** rc) {
    *rc = static_cast<RecvComm*>(recv_comm);
    if (*rc == nullptr || (*rc)->magic != kRecvMagic) {
      NET_WARN("%s: not a verbs receive comm", call);
      return Status::kInvalidArgument;
    }
    if (n < min_n || n > kMaxGroupedRecvs) {
      NET_WARN("%s: %d grouped receives (maxRecvs is %d)", call, n, kMaxGroupedRecvs);
      return Status::kInvalidArgument;
    }
    return Status::kOk;
  }

  Status close_recv(void* recv_comm) override {
    return close_comm(static_cast<RecvComm*>(recv_comm), kRecvMagic,
                     "closeRecv: not a verbs receive comm");
  }

  Status close_listen(void* listen_comm) override {
    return close_comm(static_cast<ListenComm*>(listen_comm), kListenMagic,
                     "closeListen: not a verbs listen comm");
  }

 private:
  // One close for the three kinds of comm: NULL is a no-op, a foreign pointer is refused, and the
  // magic is cleared before the delete so a second close of the same pointer is caught.
  template <class Comm>
  static Status close_comm(Comm* c, uint32_t magic, const char* foreign) {
    if (c == nullptr) return Status::kOk;
    if (c->magic != magic) {
      NET_WARN("%s", foreign);
      return Status::kInvalidArgument;
    }
    if constexpr (requires { c->close(); }) c->close();
    c->magic = 0;
    delete c;
    return Status::kOk;
  }

  Status check_dev(int dev) {
    DQ_CHECK(init());
    if (dev < 0 || dev >= static_cast<int>(devices_.size())) {
      NET_WARN("verbs device %d does not exist (%zu devices)", dev, devices_.size());
      return Status::kInvalidArgument;
    }
    return Status::kOk;
  }

  // Every comm of this backend starts with its magic (ListenComm and Conn).
  static const IbDevice* dev_of(void* comm) {
    if (comm == nullptr) return nullptr;
    const uint32_t magic = *static_cast<const uint32_t*>(comm);
    if (magic == kListenMagic) return static_cast<ListenComm*>(comm)->dev;
    if (magic == kSendMagic) return static_cast<SendComm*>(comm)->dev;
    if (magic == kRecvMagic) return static_cast<RecvComm*>(comm)->dev;
    return nullptr;
  }

  // The side channel listens on the socket backend's first device.
  static Status side_listen(const CommContext& ctx, char* handle, void** lc) {
    int n = 0;
    DQ_CHECK(socket_backend().devices(&n));
    if (n < 1) {
      NET_WARN("verbs: no socket interface for the side channel (DYNAMIQ_NET_IFNAME)");
      return Status::kUnsupported;
    }
    return socket_backend().listen(ctx, 0, handle, lc);
  }

  // Regions of a comm: (size, pointer out, lkey/rkey out).
  static Status add_region(Conn* c, size_t bytes, void** ptr, ibv_mr** mr) {
    *ptr = c->alloc(bytes);
    if (*ptr == nullptr) return Status::kOutOfMemory;
    DQ_CHECK(register_bytes(c->dev->pd, *ptr, bytes, mr));
    c->mrs.push_back(*mr);
    return Status::kOk;
  }

  Status start_connect(const IbDevice* dev, PendingConnect* pc) {
    pc->sc = std::make_unique<SendComm>();
    SendComm* sc = pc->sc.get();
    sc->dev = dev;
    sc->timeout_ms = read_net_env().timeout_ms;
    sc->peer = dev->name + " (connecting)";
    DQ_CHECK(sc->make_qps(static_cast<uint32_t>(read_net_env().ib_qps)));
    void* p = nullptr;
    ibv_mr* fifo_mr = nullptr;
    DQ_CHECK(add_region(sc, sizeof(FifoSlot) * kFifoDepth, &p, &fifo_mr));
    sc->fifo = static_cast<FifoSlot*>(p);
    ibv_mr* rec_mr = nullptr;
    DQ_CHECK(add_region(sc, sizeof(uint64_t) * kRqDepth, &p, &rec_mr));
    sc->records = static_cast<uint64_t*>(p);
    sc->records_lkey = rec_mr->lkey;
    DQ_CHECK(side_listen(pc->ctx, pc->reply_handle, &pc->reply_lc));
    sc->fill_ctl(&pc->out, ibwire::kConnect);
    pc->out.addr = reinterpret_cast<uint64_t>(sc->fifo);
    pc->out.rkey = fifo_mr->rkey;
    wire::Handle reply;
    std::memcpy(&reply, pc->reply_handle, sizeof(reply));
    reply.nsocks = 1;
    std::memcpy(pc->out.reply_handle, &reply, sizeof(reply));
    return Status::kOk;
  }

  Status progress_connect(PendingConnect* pc, void** send_comm) {
    SendComm* sc = pc->sc.get();
    if (pc->stage == 0) {
      DQ_CHECK(socket_backend().connect(pc->ctx, 0, pc->sock_handle, &sc->side_send));
      if (sc->side_send == nullptr) return Status::kOk;
      pc->stage = 1;
    }
    if (pc->stage == 1) {
      bool done = false;
      DQ_CHECK(send_ctl(sc->side_send, &pc->out, &pc->req, &done));
      if (!done) return Status::kOk;
      pc->stage = 2;
    }
    if (pc->stage == 2) {
      DQ_CHECK(socket_backend().accept(pc->reply_lc, &sc->side_recv));
      if (sc->side_recv == nullptr) return Status::kOk;
      pc->stage = 3;
    }
    bool done = false;
    Status st = recv_ctl(sc->side_recv, &pc->in, &pc->req, &done);
    if (st != Status::kOk) return st;
    if (!done) return Status::kOk;
    const char* bad = ibwire::check_ctl(pc->in, ibwire::kAccept);
    if (bad != nullptr) {
      NET_WARN("verbs connect: refused the listener's answer: %s", bad);
      return Status::kMalformedPayload;
    }
    sc->remote_records = pc->in.addr;
    sc->remote_records_rkey = pc->in.rkey;
    DQ_CHECK(sc->connect(pc->in, pc->ctx.traffic_class));
    DQ_CHECK(sc->post_side_recv());
    sc->peer = sc->dev->name + " -> QP " + std::to_string(pc->in.qpn[0]) +
               (pc->in.nqps > 1 ? " (+" + std::to_string(pc->in.nqps - 1) + " striped)" : "");
    sc->last_progress = Clock::now();
    NET_INFO("verbs connected: %s", sc->peer.c_str());
    socket_backend().close_listen(pc->reply_lc);
    pc->reply_lc = nullptr;
    *send_comm = pc->sc.release();
    return Status::kOk;
  }

  Status progress_accept(ListenComm* lc, ListenComm::Pending* p, bool* ready) {
    *ready = false;
    RecvComm* rc = p->rc.get();
    if (p->stage == 0) {
      bool done = false;
      DQ_CHECK(recv_ctl(rc->side_recv, &p->in, &p->req, &done));
      if (!done) return Status::kOk;
      const char* bad = ibwire::check_ctl(p->in, ibwire::kConnect);
      if (bad != nullptr) {
        NET_WARN("verbs accept: refused a connection: %s", bad);
        return Status::kMalformedPayload;
      }
      wire::Handle reply;
      std::memcpy(&reply, p->in.reply_handle, sizeof(reply));
      if (reply.nsocks != 1) {
        NET_WARN("verbs accept: refused a connection: reply handle asks for %u sockets",
                 reply.nsocks);
        return Status::kMalformedPayload;
      }
      reply.connect_state = 0;
      std::memcpy(p->reply, &reply, sizeof(reply));
      DQ_CHECK(rc->make_qps(p->in.nqps));  // the connector's count (check_ctl bounded it)
      void* ptr = nullptr;
      ibv_mr* src_mr = nullptr;
      DQ_CHECK(add_region(rc, sizeof(FifoSlot) * kFifoDepth, &ptr, &src_mr));
      rc->fifo_src = static_cast<FifoSlot*>(ptr);
      rc->fifo_src_lkey = src_mr->lkey;
      ibv_mr* rec_mr = nullptr;
      DQ_CHECK(add_region(rc, sizeof(uint64_t) * kRqDepth, &ptr, &rec_mr));
      rc->records = static_cast<uint64_t*>(ptr);
      rc->remote_fifo = p->in.addr;
      rc->remote_fifo_rkey = p->in.rkey;
      DQ_CHECK(rc->connect(p->in, lc->ctx.traffic_class));
      for (size_t q = 0; q < rc->qps.size(); ++q) DQ_CHECK(rc->post_receives(q, kRqDepth));
      rc->fill_ctl(&p->out, ibwire::kAccept);
      p->out.addr = reinterpret_cast<uint64_t>(rc->records);
      p->out.rkey = rec_mr->rkey;
      p->stage = 1;
    }
    if (p->stage == 1) {
      DQ_CHECK(socket_backend().connect(lc->ctx, 0, p->reply, &rc->side_send));
      if (rc->side_send == nullptr) return Status::kOk;
      p->stage = 2;
    }
    bool done = false;
    DQ_CHECK(send_ctl(rc->side_send, &p->out, &p->req, &done));
    if (!done) return Status::kOk;
    DQ_CHECK(rc->post_side_recv());
    rc->peer = rc->dev->name + " <- QP " + std::to_string(p->in.qpn[0]) +
               (p->in.nqps > 1 ? " (+" + std::to_string(p->in.nqps - 1) + " striped)" : "");
    rc->last_progress = Clock::now();
    *ready = true;
    return Status::kOk;
  }

  std::mutex init_mu_;
  pid_t init_pid_ = 0;  // the process that discovered devices_
  Status init_status_ = Status::kOk;
  std::string why_;
  std::deque<IbDevice> devices_;  // stable addresses: comms point at their device
};

IbNet& ib_net() {
  static IbNet* backend = new IbNet;  // never destroyed: comms may outlive statics
  return *backend;
}

}  // namespace

NetBackend& ib_backend() {
  return ib_net();
}

bool ib_usable(std::string* why) {
  if (ib_net().init() == Status::kOk) return true;
  *why = ib_net().why();
  return false;
}

}  // namespace dq::net
