// The metrics file's final write when the job is stopped by SIGTERM (torchrun, SLURM) or SIGINT,
// before the handler that was installed before ours runs (the default one ends the process).
//
// A signal handler may only call async-signal-safe functions, and rendering the file allocates,
// formats and takes the registry's locks. So the handler does no more than write one byte into a
// pipe and wait (poll, bounded) for one byte back from a writer thread, which blocks in read(2)
// on that pipe and renders and writes the file as metrics_flush() does. The writer thread has
// both signals blocked, so they always reach an application thread. Bounded: when the
// interrupted thread itself holds a lock the writer needs (it was inside a periodic write, or
// a malloc arena lock the writer contends for), the write cannot finish before the handler
// returns; after kWriteWaitMs the handler chains on regardless, so a stop is never delayed
// longer than that. Another signal's handler interrupting the wait does not end it, and a second
// SIGTERM on another thread waits for the write in flight before chaining.
//
// The same thread makes the periodic writes (metrics_request_write), so a training thread never
// waits on the file system inside an NCCL call (a stalled NFS or Lustre mount would stall that
// rank in the collective its peers wait in).
//
// A forked child (a data-loader worker) inherits the handlers but not the thread: there the
// handler only chains.
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <mutex>
#include <system_error>
#include <thread>

#include "common/c_locale.h"
#include "common/log.h"
#include "shim/engine/metrics.h"

