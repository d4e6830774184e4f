// Two real processes over loopback through the exported ABI: data exchange both ways, a peer
// killed with SIGKILL (the survivor's requests must fail within a bounded time), also while a
// child it forked lives on, and a foreign process holding a forged handle.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "plugin/socket/socket_wire.h"
#include "tests/plugin/plugin_harness.h"

namespace dq::net::testing {
namespace {

constexpr double kFailBoundS = 5.0;  // survivor must see an error within this

const dqNetV11* plugin_net() {
  PluginLib& pl = PluginLib::get();
  return pl.v11;
}

// Child-side helpers return 0 on success, a distinct code per failure (no gtest in children).
int child_connect(const char* handle, void** sc) {
  const dqNetV11* net = plugin_net();
  void* ctx = nullptr;
  if (net->init(&ctx, 42, nullptr, nullptr, nullptr) != dqNetSuccess) return 10;
  char h[NCCL_NET_HANDLE_MAXSIZE];
  std::memcpy(h, handle, sizeof(h));
  *sc = nullptr;
  Clock::time_point t = Clock::now();
  while (*sc == nullptr && seconds_since(t) < 10) {
    if (net->connect(ctx, 0, h, sc, nullptr) != dqNetSuccess) return 11;
  }
  return *sc != nullptr ? 0 : 12;
}

// A listener of the child's own, its handle in `handle` (to travel over a pipe).
int child_listen(char* handle, void** lc) {
  void* ctx = nullptr;
  if (plugin_net()->init(&ctx, 42, nullptr, nullptr, nullptr) != dqNetSuccess) return 30;
  if (plugin_net()->listen(ctx, 0, handle, lc) != dqNetSuccess) return 31;
  return 0;
}

int child_send_and_wait(void* sc, std::vector<char>& buf, int tag) {
  const dqNetV11* net = plugin_net();
  void* req = nullptr;
  for (int i = 0; i < 1000 && req == nullptr; ++i) {
    if (net->isend(sc, buf.data(), buf.size(), tag, nullptr, nullptr, &req) != dqNetSuccess) {
      return 20;
    }
  }
  if (req == nullptr) return 21;
  int done = 0;
  if (wait_request(net, req, nullptr, &done, 60) != dqNetSuccess || !done) return 22;
  return 0;
}

void* post_recv(void* rc, std::vector<char>& buf, int tag) {
  void* data = buf.data();
  size_t size = buf.size();
  void* req = nullptr;
  EXPECT_EQ(plugin_net()->irecv(rc, 1, &data, &size, &tag, nullptr, nullptr, &req), dqNetSuccess);
  return req;
}

int wait_child(pid_t pid) {
  int status = 0;
  Clock::time_point t = Clock::now();
  while (seconds_since(t) < 60) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

class MultiRank : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(PluginLib::get().lib, nullptr) << PluginLib::get().error;
    ASSERT_EQ(plugin_net()->init(&ctx_, 42, nullptr, &LogCapture::logger, nullptr), dqNetSuccess);
    ASSERT_EQ(plugin_net()->listen(ctx_, 0, handle_, &lc_), dqNetSuccess);
  }
  void TearDown() override {
    if (lc_ != nullptr) plugin_net()->closeListen(lc_);
    plugin_net()->finalize(ctx_);
  }
  void* ctx_ = nullptr;
  void* lc_ = nullptr;
  char handle_[NCCL_NET_HANDLE_MAXSIZE] = {};
};

TEST_F(MultiRank, TwoProcessesExchangeBothWays) {
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(pipefd[0]);
    void* sc = nullptr;
    int rc = child_connect(handle_, &sc);
    if (rc != 0) _exit(rc);
    // Child's own listen for the way back; its handle travels over the pipe.
    void* lc = nullptr;
    char back[NCCL_NET_HANDLE_MAXSIZE];
    if ((rc = child_listen(back, &lc)) != 0) _exit(rc);
    if (write(pipefd[1], back, sizeof(back)) != static_cast<ssize_t>(sizeof(back))) _exit(32);
    for (size_t size : {size_t{0}, size_t{1}, size_t{(1u << 20) + 3}, size_t{64u << 20}}) {
      std::vector<char> buf(size);
      fill(buf, static_cast<uint32_t>(size) + 1);
      if ((rc = child_send_and_wait(sc, buf, static_cast<int>(size % 1000))) != 0) _exit(rc);
    }
    void* rcomm = accept_within(plugin_net(), lc);
    if (rcomm == nullptr) _exit(33);
    std::vector<char> echo(3u << 20);
    void* req = post_recv(rcomm, echo, 77);
    int done = 0;
    int got = 0;
    if (req == nullptr || wait_request(plugin_net(), req, &got, &done, 60) != dqNetSuccess ||
        !done) {
      _exit(34);
    }
    std::vector<char> expect(3u << 20);
    fill(expect, 777);
    if (got != static_cast<int>(expect.size()) || echo != expect) _exit(35);
    plugin_net()->closeSend(sc);
    plugin_net()->closeRecv(rcomm);
    plugin_net()->closeListen(lc);
    _exit(0);
  }
  close(pipefd[1]);
  void* rc = accept_within(plugin_net(), lc_);
  ASSERT_NE(rc, nullptr);
  for (size_t size : {size_t{0}, size_t{1}, size_t{(1u << 20) + 3}, size_t{64u << 20}}) {
    std::vector<char> in(size + 8, 0x11), expect(size);
    fill(expect, static_cast<uint32_t>(size) + 1);
    void* req = post_recv(rc, in, static_cast<int>(size % 1000));
    ASSERT_NE(req, nullptr);
    int done = 0;
    int got = -1;
    ASSERT_EQ(wait_request(plugin_net(), req, &got, &done, 60), dqNetSuccess);
    ASSERT_EQ(done, 1);
    EXPECT_EQ(got, static_cast<int>(size));
    EXPECT_TRUE(same_bytes(in.data(), expect.data(), size)) << size;
  }
  char back[NCCL_NET_HANDLE_MAXSIZE];
  ASSERT_EQ(read(pipefd[0], back, sizeof(back)), static_cast<ssize_t>(sizeof(back)));
  close(pipefd[0]);
  void* sc = nullptr;
  Clock::time_point t = Clock::now();
  while (sc == nullptr && seconds_since(t) < 10) {
    ASSERT_EQ(plugin_net()->connect(ctx_, 0, back, &sc, nullptr), dqNetSuccess);
  }
  ASSERT_NE(sc, nullptr);
  std::vector<char> out(3u << 20);
  fill(out, 777);
  void* sreq = nullptr;
  ASSERT_EQ(plugin_net()->isend(sc, out.data(), out.size(), 77, nullptr, nullptr, &sreq),
            dqNetSuccess);
  int done = 0;
  ASSERT_EQ(wait_request(plugin_net(), sreq, nullptr, &done, 60), dqNetSuccess);
  EXPECT_EQ(wait_child(pid), 0);
  plugin_net()->closeSend(sc);
  plugin_net()->closeRecv(rc);
}

