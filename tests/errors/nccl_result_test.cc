// One Status -> ncclResult_t mapping (docs/ENGINE.md, "Errors: the device error word"): the table
// is pinned here, and a malformed payload gives the same code from the engine (a corrupted
// compressed payload found by the codec) and from the net plugin (a malformed frame).
#include <arpa/inet.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/nccl_api.h"
#include "common/nccl_result.h"
#include "config/settings.h"
#include "plugin/net_abi.h"
#include "plugin/socket/socket_wire.h"
#include "shim/engine/engine.h"
#include "tests/common/engine_test_util.h"

namespace {

using dq::Status;

TEST(NcclResult, TheOneTable) {
  EXPECT_EQ(dq::nccl_result(Status::kOk), ncclSuccess);
  EXPECT_EQ(dq::nccl_result(Status::kInvalidArgument), ncclInvalidArgument);
  EXPECT_EQ(dq::nccl_result(Status::kMalformedPayload), ncclRemoteError);
  EXPECT_EQ(dq::nccl_result(Status::kOutOfMemory), ncclSystemError);
  EXPECT_EQ(dq::nccl_result(Status::kSystemError), ncclSystemError);
  EXPECT_EQ(dq::nccl_result(Status::kTimeout), ncclRemoteError);
  EXPECT_EQ(dq::nccl_result(Status::kInternal), ncclInternalError);
  EXPECT_EQ(dq::nccl_result(Status::kUnsupported), ncclInvalidUsage);
  // The plugin's result enum is NCCL's.
  EXPECT_EQ(static_cast<int>(dqNetRemoteError), static_cast<int>(ncclRemoteError));
  EXPECT_EQ(static_cast<int>(dqNetSystemError), static_cast<int>(ncclSystemError));
}

// ---- the plugin: a malformed frame from a peer ---------------------------------------------
void quiet_logger(dqNetLogLevel, unsigned long, const char*, int, const char*, ...) {}

int plugin_malformed_frame_result() {
  const char* path = std::getenv("DYNAMIQ_NET_PLUGIN_PATH");
  void* lib = dlopen(path != nullptr ? path : "libnccl-net-dynamiq.so", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return -1;
  const auto* net = static_cast<const dqNetV11*>(dlsym(lib, "ncclNetPlugin_v11"));
  void* ctx = nullptr;
  if (net == nullptr || net->init(&ctx, 0x16ull, nullptr, &quiet_logger, nullptr) != dqNetSuccess)
    return -2;
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc = nullptr;
  if (net->listen(ctx, 0, handle, &lc) != dqNetSuccess) return -3;
  dq::net::wire::Handle h;
  std::memcpy(&h, handle, sizeof(h));
  std::vector<int> fds;
  for (int k = 0; k < h.nsocks; ++k) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = h.port_be;
    std::memcpy(&a.sin_addr, h.addr, 4);
    if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return -4;
    const dq::net::wire::Hello hello{dq::net::wire::kHelloMagic,
                                     dq::net::wire::kVersion,
                                     static_cast<uint16_t>(k),
                                     h.nsocks,
                                     0,
                                     0,
                                     h.secret,
                                     0,
                                     0xfeedull};
    if (send(fd, &hello, sizeof(hello), 0) != static_cast<ssize_t>(sizeof(hello))) return -5;
    if (k == 0) {
      const dq::net::wire::MsgHeader bad{0xdeadbeef, 1, 0, 10};  // not a message header
      if (send(fd, &bad, sizeof(bad), 0) != static_cast<ssize_t>(sizeof(bad))) return -5;
    }
    fds.push_back(fd);
  }
  void* rc = nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  while (rc == nullptr && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
    if (net->accept(lc, &rc, nullptr) != dqNetSuccess) return -6;
  }
  if (rc == nullptr) return -7;
  std::vector<char> in(64, 0);
  void* data = in.data();
  size_t size = in.size();
  int tag = 1;
  void* req = nullptr;
  int result = net->irecv(rc, 1, &data, &size, &tag, nullptr, nullptr, &req);
  while (result == dqNetSuccess && req != nullptr &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20)) {
    int done = 0;
    result = net->test(req, &done, nullptr);
    if (done) return -8;  // a malformed frame completed a receive
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  net->closeRecv(rc);
  net->closeListen(lc);
  net->finalize(ctx);
  for (int fd : fds) close(fd);
  return result;
}

TEST(NcclResult, PluginMalformedFrameIsTheMappedCode) {
  EXPECT_EQ(plugin_malformed_frame_result(),
            static_cast<int>(dq::nccl_result(Status::kMalformedPayload)));
}

// ---- the engine: a corrupted compressed payload -----------------------------------------------
// The host device, but every hop's output starts with garbage: the receiving rank's codec finds
// a malformed payload.
class CorruptingDevice final : public dq::engine::Device {
 public:
  explicit CorruptingDevice(Device* inner) : inner_(inner) {}
  bool corrupting = false;
  const char* name() const override { return "corrupting host"; }
  Status alloc(size_t bytes, void** out) override { return inner_->alloc(bytes, out); }
  Status alloc_mapped(size_t bytes, void** out) override {
    return inner_->alloc_mapped(bytes, out);
  }
  void release(void* p, dq::engine::StreamHandle s) override { inner_->release(p, s); }
  Status create_stream(dq::engine::StreamHandle* s) override { return inner_->create_stream(s); }
  void destroy_stream(dq::engine::StreamHandle s) override { inner_->destroy_stream(s); }
  Status create_event(dq::engine::EventHandle* e) override { return inner_->create_event(e); }
  void destroy_event(dq::engine::EventHandle e) override { inner_->destroy_event(e); }
  Status record(dq::engine::EventHandle e, dq::engine::StreamHandle s) override {
    return inner_->record(e, s);
  }
  Status wait(dq::engine::StreamHandle s, dq::engine::EventHandle e) override {
    return inner_->wait(s, e);
  }
  Status synchronize(dq::engine::EventHandle e) override { return inner_->synchronize(e); }
  bool query(dq::engine::EventHandle e) override { return inner_->query(e); }
  bool capturing(dq::engine::StreamHandle s) const override { return inner_->capturing(s); }
  std::unique_ptr<dq::engine::PreparedCodec> prepare(const dq::Codec& c) override {
    return inner_->prepare(c);
  }
  Status local_stats(const dq::engine::PreparedCodec& c, const dq::ConstTensor& x, uint16_t* st,
                     dq::engine::Lane l) override {
    return inner_->local_stats(c, x, st, l);
  }
  Status build_layout(const dq::engine::PreparedCodec& c, const uint16_t* r, uint64_t call,
                      void* layout, dq::engine::Lane l) override {
    return inner_->build_layout(c, r, call, layout, l);
  }
  Status hop(const dq::engine::PreparedCodec& c, const void* layout, int chunk,
             const dq::ConstTensor& own, const dq::ByteView* in, int n_in, uint8_t* out,
             const dq::RoundingKey& key, dq::engine::Lane l) override {
    const Status s = inner_->hop(c, layout, chunk, own, in, n_in, out, key, l);
    static const unsigned char kGarbage[16] = {0xde, 0xad, 0xbe, 0xef, 1, 2,  3,  4,
                                               5,    6,    7,    8,    9, 10, 11, 12};
    if (s != Status::kOk || !corrupting) return s;
    return inner_->copy(out, kGarbage, sizeof kGarbage, l);
  }
  Status finish(const dq::engine::PreparedCodec& c, const void* layout, int chunk, dq::ByteView in,
                void* out, dq::DType t, dq::ReduceOp op, int n, dq::engine::Lane l) override {
    return inner_->finish(c, layout, chunk, in, out, t, op, n, l);
  }
  Status copy(void* d, const void* s, size_t b, dq::engine::Lane l) override {
    return inner_->copy(d, s, b, l);
  }
  Status predict_budget(const dq::BudgetJob* j, const uint16_t* r, void* scratch, size_t bytes,
                        dq::BudgetResult* out, dq::engine::Lane l) override {
    return inner_->predict_budget(j, r, scratch, bytes, out, l);
  }
  Status nccl(dq::engine::Lane l, std::function<ncclResult_t()> calls) override {
    return inner_->nccl(l, std::move(calls));
  }

