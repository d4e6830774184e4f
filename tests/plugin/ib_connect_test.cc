// The verbs backend's connect while its peer has not called accept yet, over fake verbs in this
// process (plain objects: fake_verbs_objects.h) and the real socket side channel on loopback.
// With NCCL's lazy connection a peer may call accept minutes after the connect started (a pipeline
// stage still in its first iteration, a compilation): the connect must wait for it while the peer
// lives, and fail soon once the peer is gone. A set-up that gives up while its side channel's own
// socket connect is still in progress leaves nothing open.
#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "plugin/ibverbs/ib_internal.h"
#include "tests/plugin/fake_verbs_objects.h"

namespace dq::net::ib {
namespace {

int fake_post_recv(ibv_qp*, ibv_recv_wr*, ibv_recv_wr**) {
  return 0;
}
int fake_poll_cq(ibv_cq*, int, ibv_wc*) {
  return 0;
}

// This process's open file descriptors.
int open_fds() {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int n = 0;
  while (readdir(d) != nullptr) ++n;  // bounded by the directory's entries
  closedir(d);
  return n;
}

// A loopback listener whose accept queue is full (backlog 0, one connection never accepted):
// Linux drops further SYNs, so a connect to it stays in progress.
struct FullListener {
  int fd = -1, held = -1;
  uint16_t port_be = 0;
  FullListener() {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 0) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      return;
    port_be = a.sin_port;
    held = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (held >= 0 && connect(held, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) port_be = 0;
  }
  ~FullListener() {
    if (held >= 0) close(held);
    if (fd >= 0) close(fd);
  }
};

class IbConnectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("DYNAMIQ_NET_IFNAME", "lo", 1);  // the side channel stays on loopback
    ctx_.ops.post_recv = fake_post_recv;
    ctx_.ops.poll_cq = fake_poll_cq;
    fake_verbs::install(&ctx_, &pd_, &dev_);
    net_.use_device_for_testing(dev_);
  }

  // The stage of the connect in progress that `handle` names (PendingConnect::stage).
  int stage() const {
    ibwire::Handle h;
    std::memcpy(&h, handle_, sizeof(h));
    auto* pc = reinterpret_cast<const PendingConnect*>(h.connect_state);
    return pc == nullptr ? -1 : pc->stage;
  }

  // Calls connect for `ms` milliseconds, as NCCL's proxy does while the peer has not accepted:
  // every call must succeed without a comm.
  void connect_for(int64_t ms) {
    const Clock::time_point t = Clock::now();
    while (ms_since(t) < ms) {
      void* sc = nullptr;
      ASSERT_EQ(net_.connect(CommContext{}, 0, handle_, &sc), Status::kOk)
          << "after " << ms_since(t) << " ms in stage " << stage();
      ASSERT_EQ(sc, nullptr);
      usleep(1000);
    }
  }

  // A verbs listener on handle_ (*lc) and full_ up, with a 300 ms DYNAMIQ_NET_TIMEOUT_MS.
  void listen_beside_a_full_listener(void** lc) {
    setenv("DYNAMIQ_NET_TIMEOUT_MS", "300", 1);
    ASSERT_NE(full_.port_be, 0);
    ASSERT_EQ(net_.listen(CommContext{}, 0, handle_, lc), Status::kOk);
  }

  FullListener full_;
  ibv_context ctx_{};
  ibv_pd pd_{};
  IbDevice dev_;
  IbNet net_;
  char handle_[NCCL_NET_HANDLE_MAXSIZE] = {};
};

TEST_F(IbConnectTest, AcceptLaterThanTheTimeoutStillConnects) {
  setenv("DYNAMIQ_NET_TIMEOUT_MS", "300", 1);
  void* lc = nullptr;
  ASSERT_EQ(net_.listen(CommContext{}, 0, handle_, &lc), Status::kOk);
  // The peer computes for over three times DYNAMIQ_NET_TIMEOUT_MS before its first accept.
  connect_for(1000);
  ASSERT_EQ(stage(), 2) << "the connect should be waiting for the peer's answer";
  void* sc = nullptr;
  void* rc = nullptr;
  const Clock::time_point t = Clock::now();
  while ((sc == nullptr || rc == nullptr) && ms_since(t) < 5000) {
    if (rc == nullptr) {
      ASSERT_EQ(net_.accept(lc, &rc), Status::kOk);
    }
    if (sc == nullptr) {
      ASSERT_EQ(net_.connect(CommContext{}, 0, handle_, &sc), Status::kOk);
    }
    usleep(1000);
  }
  EXPECT_NE(sc, nullptr);
  EXPECT_NE(rc, nullptr);
  EXPECT_EQ(net_.close_send(sc), Status::kOk);
  EXPECT_EQ(net_.close_recv(rc), Status::kOk);
  EXPECT_EQ(net_.close_listen(lc), Status::kOk);
}

