#include "tools/run/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/launcher_env.h"
#include "config/settings.h"

namespace dq::rendezvous {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[4] = {'D', 'Q', 'R', 'Z'};
constexpr uint32_t kVersion = 1;
constexpr size_t kMaxKeyBytes = 64;
constexpr size_t kMaxPayloadBytes = 1 << 20;  // an ncclUniqueId is 128 bytes
constexpr auto kPerConnectionLimit = std::chrono::seconds(5);
constexpr auto kFirstBackoff = std::chrono::milliseconds(1);
constexpr auto kMaxBackoff = std::chrono::milliseconds(50);

enum ReplyCode : uint32_t { kReplyOk = 0, kReplyOtherKey = 1, kReplyBadSize = 2 };

bool parse_int_env(const char* name, long lo, long hi, int* out, bool* present) {
  const char* text = std::getenv(name);
  *present = text != nullptr && *text != '\0';
  if (!*present) return true;
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  *out = static_cast<int>(v);
  return true;
}

bool valid_key(const char* key) {
  size_t n = std::strlen(key);
  if (n == 0 || n > kMaxKeyBytes || key[0] == '.') return false;
  return std::all_of(key, key + n, [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

int ms_left(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(ms, 0, 1000 * 1000));
}

void put_u32(std::string* out, uint32_t v) {
  uint32_t be = htonl(v);
  out->append(reinterpret_cast<const char*>(&be), 4);
}

uint32_t get_u32(const unsigned char* p) {
  uint32_t be;
  std::memcpy(&be, p, 4);
  return ntohl(be);
}

// ---------------------------------------------------------------------------------------------
// File transport ($DYNAMIQ_RUN_DIR): header "DQRZ" + u32 size, then the bytes.

Status publish_file(const JobEnv& env, const char* key, const void* data, size_t size) {
  const std::string final_path = env.run_dir + "/" + key;
  const std::string temp_path =
      env.run_dir + "/." + key + ".tmp." + std::to_string(static_cast<long>(getpid()));
  std::string contents(kMagic, 4);
  put_u32(&contents, static_cast<uint32_t>(size));
  contents.append(static_cast<const char*>(data), size);
  int fd = open(temp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    DQ_FAIL(Status::kSystemError, "rendezvous: create %s: %s", temp_path.c_str(), strerror(errno));
  size_t done = 0;
  for (int attempt = 0; attempt < 1000 && done < contents.size(); ++attempt) {
    ssize_t n = write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  close(fd);
  if (done != contents.size()) {
    unlink(temp_path.c_str());
    DQ_FAIL(Status::kSystemError, "rendezvous: write %s failed: %s", temp_path.c_str(),
            strerror(errno));
  }
  if (rename(temp_path.c_str(), final_path.c_str()) != 0) {
    unlink(temp_path.c_str());
    DQ_FAIL(Status::kSystemError, "rendezvous: rename to %s: %s", final_path.c_str(),
            strerror(errno));
  }
  return Status::kOk;
}

Status wait_file(const JobEnv& env, const char* key, void* data, size_t size) {
  const std::string path = env.run_dir + "/" + key;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(env.timeout_s));
  auto backoff = kFirstBackoff;
  // Bounded by the deadline: every turn either returns or sleeps at least kFirstBackoff.
  for (;;) {
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      std::vector<unsigned char> buf(8 + size + 1);
      size_t got = 0;
      for (int attempt = 0; attempt < 1000 && got < buf.size(); ++attempt) {
        ssize_t n = read(fd, buf.data() + got, buf.size() - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += static_cast<size_t>(n);
      }
      close(fd);
      if (got != 8 + size || std::memcmp(buf.data(), kMagic, 4) != 0 ||
          get_u32(buf.data() + 4) != size)
        DQ_FAIL(Status::kMalformedPayload,
                "rendezvous: %s is not a %zu-byte rendezvous record (%zu bytes read)", path.c_str(),
                size, got);
      std::memcpy(data, buf.data() + 8, size);
      return Status::kOk;
    }
    if (errno != ENOENT)
      DQ_FAIL(Status::kSystemError, "rendezvous: open %s: %s", path.c_str(), strerror(errno));
    if (Clock::now() >= deadline)
      DQ_FAIL(Status::kTimeout,
              "rendezvous: rank %d waited %.3g s for rank 0 to publish %s; it never appeared "
              "(did rank 0 fail or not start?)",
              env.rank, env.timeout_s, path.c_str());
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, kMaxBackoff);
  }
}

// ---------------------------------------------------------------------------------------------
// TCP transport (no DYNAMIQ_RUN_DIR): rank 0 serves on MASTER_ADDR:MASTER_PORT+1.
// Client hello: "DQRZ" u32 version, u32 rank, u32 size, u32 key length, key.
// Server reply: "DQRZ" u32 code, then `size` bytes when the code is kReplyOk.

Status send_all(int fd, const void* buf, size_t n, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(buf);
  size_t done = 0;
  for (int turn = 0; turn < 100000 && done < n; ++turn) {
    pollfd pfd{fd, POLLOUT, 0};
    int ready = poll(&pfd, 1, ms_left(deadline));
    if (ready == 0) DQ_FAIL(Status::kTimeout, "rendezvous: send timed out");
    if (ready < 0 && errno == EINTR) continue;
    ssize_t sent = send(fd, p + done, n - done, MSG_NOSIGNAL);
    if (sent < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (sent <= 0) DQ_FAIL(Status::kSystemError, "rendezvous: send: %s", strerror(errno));
    done += static_cast<size_t>(sent);
  }
  return done == n ? Status::kOk : Status::kSystemError;
}

// kSystemError with errno 0 means the peer closed the connection.
Status recv_all(int fd, void* buf, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(buf);
  size_t done = 0;
  for (int turn = 0; turn < 100000 && done < n; ++turn) {
    pollfd pfd{fd, POLLIN, 0};
    int ready = poll(&pfd, 1, ms_left(deadline));
    if (ready == 0) return Status::kTimeout;
    if (ready < 0 && errno == EINTR) continue;
    ssize_t got = recv(fd, p + done, n - done, 0);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got == 0) errno = 0;
    if (got <= 0) return Status::kSystemError;
    done += static_cast<size_t>(got);
  }
  return done == n ? Status::kOk : Status::kSystemError;
}

Status resolve(const JobEnv& env, sockaddr_storage* addr, socklen_t* len) {
  if (env.master_addr.empty() || env.master_port < 0)
    DQ_FAIL(Status::kInvalidArgument,
            "rendezvous: neither DYNAMIQ_RUN_DIR nor MASTER_ADDR and MASTER_PORT are set for a "
            "%d-rank job (start it with dynamiq-run or torchrun)",
            env.world_size);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(env.master_port + 1);
  int rc = getaddrinfo(env.master_addr.c_str(), port.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr)
    DQ_FAIL(Status::kInvalidArgument, "rendezvous: cannot resolve MASTER_ADDR '%s': %s",
            env.master_addr.c_str(), gai_strerror(rc));
  std::memcpy(addr, found->ai_addr, found->ai_addrlen);
  *len = found->ai_addrlen;
  freeaddrinfo(found);
  return Status::kOk;
}

class Socket {
 public:
  explicit Socket(int fd = -1) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

// Serves one connection; *served_rank is set when that rank got the bytes.
Status serve_one(int fd, const char* key, const void* data, size_t size, int world_size,
                 Clock::time_point job_deadline, int* served_rank) {
  *served_rank = -1;
  const auto deadline = std::min(job_deadline, Clock::now() + kPerConnectionLimit);
  unsigned char head[20];
  if (recv_all(fd, head, sizeof head, deadline) != Status::kOk ||
      std::memcmp(head, kMagic, 4) != 0 || get_u32(head + 4) != kVersion)
    DQ_FAIL(Status::kMalformedPayload, "rendezvous: dropped a connection that sent no valid hello");
  const uint32_t rank = get_u32(head + 8), want_size = get_u32(head + 12);
  const uint32_t key_len = get_u32(head + 16);
  if (key_len > kMaxKeyBytes)
    DQ_FAIL(Status::kMalformedPayload, "rendezvous: dropped a hello with a %u-byte key", key_len);
  char their_key[kMaxKeyBytes + 1] = {};
  if (recv_all(fd, their_key, key_len, deadline) != Status::kOk)
    DQ_FAIL(Status::kMalformedPayload, "rendezvous: dropped a hello cut short");
  uint32_t code = kReplyOk;
  if (std::strcmp(their_key, key) != 0)
    code = kReplyOtherKey;
  else if (want_size != size)
    code = kReplyBadSize;
  std::string reply(kMagic, 4);
  put_u32(&reply, code);
  if (code == kReplyOk) reply.append(static_cast<const char*>(data), size);
  DQ_CHECK(send_all(fd, reply.data(), reply.size(), deadline));
  if (code == kReplyOk && rank >= 1 && rank < static_cast<uint32_t>(world_size))
    *served_rank = static_cast<int>(rank);
  return Status::kOk;
}

Status publish_tcp(const JobEnv& env, const char* key, const void* data, size_t size) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  DQ_CHECK(resolve(env, &addr, &len));
  // Every address of the host, on the port: MASTER_ADDR may resolve on rank 0's own host to a
  // loopback address (Debian's /etc/hosts maps the host name to 127.0.1.1) while the other
  // ranks reach it by its network address. torch's TCPStore listens the same way. Not where
  // MASTER_ADDR is loopback itself (a job on one host, every test): nothing outside the host
  // can reach the unique id then, nor hold the rendezvous up with connections of its own.
  const std::string& m = env.master_addr;
  const bool loopback_only = m == "127.0.0.1" || m == "::1" || m == "localhost";
  if (!loopback_only && addr.ss_family == AF_INET)
    reinterpret_cast<sockaddr_in*>(&addr)->sin_addr.s_addr = htonl(INADDR_ANY);
  else if (!loopback_only && addr.ss_family == AF_INET6)
    reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr = in6addr_any;
  Socket listener(socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (listener.fd() < 0) DQ_FAIL(Status::kSystemError, "rendezvous: socket: %s", strerror(errno));
  int one = 1;
  setsockopt(listener.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(listener.fd(), reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      listen(listener.fd(), std::min(env.world_size, 4096)) != 0)
    DQ_FAIL(Status::kSystemError, "rendezvous: rank 0 cannot listen on %s:%d: %s",
            env.master_addr.c_str(), env.master_port + 1, strerror(errno));
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(env.timeout_s));
  std::vector<bool> served(env.world_size, false);
  int remaining = env.world_size - 1;
  // Bounded by the deadline: each turn waits in poll() for a connection.
  while (remaining > 0) {
    pollfd pfd{listener.fd(), POLLIN, 0};
    int ready = poll(&pfd, 1, ms_left(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0 || Clock::now() >= deadline)
      DQ_FAIL(Status::kTimeout,
              "rendezvous: rank 0 waited %.3g s on %s:%d but %d of %d ranks never asked for '%s'",
              env.timeout_s, env.master_addr.c_str(), env.master_port + 1, remaining,
              env.world_size - 1, key);
    Socket conn(accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (conn.fd() < 0) continue;
    int rank = -1;
    if (serve_one(conn.fd(), key, data, size, env.world_size, deadline, &rank) == Status::kOk &&
        rank > 0 && !served[rank]) {
      served[rank] = true;
      --remaining;
    }
  }
  return Status::kOk;
}

Status fetch_tcp(const JobEnv& env, const char* key, void* data, size_t size) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  DQ_CHECK(resolve(env, &addr, &len));
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(env.timeout_s));
  std::string hello(kMagic, 4);
  put_u32(&hello, kVersion);
  put_u32(&hello, static_cast<uint32_t>(env.rank));
  put_u32(&hello, static_cast<uint32_t>(size));
  put_u32(&hello, static_cast<uint32_t>(std::strlen(key)));
  hello.append(key);
  auto backoff = kFirstBackoff;
  const char* last_problem = "no answer";
  // Bounded by the deadline: every failed turn sleeps at least kFirstBackoff.
  while (Clock::now() < deadline) {
    Socket conn(socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (conn.fd() < 0) DQ_FAIL(Status::kSystemError, "rendezvous: socket: %s", strerror(errno));
    bool connected = connect(conn.fd(), reinterpret_cast<sockaddr*>(&addr), len) == 0;
    if (!connected && errno == EINPROGRESS) {
      pollfd pfd{conn.fd(), POLLOUT, 0};
      int err = 0;
      socklen_t err_len = sizeof err;
      connected = poll(&pfd, 1, std::min(ms_left(deadline), 1000)) == 1 &&
                  getsockopt(conn.fd(), SOL_SOCKET, SO_ERROR, &err, &err_len) == 0 && err == 0;
    }
    if (connected) {
      unsigned char head[8];
      if (send_all(conn.fd(), hello.data(), hello.size(), deadline) == Status::kOk &&
          recv_all(conn.fd(), head, sizeof head, deadline) == Status::kOk) {
        if (std::memcmp(head, kMagic, 4) != 0)
          DQ_FAIL(Status::kMalformedPayload,
                  "rendezvous: %s:%d answered with something that is not a rendezvous reply",
                  env.master_addr.c_str(), env.master_port + 1);
        uint32_t code = get_u32(head + 4);
        if (code == kReplyBadSize)
          DQ_FAIL(Status::kInvalidArgument, "rendezvous: rank 0 publishes '%s' with another size",
                  key);
        if (code == kReplyOk) {
          if (recv_all(conn.fd(), data, size, deadline) == Status::kOk) return Status::kOk;
          last_problem = "reply cut short";
        } else {
          last_problem = "rank 0 was serving another key";
        }
      } else {
        last_problem = "connection dropped";
      }
    } else {
      last_problem = "connection refused (rank 0 not listening yet?)";
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, kMaxBackoff);
  }
  DQ_FAIL(Status::kTimeout, "rendezvous: rank %d got no '%s' from %s:%d within %.3g s (last: %s)",
          env.rank, key, env.master_addr.c_str(), env.master_port + 1, env.timeout_s, last_problem);
}

// The local rank where `family` sets none (Slurm's PMI-2 plugin sets PMI_RANK and PMI_SIZE but not
// MPI_LOCALRANKID): a later family's, where that family gives the process the same rank (the
// same job step: srun --mpi=pmi2 sets SLURM_PROCID and SLURM_LOCALID beside them); else the rank
// itself (one node).
int local_rank_elsewhere(const LauncherVariables& family, int rank) {
  bool after = false;
  for (const LauncherVariables& v : kLauncherVariables) {
    if (&v == &family) {
      after = true;
      continue;
    }
    if (!after) continue;
    int other_rank = -1, local = -1;
    bool has_rank = false, has_local = false;
    if (parse_int_env(v.rank, 0, 1 << 24, &other_rank, &has_rank) && has_rank &&
        other_rank == rank && parse_int_env(v.local_rank, 0, 1 << 24, &local, &has_local) &&
        has_local)
      return local;
  }
  return rank;
}

// Rank, size and local rank from the first family of kLauncherVariables (common/launcher_env.h,
// the launchers dynamiq-perf and the demo run under) that sets any of them; its rank and size must
// both be set, so that a job started by any launcher is never taken for one rank of one.
Status read_rank_variables(JobEnv* out, const char** family) {
  for (const LauncherVariables& v : kLauncherVariables) {
    bool has_rank = false, has_world = false, has_local = false;
    if (!parse_int_env(v.rank, 0, 1 << 24, &out->rank, &has_rank) ||
        !parse_int_env(v.size, 1, 1 << 24, &out->world_size, &has_world) ||
        !parse_int_env(v.local_rank, 0, 1 << 24, &out->local_rank, &has_local))
      DQ_FAIL(Status::kInvalidArgument, "rendezvous: %s, %s or %s is not a valid number", v.rank,
              v.size, v.local_rank);
    if (!has_rank && !has_world) continue;
    if (has_rank != has_world)
      DQ_FAIL(Status::kInvalidArgument, "rendezvous: %s and %s must be set together", v.rank,
              v.size);
    if (out->rank >= out->world_size)
      DQ_FAIL(Status::kInvalidArgument, "rendezvous: %s %d is not below %s %d", v.rank, out->rank,
              v.size, out->world_size);
    if (!has_local) out->local_rank = local_rank_elsewhere(v, out->rank);
    *family = v.rank;
    return Status::kOk;
  }
  out->rank = 0;
  out->world_size = 1;
  out->local_rank = 0;
  return Status::kOk;
}

}  // namespace

Status read_job_env(JobEnv* out) {
  *out = JobEnv{};
  const char* family = nullptr;
  if (Status s = read_rank_variables(out, &family); s != Status::kOk) return s;
  bool has_port = false;
  if (!parse_int_env("MASTER_PORT", 1, 65534, &out->master_port, &has_port))
    DQ_FAIL(Status::kInvalidArgument, "rendezvous: MASTER_PORT is not a valid number");
  if (!has_port) out->master_port = -1;
  // dynamiq's own variables come from the settings table (validated there: an invalid value
  // warns once and keeps the default); MASTER_ADDR is the launcher's (torchrun's).
  const config::Settings settings = config::current();
  if (!settings.run_dir.empty()) out->run_dir = settings.run_dir;
  if (const char* addr = std::getenv("MASTER_ADDR")) out->master_addr = addr;
  out->timeout_s = settings.rendezvous_timeout_s;
  // Several ranks need a way to meet: refuse now, naming the variables, rather than wait out the
  // timeout (or run as independent one-rank jobs).
  if (out->world_size > 1 && out->run_dir.empty() &&
      (out->master_addr.empty() || out->master_port < 0))
    DQ_FAIL(Status::kInvalidArgument,
            "rendezvous: %s says rank %d of %d, but neither DYNAMIQ_RUN_DIR nor MASTER_ADDR and "
            "MASTER_PORT are set; under srun or mpirun export MASTER_ADDR (the first node's "
            "address) and MASTER_PORT (a free port; MASTER_PORT+1 is used too)",
            family, out->rank, out->world_size);
  return Status::kOk;
}

Status share_bytes(const JobEnv& env, const char* key, void* data, size_t size) {
  if (!valid_key(key))
    DQ_FAIL(Status::kInvalidArgument, "rendezvous: key '%s' must be 1..64 of [A-Za-z0-9._-]", key);
  if (size == 0 || size > kMaxPayloadBytes)
    DQ_FAIL(Status::kInvalidArgument, "rendezvous: %zu bytes is not in 1..%zu", size,
            kMaxPayloadBytes);
  if (env.world_size == 1) return Status::kOk;
  if (!env.run_dir.empty()) {
    if (env.rank == 0) return publish_file(env, key, data, size);
    return wait_file(env, key, data, size);
  }
  if (env.rank == 0) return publish_tcp(env, key, data, size);
  return fetch_tcp(env, key, data, size);
}

}  // namespace dq::rendezvous
