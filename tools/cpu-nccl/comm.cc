#include "tools/cpu-nccl/comm.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>

#include "config/settings.h"

namespace dq::cpunccl {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kIdMagic = 0x31434e4350435144ull;     // "DQCPCNC1"
constexpr uint64_t kHelloMagic = 0x4f4c4c4548435144ull;  // "DQCHELLO"
constexpr size_t kIdHandleOffset = 16;
constexpr size_t kIdHandleBytes = kUniqueIdBytes - kIdHandleOffset;  // 112
constexpr int kWindow = 4;  // messages in flight per direction (pipeline depth)

enum HelloKind : int32_t { kRankToRoot = 1, kRootToRank = 2, kPeer = 3 };

uint64_t random_u64() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
         static_cast<uint64_t>(Clock::now().time_since_epoch().count());
}

uint64_t mix(uint64_t x) {  // splitmix64 finaliser: derives child comm tags
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Tracks time since the last progress and backs off while idle (no core burnt on waiting).
class IdleClock {
 public:
  explicit IdleClock(int timeout_ms) : timeout_(std::chrono::milliseconds(timeout_ms)) {}
  void progressed() {
    last_ = Clock::now();
    rounds_ = 0;
  }
  // Waits a little; false once nothing progressed for the whole timeout.
  bool idle() {
    ++rounds_;
    if (rounds_ < 16) {
      std::this_thread::yield();
    } else {
      unsigned shift = std::min(rounds_ - 16, 6u);
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(500u, 8u << shift)));
    }
    return Clock::now() - last_ < timeout_;
  }
  long idle_ms() const {
    return static_cast<long>(
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - last_).count());
  }

 private:
  Clock::duration timeout_;
  Clock::time_point last_ = Clock::now();
  unsigned rounds_ = 0;
};

// Memory registrations of one operation; deregistered when it ends.
class MrSet {
 public:
  explicit MrSet(Net* net) : net_(net) {}
  ~MrSet() {
    for (auto& e : entries_) net_->dereg(e.comm, e.mhandle);
  }
  Status add(void* comm, const void* base, size_t bytes) {
    if (!comm || !base || bytes == 0) return Status::kOk;
    for (auto& e : entries_)
      if (e.comm == comm && e.base == base && e.bytes == bytes) return Status::kOk;
    Entry e{comm, static_cast<const char*>(base), bytes, nullptr};
    DQ_CHECK(net_->reg(comm, const_cast<void*>(base), bytes, &e.mhandle));
    entries_.push_back(e);
    return Status::kOk;
  }
  // After the comms were closed: their registrations went with them.
  void forget() { entries_.clear(); }
  void* find(void* comm, const void* ptr, size_t bytes) const {
    const char* p = static_cast<const char*>(ptr);
    for (auto& e : entries_)
      if (e.comm == comm && p >= e.base && p + bytes <= e.base + e.bytes) return e.mhandle;
    return nullptr;
  }

 private:
  struct Entry {
    void* comm;
    const char* base;
    size_t bytes;
    void* mhandle;
  };
  Net* net_;
  std::vector<Entry> entries_;
};

// On an early return while requests are posted, closes every connection of the comm before
// the buffers the plugin may still write to (temp slots, the caller's buffers) go away.
// Declare it after those buffers and after the MrSet, so that it runs first.
class AbortOnError {
 public:
  AbortOnError(Comm* comm, MrSet* mrs) : comm_(comm), mrs_(mrs) {}
  ~AbortOnError() {
    if (!armed_) return;
    comm_->abort_connections();
    mrs_->forget();
  }
  void dismiss() { armed_ = false; }

 private:
  Comm* comm_;
  MrSet* mrs_;
  bool armed_ = true;
};

struct Span {
  char* ptr;
  size_t bytes;
};

// A pipelined exchange with one send peer and one receive peer: items are posted in order,
// at most kWindow in flight each way; receives complete in order (the plugin keeps order per
// connection) and are handed to on_recv, which may unlock later sends.
struct Pipeline {
  int send_peer = -1;
  int recv_peer = -1;
  size_t sends = 0;
  size_t recvs = 0;
  size_t slot_bytes = 0;  // temp slot size for receives whose span has ptr == nullptr
  std::function<Span(size_t)> send_span;
  // May send item i now? (recv_done = receives processed so far)
  std::function<bool(size_t i, size_t recv_done, const std::vector<uint8_t>& send_done)>
      send_ready;
  std::function<Span(size_t)> recv_span;
  std::function<bool(size_t i, const std::vector<uint8_t>& send_done)> recv_ready;
  std::function<void(size_t i, const char* landed, size_t bytes)> on_recv;
  std::vector<std::pair<const void*, size_t>> send_buffers;  // to register on the send comm
  std::vector<std::pair<const void*, size_t>> recv_buffers;  // to register on the recv comm
};

}  // namespace

int timeout_ms_from_env() {
  // DYNAMIQ_CPU_NCCL_TIMEOUT_MS, else DYNAMIQ_TIMEOUT_MS (config/settings.def).
  return static_cast<int>(config::current().cpu_nccl_timeout_ms);
}

struct Comm::Hello {
  uint64_t magic;
  uint64_t comm_tag;
  int32_t kind;
  int32_t rank;
  int32_t nranks;
  int32_t reserved;
  NetHandle handle;  // kRankToRoot: the sender's listen handle
};

// ---------------------------------------------------------------------------------------------
// Small blocking helpers on the plugin, all bounded by an idle timeout.