// The acceptor's connection is made only once the connector's queue pairs are in RTS: its first
// FIFO write into a QP still in INIT would be dropped and resent only after the ACK timeout.
TEST_F(IbConnectTest, AcceptReturnsOnlyOnceTheConnectorsQueuePairsAreReady) {
  setenv("DYNAMIQ_NET_TIMEOUT_MS", "60000", 1);  // the set-up's bound is not what is tested
  void* lc = nullptr;
  ASSERT_EQ(net_.listen(CommContext{}, 0, handle_, &lc), Status::kOk);
  void* sc = nullptr;
  void* rc = nullptr;
  Clock::time_point t = Clock::now();
  while (stage() < 2 && ms_since(t) < 5000) {
    ASSERT_EQ(net_.connect(CommContext{}, 0, handle_, &sc), Status::kOk);
    usleep(1000);
  }
  ASSERT_EQ(stage(), 2) << "the connect should be waiting for the acceptor's answer";
  ibwire::Handle h;
  std::memcpy(&h, handle_, sizeof(h));
  const auto* pending = reinterpret_cast<const PendingConnect*>(h.connect_state);
  const std::vector<ibv_qp*> connector_qps = pending->sc->qps;
  // The acceptor alone is called for a while (the connector's next connect call comes later):
  // it must not finish meanwhile.
  t = Clock::now();
  while (rc == nullptr && ms_since(t) < 300) {
    ASSERT_EQ(net_.accept(lc, &rc), Status::kOk);
    usleep(1000);
  }
  EXPECT_EQ(rc, nullptr) << "accept returned before the connector's queue pairs were ready";
  t = Clock::now();
  while ((sc == nullptr || rc == nullptr) && ms_since(t) < 5000) {
    if (sc == nullptr) {
      ASSERT_EQ(net_.connect(CommContext{}, 0, handle_, &sc), Status::kOk);
    }
    if (rc == nullptr) {
      ASSERT_EQ(net_.accept(lc, &rc), Status::kOk);
      if (rc != nullptr) {
        for (const ibv_qp* q : connector_qps) {
          EXPECT_EQ(q->state, IBV_QPS_RTS) << "the acceptor's connection was made first";
        }
      }
    }
    usleep(1000);
  }
  ASSERT_NE(sc, nullptr);
  ASSERT_NE(rc, nullptr);
  for (const ibv_qp* q : static_cast<RecvComm*>(rc)->qps) EXPECT_EQ(q->state, IBV_QPS_RTS);
  EXPECT_EQ(net_.close_send(sc), Status::kOk);
  EXPECT_EQ(net_.close_recv(rc), Status::kOk);
  EXPECT_EQ(net_.close_listen(lc), Status::kOk);
}

TEST_F(IbConnectTest, PeerThatDiesBeforeAcceptingFailsTheConnectSoon) {
  // A bound far beyond the test's wait: the failure must come from the side channel.
  setenv("DYNAMIQ_NET_TIMEOUT_MS", "60000", 1);
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // the peer: listens, hands over its handle, never accepts
    close(fds[0]);
    IbNet peer;
    peer.use_device_for_testing(dev_);
    void* lc = nullptr;
    char h[NCCL_NET_HANDLE_MAXSIZE] = {};
    if (peer.listen(CommContext{}, 0, h, &lc) != Status::kOk) _exit(1);
    if (write(fds[1], h, sizeof(h)) != static_cast<ssize_t>(sizeof(h))) _exit(2);
    for (;;) pause();  // until killed
  }
  close(fds[1]);
  ASSERT_EQ(read(fds[0], handle_, sizeof(handle_)), static_cast<ssize_t>(sizeof(handle_)));
  close(fds[0]);
  connect_for(500);
  EXPECT_EQ(stage(), 2);
  kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  const Clock::time_point t = Clock::now();
  Status st = Status::kOk;
  void* sc = nullptr;
  while (st == Status::kOk && sc == nullptr && ms_since(t) < 5000) {
    st = net_.connect(CommContext{}, 0, handle_, &sc);
    usleep(1000);
  }
  EXPECT_NE(st, Status::kOk) << "the connect went on for " << ms_since(t)
                             << " ms after its peer died";
  EXPECT_EQ(sc, nullptr);
  EXPECT_LT(ms_since(t), 2000);
}

