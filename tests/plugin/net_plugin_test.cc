// Unit tests of the net plugin through its exported ABI (dlopen, like NCCL), in one process
// over loopback (the test environment sets DYNAMIQ_NET_IFNAME=lo).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "plugin/net_devices.h"
#include "plugin/net_env.h"
#include "plugin/socket/socket_wire.h"
#include "tests/plugin/plugin_harness.h"

namespace dq::net::testing {
namespace {

class NetPluginTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PluginLib& pl = PluginLib::get();
    ASSERT_NE(pl.lib, nullptr) << pl.error;
    net_ = pl.v11;
    ASSERT_NE(net_, nullptr);
    ASSERT_EQ(net_->init(&ctx_, 0x1234abcdull, nullptr, &LogCapture::logger, nullptr),
              dqNetSuccess);
    ASSERT_EQ(net_->listen(ctx_, 0, handle_, &listen_comm_), dqNetSuccess);
  }
  void TearDown() override {
    if (send_comm_) {
      EXPECT_EQ(net_->closeSend(send_comm_), dqNetSuccess);
    }
    if (recv_comm_) {
      EXPECT_EQ(net_->closeRecv(recv_comm_), dqNetSuccess);
    }
    if (listen_comm_) {
      EXPECT_EQ(net_->closeListen(listen_comm_), dqNetSuccess);
    }
    if (ctx_) {
      EXPECT_EQ(net_->finalize(ctx_), dqNetSuccess);
    }
  }
  void connect() {
    ASSERT_TRUE(connect_pair(net_, ctx_, listen_comm_, handle_, &send_comm_, &recv_comm_));
  }
  void* start_send(std::vector<char>& buf, int tag) {
    void* req = nullptr;
    for (int i = 0; i < 1000 && req == nullptr; ++i) {
      EXPECT_EQ(net_->isend(send_comm_, buf.data(), buf.size(), tag, nullptr, nullptr, &req),
                dqNetSuccess);
    }
    EXPECT_NE(req, nullptr);
    return req;
  }
  void* start_recv(std::vector<char>& buf, int tag) {
    void* data = buf.data();
    size_t size = buf.size();
    void* req = nullptr;
    EXPECT_EQ(net_->irecv(recv_comm_, 1, &data, &size, &tag, nullptr, nullptr, &req), dqNetSuccess);
    EXPECT_NE(req, nullptr);
    return req;
  }
  void finish(void* req, int expected_size) {
    int done = 0;
    int size = -1;
    ASSERT_EQ(wait_request(net_, req, &size, &done), dqNetSuccess);
    ASSERT_EQ(done, 1);
    EXPECT_EQ(size, expected_size);
  }

  const dqNetV11* net_ = nullptr;
  void* ctx_ = nullptr;
  char handle_[NCCL_NET_HANDLE_MAXSIZE] = {};
  void* listen_comm_ = nullptr;
  void* send_comm_ = nullptr;
  void* recv_comm_ = nullptr;
};

TEST(NetPluginAbi, ExportsEveryVersionAndHidesInternals) {
  PluginLib& pl = PluginLib::get();
  ASSERT_NE(pl.lib, nullptr) << pl.error;
  ASSERT_NE(pl.v11, nullptr);
  ASSERT_NE(pl.v10, nullptr);
  ASSERT_NE(pl.v9, nullptr);
  ASSERT_NE(pl.v8, nullptr);
  EXPECT_STREQ(pl.v11->name, "dynamiq");
  EXPECT_STREQ(pl.v8->name, "dynamiq");
  // Core symbols stay hidden: the mangled name of the backend accessor must not resolve.
  EXPECT_EQ(dlsym(pl.lib, "_ZN2dq3net13SocketBackendEv"), nullptr);
  EXPECT_EQ(dlsym(pl.lib, "_ZN2dq11log_messageENS_8LogLevelENS_6SubsysEPKciS4_z"), nullptr);
  // Entries NCCL calls unconditionally are present in every table.
  EXPECT_NE(pl.v8->irecv, nullptr);
  EXPECT_NE(pl.v9->makeVDevice, nullptr);
  EXPECT_NE(pl.v11->finalize, nullptr);
}

TEST(NetPluginEnv, IfnamePrefixMatching) {
  EXPECT_TRUE(ifname_matches("", "eth0"));
  EXPECT_TRUE(ifname_matches("eth", "eth0"));
  EXPECT_FALSE(ifname_matches("eth", "lo"));
  EXPECT_TRUE(ifname_matches("ib,lo", "lo"));
  EXPECT_FALSE(ifname_matches("^lo,docker", "lo"));
  EXPECT_TRUE(ifname_matches("^lo,docker", "eth0"));
  EXPECT_FALSE(ifname_matches("=eth", "eth0"));
  EXPECT_TRUE(ifname_matches("=eth0", "eth0"));
  EXPECT_FALSE(ifname_matches("^=eth0", "eth0"));
}

// An interface list as getifaddrs could give it: each entry "name a.b.c.d" (IPv4) or
// "name v6-address".
std::vector<InterfaceAddress> interfaces(const std::vector<std::string>& entries) {
  std::vector<InterfaceAddress> out;
  for (const std::string& e : entries) {
    InterfaceAddress a;
    a.name = e.substr(0, e.find(' '));
    const std::string addr = e.substr(e.find(' ') + 1);
    auto* v4 = reinterpret_cast<sockaddr_in*>(&a.addr);
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&a.addr);
    if (inet_pton(AF_INET, addr.c_str(), &v4->sin_addr) == 1) {
      v4->sin_family = AF_INET;
    } else {
      EXPECT_EQ(inet_pton(AF_INET6, addr.c_str(), &v6->sin6_addr), 1) << addr;
      v6->sin6_family = AF_INET6;
    }
    out.push_back(a);
  }
  return out;
}

// The names select_interfaces() picks, with each one's address, space-separated.
std::string selected(const std::string& spec, const std::vector<std::string>& entries) {
  std::string out;
  for (const NetDevice& d : select_interfaces(spec, interfaces(entries))) {
    char host[INET6_ADDRSTRLEN] = "?";
    if (d.addr.ss_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&d.addr)->sin_addr, host,
                sizeof(host));
    } else {
      inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&d.addr)->sin6_addr, host,
                sizeof(host));
    }
    out += (out.empty() ? "" : " ") + d.name + "=" + host;
  }
  return out;
}

