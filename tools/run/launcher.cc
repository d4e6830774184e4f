// dynamiq-run: starts N local ranks of one program, prefixes their output with "[rank] ",
// returns the first failure, stops the other ranks when one fails and enforces a timeout.
// One thread, one poll() loop over the ranks' pipes and a signalfd; nothing spins.
#include <fcntl.h>
#include <linux/nsfs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/status.h"
#include "tools/cli/cli.h"
#include "tools/run/launch_options.h"

extern char** environ;

namespace dq::run {
namespace {

constexpr int kExitUsage = 2;
constexpr int kExitTimeout = 124;
constexpr int kExitCannotRun = 127;
constexpr size_t kReadChunkBytes = 64 * 1024;
// A line longer than this is emitted in pieces (each prefixed) so one rank cannot grow memory.
constexpr size_t kMaxLineBytes = 64 * 1024;
// After every rank exited, output still in flight (or held by a grandchild) gets this long.
constexpr int kDrainMs = 2000;
constexpr int kPollSliceMs = 1000;  // poll wake-up when no deadline is nearer

using Clock = std::chrono::steady_clock;

int ms_until(Clock::time_point t) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(ms, 0, kPollSliceMs));
}

void say(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void say(const char* fmt, ...) {
  char text[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  std::string line = std::string("dynamiq-run: ") + text + "\n";
  ssize_t ignored = write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

// Writes all bytes; our output fds are blocking and signals arrive through the signalfd, so a
// write only returns short on a real error (e.g. the reader went away), where output is dropped.
void write_all(int fd, const struct iovec* parts, int count) {
  std::vector<iovec> iov(parts, parts + count);
  size_t index = 0;
  for (int attempt = 0; attempt < 1000 && index < iov.size(); ++attempt) {
    ssize_t n = writev(fd, iov.data() + index, static_cast<int>(iov.size() - index));
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return;
    }
    size_t left = static_cast<size_t>(n);
    while (index < iov.size() && left >= iov[index].iov_len) left -= iov[index++].iov_len;
    if (index < iov.size()) {
      iov[index].iov_base = static_cast<char*>(iov[index].iov_base) + left;
      iov[index].iov_len -= left;
    }
  }
}

// Reads one rank's stdout or stderr and re-emits whole lines with the rank prefix.
class LineForwarder {
 public:
  LineForwarder(int fd, int dest_fd, std::string prefix)
      : fd_(fd), dest_fd_(dest_fd), prefix_(std::move(prefix)) {}
  int fd() const { return fd_; }
  bool open() const { return fd_ >= 0; }

  // Called when poll says the fd is readable (or hung up). Reads once; never blocks.
  void on_readable() {
    char chunk[kReadChunkBytes];
    ssize_t n = read(fd_, chunk, sizeof chunk);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
      close_and_flush();
      return;
    }
    pending_.append(chunk, static_cast<size_t>(n));
    emit_complete_lines();
  }

  void close_and_flush() {
    if (!pending_.empty()) emit_line(pending_);
    pending_.clear();
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  void emit_complete_lines() {
    size_t start = 0;
    for (size_t guard = 0; guard <= pending_.size(); ++guard) {
      size_t nl = pending_.find('\n', start);
      if (nl == std::string::npos) break;
      emit_line(std::string_view(pending_).substr(start, nl - start));
      start = nl + 1;
    }
    pending_.erase(0, start);
    // A line without an end yet: forward its whole kMaxLineBytes pieces now.
    const size_t cut = pending_.size() / kMaxLineBytes * kMaxLineBytes;
    if (cut > 0) {
      emit_line(std::string_view(pending_).substr(0, cut));
      pending_.erase(0, cut);
    }
  }

  // Writes one line (in kMaxLineBytes pieces if longer), each piece prefixed, one writev each.
  void emit_line(std::string_view line) {
    static const char kNewline = '\n';
    size_t start = 0;
    do {
      std::string_view piece = line.substr(start, kMaxLineBytes);
      iovec parts[3] = {{const_cast<char*>(prefix_.data()), prefix_.size()},
                        {const_cast<char*>(piece.data()), piece.size()},
                        {const_cast<char*>(&kNewline), 1}};
      write_all(dest_fd_, parts, 3);
      start += piece.size();
    } while (start < line.size());
  }

  int fd_;
  int dest_fd_;
  std::string prefix_;
  std::string pending_;
};

struct RankProcess {
  int rank = 0;
  pid_t pid = -1;
  bool reaped = false;
  int exit_code = 0;
};

int exit_code_of(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

std::string describe_exit(int wait_status) {
  if (WIFSIGNALED(wait_status)) {
    int sig = WTERMSIG(wait_status);
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "exited with code " + std::to_string(exit_code_of(wait_status));
}

// A loopback TCP port that is free now, with the next port free too (the rendezvous helper's
// TCP fallback uses MASTER_PORT+1). Another process may still take it before the ranks do.
Status find_free_port(int* port) {
  for (int attempt = 0; attempt < 64; ++attempt) {
    int fds[2] = {-1, -1};
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fds[0] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fds[0] < 0) DQ_FAIL(Status::kSystemError, "socket: %s", strerror(errno));
    socklen_t len = sizeof addr;
    bool ok = bind(fds[0], reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
              getsockname(fds[0], reinterpret_cast<sockaddr*>(&addr), &len) == 0;
    int candidate = ok ? ntohs(addr.sin_port) : 0;
    if (ok && candidate < 65535) {
      fds[1] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      addr.sin_port = htons(static_cast<uint16_t>(candidate + 1));
      ok = fds[1] >= 0 && bind(fds[1], reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    } else {
      ok = false;
    }
    for (int fd : fds)
      if (fd >= 0) close(fd);
    if (ok) {
      *port = candidate;
      return Status::kOk;
    }
  }
  DQ_FAIL(Status::kSystemError, "no free pair of loopback TCP ports found in 64 attempts");
}

std::string executable_dir() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return ".";
  return exe.parent_path().string();
}

struct LibraryDirs {
  std::string cpu_nccl;
  std::string plugin;
};

#ifndef DQ_INSTALL_BINDIR
#define DQ_INSTALL_BINDIR "bin"
#endif
#ifndef DQ_INSTALL_LIBDIR
#define DQ_INSTALL_LIBDIR "lib"
#endif
#ifndef DQ_INSTALL_PREFIX
#define DQ_INSTALL_PREFIX "/usr/local"
#endif

// The library folder of an installed tree: <prefix>/<libdir>, with the prefix taken from this
// executable's folder (<prefix>/<bindir>) so that a staged (DESTDIR) or moved tree works too.
// Meson's bindir and libdir are relative to the prefix unless configured as absolute paths.
std::filesystem::path installed_libdir(const std::filesystem::path& here) {
  namespace fs = std::filesystem;
  const fs::path bindir(DQ_INSTALL_BINDIR), libdir(DQ_INSTALL_LIBDIR);
  if (libdir.is_absolute()) return libdir;
  if (bindir.is_absolute()) return fs::path(DQ_INSTALL_PREFIX) / libdir;
  fs::path prefix = here;
  for (const auto& part : bindir.lexically_normal()) {
    if (part.empty() || part == ".") continue;
    prefix = prefix.parent_path();
  }
  return prefix / libdir;
}

// The CPU NCCL and the plugin: in a build tree relative to this executable
// (<build>/tools/dynamiq-run: <build>/tools/cpu-nccl and <build>/plugin/abi), else in an
// installed tree (<prefix>/<libdir>/dynamiq/cpu-nccl and <prefix>/<libdir>).
Status locate_cpu_nccl(LibraryDirs* dirs, std::string* error) {
  namespace fs = std::filesystem;
  const fs::path here = executable_dir();
  const fs::path lib = installed_libdir(here);
  const fs::path candidates[2][2] = {{here / "cpu-nccl", here / ".." / "plugin" / "abi"},
                                     {lib / "dynamiq" / "cpu-nccl", lib}};
  for (const auto& [nccl_dir, plugin_dir] : candidates) {
    std::error_code ec;
    fs::path nccl = fs::weakly_canonical(nccl_dir, ec);
    fs::path plugin = fs::weakly_canonical(plugin_dir, ec);
    if (!fs::exists(nccl / "libnccl.so.2")) continue;
    if (!fs::exists(plugin / "libnccl-net-dynamiq.so")) {
      *error = "--cpu-nccl: " + (plugin / "libnccl-net-dynamiq.so").string() +
               " does not exist (build or install plugin/abi)";
      return Status::kInvalidArgument;
    }
    dirs->cpu_nccl = nccl.string();
    dirs->plugin = plugin.string();
    return Status::kOk;
  }
  *error = "--cpu-nccl: no CPU NCCL: neither " +
           (here / "cpu-nccl" / "libnccl.so.2").lexically_normal().string() + " (build tree) nor " +
           (lib / "dynamiq" / "cpu-nccl" / "libnccl.so.2").lexically_normal().string() +
           " (installed tree) exists";
  return Status::kInvalidArgument;
}

bool program_is_runnable(const std::string& program) {
  if (program.find('/') != std::string::npos) return access(program.c_str(), X_OK) == 0;
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  for (size_t guard = 0; guard <= dirs.size(); ++guard) {
    size_t colon = dirs.find(':', start);
    std::string dir = dirs.substr(start, colon == std::string::npos ? colon : colon - start);
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    struct stat st {};
    if (stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        access(candidate.c_str(), X_OK) == 0)
      return true;
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  return false;
}

// The environment every rank shares; RANK and LOCAL_RANK are added per rank.
std::vector<std::string> base_environment(const LaunchOptions& options, int master_port,
                                          const std::string& run_dir, const LibraryDirs* libs) {
  static const char* const kOwned[] = {
      "RANK",        "WORLD_SIZE",      "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
      "MASTER_PORT", "DYNAMIQ_RUN_DIR", "GROUP_RANK", "NODE_RANK"};
  std::vector<std::string> env;
  std::string old_library_path;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view entry(*e);
    std::string_view name = entry.substr(0, entry.find('='));
    bool owned =
        std::any_of(std::begin(kOwned), std::end(kOwned), [&](const char* k) { return name == k; });
    if (libs != nullptr && name == "LD_LIBRARY_PATH") {
      old_library_path = std::string(entry.substr(name.size() + 1));
      continue;
    }
    if (libs != nullptr && name == "NCCL_NET_PLUGIN") continue;
    if (!owned) env.emplace_back(entry);
  }
  const std::string world = std::to_string(options.num_ranks);
  env.push_back("WORLD_SIZE=" + world);
  env.push_back("LOCAL_WORLD_SIZE=" + world);
  env.push_back("GROUP_RANK=0");
  env.push_back("NODE_RANK=0");
  env.push_back("MASTER_ADDR=" + options.master_addr);
  env.push_back("MASTER_PORT=" + std::to_string(master_port));
  env.push_back("DYNAMIQ_RUN_DIR=" + run_dir);
  if (libs != nullptr) {
    std::string path = libs->cpu_nccl + ":" + libs->plugin;
    if (!old_library_path.empty()) path += ":" + old_library_path;
    env.push_back("LD_LIBRARY_PATH=" + path);
    env.push_back("NCCL_NET_PLUGIN=dynamiq");
    env.push_back("DYNAMIQ_CPU_NCCL=1");
    // Every rank runs on this host: keep the plugin's traffic on loopback unless told otherwise.
    if (std::getenv("DYNAMIQ_NET_IFNAME") == nullptr) env.push_back("DYNAMIQ_NET_IFNAME=lo");
  }
  return env;
}

// Sets NAME=VALUE in env, replacing an entry of the same NAME.
void set_env_entry(std::vector<std::string>* env, const std::string& entry) {
  const std::string prefix = entry.substr(0, entry.find('=') + 1);
  env->erase(std::remove_if(
                 env->begin(), env->end(),
                 [&](const std::string& e) { return e.compare(0, prefix.size(), prefix) == 0; }),
             env->end());
  env->push_back(entry);
}

// Opens the network namespace file of every rank (--rank-netns) and checks that it is one, so a
// typo fails before any rank starts. The descriptors are close-on-exec.
Status open_rank_namespaces(const LaunchOptions& options, std::vector<int>* fds,
                            std::string* error) {
  fds->assign(options.num_ranks, -1);
  if (options.rank_netns.empty()) return Status::kOk;
  for (int r = 0; r < options.num_ranks; ++r) {
    const std::string path = rank_netns_path(options.rank_netns, r);
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      *error = "--rank-netns: cannot open " + path + " for rank " + std::to_string(r) + ": " +
               strerror(errno) + " (create it with `ip netns add`)";
      return Status::kInvalidArgument;
    }
    (*fds)[r] = fd;
    if (ioctl(fd, NS_GET_NSTYPE) != CLONE_NEWNET) {
      *error =
          "--rank-netns: " + path + " (rank " + std::to_string(r) + ") is not a network namespace";
      return Status::kInvalidArgument;
    }
  }
  return Status::kOk;
}

class Launcher {
 public:
  explicit Launcher(const LaunchOptions& options) : options_(options) {}

  int run() {
    if (!program_is_runnable(options_.command[0])) {
      say("cannot run '%s': not found or not executable", options_.command[0].c_str());
      return kExitCannotRun;
    }
    LibraryDirs libs;
    if (options_.cpu_nccl) {
      std::string error;
      if (locate_cpu_nccl(&libs, &error) != Status::kOk) {
        say("%s", error.c_str());
        return kExitUsage;
      }
    }
    std::string netns_error;
    if (open_rank_namespaces(options_, &netns_fds_, &netns_error) != Status::kOk) {
      say("%s", netns_error.c_str());
      close_namespaces();
      return kExitUsage;
    }
    int master_port = 0;
    if (find_free_port(&master_port) != Status::kOk || make_run_dir() != Status::kOk) {
      close_namespaces();
      return 1;
    }
    int code = 1;
    if (setup_signals() == Status::kOk) {
      env_ = base_environment(options_, master_port, run_dir_, options_.cpu_nccl ? &libs : nullptr);
      code = spawn_all() == Status::kOk ? supervise() : stop_after_spawn_failure();
    }
    remove_run_dir();
    close_namespaces();
    return code;
  }

 private:
  void close_namespaces() {
    for (int& fd : netns_fds_) {
      if (fd >= 0) close(fd);
      fd = -1;
    }
  }

  Status make_run_dir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/dynamiq-run.XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr)
      DQ_FAIL(Status::kSystemError, "mkdtemp %s: %s", pattern.c_str(), strerror(errno));
    run_dir_ = pattern;  // mkdtemp creates it with mode 0700
    return Status::kOk;
  }

  void remove_run_dir() {
    if (run_dir_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(run_dir_, ec);
    if (ec) say("could not remove %s: %s", run_dir_.c_str(), ec.message().c_str());
  }

  Status setup_signals() {
    sigemptyset(&handled_);
    for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&handled_, sig);
    if (sigprocmask(SIG_BLOCK, &handled_, &original_mask_) != 0)
      DQ_FAIL(Status::kSystemError, "sigprocmask: %s", strerror(errno));
    signal_fd_ = signalfd(-1, &handled_, SFD_CLOEXEC | SFD_NONBLOCK);
    if (signal_fd_ < 0) DQ_FAIL(Status::kSystemError, "signalfd: %s", strerror(errno));
    // A closed stdout must not kill the launcher while ranks still run; writes just fail.
    signal(SIGPIPE, SIG_IGN);
    return Status::kOk;
  }

  Status spawn_all() {
    for (int r = 0; r < options_.num_ranks; ++r) DQ_CHECK(spawn(r));
    return Status::kOk;
  }

  Status spawn(int rank) {
    int out_pipe[2], err_pipe[2];
    if (pipe2(out_pipe, O_CLOEXEC) != 0)
      DQ_FAIL(Status::kSystemError, "pipe2: %s", strerror(errno));
    if (pipe2(err_pipe, O_CLOEXEC) != 0) {
      close(out_pipe[0]);
      close(out_pipe[1]);
      DQ_FAIL(Status::kSystemError, "pipe2: %s", strerror(errno));
    }
    // Everything the child needs is built before fork(): after it only async-signal-safe calls.
    std::vector<std::string> env = env_;
    env.push_back("RANK=" + std::to_string(rank));
    env.push_back("LOCAL_RANK=" + std::to_string(rank));
    for (const auto& entry : options_.rank_env) set_env_entry(&env, expand_rank(entry, rank));
    const int netns_fd = netns_fds_[rank];
    const std::string netns_failed =
        "dynamiq-run: rank " + std::to_string(rank) + " cannot enter network namespace " +
        (options_.rank_netns.empty() ? std::string() : rank_netns_path(options_.rank_netns, rank)) +
        ": ";
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<char*> argv;
    for (const auto& a : options_.command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const std::string exec_failed = "dynamiq-run: cannot execute " + options_.command[0] + ": ";
    const pid_t parent = getpid();

    pid_t pid = fork();
    if (pid < 0) {
      for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) close(fd);
      DQ_FAIL(Status::kSystemError, "fork: %s", strerror(errno));
    }
    if (pid == 0) {
      setpgid(0, 0);  // own process group: stopping a rank also stops what it started
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(kExitCannotRun);
      int null_fd = open("/dev/null", O_RDONLY);
      if (null_fd >= 0) dup2(null_fd, STDIN_FILENO);
      dup2(out_pipe[1], STDOUT_FILENO);
      dup2(err_pipe[1], STDERR_FILENO);
      signal(SIGPIPE, SIG_DFL);
      sigprocmask(SIG_SETMASK, &original_mask_, nullptr);
      if (netns_fd >= 0 && setns(netns_fd, CLONE_NEWNET) != 0) {
        const char* why = strerror(errno);
        ssize_t ignored = write(STDERR_FILENO, netns_failed.data(), netns_failed.size());
        ignored = write(STDERR_FILENO, why, strlen(why));
        ignored = write(STDERR_FILENO, "\n", 1);
        (void)ignored;
        _exit(kExitCannotRun);
      }
      execvpe(argv[0], argv.data(), envp.data());
      const char* reason = strerror(errno);
      ssize_t ignored = write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
      ignored = write(STDERR_FILENO, reason, strlen(reason));
      ignored = write(STDERR_FILENO, "\n", 1);
      (void)ignored;
      _exit(kExitCannotRun);
    }
    setpgid(pid, pid);  // also here, so kill(-pid) works even before the child ran
    close(out_pipe[1]);
    close(err_pipe[1]);
    for (int fd : {out_pipe[0], err_pipe[0]}) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    std::string prefix = "[";  // built in steps: GCC 12 warns falsely on "[" + std::string
    prefix += std::to_string(rank);
    prefix += "] ";
    forwarders_.emplace_back(out_pipe[0], STDOUT_FILENO, prefix);
    forwarders_.emplace_back(err_pipe[0], STDERR_FILENO, prefix);
    ranks_.push_back(RankProcess{rank, pid, false, 0});
    return Status::kOk;
  }

  int stop_after_spawn_failure() {
    say("could not start all %d ranks; stopping the ones that started", options_.num_ranks);
    failure_code_ = 1;
    begin_stop();
    return supervise();
  }

  void signal_all(int sig) {
    for (const auto& r : ranks_)
      if (r.pid > 0) kill(-r.pid, sig);  // the group: the rank and anything it started
  }

  // Processes a rank left in its group after it exited (a worker it started and did not wait
  // for; a rank's death signal reaches its own children only): they end with the job, as they
  // would when it is stopped, SIGTERM and then, after the grace period, SIGKILL. Bounded by the
  // grace period and the polls of kDrainMs slices.
  void end_leftovers() {
    auto any_left = [&] {
      // A launcher that is its PID namespace's init (a container without --init) or a subreaper
      // inherits the leftovers it stops: reaped here, or as zombies they stay in their group and
      // the wait runs out the grace period. Every rank is reaped by now: nothing else is ours.
      while (waitpid(-1, nullptr, WNOHANG) > 0) {
      }
      for (const auto& r : ranks_)
        if (r.pid > 0 && kill(-r.pid, 0) == 0) return true;
      return false;
    };
    if (!any_left()) return;
    say("processes the ranks started are still running after the ranks exited; stopping them");
    signal_all(SIGTERM);
    const auto until =
        Clock::now() + std::chrono::milliseconds(static_cast<long>(options_.grace_s * 1000));
    while (any_left() && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (any_left()) signal_all(SIGKILL);
  }

  void begin_stop() {
    if (stopping_) return;
    stopping_ = true;
    signal_all(SIGTERM);
    kill_at_ = Clock::now() + std::chrono::milliseconds(static_cast<long>(options_.grace_s * 1000));
  }

  bool all_reaped() const {
    return std::all_of(ranks_.begin(), ranks_.end(), [](const RankProcess& r) { return r.reaped; });
  }

  void on_rank_exit(pid_t pid, int wait_status) {
    for (auto& r : ranks_) {
      if (r.pid != pid || r.reaped) continue;
      r.reaped = true;
      r.exit_code = exit_code_of(wait_status);
      if (r.exit_code != 0 && !stopping_) {
        failure_code_ = r.exit_code;
        say("rank %d (pid %d) %s; stopping the other ranks", r.rank, static_cast<int>(pid),
            describe_exit(wait_status).c_str());
        begin_stop();
      }
      return;
    }
  }

  void reap() {
    for (size_t guard = 0; guard <= ranks_.size(); ++guard) {
      int status = 0;
      pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return;
      if (WIFEXITED(status) || WIFSIGNALED(status)) on_rank_exit(pid, status);
    }
  }

  void on_signal_fd() {
    for (int guard = 0; guard < 64; ++guard) {
      signalfd_siginfo info{};
      if (read(signal_fd_, &info, sizeof info) != static_cast<ssize_t>(sizeof info)) return;
      int sig = static_cast<int>(info.ssi_signo);
      if (sig == SIGCHLD) {
        reap();
      } else if (launcher_signal_ == 0) {
        launcher_signal_ = sig;
        say("received signal %d (%s); stopping all ranks", sig, strsignal(sig));
        if (!stopping_) {
          stopping_ = true;
          signal_all(sig == SIGINT ? SIGINT : SIGTERM);
          kill_at_ =
              Clock::now() + std::chrono::milliseconds(static_cast<long>(options_.grace_s * 1000));
        }
      }
    }
  }

  int supervise() {
    const auto start = Clock::now();
    const auto deadline =
        start + std::chrono::milliseconds(static_cast<long>(options_.timeout_s * 1000));
    bool killed = false;
    Clock::time_point drain_until{};
    std::vector<pollfd> fds;
    std::vector<LineForwarder*> owners;
    // Each turn blocks in poll() for at most kPollSliceMs; the loop ends when every rank is
    // reaped and its output drained, which the SIGKILL escalation and the drain limit bound.
    for (;;) {
      reap();  // SIGCHLD may have been merged or raced the signalfd
      const auto now = Clock::now();
      if (options_.timeout_s > 0 && !timed_out_ && !all_reaped() && now >= deadline) {
        timed_out_ = true;
        say("timeout: %.3g s passed; stopping all ranks", options_.timeout_s);
        begin_stop();
      }
      if (stopping_ && !killed && now >= kill_at_) {
        killed = true;
        if (!all_reaped())
          say("ranks still running %.3g s after SIGTERM; sending SIGKILL", options_.grace_s);
        signal_all(SIGKILL);
      }
      const bool any_open = std::any_of(forwarders_.begin(), forwarders_.end(),
                                        [](const LineForwarder& f) { return f.open(); });
      if (all_reaped()) {
        if (!any_open) break;
        if (drain_until == Clock::time_point{})
          drain_until = now + std::chrono::milliseconds(kDrainMs);
        if (now >= drain_until) break;
      }

      int wait_ms = kPollSliceMs;
      if (options_.timeout_s > 0 && !timed_out_) wait_ms = std::min(wait_ms, ms_until(deadline));
      if (stopping_ && !killed) wait_ms = std::min(wait_ms, ms_until(kill_at_));
      if (drain_until != Clock::time_point{}) wait_ms = std::min(wait_ms, ms_until(drain_until));

      fds.clear();
      owners.clear();
      fds.push_back({signal_fd_, POLLIN, 0});
      owners.push_back(nullptr);
      for (auto& f : forwarders_) {
        if (!f.open()) continue;
        fds.push_back({f.fd(), POLLIN, 0});
        owners.push_back(&f);
      }
      int ready = poll(fds.data(), fds.size(), wait_ms);
      if (ready < 0 && errno != EINTR) {
        say("poll: %s", strerror(errno));
        break;
      }
      for (size_t i = 0; ready > 0 && i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        if (owners[i] == nullptr)
          on_signal_fd();
        else
          owners[i]->on_readable();
      }
    }
    for (auto& f : forwarders_) f.close_and_flush();
    if (all_reaped()) end_leftovers();
    if (!all_reaped()) {
      // Only after poll() failed: make sure nothing outlives the launcher, then collect.
      signal_all(SIGKILL);
      for (auto& r : ranks_) {
        int status = 0;
        if (!r.reaped && waitpid(r.pid, &status, 0) == r.pid) on_rank_exit(r.pid, status);
      }
    }
    if (launcher_signal_ != 0) return 128 + launcher_signal_;
    if (failure_code_ != 0) return failure_code_;
    if (timed_out_) return kExitTimeout;
    return 0;
  }

  const LaunchOptions& options_;
  std::vector<std::string> env_;
  std::vector<int> netns_fds_;  // per rank, -1 without --rank-netns
  std::string run_dir_;
  sigset_t handled_{};
  sigset_t original_mask_{};
  int signal_fd_ = -1;
  std::vector<RankProcess> ranks_;
  std::vector<LineForwarder> forwarders_;
  bool stopping_ = false;
  bool timed_out_ = false;
  int failure_code_ = 0;
  int launcher_signal_ = 0;
  Clock::time_point kill_at_{};
};

}  // namespace
}  // namespace dq::run

int main(int argc, char** argv) {
  dq::run::LaunchOptions options;
  std::string error;
  if (dq::run::parse_launch_options(argc, argv, &options, &error) != dq::Status::kOk) {
    std::fprintf(stderr, "dynamiq-run: %s\n%s", error.c_str(), dq::run::launch_usage());
    return dq::run::kExitUsage;
  }
  if (options.show_help) {
    std::fputs(dq::run::launch_usage(), stdout);
    return 0;
  }
  if (options.show_version) {
    std::printf("%s\n", dq::cli::version_line("dynamiq-run").c_str());
    return 0;
  }
  dq::run::Launcher launcher(options);
  return launcher.run();
}
