// The types the files of the ibverbs backend share (private to plugin/ibverbs/): limits and
// magic words, a verbs port (IbDevice), a registered region (IbMr), one connection's queue pairs
// and side channel (Conn), the send and receive comms and their requests, the listen comm and a
// connect in progress, and the backend class (IbNet), whose calls are defined by concern:
//   ib_discovery.cc     the verbs ports, init and device properties
//   ib_connect.cc       queue pair setup, the side-channel handshake, listen/connect/accept
//   ib_datapath.cc      isend/irecv/test and the progress of both directions
//   ib_registration.cc  memory registration, DMA-BUF, GPUDirect flushes
//   ib_backend.cc       close calls, the backend's instance
// Wire formats and the protocol: ib_wire.h. libibverbs itself: ib_loader.h.
#pragma once

#include <infiniband/verbs.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "plugin/ibverbs/ib_loader.h"
#include "plugin/ibverbs/ib_wire.h"
#include "plugin/net_backend.h"
#include "plugin/net_backend_common.h"
#include "plugin/net_env.h"
#include "plugin/net_log.h"

namespace dq::net::ib {

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
// The local ACK timeout and retries are settings (IbDevice): by default 4.096 us * 2^18 = 1.07 s
// and 7 retries, NCCL's defaults, so a peer QP that is not yet ready to receive (still finishing
// its connect) gets about 7 s before the transfer fails.
constexpr uint8_t kRnrRetry = 7;  // 7 = retry forever (receives are always posted first anyway)

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
  // The queue pairs' attributes (NetEnv: DYNAMIQ_NET_IB_TC etc., else NCCL_IB_TC etc.). A
  // communicator's own traffic class (ncclConfig_t) takes precedence over traffic_class.
  uint8_t traffic_class = 0;
  uint8_t service_level = 0;
  uint8_t ack_timeout = 18;  // 4.096 us x 2^ack_timeout a try
  uint8_t retry_count = 7;
};

// Loads libibverbs (once per process) and appends every active port that DYNAMIQ_NET_IB_HCA
// selects and that has an address (a LID, or a RoCE GID) to *out; kUnsupported with *why when
// there is none.
Status discover_ib_devices(const NetEnv& env, std::deque<IbDevice>* out, std::string* why);

// ---------------------------------------------------------------- registered memory

// A memory handle of this backend: the region the shared checks read first (check_region,
// net_backend_common.h), then the verbs registration.
struct IbMr {
  RegisteredRegion region{kMrMagic, nullptr, 0};
  ibv_mr* mr = nullptr;      // NULL for an empty region
  int type = NCCL_PTR_HOST;  // NCCL_PTR_CUDA: device memory (a receive into it is flushed)
};
static_assert(std::is_standard_layout_v<IbMr>, "check_region reads an IbMr as its region");

// What the peer's work requests and the local ones may do to a registered region.
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

// Registers `size` bytes at `data` with protection domain `pd` (logged on failure), with
// relaxed ordering where it is on.
Status register_bytes(ibv_pd* pd, void* data, size_t size, ibv_mr** out);

// Relaxed ordering of the process's registrations, decided once at discovery from
// DYNAMIQ_NET_IB_PCI_RELAXED_ORDERING (0 off, 1 on, 2 where taken) and libibverbs; logged. In
// mode 2 the first registration the device refuses with it turns it off, and is made without.
void set_relaxed_ordering(int mode);
// The access flags a registration adds: IBV_ACCESS_RELAXED_ORDERING, or 0.
int relaxed_ordering_access();

// ---------------------------------------------------------------- one endpoint (QP + CQ)

// One try's nominal local ACK timeout: 4.096 us x 2^ack_timeout, in ms.
inline double ack_try_ms(int ack_timeout) {
  return 4.096e-3 * std::ldexp(1.0, ack_timeout);
}

// The data path's stall bound (ms) for queue pairs that retry `retry_count` times with a local
// ACK timeout of ack_try_ms(ack_timeout): DYNAMIQ_NET_TIMEOUT_MS, or longer where the HCA may
// still be retransmitting then. The IB specification lets a try last up to 4x its nominal time;
// a job's NCCL_IB_TIMEOUT=23 makes one try 34 s, past the 30 s default, and a lost packet the
// HCA would have resent must not fail the connection.
inline int64_t stall_bound_ms(int64_t net_timeout_ms, int ack_timeout, int retry_count) {
  const auto retries_ms =
      static_cast<int64_t>(std::ceil(4.0 * (retry_count + 1) * ack_try_ms(ack_timeout)));
  return std::max(net_timeout_ms, retries_ms);
}

