// Socket backend of the net plugin: TCP, several sockets per connection, one I/O thread per
// socket. Receives are matched by tag (FIFO per tag); a message that arrives before its receive
// is posted is staged in host memory and copied when the receive is posted.
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "plugin/net_backend.h"
#include "plugin/net_devices.h"
#include "plugin/net_env.h"
#include "plugin/net_log.h"
#include "plugin/socket/socket_io.h"
#include "plugin/socket/socket_parse.h"
#include "plugin/socket/socket_wire.h"

namespace dq::net {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kListenCommMagic = 0x4c434e44;
constexpr uint32_t kSendCommMagic = 0x53434e44;
constexpr uint32_t kRecvCommMagic = 0x52434e44;
constexpr uint32_t kSendRequestMagic = 0x53524e44;
constexpr uint32_t kRecvRequestMagic = 0x52524e44;
constexpr uint32_t kMrMagic = 0x4d524e44;
constexpr size_t kMaxRequestsPerComm = 1024;  // isend/irecv return a NULL request beyond this
constexpr int kMaxAcceptsPerCall = 64;

int64_t ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

void close_fd(int* fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

struct MemoryRegion {
  uint32_t magic = kMrMagic;
  const char* base;
  size_t size;
};

// ---------------------------------------------------------------- send side

struct SendComm;

struct SendRequest {
  uint32_t magic = kSendRequestMagic;
  SendComm* comm;
  uint64_t seq = 0;
  int tag = 0;
  const char* data = nullptr;
  size_t size = 0;
  wire::Split split{};
  int parts_left = 0;  // guarded by comm->mu
  bool done = false;   // guarded by comm->mu
};

struct SendComm {
  uint32_t magic = kSendCommMagic;
  std::string peer;
  int64_t timeout_ms = 30000;
  std::vector<int> fds;
  std::vector<std::thread> threads;
  std::atomic<bool> stop{false};

  std::mutex mu;
  std::condition_variable cv;
  bool failed = false;
  uint64_t next_seq = 0;
  std::vector<std::deque<SendRequest*>> queues;  // per socket, in seq order
  std::unordered_set<SendRequest*> requests;

  void fail(const std::string& why) {  // mu held
    if (failed) return;
    failed = true;
    NET_WARN("send connection to %s failed: %s", peer.c_str(), why.c_str());
    for (int fd : fds) shutdown(fd, SHUT_RDWR);
    cv.notify_all();
  }

  void run(int k) {
    int fd = fds[static_cast<size_t>(k)];
    // Bounded by stop/failure; each pass sends one message part or waits one slice.
    for (;;) {
      SendRequest* req = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu);
        while (queues[static_cast<size_t>(k)].empty()) {
          if (stop.load() || failed) return;
          cv.wait_for(lock, std::chrono::milliseconds(kPollSliceMs));
        }
        if (failed) return;
        req = queues[static_cast<size_t>(k)].front();
      }
      const char* body = req->data + req->split.offset(k);
      size_t body_len = req->split.len(k, req->size);
      int err = 0;
      IoEnd end;
      if (k == 0) {
        wire::MsgHeader h{wire::kMsgMagic, req->tag, req->seq, req->size};
        end = write_full(fd, &h, sizeof(h), body, body_len, stop, timeout_ms, &err);
      } else {
        wire::PartHeader h{wire::kPartMagic, static_cast<uint32_t>(k), req->seq,
                           req->split.offset(k), body_len};
        end = write_full(fd, &h, sizeof(h), body, body_len, stop, timeout_ms, &err);
      }
      std::lock_guard<std::mutex> lock(mu);
      if (end != IoEnd::kDone) {
        if (end != IoEnd::kStopped) {
          fail(std::string("socket ") + std::to_string(k) + ": " + io_end_name(end) +
               (err != 0 ? std::string(" (") + std::strerror(err) + ")" : ""));
        }
        return;
      }
      queues[static_cast<size_t>(k)].pop_front();
      if (--req->parts_left == 0) req->done = true;
    }
  }
};

// ---------------------------------------------------------------- receive side

struct RecvRequest;

struct RecvSlot {
  RecvRequest* req = nullptr;
  char* data = nullptr;
  size_t capacity = 0;
  int tag = 0;
  size_t received = 0;
  bool done = false;
};

struct RecvRequest {
  uint32_t magic = kRecvRequestMagic;
  struct RecvComm* comm;
  int n = 0;
  int remaining = 0;  // guarded by comm->mu
  RecvSlot slots[kMaxGroupedRecvs];
};

struct RecvMsg {
  uint64_t seq;
  int tag;
  size_t size;
  wire::Split split;
  char* dest = nullptr;     // the matched receive buffer, or `staging`
  char* staging = nullptr;  // malloc'd while no receive was posted at header time
  RecvSlot* slot = nullptr;
  int parts_left;
  bool complete = false;
  uint32_t parts_seen = 1;  // bit k: part k's header was read (part 0 comes with the header)
};

