// The CPU NCCL communicator object: its lifetime, failure state and plugin set-up, and the
// blocking plugin helpers the bootstrap uses. Bootstrap: root.cc and mesh.cc; data movement:
// collectives.cc.
#include "tools/cpu-nccl/comm.h"

#include <algorithm>
#include <string>

#include "config/settings.h"
#include "tools/cpu-nccl/comm_internal.h"

namespace dq::cpunccl {

int timeout_ms_from_env() {
  // DYNAMIQ_CPU_NCCL_TIMEOUT_MS, else DYNAMIQ_TIMEOUT_MS (config/settings.def).
  return static_cast<int>(config::current().cpu_nccl_timeout_ms);
}

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

Comm::~Comm() {
  abort_connections();
  listener_.reset();  // closed here unless a communicator shrunk from this one still uses it
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

constexpr size_t kMaxParked = 4096;  // connections of each kind; more are stray and closed

Comm::Listener::~Listener() {
  for (const Parked& p : parked_) net->close_recv(p.comm);
  for (const std::unique_ptr<Incoming>& in : unread_) {
    net->dereg(in->comm, in->mhandle);
    net->close_recv(in->comm);
  }
  if (comm) net->close_listen(comm);
}

bool Comm::Listener::park(const Parked& p) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (parked_.size() >= kMaxParked) return false;
  parked_.push_back(p);
  return true;
}

std::vector<Comm::Listener::Parked> Comm::Listener::claim(uint64_t comm_tag) {
  std::vector<Parked> mine;
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < parked_.size();) {
    if (parked_[i].comm_tag == comm_tag) {
      mine.push_back(parked_[i]);
      parked_[i] = parked_.back();
      parked_.pop_back();
    } else {
      ++i;
    }
  }
  return mine;
}

bool Comm::Listener::leave_unread(std::unique_ptr<Incoming>& in) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (unread_.size() >= kMaxParked) return false;
  unread_.push_back(std::move(in));
  return true;
}

std::vector<std::unique_ptr<Incoming>> Comm::Listener::adopt_unread() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::unique_ptr<Incoming>> all;
  all.swap(unread_);
  return all;
}

Status Comm::open_listener(uint64_t net_comm_id, NetHandle* handle) {
  auto listener = std::make_shared<Listener>();
  listener->net = net_;
  listener->net_comm_id = net_comm_id;
  DQ_CHECK(net_->listen(ctx_, handle, &listener->comm));
  listener_ = std::move(listener);
  return Status::kOk;
}

Status Comm::init_plugin(uint64_t comm_tag) {
  comm_tag_ = comm_tag;
  const config::Settings settings = config::current();  // DYNAMIQ_CPU_NCCL_*
  timeout_ms_ = static_cast<int>(settings.cpu_nccl_timeout_ms);
  chunk_bytes_ = static_cast<size_t>(settings.cpu_nccl_chunk_bytes);
  DQ_CHECK(Net::get(&net_));
  DQ_CHECK(net_->init(comm_tag, &ctx_));
  chunk_bytes_ = std::min(chunk_bytes_, net_->max_message_bytes());  // known once init asked
  send_comms_.assign(nranks_, nullptr);
  recv_comms_.assign(nranks_, nullptr);
  return Status::kOk;
}

}  // namespace dq::cpunccl
