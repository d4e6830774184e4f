// Runs N ranks as forked processes with a deadline, for the multirank tests.
//
// The parent starts no thread before it forks: a child of a multi-threaded process inherits
// every lock another thread held (GCC 12's ASan hung ranks in its allocator's mutex; TSan
// refuses such children outright). So the NCCL unique ids are made by rank 0, a child, and
// reach the other ranks through pipes created before fork: a rank that finds the pipe closed
// knows rank 0 died and fails at once instead of waiting for ids that will never come.
//
// The parent polls the ranks, kills every rank left (SIGKILL) at the deadline or as soon as one
// rank ends in a way the test does not accept, and returns how each rank ended.
#pragma once

#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace dq::test {

// How one rank process ended.
struct RankExit {
  enum class How {
    kExited,      // exit status in `status`
    kSignaled,    // killed by a signal of its own (or someone else's), in `status`
    kDeadline,    // still running at the deadline: killed by the harness (a hang)
    kCut,         // killed by the harness after another rank failed
    kNotStarted,  // the harness refused to fork (see stderr)
  };
  How how = How::kNotStarted;
  int status = 0;        // waitpid's status for kExited and kSignaled
  double seconds = 0.0;  // from the fork until the parent saw it end

  bool exited(int code) const { return how == How::kExited && WEXITSTATUS(status) == code; }
  bool signaled(int sig) const { return how == How::kSignaled && WTERMSIG(status) == sig; }
  // The encoding the tests have always asserted on: the exit status, -signal, 124 for a hang,
  // 125 when cut short after another rank failed, 99 when the ranks never ran.
  int code() const {
    switch (how) {
      case How::kExited:
        return WEXITSTATUS(status);
      case How::kSignaled:
        return -WTERMSIG(status);
      case How::kDeadline:
        return 124;
      case How::kCut:
        return 125;
      case How::kNotStarted:
        break;
    }
    return 99;
  }
  std::string describe() const {
    char s[128];
    switch (how) {
      case How::kExited:
        std::snprintf(s, sizeof s, "exited with %d after %.1f s", WEXITSTATUS(status), seconds);
        break;
      case How::kSignaled:
        std::snprintf(s, sizeof s, "killed by signal %d (%s) after %.1f s", WTERMSIG(status),
                      strsignal(WTERMSIG(status)), seconds);
        break;
      case How::kDeadline:
        std::snprintf(s, sizeof s, "still running at the deadline (%.0f s): killed, a hang",
                      seconds);
        break;
      case How::kCut:
        std::snprintf(s, sizeof s, "killed after %.1f s because another rank failed", seconds);
        break;
      case How::kNotStarted:
        std::snprintf(s, sizeof s, "never started");
        break;
    }
    return s;
  }
};

struct RankOptions {
  int timeout_s = 300;  // for the whole run; 0: no deadline (the caller's own timeout applies)
  // Whether a rank ended as the test wants; the first that did not gets the others killed.
  // Empty: exit status 0.
  std::function<bool(int rank, const RankExit&)> expected;
  int id_timeout_s = 60;  // how long ranks 1.. wait for rank 0's ids
};

namespace detail {

// This process's threads, by name.
inline std::vector<std::string> threads_in_this_process() {
  std::vector<std::string> names;
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return names;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    char name[64] = "?";
    const std::string path = std::string("/proc/self/task/") + e->d_name + "/comm";
    if (FILE* f = std::fopen(path.c_str(), "r")) {
      if (std::fgets(name, sizeof name, f) != nullptr) name[std::strcspn(name, "\n")] = 0;
      std::fclose(f);
    }
    names.push_back(name);
  }
  closedir(d);
  return names;
}

// TSan runs a background thread of its own, and handles fork around it.
#if defined(__SANITIZE_THREAD__)
constexpr int kOwnThreads = 2;
#else
constexpr int kOwnThreads = 1;
#endif

inline double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Writes all of buf to fd; a reader gone is an error, not a SIGPIPE.
inline bool write_all(int fd, const void* buf, size_t bytes) {
  struct sigaction ignore = {};
  struct sigaction old = {};
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ignore, &old);
  const char* p = static_cast<const char*>(buf);
  while (bytes > 0) {
    const ssize_t k = write(fd, p, bytes);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    p += k;
    bytes -= static_cast<size_t>(k);
  }
  sigaction(SIGPIPE, &old, nullptr);
  return bytes == 0;
}