struct RecvComm {
  uint32_t magic = kRecvCommMagic;
  std::string peer;
  int64_t timeout_ms = 30000;
  std::vector<int> fds;
  std::vector<std::thread> threads;
  std::atomic<bool> stop{false};

  std::mutex mu;
  std::condition_variable cv;
  bool failed = false;
  // What a receive on a failed connection returns: kMalformedPayload when the peer's bytes
  // failed validation, kSystemError otherwise (closed, reset, timed out, out of memory).
  Status fail_status = Status::kSystemError;
  int clean_eofs = 0;
  uint64_t next_seq = 0;
  // Socket 0 is inside a message (its own stall bound applies); other sockets waiting for a
  // header do not count that time against their bound.
  bool headers_busy = false;
  std::map<uint64_t, RecvMsg*> active;  // header read, parts outstanding
  std::deque<RecvMsg*> unexpected;      // header read, no receive matched yet (seq order)
  std::deque<RecvSlot*> posted;         // receives waiting for a message (posting order)
  std::unordered_set<RecvRequest*> requests;

  ~RecvComm() {
    for (auto& [seq, msg] : active) {
      (void)seq;
      if (msg->slot == nullptr) continue;  // owned by `unexpected`
      std::free(msg->staging);
      delete msg;
    }
    for (RecvMsg* msg : unexpected) {
      std::free(msg->staging);
      delete msg;
    }
    for (RecvRequest* r : requests) delete r;
  }

  void fail(const std::string& why, bool warn = true) {  // mu held
    if (failed) return;
    failed = true;
    if (warn) {
      NET_WARN("receive connection from %s failed: %s", peer.c_str(), why.c_str());
    } else {
      NET_INFO("receive connection from %s ended: %s", peer.c_str(), why.c_str());
    }
    for (int fd : fds) shutdown(fd, SHUT_RDWR);
    cv.notify_all();
  }

  // The peer's bytes failed validation.
  void malformed(const std::string& why) {  // mu held
    if (failed) return;
    fail("malformed frame: " + why);
    fail_status = Status::kMalformedPayload;
  }

  // The receive `slot` takes message `msg`; copies now if the message is already complete.
  void bind_message(RecvMsg* msg, RecvSlot* slot) {  // mu held; size already checked
    msg->slot = slot;
    if (msg->complete) finish(msg);
  }

  void finish(RecvMsg* msg) {  // mu held; msg complete and bound
    RecvSlot* slot = msg->slot;
    if (msg->staging != nullptr) {
      if (msg->size > 0) std::memcpy(slot->data, msg->staging, msg->size);
      std::free(msg->staging);
    }
    slot->received = msg->size;
    slot->done = true;
    slot->req->remaining--;
    delete msg;
  }

  void part_done(RecvMsg* msg) {  // mu held
    if (--msg->parts_left > 0) return;
    msg->complete = true;
    active.erase(msg->seq);
    if (msg->slot != nullptr) finish(msg);
  }

  bool oversized(const RecvMsg* msg, const RecvSlot* slot) {  // mu held
    if (msg->size <= slot->capacity) return false;
    fail("message " + std::to_string(msg->seq) + " with tag " + std::to_string(msg->tag) +
         " carries " + std::to_string(msg->size) + " bytes but the posted receive holds only " +
         std::to_string(slot->capacity));
    return true;
  }

  // Stream end on socket k: orderly close between messages is not an error unless receives
  // are still waiting; anything else fails the connection.
  void end_of_stream(int k, IoEnd end, bool mid_message, int err) {
    std::lock_guard<std::mutex> lock(mu);
    if (end == IoEnd::kStopped || failed) return;
    if (end == IoEnd::kEof && !mid_message) {
      if (++clean_eofs < static_cast<int>(fds.size())) return;
      bool waiting = !posted.empty() || !active.empty();
      fail("peer closed the connection", /*warn=*/waiting);
      return;
    }
    fail(std::string("socket ") + std::to_string(k) + ": " + io_end_name(end) +
         (mid_message ? " in the middle of a message" : "") +
         (err != 0 ? std::string(" (") + std::strerror(err) + ")" : ""));
  }