 private:
  Device* inner_;
};

dq::config::Settings engine_settings() {
  dq::config::Settings s;
  std::string error;
  auto lookup = [](const char* key, void*) -> const char* {
    if (std::strcmp(key, "DYNAMIQ_ENABLE") == 0) return "1";
    if (std::strcmp(key, "DYNAMIQ_TOPO") == 0) return "ring";
    return nullptr;
  };
  if (dq::config::load(lookup, nullptr, &s, &error) != Status::kOk) std::abort();
  return s;
}

// Rank body in a forked process: one clean call, then a corrupted one. Exit code: the corrupted
// call's ncclResult_t, or 100 + a step that went wrong.
int engine_rank(int rank, int n, ncclComm_t comm) {
  const dq::config::Settings settings = engine_settings();
  const dq::engine::NcclOps ops = dq::test::cpu_nccl_ops();
  CorruptingDevice device(dq::engine::host_device());
  dq::engine::Engine engine(settings, true, {comm, rank, n}, ops, &device, nullptr, true);
  constexpr size_t kCount = 1 << 20;
  std::vector<float> in(kCount), out(kCount, 0.0f);
  for (size_t i = 0; i < kCount; ++i)
    in[i] = static_cast<float>(std::sin(0.001 * i + rank) * (1.0 + 4.0 * std::cos(3e-5 * i)));
  dq::engine::CallArgs args;
  args.send = in.data();
  args.recv = out.data();
  args.count = kCount;
  dq::engine::PassReason reason;
  if (engine.run(args, &reason) != ncclSuccess || reason != dq::engine::PassReason::kRerouted)
    return 101;
  device.corrupting = true;  // every rank's payloads: each rank's first decode finds garbage
  return static_cast<int>(engine.run(args, &reason));
}

TEST(NcclResult, EngineMalformedPayloadIsTheMappedCode) {
  constexpr int kRanks = 2;
  setenv("DYNAMIQ_CPU_NCCL_TIMEOUT_MS", "3000", 1);
  // Rank 0, a child, makes the unique id and passes it on through a pipe: ncclGetUniqueId starts
  // the bootstrap root's threads, and a child forked from a multi-threaded parent may inherit a
  // lock one of them held (ASan's allocator hung ranks that way).
  int id_pipe[2];
  ASSERT_EQ(pipe(id_pipe), 0);
  std::vector<pid_t> pids;
  for (int r = 0; r < kRanks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      ncclUniqueId id;
      if (r == 0) {
        if (ncclGetUniqueId(&id) != ncclSuccess) _exit(102);
        for (int peer = 1; peer < kRanks; ++peer)
          if (write(id_pipe[1], &id, sizeof id) != static_cast<ssize_t>(sizeof id)) _exit(103);
      } else {
        close(id_pipe[1]);  // rank 0 dying closes the last writer: read returns 0, no hang
        if (read(id_pipe[0], &id, sizeof id) != static_cast<ssize_t>(sizeof id)) _exit(104);
      }
      ncclComm_t comm = nullptr;
      if (ncclCommInitRank(&comm, kRanks, id, r) != ncclSuccess) _exit(100);
      const int code = engine_rank(r, kRanks, comm);
      std::fflush(stderr);
      _exit(code);
    }
    ASSERT_GT(pid, 0);
    pids.push_back(pid);
  }
  close(id_pipe[0]);
  close(id_pipe[1]);
  for (int r = 0; r < kRanks; ++r) {
    int st = 0;
    // Each rank's wait is bounded by DYNAMIQ_CPU_NCCL_TIMEOUT_MS; meson's timeout bounds the rest.
    ASSERT_EQ(waitpid(pids[r], &st, 0), pids[r]);
    ASSERT_TRUE(WIFEXITED(st)) << "rank " << r << " died";
    EXPECT_EQ(WEXITSTATUS(st), static_cast<int>(dq::nccl_result(Status::kMalformedPayload)))
        << "rank " << r << " (exit codes above 100: a step before the corrupted call failed)";
  }
}

}  // namespace