namespace {

Status wait_request(Net* net, void* request, size_t expect_bytes, int timeout_ms,
                    const char* what) {
  IdleClock clock(timeout_ms);
  for (;;) {
    bool done = false;
    size_t bytes = 0;
    DQ_CHECK(net->test(request, &done, &bytes));
    if (done) {
      if (bytes != expect_bytes)
        DQ_FAIL(Status::kMalformedPayload, "cpu-nccl: %s: %zu bytes instead of %zu", what, bytes,
                expect_bytes);
      return Status::kOk;
    }
    if (!clock.idle()) DQ_FAIL(Status::kTimeout, "cpu-nccl: %s: timed out", what);
  }
}

Status post_send(Net* net, void* comm, void* data, size_t bytes, void* mh, int timeout_ms,
                 void** request) {
  IdleClock clock(timeout_ms);
  for (;;) {
    DQ_CHECK(net->isend(comm, data, bytes, mh, request));
    if (*request) return Status::kOk;
    if (!clock.idle()) DQ_FAIL(Status::kTimeout, "cpu-nccl: isend stayed blocked");
  }
}

Status send_blocking(Net* net, void* comm, void* data, size_t bytes, int timeout_ms,
                     const char* what) {
  void* mh = nullptr;
  DQ_CHECK(net->reg(comm, data, bytes, &mh));
  void* req = nullptr;
  Status s = post_send(net, comm, data, bytes, mh, timeout_ms, &req);
  if (s == Status::kOk) s = wait_request(net, req, bytes, timeout_ms, what);
  net->dereg(comm, mh);
  return s;
}

// The bootstrap root: collects every rank's listen handle, then sends the table to every rank.
struct RootState {
  Net* net;
  void* ctx;
  void* listen_comm;
  uint64_t job;
  int timeout_ms;
};

struct Incoming {
  void* comm = nullptr;
  void* request = nullptr;
  void* mhandle = nullptr;
  std::unique_ptr<unsigned char[]> buffer;
  bool done = false;
};

Status root_serve(const RootState& st) {
  IdleClock clock(st.timeout_ms);
  std::vector<std::unique_ptr<Incoming>> incoming;
  int nranks = -1;
  std::vector<NetHandle> handles;
  std::vector<uint8_t> seen;
  int seen_count = 0;
  Status status = Status::kOk;
  // Phase 1: gather.
  const size_t hello_bytes = sizeof(uint64_t) * 2 + sizeof(int32_t) * 4 + kNetHandleBytes;
  while (nranks < 0 || seen_count < nranks) {
    bool progress = false;
    void* rc = nullptr;
    status = st.net->accept(st.listen_comm, &rc);
    if (status != Status::kOk) break;
    if (rc) {
      auto in = std::make_unique<Incoming>();
      in->comm = rc;
      in->buffer = std::make_unique<unsigned char[]>(hello_bytes);
      incoming.push_back(std::move(in));
      progress = true;
    }
    for (auto& in : incoming) {
      if (in->done) continue;
      if (!in->request) {
        status = st.net->reg(in->comm, in->buffer.get(), hello_bytes, &in->mhandle);
        if (status == Status::kOk)
          status = st.net->irecv(in->comm, in->buffer.get(), hello_bytes, in->mhandle,
                                 &in->request);
        if (status != Status::kOk) break;
        if (!in->request) continue;
      }
      bool done = false;
      size_t bytes = 0;
      if (st.net->test(in->request, &done, &bytes) != Status::kOk) {
        DQ_WARN(Subsys::kNet, "cpu-nccl root: a rank's hello failed; ignoring that connection");
        in->done = true;
        continue;
      }
      if (!done) continue;
      in->done = true;
      progress = true;
      uint64_t magic, job;
      int32_t kind, rank, n;
      std::memcpy(&magic, in->buffer.get(), 8);
      std::memcpy(&job, in->buffer.get() + 8, 8);
      std::memcpy(&kind, in->buffer.get() + 16, 4);
      std::memcpy(&rank, in->buffer.get() + 20, 4);
      std::memcpy(&n, in->buffer.get() + 24, 4);
      if (bytes != hello_bytes || magic != kHelloMagic || job != st.job || kind != kRankToRoot ||
          n < 1 || rank < 0 || rank >= n || (nranks > 0 && n != nranks)) {
        DQ_WARN(Subsys::kNet, "cpu-nccl root: rejected a malformed or foreign hello");
        continue;
      }
      if (nranks < 0) {
        nranks = n;
        handles.resize(n);
        seen.assign(n, 0);
      }
      if (seen[rank]) {
        DQ_WARN(Subsys::kNet, "cpu-nccl root: rank %d registered twice; ignoring", rank);
        continue;
      }
      seen[rank] = 1;
      ++seen_count;
      std::memcpy(handles[rank].bytes, in->buffer.get() + 32, kNetHandleBytes);
    }
    if (status != Status::kOk) break;
    if (progress) clock.progressed();
    else if (!clock.idle()) {
      if (nranks < 0)
        DQ_WARN(Subsys::kNet, "cpu-nccl root: no rank used this unique id within %d ms",
                st.timeout_ms);
      else
        DQ_WARN(Subsys::kNet, "cpu-nccl root: only %d of %d ranks arrived within %d ms",
                seen_count, nranks, st.timeout_ms);
      status = Status::kTimeout;
      break;
    }
  }
  // Phase 2: send the table (hello header + nranks handles in one message) to every rank.
  std::vector<void*> send_comms;
  if (status == Status::kOk) {
    const size_t table_bytes = 32 + kNetHandleBytes * static_cast<size_t>(nranks);
    std::vector<unsigned char> table(table_bytes);
    uint64_t magic = kHelloMagic;
    int32_t kind = kRootToRank, zero = 0;
    std::memcpy(table.data(), &magic, 8);
    std::memcpy(table.data() + 8, &st.job, 8);
    std::memcpy(table.data() + 16, &kind, 4);
    std::memcpy(table.data() + 20, &zero, 4);
    std::memcpy(table.data() + 24, &nranks, 4);
    std::memcpy(table.data() + 28, &zero, 4);
    for (int r = 0; r < nranks; ++r)
      std::memcpy(table.data() + 32 + kNetHandleBytes * r, handles[r].bytes, kNetHandleBytes);
    send_comms.assign(nranks, nullptr);
    std::vector<void*> requests(nranks, nullptr), mhandles(nranks, nullptr);
    std::vector<uint8_t> finished(nranks, 0);
    int finished_count = 0;
    clock.progressed();
    while (status == Status::kOk && finished_count < nranks) {
      bool progress = false;
      for (int r = 0; r < nranks && status == Status::kOk; ++r) {
        if (finished[r]) continue;
        if (!send_comms[r]) {
          status = st.net->connect(st.ctx, &handles[r], &send_comms[r]);
          if (status != Status::kOk || !send_comms[r]) continue;
          status = st.net->reg(send_comms[r], table.data(), table_bytes, &mhandles[r]);
          progress = true;
        }
        if (status != Status::kOk) break;
        if (!requests[r]) {
          status = st.net->isend(send_comms[r], table.data(), table_bytes, mhandles[r],
                                 &requests[r]);
          if (status != Status::kOk || !requests[r]) continue;
          progress = true;
        }
        bool done = false;
        status = st.net->test(requests[r], &done, nullptr);
        if (status == Status::kOk && done) {
          finished[r] = 1;
          ++finished_count;
          progress = true;
        }
      }
      if (status != Status::kOk) {
        DQ_WARN(Subsys::kNet, "cpu-nccl root: sending the rank table failed");
        break;
      }
      if (progress) clock.progressed();
      else if (!clock.idle()) {
        DQ_WARN(Subsys::kNet, "cpu-nccl root: %d of %d ranks did not take the rank table",
                nranks - finished_count, nranks);
        status = Status::kTimeout;
      }
    }
    for (int r = 0; r < nranks; ++r) {
      if (send_comms[r]) {
        st.net->dereg(send_comms[r], mhandles[r]);
        st.net->close_send(send_comms[r]);
      }
    }
  }
  for (auto& in : incoming) {
    st.net->dereg(in->comm, in->mhandle);
    st.net->close_recv(in->comm);
  }
  st.net->close_listen(st.listen_comm);
  st.net->finalize(st.ctx);
  return status;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Comm::~Comm() {
  abort_connections();
  if (listen_comm_) net_->close_listen(listen_comm_);
  if (net_ && ctx_) net_->finalize(ctx_);
}

void Comm::abort_connections() {
  if (!net_) return;
  for (auto& c : send_comms_) {
    net_->close_send(c);
    c = nullptr;
  }
  for (auto& c : recv_comms_) {
    net_->close_recv(c);
    c = nullptr;
  }
}

void Comm::fail(FailKind kind, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (last_error_.empty()) last_error_ = message;
  }
  FailKind none = FailKind::kNone;
  failure_.compare_exchange_strong(none, kind);
  abort_connections();
}

std::string Comm::last_error() const {
  std::lock_guard<std::mutex> lock(error_mutex_);
  return last_error_;
}

Status Comm::make_unique_id(unsigned char id[kUniqueIdBytes]) {
  Net* net = nullptr;
  DQ_CHECK(Net::get(&net));
  RootState st{net, nullptr, nullptr, random_u64(), timeout_ms_from_env()};
  DQ_CHECK(net->init(st.job, &st.ctx));
  NetHandle handle;
  Status s = net->listen(st.ctx, &handle, &st.listen_comm);
  if (s != Status::kOk) {
    net->finalize(st.ctx);
    return s;
  }
  for (size_t i = kIdHandleBytes; i < kNetHandleBytes; ++i) {
    if (handle.bytes[i] != 0) {
      net->close_listen(st.listen_comm);
      net->finalize(st.ctx);
      DQ_FAIL(Status::kUnsupported,
              "cpu-nccl: the net plugin's listen handle uses more than %zu bytes; it does not "
              "fit in ncclUniqueId next to the job id",
              kIdHandleBytes);
    }
  }
  std::memset(id, 0, kUniqueIdBytes);
  std::memcpy(id, &kIdMagic, 8);
  std::memcpy(id + 8, &st.job, 8);
  std::memcpy(id + kIdHandleOffset, handle.bytes, kIdHandleBytes);
  std::thread([st] {
    if (root_serve(st) != Status::kOk)
      DQ_WARN(Subsys::kNet, "cpu-nccl root for job %016llx ended with an error",
              static_cast<unsigned long long>(st.job));
  }).detach();
  return Status::kOk;
}

Status Comm::init_plugin(uint64_t comm_tag) {
  comm_tag_ = comm_tag;
  const config::Settings settings = config::current();  // DYNAMIQ_CPU_NCCL_*
  timeout_ms_ = static_cast<int>(settings.cpu_nccl_timeout_ms);
  chunk_bytes_ = static_cast<size_t>(settings.cpu_nccl_chunk_bytes);
  DQ_CHECK(Net::get(&net_));
  chunk_bytes_ = std::min(chunk_bytes_, net_->max_message_bytes());
  DQ_CHECK(net_->init(comm_tag, &ctx_));
  send_comms_.assign(nranks_, nullptr);
  recv_comms_.assign(nranks_, nullptr);
  return Status::kOk;
}

Status Comm::init(const unsigned char id[kUniqueIdBytes]) {
  uint64_t magic, job;
  std::memcpy(&magic, id, 8);
  std::memcpy(&job, id + 8, 8);
  if (magic != kIdMagic)
    DQ_FAIL(Status::kInvalidArgument, "cpu-nccl: ncclUniqueId was not made by ncclGetUniqueId "
                                      "of this library");
  DQ_CHECK(init_plugin(job));
  NetHandle my_handle;
  DQ_CHECK(net_->listen(ctx_, &my_handle, &listen_comm_));
  // Register with the root.
  NetHandle root_handle;
  std::memset(root_handle.bytes, 0, sizeof root_handle.bytes);
  std::memcpy(root_handle.bytes, id + kIdHandleOffset, kIdHandleBytes);
  void* root_send = nullptr;
  {
    IdleClock clock(timeout_ms_);
    for (;;) {
      DQ_CHECK(net_->connect(ctx_, &root_handle, &root_send));
      if (root_send) break;
      if (!clock.idle())
        DQ_FAIL(Status::kTimeout, "cpu-nccl rank %d: cannot reach the bootstrap root", rank_);
    }
  }
  Hello hello{};
  hello.magic = kHelloMagic;
  hello.comm_tag = job;
  hello.kind = kRankToRoot;
  hello.rank = rank_;
  hello.nranks = nranks_;
  hello.handle = my_handle;
  static_assert(sizeof(Hello) == 32 + kNetHandleBytes);
  Status s = send_blocking(net_, root_send, &hello, sizeof hello, timeout_ms_,
                           "sending this rank's address to the bootstrap root");
  if (s == Status::kOk) {
    std::vector<NetHandle> handles;
    s = build_mesh(&handles, /*handles_from_root=*/true);
  }
  net_->close_send(root_send);
  if (s != Status::kOk) DQ_FAIL(s, "cpu-nccl rank %d of %d: bootstrap failed", rank_, nranks_);
  DQ_INFO(Subsys::kNet, "cpu-nccl rank %d of %d: connected to every peer (job %016llx)", rank_,
          nranks_, static_cast<unsigned long long>(job));
  return Status::kOk;
}

Status Comm::build_mesh(std::vector<NetHandle>* handles, bool handles_from_root) {
  const size_t table_bytes = 32 + kNetHandleBytes * static_cast<size_t>(nranks_);
  std::vector<std::unique_ptr<Incoming>> incoming;
  Incoming* root_in = nullptr;  // the accepted connection the root's table arrives on
  bool have_table = !handles_from_root;
  int accepted_peers = 0, connected_peers = 0;
  std::vector<void*> hello_req(nranks_, nullptr), hello_mh(nranks_, nullptr);
  std::vector<uint8_t> hello_sent(nranks_, 0);
  Hello out{};
  out.magic = kHelloMagic;
  out.comm_tag = comm_tag_;
  out.kind = kPeer;
  out.rank = rank_;
  out.nranks = nranks_;
  IdleClock clock(timeout_ms_);
  Status status = Status::kOk;
  auto finished = [&] {
    return have_table && accepted_peers == nranks_ - 1 && connected_peers == nranks_ - 1;
  };
  while (!finished()) {
    bool progress = false;
    void* rc = nullptr;
    status = net_->accept(listen_comm_, &rc);
    if (status != Status::kOk) break;
    if (rc) {
      auto in = std::make_unique<Incoming>();
      in->comm = rc;
      in->buffer = std::make_unique<unsigned char[]>(std::max(sizeof(Hello), table_bytes));
      incoming.push_back(std::move(in));
      progress = true;
    }
    for (auto& in : incoming) {
      if (in->done || !in->comm) continue;
      // The root sends one message (header + table); peers send one Hello.
      const bool from_root = in.get() == root_in;
      if (!in->request) {
        size_t cap = handles_from_root ? std::max(sizeof(Hello), table_bytes) : sizeof(Hello);
        if (!in->mhandle) {
          status = net_->reg(in->comm, in->buffer.get(), cap, &in->mhandle);
          if (status != Status::kOk) break;
        }
        status = net_->irecv(in->comm, in->buffer.get(), cap, in->mhandle, &in->request);
        if (status != Status::kOk) break;
        if (!in->request) continue;
      }
      (void)from_root;
      bool done = false;
      size_t bytes = 0;
      if (net_->test(in->request, &done, &bytes) != Status::kOk) {
        DQ_WARN(Subsys::kNet, "cpu-nccl rank %d: an incoming connection failed during "
                "bootstrap; ignoring it", rank_);
        net_->dereg(in->comm, in->mhandle);
        net_->close_recv(in->comm);
        in->comm = nullptr;
        in->done = true;
        continue;
      }
      if (!done) continue;
      in->done = true;
      progress = true;
      Hello h{};
      std::memcpy(&h, in->buffer.get(), std::min(bytes, sizeof h));
      bool valid = bytes >= 32 && h.magic == kHelloMagic && h.comm_tag == comm_tag_;
      if (valid && h.kind == kRootToRank && handles_from_root && !have_table &&
          h.nranks == nranks_ && bytes == table_bytes) {
        handles->resize(nranks_);
        for (int r = 0; r < nranks_; ++r)
          std::memcpy((*handles)[r].bytes, in->buffer.get() + 32 + kNetHandleBytes * r,
                      kNetHandleBytes);
        have_table = true;
        root_in = in.get();
        net_->dereg(in->comm, in->mhandle);
        net_->close_recv(in->comm);
        in->comm = nullptr;
        continue;
      }
      if (valid && h.kind == kPeer && bytes == sizeof(Hello) && h.nranks == nranks_ &&
          h.rank >= 0 && h.rank < nranks_ && h.rank != rank_ && !recv_comms_[h.rank]) {
        recv_comms_[h.rank] = in->comm;
        net_->dereg(in->comm, in->mhandle);
        in->comm = nullptr;  // owned by recv_comms_ now
        ++accepted_peers;
        continue;
      }
      DQ_WARN(Subsys::kNet, "cpu-nccl rank %d: rejected an unexpected connection during "
              "bootstrap (kind %d, rank %d)", rank_, h.kind, h.rank);
      net_->dereg(in->comm, in->mhandle);
      net_->close_recv(in->comm);
      in->comm = nullptr;
    }
    if (status != Status::kOk) break;
    if (have_table) {
      for (int p = 0; p < nranks_ && status == Status::kOk; ++p) {
        if (p == rank_ || hello_sent[p]) continue;
        if (!send_comms_[p]) {
          status = net_->connect(ctx_, &(*handles)[p], &send_comms_[p]);
          if (status != Status::kOk || !send_comms_[p]) continue;
          status = net_->reg(send_comms_[p], &out, sizeof out, &hello_mh[p]);
          progress = true;
          if (status != Status::kOk) break;
        }
        if (!hello_req[p]) {
          status = net_->isend(send_comms_[p], &out, sizeof out, hello_mh[p], &hello_req[p]);
          if (status != Status::kOk || !hello_req[p]) continue;
          progress = true;
        }
        bool done = false;
        status = net_->test(hello_req[p], &done, nullptr);
        if (status == Status::kOk && done) {
          hello_sent[p] = 1;
          net_->dereg(send_comms_[p], hello_mh[p]);
          hello_mh[p] = nullptr;
          ++connected_peers;
          progress = true;
        }
      }
      if (status != Status::kOk) break;
    }
    if (progress) {
      clock.progressed();
    } else if (!clock.idle()) {
      std::string missing;
      for (int p = 0; p < nranks_; ++p)
        if (p != rank_ && (!recv_comms_[p] || !hello_sent[p]))
        {
          if (!missing.empty()) missing.push_back(',');
          missing.append(std::to_string(p));
        }
      DQ_WARN(Subsys::kNet, "cpu-nccl rank %d: bootstrap timed out after %d ms: %s; peers "
              "not connected: %s", rank_, timeout_ms_,
              have_table ? "mesh incomplete" : "no rank table from the root", missing.c_str());
      status = Status::kTimeout;
      break;
    }
  }
  for (auto& in : incoming) {
    if (in->comm) {
      net_->dereg(in->comm, in->mhandle);
      net_->close_recv(in->comm);
    }
  }
  for (int p = 0; p < nranks_; ++p)
    if (hello_mh[p] && send_comms_[p]) net_->dereg(send_comms_[p], hello_mh[p]);
  return status;
}

Status Comm::split(Comm* parent, int color, int key, const std::string& name, Comm** child) {
  *child = nullptr;
  const uint64_t tag = mix(parent->comm_tag_ ^ mix(++parent->split_count_));
  std::unique_ptr<Comm> fresh;
  NetHandle my_handle{};
  // Every parent rank takes part in the exchange, even with color < 0.
  struct Entry {
    int32_t color;
    int32_t key;
    NetHandle handle;
  };
  std::vector<Entry> table(parent->nranks_);
  Entry mine{color, key, {}};
  std::memset(mine.handle.bytes, 0, kNetHandleBytes);
  Status local = Status::kOk;
  if (color >= 0) {
    // Rank and size are known only after the exchange; build with placeholders, fix below.
    fresh = std::make_unique<Comm>(0, 1);
    fresh->net_ = parent->net_;
    local = fresh->net_->init(mix(tag ^ static_cast<uint64_t>(color)), &fresh->ctx_);
    if (local == Status::kOk) local = fresh->net_->listen(fresh->ctx_, &my_handle,
                                                          &fresh->listen_comm_);
    if (local != Status::kOk) mine.color = -2;  // tells the others this rank cannot join
    mine.handle = my_handle;
  }
  CollArgs gather{CollKind::kAllGather, &mine, table.data(), sizeof(Entry), DType::kUint8,
                  RedOp::kSum, 0};
  DQ_CHECK(parent->collective(gather));
  if (local != Status::kOk) DQ_FAIL(local, "cpu-nccl: ncclCommSplit: cannot listen");
  if (color < 0) return Status::kOk;
  std::vector<int> members;
  for (int r = 0; r < parent->nranks_; ++r) {
    if (table[r].color == -2 && color >= 0)
      DQ_FAIL(Status::kSystemError, "cpu-nccl: ncclCommSplit: parent rank %d failed to listen",
              r);
    if (table[r].color == color) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return table[a].key < table[b].key; });
  const int new_rank =
      static_cast<int>(std::find(members.begin(), members.end(), parent->rank_) - members.begin());
  auto made = std::make_unique<Comm>(new_rank, static_cast<int>(members.size()));
  made->net_ = fresh->net_;
  made->ctx_ = fresh->ctx_;
  made->listen_comm_ = fresh->listen_comm_;
  fresh->ctx_ = nullptr;
  fresh->listen_comm_ = nullptr;
  made->comm_tag_ = mix(tag ^ static_cast<uint64_t>(color));
  made->timeout_ms_ = parent->timeout_ms_;
  made->chunk_bytes_ = parent->chunk_bytes_;
  made->name_ = name;
  made->blocking_ = parent->blocking_;
  made->send_comms_.assign(made->nranks_, nullptr);
  made->recv_comms_.assign(made->nranks_, nullptr);
  std::vector<NetHandle> handles(made->nranks_);
  for (int i = 0; i < made->nranks_; ++i) handles[i] = table[members[i]].handle;
  DQ_CHECK(made->build_mesh(&handles, /*handles_from_root=*/false));
  *child = made.release();
  return Status::kOk;
}