  void run_headers() {
    int fd = fds[0];
    // Bounded by stop/failure/end of stream; each pass receives one message header + part 0.
    for (;;) {
      wire::MsgHeader h{};
      bool began = false;
      int err = 0;
      IoEnd end = read_full(fd, &h, sizeof(h), /*idle_ok=*/true, stop, timeout_ms, &began, &err);
      if (end != IoEnd::kDone) return end_of_stream(0, end, began, err);
      RecvMsg* msg = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (failed) return;
        switch (wire::check_msg_header(h, next_seq)) {
          case wire::MsgCheck::kOk:
            break;
          case wire::MsgCheck::kBadMagic:
            return malformed("bad message magic");
          case wire::MsgCheck::kTooLarge:
            return malformed("message size " + std::to_string(h.size) +
                             " exceeds the 1 TiB limit");
          case wire::MsgCheck::kBadSeq:
            return malformed("sequence " + std::to_string(h.seq) + ", expected " +
                             std::to_string(next_seq));
        }
        ++next_seq;
        msg = new RecvMsg{
            h.seq,   h.tag,   h.size,  wire::split_message(h.size, static_cast<int>(fds.size())),
            nullptr, nullptr, nullptr, 0,
            false,   1u};
        msg->parts_left = msg->split.parts;
        auto it = std::find_if(posted.begin(), posted.end(),
                               [&](const RecvSlot* s) { return s->tag == h.tag; });
        if (it != posted.end()) {
          RecvSlot* slot = *it;
          posted.erase(it);
          if (oversized(msg, slot)) {
            delete msg;
            return;
          }
          msg->slot = slot;
          msg->dest = slot->data;
        } else {
          msg->staging = static_cast<char*>(std::malloc(std::max<size_t>(h.size, 1)));
          if (msg->staging == nullptr) {
            delete msg;
            return fail("cannot stage an unexpected message of " + std::to_string(h.size) +
                        " bytes: out of memory");
          }
          msg->dest = msg->staging;
          unexpected.push_back(msg);
        }
        active[msg->seq] = msg;
        headers_busy = true;
        cv.notify_all();
      }
      end = read_full(fd, msg->dest, msg->split.len(0, msg->size), false, stop, timeout_ms, &began,
                     &err);
      if (end != IoEnd::kDone) return end_of_stream(0, end, true, err);
      std::lock_guard<std::mutex> lock(mu);
      headers_busy = false;
      part_done(msg);
    }
  }

  void run_parts(int k) {
    int fd = fds[static_cast<size_t>(k)];
    for (;;) {  // bounded like run_headers
      wire::PartHeader h{};
      bool began = false;
      int err = 0;
      IoEnd end = read_full(fd, &h, sizeof(h), /*idle_ok=*/true, stop, timeout_ms, &began, &err);
      if (end != IoEnd::kDone) return end_of_stream(k, end, began, err);
      RecvMsg* msg = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu);
        if (!wire::part_header_valid(h, k)) {
          return malformed("bad part header on socket " + std::to_string(k));
        }
        // The header for this seq comes on socket 0; wait for it, bounded by the timeout.
        Clock::time_point start = Clock::now();
        for (;;) {
          if (failed || stop.load()) return;
          auto it = active.find(h.seq);
          if (it != active.end()) {
            msg = it->second;
            break;
          }
          if (h.seq < next_seq) {
            return malformed("part for message " + std::to_string(h.seq) +
                             " which is not in flight");
          }
          if (headers_busy) start = Clock::now();
          if (ms_since(start) > timeout_ms) {
            return fail("timed out waiting for the header of message " + std::to_string(h.seq));
          }
          cv.wait_for(lock, std::chrono::milliseconds(kPollSliceMs));
        }
        if ((msg->parts_seen >> k) & 1u) {
          return malformed("part " + std::to_string(k) + " of message " + std::to_string(h.seq) +
                           " arrived twice");
        }
        if (!wire::part_matches(h, k, msg->split, msg->size, msg->parts_seen)) {
          return malformed("part " + std::to_string(k) + " of message " + std::to_string(h.seq) +
                           " has offset/length " + std::to_string(h.offset) + "/" +
                           std::to_string(h.len));
        }
        msg->parts_seen |= 1u << k;
      }
      end = read_full(fd, msg->dest + h.offset, h.len, false, stop, timeout_ms, &began, &err);
      if (end != IoEnd::kDone) return end_of_stream(k, end, true, err);
      std::lock_guard<std::mutex> lock(mu);
      part_done(msg);
    }
  }
};

// ---------------------------------------------------------------- listen side

struct PendingSocket {
  int fd = -1;
  std::string peer;
  wire::Hello hello{};
  size_t got = 0;
  Clock::time_point start;
};

using wire::PendingGroup;

struct ListenComm {
  uint32_t magic = kListenCommMagic;
  int fd = -1;
  uint64_t secret = 0;
  uint64_t comm_id = 0;
  bool has_comm_id = false;
  int64_t timeout_ms = 30000;
  std::mutex mu;
  std::vector<PendingSocket> pending;
  std::vector<PendingGroup> groups;

  ~ListenComm() {
    close_fd(&fd);
    for (auto& p : pending) close_fd(&p.fd);
    for (auto& g : groups) {
      for (int& f : g.fds) close_fd(&f);
    }
  }
};

struct PendingConnect {
  std::string peer;
  std::vector<int> fds;
  std::vector<bool> connected;
  std::vector<size_t> hello_sent;
  wire::Hello hello{};
  Clock::time_point start;
  int64_t timeout_ms = 30000;