TEST(NetPluginEnv, DefaultInterfacesFollowNcclOrder) {
  // Unset: a Docker bridge (the same address on every host) and loopback are left out while
  // there is another interface; ib* first, as NCCL's socket transport chooses.
  EXPECT_EQ(selected("", {"lo 127.0.0.1", "docker0 172.17.0.1", "eth0 10.0.0.5"}), "eth0=10.0.0.5");
  EXPECT_EQ(selected("", {"lo 127.0.0.1", "docker0 172.17.0.1"}), "docker0=172.17.0.1");
  EXPECT_EQ(selected("", {"ib0 192.168.1.5", "eth0 10.0.0.5", "docker0 172.17.0.1"}),
            "ib0=192.168.1.5");
  EXPECT_EQ(selected("", {"lo 127.0.0.1"}), "lo=127.0.0.1");
  EXPECT_EQ(selected("", {"docker0 172.17.0.1", "eth0 10.0.0.5", "eth1 10.1.0.5", "lo ::1"}),
            "eth0=10.0.0.5 eth1=10.1.0.5");
  EXPECT_EQ(selected("", {}), "");
  // A libvirt bridge has the same address on every host, as Docker's: never taken.
  EXPECT_EQ(selected("", {"virbr0 192.168.122.1", "eth0 10.0.0.5", "lo 127.0.0.1"}),
            "eth0=10.0.0.5");
  EXPECT_EQ(selected("", {"virbr0 192.168.122.1", "lo 127.0.0.1"}), "lo=127.0.0.1");
  // One device per interface: IPv4 preferred, IPv6 link-local never.
  EXPECT_EQ(selected("", {"eth0 fe80::1", "eth0 2001:db8::5", "eth0 10.0.0.5", "eth1 fe80::2"}),
            "eth0=10.0.0.5");
  EXPECT_EQ(selected("", {"eth0 2001:db8::5"}), "eth0=2001:db8::5");
  // Given explicitly (DYNAMIQ_NET_IFNAME or NCCL_SOCKET_IFNAME), the spec alone decides.
  const std::vector<std::string> docker_host = {"lo 127.0.0.1", "docker0 172.17.0.1",
                                                "eth0 10.0.0.5"};
  EXPECT_EQ(selected("lo", docker_host), "lo=127.0.0.1");
  EXPECT_EQ(selected("docker", docker_host), "docker0=172.17.0.1");
  EXPECT_EQ(selected("^eth", docker_host), "lo=127.0.0.1 docker0=172.17.0.1");
  EXPECT_EQ(selected("=eth0,lo", docker_host), "lo=127.0.0.1 eth0=10.0.0.5");
  EXPECT_EQ(selected("ib", docker_host), "");
}

TEST(NetPluginEnv, SplitCoversTheMessageExactly) {
  for (size_t size : {size_t{0}, size_t{1}, size_t{131071}, size_t{131072}, size_t{4u << 20},
                      size_t{(256u << 20) + 7}}) {
    for (int nsocks = 1; nsocks <= wire::kMaxSocks; ++nsocks) {
      wire::Split s = wire::split_message(size, nsocks);
      ASSERT_GE(s.parts, 1);
      ASSERT_LE(s.parts, nsocks);
      size_t covered = 0;
      for (int k = 0; k < s.parts; ++k) {
        EXPECT_EQ(s.offset(k), covered);
        if (size > 0) {
          EXPECT_GT(s.len(k, size), 0u) << size << " " << nsocks << " " << k;
        }
        covered += s.len(k, size);
      }
      EXPECT_EQ(covered, size);
    }
  }
}

// The first test of the binary: the backend is chosen at the first init. With
// DYNAMIQ_NET_BACKEND unset (socket, the default) on a machine with an active verbs port, one
// warning names the port and DYNAMIQ_NET_BACKEND=auto; none elsewhere, nor where verbs are turned
// off (NCCL_IB_DISABLE=1). DQ_EXPECT_SOCKET_WARNING=1 says the machine has one and the test's
// environment leaves it on (rdma_socket_default, in the guest); unset, none is expected.
// DQ_EXPECT_BACKEND_LINE, when set, is a piece of the INFO line that names the backend chosen.
TEST_F(NetPluginTest, DefaultSocketBackendSpeaksUpBesideAnActiveVerbsPort) {
  const char* expect = std::getenv("DQ_EXPECT_SOCKET_WARNING");
  const int wanted = expect != nullptr && std::string(expect) == "1" ? 1 : 0;
  if (const char* line = std::getenv("DQ_EXPECT_BACKEND_LINE")) {
    EXPECT_EQ(LogCapture::count_info(line, ""), 1) << line;
  }
  int found = 0;
  std::lock_guard<std::mutex> lock(LogCapture::mu());
  for (const std::string& w : LogCapture::warnings()) {
    if (w.find("although verbs port") == std::string::npos) continue;
    ++found;
    std::printf("%s\n", w.c_str());
    EXPECT_NE(w.find("DYNAMIQ_NET_BACKEND=auto"), std::string::npos) << w;
  }
  EXPECT_EQ(found, wanted);
}

TEST_F(NetPluginTest, DeviceIsLoopbackWithHostProperties) {
  int ndev = 0;
  ASSERT_EQ(net_->devices(&ndev), dqNetSuccess);
  ASSERT_EQ(ndev, 1);  // DYNAMIQ_NET_IFNAME=lo in the test environment
  dqNetPropertiesV11 p{};
  ASSERT_EQ(net_->getProperties(0, &p), dqNetSuccess);
  EXPECT_STREQ(p.name, "lo");
  EXPECT_EQ(p.ptrSupport, NCCL_PTR_HOST);
  EXPECT_GT(p.maxRecvs, 1);
  EXPECT_GT(p.speed, 0);
  EXPECT_GT(p.maxComms, 0);
  EXPECT_EQ(p.vProps.ndevs, 1);
  EXPECT_EQ(p.vProps.devs[0], 0);
  EXPECT_EQ(net_->getProperties(1, &p), dqNetInvalidArgument);

  const PluginLib& pl = PluginLib::get();
  dqNetPropertiesV8 p8{};
  ASSERT_EQ(pl.v8->getProperties(0, &p8), dqNetSuccess);
  EXPECT_STREQ(p8.name, "lo");
  EXPECT_EQ(p8.maxRecvs, p.maxRecvs);
  EXPECT_EQ(p8.speed, p.speed);
  dqNetPropertiesV10 p10{};
  ASSERT_EQ(pl.v10->getProperties(0, &p10), dqNetSuccess);
  EXPECT_EQ(p10.guid, p.guid);
  EXPECT_EQ(p10.maxP2pBytes, p.maxP2pBytes);
}