// ---------------------------------------------------------------------------------------------
// Data movement.

namespace {

Status run_pipeline(Comm* comm, Net* net, const std::vector<void*>& send_comms,
                    const std::vector<void*>& recv_comms, int timeout_ms, Pipeline& p) {
  const int rank = comm->rank();
  void* sc = p.send_peer >= 0 ? send_comms[p.send_peer] : nullptr;
  void* rc = p.recv_peer >= 0 ? recv_comms[p.recv_peer] : nullptr;
  if ((p.sends && !sc) || (p.recvs && !rc))
    DQ_FAIL(Status::kSystemError, "cpu-nccl rank %d: connection to peer rank %d is closed", rank,
            p.sends && !sc ? p.send_peer : p.recv_peer);
  MrSet mrs(net);
  for (auto& b : p.send_buffers) DQ_CHECK(mrs.add(sc, b.first, b.second));
  for (auto& b : p.recv_buffers) DQ_CHECK(mrs.add(rc, b.first, b.second));
  std::vector<char> slots;
  if (p.slot_bytes && p.recvs) {
    slots.resize(p.slot_bytes * kWindow);
    DQ_CHECK(mrs.add(rc, slots.data(), slots.size()));
  }
  std::vector<void*> send_req(p.sends, nullptr);
  std::vector<uint8_t> send_done(p.sends, 0);
  AbortOnError abort_on_error(comm, &mrs);
  std::vector<void*> recv_req(p.recvs, nullptr);
  std::vector<Span> recv_at(p.recvs, Span{nullptr, 0});
  size_t send_posted = 0, send_first_open = 0, sends_finished = 0, send_inflight = 0;
  size_t recv_posted = 0, recv_processed = 0;
  IdleClock clock(timeout_ms);
  while (sends_finished < p.sends || recv_processed < p.recvs) {
    bool progress = false;
    // Post sends in order.
    while (send_posted < p.sends && send_inflight < kWindow) {
      const size_t i = send_posted;
      if (p.send_ready && !p.send_ready(i, recv_processed, send_done)) break;
      Span s = p.send_span(i);
      if (s.bytes == 0) {
        send_done[i] = 1;
        ++sends_finished;
        ++send_posted;
        progress = true;
        continue;
      }
      Status st = net->isend(sc, s.ptr, s.bytes, mrs.find(sc, s.ptr, s.bytes), &send_req[i]);
      if (st != Status::kOk)
        DQ_FAIL(Status::kSystemError, "cpu-nccl rank %d: send to peer rank %d failed", rank,
                p.send_peer);
      if (!send_req[i]) break;
      ++send_inflight;
      ++send_posted;
      progress = true;
    }
    // Post receives in order, into a free temp slot or straight into place.
    while (recv_posted < p.recvs && recv_posted < recv_processed + kWindow) {
      const size_t i = recv_posted;
      if (p.recv_ready && !p.recv_ready(i, send_done)) break;
      Span s = p.recv_span(i);
      if (s.bytes != 0) {
        if (!s.ptr) s.ptr = slots.data() + (i % kWindow) * p.slot_bytes;
        Status st = net->irecv(rc, s.ptr, s.bytes, mrs.find(rc, s.ptr, s.bytes), &recv_req[i]);
        if (st != Status::kOk)
          DQ_FAIL(Status::kSystemError, "cpu-nccl rank %d: receive from peer rank %d failed",
                  rank, p.recv_peer);
        if (!recv_req[i]) break;
      }
      recv_at[i] = s;
      ++recv_posted;
      progress = true;
    }
    // Complete sends (any order).
    for (size_t i = send_first_open; i < send_posted; ++i) {
      if (send_done[i]) continue;
      bool done = false;
      if (net->test(send_req[i], &done, nullptr) != Status::kOk)
        DQ_FAIL(Status::kSystemError, "cpu-nccl rank %d: send to peer rank %d failed "
                "(connection lost?)", rank, p.send_peer);
      if (done) {
        send_done[i] = 1;
        ++sends_finished;
        --send_inflight;
        progress = true;
      }
    }
    while (send_first_open < send_posted && send_done[send_first_open]) ++send_first_open;
    // Complete receives in order.
    while (recv_processed < recv_posted) {
      const size_t i = recv_processed;
      if (recv_at[i].bytes != 0) {
        bool done = false;
        size_t bytes = 0;
        // The plugin's own status: a malformed frame stays kMalformedPayload.
        if (const Status ts = net->test(recv_req[i], &done, &bytes); ts != Status::kOk)
          DQ_FAIL(ts, "cpu-nccl rank %d: receive from peer rank %d failed "
                  "(connection lost?)", rank, p.recv_peer);
        if (!done) break;
        if (bytes != recv_at[i].bytes)
          DQ_FAIL(Status::kMalformedPayload, "cpu-nccl rank %d: peer rank %d sent %zu bytes, "
                  "expected %zu (mismatched calls?)", rank, p.recv_peer, bytes, recv_at[i].bytes);
      }
      if (p.on_recv) p.on_recv(i, recv_at[i].ptr, recv_at[i].bytes);
      ++recv_processed;
      progress = true;
    }
    if (progress) {
      clock.progressed();
    } else if (!clock.idle()) {
      const int peer = recv_processed < p.recvs ? p.recv_peer : p.send_peer;
      DQ_FAIL(Status::kTimeout, "cpu-nccl rank %d: no progress with peer rank %d for %ld ms "
              "(peer dead or not calling the same collective)", rank, peer, clock.idle_ms());
    }
  }
  abort_on_error.dismiss();
  return Status::kOk;
}

// Split `count` elements into n near-equal segments.
struct Segments {
  size_t base, extra;
  size_t count(size_t k) const { return base + (k < extra ? 1 : 0); }
  size_t offset(size_t k) const { return k * base + std::min(k, extra); }
};

}  // namespace