  ~PendingConnect() {
    for (int& f : fds) close_fd(&f);
  }
};

// Connects in progress, keyed by the pointer stored in the caller's handle. Never destroyed: a
// proxy thread may still be connecting while the process exits, and a static set's destructor
// would run under it (ThreadSanitizer reported that race at exit).
struct PendingConnects {
  std::mutex mu;
  std::unordered_set<PendingConnect*> set;
};
PendingConnects& pending_connects() {
  static auto* registry = new PendingConnects;
  return *registry;
}

// ---------------------------------------------------------------- the backend

class SocketNet final : public NetBackend {
 public:
  Status init() override {
    std::call_once(once_, [this] {
      NetEnv env = read_net_env();
      init_status_ = discover_devices(env.ifname, &devices_);
      if (init_status_ == Status::kOk) {
        for (size_t i = 0; i < devices_.size(); ++i) {
          NET_INFO("device %zu: %s %s, %d Mbps", i, devices_[i].name.c_str(),
                   addr_to_string(reinterpret_cast<const sockaddr*>(&devices_[i].addr)).c_str(),
                   devices_[i].speed_mbps);
        }
      }
    });
    return init_status_;
  }

  Status devices(int* ndev) override {
    DQ_CHECK(init());
    *ndev = static_cast<int>(devices_.size());
    return Status::kOk;
  }

