// The verbs backend's iflush when the flush queue pair's send queue is full, over fake verbs in
// this process: a device context whose post_send and poll_cq (inline in <infiniband/verbs.h>,
// called through the context) hold the READs until the test lets them complete, and plain-object
// verbs for the rest (fake_verbs_objects.h).
// NCCL takes a NULL flush request as already flushed and lets the GPU read the received bytes,
// so every flush that is needed must return a request, and each must complete.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <deque>
#include <set>
#include <vector>

#include "plugin/ibverbs/ib_internal.h"
#include "tests/plugin/fake_verbs_objects.h"

namespace dq::net::ib {
namespace {

// What the fake device does with the flush READs: a send queue of kSqDepth entries that holds
// posted work requests until executed, then retires them as its completions are polled.
struct FakeDevice {
  struct Posted {
    uint64_t wr_id = 0;
    bool signalled = false;
  };
  ibv_context ctx{};
  ibv_pd pd{};
  std::deque<Posted> queue;           // posted, not yet retired (oldest first)
  size_t executed = 0;                // of them, the first `executed` are done on the "wire"
  int reads_posted = 0;               // READs accepted, all time
  int refused_posts = 0;              // posts beyond the send queue's depth (the plugin must never)
  int bad_reads = 0;                  // work requests that are not 1-byte RDMA READs
  std::set<uint64_t> signalled_done;  // wr_ids whose completion was polled
  std::set<uint64_t> read_addrs;
};
FakeDevice* g_fake = nullptr;

int fake_post_send(ibv_qp*, ibv_send_wr* wr, ibv_send_wr** bad) {
  int n = 0;
  for (const ibv_send_wr* w = wr; w != nullptr; w = w->next) ++n;
  if (g_fake->queue.size() + static_cast<size_t>(n) > static_cast<size_t>(kSqDepth)) {
    ++g_fake->refused_posts;
    *bad = wr;
    return ENOMEM;
  }
  for (const ibv_send_wr* w = wr; w != nullptr; w = w->next) {
    if (w->opcode != IBV_WR_RDMA_READ || w->num_sge != 1 || w->sg_list[0].length != 1)
      ++g_fake->bad_reads;
    g_fake->read_addrs.insert(w->wr.rdma.remote_addr);
    g_fake->queue.push_back({w->wr_id, (w->send_flags & IBV_SEND_SIGNALED) != 0});
    ++g_fake->reads_posted;
  }
  return 0;
}

int fake_poll_cq(ibv_cq*, int num, ibv_wc* wc) {
  int n = 0;
  // Bounded by the executed work requests.
  while (n < num && g_fake->executed > 0) {
    const FakeDevice::Posted p = g_fake->queue.front();
    g_fake->queue.pop_front();
    --g_fake->executed;
    if (!p.signalled) continue;  // retired with the signalled one after it
    wc[n] = ibv_wc{};
    wc[n].wr_id = p.wr_id;
    wc[n].status = IBV_WC_SUCCESS;
    wc[n].opcode = IBV_WC_RDMA_READ;
    g_fake->signalled_done.insert(p.wr_id);
    ++n;
  }
  return n;
}

class IbFlushTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g_fake = &fake_;
    fake_.ctx.ops.post_send = fake_post_send;
    fake_.ctx.ops.poll_cq = fake_poll_cq;
    fake_verbs::install(&fake_.ctx, &fake_.pd, &dev_);
    dev_.flush_all = true;  // host buffers are flushed too: no GPU needed
    rc_ = new RecvComm;
    rc_->dev = &dev_;
    rc_->peer = "fake peer";
    rc_->timeout_ms = 60000;
    for (int i = 0; i < kMaxGroupedRecvs; ++i) {
      data_[i] = buffers_[i];
      sizes_[i] = sizeof(buffers_[i]);
      ASSERT_EQ(net_.reg_mr(rc_, buffers_[i], sizeof(buffers_[i]), NCCL_PTR_HOST, &mhandles_[i]),
                Status::kOk);
    }
  }
  void TearDown() override {
    for (void* m : mhandles_) EXPECT_EQ(net_.dereg_mr(rc_, m), Status::kOk);
    EXPECT_EQ(net_.close_recv(rc_), Status::kOk);
    g_fake = nullptr;
  }

  FakeDevice fake_;
  IbDevice dev_;
  IbNet net_;
  RecvComm* rc_ = nullptr;
  char buffers_[kMaxGroupedRecvs][64] = {};
  void* data_[kMaxGroupedRecvs] = {};
  int sizes_[kMaxGroupedRecvs] = {};
  void* mhandles_[kMaxGroupedRecvs] = {};
};

