// The ibverbs backend through the exported ABI, run with DYNAMIQ_NET_BACKEND=ib.
//  - Without an active verbs port (this machine, CI): the plugin warns once and serves on
//    sockets (FallsBackToSocketWithOneWarning); the verbs-only tests skip.
//  - With one (soft-RoCE rxe0 in the VM, tests/rdma): the devices are verbs ports and
//    registered-buffer transfers, grouped receives and the size checks run over RC QPs.
// `--require-device`: exit 77 (skipped) with the reason when no active verbs port exists.
#include <dirent.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "tests/plugin/plugin_harness.h"

namespace dq::net::testing {
namespace {

// Active ports from sysfs (the kernel's view, independent of the plugin): "dev:port" list.
std::vector<std::string> active_verbs_ports() {
  std::vector<std::string> out;
  DIR* d = opendir("/sys/class/infiniband");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const std::string dev = e->d_name;
    for (int port = 1; port <= 4; ++port) {
      std::ifstream f("/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port) + "/state");
      std::string state;
      if (f && std::getline(f, state) && state.find("ACTIVE") != std::string::npos) {
        out.push_back(dev + ":" + std::to_string(port));
      }
    }
  }
  closedir(d);
  return out;
}

bool have_verbs() {
  return !active_verbs_ports().empty();
}

class NetIbTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PluginLib& pl = PluginLib::get();
    ASSERT_NE(pl.lib, nullptr) << pl.error;
    net_ = pl.v11;
    ASSERT_EQ(net_->init(&ctx_, 0x5151ull, nullptr, &LogCapture::logger, nullptr), dqNetSuccess);
  }
  void TearDown() override {
    if (sc_ != nullptr) {
      EXPECT_EQ(net_->closeSend(sc_), dqNetSuccess);
    }
    if (rc_ != nullptr) {
      EXPECT_EQ(net_->closeRecv(rc_), dqNetSuccess);
    }
    if (lc_ != nullptr) {
      EXPECT_EQ(net_->closeListen(lc_), dqNetSuccess);
    }
    EXPECT_EQ(net_->finalize(ctx_), dqNetSuccess);
  }
  void connect() {
    ASSERT_EQ(net_->listen(ctx_, 0, handle_, &lc_), dqNetSuccess);
    ASSERT_TRUE(connect_pair(net_, ctx_, lc_, handle_, &sc_, &rc_));
  }
  const dqNetV11* net_ = nullptr;
  void* ctx_ = nullptr;
  char handle_[NCCL_NET_HANDLE_MAXSIZE] = {};
  void* lc_ = nullptr;
  void* sc_ = nullptr;
  void* rc_ = nullptr;
};

// First test of the binary: the backend is chosen on the first init, which is when the
// fallback warning is logged.
TEST_F(NetIbTest, ChosenBackendMatchesTheMachine) {
  dqNetPropertiesV11 p{};
  ASSERT_EQ(net_->getProperties(0, &p), dqNetSuccess);
  ASSERT_NE(p.name, nullptr);
  const std::string name = p.name;
  if (have_verbs()) {
    std::ifstream dev("/sys/class/infiniband/" + name + "/ports/" + std::to_string(p.port) +
                      "/state");
    EXPECT_TRUE(dev.good()) << name << " port " << p.port << " is not a verbs port";
    EXPECT_EQ(p.maxRecvs, 8);
    EXPECT_EQ(p.ptrSupport, NCCL_PTR_HOST);
    EXPECT_GT(p.speed, 0);
    EXPECT_GT(p.maxComms, 0);
    // One line says what rdma-core answered about fork support (printed: the guest's answer);
    // one says whether registrations use relaxed ordering, as DQ_EXPECT_RELAXED_ORDERING ("on"
    // or "off") says the test's environment asked, when set.
    EXPECT_EQ(LogCapture::count_info("verbs fork support", ""), 1);
    if (const char* relaxed = std::getenv("DQ_EXPECT_RELAXED_ORDERING")) {
      EXPECT_EQ(LogCapture::count_info("verbs relaxed ordering: " + std::string(relaxed), ""), 1);
    }
    std::lock_guard<std::mutex> lock(LogCapture::mu());
    for (const std::string& line : LogCapture::infos())
      if (line.find("verbs fork support") != std::string::npos ||
          line.find("verbs relaxed ordering") != std::string::npos)
        std::printf("%s\n", line.c_str());
  } else {
    std::ifstream netdev("/sys/class/net/" + name + "/operstate");
    EXPECT_TRUE(netdev.good()) << name << " is not a network interface (socket fallback)";
    EXPECT_TRUE(LogCapture::contains("DYNAMIQ_NET_BACKEND=ib", "using socket"));
  }
}