  Status get_properties(int dev, dqNetPropertiesV11* props) override {
    DQ_CHECK(check_dev(dev));
    const NetDevice& d = devices_[static_cast<size_t>(dev)];
    std::memset(props, 0, sizeof(*props));
    props->name = const_cast<char*>(d.name.c_str());
    props->pciPath = d.pci_path.empty() ? nullptr : const_cast<char*>(d.pci_path.c_str());
    props->guid = d.guid;
    props->ptrSupport = NCCL_PTR_HOST;
    props->regIsGlobal = 0;
    props->forceFlush = 0;
    props->speed = d.speed_mbps;
    props->port = 0;
    props->latency = 0;
    props->maxComms = 65536;
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
    const NetDevice& d = devices_[static_cast<size_t>(dev)];
    NetEnv env = read_net_env();
    auto lc = std::make_unique<ListenComm>();
    lc->fd = socket(d.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (lc->fd < 0) return sys_fail("socket", d.name);
    int one = 1;
    setsockopt(lc->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_storage addr = d.addr;
    if (addr.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&addr)->sin_port = 0;
    if (addr.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = 0;
    if (bind(lc->fd, reinterpret_cast<sockaddr*>(&addr), d.addr_len) != 0) {
      return sys_fail("bind", d.name);
    }
    if (::listen(lc->fd, 512) != 0) return sys_fail("listen", d.name);
    socklen_t len = sizeof(addr);
    if (getsockname(lc->fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return sys_fail("getsockname", d.name);
    }
    lc->secret = random_u64();
    lc->comm_id = ctx.comm_id;
    lc->has_comm_id = ctx.has_comm_id;
    lc->timeout_ms = env.timeout_ms;

    std::memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
    wire::Handle h{};
    h.magic = wire::kHandleMagic;
    h.version = wire::kVersion;
    h.family = addr.ss_family;
    h.nsocks = static_cast<uint16_t>(env.nsocks);
    if (addr.ss_family == AF_INET) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
      h.port_be = a->sin_port;
      std::memcpy(h.addr, &a->sin_addr, 4);
    } else {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
      h.port_be = a->sin6_port;
      std::memcpy(h.addr, &a->sin6_addr, 16);
    }
    h.secret = lc->secret;
    h.connect_state = 0;
    std::memcpy(handle, &h, sizeof(h));
    NET_INFO("listening on %s (%s), %d sockets per connection",
             addr_to_string(reinterpret_cast<sockaddr*>(&addr)).c_str(), d.name.c_str(), env.nsocks);
    *listen_comm = lc.release();
    return Status::kOk;
  }

  Status connect(const CommContext& ctx, int dev, void* handle, void** send_comm) override {
    *send_comm = nullptr;
    DQ_CHECK(check_dev(dev));
    wire::Handle h;
    std::memcpy(&h, handle, sizeof(h));
    if (!wire::handle_valid(h)) {
      NET_WARN("connect: the handle is not a dynamiq listen handle (magic %#x, version %u)",
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
      DQ_CHECK(start_connect(ctx, h, &pc));
      h.connect_state = reinterpret_cast<uint64_t>(pc);
      std::memcpy(handle, &h, sizeof(h));
    }
    Status st = progress_connect(pc, send_comm);
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
    if (lc == nullptr || lc->magic != kListenCommMagic) {
      NET_WARN("accept: not a listen comm");
      return Status::kInvalidArgument;
    }
    std::lock_guard<std::mutex> lock(lc->mu);
    for (int i = 0; i < kMaxAcceptsPerCall; ++i) {
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      int fd =
          accept4(lc->fd, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        NET_WARN("accept failed: %s", std::strerror(errno));
        return Status::kSystemError;
      }
      PendingSocket p;
      p.fd = fd;
      p.peer = addr_to_string(reinterpret_cast<sockaddr*>(&addr));
      p.start = Clock::now();
      lc->pending.push_back(std::move(p));
    }
    progress_hellos(lc);
    for (size_t gi = 0; gi < lc->groups.size(); ++gi) {
      PendingGroup& g = lc->groups[gi];
      bool complete = std::all_of(g.fds.begin(), g.fds.end(), [](int f) { return f >= 0; });
      if (complete) {
        std::vector<int> fds = g.fds;
        std::string peer = g.peer;
        lc->groups.erase(lc->groups.begin() + static_cast<long>(gi));
        return make_recv_comm(std::move(fds), peer, lc->timeout_ms, recv_comm);
      }
      if (ms_since(g.start) > lc->timeout_ms) {
        NET_WARN("connection from %s: only some of its %zu sockets arrived within %lld ms; dropped",
                 g.peer.c_str(), g.fds.size(), static_cast<long long>(lc->timeout_ms));
        for (int& f : g.fds) close_fd(&f);
        lc->groups.erase(lc->groups.begin() + static_cast<long>(gi));
        --gi;
      }
    }
    return Status::kOk;
  }

  Status reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) override {
    *mhandle = nullptr;
    (void)comm;
    if (type != NCCL_PTR_HOST) {
      NET_WARN("regMr: memory type %d is not supported (this plugin advertises host memory only)",
               type);
      return Status::kInvalidArgument;
    }
    *mhandle = new MemoryRegion{kMrMagic, static_cast<const char*>(data), size};
    return Status::kOk;
  }

  Status dereg_mr(void* comm, void* mhandle) override {
    (void)comm;
    auto* mr = static_cast<MemoryRegion*>(mhandle);
    if (mr == nullptr) return Status::kOk;
    if (mr->magic != kMrMagic) {
      NET_WARN("deregMr: not a memory handle of this plugin");
      return Status::kInvalidArgument;
    }
    mr->magic = 0;
    delete mr;
    return Status::kOk;
  }

  Status isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
               void** request) override {
    *request = nullptr;
    auto* sc = static_cast<SendComm*>(send_comm);
    if (sc == nullptr || sc->magic != kSendCommMagic) {
      NET_WARN("isend: not a send comm");
      return Status::kInvalidArgument;
    }
    DQ_CHECK(check_region(mhandle, data, size));
    if (size > wire::kMaxMessageBytes || (size > 0 && data == nullptr)) {
      NET_WARN("isend: invalid buffer %p of %zu bytes", data, size);
      return Status::kInvalidArgument;
    }
    std::lock_guard<std::mutex> lock(sc->mu);
    if (sc->failed) {
      NET_WARN("isend to %s: the connection has failed", sc->peer.c_str());
      return Status::kSystemError;
    }
    if (sc->requests.size() >= kMaxRequestsPerComm) return Status::kOk;  // NULL: retry later
    auto* req = new SendRequest;
    req->comm = sc;
    req->seq = sc->next_seq++;
    req->tag = tag;
    req->data = static_cast<const char*>(data);
    req->size = size;
    req->split = wire::split_message(size, static_cast<int>(sc->fds.size()));
    req->parts_left = req->split.parts;
    for (int k = 0; k < req->split.parts; ++k) sc->queues[static_cast<size_t>(k)].push_back(req);
    sc->requests.insert(req);
    sc->cv.notify_all();
    *request = req;
    return Status::kOk;
  }

  Status irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
               void** mhandles, void** request) override {
    *request = nullptr;
    auto* rc = static_cast<RecvComm*>(recv_comm);
    if (rc == nullptr || rc->magic != kRecvCommMagic) {
      NET_WARN("irecv: not a receive comm");
      return Status::kInvalidArgument;
    }
    if (n < 1 || n > kMaxGroupedRecvs) {
      NET_WARN("irecv: %d grouped receives (maxRecvs is %d)", n, kMaxGroupedRecvs);
      return Status::kInvalidArgument;
    }
    for (int i = 0; i < n; ++i) {
      DQ_CHECK(check_region(mhandles != nullptr ? mhandles[i] : nullptr, data[i], sizes[i]));
      if (sizes[i] > 0 && data[i] == nullptr) {
        NET_WARN("irecv: NULL buffer for %zu bytes", sizes[i]);
        return Status::kInvalidArgument;
      }
    }
    std::lock_guard<std::mutex> lock(rc->mu);
    if (rc->requests.size() >= kMaxRequestsPerComm) return Status::kOk;  // NULL: retry later
    if (rc->failed && !completable_from_staging(rc, n, tags)) {
      NET_WARN("irecv from %s: the connection has failed", rc->peer.c_str());
      return rc->fail_status;
    }
    auto* req = new RecvRequest;
    req->comm = rc;
    req->n = n;
    req->remaining = n;
    rc->requests.insert(req);
    for (int i = 0; i < n; ++i) {
      RecvSlot* slot = &req->slots[i];
      slot->req = req;
      slot->data = static_cast<char*>(data[i]);
      slot->capacity = sizes[i];
      slot->tag = tags[i];
      auto it = std::find_if(rc->unexpected.begin(), rc->unexpected.end(),
                             [&](const RecvMsg* m) { return m->tag == tags[i]; });
      if (it == rc->unexpected.end()) {
        rc->posted.push_back(slot);
        continue;
      }
      RecvMsg* msg = *it;
      rc->unexpected.erase(it);
      if (rc->oversized(msg, slot)) {
        // The message stays owned here until the comm is closed.
        rc->unexpected.push_front(msg);
        break;
      }
      rc->bind_message(msg, slot);
    }
    *request = req;
    return Status::kOk;
  }

  Status test(void* request, int* done, int* sizes) override {
    *done = 0;
    auto* magic = static_cast<uint32_t*>(request);
    if (magic == nullptr) {
      NET_WARN("test: NULL request");
      return Status::kInvalidArgument;
    }
    if (*magic == kSendRequestMagic) {
      auto* req = static_cast<SendRequest*>(request);
      SendComm* sc = req->comm;
      std::lock_guard<std::mutex> lock(sc->mu);
      if (req->done) {
        *done = 1;
        if (sizes != nullptr) sizes[0] = static_cast<int>(std::min<size_t>(req->size, INT_MAX));
        sc->requests.erase(req);
        req->magic = 0;
        delete req;
        return Status::kOk;
      }
      if (sc->failed) return Status::kSystemError;  // already logged by fail()
      return Status::kOk;
    }
    if (*magic == kRecvRequestMagic) {
      auto* req = static_cast<RecvRequest*>(request);
      RecvComm* rc = req->comm;
      std::lock_guard<std::mutex> lock(rc->mu);
      if (req->remaining == 0) {
        *done = 1;
        for (int i = 0; sizes != nullptr && i < req->n; ++i) {
          sizes[i] = static_cast<int>(std::min<size_t>(req->slots[i].received, INT_MAX));
        }
        rc->requests.erase(req);
        req->magic = 0;
        delete req;
        return Status::kOk;
      }
      if (rc->failed) return rc->fail_status;
      return Status::kOk;
    }
    NET_WARN("test: %p is not a request of this plugin", request);
    return Status::kInvalidArgument;
  }

  Status close_send(void* send_comm) override {
    auto* sc = static_cast<SendComm*>(send_comm);
    if (sc == nullptr) return Status::kOk;
    if (sc->magic != kSendCommMagic) {
      NET_WARN("closeSend: not a send comm");
      return Status::kInvalidArgument;
    }
    sc->stop.store(true);
    {
      std::lock_guard<std::mutex> lock(sc->mu);
      sc->cv.notify_all();
    }
    for (auto& t : sc->threads) t.join();
    for (int& fd : sc->fds) close_fd(&fd);
    for (SendRequest* r : sc->requests) delete r;
    sc->magic = 0;
    delete sc;
    return Status::kOk;
  }

  Status close_recv(void* recv_comm) override {
    auto* rc = static_cast<RecvComm*>(recv_comm);
    if (rc == nullptr) return Status::kOk;
    if (rc->magic != kRecvCommMagic) {
      NET_WARN("closeRecv: not a receive comm");
      return Status::kInvalidArgument;
    }
    rc->stop.store(true);
    for (int fd : rc->fds) shutdown(fd, SHUT_RDWR);
    {
      std::lock_guard<std::mutex> lock(rc->mu);
      rc->cv.notify_all();
    }
    for (auto& t : rc->threads) t.join();
    for (int& fd : rc->fds) close_fd(&fd);
    rc->magic = 0;
    delete rc;
    return Status::kOk;
  }

  Status close_listen(void* listen_comm) override {
    auto* lc = static_cast<ListenComm*>(listen_comm);
    if (lc == nullptr) return Status::kOk;
    if (lc->magic != kListenCommMagic) {
      NET_WARN("closeListen: not a listen comm");
      return Status::kInvalidArgument;
    }
    lc->magic = 0;
    delete lc;
    return Status::kOk;
  }

 private:
  Status check_dev(int dev) {
    DQ_CHECK(init());
    if (dev < 0 || dev >= static_cast<int>(devices_.size())) {
      NET_WARN("device %d does not exist (%zu devices)", dev, devices_.size());
      return Status::kInvalidArgument;
    }
    return Status::kOk;
  }

  static Status sys_fail(const char* what, const std::string& dev) {
    NET_WARN("%s on %s failed: %s", what, dev.c_str(), std::strerror(errno));
    return Status::kSystemError;
  }

  static Status check_region(void* mhandle, void* data, size_t size) {
    if (mhandle == nullptr) return Status::kOk;
    auto* mr = static_cast<MemoryRegion*>(mhandle);
    const char* p = static_cast<const char*>(data);
    if (mr->magic != kMrMagic) {
      NET_WARN("memory handle %p is not registered with this plugin", mhandle);
      return Status::kInvalidArgument;
    }
    if (size > 0 && (p < mr->base || p + size > mr->base + mr->size)) {
      NET_WARN("buffer %p+%zu lies outside its registered region %p+%zu", data, size,
               static_cast<const void*>(mr->base), mr->size);
      return Status::kInvalidArgument;
    }
    return Status::kOk;
  }

  // After a failure, a receive can still complete if staged, complete messages cover it.
  static bool completable_from_staging(RecvComm* rc, int n, const int* tags) {
    std::vector<const RecvMsg*> used;
    for (int i = 0; i < n; ++i) {
      auto it = std::find_if(rc->unexpected.begin(), rc->unexpected.end(), [&](const RecvMsg* m) {
        return m->tag == tags[i] && std::find(used.begin(), used.end(), m) == used.end();
      });
      if (it == rc->unexpected.end() || !(*it)->complete) return false;
      used.push_back(*it);
    }
    return true;
  }

  Status start_connect(const CommContext& ctx, const wire::Handle& h, PendingConnect** out) {
    auto pc = std::make_unique<PendingConnect>();
    sockaddr_storage addr{};
    socklen_t addr_len = 0;
    if (h.family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(&addr);
      a->sin_family = AF_INET;
      a->sin_port = h.port_be;
      std::memcpy(&a->sin_addr, h.addr, 4);
      addr_len = sizeof(sockaddr_in);
    } else {
      auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
      a->sin6_family = AF_INET6;
      a->sin6_port = h.port_be;
      std::memcpy(&a->sin6_addr, h.addr, 16);
      addr_len = sizeof(sockaddr_in6);
    }
    pc->peer = addr_to_string(reinterpret_cast<sockaddr*>(&addr));
    pc->timeout_ms = read_net_env().timeout_ms;
    pc->start = Clock::now();
    pc->hello = wire::Hello{wire::kHelloMagic,
                            wire::kVersion,
                            0,
                            h.nsocks,
                            static_cast<uint16_t>(ctx.has_comm_id ? wire::kHelloHasCommId : 0),
                            0,
                            h.secret,
                            ctx.comm_id,
                            random_u64()};
    for (int k = 0; k < h.nsocks; ++k) {
      int fd = socket(h.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) return sys_fail("socket", pc->peer);
      pc->fds.push_back(fd);
      pc->connected.push_back(false);
      pc->hello_sent.push_back(0);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), addr_len) != 0 && errno != EINPROGRESS) {
        NET_WARN("connect to %s failed: %s", pc->peer.c_str(), std::strerror(errno));
        return Status::kSystemError;
      }
    }
    *out = pc.release();
    std::lock_guard<std::mutex> lock(pending_connects().mu);
    pending_connects().set.insert(*out);
    return Status::kOk;
  }

  Status progress_connect(PendingConnect* pc, void** send_comm) {
    bool all_sent = true;
    for (size_t k = 0; k < pc->fds.size(); ++k) {
      int fd = pc->fds[k];
      if (!pc->connected[k]) {
        pollfd p{fd, POLLOUT, 0};
        if (poll(&p, 1, 0) < 0 && errno != EINTR) return sys_fail("poll", pc->peer);
        if ((p.revents & (POLLOUT | POLLERR | POLLHUP)) == 0) {
          all_sent = false;
          continue;
        }
        int err = 0;
        socklen_t len = sizeof(err);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0) {
          NET_WARN("connect to %s failed: %s", pc->peer.c_str(), std::strerror(err));
          return Status::kSystemError;
        }
        pc->connected[k] = true;
      }
      wire::Hello hello = pc->hello;
      hello.sock_index = static_cast<uint16_t>(k);
      size_t& sent = pc->hello_sent[k];
      if (sent < sizeof(hello)) {
        ssize_t n = send(fd, reinterpret_cast<char*>(&hello) + sent, sizeof(hello) - sent,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) sent += static_cast<size_t>(n);
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          NET_WARN("handshake with %s failed: %s", pc->peer.c_str(), std::strerror(errno));
          return Status::kSystemError;
        }
      }
      if (sent < sizeof(hello)) all_sent = false;
    }
    if (!all_sent) {
      if (ms_since(pc->start) > pc->timeout_ms) {
        NET_WARN("connect to %s timed out after %lld ms (DYNAMIQ_NET_TIMEOUT_MS)", pc->peer.c_str(),
                 static_cast<long long>(pc->timeout_ms));
        return Status::kTimeout;
      }
      return Status::kOk;
    }
    auto sc = std::make_unique<SendComm>();
    sc->peer = pc->peer;
    sc->timeout_ms = pc->timeout_ms;
    for (int fd : pc->fds) {
      if (!configure_data_socket(fd)) return sys_fail("configure socket", pc->peer);
    }
    sc->fds = pc->fds;
    pc->fds.clear();  // now owned by the send comm
    sc->queues.resize(sc->fds.size());
    for (size_t k = 0; k < sc->fds.size(); ++k) {
      sc->threads.emplace_back([c = sc.get(), k] { c->run(static_cast<int>(k)); });
    }
    NET_INFO("connected to %s with %zu sockets", sc->peer.c_str(), sc->fds.size());
    *send_comm = sc.release();
    return Status::kOk;
  }

  void progress_hellos(ListenComm* lc) {
    for (size_t i = 0; i < lc->pending.size(); ++i) {
      PendingSocket& p = lc->pending[i];
      bool drop = false;
      ssize_t n = recv(p.fd, reinterpret_cast<char*>(&p.hello) + p.got, sizeof(p.hello) - p.got,
                       MSG_DONTWAIT);
      if (n > 0) p.got += static_cast<size_t>(n);
      if (n == 0) {
        NET_WARN("connection from %s closed during the handshake", p.peer.c_str());
        drop = true;
      } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        NET_WARN("handshake from %s failed: %s", p.peer.c_str(), std::strerror(errno));
        drop = true;
      } else if (p.got < sizeof(p.hello) && ms_since(p.start) > lc->timeout_ms) {
        NET_WARN("handshake from %s timed out after %lld ms", p.peer.c_str(),
                 static_cast<long long>(lc->timeout_ms));
        drop = true;
      } else if (p.got == sizeof(p.hello)) {
        drop = !admit_socket(lc, p);
        if (!drop) p.fd = -1;  // handed to a group
      } else {
        continue;  // still waiting for the rest of the hello
      }
      close_fd(&p.fd);
      lc->pending.erase(lc->pending.begin() + static_cast<long>(i));
      --i;
    }
  }

  // Validates a complete hello; on success the socket joins its connection's group.
  bool admit_socket(ListenComm* lc, const PendingSocket& p) {
    const wire::Hello& h = p.hello;
    switch (wire::check_hello(h, lc->secret, lc->has_comm_id, lc->comm_id)) {
      case wire::HelloCheck::kOk:
        break;
      case wire::HelloCheck::kNotDynamiq:
        NET_WARN("refused connection from %s: not a dynamiq handshake (magic %#x, version %u)",
                 p.peer.c_str(), h.magic, h.version);
        return false;
      case wire::HelloCheck::kWrongSecret:
        NET_WARN("refused connection from %s: wrong secret (it does not hold this listen handle)",
                 p.peer.c_str());
        return false;
      case wire::HelloCheck::kWrongCommId:
        NET_WARN("refused connection from %s: communicator id %#llx, expected %#llx",
                 p.peer.c_str(), static_cast<unsigned long long>(h.comm_id),
                 static_cast<unsigned long long>(lc->comm_id));
        return false;
      case wire::HelloCheck::kBadSocket:
        NET_WARN("refused connection from %s: socket %u of %u", p.peer.c_str(), h.sock_index,
                 h.nsocks);
        return false;
    }
    if (!wire::join_group(&lc->groups, h, p.peer, p.fd)) {
      NET_WARN("refused connection from %s: inconsistent socket %u of %u", p.peer.c_str(),
               h.sock_index, h.nsocks);
      return false;
    }
    return true;
  }

  static Status make_recv_comm(std::vector<int> fds, const std::string& peer, int64_t timeout_ms,
                             void** recv_comm) {
    for (int fd : fds) {
      if (!configure_data_socket(fd)) {
        for (int& f : fds) close_fd(&f);
        return sys_fail("configure socket", peer);
      }
    }
    auto rc = std::make_unique<RecvComm>();
    rc->peer = peer;
    rc->timeout_ms = timeout_ms;
    rc->fds = std::move(fds);
    rc->threads.emplace_back([c = rc.get()] { c->run_headers(); });
    for (size_t k = 1; k < rc->fds.size(); ++k) {
      rc->threads.emplace_back([c = rc.get(), k] { c->run_parts(static_cast<int>(k)); });
    }
    NET_INFO("accepted connection from %s with %zu sockets", peer.c_str(), rc->fds.size());
    *recv_comm = rc.release();
    return Status::kOk;
  }

  std::once_flag once_;
  Status init_status_ = Status::kOk;
  std::vector<NetDevice> devices_;
};

}  // namespace

NetBackend& socket_backend() {
  static SocketNet* backend = new SocketNet;  // never destroyed: comms may outlive statics
  return *backend;
}

}  // namespace dq::net