TEST_F(MultiRank, KilledSenderFailsPendingReceivesQuickly) {
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    void* sc = nullptr;
    int rc = child_connect(handle_, &sc);
    if (rc != 0) _exit(rc);
    std::vector<char> first(1u << 20, 'a');
    if ((rc = child_send_and_wait(sc, first, 1)) != 0) _exit(rc);
    // Start a large message and then hang until killed.
    std::vector<char> big(256u << 20, 'b');
    void* req = nullptr;
    plugin_net()->isend(sc, big.data(), big.size(), 2, nullptr, nullptr, &req);
    pause();
    _exit(0);
  }
  void* rc = accept_within(plugin_net(), lc_);
  ASSERT_NE(rc, nullptr);
  std::vector<char> first(1u << 20);
  void* r1 = post_recv(rc, first, 1);
  int done = 0;
  ASSERT_EQ(wait_request(plugin_net(), r1, nullptr, &done, 30), dqNetSuccess);
  ASSERT_EQ(done, 1);
  EXPECT_EQ(first, std::vector<char>(1u << 20, 'a'));
  std::vector<char> big(256u << 20);
  std::vector<char> never(100);
  void* r2 = post_recv(rc, big, 2);
  void* r3 = post_recv(rc, never, 3);  // a tag the peer never sends
  ASSERT_NE(r2, nullptr);
  ASSERT_NE(r3, nullptr);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  Clock::time_point t = Clock::now();
  // The big one may or may not have made it; the never-sent one must fail.
  dqNetResult res2 = wait_request(plugin_net(), r2, nullptr, &done, kFailBoundS + 1);
  EXPECT_TRUE(res2 != dqNetSuccess || done == 1) << "request neither finished nor failed";
  dqNetResult res3 = wait_request(plugin_net(), r3, nullptr, &done, kFailBoundS + 1);
  EXPECT_NE(res3, dqNetSuccess);
  EXPECT_EQ(done, 0);
  EXPECT_LT(seconds_since(t), kFailBoundS);
  // A later receive fails at once.
  void* data = never.data();
  size_t size = never.size();
  int tag = 4;
  void* r4 = nullptr;
  EXPECT_NE(plugin_net()->irecv(rc, 1, &data, &size, &tag, nullptr, nullptr, &r4), dqNetSuccess);
  EXPECT_EQ(wait_child(pid), 128 + SIGKILL);
  plugin_net()->closeRecv(rc);
}