TEST_F(NetIbTest, FallbackStillMovesData) {
  connect();
  std::vector<char> out(300001), in(300001);
  fill(out, 17);
  void* data = in.data();
  size_t cap = in.size();
  int tag = 3;
  void* rreq = nullptr;
  ASSERT_EQ(net_->irecv(rc_, 1, &data, &cap, &tag, nullptr, nullptr, &rreq), dqNetSuccess);
  void* sreq = nullptr;
  for (int i = 0; i < 1000 && sreq == nullptr; ++i) {
    ASSERT_EQ(net_->isend(sc_, out.data(), out.size(), 3, nullptr, nullptr, &sreq), dqNetSuccess);
  }
  ASSERT_NE(sreq, nullptr);
  int done = 0;
  int size = 0;
  ASSERT_EQ(wait_request(net_, sreq, &size, &done, 20), dqNetSuccess);
  ASSERT_EQ(done, 1);
  ASSERT_EQ(wait_request(net_, rreq, &size, &done, 20), dqNetSuccess);
  ASSERT_EQ(done, 1);
  EXPECT_EQ(size, 300001);
  EXPECT_EQ(in, out);
}

// Registered buffers (NCCL's path: regMr once, then many requests) over RC QPs, sizes from
// 0 B to 32 MiB, every receive larger than its message.
TEST_F(NetIbTest, RegisteredBuffersAllSizes) {
  if (!have_verbs()) GTEST_SKIP() << "no active verbs port";
  connect();
  const size_t kMax = 32u << 20;
  std::vector<char> out(kMax), in(kMax + 64);
  void* smh = nullptr;
  void* rmh = nullptr;
  ASSERT_EQ(net_->regMr(sc_, out.data(), out.size(), NCCL_PTR_HOST, &smh), dqNetSuccess);
  ASSERT_EQ(net_->regMr(rc_, in.data(), in.size(), NCCL_PTR_HOST, &rmh), dqNetSuccess);
  int tag = 0;
  // Around the striping bounds too (DYNAMIQ_NET_IB_QPS > 1: 1 stripe below 1 MiB, then one per
  // 512 KiB up to the QP count, the last stripe shorter).
  for (size_t size : {size_t{0}, size_t{1}, size_t{4095}, size_t{65536}, size_t{(1u << 20) - 1},
                      size_t{1u << 20}, size_t{(3u << 19) + 7}, size_t{(4u << 20) + 3}, kMax}) {
    fill(out, static_cast<uint32_t>(size));
    std::fill(in.begin(), in.end(), 0x5a);
    void* data = in.data();
    size_t cap = size + 64;
    void* rreq = nullptr;
    ASSERT_EQ(net_->irecv(rc_, 1, &data, &cap, &tag, &rmh, nullptr, &rreq), dqNetSuccess);
    ASSERT_NE(rreq, nullptr);
    void* sreq = nullptr;
    for (int i = 0; i < 1000 && sreq == nullptr; ++i) {
      ASSERT_EQ(net_->isend(sc_, out.data(), size, tag, smh, nullptr, &sreq), dqNetSuccess);
    }
    ASSERT_NE(sreq, nullptr);
    int done = 0;
    int got = -1;
    ASSERT_EQ(wait_request(net_, sreq, &got, &done, 60), dqNetSuccess);
    ASSERT_EQ(done, 1);
    ASSERT_EQ(wait_request(net_, rreq, &got, &done, 60), dqNetSuccess);
    ASSERT_EQ(done, 1) << size;
    EXPECT_EQ(got, static_cast<int>(size));
    EXPECT_TRUE(same_bytes(in.data(), out.data(), size)) << size;
    EXPECT_EQ(in[size], 0x5a) << "wrote past the end for size " << size;
    ++tag;
  }
  EXPECT_EQ(net_->deregMr(sc_, smh), dqNetSuccess);
  EXPECT_EQ(net_->deregMr(rc_, rmh), dqNetSuccess);
}

