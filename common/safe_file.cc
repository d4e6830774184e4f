#include "common/safe_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "common/splitmix.h"

namespace dq {
namespace {

std::string errno_text(const char* what, const std::string& path, int err) {
  return std::string(what) + " " + path + ": " + std::strerror(err);
}

// Descriptors opened here are checked to be regular files: a FIFO or device at the name is
// refused (opened non-blocking, so a FIFO without a reader cannot hang the caller).
bool keep_if_regular(int fd, const std::string& path, std::string* why) {
  struct stat st;
  if (fstat(fd, &st) != 0) {
    *why = errno_text("cannot stat", path, errno);
    return false;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = path + " is not a regular file";
    return false;
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    *why = errno_text("cannot set flags of", path, errno);
    return false;
  }
  return true;
}

// An unpredictable 64-bit value: the clock's nanoseconds, the pid and a per-process counter,
// mixed. Unpredictable enough that a link cannot be placed at the name in advance; O_EXCL makes a
// collision a retry, never a write through someone else's file.
uint64_t name_entropy() {
  static std::atomic<uint64_t> counter{0};
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  const uint64_t now_ns =
      static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
  const uint64_t here =
      (static_cast<uint64_t>(getpid()) << 32) ^ counter.fetch_add(1, std::memory_order_relaxed);
  return splitmix64(now_ns ^ splitmix64(here));
}

bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

}  // namespace

int open_output_nofollow(const std::string& path, bool truncate, bool append, std::string* why) {
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK |
                    (truncate ? O_TRUNC : 0) | (append ? O_APPEND : 0);
  const int fd = open(path.c_str(), flags, 0644);
  if (fd < 0) {
    *why = errno == ELOOP ? path + " is a symbolic link (not followed)"
                          : errno_text("cannot open", path, errno);
    return -1;
  }
  if (!keep_if_regular(fd, path, why)) {
    close(fd);
    return -1;
  }
  return fd;
}

int create_temporary_beside(const std::string& path, std::string* tmp_path, std::string* why) {
  constexpr int kTries = 16;  // only a name taken in the meantime makes another try
  for (int attempt = 0; attempt < kTries; ++attempt) {
    char suffix[48];
    std::snprintf(suffix, sizeof suffix, ".tmp.%d.%016llx", static_cast<int>(getpid()),
                  static_cast<unsigned long long>(name_entropy()));
    *tmp_path = path + suffix;
    const int fd =
        open(tmp_path->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) return fd;
    if (errno != EEXIST) {
      *why = errno_text("cannot create", *tmp_path, errno);
      return -1;
    }
  }
  *why = "no fresh temporary name beside " + path + " after " + std::to_string(kTries) + " tries";
  return -1;
}

bool write_file_replacing(const std::string& path, std::string_view data, std::string* why) {
  std::string tmp;
  const int fd = create_temporary_beside(path, &tmp, why);
  if (fd < 0) return false;
  bool ok = write_all(fd, data);
  if (!ok) *why = errno_text("cannot write", tmp, errno);
  if (close(fd) != 0 && ok) {
    *why = errno_text("cannot close", tmp, errno);
    ok = false;
  }
  if (ok && std::rename(tmp.c_str(), path.c_str()) != 0) {
    *why = errno_text("cannot rename the temporary over", path, errno);
    ok = false;
  }
  if (!ok) unlink(tmp.c_str());
  return ok;
}

}  // namespace dq