TEST_F(MultiRank, KilledReceiverFailsSenderQuickly) {
  // Here the child receives: it listens and hands its handle to us over a pipe.
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(pipefd[0]);
    void* lc = nullptr;
    char h[NCCL_NET_HANDLE_MAXSIZE];
    if (const int rc = child_listen(h, &lc); rc != 0) _exit(rc);
    if (write(pipefd[1], h, sizeof(h)) != static_cast<ssize_t>(sizeof(h))) _exit(42);
    void* rc = accept_within(plugin_net(), lc);
    if (rc == nullptr) _exit(43);
    std::vector<char> buf(8u << 20);
    void* req = post_recv(rc, buf, 1);
    int done = 0;
    if (req == nullptr || wait_request(plugin_net(), req, nullptr, &done, 60) != dqNetSuccess)
      _exit(44);
    pause();  // receive nothing more; wait to be killed
    _exit(0);
  }
  close(pipefd[1]);
  char h[NCCL_NET_HANDLE_MAXSIZE];
  ASSERT_EQ(read(pipefd[0], h, sizeof(h)), static_cast<ssize_t>(sizeof(h)));
  close(pipefd[0]);
  void* sc = nullptr;
  Clock::time_point t = Clock::now();
  while (sc == nullptr && seconds_since(t) < 10) {
    ASSERT_EQ(plugin_net()->connect(ctx_, 0, h, &sc, nullptr), dqNetSuccess);
  }
  ASSERT_NE(sc, nullptr);
  std::vector<char> out(8u << 20, 'z');
  void* req = nullptr;
  ASSERT_EQ(plugin_net()->isend(sc, out.data(), out.size(), 1, nullptr, nullptr, &req),
            dqNetSuccess);
  int done = 0;
  ASSERT_EQ(wait_request(plugin_net(), req, nullptr, &done, 30), dqNetSuccess);
  ASSERT_EQ(done, 1);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  EXPECT_EQ(wait_child(pid), 128 + SIGKILL);
  // Keep sending: within the bound, isend or test must report the dead peer.
  t = Clock::now();
  bool failed = false;
  while (!failed && seconds_since(t) < kFailBoundS) {
    void* r = nullptr;
    if (plugin_net()->isend(sc, out.data(), out.size(), 2, nullptr, nullptr, &r) != dqNetSuccess) {
      failed = true;
      break;
    }
    if (r == nullptr) continue;
    dqNetResult res = wait_request(plugin_net(), r, nullptr, &done, kFailBoundS);
    failed = res != dqNetSuccess;
  }
  EXPECT_TRUE(failed) << "sending to a killed peer never failed";
  EXPECT_LT(seconds_since(t), kFailBoundS);
  plugin_net()->closeSend(sc);
}

// A raw TCP connect to the listener a handle names: true if it is accepted (by the kernel).
bool tcp_listener_answers(const char* handle) {
  wire::Handle h;
  std::memcpy(&h, handle, sizeof(h));
  if (h.family != AF_INET) return false;  // the tests listen on loopback, IPv4
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = h.port_be;
  std::memcpy(&addr.sin_addr, h.addr, 4);
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool answered = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return answered;
}