// Every connection has the queue pairs the connecting side asked for (DYNAMIQ_NET_IB_QPS), and
// both ends say so: "verbs connected: DEV -> QP n (+k striped)".
TEST_F(NetIbTest, ConnectionsHaveTheQueuePairsAsked) {
  if (!have_verbs()) GTEST_SKIP() << "no active verbs port";
  const char* env = std::getenv("DYNAMIQ_NET_IB_QPS");
  const int qps = env != nullptr ? std::atoi(env) : 1;
  LogCapture::clear();
  connect();
  EXPECT_EQ(LogCapture::count_info("verbs connected:", " -> QP "), 1);
  if (qps > 1) {
    const std::string striped = "(+" + std::to_string(qps - 1) + " striped)";
    EXPECT_EQ(LogCapture::count_info("verbs connected:", striped), 1) << striped;
    EXPECT_EQ(LogCapture::count_info("<- QP ", striped), 1) << "the accepting side: " << striped;
  } else {
    EXPECT_EQ(LogCapture::count_info("", "striped"), 0);
  }
}

// GPUDirect RDMA as far as a machine without a GPU can check it: GPU memory is advertised
// exactly when the peer-memory module is loaded (never on rxe in the guest), GPU and DMA-BUF
// registrations the device cannot take are refused with an error (never a crash), host memory
// through regMrDmaBuf is an ordinary registration, and a receive into host memory needs no
// flush (NULL request) unless DYNAMIQ_NET_IB_GDR=flush-all.
bool peer_memory_loaded() {
  for (const char* path : {"/sys/kernel/mm/memory_peers/nv_mem/version",
                           "/sys/module/nvidia_peermem/version", "/sys/module/nvidia_peermem"}) {
    std::ifstream f(path);
    if (f.good()) return true;
  }
  return false;
}

bool flush_all() {
  const char* v = std::getenv("DYNAMIQ_NET_IB_GDR");
  return v != nullptr && std::string(v) == "flush-all";
}

// One registered 1 MiB message from sc_ to rc_ into `in` (registered as *rmh).
void transfer(const dqNetV11* net, void* sc, void* rc, std::vector<char>* in, void** rmh, int tag) {
  std::vector<char> out(in->size());
  fill(out, static_cast<uint32_t>(tag));
  void* smh = nullptr;
  ASSERT_EQ(net->regMr(sc, out.data(), out.size(), NCCL_PTR_HOST, &smh), dqNetSuccess);
  void* data = in->data();
  size_t cap = in->size();
  void* rreq = nullptr;
  ASSERT_EQ(net->irecv(rc, 1, &data, &cap, &tag, rmh, nullptr, &rreq), dqNetSuccess);
  ASSERT_NE(rreq, nullptr);
  void* sreq = nullptr;
  for (int i = 0; i < 1000 && sreq == nullptr; ++i) {
    ASSERT_EQ(net->isend(sc, out.data(), out.size(), tag, smh, nullptr, &sreq), dqNetSuccess);
  }
  ASSERT_NE(sreq, nullptr);
  int done = 0;
  int got = -1;
  ASSERT_EQ(wait_request(net, sreq, &got, &done, 60), dqNetSuccess);
  ASSERT_EQ(wait_request(net, rreq, &got, &done, 60), dqNetSuccess);
  ASSERT_EQ(done, 1);
  EXPECT_EQ(*in, out);
  EXPECT_EQ(net->deregMr(sc, smh), dqNetSuccess);
}