Status Comm::collective(const CollArgs& a) {
  switch (a.kind) {
    case CollKind::kAllReduce:
    case CollKind::kAllGather:
    case CollKind::kReduceScatter: return ring(a);
    case CollKind::kBroadcast: return chain_broadcast(a);
    case CollKind::kReduce: return chain_reduce(a);
    case CollKind::kAllToAll: {
      const size_t esize = dtype_size(a.dtype);
      const size_t bytes = a.count * esize;
      std::vector<P2pArgs> ops;
      for (int p = 0; p < nranks_; ++p) {
        ops.push_back({true, p, const_cast<char*>(static_cast<const char*>(a.sendbuff)) + p * bytes,
                       bytes});
        ops.push_back({false, p, static_cast<char*>(a.recvbuff) + p * bytes, bytes});
      }
      if (a.sendbuff == a.recvbuff && nranks_ > 1)
        DQ_FAIL(Status::kInvalidArgument, "cpu-nccl: in-place ncclAlltoAll is not supported");
      return point_to_point(ops);
    }
  }
  return Status::kInternal;
}

Status Comm::ring(const CollArgs& a) {
  const size_t esize = dtype_size(a.dtype);
  const int n = nranks_, r = rank_;
  const char* in = static_cast<const char*>(a.sendbuff);
  char* out = static_cast<char*>(a.recvbuff);
  const bool allreduce = a.kind == CollKind::kAllReduce;
  const bool gather_only = a.kind == CollKind::kAllGather;
  // Element layout: segment k of the full vector is reduced / gathered as a unit.
  Segments seg{};
  size_t total_count;
  if (allreduce) {
    total_count = a.count;
    seg = {a.count / n, a.count % n};
  } else {
    total_count = a.count * n;
    seg = {a.count, 0};
  }
  if (total_count == 0) return Status::kOk;
  // Gather: our own block goes into place first. Reduce-scatter / all-reduce with 1 rank: copy.
  if (gather_only) {
    char* mine = out + seg.offset(r) * esize;
    if (mine != in) std::memmove(mine, in, a.count * esize);
    if (n == 1) return Status::kOk;
  } else if (n == 1) {
    if (out != in) std::memmove(out, in, a.count * esize);
    return Status::kOk;
  }
  // Where the running partial sum of segment k lives: the output for all-reduce; for
  // reduce-scatter our own block is the output and the others go to scratch.
  std::vector<char> scratch;
  if (a.kind == CollKind::kReduceScatter) scratch.resize(total_count * esize);
  auto partial = [&](size_t k) -> char* {
    if (allreduce) return out + seg.offset(k) * esize;
    return static_cast<int>(k) == r ? out : scratch.data() + seg.offset(k) * esize;
  };
  auto input = [&](size_t k) -> const char* { return in + seg.offset(k) * esize; };
  auto mod = [n](long x) { return static_cast<size_t>(((x % n) + n) % n); };

  const size_t rs_steps = gather_only ? 0 : static_cast<size_t>(n - 1);
  const size_t ag_steps = a.kind == CollKind::kReduceScatter ? 0 : static_cast<size_t>(n - 1);
  const size_t steps = rs_steps + ag_steps;
  const size_t chunk_elems = std::max<size_t>(1, chunk_bytes_ / esize);
  const size_t chunks = (seg.count(0) + chunk_elems - 1) / chunk_elems;  // seg 0 is largest
  if (chunks == 0) return Status::kOk;
  auto send_seg = [&](size_t g) {
    return g < rs_steps ? mod(r - static_cast<long>(g) - 1) : mod(r - static_cast<long>(g - rs_steps));
  };
  auto recv_seg = [&](size_t g) {
    return g < rs_steps ? mod(r - static_cast<long>(g) - 2)
                        : mod(r - static_cast<long>(g - rs_steps) - 1);
  };
  auto chunk_range = [&](size_t k, size_t c, size_t* first, size_t* len) {
    const size_t cnt = seg.count(k);
    *first = std::min(c * chunk_elems, cnt);
    *len = std::min(cnt, *first + chunk_elems) - *first;
  };
  Pipeline p;
  p.send_peer = (r + 1) % n;
  p.recv_peer = (r + n - 1) % n;
  p.sends = p.recvs = steps * chunks;
  p.slot_bytes = rs_steps ? chunk_elems * esize : 0;
  p.send_span = [&](size_t i) {
    const size_t g = i / chunks, c = i % chunks, k = send_seg(g);
    size_t first, len;
    chunk_range(k, c, &first, &len);
    const char* base = (g == 0 && rs_steps) ? input(k)
                       : g < rs_steps       ? partial(k)
                                            : out + seg.offset(k) * esize;
    return Span{const_cast<char*>(base) + first * esize, len * esize};
  };
  p.send_ready = [&](size_t i, size_t recv_done, const std::vector<uint8_t>&) {
    return i < chunks || recv_done > i - chunks;  // step g needs step g-1's chunk received
  };
  p.recv_span = [&](size_t i) {
    const size_t g = i / chunks, c = i % chunks, k = recv_seg(g);
    size_t first, len;
    chunk_range(k, c, &first, &len);
    if (g < rs_steps) return Span{nullptr, len * esize};  // temp slot, reduced on arrival
    return Span{out + (seg.offset(k) + first) * esize, len * esize};
  };
  p.recv_ready = [&](size_t i, const std::vector<uint8_t>& send_done) {
    const size_t g = i / chunks;
    // All-reduce gathers into memory an early send may still read: wait for that send.
    if (!allreduce || g < rs_steps) return true;
    return send_done[(g - rs_steps) * chunks + i % chunks] != 0;
  };
  p.on_recv = [&](size_t i, const char* landed, size_t bytes) {
    const size_t g = i / chunks, c = i % chunks;
    if (g >= rs_steps || bytes == 0) return;
    const size_t k = recv_seg(g);
    size_t first, len;
    chunk_range(k, c, &first, &len);
    char* dst = partial(k) + first * esize;
    reduce_elements(a.dtype, a.op, landed, input(k) + first * esize, dst, len);
    if (g == rs_steps - 1 && a.op == RedOp::kAvg) finish_average(a.dtype, dst, len, n);
  };
  if (rs_steps) {
    p.send_buffers.push_back({in, total_count * esize});
    if (!scratch.empty()) {
      p.send_buffers.push_back({scratch.data(), scratch.size()});
    }
  }
  const size_t out_bytes = (a.kind == CollKind::kReduceScatter ? a.count : total_count) * esize;
  p.send_buffers.push_back({out, out_bytes});
  p.recv_buffers.push_back({out, out_bytes});
  return run_pipeline(this, net_, send_comms_, recv_comms_, timeout_ms_, p);
}

