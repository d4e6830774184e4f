// Connection setup of the socket backend: a listener hands out a handle (address, port, a
// random secret, the socket count); a connector opens that many sockets and sends a hello on
// each (secret, communicator id, a nonce naming the connection, the socket's index); the
// listener admits the sockets whose hello checks out and groups them by nonce, and a complete
// group becomes a receive comm.
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <new>
#include <system_error>

#include "plugin/net_env.h"
#include "plugin/socket/socket_comms.h"

namespace dq::net::sock {
namespace {

// Connects in progress of this backend (net_backend_common.h).
PendingConnects& pending_connects() {
  static auto* registry = new PendingConnects;  // never destroyed: see PendingConnects
  return *registry;
}

// Thread starts left before one fails (fail_thread_start_for_testing); -1: none fails.
std::atomic<int> g_thread_starts_before_failure{-1};
std::atomic<bool> g_thread_start_out_of_memory{false};

// Starts one I/O thread per socket of comm `c`, body(c, k) for socket k. False, logged with the
// peer and the cause, where one cannot start: std::thread throws std::system_error (EAGAIN at
// the process's thread or pids limit), and it or the vector's growth std::bad_alloc. Any
// exception past here would destroy the comm with joinable threads: std::terminate. The threads
// that did start are in c->threads then, for the caller to stop and join with the close of the
// comm, which also closes its sockets.
template <class Comm, class Body>
bool start_io_threads(Comm* c, Body body) {
  for (size_t k = 0; k < c->fds.size(); ++k) {
    try {
      int left = g_thread_starts_before_failure.load();
      while (left >= 0 && !g_thread_starts_before_failure.compare_exchange_weak(left, left - 1)) {
      }
      if (left == 0 && g_thread_start_out_of_memory.load()) throw std::bad_alloc();
      if (left == 0) throw std::system_error(EAGAIN, std::generic_category(), "injected by a test");
      c->threads.emplace_back([c, k, body] { body(c, static_cast<int>(k)); });
    } catch (const std::system_error& e) {
      NET_WARN(
          "connection with %s: its I/O thread %zu of %zu could not start: %s (errno %d; the "
          "process's thread or pids limit?); closed",
          c->peer.c_str(), k + 1, c->fds.size(), e.what(), e.code().value());
      return false;
    } catch (const std::exception& e) {
      NET_WARN("connection with %s: its I/O thread %zu of %zu could not start: %s; closed",
               c->peer.c_str(), k + 1, c->fds.size(), e.what());
      return false;
    }
  }
  return true;
}

}  // namespace

void fail_thread_start_for_testing(int starts_before_failure, bool out_of_memory) {
  g_thread_start_out_of_memory.store(out_of_memory);
  g_thread_starts_before_failure.store(starts_before_failure);
}

Status SocketNet::listen(const CommContext& ctx, int dev, void* handle, void** listen_comm) {
  *listen_comm = nullptr;
  DQ_CHECK(check_dev(dev));
  const NetDevice& d = devices_[static_cast<size_t>(dev)];
  NetEnv env = read_net_env();
  auto lc = std::make_unique<ListenComm>();
  lc->fd = open_socket(d.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC);
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

Status SocketNet::connect(const CommContext& ctx, int dev, void* handle, void** send_comm) {
  *send_comm = nullptr;
  DQ_CHECK(check_dev(dev));
  wire::Handle h;
  std::memcpy(&h, handle, sizeof(h));
  if (!wire::handle_valid(h)) {
    NET_WARN("connect: the handle is not a dynamiq listen handle (magic %#x, version %u)", h.magic,
             h.version);
    return Status::kInvalidArgument;
  }
  auto start = [&](PendingConnect* pc) { return start_connect(ctx, h, pc); };
  auto progress = [this](PendingConnect* pc, void** out) { return progress_connect(pc, out); };
  const Status st = drive_connect<PendingConnect>(pending_connects(), &h.connect_state, start,
                                                  progress, send_comm);
  std::memcpy(handle, &h, sizeof(h));
  return st;
}

}  // namespace dq::net::sock

namespace dq::net {

void socket_forget_connect(void* handle) {
  wire::Handle h;
  std::memcpy(&h, handle, sizeof(h));
  auto* pc = static_cast<sock::PendingConnect*>(sock::pending_connects().find(h.connect_state));
  if (pc == nullptr) return;
  sock::pending_connects().remove(pc);
  delete pc;  // closes its sockets
  h.connect_state = 0;
  std::memcpy(handle, &h, sizeof(h));
}

}  // namespace dq::net

namespace dq::net::sock {

namespace {

// accept(2) errors that belong to one incoming connection rather than to the listener. Besides
// EINTR and ECONNABORTED, Linux passes a new TCP connection's pending network error to accept()
// (its manual names these); treating them as failures would fail the whole communicator's set-up
// over one peer's dropped attempt. The caller's loop is bounded (kMaxAcceptsPerCall).
bool is_failed_connection_error(int e) {
  switch (e) {
    case EINTR:
    case ECONNABORTED:
    case ENETDOWN:
    case EPROTO:
    case ENOPROTOOPT:
    case EHOSTDOWN:
    case ENONET:
    case EHOSTUNREACH:
    case EOPNOTSUPP:
    case ENETUNREACH:
      return true;
    default:
      return false;
  }
}

}  // namespace

Status SocketNet::accept(void* listen_comm, void** recv_comm) {
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
    int fd = accept_socket(lc->fd, reinterpret_cast<sockaddr*>(&addr), &len,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      // The connection failed before it was taken, not the listener: the next one may be fine.
      if (is_failed_connection_error(errno)) continue;
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
      for (int& f : g.fds) close_socket(&f);
      lc->groups.erase(lc->groups.begin() + static_cast<long>(gi));
      --gi;
    }
  }
  return Status::kOk;
}

Status SocketNet::sys_fail(const char* what, const std::string& dev) {
  NET_WARN("%s on %s failed: %s", what, dev.c_str(), std::strerror(errno));
  return Status::kSystemError;
}

Status SocketNet::start_connect(const CommContext& ctx, const wire::Handle& h, PendingConnect* pc) {
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
    int fd = open_socket(h.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return sys_fail("socket", pc->peer);
    pc->fds.push_back(fd);
    pc->connected.push_back(false);
    pc->hello_sent.push_back(0);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), addr_len) != 0 && errno != EINPROGRESS) {
      NET_WARN("connect to %s failed: %s", pc->peer.c_str(), std::strerror(errno));
      return Status::kSystemError;
    }
  }
  return Status::kOk;
}