TEST_F(NetIbTest, GpuDirectAdvertisedOnlyWhereTheMachineHasIt) {
  if (!have_verbs()) GTEST_SKIP() << "no active verbs port";
  dqNetPropertiesV11 p{};
  ASSERT_EQ(net_->getProperties(0, &p), dqNetSuccess);
  EXPECT_NE(p.ptrSupport & NCCL_PTR_HOST, 0);
  EXPECT_EQ((p.ptrSupport & NCCL_PTR_CUDA) != 0, peer_memory_loaded()) << p.ptrSupport;
  EXPECT_EQ(p.forceFlush, flush_all() ? 1 : 0);
  std::printf("ptrSupport %d (DMA-BUF %s), forceFlush %d\n", p.ptrSupport,
              (p.ptrSupport & NCCL_PTR_DMABUF) ? "yes" : "no", p.forceFlush);
  connect();
  std::vector<char> buf(1 << 20);
  void* mh = nullptr;
  if ((p.ptrSupport & NCCL_PTR_CUDA) == 0) {
    EXPECT_NE(net_->regMr(rc_, buf.data(), buf.size(), NCCL_PTR_CUDA, &mh), dqNetSuccess);
    EXPECT_EQ(mh, nullptr);
    EXPECT_TRUE(LogCapture::contains("regMr: memory type", "not supported"));
  }
  if ((p.ptrSupport & NCCL_PTR_DMABUF) == 0) {
    EXPECT_NE(net_->regMrDmaBuf(rc_, buf.data(), buf.size(), NCCL_PTR_CUDA, 0, 3, &mh),
              dqNetSuccess);
    EXPECT_EQ(mh, nullptr);
  }
  // Host memory through regMrDmaBuf: an ordinary registration that carries a transfer.
  ASSERT_EQ(net_->regMrDmaBuf(rc_, buf.data(), buf.size(), NCCL_PTR_HOST, 0, -1, &mh),
            dqNetSuccess);
  ASSERT_NE(mh, nullptr);
  transfer(net_, sc_, rc_, &buf, &mh, 7);
  void* data = buf.data();
  int size = static_cast<int>(buf.size());
  void* freq = reinterpret_cast<void*>(1);
  ASSERT_EQ(net_->iflush(rc_, 1, &data, &size, &mh, &freq), dqNetSuccess);
  if (!flush_all()) {
    EXPECT_EQ(freq, nullptr) << "a host receive needs no flush";
  }
  if (freq != nullptr) {
    int done = 0;
    ASSERT_EQ(wait_request(net_, freq, nullptr, &done, 20), dqNetSuccess);
  }
  EXPECT_EQ(net_->deregMr(rc_, mh), dqNetSuccess);
}

// DYNAMIQ_NET_IB_GDR=flush-all (its own process: rdma_net_ib_flush): every receive is flushed
// through the receive comm's own loopback QP: a flush request per iflush, completed by an RDMA
// READ of each buffer; grouped buffers, repeated flushes, and a buffer outside its registration
// refused.
TEST_F(NetIbTest, FlushAllReadsBackEveryReceive) {
  if (!have_verbs()) GTEST_SKIP() << "no active verbs port";
  if (!flush_all()) GTEST_SKIP() << "needs DYNAMIQ_NET_IB_GDR=flush-all (rdma_net_ib_flush)";
  connect();
  std::vector<char> a(1 << 20), b(1 << 20);
  void* mh[2] = {nullptr, nullptr};
  ASSERT_EQ(net_->regMr(rc_, a.data(), a.size(), NCCL_PTR_HOST, &mh[0]), dqNetSuccess);
  ASSERT_EQ(net_->regMr(rc_, b.data(), b.size(), NCCL_PTR_HOST, &mh[1]), dqNetSuccess);
  for (int round = 0; round < 20; ++round) {
    transfer(net_, sc_, rc_, &a, &mh[0], 2 * round);
    transfer(net_, sc_, rc_, &b, &mh[1], 2 * round + 1);
    void* data[2] = {a.data(), b.data()};
    int sizes[2] = {static_cast<int>(a.size()), round % 2 ? 0 : static_cast<int>(b.size())};
    void* freq = nullptr;
    ASSERT_EQ(net_->iflush(rc_, 2, data, sizes, mh, &freq), dqNetSuccess);
    ASSERT_NE(freq, nullptr) << "round " << round;
    int done = 0;
    ASSERT_EQ(wait_request(net_, freq, nullptr, &done, 20), dqNetSuccess);
    ASSERT_EQ(done, 1);
  }
  // Nothing received (sizes 0): nothing to flush.
  void* data = a.data();
  int zero = 0;
  void* freq = reinterpret_cast<void*>(1);
  ASSERT_EQ(net_->iflush(rc_, 1, &data, &zero, mh, &freq), dqNetSuccess);
  EXPECT_EQ(freq, nullptr);
  // A buffer outside its registration: refused, no request.
  std::vector<char> other(4096);
  data = other.data();
  int one = 1;
  freq = nullptr;
  EXPECT_NE(net_->iflush(rc_, 1, &data, &one, mh, &freq), dqNetSuccess);
  EXPECT_EQ(freq, nullptr);
  EXPECT_EQ(net_->deregMr(rc_, mh[0]), dqNetSuccess);
  EXPECT_EQ(net_->deregMr(rc_, mh[1]), dqNetSuccess);
}