Status Comm::chain_broadcast(const CollArgs& a) {
  const size_t esize = dtype_size(a.dtype);
  const size_t bytes = a.count * esize;
  const int n = nranks_;
  const int pos = (rank_ - a.root + n) % n;  // 0 = root, n-1 = end of the chain
  const char* in = static_cast<const char*>(a.sendbuff);
  char* out = static_cast<char*>(a.recvbuff);
  if (bytes == 0) return Status::kOk;
  if (pos == 0 && out != in) std::memmove(out, in, bytes);
  if (n == 1) return Status::kOk;
  const size_t chunk = std::max<size_t>(esize, chunk_bytes_ / esize * esize);
  const size_t chunks = (bytes + chunk - 1) / chunk;
  Pipeline p;
  p.send_peer = pos < n - 1 ? (rank_ + 1) % n : -1;
  p.recv_peer = pos > 0 ? (rank_ + n - 1) % n : -1;
  p.sends = pos < n - 1 ? chunks : 0;
  p.recvs = pos > 0 ? chunks : 0;
  auto span = [&](size_t c) {
    size_t first = c * chunk;
    return Span{out + first, std::min(bytes, first + chunk) - first};
  };
  p.send_span = span;
  p.recv_span = span;
  p.send_ready = [&](size_t i, size_t recv_done, const std::vector<uint8_t>&) {
    return pos == 0 || recv_done > i;
  };
  p.send_buffers.push_back({out, bytes});
  p.recv_buffers.push_back({out, bytes});
  return run_pipeline(this, net_, send_comms_, recv_comms_, timeout_ms_, p);
}