TEST_F(NetPluginTest, HandleFitsAndConnectIsNonBlocking) {
  wire::Handle h;
  std::memcpy(&h, handle_, sizeof(h));
  EXPECT_EQ(h.magic, wire::kHandleMagic);
  EXPECT_NE(h.secret, 0u);
  EXPECT_EQ(h.family, AF_INET);
  // Nothing accepted yet: accept returns a NULL comm, without blocking.
  void* rc = nullptr;
  Clock::time_point t = Clock::now();
  ASSERT_EQ(net_->accept(listen_comm_, &rc, nullptr), dqNetSuccess);
  EXPECT_EQ(rc, nullptr);
  // A blocking accept would wait for a peer that never comes; 5 s tells the two apart even on a
  // loaded 2-core machine (was 0.5 s: a wall-clock figure, not a property).
  EXPECT_LT(seconds_since(t), 5.0);
  connect();
  // A second listen draws a different secret.
  void* lc2 = nullptr;
  char handle2[NCCL_NET_HANDLE_MAXSIZE];
  ASSERT_EQ(net_->listen(ctx_, 0, handle2, &lc2), dqNetSuccess);
  wire::Handle h2;
  std::memcpy(&h2, handle2, sizeof(h2));
  EXPECT_NE(h2.secret, h.secret);
  EXPECT_EQ(net_->closeListen(lc2), dqNetSuccess);
}

TEST_F(NetPluginTest, MessageSizesFromZeroTo256MiB) {
  connect();
  const size_t sizes[] = {0,        1,         7,         4096, 65535, 131075, (1u << 20) + 1,
                          4u << 20, 64u << 20, 256u << 20};
  int tag = 0;
  for (size_t size : sizes) {
    std::vector<char> out(size), in(size + 16, 0x5a);
    fill(out, static_cast<uint32_t>(size));
    void* rreq = start_recv(in, tag);
    void* sreq = start_send(out, tag);
    finish(sreq, static_cast<int>(size));
    finish(rreq, static_cast<int>(size));
    EXPECT_TRUE(same_bytes(in.data(), out.data(), size)) << size;
    EXPECT_EQ(in[size], 0x5a) << "wrote past the message end for size " << size;
    ++tag;
  }
}

TEST_F(NetPluginTest, OutOfOrderTagsMatchTheirOwnReceives) {
  connect();
  constexpr int kN = 8;
  std::vector<std::vector<char>> out(kN), in(kN);
  std::vector<void*> sreq(kN), rreq(kN);
  // Sends go out in tag order, including some sizes that use several sockets.
  for (int t = 0; t < kN; ++t) {
    out[t].resize(1000 + static_cast<size_t>(t) * 70000);
    fill(out[t], 100 + static_cast<uint32_t>(t));
    in[t].assign(out[t].size(), 0);
    sreq[t] = start_send(out[t], t);
  }
  // Let some of them arrive before any receive is posted (staged path).
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  for (int t = kN - 1; t >= 0; --t) rreq[t] = start_recv(in[t], t);
  for (int t = 0; t < kN; ++t) {
    finish(sreq[t], static_cast<int>(out[t].size()));
    finish(rreq[t], static_cast<int>(out[t].size()));
    EXPECT_EQ(in[t], out[t]) << "tag " << t;
  }
}

TEST_F(NetPluginTest, ReceivesPostedFirstInReverseTagOrder) {
  connect();
  constexpr int kN = 6;
  std::vector<std::vector<char>> out(kN), in(kN);
  std::vector<void*> sreq(kN), rreq(kN);
  for (int t = kN - 1; t >= 0; --t) {
    out[t].resize(5000 + static_cast<size_t>(t) * 90001);
    fill(out[t], 300 + static_cast<uint32_t>(t));
    in[t].assign(out[t].size(), 0);
    rreq[t] = start_recv(in[t], 20 + t);
  }
  for (int t = 0; t < kN; ++t) sreq[t] = start_send(out[t], 20 + t);
  for (int t = 0; t < kN; ++t) {
    finish(sreq[t], static_cast<int>(out[t].size()));
    finish(rreq[t], static_cast<int>(out[t].size()));
    EXPECT_EQ(in[t], out[t]) << "tag " << 20 + t;
  }
}

TEST_F(NetPluginTest, SameTagIsFifo) {
  connect();
  std::vector<std::vector<char>> out(5), in(5);
  std::vector<void*> rreq(5), sreq(5);
  for (int i = 0; i < 5; ++i) {
    in[i].assign(300000, 0);
    rreq[i] = start_recv(in[i], 7);
  }
  for (int i = 0; i < 5; ++i) {
    out[i].resize(300000 - static_cast<size_t>(i));
    fill(out[i], 900 + static_cast<uint32_t>(i));
    sreq[i] = start_send(out[i], 7);
  }
  for (int i = 0; i < 5; ++i) {
    finish(sreq[i], static_cast<int>(out[i].size()));
    finish(rreq[i], static_cast<int>(out[i].size()));
    EXPECT_TRUE(same_bytes(in[i].data(), out[i].data(), out[i].size())) << i;
  }
}

TEST_F(NetPluginTest, ManyRequestsInFlight) {
  connect();
  constexpr int kN = NCCL_NET_MAX_REQUESTS;
  std::vector<std::vector<char>> out(kN), in(kN);
  std::vector<void*> sreq(kN), rreq(kN);
  for (int i = 0; i < kN; ++i) {
    out[i].resize(static_cast<size_t>(1 + i) * 37001);
    fill(out[i], 5000 + static_cast<uint32_t>(i));
    in[i].assign(out[i].size(), 0);
    rreq[i] = start_recv(in[i], i % 4);  // tags repeat: FIFO per tag must hold across the window
  }
  for (int i = 0; i < kN; ++i) sreq[i] = start_send(out[i], i % 4);
  // Complete in reverse order: test() of a later request must not depend on earlier ones.
  for (int i = kN - 1; i >= 0; --i) {
    finish(rreq[i], static_cast<int>(out[i].size()));
    finish(sreq[i], static_cast<int>(out[i].size()));
    EXPECT_EQ(in[i], out[i]) << i;
  }
}