// The queue pairs' attributes as the driver holds them (the connect's INFO line, queried back
// from the driver): DQ_EXPECT_QP_ATTRS, "TC,SL,TIMEOUT,RETRIES", is what the test's environment
// set (DYNAMIQ_NET_IB_* or NCCL_IB_*, or neither: the defaults); SL "*" is not checked (RoCE
// maps priority from the traffic class, and rxe does not keep a service level). Skipped without
// a verbs port or without DQ_EXPECT_QP_ATTRS.
TEST_F(NetIbTest, QueuePairsHaveTheConfiguredAttributes) {
  if (!have_verbs()) GTEST_SKIP() << "no active verbs port";
  const char* want = std::getenv("DQ_EXPECT_QP_ATTRS");
  if (want == nullptr) GTEST_SKIP() << "DQ_EXPECT_QP_ATTRS (TC,SL,TIMEOUT,RETRIES) is unset";
  unsigned tc = 0, timeout = 0, retries = 0;
  char sl[8] = {};
  ASSERT_EQ(std::sscanf(want, "%u,%7[0-9*],%u,%u", &tc, sl, &timeout, &retries), 4) << want;
  // What the connect's line must hold, each piece as the plugin writes it.
  std::vector<std::string> pieces = {"; traffic class " + std::to_string(tc) + ",",
                                     " ack timeout " + std::to_string(timeout) + " (",
                                     " retries " + std::to_string(retries)};
  if (std::strcmp(sl, "*") != 0) pieces.push_back(" service level " + std::string(sl) + ",");
  LogCapture::clear();
  connect();
  std::vector<char> buf(4096);
  void* mh = nullptr;
  ASSERT_EQ(net_->regMr(rc_, buf.data(), buf.size(), NCCL_PTR_HOST, &mh), dqNetSuccess);
  transfer(net_, sc_, rc_, &buf, &mh, 9);
  EXPECT_EQ(net_->deregMr(rc_, mh), dqNetSuccess);
  int matching = 0;
  std::lock_guard<std::mutex> lock(LogCapture::mu());
  for (const std::string& line : LogCapture::infos()) {
    if (line.find("verbs connected:") == std::string::npos) continue;
    std::printf("%s\n", line.c_str());
    bool all = true;
    for (const std::string& p : pieces) all = all && line.find(p) != std::string::npos;
    matching += all;
  }
  EXPECT_EQ(matching, 1) << "no connect line with traffic class " << tc << ", service level " << sl
                         << ", ack timeout " << timeout << ", retries " << retries;
}

// Run by net_ib_fork_support over a recording libibverbs (tests/plugin/fake_ibverbs; its log is
// DQ_FAKE_VERBS_LOG) that answers as a kernel without RDMA copy-on-fork: the plugin asks whether
// fork support is needed, asks for it once, and only then makes any other verbs call (an
// ibv_fork_init after a registration is refused); its INFO line says so. Skipped elsewhere.
TEST_F(NetIbTest, AsksForForkSupportBeforeAnyOtherVerbsCall) {
  const char* path = std::getenv("DQ_FAKE_VERBS_LOG");
  if (path == nullptr) GTEST_SKIP() << "run by the test net_ib_fork_support";
  std::ifstream log(path);
  ASSERT_TRUE(log.good()) << "the recording libibverbs wrote no log at " << path
                          << ": the plugin did not load it";
  std::vector<std::string> calls;
  for (std::string line; std::getline(log, line);) calls.push_back(line);
  ASSERT_GE(calls.size(), 3u);
  EXPECT_EQ(calls[0], "ibv_is_fork_initialized");
  EXPECT_EQ(calls[1], "ibv_fork_init");
  EXPECT_EQ(calls[2], "ibv_get_device_list");
  EXPECT_EQ(std::count(calls.begin(), calls.end(), "ibv_fork_init"), 1);
  EXPECT_EQ(LogCapture::count_info("verbs fork support", "enabled"), 1);
}

}  // namespace
}  // namespace dq::net::testing

int main(int argc, char** argv) {
  bool require = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--require-device") == 0) require = true;
  }
  if (require && !dq::net::testing::have_verbs()) {
    std::printf("SKIP: no active verbs port in /sys/class/infiniband (run it in tests/vm)\n");
    return 77;
  }
  // The recording libibverbs appends: start from an empty log.
  if (const char* log = std::getenv("DQ_FAKE_VERBS_LOG")) std::remove(log);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
