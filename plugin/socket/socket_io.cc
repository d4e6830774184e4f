#include "plugin/socket/socket_io.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include <chrono>
#include <cstring>

namespace dq::net {
namespace {

using Clock = std::chrono::steady_clock;

int64_t ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

}  // namespace

bool configure_data_socket(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) return false;
  if (fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) return false;
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) return false;
  timeval slice{};
  slice.tv_sec = 0;
  slice.tv_usec = kPollSliceMs * 1000;
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &slice, sizeof(slice)) != 0) return false;
  if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &slice, sizeof(slice)) != 0) return false;
  return true;
}

IoEnd read_full(int fd, void* buf, size_t len, bool idle_ok, const std::atomic<bool>& stop,
                int64_t stall_ms, bool* began, int* err) {
  char* p = static_cast<char*>(buf);
  size_t got = 0;
  Clock::time_point last_progress = Clock::now();
  *began = false;
  // Each pass either moves bytes or sleeps up to one slice in recv(); stop and the stall
  // deadline end the loop.
  while (got < len) {
    ssize_t n = recv(fd, p + got, len - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
      *began = true;
      last_progress = Clock::now();
      continue;
    }
    if (n == 0) return stop.load() ? IoEnd::kStopped : IoEnd::kEof;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (stop.load()) return IoEnd::kStopped;
      if ((got > 0 || !idle_ok) && ms_since(last_progress) > stall_ms) return IoEnd::kTimeout;
      continue;
    }
    *err = errno;
    return stop.load() ? IoEnd::kStopped : IoEnd::kError;
  }
  return IoEnd::kDone;
}

IoEnd write_full(int fd, const void* head, size_t head_len, const void* body, size_t body_len,
                 const std::atomic<bool>& stop, int64_t stall_ms, int* err) {
  iovec iov[2];
  iov[0].iov_base = const_cast<void*>(head);
  iov[0].iov_len = head_len;
  iov[1].iov_base = const_cast<void*>(body);
  iov[1].iov_len = body_len;
  int first = head_len == 0 ? 1 : 0;
  Clock::time_point last_progress = Clock::now();
  while (first < 2) {
    if (iov[first].iov_len == 0) {
      ++first;
      continue;
    }
    msghdr msg{};
    msg.msg_iov = &iov[first];
    msg.msg_iovlen = static_cast<size_t>(2 - first);
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n > 0) {
      size_t left = static_cast<size_t>(n);
      while (left > 0 && first < 2) {
        size_t take = left < iov[first].iov_len ? left : iov[first].iov_len;
        iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + take;
        iov[first].iov_len -= take;
        left -= take;
        if (iov[first].iov_len == 0) ++first;
      }
      last_progress = Clock::now();
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (stop.load()) return IoEnd::kStopped;
      if (ms_since(last_progress) > stall_ms) return IoEnd::kTimeout;
      continue;
    }
    *err = n < 0 ? errno : EPIPE;
    return stop.load() ? IoEnd::kStopped : IoEnd::kError;
  }
  return IoEnd::kDone;
}

const char* io_end_name(IoEnd end) {
  switch (end) {
    case IoEnd::kDone:
      return "done";
    case IoEnd::kEof:
      return "connection closed by peer";
    case IoEnd::kStopped:
      return "stopped";
    case IoEnd::kTimeout:
      return "peer stalled past DYNAMIQ_NET_TIMEOUT_MS";
    case IoEnd::kError:
      return "socket error";
  }
  return "?";
}

uint64_t random_u64() {
  uint64_t v = 0;
  // getrandom on 8 bytes never returns short once the pool is initialised; retry a few times.
  for (int attempt = 0; attempt < 16 && v == 0; ++attempt) {
    if (getrandom(&v, sizeof(v), 0) != static_cast<ssize_t>(sizeof(v))) v = 0;
  }
  if (v == 0) {  // fall back to a clock-derived value; still unique per call
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    v = (static_cast<uint64_t>(ts.tv_sec) * 1000000007ull) ^ static_cast<uint64_t>(ts.tv_nsec) ^
        0x9e3779b97f4a7c15ull;
  }
  return v;
}

}  // namespace dq::net