TEST_F(NetPluginTest, GroupedReceives) {
  connect();
  dqNetPropertiesV11 p{};
  ASSERT_EQ(net_->getProperties(0, &p), dqNetSuccess);
  const int n = p.maxRecvs;
  std::vector<std::vector<char>> out(n), in(n);
  std::vector<void*> data(n);
  std::vector<size_t> caps(n);
  std::vector<int> tags(n);
  for (int i = 0; i < n; ++i) {
    out[i].resize(static_cast<size_t>(i) * 50000);  // includes an empty one
    fill(out[i], 77 + static_cast<uint32_t>(i));
    in[i].assign(out[i].size() + 100, 0);
    data[i] = in[i].data();
    caps[i] = in[i].size();
    tags[i] = 40 + i;
  }
  void* rreq = nullptr;
  ASSERT_EQ(
      net_->irecv(recv_comm_, n, data.data(), caps.data(), tags.data(), nullptr, nullptr, &rreq),
      dqNetSuccess);
  ASSERT_NE(rreq, nullptr);
  std::vector<void*> sreq(n);
  for (int i = n - 1; i >= 0; --i) sreq[i] = start_send(out[i], 40 + i);  // reverse tag order
  for (int i = 0; i < n; ++i) finish(sreq[i], static_cast<int>(out[i].size()));
  std::vector<int> got(n, -1);
  int done = 0;
  ASSERT_EQ(wait_request(net_, rreq, got.data(), &done), dqNetSuccess);
  ASSERT_EQ(done, 1);
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(got[i], static_cast<int>(out[i].size())) << i;
    EXPECT_TRUE(same_bytes(in[i].data(), out[i].data(), out[i].size())) << i;
  }
  // More receives than maxRecvs is refused.
  std::vector<void*> d2(n + 1, in[0].data());
  std::vector<size_t> c2(n + 1, 1);
  std::vector<int> t2(n + 1, 1);
  void* bad = nullptr;
  EXPECT_EQ(net_->irecv(recv_comm_, n + 1, d2.data(), c2.data(), t2.data(), nullptr, nullptr, &bad),
            dqNetInvalidArgument);
}

TEST_F(NetPluginTest, MessageLargerThanReceiveIsAnError) {
  connect();
  LogCapture::clear();
  std::vector<char> out(1000, 1), in(100, 0);
  void* rreq = start_recv(in, 3);
  void* sreq = start_send(out, 3);
  finish(sreq, 1000);
  int done = 0;
  int size = 0;
  EXPECT_NE(wait_request(net_, rreq, &size, &done, 10), dqNetSuccess);
  EXPECT_EQ(done, 0);
  EXPECT_TRUE(LogCapture::contains("1000 bytes", "holds only 100"));
  EXPECT_EQ(in, std::vector<char>(100, 0)) << "no byte may be written into a too-small buffer";
}

TEST_F(NetPluginTest, RegistrationIsHostOnly) {
  connect();
  std::vector<char> buf(4096, 3);
  void* mh = nullptr;
  EXPECT_EQ(net_->regMr(send_comm_, buf.data(), buf.size(), NCCL_PTR_CUDA, &mh),
            dqNetInvalidArgument);
  EXPECT_EQ(mh, nullptr);
  EXPECT_NE(net_->regMrDmaBuf(send_comm_, buf.data(), buf.size(), NCCL_PTR_DMABUF, 0, 3, &mh),
            dqNetSuccess);
  ASSERT_EQ(net_->regMr(send_comm_, buf.data(), buf.size(), NCCL_PTR_HOST, &mh), dqNetSuccess);
  ASSERT_NE(mh, nullptr);
  void* req = nullptr;
  // A buffer outside the registered region is refused.
  std::vector<char> other(10);
  EXPECT_EQ(net_->isend(send_comm_, other.data(), other.size(), 1, mh, nullptr, &req),
            dqNetInvalidArgument);
  ASSERT_EQ(net_->isend(send_comm_, buf.data(), buf.size(), 1, mh, nullptr, &req), dqNetSuccess);
  std::vector<char> in(4096);
  void* rreq = start_recv(in, 1);
  finish(req, 4096);
  finish(rreq, 4096);
  EXPECT_EQ(in, buf);
  EXPECT_EQ(net_->deregMr(send_comm_, mh), dqNetSuccess);
  void* flush_req = reinterpret_cast<void*>(1);
  void* d = in.data();
  int s = 4096;
  EXPECT_EQ(net_->iflush(recv_comm_, 1, &d, &s, nullptr, &flush_req), dqNetSuccess);
  EXPECT_EQ(flush_req, nullptr);
}