// What every connection has: its QPs (qps[0] also carries the FIFO and the size records), one
// CQ for all of them, the side channel, the failure state.
struct Conn {
  uint32_t magic = 0;  // first: kSendMagic or kRecvMagic (dev_of reads it)
  const IbDevice* dev = nullptr;
  std::string peer;            // for logs: "verbs device <- side channel peer"
  int64_t timeout_ms = 30000;  // DYNAMIQ_NET_TIMEOUT_MS: the set-up's network steps
  int64_t stall_ms = 30000;    // a transfer without progress (stall_bound_ms())
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;               // qps[0]
  std::vector<ibv_qp*> qps;           // 1..kMaxQps
  std::vector<uint32_t> psns;         // their initial packet sequence numbers
  int qp_used[ibwire::kMaxQps] = {};  // per QP: send work requests posted and not yet retired
  void* side_send = nullptr;          // socket send comm to the peer
  void* side_recv = nullptr;          // socket receive comm from the peer
  void* bye_req = nullptr;  // receive posted on side_recv: kBye, or an error when the peer dies
  Ctl bye{};
  std::vector<ibv_mr*> mrs;   // the comm's own regions (FIFO, size records)
  std::vector<void*> blocks;  // their memory (posix_memalign)

  std::mutex mu;
  bool failed = false;
  Status fail_status = Status::kSystemError;
  bool peer_closed = false;
  int sq_used = 0;  // send work requests posted and not yet retired, all QPs
  Clock::time_point last_progress = Clock::now();

  // Marks the connection failed with `status`, what every later call on it returns: the first
  // failure's status and message stand (a timeout after a malformed message still reports the
  // message). mu held.
  void fail(Status status, const std::string& why) {
    if (failed) return;
    fail_status = status;
    fail(why);
  }
  // The same with the default status, kSystemError (the first failure only is logged). mu held.
  void fail(const std::string& why, bool warn = true) {
    if (failed) return;
    failed = true;
    if (warn) {
      NET_WARN("verbs connection with %s failed: %s", peer.c_str(), why.c_str());
    } else {
      NET_INFO("verbs connection with %s ended: %s", peer.c_str(), why.c_str());
    }
  }

  // timeout_ms and stall_ms from DYNAMIQ_NET_TIMEOUT_MS and the device's retry settings.
  void set_timeouts(int64_t net_timeout_ms) {
    timeout_ms = net_timeout_ms;
    stall_ms = stall_bound_ms(net_timeout_ms, dev->ack_timeout, dev->retry_count);
  }

  // Side channel: the peer's kBye (orderly close) or its death (error on the posted receive).
  void poll_side();  // mu held

  // Posts the receive of the peer's kBye on side_recv (poll_side watches it).
  Status post_side_recv();

  // `bytes` zeroed, page-aligned bytes freed by close() (blocks). Whole pages: with fork support
  // (ib_discovery.cc) a registered page is left out of forked children, so it must hold nothing
  // else of the process's.
  void* alloc(size_t bytes) {
    const long page = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096;
    bytes = (bytes + page - 1) / page * page;
    void* p = nullptr;
    if (posix_memalign(&p, static_cast<size_t>(page), bytes) != 0) return nullptr;
    std::memset(p, 0, bytes);
    blocks.push_back(p);
    return p;
  }

  // `nqps` RC QPs on one CQ. remote_access: what the peer's work requests may do to this
  // connection's memory (the flush QP, whose peer is itself, reads).
  Status make_qps(uint32_t nqps,
                  int remote_access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE);

  // Index of the QP of a work completion (wc.qp_num) in qps, or -1.
  int qp_index(uint32_t qp_num) const {
    for (size_t i = 0; i < qps.size(); ++i) {
      if (qps[i]->qp_num == qp_num) return static_cast<int>(i);
    }
    return -1;
  }