TEST_F(IbFlushTest, FullSendQueueStillGivesARequestThatCompletes) {
  // Grouped flushes of kMaxGroupedRecvs READs each, none completing: the send queue holds
  // kSqDepth / kMaxGroupedRecvs of them; the rest must wait inside their requests.
  constexpr int kFlushes = kSqDepth / kMaxGroupedRecvs + 8;
  std::vector<void*> pending;
  for (int i = 0; i < kFlushes; ++i) {
    void* req = nullptr;
    ASSERT_EQ(net_.iflush(rc_, kMaxGroupedRecvs, data_, sizes_, mhandles_, &req), Status::kOk);
    ASSERT_NE(req, nullptr) << "flush " << i << " of " << kFlushes
                            << " returned NULL (taken as flushed) with " << fake_.reads_posted
                            << " READs posted";
    pending.push_back(req);
  }
  EXPECT_EQ(fake_.reads_posted, kSqDepth);  // the queue is full, and no more was posted
  int done = 0;
  ASSERT_EQ(net_.test(pending.back(), &done, nullptr), Status::kOk);
  EXPECT_EQ(done, 0);  // its READs are not even posted: it cannot be done

  // The device executes what was posted; test() retires it and posts the waiting READs.
  for (int round = 0; round < 100 && !pending.empty(); ++round) {
    fake_.executed = fake_.queue.size();
    for (size_t i = 0; i < pending.size(); ++i) {
      void* req = pending[i];
      done = 0;
      ASSERT_EQ(net_.test(req, &done, nullptr), Status::kOk);
      if (!done) continue;
      // Done only once its own signalled READ (the last of its READs) has completed.
      EXPECT_EQ(fake_.signalled_done.count(reinterpret_cast<uint64_t>(req)), 1u);
      pending.erase(pending.begin() + static_cast<long>(i));
      --i;
    }
  }
  EXPECT_TRUE(pending.empty()) << pending.size() << " flushes never completed";
  EXPECT_EQ(fake_.reads_posted, kFlushes * kMaxGroupedRecvs);
  EXPECT_EQ(fake_.refused_posts, 0);
  EXPECT_EQ(fake_.bad_reads, 0);
  EXPECT_EQ(fake_.read_addrs.size(), static_cast<size_t>(kMaxGroupedRecvs));
}

TEST_F(IbFlushTest, NothingToFlushGivesNull) {
  // Empty receives need no flush: NULL is right there.
  int zero[kMaxGroupedRecvs] = {};
  void* req = this;
  ASSERT_EQ(net_.iflush(rc_, kMaxGroupedRecvs, data_, zero, mhandles_, &req), Status::kOk);
  EXPECT_EQ(req, nullptr);
  EXPECT_EQ(fake_.reads_posted, 0);
}

TEST_F(IbFlushTest, FlushQueuePairThatCannotBeMadeLeaksNothingAndIsMadeLater) {
  // The flush QP's scratch word cannot be registered (its QP and CQ are made by then): the flush
  // fails, and what its set-up made is gone; the next flush makes it.
  const int qps = fake_verbs::live().qps, cqs = fake_verbs::live().cqs;
  const int mrs = fake_verbs::live().mrs;
  fake_verbs::registrations_before_failure() = 0;
  void* req = nullptr;
  EXPECT_NE(net_.iflush(rc_, 1, data_, sizes_, mhandles_, &req), Status::kOk);
  fake_verbs::registrations_before_failure() = -1;
  EXPECT_EQ(req, nullptr);
  EXPECT_EQ(fake_verbs::live().qps, qps) << "the failed flush QP's queue pair leaked";
  EXPECT_EQ(fake_verbs::live().cqs, cqs) << "its completion queue leaked";
  EXPECT_EQ(fake_verbs::live().mrs, mrs);
  ASSERT_EQ(net_.iflush(rc_, 1, data_, sizes_, mhandles_, &req), Status::kOk);
  ASSERT_NE(req, nullptr);
  EXPECT_EQ(fake_verbs::live().qps, qps + 1);  // the flush QP, until the comm closes
  fake_.executed = fake_.queue.size();
  int done = 0;
  for (int i = 0; i < 100 && done == 0; ++i) ASSERT_EQ(net_.test(req, &done, nullptr), Status::kOk);
  EXPECT_EQ(done, 1);
}

