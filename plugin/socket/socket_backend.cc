// Socket backend of the net plugin: TCP, several sockets per connection, one I/O thread per
// socket. Receives are matched by tag (FIFO per tag); a message that arrives before its receive
// is posted is staged in host memory and copied when the receive is posted. The backend's types:
// socket_comms.h, which lists the files its calls live in. This file: init and properties,
// registration, isend/irecv/test, the close calls and the backend's instance.
#include <errno.h>
#include <sys/socket.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "plugin/net_env.h"
#include "plugin/socket/socket_comms.h"

namespace dq::net {
namespace sock {

Status SocketNet::init() {
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

Status SocketNet::devices(int* ndev) {
  DQ_CHECK(init());
  *ndev = static_cast<int>(devices_.size());
  return Status::kOk;
}

Status SocketNet::get_properties(int dev, dqNetPropertiesV11* props) {
  DQ_CHECK(check_dev(dev));
  const NetDevice& d = devices_[static_cast<size_t>(dev)];
  fill_common_properties(dev, d.name, d.pci_path, d.guid, d.speed_mbps, props);
  return Status::kOk;
}

Status SocketNet::reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
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

namespace {

bool overlaps(const char* data, size_t size, const MemoryRegion& mr) {
  return size > 0 && data < mr.base + mr.size && mr.base < data + size;
}

// Stops a comm's I/O threads and joins them; its close then finds none. mu not held.
template <class Comm>
void stop_io_threads(Comm* c) {
  c->stop.store(true);
  for (int fd : c->fds) shutdown(fd, SHUT_RDWR);
  {
    std::lock_guard<std::mutex> lock(c->mu);
    c->cv.notify_all();
  }
  for (auto& t : c->threads) t.join();
  c->threads.clear();
}

// Where `in_use()` (asked under the comm's lock) says a request in flight uses the region being
// deregistered: the comm fails with `why` and its threads stop before the caller frees it.
template <class Comm, class InUse>
void stop_if_in_use(Comm* c, InUse in_use, const char* why) {
  bool used = false;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    used = in_use();
    if (used) c->fail(why);
  }
  if (used) stop_io_threads(c);
}

}  // namespace

// NCCL's teardown of a connection deregisters its buffers and frees them before it closes the
// connection (its proxy's free: deregMr, the host buffers' free, then closeRecv / closeSend).
// After an abort a transfer into or out of them may still be under way on this comm's I/O
// threads, which would then write into freed memory (a crash, or corruption of whatever the
// memory holds next) or send it. So deregistering a region that an unfinished request uses
// fails the comm and stops its threads first. A region no request in flight uses (a healthy
// job's deregistration) changes nothing.
Status SocketNet::dereg_mr(void* comm, void* mhandle) {
  auto* mr = static_cast<MemoryRegion*>(mhandle);
  if (mr == nullptr) return Status::kOk;
  if (mr->magic != kMrMagic) {
    NET_WARN("deregMr: not a memory handle of this plugin");
    return Status::kInvalidArgument;
  }
  const uint32_t comm_magic = comm != nullptr ? *static_cast<const uint32_t*>(comm) : 0;
  if (comm_magic == kRecvCommMagic) {
    auto* rc = static_cast<RecvComm*>(comm);
    stop_if_in_use(
        rc,
        [&] {
          for (const RecvRequest* r : rc->requests)
            for (int i = 0; i < r->n; ++i)
              if (!r->slots[i].done && overlaps(r->slots[i].data, r->slots[i].capacity, *mr))
                return true;
          return false;
        },
        "a buffer of a receive in progress was deregistered (an abort?)");
  } else if (comm_magic == kSendCommMagic) {
    auto* sc = static_cast<SendComm*>(comm);
    stop_if_in_use(
        sc,
        [&] {
          return std::any_of(sc->requests.begin(), sc->requests.end(), [&](const SendRequest* r) {
            return !r->done && overlaps(r->data, r->size, *mr);
          });
        },
        "a buffer of a send in progress was deregistered (an abort?)");
  }
  mr->magic = 0;
  delete mr;
  return Status::kOk;
}

Status SocketNet::isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                        void** request) {
  *request = nullptr;
  auto* sc = static_cast<SendComm*>(send_comm);
  if (sc == nullptr || sc->magic != kSendCommMagic) {
    NET_WARN("isend: not a send comm");
    return Status::kInvalidArgument;
  }
  DQ_CHECK(check_region(mhandle, kMrMagic, data, size));
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

Status SocketNet::irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
                        void** mhandles, void** request) {
  *request = nullptr;
  auto* rc = static_cast<RecvComm*>(recv_comm);
  if (rc == nullptr || rc->magic != kRecvCommMagic) {
    NET_WARN("irecv: not a receive comm");
    return Status::kInvalidArgument;
  }
  DQ_CHECK(check_grouped_count("irecv", n, 1));
  DQ_CHECK(check_recv_buffers(n, data, sizes, mhandles, kMrMagic));
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

Status SocketNet::test(void* request, int* done, int* sizes) {
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

Status SocketNet::close_send(void* send_comm) {
  return close_comm(static_cast<SendComm*>(send_comm), kSendCommMagic, "closeSend: not a send comm",
                    [](SendComm* sc) {
                      sc->stop.store(true);
                      {
                        std::lock_guard<std::mutex> lock(sc->mu);
                        sc->cv.notify_all();
                      }
                      for (auto& t : sc->threads) t.join();
                      for (int& fd : sc->fds) close_socket(&fd);
                      for (SendRequest* r : sc->requests) delete r;
                    });
}

Status SocketNet::close_recv(void* recv_comm) {
  return close_comm(static_cast<RecvComm*>(recv_comm), kRecvCommMagic,
                    "closeRecv: not a receive comm", [](RecvComm* rc) {
                      stop_io_threads(rc);
                      for (int& fd : rc->fds) close_socket(&fd);
                    });
}

Status SocketNet::close_listen(void* listen_comm) {
  // The listening socket and the sockets still in their handshake close in ~ListenComm.
  return close_comm(static_cast<ListenComm*>(listen_comm), kListenCommMagic,
                    "closeListen: not a listen comm", [](ListenComm*) {});
}

Status SocketNet::check_dev(int dev) {
  DQ_CHECK(init());
  return check_device_index("device", dev, devices_.size());
}

bool SocketNet::completable_from_staging(RecvComm* rc, int n, const int* tags) {
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

}  // namespace sock

Status socket_send_peer_alive(void* send_comm) {
  auto* sc = static_cast<sock::SendComm*>(send_comm);
  if (sc == nullptr || sc->magic != sock::kSendCommMagic) {
    NET_WARN("socket_send_peer_alive: not a send comm");
    return Status::kInvalidArgument;
  }
  std::lock_guard<std::mutex> lock(sc->mu);
  for (size_t k = 0; k < sc->fds.size() && !sc->failed; ++k) {
    char byte = 0;
    const ssize_t n = recv(sc->fds[k], &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    const std::string why = n == 0  ? "the peer closed the connection"
                            : n > 0 ? "the peer sent bytes on a send connection"
                                    : std::string("socket error: ") + std::strerror(errno);
    sc->fail("socket " + std::to_string(k) + ": " + why);
  }
  return sc->failed ? Status::kSystemError : Status::kOk;
}

NetBackend& socket_backend() {
  static sock::SocketNet* backend =
      new sock::SocketNet;  // never destroyed: comms may outlive statics
  return *backend;
}

}  // namespace dq::net