Status SocketNet::progress_connect(PendingConnect* pc, void** send_comm) {
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
  if (!start_io_threads(sc.get(), [](SendComm* c, int k) { c->run(k); })) {
    close_send(sc.release());  // stops and joins the threads started, closes the sockets
    return Status::kSystemError;
  }
  NET_INFO("connected to %s with %zu sockets", sc->peer.c_str(), sc->fds.size());
  *send_comm = sc.release();
  return Status::kOk;
}

void SocketNet::progress_hellos(ListenComm* lc) {
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
    close_socket(&p.fd);
    lc->pending.erase(lc->pending.begin() + static_cast<long>(i));
    --i;
  }
}

bool SocketNet::admit_socket(ListenComm* lc, const PendingSocket& p) {
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
      NET_WARN("refused connection from %s: communicator id %#llx, expected %#llx", p.peer.c_str(),
               static_cast<unsigned long long>(h.comm_id),
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

Status SocketNet::make_recv_comm(std::vector<int> fds, const std::string& peer, int64_t timeout_ms,
                                 void** recv_comm) {
  for (int fd : fds) {
    if (!configure_data_socket(fd)) {
      for (int& f : fds) close_socket(&f);
      return sys_fail("configure socket", peer);
    }
  }
  auto rc = std::make_unique<RecvComm>();
  rc->peer = peer;
  rc->timeout_ms = timeout_ms;
  rc->fds = std::move(fds);
  auto body = [](RecvComm* c, int k) {
    if (k == 0) {
      c->run_headers();
    } else {
      c->run_parts(k);
    }
  };
  if (!start_io_threads(rc.get(), body)) {
    // Stops and joins the threads started, closes the sockets.
    socket_backend().close_recv(rc.release());
    return Status::kSystemError;
  }
  NET_INFO("accepted connection from %s with %zu sockets", peer.c_str(), rc->fds.size());
  *recv_comm = rc.release();
  return Status::kOk;
}

}  // namespace dq::net::sock
