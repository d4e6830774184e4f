// Loopback throughput of the net plugin: one connection between two processes, fixed-size
// messages with several in flight, through the exported v11 table (dlopen, like NCCL).
// Usage: net_loopback_bench [--size BYTES] [--inflight N] [--seconds S] [--register 0|1]
// --register 1 registers every buffer once with regMr and passes its handle, as NCCL does
// (default 0: no handle, so a backend that needs registration, verbs, registers per request).
// Prints one line: "dynamiq-net loopback size=... inflight=... nsocks=... gbps=<Gbit/s>".
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>

#include "tests/plugin/plugin_harness.h"

namespace {

using dq::net::testing::Clock;
using dq::net::testing::PluginLib;
using dq::net::testing::seconds_since;

constexpr int kDataTag = 0;
constexpr int kEndTag = 1;

void die(const char* what) {
  std::fprintf(stderr, "net_loopback_bench: %s\n", what);
  std::exit(2);
}

// One test() call; while nothing completes, nap briefly instead of spinning so that the
// plugin's I/O threads keep the CPU (the machine may have only a couple of cores).
bool poll_request(const dqNetV11* net, void* req, int* size, bool* failed = nullptr) {
  int done = 0;
  if (net->test(req, &done, size) != dqNetSuccess) {
    if (failed == nullptr) die("a request failed");
    *failed = true;
    return false;
  }
  return done != 0;
}

void nap() {
  std::this_thread::sleep_for(std::chrono::microseconds(200));
}

// The buffer's memory handle when `reg` (regMr once, as NCCL does), else nullptr.
void* register_buffer(const dqNetV11* net, bool reg, void* comm, void* data, size_t size) {
  void* mh = nullptr;
  if (reg && net->regMr(comm, data, size, NCCL_PTR_HOST, &mh) != dqNetSuccess) die("regMr failed");
  return mh;
}

void run_sender(const dqNetV11* net, void* ctx, char* handle, size_t size, int inflight,
                double seconds, bool reg, int done_fd) {
  void* sc = nullptr;
  Clock::time_point t = Clock::now();
  while (sc == nullptr && seconds_since(t) < 30) {
    if (net->connect(ctx, 0, handle, &sc, nullptr) != dqNetSuccess) die("connect failed");
  }
  if (sc == nullptr) die("connect timed out");
  std::vector<char> buf(size, 'x');
  void* mh = register_buffer(net, reg, sc, buf.data(), size);
  std::deque<void*> window;
  t = Clock::now();
  // Bounded by `seconds` (plus the time to drain at most `inflight` messages).
  while (seconds_since(t) < seconds) {
    while (static_cast<int>(window.size()) < inflight) {
      void* req = nullptr;
      if (net->isend(sc, buf.data(), size, kDataTag, mh, nullptr, &req) != dqNetSuccess) {
        die("isend failed");
      }
      if (req == nullptr) break;
      window.push_back(req);
    }
    if (!window.empty()) {
      if (poll_request(net, window.front(), nullptr)) {
        window.pop_front();
      } else {
        nap();
      }
    }
  }
  while (!window.empty()) {
    if (poll_request(net, window.front(), nullptr)) {
      window.pop_front();
    } else {
      nap();
    }
  }
  void* end = nullptr;
  while (end == nullptr) {
    if (net->isend(sc, buf.data(), 0, kEndTag, nullptr, nullptr, &end) != dqNetSuccess) {
      die("isend failed");
    }
  }
  while (!poll_request(net, end, nullptr)) nap();
  // Close only after the receiver has closed: its still-posted receives would fail otherwise.
  char byte = 0;
  if (read(done_fd, &byte, 1) != 1) die("receiver vanished");
  if (mh != nullptr) net->deregMr(sc, mh);
  net->closeSend(sc);
}

double run_receiver(const dqNetV11* net, void* lc, size_t size, int inflight, bool reg,
                    int done_fd) {
  void* rc = nullptr;
  Clock::time_point t = Clock::now();
  while (rc == nullptr && seconds_since(t) < 30) {
    if (net->accept(lc, &rc, nullptr) != dqNetSuccess) die("accept failed");
  }
  if (rc == nullptr) die("accept timed out");
  std::vector<std::vector<char>> bufs(static_cast<size_t>(inflight), std::vector<char>(size));
  std::vector<void*> mhs;
  for (auto& b : bufs) mhs.push_back(register_buffer(net, reg, rc, b.data(), size));
  auto post = [&](int tag, void* data, size_t cap, void* mh) {
    void* req = nullptr;
    int tag_copy = tag;
    while (req == nullptr) {
      if (net->irecv(rc, 1, &data, &cap, &tag_copy, &mh, nullptr, &req) != dqNetSuccess) {
        die("irecv failed");
      }
    }
    return req;
  };
  char end_byte = 0;
  void* end_req = post(kEndTag, &end_byte, 1, nullptr);
  std::deque<std::pair<void*, int>> window;  // request, buffer index
  for (int i = 0; i < inflight; ++i) {
    window.emplace_back(post(kDataTag, bufs[i].data(), size, mhs[static_cast<size_t>(i)]), i);
  }
  long long completed = 0;
  Clock::time_point first{};
  Clock::time_point last{};
  // Bounded by the sender's end marker (the sender runs for a fixed time).
  for (;;) {
    int got = 0;
    bool failed = false;
    // After the end marker the sender closes; the still-posted receives then fail, by design.
    if (poll_request(net, end_req, nullptr)) break;
    if (poll_request(net, window.front().first, &got, &failed)) {
      if (static_cast<size_t>(got) != size) die("short message");
      last = Clock::now();
      if (completed == 0) first = last;
      ++completed;
      int idx = window.front().second;
      window.pop_front();
      window.emplace_back(post(kDataTag, bufs[static_cast<size_t>(idx)].data(), size,
                               mhs[static_cast<size_t>(idx)]),
                          idx);
      continue;
    }
    if (failed) die("a receive failed before the end marker");
    nap();
  }
  for (void* mh : mhs) {
    if (mh != nullptr) net->deregMr(rc, mh);
  }
  net->closeRecv(rc);
  if (write(done_fd, "x", 1) != 1) die("cannot signal the sender");
  double secs = std::chrono::duration<double>(last - first).count();
  if (completed < 2 || secs <= 0) die("too few messages to time");
  // The first completion starts the clock, so it is not counted.
  return static_cast<double>(completed - 1) * static_cast<double>(size) * 8 / secs / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  size_t size = 4u << 20;
  int inflight = 8;
  double seconds = 5;
  bool reg = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--size")
      size = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--inflight")
      inflight = std::atoi(argv[i + 1]);
    else if (a == "--seconds")
      seconds = std::atof(argv[i + 1]);
    else if (a == "--register")
      reg = std::atoi(argv[i + 1]) != 0;
    else
      die("unknown option (use --size, --inflight, --seconds, --register)");
  }
  if (size == 0 || inflight < 1 || inflight > NCCL_NET_MAX_REQUESTS || seconds <= 0) {
    die("bad arguments");
  }
  PluginLib& pl = PluginLib::get();
  if (pl.v11 == nullptr) die(pl.error.c_str());
  const dqNetV11* net = pl.v11;
  void* ctx = nullptr;
  if (net->init(&ctx, 7, nullptr, nullptr, nullptr) != dqNetSuccess) die("init failed");
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc = nullptr;
  if (net->listen(ctx, 0, handle, &lc) != dqNetSuccess) die("listen failed");
  std::fflush(stdout);
  int done_pipe[2];
  if (pipe(done_pipe) != 0) die("pipe failed");
  pid_t pid = fork();
  if (pid < 0) die("fork failed");
  if (pid == 0) {
    close(done_pipe[1]);
    run_sender(net, ctx, handle, size, inflight, seconds, reg, done_pipe[0]);
    _exit(0);
  }
  close(done_pipe[0]);
  double gbps = run_receiver(net, lc, size, inflight, reg, done_pipe[1]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) die("sender failed");
  const char* nsocks = std::getenv("DYNAMIQ_NET_NSOCKS");
  std::printf("dynamiq-net loopback size=%zu inflight=%d nsocks=%s registered=%d gbps=%.3f\n", size,
              inflight, nsocks != nullptr ? nsocks : "default", reg ? 1 : 0, gbps);
  net->closeListen(lc);
  return 0;
}