TEST_F(NetPluginTest, WrongSecretIsRefusedAndDeliversNothing) {
  LogCapture::clear();
  char forged[NCCL_NET_HANDLE_MAXSIZE];
  std::memcpy(forged, handle_, sizeof(forged));
  wire::Handle h;
  std::memcpy(&h, forged, sizeof(h));
  h.secret ^= 0x1;  // one bit off
  std::memcpy(forged, &h, sizeof(h));
  void* intruder = nullptr;
  Clock::time_point t = Clock::now();
  while (intruder == nullptr && seconds_since(t) < 5) {
    ASSERT_EQ(net_->connect(ctx_, 0, forged, &intruder, nullptr), dqNetSuccess);
  }
  ASSERT_NE(intruder, nullptr);  // TCP-level connect succeeds; the handshake is what fails
  std::vector<char> evil(1000, 'X');
  void* evil_req = nullptr;
  net_->isend(intruder, evil.data(), evil.size(), 9, nullptr, nullptr, &evil_req);
  // accept never hands out the intruder's connection.
  t = Clock::now();
  void* rc = nullptr;
  while (seconds_since(t) < 1.0) {
    ASSERT_EQ(net_->accept(listen_comm_, &rc, nullptr), dqNetSuccess);
    ASSERT_EQ(rc, nullptr);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(LogCapture::contains("wrong secret", "127.0.0.1"));
  // The legitimate peer connects and only its data arrives on tag 9.
  connect();
  std::vector<char> good(1000, 'G'), in(1000, 0);
  void* rreq = start_recv(in, 9);
  finish(start_send(good, 9), 1000);
  finish(rreq, 1000);
  EXPECT_EQ(in, good);
  if (evil_req != nullptr) {
    int done = 0;
    net_->test(evil_req, &done, nullptr);  // either outcome; must not crash
  }
  net_->closeSend(intruder);
}

TEST_F(NetPluginTest, CommunicatorIdMismatchIsRefused) {
  LogCapture::clear();
  void* other_ctx = nullptr;
  ASSERT_EQ(net_->init(&other_ctx, 0x9999ull, nullptr, &LogCapture::logger, nullptr), dqNetSuccess);
  char copy[NCCL_NET_HANDLE_MAXSIZE];
  std::memcpy(copy, handle_, sizeof(copy));
  void* sc = nullptr;
  Clock::time_point t = Clock::now();
  while (sc == nullptr && seconds_since(t) < 5) {
    ASSERT_EQ(net_->connect(other_ctx, 0, copy, &sc, nullptr), dqNetSuccess);
  }
  ASSERT_NE(sc, nullptr);
  void* rc = nullptr;
  t = Clock::now();
  while (seconds_since(t) < 0.5) {
    ASSERT_EQ(net_->accept(listen_comm_, &rc, nullptr), dqNetSuccess);
    ASSERT_EQ(rc, nullptr);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(LogCapture::contains("communicator id", "127.0.0.1"));
  net_->closeSend(sc);
  net_->finalize(other_ctx);
}

// A raw client that knows the secret but then speaks garbage: the receive must fail, fast.
void raw_client_sends(const char* handle, const void* frame, size_t len) {
  wire::Handle h;
  std::memcpy(&h, handle, sizeof(h));
  for (int k = 0; k < h.nsocks; ++k) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = h.port_be;
    std::memcpy(&a.sin_addr, h.addr, 4);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    wire::Hello hello{
        wire::kHelloMagic, wire::kVersion, static_cast<uint16_t>(k), h.nsocks, 0, 0, h.secret, 0,
        0xfeedull};
    ASSERT_EQ(send(fd, &hello, sizeof(hello), 0), static_cast<ssize_t>(sizeof(hello)));
    if (k == 0) {
      ASSERT_EQ(send(fd, frame, len, 0), static_cast<ssize_t>(len));
    }
    // Leak-free: the receiver owns the other end; our fd closes at exit of the test body.
    std::thread([fd] {
      std::this_thread::sleep_for(std::chrono::seconds(3));
      close(fd);
    }).detach();
  }
}

TEST_F(NetPluginTest, MalformedFramesFailTheReceive) {
  struct Case {
    wire::MsgHeader header;
    const char* expect;
  };
  const Case cases[] = {
      {{0xdeadbeef, 1, 0, 10}, "bad message magic"},
      {{wire::kMsgMagic, 1, 0, 1ull << 50}, "exceeds the 1 TiB limit"},
      {{wire::kMsgMagic, 1, 5, 10}, "sequence 5"},
  };
  for (const Case& c : cases) {
    LogCapture::clear();
    void* lc = nullptr;
    char handle[NCCL_NET_HANDLE_MAXSIZE];
    ASSERT_EQ(net_->listen(ctx_, 0, handle, &lc), dqNetSuccess);
    raw_client_sends(handle, &c.header, sizeof(c.header));
    void* rc = accept_within(net_, lc, 5);
    ASSERT_NE(rc, nullptr);
    std::vector<char> in(64, 0);
    void* data = in.data();
    size_t size = in.size();
    int tag = 1;
    void* req = nullptr;
    dqNetResult posted = net_->irecv(rc, 1, &data, &size, &tag, nullptr, nullptr, &req);
    if (posted == dqNetSuccess) {
      ASSERT_NE(req, nullptr);
      int done = 0;
      Clock::time_point t = Clock::now();
      EXPECT_NE(wait_request(net_, req, nullptr, &done, 10), dqNetSuccess) << c.expect;
      EXPECT_EQ(done, 0);
      EXPECT_LT(seconds_since(t), 5.0);
    }
    EXPECT_TRUE(LogCapture::contains("malformed frame", c.expect)) << c.expect;
    EXPECT_EQ(in, std::vector<char>(64, 0));
    EXPECT_EQ(net_->closeRecv(rc), dqNetSuccess);
    EXPECT_EQ(net_->closeListen(lc), dqNetSuccess);
  }
}

double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

TEST_F(NetPluginTest, IdleConnectionsDoNotBurnCpu) {
  connect();
  // Several idle connections with a receive posted: the I/O threads must sleep, not spin.
  std::vector<void*> extra_send, extra_recv;
  for (int i = 0; i < 3; ++i) {
    void* lc = nullptr;
    char h[NCCL_NET_HANDLE_MAXSIZE];
    ASSERT_EQ(net_->listen(ctx_, 0, h, &lc), dqNetSuccess);
    void* sc = nullptr;
    void* rc = nullptr;
    ASSERT_TRUE(connect_pair(net_, ctx_, lc, h, &sc, &rc));
    extra_send.push_back(sc);
    extra_recv.push_back(rc);
    net_->closeListen(lc);
  }
  std::vector<char> in(100);
  void* rreq = start_recv(in, 1);
  double cpu0 = process_cpu_seconds();
  std::this_thread::sleep_for(std::chrono::seconds(2));
  double cpu = process_cpu_seconds() - cpu0;
  // CPU time (not wall time) is immune to machine load; a spinning thread would use ~2 s.
  EXPECT_LT(cpu, 0.2) << "idle connections used " << cpu << " s of CPU in 2 s";
  std::vector<char> out(100, 'q');
  finish(start_send(out, 1), 100);
  finish(rreq, 100);
  for (void* sc : extra_send) EXPECT_EQ(net_->closeSend(sc), dqNetSuccess);
  for (void* rc : extra_recv) EXPECT_EQ(net_->closeRecv(rc), dqNetSuccess);
}

// Raw socket to the listener of `handle`; sends `hello` (if given) and `bytes`, then stays open.
int raw_connect(const char* handle) {
  wire::Handle h;
  std::memcpy(&h, handle, sizeof(h));
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = h.port_be;
  std::memcpy(&a.sin_addr, h.addr, 4);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return -1;
  return fd;
}

// Raw sockets to the listener of `handle`, one per socket of its striped connection, each having
// said hello as socket k with communicator id `comm_id`: what the listener's accept takes as one
// connection. Empty (nothing left open) when a connect or a hello fails.
std::vector<int> raw_connection(const char* handle, uint64_t comm_id) {
  wire::Handle h;
  std::memcpy(&h, handle, sizeof(h));
  std::vector<int> fds;
  for (int k = 0; k < h.nsocks; ++k) {
    const int fd = raw_connect(handle);
    if (fd < 0) break;
    fds.push_back(fd);
    wire::Hello hello{wire::kHelloMagic,
                      wire::kVersion,
                      static_cast<uint16_t>(k),
                      h.nsocks,
                      0,
                      0,
                      h.secret,
                      0,
                      comm_id};
    if (send(fd, &hello, sizeof(hello), 0) != static_cast<ssize_t>(sizeof(hello))) break;
  }
  if (fds.size() != static_cast<size_t>(h.nsocks)) {
    for (int fd : fds) close(fd);
    fds.clear();
  }
  return fds;
}

// NCCL's teardown after an abort deregisters a connection's buffers and frees them before it
// closes the connection, while a live peer may still be sending: no byte may land in the freed
// memory (here: pages mapped again at the same address, holding a pattern).
TEST_F(NetPluginTest, DeregisteringABufferMidReceiveStopsWritesIntoIt) {
  setenv("DYNAMIQ_NET_NSOCKS", "1", 1);  // the whole message on one socket, after its header
  void* lc = nullptr;
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  ASSERT_EQ(net_->listen(ctx_, 0, handle, &lc), dqNetSuccess);
  unsetenv("DYNAMIQ_NET_NSOCKS");
  const std::vector<int> fds = raw_connection(handle, 0xdeadull);
  ASSERT_EQ(fds.size(), 1u);
  void* rc = accept_within(net_, lc, 5);
  ASSERT_NE(rc, nullptr);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  auto* buf = static_cast<char*>(
      mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(buf, MAP_FAILED);
  void* mh = nullptr;
  ASSERT_EQ(net_->regMr(rc, buf, 2 * page, NCCL_PTR_HOST, &mh), dqNetSuccess);
  void* data = buf;
  size_t size = 2 * page;
  int tag = 1;
  void* req = nullptr;
  ASSERT_EQ(net_->irecv(rc, 1, &data, &size, &tag, &mh, nullptr, &req), dqNetSuccess);
  ASSERT_NE(req, nullptr);
  // The header and the first page: the receive is bound to the buffer and in progress.
  const wire::MsgHeader header{wire::kMsgMagic, 1, 0, 2 * page};
  const std::vector<char> payload(page, '\x11');
  ASSERT_EQ(send(fds[0], &header, sizeof(header), 0), static_cast<ssize_t>(sizeof(header)));
  ASSERT_EQ(send(fds[0], payload.data(), page, 0), static_cast<ssize_t>(page));
  int done = 0;
  for (int i = 0; i < 200 && buf[page - 1] != '\x11'; ++i) {  // bounded: 2 s
    ASSERT_EQ(net_->test(req, &done, nullptr), dqNetSuccess);
    usleep(10 * 1000);
  }
  ASSERT_EQ(buf[page - 1], '\x11') << "the first page never arrived";
  // NCCL's order: deregMr, then the buffer's free (here: other pages at the same address).
  ASSERT_EQ(net_->deregMr(rc, mh), dqNetSuccess);
  ASSERT_EQ(munmap(buf, 2 * page), 0);
  ASSERT_EQ(
      mmap(buf, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0),
      buf);
  std::memset(buf, 0x5a, 2 * page);
  (void)send(fds[0], payload.data(), page, MSG_NOSIGNAL);  // the peer sends the rest
  usleep(300 * 1000);
  EXPECT_EQ(std::count(buf, buf + 2 * page, '\x5a'), static_cast<long>(2 * page))
      << "the connection wrote into memory deregistered and freed";
  EXPECT_NE(net_->test(req, &done, nullptr), dqNetSuccess);  // the receive failed
  EXPECT_EQ(net_->closeRecv(rc), dqNetSuccess);
  EXPECT_EQ(net_->closeListen(lc), dqNetSuccess);
  for (int fd : fds) close(fd);
  munmap(buf, 2 * page);
}

// The same on the send side: a send blocked by a peer that reads nothing yet, its buffer
// deregistered and freed (pages mapped again with a pattern), then the peer reads: no byte of the
// new pages may reach it.
TEST_F(NetPluginTest, DeregisteringABufferMidSendStopsReadsFromIt) {
  const int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(lfd, 0);
  const int small = 4096;  // the peer's receive buffer: the send blocks early
  ASSERT_EQ(setsockopt(lfd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof(a);
  ASSERT_EQ(bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(lfd, 1), 0);
  ASSERT_EQ(getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &alen), 0);
  wire::Handle h{};
  h.magic = wire::kHandleMagic;
  h.version = wire::kVersion;
  h.family = AF_INET;
  h.port_be = a.sin_port;
  h.nsocks = 1;
  std::memcpy(h.addr, &a.sin_addr, 4);
  char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
  std::memcpy(handle, &h, sizeof(h));
  void* sc = nullptr;
  for (int i = 0; i < 500 && sc == nullptr; ++i) {  // bounded: 5 s
    ASSERT_EQ(net_->connect(ctx_, 0, handle, &sc, nullptr), dqNetSuccess);
    if (sc == nullptr) usleep(10 * 1000);
  }
  ASSERT_NE(sc, nullptr);
  const int peer = accept(lfd, nullptr, nullptr);
  ASSERT_GE(peer, 0);
  wire::Hello hello{};
  ASSERT_EQ(recv(peer, &hello, sizeof(hello), MSG_WAITALL), static_cast<ssize_t>(sizeof(hello)));
  constexpr size_t kBytes = 32u << 20;
  auto* buf = static_cast<char*>(
      mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(buf, MAP_FAILED);
  std::memset(buf, 0x11, kBytes);
  void* mh = nullptr;
  ASSERT_EQ(net_->regMr(sc, buf, kBytes, NCCL_PTR_HOST, &mh), dqNetSuccess);
  void* req = nullptr;
  ASSERT_EQ(net_->isend(sc, buf, kBytes, 1, mh, nullptr, &req), dqNetSuccess);
  ASSERT_NE(req, nullptr);
  usleep(200 * 1000);  // the writer fills the socket buffers and waits
  int done = 0;
  ASSERT_EQ(net_->test(req, &done, nullptr), dqNetSuccess);
  ASSERT_EQ(done, 0) << "the send should still be blocked by the peer";
  ASSERT_EQ(net_->deregMr(sc, mh), dqNetSuccess);
  ASSERT_EQ(munmap(buf, kBytes), 0);
  ASSERT_EQ(
      mmap(buf, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0),
      buf);
  std::memset(buf, 0x5a, kBytes);
  // The peer reads what comes for 500 ms; after the header, only the old pages' 0x11 may appear.
  size_t got = 0, pattern = 0;
  std::vector<char> chunk(1 << 16);
  const Clock::time_point t = Clock::now();
  while (seconds_since(t) < 0.5) {
    const ssize_t n = recv(peer, chunk.data(), chunk.size(), MSG_DONTWAIT);
    if (n == 0) break;  // the sender shut its socket down
    if (n < 0) {
      usleep(1000);
      continue;
    }
    for (ssize_t i = 0; i < n; ++i, ++got)
      if (got >= sizeof(wire::MsgHeader) && chunk[static_cast<size_t>(i)] == 0x5a) ++pattern;
  }
  EXPECT_EQ(pattern, 0u) << "the connection sent bytes of memory deregistered and freed (" << got
                         << " bytes read)";
  EXPECT_NE(net_->test(req, &done, nullptr), dqNetSuccess);  // the send failed
  EXPECT_EQ(net_->closeSend(sc), dqNetSuccess);
  close(peer);
  close(lfd);
  munmap(buf, kBytes);
}

TEST_F(NetPluginTest, StalledPeerMidMessageFailsAfterTheTimeout) {
  setenv("DYNAMIQ_NET_TIMEOUT_MS", "1000", 1);
  LogCapture::clear();
  void* lc = nullptr;
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  ASSERT_EQ(net_->listen(ctx_, 0, handle, &lc), dqNetSuccess);
  setenv("DYNAMIQ_NET_TIMEOUT_MS", "5000", 1);
  wire::Handle h;
  std::memcpy(&h, handle, sizeof(h));
  const std::vector<int> fds = raw_connection(handle, 0xabcull);
  ASSERT_EQ(fds.size(), static_cast<size_t>(h.nsocks));
  // A valid header for 1000 bytes, then only 10 of them, then silence (socket stays open).
  wire::MsgHeader mh{wire::kMsgMagic, 1, 0, 1000};
  char ten[10] = {};
  ASSERT_EQ(send(fds[0], &mh, sizeof(mh), 0), static_cast<ssize_t>(sizeof(mh)));
  ASSERT_EQ(send(fds[0], ten, sizeof(ten), 0), static_cast<ssize_t>(sizeof(ten)));
  void* rc = accept_within(net_, lc, 5);
  ASSERT_NE(rc, nullptr);
  std::vector<char> in(1000);
  void* data = in.data();
  size_t size = in.size();
  int tag = 1;
  void* req = nullptr;
  ASSERT_EQ(net_->irecv(rc, 1, &data, &size, &tag, nullptr, nullptr, &req), dqNetSuccess);
  int done = 0;
  Clock::time_point t = Clock::now();
  EXPECT_NE(wait_request(net_, req, nullptr, &done, 10), dqNetSuccess);
  double waited = seconds_since(t);
  EXPECT_GT(waited, 0.5) << "failed before the 1000 ms stall bound";
  // Without the bound the wait runs to wait_request's own 10 s.
  EXPECT_LT(waited, 8.0) << "the stall bound was not enforced";
  EXPECT_TRUE(LogCapture::contains("stalled", "middle of a message"));
  EXPECT_EQ(net_->closeRecv(rc), dqNetSuccess);
  EXPECT_EQ(net_->closeListen(lc), dqNetSuccess);
  for (int fd : fds) close(fd);
}

TEST_F(NetPluginTest, InconsistentPartFrameFailsTheReceive) {
  LogCapture::clear();
  wire::Handle h;
  std::memcpy(&h, handle_, sizeof(h));
  ASSERT_GE(h.nsocks, 2) << "needs a striped connection (DYNAMIQ_NET_NSOCKS >= 2)";
  const std::vector<int> fds = raw_connection(handle_, 0x5151ull);
  ASSERT_EQ(fds.size(), static_cast<size_t>(h.nsocks));
  const size_t size = 1u << 20;  // striped over every socket
  wire::Split split = wire::split_message(size, h.nsocks);
  ASSERT_GE(split.parts, 2);
  // Socket 1 claims the wrong offset for its part.
  wire::PartHeader ph{wire::kPartMagic, 1, 0, split.offset(1) + 4096, split.len(1, size)};
  ASSERT_EQ(send(fds[1], &ph, sizeof(ph), 0), static_cast<ssize_t>(sizeof(ph)));
  wire::MsgHeader mh{wire::kMsgMagic, 1, 0, size};
  ASSERT_EQ(send(fds[0], &mh, sizeof(mh), 0), static_cast<ssize_t>(sizeof(mh)));
  void* rc = accept_within(net_, listen_comm_, 5);
  ASSERT_NE(rc, nullptr);
  recv_comm_ = rc;
  std::vector<char> in(size);
  void* data = in.data();
  size_t cap = in.size();
  int tag = 1;
  void* req = nullptr;
  dqNetResult posted = net_->irecv(rc, 1, &data, &cap, &tag, nullptr, nullptr, &req);
  if (posted == dqNetSuccess) {
    int done = 0;
    EXPECT_NE(wait_request(net_, req, nullptr, &done, 10), dqNetSuccess);
    EXPECT_EQ(done, 0);
  }
  EXPECT_TRUE(LogCapture::contains("malformed frame", "offset/length"));
  for (int fd : fds) close(fd);
}

// A sender that dies after writing a part on socket 1 but before the message's header on socket
// 0 (its writers are separate threads): socket 0 ends cleanly between messages, and the receive
// must fail at once, not after the 5 s stall bound of the wait for that header.
TEST_F(NetPluginTest, SenderGoneBeforeTheHeaderFailsQuickly) {
  LogCapture::clear();
  wire::Handle h;
  std::memcpy(&h, handle_, sizeof(h));
  ASSERT_GE(h.nsocks, 2) << "needs a striped connection (DYNAMIQ_NET_NSOCKS >= 2)";
  const std::vector<int> fds = raw_connection(handle_, 0x6161ull);
  ASSERT_EQ(fds.size(), static_cast<size_t>(h.nsocks));
  void* rc = accept_within(net_, listen_comm_, 5);
  ASSERT_NE(rc, nullptr);
  recv_comm_ = rc;
  const size_t size = 1u << 20;  // striped over every socket
  std::vector<char> in(size);
  void* data = in.data();
  size_t cap = in.size();
  int tag = 1;
  void* req = nullptr;
  ASSERT_EQ(net_->irecv(rc, 1, &data, &cap, &tag, nullptr, nullptr, &req), dqNetSuccess);
  ASSERT_NE(req, nullptr);
  const wire::Split split = wire::split_message(size, h.nsocks);
  ASSERT_GE(split.parts, 2);
  const wire::PartHeader ph{wire::kPartMagic, 1, 0, split.offset(1), split.len(1, size)};
  ASSERT_EQ(send(fds[1], &ph, sizeof(ph), 0), static_cast<ssize_t>(sizeof(ph)));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // socket 1's reader has the part
  Clock::time_point t = Clock::now();
  for (int fd : fds) close(fd);
  int done = 0;
  EXPECT_NE(wait_request(net_, req, nullptr, &done, 10), dqNetSuccess);
  EXPECT_EQ(done, 0);
  EXPECT_LT(seconds_since(t), 2.5) << "failed by the 5 s stall bound, not by the close";
  EXPECT_TRUE(LogCapture::contains("closed the connection before the header", "message 0"));
}

TEST_F(NetPluginTest, SilentHandshakeIsDroppedAfterTheTimeout) {
  setenv("DYNAMIQ_NET_TIMEOUT_MS", "300", 1);
  LogCapture::clear();
  void* lc = nullptr;
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  ASSERT_EQ(net_->listen(ctx_, 0, handle, &lc), dqNetSuccess);
  setenv("DYNAMIQ_NET_TIMEOUT_MS", "5000", 1);
  int fd = raw_connect(handle);  // connects, never says hello
  ASSERT_GE(fd, 0);
  void* rc = nullptr;
  Clock::time_point t = Clock::now();
  while (!LogCapture::contains("handshake", "timed out") && seconds_since(t) < 5) {
    ASSERT_EQ(net_->accept(lc, &rc, nullptr), dqNetSuccess);
    ASSERT_EQ(rc, nullptr);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(LogCapture::contains("handshake", "timed out"));
  EXPECT_LT(seconds_since(t), 4.5);  // inside the 5 s wait above, whatever the load
  // The listener dropped it: our end sees the close.
  char byte;
  EXPECT_EQ(recv(fd, &byte, 1, 0), 0);
  close(fd);
  EXPECT_EQ(net_->closeListen(lc), dqNetSuccess);
}

TEST_F(NetPluginTest, ClosedSenderFailsPendingReceive) {
  connect();
  std::vector<char> in(1000);
  void* rreq = start_recv(in, 1);
  ASSERT_EQ(net_->closeSend(send_comm_), dqNetSuccess);
  send_comm_ = nullptr;
  int done = 0;
  Clock::time_point t = Clock::now();
  EXPECT_NE(wait_request(net_, rreq, nullptr, &done, 10), dqNetSuccess);
  EXPECT_LT(seconds_since(t), 8.0);  // failed, not wait_request's own 10 s bound
  // Later receives fail at once.
  void* data = in.data();
  size_t size = in.size();
  int tag = 2;
  void* req = nullptr;
  EXPECT_NE(net_->irecv(recv_comm_, 1, &data, &size, &tag, nullptr, nullptr, &req), dqNetSuccess);
}

TEST_F(NetPluginTest, StagedMessageSurvivesSenderClose) {
  connect();
  std::vector<char> out(200000), in(200000);
  fill(out, 4242);
  finish(start_send(out, 11), 200000);
  ASSERT_EQ(net_->closeSend(send_comm_), dqNetSuccess);
  send_comm_ = nullptr;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // The message arrived before the close; receiving it afterwards still works.
  void* rreq = start_recv(in, 11);
  finish(rreq, 200000);
  EXPECT_EQ(in, out);
}

TEST_F(NetPluginTest, ConnectToClosedListenerFails) {
  ASSERT_EQ(net_->closeListen(listen_comm_), dqNetSuccess);
  listen_comm_ = nullptr;
  void* sc = nullptr;
  dqNetResult r = dqNetSuccess;
  Clock::time_point t = Clock::now();
  while (r == dqNetSuccess && sc == nullptr && seconds_since(t) < 10) {
    r = net_->connect(ctx_, 0, handle_, &sc, nullptr);
  }
  EXPECT_NE(r, dqNetSuccess);
  EXPECT_EQ(sc, nullptr);
}

TEST(NetPluginAdapters, V8RoundTripWithIntSizes) {
  const PluginLib& pl = PluginLib::get();
  ASSERT_NE(pl.v8, nullptr);
  const dqNetV8* n = pl.v8;
  ASSERT_EQ(n->init(&LogCapture::logger), dqNetSuccess);
  int ndev = 0;
  ASSERT_EQ(n->devices(&ndev), dqNetSuccess);
  ASSERT_GE(ndev, 1);
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc = nullptr;
  ASSERT_EQ(n->listen(0, handle, &lc), dqNetSuccess);
  void* sc = nullptr;
  void* rc = nullptr;
  Clock::time_point t = Clock::now();
  while ((sc == nullptr || rc == nullptr) && seconds_since(t) < 10) {
    if (sc == nullptr) {
      ASSERT_EQ(n->connect(0, handle, &sc, nullptr), dqNetSuccess);
    }
    if (rc == nullptr) {
      ASSERT_EQ(n->accept(lc, &rc, nullptr), dqNetSuccess);
    }
  }
  ASSERT_NE(sc, nullptr);
  ASSERT_NE(rc, nullptr);
  std::vector<char> out(300001), in(300001);
  fill(out, 8);
  void* data = in.data();
  int size = static_cast<int>(in.size());
  int tag = 5;
  void* rreq = nullptr;
  ASSERT_EQ(n->irecv(rc, 1, &data, &size, &tag, nullptr, &rreq), dqNetSuccess);
  void* sreq = nullptr;
  ASSERT_EQ(n->isend(sc, out.data(), static_cast<int>(out.size()), 5, nullptr, &sreq),
            dqNetSuccess);
  EXPECT_EQ(n->isend(sc, out.data(), -1, 5, nullptr, &sreq), dqNetInvalidArgument);
  int done = 0;
  int got = 0;
  t = Clock::now();
  while (!done && seconds_since(t) < 10) ASSERT_EQ(n->test(rreq, &done, &got), dqNetSuccess);
  EXPECT_EQ(got, 300001);
  EXPECT_EQ(in, out);
  // The v9/v10 tables agree on the shared entries.
  EXPECT_EQ(pl.v9->test, n->test);
  EXPECT_EQ(pl.v10->closeSend, n->closeSend);
  EXPECT_EQ(n->closeSend(sc), dqNetSuccess);
  EXPECT_EQ(n->closeRecv(rc), dqNetSuccess);
  EXPECT_EQ(n->closeListen(lc), dqNetSuccess);
}

}  // namespace
}  // namespace dq::net::testing