  // A control message of `kind` describing this end: its QPs, address, MTU and FIFO limits.
  void fill_ctl(Ctl* c, uint16_t kind) const;

  // Every QP INIT -> RTR -> RTS towards its peer QP described by `c` (already checked).
  Status connect(const Ctl& c, int traffic_class);

  // QP i to RTR towards the peer's QP i, then to RTS.
  Status connect_qp(size_t i, const Ctl& c, int traffic_class);
  // The first queue pair's traffic class, service level, timeout and retries, queried back.
  std::string qp_attributes() const;

  // Orderly close: kBye to the peer (bounded wait), then release().
  void close();
  // The side channel, QPs, CQ and regions released, without a word to the peer. Idempotent.
  void release();
  // A connection dropped on an error path (a set-up that failed half way) leaks nothing.
  ~Conn() { release(); }

  // A failed work completion in words, for fail().
  std::string wc_error(const ibv_wc& wc) const;
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
  uint64_t frontier = 0;              // every posting with seq <= frontier has been taken into snap
  std::deque<SendReq*> waiting;       // isend order, not matched yet
  std::unordered_set<SendReq*> reqs;

  ~SendComm();

  // Takes slot `pos` if the receiver wrote a new posting there and all of it has landed (its
  // check word matches): false while there is none or it is still arriving.
  bool take_new_posting(uint32_t pos);

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
  Status post(SendReq* r, uint32_t pos, int e);

  // Completions, matching of waiting sends to posted receives, fault detection.
  void progress();  // mu held
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
// Its READs wait for room in the flush QP's send queue where it is full: the request exists
// either way, since NCCL takes a NULL one as already flushed.
struct FlushReq {
  uint32_t magic = kFlushReqMagic;
  RecvComm* comm = nullptr;
  bool done = false;
  int wrs = 0;  // send queue entries its READs hold until the signalled last one completes
  uint64_t addr[kMaxGroupedRecvs] = {};  // the one-byte READs: source address and key each
  uint32_t rkey[kMaxGroupedRecvs] = {};
  Clock::time_point start = Clock::now();
};

struct RecvComm : Conn {
  RecvComm() { magic = kRecvMagic; }
  // The flush QP (made at the first iflush that needs one; peer: itself) and its scratch.
  std::unique_ptr<Conn> flush;
  uint32_t* flush_scratch = nullptr;
  uint32_t flush_lkey = 0;
  std::unordered_set<FlushReq*> flushes;
  std::deque<FlushReq*> unposted_flushes;  // in iflush order, waiting for send queue room

  FifoSlot* fifo_src = nullptr;  // local copy of each slot, source of the FIFO writes
  uint32_t fifo_src_lkey = 0;
  uint64_t* records = nullptr;  // written by the sender (size records)
  uint64_t remote_fifo = 0;
  uint32_t remote_fifo_rkey = 0;
  uint64_t next_seq = 0;              // the next posting's receive index
  RecvReq* by_slot[kFifoDepth] = {};  // per FIFO slot: the receive posted there, or NULL
  std::unordered_set<RecvReq*> reqs;

  ~RecvComm();

  // The flush QP and its registered scratch word (ib_registration.cc). mu held.
  Status make_flush_qp();
  // Polls the flush QP's completions into their requests, then posts the READs of the
  // unposted flushes, in order, while the send queue has room for them. mu held.
  Status poll_flushes();

  // Posts n zero-length receives on QP q: each takes one WRITE WITH IMM. Every QP keeps
  // kRqDepth posted (one per grouped receive the FIFO can hold; an entry takes at most one per
  // QP), topped up as they complete, so a stripe never meets an empty receive queue.
  Status post_receives(size_t q, int n);

  // Completions of the sender's writes into receives, fault detection. mu held.
  void progress();
};

// ---------------------------------------------------------------- connection setup

// A verbs listener: the side channel's socket listener, and the connections arriving on it that
// are still in their handshake.
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
    Ctl ready{};
    // 0: receiving kConnect, 1: connecting back, 2: sending kAccept, 3: receiving kReady
    int stage = 0;
    Clock::time_point start = Clock::now();

