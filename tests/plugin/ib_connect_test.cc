// The verbs backend's connect while its peer has not called accept yet, over fake verbs in this
// process (plain objects: fake_verbs_objects.h) and the real socket side channel on loopback.
// With NCCL's lazy connection a peer may call accept minutes after the connect started (a pipeline
// stage still in its first iteration, a compilation): the connect must wait for it while the peer
// lives, and fail soon once the peer is gone.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

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

}  // namespace
}  // namespace dq::net::ib