TEST_F(IbConnectTest, ConnectTimingOutInItsSideChannelConnectLeavesNoSocketOpen) {
  void* lc = nullptr;
  ASSERT_NO_FATAL_FAILURE(listen_beside_a_full_listener(&lc));
  ibwire::Handle h;
  std::memcpy(&h, handle_, sizeof(h));
  ASSERT_EQ(h.sock.family, AF_INET);
  h.sock.port_be = full_.port_be;  // the side channel's connect never completes
  std::memcpy(handle_, &h, sizeof(h));
  const int before = open_fds();
  void* sc = nullptr;
  ASSERT_EQ(net_.connect(CommContext{}, 0, handle_, &sc), Status::kOk);
  ASSERT_EQ(stage(), 0);
  // The verbs set-up's bound passes first (its start precedes its socket connect's): the order
  // that left the socket connect behind.
  std::memcpy(&h, handle_, sizeof(h));
  reinterpret_cast<PendingConnect*>(h.connect_state)->start -= std::chrono::seconds(10);
  EXPECT_EQ(net_.connect(CommContext{}, 0, handle_, &sc), Status::kTimeout);
  EXPECT_EQ(sc, nullptr);
  EXPECT_EQ(stage(), -1);
  EXPECT_EQ(open_fds(), before) << "a socket of the abandoned set-up is still open";
  EXPECT_EQ(net_.close_listen(lc), Status::kOk);
}

TEST_F(IbConnectTest, AcceptTimingOutInItsConnectBackLeavesNoSocketOpen) {
  void* lc = nullptr;
  ASSERT_NO_FATAL_FAILURE(listen_beside_a_full_listener(&lc));
  // A connector's kConnect whose reply handle names the full listener: the acceptor's connect
  // back never completes.
  Conn connector;
  connector.dev = &dev_;
  ASSERT_EQ(connector.make_qps(1), Status::kOk);
  Ctl c{};
  connector.fill_ctl(&c, ibwire::kConnect);
  c.addr = reinterpret_cast<uint64_t>(&c);
  char reply[NCCL_NET_HANDLE_MAXSIZE] = {};
  void* reply_lc = nullptr;
  ASSERT_EQ(socket_backend().listen(CommContext{}, 0, reply, &reply_lc), Status::kOk);
  wire::Handle rh;
  std::memcpy(&rh, reply, sizeof(rh));
  rh.port_be = full_.port_be;
  rh.nsocks = 1;
  std::memcpy(c.reply_handle, &rh, sizeof(rh));
  ibwire::Handle h;
  std::memcpy(&h, handle_, sizeof(h));
  void* side = nullptr;
  const Clock::time_point t = Clock::now();
  while (side == nullptr && ms_since(t) < 5000) {
    ASSERT_EQ(socket_backend().connect(CommContext{}, 0, &h.sock, &side), Status::kOk);
  }
  ASSERT_NE(side, nullptr);
  void* req = nullptr;
  ASSERT_EQ(socket_backend().isend(side, &c, sizeof(c), kSideTag, nullptr, &req), Status::kOk);
  ASSERT_NE(req, nullptr);
  for (int done = 0; done == 0 && ms_since(t) < 5000;)
    ASSERT_EQ(socket_backend().test(req, &done, nullptr), Status::kOk);
  const int before = open_fds();
  auto* listener = static_cast<ListenComm*>(lc);
  void* rc = nullptr;
  while ((listener->pending.empty() || listener->pending[0]->stage != 1) && ms_since(t) < 5000) {
    ASSERT_EQ(net_.accept(lc, &rc), Status::kOk);
    ASSERT_EQ(rc, nullptr);
    usleep(1000);
  }
  ASSERT_EQ(listener->pending.size(), 1u);
  ASSERT_EQ(listener->pending[0]->stage, 1) << "the acceptor should be connecting back";
  // The set-up's bound passes before its connect back's own (which starts later).
  listener->pending[0]->start -= std::chrono::seconds(10);
  ASSERT_EQ(net_.accept(lc, &rc), Status::kOk);  // one slow peer does not fail the listener
  EXPECT_EQ(rc, nullptr);
  EXPECT_TRUE(listener->pending.empty());
  EXPECT_EQ(open_fds(), before) << "a socket of the abandoned set-up is still open";
  EXPECT_EQ(socket_backend().close_send(side), Status::kOk);
  EXPECT_EQ(socket_backend().close_listen(reply_lc), Status::kOk);
  EXPECT_EQ(net_.close_listen(lc), Status::kOk);
}

}  // namespace
}  // namespace dq::net::ib
