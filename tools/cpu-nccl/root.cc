// The bootstrap root of the CPU NCCL: ncclGetUniqueId starts it on a thread of its own. It
// collects every rank's listen handle (one hello per rank), then sends the rank table (a hello
// header and nranks handles, one message) to every rank.
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "tools/cpu-nccl/comm.h"
#include "tools/cpu-nccl/comm_internal.h"

namespace dq::cpunccl {
namespace {

constexpr size_t kRankHelloBytes = kHelloHeaderBytes + kNetHandleBytes;

// What the root learned from the ranks' hellos so far.
struct RankTable {
  int nranks = -1;  // from the first valid hello
  std::vector<NetHandle> handles;
  std::vector<uint8_t> seen;
  int seen_count = 0;
  bool complete() const { return nranks >= 0 && seen_count >= nranks; }
};

// Accepts at most one new connection into *incoming.
Status accept_rank(const RootState& st, std::vector<std::unique_ptr<Incoming>>* incoming,
                   bool* progress) {
  void* rc = nullptr;
  if (const Status s = st.net->accept(st.listen_comm, &rc); s != Status::kOk) return s;
  if (rc) {
    auto in = std::make_unique<Incoming>();
    in->comm = rc;
    in->buffer = std::make_unique<unsigned char[]>(kRankHelloBytes);
    incoming->push_back(std::move(in));
    *progress = true;
  }
  return Status::kOk;
}

// Records one received hello of `bytes` bytes in *table; a malformed, foreign or repeated one
// is ignored with a warning.
void take_rank_hello(const RootState& st, const Incoming& in, size_t bytes, RankTable* table) {
  uint64_t magic, job;
  int32_t kind, rank, n;
  std::memcpy(&magic, in.buffer.get(), 8);
  std::memcpy(&job, in.buffer.get() + 8, 8);
  std::memcpy(&kind, in.buffer.get() + 16, 4);
  std::memcpy(&rank, in.buffer.get() + 20, 4);
  std::memcpy(&n, in.buffer.get() + 24, 4);
  if (bytes != kRankHelloBytes || magic != kHelloMagic || job != st.job || kind != kRankToRoot ||
      n < 1 || rank < 0 || rank >= n || (table->nranks > 0 && n != table->nranks)) {
    DQ_WARN(Subsys::kNet, "cpu-nccl root: rejected a malformed or foreign hello");
    return;
  }
  if (table->nranks < 0) {
    table->nranks = n;
    table->handles.resize(n);
    table->seen.assign(n, 0);
  }
  if (table->seen[rank]) {
    DQ_WARN(Subsys::kNet, "cpu-nccl root: rank %d registered twice; ignoring", rank);
    return;
  }
  table->seen[rank] = 1;
  ++table->seen_count;
  std::memcpy(table->handles[rank].bytes, in.buffer.get() + kHelloHeaderBytes, kNetHandleBytes);
}

// Posts the hello receive on every accepted connection and takes the hellos that arrived.
Status receive_rank_hellos(const RootState& st,
                           const std::vector<std::unique_ptr<Incoming>>& incoming, RankTable* table,
                           bool* progress) {
  for (auto& in : incoming) {
    if (in->done) continue;
    if (!in->request) {
      Status status = st.net->reg(in->comm, in->buffer.get(), kRankHelloBytes, &in->mhandle);
      if (status == Status::kOk)
        status =
            st.net->irecv(in->comm, in->buffer.get(), kRankHelloBytes, in->mhandle, &in->request);
      if (status != Status::kOk) return status;
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
    *progress = true;
    take_rank_hello(st, *in, bytes, table);
  }
  return Status::kOk;
}

// Phase 1: accepts connections until every rank's hello arrived; kTimeout when none
// progressed for the whole timeout.
Status gather_rank_hellos(const RootState& st, IdleClock& clock,
                          std::vector<std::unique_ptr<Incoming>>* incoming, RankTable* table) {
  while (!table->complete()) {
    bool progress = false;
    if (const Status s = accept_rank(st, incoming, &progress); s != Status::kOk) return s;
    if (const Status s = receive_rank_hellos(st, *incoming, table, &progress); s != Status::kOk)
      return s;
    if (progress) {
      clock.progressed();
    } else if (!clock.idle()) {
      if (table->nranks < 0)
        DQ_WARN(Subsys::kNet, "cpu-nccl root: no rank used this unique id within %d ms",
                st.timeout_ms);
      else
        DQ_WARN(Subsys::kNet, "cpu-nccl root: only %d of %d ranks arrived within %d ms",
                table->seen_count, table->nranks, st.timeout_ms);
      return Status::kTimeout;
    }
  }
  return Status::kOk;
}

// The rank table message: a hello header (kind kRootToRank, nranks) then every rank's handle.
std::vector<unsigned char> encode_rank_table(const RootState& st, const RankTable& table) {
  const int nranks = table.nranks;
  std::vector<unsigned char> message(kHelloHeaderBytes +
                                     kNetHandleBytes * static_cast<size_t>(nranks));
  uint64_t magic = kHelloMagic;
  int32_t kind = kRootToRank, zero = 0;
  std::memcpy(message.data(), &magic, 8);
  std::memcpy(message.data() + 8, &st.job, 8);
  std::memcpy(message.data() + 16, &kind, 4);
  std::memcpy(message.data() + 20, &zero, 4);
  std::memcpy(message.data() + 24, &nranks, 4);
  std::memcpy(message.data() + 28, &zero, 4);
  for (int r = 0; r < nranks; ++r)
    std::memcpy(message.data() + kHelloHeaderBytes + kNetHandleBytes * r, table.handles[r].bytes,
                kNetHandleBytes);
  return message;
}

// The rank table's delivery to every rank: one connection, registration and send each.
struct TableDelivery {
  explicit TableDelivery(int nranks)
      : send_comms(nranks, nullptr),
        requests(nranks, nullptr),
        mhandles(nranks, nullptr),
        finished(nranks, 0) {}
  std::vector<void*> send_comms, requests, mhandles;
  std::vector<uint8_t> finished;
  int finished_count = 0;
};

// One round over the ranks not served yet: connects, posts the send, tests it.
Status push_rank_table(const RootState& st, std::vector<unsigned char>& message,
                       std::vector<NetHandle>& handles, TableDelivery* d, bool* progress) {
  Status status = Status::kOk;
  const int nranks = static_cast<int>(d->finished.size());
  for (int r = 0; r < nranks && status == Status::kOk; ++r) {
    if (d->finished[r]) continue;
    if (!d->send_comms[r]) {
      status = st.net->connect(st.ctx, &handles[r], &d->send_comms[r]);
      if (status != Status::kOk || !d->send_comms[r]) continue;
      status = st.net->reg(d->send_comms[r], message.data(), message.size(), &d->mhandles[r]);
      *progress = true;
    }
    if (status != Status::kOk) break;
    if (!d->requests[r]) {
      status = st.net->isend(d->send_comms[r], message.data(), message.size(), d->mhandles[r],
                             &d->requests[r]);
      if (status != Status::kOk || !d->requests[r]) continue;
      *progress = true;
    }
    bool done = false;
    status = st.net->test(d->requests[r], &done, nullptr);
    if (status == Status::kOk && done) {
      d->finished[r] = 1;
      ++d->finished_count;
      *progress = true;
    }
  }
  return status;
}

// Phase 2: sends the rank table to every rank, then closes those connections.
Status send_rank_table(const RootState& st, IdleClock& clock, RankTable& table) {
  const int nranks = table.nranks;
  std::vector<unsigned char> message = encode_rank_table(st, table);
  TableDelivery delivery(nranks);
  Status status = Status::kOk;
  clock.progressed();
  while (status == Status::kOk && delivery.finished_count < nranks) {
    bool progress = false;
    status = push_rank_table(st, message, table.handles, &delivery, &progress);
    if (status != Status::kOk) {
      DQ_WARN(Subsys::kNet, "cpu-nccl root: sending the rank table failed");
      break;
    }
    if (progress) {
      clock.progressed();
    } else if (!clock.idle()) {
      DQ_WARN(Subsys::kNet, "cpu-nccl root: %d of %d ranks did not take the rank table",
              nranks - delivery.finished_count, nranks);
      status = Status::kTimeout;
    }
  }
  for (int r = 0; r < nranks; ++r) {
    if (delivery.send_comms[r]) {
      st.net->dereg(delivery.send_comms[r], delivery.mhandles[r]);
      st.net->close_send(delivery.send_comms[r]);
    }
  }
  return status;
}

}  // namespace

Status root_serve(const RootState& st) {
  IdleClock clock(st.timeout_ms);
  std::vector<std::unique_ptr<Incoming>> incoming;
  RankTable table;
  Status status = gather_rank_hellos(st, clock, &incoming, &table);
  if (status == Status::kOk) status = send_rank_table(st, clock, table);
  for (auto& in : incoming) {
    st.net->dereg(in->comm, in->mhandle);
    st.net->close_recv(in->comm);
  }
  st.net->close_listen(st.listen_comm);
  st.net->finalize(st.ctx);
  return status;
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

}  // namespace dq::cpunccl