Status Comm::chain_reduce(const CollArgs& a) {
  const size_t esize = dtype_size(a.dtype);
  const size_t bytes = a.count * esize;
  const int n = nranks_;
  const int pos = (rank_ - a.root - 1 + 2 * n) % n;  // chain root+1, ..., root (= n-1)
  const char* in = static_cast<const char*>(a.sendbuff);
  char* out = static_cast<char*>(a.recvbuff);
  if (bytes == 0) return Status::kOk;
  if (n == 1) {
    if (out != in) std::memmove(out, in, bytes);
    return Status::kOk;
  }
  const bool is_root = pos == n - 1;
  std::vector<char> scratch;
  char* acc = out;  // where this rank's partial result goes
  if (!is_root && pos > 0) {
    scratch.resize(bytes);
    acc = scratch.data();
  }
  const size_t chunk = std::max<size_t>(esize, chunk_bytes_ / esize * esize);
  const size_t chunks = (bytes + chunk - 1) / chunk;
  auto range = [&](size_t c, size_t* first, size_t* len) {
    *first = c * chunk;
    *len = std::min(bytes, *first + chunk) - *first;
  };
  Pipeline p;
  p.send_peer = is_root ? -1 : (rank_ + 1) % n;
  p.recv_peer = pos == 0 ? -1 : (rank_ + n - 1) % n;
  p.sends = is_root ? 0 : chunks;
  p.recvs = pos == 0 ? 0 : chunks;
  p.slot_bytes = chunk;
  p.send_span = [&](size_t c) {
    size_t first, len;
    range(c, &first, &len);
    const char* base = pos == 0 ? in : acc;
    return Span{const_cast<char*>(base) + first, len};
  };
  p.send_ready = [&](size_t i, size_t recv_done, const std::vector<uint8_t>&) {
    return pos == 0 || recv_done > i;
  };
  p.recv_span = [&](size_t c) {
    size_t first, len;
    range(c, &first, &len);
    return Span{nullptr, len};
  };
  p.on_recv = [&](size_t c, const char* landed, size_t len) {
    size_t first, l;
    range(c, &first, &l);
    reduce_elements(a.dtype, a.op, landed, in + first, acc + first, len / esize);
    if (is_root && a.op == RedOp::kAvg) finish_average(a.dtype, acc + first, len / esize, n);
  };
  p.send_buffers.push_back({pos == 0 ? in : acc, bytes});
  return run_pipeline(this, net_, send_comms_, recv_comms_, timeout_ms_, p);
}