    // A set-up dropped (failed, timed out, or its listener closed): its connect back, which no
    // later accept call would resume, and its connection closed.
    ~Pending() {
      if (stage == 1) socket_forget_connect(reply);
      if (rc) rc->close();
    }
  };
  std::vector<std::unique_ptr<Pending>> pending;

  ~ListenComm() {
    pending.clear();
    if (sock_lc != nullptr) socket_backend().close_listen(sock_lc);
  }
};

// A connect in progress (the connect call returns NULL until the handshake is done).
struct PendingConnect {
  std::unique_ptr<SendComm> sc;
  CommContext ctx;
  char sock_handle[NCCL_NET_HANDLE_MAXSIZE] = {};  // the listener's, progress of its connect
  // This end's own socket listener, which the listener connects back to (its handle travels
  // in kConnect): the side channel's receive direction.
  char reply_handle[NCCL_NET_HANDLE_MAXSIZE] = {};
  void* reply_lc = nullptr;
  Ctl out{};
  Ctl in{};
  void* req = nullptr;
  // 0: connecting, 1: sending kConnect, 2: accepting the reply, 3: receiving it, 4: sending kReady
  int stage = 0;
  Clock::time_point start = Clock::now();
  bool wait_logged = false;  // the INFO line that the peer has not answered yet was logged

  // A connect dropped (failed or timed out): in stage 0 its side-channel connect, which no
  // later connect call would resume, then this end's listener and the connection.
  ~PendingConnect() {
    if (stage == 0) socket_forget_connect(sock_handle);
    if (reply_lc != nullptr) socket_backend().close_listen(reply_lc);
    if (sc) sc->close();
  }
};

// ---------------------------------------------------------------- the backend

class IbNet final : public NetBackend {
 public:
  Status init() override;
  // Why init() failed (libibverbs, a device, an active port, an address missing).
  const std::string& why() const { return why_; }
  // For tests over fake verbs in the process: `d` is this process's only device, no discovery.
  void use_device_for_testing(const IbDevice& d);
  Status devices(int* ndev) override;
  Status get_properties(int dev, dqNetPropertiesV11* props) override;
  Status listen(const CommContext& ctx, int dev, void* handle, void** listen_comm) override;
  Status connect(const CommContext& ctx, int dev, void* handle, void** send_comm) override;
  Status accept(void* listen_comm, void** recv_comm) override;
  Status reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) override;
  Status reg_mr_dma_buf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                        void** mhandle) override;
  Status iflush(void* recv_comm, int n, void** data, const int* sizes, void** mhandles,
                void** request) override;
  Status dereg_mr(void* comm, void* mhandle) override;
  Status isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
               void** request) override;
  Status irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
               void** mhandles, void** request) override;
  Status test(void* request, int* done, int* sizes) override;
  Status close_send(void* send_comm) override;
  Status close_recv(void* recv_comm) override;
  Status close_listen(void* listen_comm) override;

 private:
  // `recv_comm` as a verbs receive comm for a call on n grouped buffers (min_n..maxRecvs).
  static Status grouped_call(const char* call, void* recv_comm, int n, int min_n, RecvComm** rc);
  Status check_dev(int dev);
  // The device of any comm of this backend (each starts with its magic), or NULL.
  static const IbDevice* dev_of(void* comm);
  // The side channel listens on the socket backend's first device.
  static Status side_listen(const CommContext& ctx, char* handle, void** lc);
  // A region of `bytes` zeroed bytes of comm `c`, registered: *ptr, *mr (its keys).
  static Status add_region(Conn* c, size_t bytes, void** ptr, ibv_mr** mr);
  Status start_connect(const IbDevice* dev, PendingConnect* pc);
  Status progress_connect(PendingConnect* pc, void** send_comm);
  // While a connect waits for the peer's answer: kOk while the side channel's send direction is
  // up, an error (logged) once the peer closed or reset it.
  static Status peer_alive(PendingConnect* pc);
  Status progress_accept(ListenComm* lc, ListenComm::Pending* p, bool* ready);

  std::mutex init_mu_;
  pid_t init_pid_ = 0;  // the process that discovered devices_
  Status init_status_ = Status::kOk;
  std::string why_;
  std::deque<IbDevice> devices_;  // stable addresses: comms point at their device
};

// The backend's one instance.
IbNet& ib_net();

}  // namespace dq::net::ib