// Reads exactly `bytes` from fd within timeout_s. 1: done, 0: end of file (the writer died or
// gave up), -1: timeout or error.
inline int read_all(int fd, void* buf, size_t bytes, int timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  char* p = static_cast<char*>(buf);
  while (bytes > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return -1;
    pollfd pfd{fd, POLLIN, 0};
    const int ready = poll(&pfd, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return -1;
    const ssize_t k = read(fd, p, bytes);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return -1;
    if (k == 0) return 0;
    p += k;
    bytes -= static_cast<size_t>(k);
  }
  return 1;
}

// False, after a message naming them, when this process runs threads besides its own: a
// forked child can inherit a lock one of them holds and hang.
inline bool single_threaded() {
  const std::vector<std::string> threads = threads_in_this_process();
  if (static_cast<int>(threads.size()) <= kOwnThreads) return true;
  std::string names;
  for (const auto& t : threads) names += " " + t;
  std::fprintf(stderr,
               "rank harness: this process runs %zu threads (%s ) before forking its ranks; a "
               "forked child can inherit a lock one of them holds and hang. Start no thread "
               "(NCCL, TBB, ...) in the parent before run_ranks.\n",
               threads.size(), names.c_str());
  return false;
}

inline void close_fd(int* fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

// One run of the ranks, as the parent sees it (and each child, just after fork).
struct Launch {
  int n = 0;
  size_t shared_bytes = 0;
  std::vector<int> rd, wr;  // rank r >= 1 reads rd[r]; rank 0 writes wr[r]
  std::vector<pid_t> pids;
  std::vector<RankExit> out;
  std::chrono::steady_clock::time_point t0;

  void close_all() {
    for (int r = 0; r < n; ++r) close_fd(&rd[r]), close_fd(&wr[r]);
  }
};

// A pipe from rank 0 to each other rank, for the shared bytes. False (all closed) on failure.
inline bool open_pipes(Launch* l) {
  for (int r = 1; r < l->n; ++r) {
    int p[2];
    if (pipe(p) != 0) {
      std::perror("rank harness: pipe");
      l->close_all();
      return false;
    }
    l->rd[r] = p[0];
    l->wr[r] = p[1];
  }
  return true;
}

// Rank r, in its forked process: the shared bytes (rank 0 makes them and writes them to every
// other rank; the others read theirs), then body. Never returns.
[[noreturn]] inline void rank_main(Launch* l, int r, pid_t parent, const RankOptions& opt,
                                   const std::function<bool(void*)>& make_shared,
                                   const std::function<int(int, const void*)>& body) {
  const int n = l->n;
  const bool share = l->shared_bytes > 0;
  // A rank must not outlive a parent killed by the test runner's timeout.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(96);
  std::vector<char> bytes(l->shared_bytes);
  for (int k = 0; k < n; ++k)
    if (k != r) close_fd(&l->rd[k]);
  if (share && r == 0) {
    const bool made = make_shared(bytes.data());
    for (int k = 1; k < n; ++k) {
      if (made) write_all(l->wr[k], bytes.data(), l->shared_bytes);
      close_fd(&l->wr[k]);  // without the ids, the end of file tells the others
    }
    if (!made) {
      std::fprintf(stderr, "rank 0: cannot make the NCCL unique id\n");
      _exit(99);
    }
  } else if (share) {
    const int got = read_all(l->rd[r], bytes.data(), l->shared_bytes, opt.id_timeout_s);
    close_fd(&l->rd[r]);
    if (got != 1) {
      std::fprintf(stderr, "rank %d: %s\n", r,
                   got == 0 ? "rank 0 ended without sharing the NCCL unique id"
                            : "no NCCL unique id from rank 0 in time");
      _exit(99);
    }
  }
  int rc = 95;
  try {  // an exception must not carry the child on into the parent's code
    rc = body(r, bytes.data());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: exception: %s\n", r, e.what());
  } catch (...) {
    std::fprintf(stderr, "rank %d: exception\n", r);
  }
  std::fflush(nullptr);
  _exit(rc);
}

// Rank r ended with waitpid status st.
inline void rank_ended(Launch* l, int r, int st) {
  l->pids[r] = -1;
  l->out[r].how = WIFEXITED(st) ? RankExit::How::kExited : RankExit::How::kSignaled;
  l->out[r].status = st;
  l->out[r].seconds = since(l->t0);
}

// Kills every rank still running and reaps it; one the kill ended is recorded as `how`.
inline void kill_left(Launch* l, RankExit::How how) {
  for (int r = 0; r < l->n; ++r)
    if (l->pids[r] > 0) kill(l->pids[r], SIGKILL);
  for (int r = 0; r < l->n; ++r) {
    int st = 0;
    if (l->pids[r] <= 0 || waitpid(l->pids[r], &st, 0) != l->pids[r]) continue;
    rank_ended(l, r, st);
    if (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) l->out[r].how = how;  // else it ended first
  }
}

// Polls the ranks until every one ended, one ended in a way opt does not accept (the others are
// killed), or the deadline passed (all killed).
inline void wait_ranks(Launch* l, const RankOptions& opt) {
  const int n = l->n;
  auto ok = [&](int r) { return opt.expected ? opt.expected(r, l->out[r]) : l->out[r].exited(0); };
  const auto deadline = l->t0 + std::chrono::seconds(opt.timeout_s);
  for (int left = n; left > 0;) {  // bounded by the deadline
    for (int r = 0; r < n && left > 0; ++r) {
      int st = 0;
      if (l->pids[r] < 0 || waitpid(l->pids[r], &st, WNOHANG) != l->pids[r]) continue;
      rank_ended(l, r, st);
      --left;
      if (left > 0 && !ok(r)) {
        std::fprintf(stderr, "rank %d %s: killing the other ranks\n", r,
                     l->out[r].describe().c_str());
        kill_left(l, RankExit::How::kCut);
        left = 0;
      }
    }
    if (left > 0 && opt.timeout_s > 0 && std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "ranks still running after %d s: killing them (a hang)\n",
                   opt.timeout_s);
      kill_left(l, RankExit::How::kDeadline);
      break;
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Runs body(rank) in n forked processes; `shared` bytes made by make_shared in rank 0 reach
// every rank (through a pipe each) before its body runs.
inline std::vector<RankExit> run(int n, const RankOptions& opt, size_t shared_bytes,
                                 const std::function<bool(void*)>& make_shared,
                                 const std::function<int(int, const void*)>& body) {
  Launch l;
  l.n = n;
  l.shared_bytes = shared_bytes;
  l.out.resize(n);
  if (!single_threaded()) return l.out;
  l.rd.assign(n, -1);
  l.wr.assign(n, -1);
  if (shared_bytes > 0 && !open_pipes(&l)) return l.out;
  std::fflush(nullptr);  // nothing buffered gets written twice
  const pid_t parent = getpid();
  l.t0 = std::chrono::steady_clock::now();
  l.pids.assign(n, -1);
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("rank harness: fork");
      break;
    }
    if (pid == 0) rank_main(&l, r, parent, opt, make_shared, body);
    l.pids[r] = pid;
    if (r == 0)
      for (int k = 1; k < n; ++k) close_fd(&l.wr[k]);  // rank 0 holds the only write ends
    else
      close_fd(&l.rd[r]);
  }
  l.close_all();
  if (l.pids[n - 1] < 0) {  // a fork failed: the ranks that started cannot meet
    kill_left(&l, RankExit::How::kNotStarted);
    return l.out;
  }
  wait_ranks(&l, opt);
  return l.out;
}

}  // namespace detail

// Runs body(rank) in n forked processes; the parent stays single-threaded.
inline std::vector<RankExit> run_ranks(int n, const RankOptions& opt,
                                       const std::function<int(int rank)>& body) {
  return detail::run(n, opt, 0, nullptr, [&](int r, const void*) { return body(r); });
}

// The same, with `ids` NCCL unique ids: rank 0 makes them with make_id (ncclGetUniqueId, from
// whichever nccl header the caller uses; 0 is success) and every rank's body gets them.
template <typename Id, typename MakeId>
std::vector<RankExit> run_ranks(int n, int ids, MakeId make_id, const RankOptions& opt,
                                const std::function<int(int rank, const Id* ids)>& body) {
  return detail::run(
      n, opt, sizeof(Id) * ids,
      [&](void* buf) {
        Id* out = static_cast<Id*>(buf);
        for (int k = 0; k < ids; ++k)
          if (make_id(&out[k]) != decltype(make_id(out)){}) return false;
        return true;
      },
      [&](int r, const void* buf) { return body(r, static_cast<const Id*>(buf)); });
}

}  // namespace dq::test