// A rank that forked a worker after set-up (PyTorch's DataLoader workers) and then crashed: the
// worker, still alive, must not keep the rank's connections or its listening socket open, or the
// peers see no end of stream and wait for a timeout (the worker here would live 30 s).
TEST_F(MultiRank, KilledSenderWithALiveForkedWorkerFailsQuickly) {
  // The worker becomes our child when its parent dies, so that we reap it.
  ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(pipefd[0]);
    void* sc = nullptr;
    int rc = child_connect(handle_, &sc);
    if (rc != 0) _exit(rc);
    void* lc = nullptr;
    char h[NCCL_NET_HANDLE_MAXSIZE];
    if ((rc = child_listen(h, &lc)) != 0) _exit(rc);
    std::vector<char> first(1u << 20, 'a');
    if ((rc = child_send_and_wait(sc, first, 1)) != 0) _exit(rc);
    const pid_t worker = fork();
    if (worker < 0) _exit(52);
    if (worker == 0) {
      for (int i = 0; i < 300; ++i) usleep(100 * 1000);  // 30 s at most
      _exit(0);
    }
    if (write(pipefd[1], &worker, sizeof(worker)) != static_cast<ssize_t>(sizeof(worker)) ||
        write(pipefd[1], h, sizeof(h)) != static_cast<ssize_t>(sizeof(h)))
      _exit(53);
    pause();
    _exit(0);
  }
  close(pipefd[1]);
  void* rc = accept_within(plugin_net(), lc_);
  ASSERT_NE(rc, nullptr);
  std::vector<char> first(1u << 20);
  void* r1 = post_recv(rc, first, 1);
  int done = 0;
  ASSERT_EQ(wait_request(plugin_net(), r1, nullptr, &done, 30), dqNetSuccess);
  ASSERT_EQ(done, 1);
  pid_t worker = -1;
  char child_handle[NCCL_NET_HANDLE_MAXSIZE];
  ASSERT_EQ(read(pipefd[0], &worker, sizeof(worker)), static_cast<ssize_t>(sizeof(worker)));
  ASSERT_EQ(read(pipefd[0], child_handle, sizeof(child_handle)),
            static_cast<ssize_t>(sizeof(child_handle)));
  close(pipefd[0]);
  EXPECT_TRUE(tcp_listener_answers(child_handle));
  std::vector<char> never(100);
  void* r2 = post_recv(rc, never, 2);  // a tag the peer never sends
  ASSERT_NE(r2, nullptr);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  const Clock::time_point t = Clock::now();
  EXPECT_NE(wait_request(plugin_net(), r2, nullptr, &done, kFailBoundS + 1), dqNetSuccess);
  const double failed_after_s = seconds_since(t);
  EXPECT_LT(failed_after_s, kFailBoundS);
  EXPECT_EQ(wait_child(pid), 128 + SIGKILL);
  EXPECT_EQ(kill(worker, 0), 0) << "the worker was not alive: the case was not tested";
  EXPECT_FALSE(tcp_listener_answers(child_handle))
      << "a connect to the dead rank's listener was accepted while its worker lived";
  std::printf("receive failed %.3f s after the rank was killed, its worker alive\n",
              failed_after_s);
  kill(worker, SIGKILL);
  EXPECT_EQ(wait_child(worker), 128 + SIGKILL);
  prctl(PR_SET_CHILD_SUBREAPER, 0);
  plugin_net()->closeRecv(rc);
}

TEST_F(MultiRank, ForeignProcessWithForgedHandleIsRefused) {
  LogCapture::clear();
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    char forged[NCCL_NET_HANDLE_MAXSIZE];
    std::memcpy(forged, handle_, sizeof(forged));
    wire::Handle h;
    std::memcpy(&h, forged, sizeof(h));
    h.secret = ~h.secret;
    std::memcpy(forged, &h, sizeof(h));
    void* sc = nullptr;
    int rc = child_connect(forged, &sc);
    if (rc != 0) _exit(rc);
    std::vector<char> evil(4096, 'E');
    void* req = nullptr;
    plugin_net()->isend(sc, evil.data(), evil.size(), 5, nullptr, nullptr, &req);
    std::this_thread::sleep_for(std::chrono::seconds(2));
    _exit(0);
  }
  // Nothing is accepted from the forger.
  void* rc = accept_within(plugin_net(), lc_, 1.5);
  EXPECT_EQ(rc, nullptr);
  EXPECT_TRUE(LogCapture::contains("wrong secret", "127.0.0.1"));
  EXPECT_EQ(wait_child(pid), 0);
  if (rc != nullptr) plugin_net()->closeRecv(rc);
}

}  // namespace
}  // namespace dq::net::testing
