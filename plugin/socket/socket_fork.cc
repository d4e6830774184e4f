#include "plugin/socket/socket_fork.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <vector>

namespace dq::net::sock {
namespace {

// The descriptors of the plugin's sockets. `mu` is held across fork() (prepare to parent/child
// handler), so the set a child sees is complete.
struct Registry {
  std::mutex mu;
  std::vector<int> fds;
};

// Never destroyed: a fork or a close may come while the process exits.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

void lock_before_fork() {
  registry().mu.lock();
}
void unlock_in_parent() {
  registry().mu.unlock();
}

// The child's only thread. open, dup3 and close are async-signal-safe; nothing here allocates.
void replace_in_child() {
  Registry& r = registry();
  const int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  size_t kept = 0;
  for (int fd : r.fds) {
    if (null_fd >= 0 && dup3(null_fd, fd, O_CLOEXEC) == fd) {
      r.fds[kept++] = fd;  // now /dev/null, still the plugin's to close
    } else {
      close(fd);  // the number is free again: no longer the plugin's
    }
  }
  r.fds.resize(kept);  // shrinks: no allocation
  if (null_fd >= 0) close(null_fd);
  r.mu.unlock();
}

// Registered from this library (glibc drops the handlers when the library is unloaded).
void install_fork_handlers() {
  static std::once_flag once;
  std::call_once(once,
                 [] { pthread_atfork(&lock_before_fork, &unlock_in_parent, &replace_in_child); });
}

template <class Make>
int make_tracked(Make make) {
  install_fork_handlers();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.fds.reserve(r.fds.size() + 1);  // before the socket exists: a failure leaks nothing
  const int fd = make();
  if (fd >= 0) r.fds.push_back(fd);
  return fd;
}

}  // namespace

int open_socket(int family, int type) {
  return make_tracked([&] { return socket(family, type, 0); });
}

int accept_socket(int listen_fd, sockaddr* addr, socklen_t* len, int flags) {
  return make_tracked([&] { return accept4(listen_fd, addr, len, flags); });
}

void close_socket(int* fd) {
  if (*fd < 0) return;
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    const auto it = std::find(r.fds.begin(), r.fds.end(), *fd);
    if (it != r.fds.end()) {
      *it = r.fds.back();
      r.fds.pop_back();
      const int saved = errno;
      close(*fd);
      errno = saved;
    }
  }
  *fd = -1;
}

}  // namespace dq::net::sock