namespace dq::engine {
namespace {

constexpr int kSignals[2] = {SIGTERM, SIGINT};
constexpr int kWriteWaitMs = 5000;  // the longest a stop waits for the final write

// Plain data read by the handler; written once, before the handlers are installed.
int g_request[2] = {-1, -1};  // handler -> writer thread
int g_done[2] = {-1, -1};     // writer thread -> handler (non-blocking read end)
// The process that owns the writer thread, 0 before it runs: read by the handler and by any
// thread's periodic request (lock-free: signal-safe).
std::atomic<pid_t> g_pid{0};
struct sigaction g_previous[2];
std::atomic<bool> g_busy{false};         // one write per signal in flight (lock-free: signal-safe)
std::atomic<pid_t> g_waiting_thread{0};  // the thread whose handler waits for that write

// What a request byte asks of the writer thread: the handler's write, answered with a byte on
// g_done, or a periodic write (metrics_request_write), answered with nothing.
constexpr char kSignalWrite = 1;
constexpr char kPeriodicWrite = 2;
std::atomic<bool> g_periodic_queued{false};  // a periodic request not yet taken by the thread

void writer_loop() {
  const CNumericLocale c_numbers;  // a thread starts in the application's global locale
  for (;;) {
    char b = 0;
    const ssize_t n = read(g_request[0], &b, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    if (b == kPeriodicWrite) {
      g_periodic_queued.store(false);  // a tick during this write queues the next one
      metrics_flush();
      continue;
    }
    metrics_flush();
    while (write(g_done[1], &b, 1) < 0 && errno == EINTR) {
    }
  }
}

// Runs what was installed before: its handler, or the default action (re-raised: the signal is
// blocked while this handler runs, so it is delivered, with the default disposition, when the
// handler returns), or nothing for an ignored signal.
// SIG_DFL and SIG_IGN are read whatever the flags: the kernel keeps SA_SIGINFO beside them for
// a program that set them through a reused struct sigaction, and that struct's handler field is
// then 0 or 1, not a function.
void chain(int sig, siginfo_t* info, void* context) {
  const struct sigaction& old = g_previous[sig == SIGTERM ? 0 : 1];
  if (old.sa_handler == SIG_IGN) return;
  if (old.sa_handler == SIG_DFL) {
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
    raise(sig);
    return;
  }
  if ((old.sa_flags & SA_SIGINFO) != 0) {
    old.sa_sigaction(sig, info, context);
    return;
  }
  old.sa_handler(sig);
}

// CLOCK_MONOTONIC in milliseconds (clock_gettime is async-signal-safe).
int64_t monotonic_ms() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000 + t.tv_nsec / 1000000;
}

// Waits for the writer's byte until `deadline_ms`. Another signal's handler on this thread ends
// poll(2) with EINTR, never restarted whatever SA_RESTART says (a data loader's SIGCHLD as its
// workers die of the same SIGTERM): the wait goes on to the same deadline.
void wait_for_write(int64_t deadline_ms) {
  for (;;) {  // bounded by the deadline
    const int64_t left = deadline_ms - monotonic_ms();
    if (left <= 0) return;
    pollfd p{g_done[0], POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(left));
    if (r == 1) {
      char b = 0;
      (void)!read(g_done[0], &b, 1);
      return;
    }
    if (r == 0 || errno != EINTR) return;
  }
}

void on_signal(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  if (getpid() == g_pid.load()) {
    const int64_t deadline_ms = monotonic_ms() + kWriteWaitMs;
    if (!g_busy.exchange(true)) {
      g_waiting_thread.store(gettid());
      char b = kSignalWrite;
      // A byte left by a write that finished after an earlier wait gave up.
      for (int i = 0; i < 64 && read(g_done[0], &b, 1) == 1; ++i) {
      }
      if (write(g_request[1], &b, 1) == 1) wait_for_write(deadline_ms);
      g_waiting_thread.store(0);
      g_busy.store(false);
    } else if (g_waiting_thread.load() != gettid()) {
      // Another thread's signal started the write (the launcher's SIGTERM and the scheduler's,
      // each to a thread of its own): chaining now would end the process (the default action)
      // mid-write. Wait for it, within the same bound. A signal nested on the waiting thread
      // itself cannot wait for it: it chains at once.
      while (g_busy.load() && monotonic_ms() < deadline_ms) {  // bounded by the deadline
        timespec one_ms{0, 1000000};
        nanosleep(&one_ms, nullptr);
      }
    }
  }
  chain(sig, info, context);
  errno = saved_errno;
}

void install() {
  if (pipe2(g_request, O_CLOEXEC) != 0) return;
  if (pipe2(g_done, O_CLOEXEC | O_NONBLOCK) != 0) {
    close(g_request[0]);
    close(g_request[1]);
    return;
  }
  sigset_t block, old;
  sigemptyset(&block);
  for (int sig : kSignals) sigaddset(&block, sig);
  pthread_sigmask(SIG_BLOCK, &block, &old);
  bool started = true;
  try {
    std::thread(writer_loop).detach();
  } catch (const std::system_error& e) {  // EAGAIN: a thread or pids limit
    started = false;
    DQ_WARN(Subsys::kShim,
            "dynamiq: no thread for the metrics file's write on SIGTERM and SIGINT (%s): the file "
            "holds the last periodic write when the job is stopped",
            e.what());
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (!started) {
    for (int fd : {g_request[0], g_request[1], g_done[0], g_done[1]}) close(fd);
    return;
  }
  g_pid.store(getpid());
  for (int i = 0; i < 2; ++i) {
    if (sigaction(kSignals[i], nullptr, &g_previous[i]) != 0) continue;
    // An ignored signal (nohup) stays ignored: the job is not stopped by it.
    if (g_previous[i].sa_handler == SIG_IGN) continue;
    struct sigaction sa {};
    sa.sa_sigaction = on_signal;
    sigemptyset(&sa.sa_mask);
    // Whether interrupted system calls restart stays the previous handler's choice.
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | (g_previous[i].sa_flags & SA_RESTART);
    sigaction(kSignals[i], &sa, nullptr);
  }
  DQ_INFO(Subsys::kShim,
          "dynamiq: the metrics file is written once more on SIGTERM and SIGINT (then the "
          "handler installed before runs)");
}

}  // namespace

void metrics_install_signal_write() {
  static std::once_flag once;
  std::call_once(once, install);
}

bool metrics_request_write() {
  const pid_t owner = g_pid.load();
  if (owner == 0 || getpid() != owner) return false;  // no writer thread in this process
  if (g_periodic_queued.exchange(true)) return true;  // one is queued: it writes this state too
  const char b = kPeriodicWrite;
  // The request pipe holds 64 KiB and at most one periodic byte waits in it: never blocks.
  for (int i = 0; i < 8; ++i) {  // bounded: EINTR retries
    if (write(g_request[1], &b, 1) == 1) return true;
    if (errno != EINTR) break;
  }
  g_periodic_queued.store(false);
  return false;
}

}  // namespace dq::engine