Status Comm::point_to_point(const std::vector<P2pArgs>& ops) {
  // Self messages: the k-th send to self fills the k-th receive from self.
  std::vector<const P2pArgs*> self_sends, self_recvs;
  for (auto& op : ops)
    if (op.peer == rank_) (op.is_send ? self_sends : self_recvs).push_back(&op);
  if (self_sends.size() != self_recvs.size())
    DQ_FAIL(Status::kInvalidArgument, "cpu-nccl rank %d: %zu sends to self but %zu receives",
            rank_, self_sends.size(), self_recvs.size());
  for (size_t i = 0; i < self_sends.size(); ++i) {
    if (self_sends[i]->bytes != self_recvs[i]->bytes)
      DQ_FAIL(Status::kInvalidArgument, "cpu-nccl rank %d: send/recv to self differ in size",
              rank_);
    if (self_sends[i]->bytes && self_sends[i]->buffer != self_recvs[i]->buffer)
      std::memmove(self_recvs[i]->buffer, self_sends[i]->buffer, self_sends[i]->bytes);
  }
  // One ordered stream per (peer, direction); messages are cut into chunks.
  const size_t chunk = chunk_bytes_;
  struct Item {
    char* ptr;
    size_t bytes;
    void* request = nullptr;
    bool posted = false, done = false;
  };
  struct Stream {
    bool is_send;
    int peer;
    void* comm;
    std::vector<Item> items;
    size_t next_post = 0, first_open = 0, inflight = 0, finished = 0;
  };
  std::vector<Stream> streams;
  auto stream_for = [&](bool is_send, int peer) -> Stream& {
    for (auto& s : streams)
      if (s.is_send == is_send && s.peer == peer) return s;
    streams.push_back(Stream{is_send, peer, is_send ? send_comms_[peer] : recv_comms_[peer], {}});
    return streams.back();
  };
  MrSet mrs(net_);
  for (auto& op : ops) {
    if (op.peer == rank_) continue;
    if (op.peer < 0 || op.peer >= nranks_)
      DQ_FAIL(Status::kInvalidArgument, "cpu-nccl rank %d: peer %d out of range", rank_, op.peer);
    Stream& s = stream_for(op.is_send, op.peer);
    if (!s.comm)
      DQ_FAIL(Status::kSystemError, "cpu-nccl rank %d: connection to peer rank %d is closed",
              rank_, op.peer);
    DQ_CHECK(mrs.add(s.comm, op.buffer, op.bytes));
    char* base = static_cast<char*>(op.buffer);
    for (size_t off = 0; off < op.bytes; off += chunk)
      s.items.push_back(Item{base + off, std::min(chunk, op.bytes - off)});
  }
  AbortOnError abort_on_error(this, &mrs);
  IdleClock clock(timeout_ms_);
  for (;;) {
    bool all_done = true, progress = false;
    for (auto& s : streams) {
      while (s.next_post < s.items.size() && s.inflight < kWindow) {
        Item& it = s.items[s.next_post];
        void* mh = mrs.find(s.comm, it.ptr, it.bytes);
        Status st = s.is_send ? net_->isend(s.comm, it.ptr, it.bytes, mh, &it.request)
                              : net_->irecv(s.comm, it.ptr, it.bytes, mh, &it.request);
        if (st != Status::kOk)
          DQ_FAIL(Status::kSystemError, "cpu-nccl rank %d: %s peer rank %d failed", rank_,
                  s.is_send ? "send to" : "receive from", s.peer);
        if (!it.request) break;
        it.posted = true;
        ++s.inflight;
        ++s.next_post;
        progress = true;
      }
      for (size_t i = s.first_open; i < s.next_post; ++i) {
        Item& it = s.items[i];
        if (it.done) continue;
        bool done = false;
        size_t bytes = 0;
        if (net_->test(it.request, &done, &bytes) != Status::kOk)
          DQ_FAIL(Status::kSystemError, "cpu-nccl rank %d: %s peer rank %d failed (connection "
                  "lost?)", rank_, s.is_send ? "send to" : "receive from", s.peer);
        if (!done) continue;
        if (!s.is_send && bytes != it.bytes)
          DQ_FAIL(Status::kMalformedPayload, "cpu-nccl rank %d: peer rank %d sent %zu bytes, "
                  "expected %zu (send/recv counts differ?)", rank_, s.peer, bytes, it.bytes);
        it.done = true;
        --s.inflight;
        ++s.finished;
        progress = true;
      }
      while (s.first_open < s.next_post && s.items[s.first_open].done) ++s.first_open;
      if (s.finished < s.items.size()) all_done = false;
    }
    if (all_done) {
      abort_on_error.dismiss();
      return Status::kOk;
    }
    if (progress) {
      clock.progressed();
    } else if (!clock.idle()) {
      for (auto& s : streams)
        if (s.finished < s.items.size())
          DQ_FAIL(Status::kTimeout, "cpu-nccl rank %d: no progress %s peer rank %d for %ld ms "
                  "(peer dead or not matching this call)", rank_,
                  s.is_send ? "sending to" : "receiving from", s.peer, clock.idle_ms());
      return Status::kTimeout;
    }
  }
}

}  // namespace dq::cpunccl