// A flush's READs outstanding past DYNAMIQ_NET_TIMEOUT_MS: still waited for while the queue
// pairs' own retries may take longer (a lost packet the HCA resends), failed once past those.
TEST_F(IbFlushTest, AStallIsBoundedByTheQueuePairsRetriesAsWell) {
  EXPECT_EQ(stall_bound_ms(30000, 14, 7), 30000);    // 8 tries of 67 ms: the setting holds
  EXPECT_EQ(stall_bound_ms(30000, 18, 7), 34360);    // 8 tries of 1.07 s, up to 4x each
  EXPECT_EQ(stall_bound_ms(30000, 23, 7), 1099512);  // NCCL_IB_TIMEOUT=23: 34.4 s a try
  EXPECT_EQ(stall_bound_ms(10, 1, 0), 10);
  rc_->set_timeouts(10);  // DYNAMIQ_NET_TIMEOUT_MS=10, the device's 18 and 7 retries
  EXPECT_EQ(rc_->stall_ms, 34360);
  void* req = nullptr;
  ASSERT_EQ(net_.iflush(rc_, 1, data_, sizes_, mhandles_, &req), Status::kOk);
  ASSERT_NE(req, nullptr);
  usleep(50 * 1000);
  int done = 0;
  EXPECT_EQ(net_.test(req, &done, nullptr), Status::kOk) << "failed past 10 ms, within the retries";
  EXPECT_EQ(done, 0);
  dev_.ack_timeout = 1;  // 8 us a try: the 10 ms bound holds
  dev_.retry_count = 0;
  rc_->set_timeouts(10);
  usleep(20 * 1000);
  EXPECT_EQ(net_.test(req, &done, nullptr), Status::kTimeout);
  fake_.executed = fake_.queue.size();  // the READs end, so the comm closes cleanly
}

// A comm that failed keeps its first failure's status: a flush that then outlives the stall bound
// reports that failure (a peer's malformed message, NCCL's remote error), not a timeout of its own.
TEST_F(IbFlushTest, AFlushOnAFailedCommReportsTheFirstFailure) {
  void* req = nullptr;
  ASSERT_EQ(net_.iflush(rc_, 1, data_, sizes_, mhandles_, &req), Status::kOk);
  ASSERT_NE(req, nullptr);
  {
    std::lock_guard<std::mutex> lock(rc_->mu);
    rc_->fail(Status::kMalformedPayload, "a malformed message (injected)");
  }
  int done = 0;
  EXPECT_EQ(net_.test(req, &done, nullptr), Status::kMalformedPayload);
  dev_.ack_timeout = 1;  // 8 us a try: the stall bound is the 1 ms setting
  dev_.retry_count = 0;
  rc_->set_timeouts(1);
  usleep(10 * 1000);
  EXPECT_EQ(net_.test(req, &done, nullptr), Status::kMalformedPayload);
  EXPECT_EQ(done, 0);
  fake_.executed = fake_.queue.size();  // the READs end, so the comm closes cleanly
}

// Every verbs object a receive comm made, its flush QP's included, is gone once it closes.
TEST(IbFlushClose, ClosingTheCommDestroysItsFlushQueuePair) {
  FakeDevice fake;
  g_fake = &fake;
  fake.ctx.ops.post_send = fake_post_send;
  fake.ctx.ops.poll_cq = fake_poll_cq;
  IbDevice dev;
  fake_verbs::install(&fake.ctx, &fake.pd, &dev);
  dev.flush_all = true;
  IbNet net;
  const int qps = fake_verbs::live().qps, cqs = fake_verbs::live().cqs;
  const int mrs = fake_verbs::live().mrs;
  auto* rc = new RecvComm;
  rc->dev = &dev;
  rc->peer = "fake peer";
  char buffer[64] = {};
  void* data = buffer;
  int size = sizeof(buffer);
  void* mhandle = nullptr;
  ASSERT_EQ(net.reg_mr(rc, buffer, sizeof(buffer), NCCL_PTR_HOST, &mhandle), Status::kOk);
  void* req = nullptr;
  ASSERT_EQ(net.iflush(rc, 1, &data, &size, &mhandle, &req), Status::kOk);
  EXPECT_GT(fake_verbs::live().qps, qps);
  EXPECT_EQ(net.dereg_mr(rc, mhandle), Status::kOk);
  EXPECT_EQ(net.close_recv(rc), Status::kOk);
  EXPECT_EQ(fake_verbs::live().qps, qps);
  EXPECT_EQ(fake_verbs::live().cqs, cqs);
  EXPECT_EQ(fake_verbs::live().mrs, mrs);
  g_fake = nullptr;
}

}  // namespace
}  // namespace dq::net::ib
