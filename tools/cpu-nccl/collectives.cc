// Data movement of the CPU NCCL communicator: a pipelined exchange with one send and one
// receive peer (run_pipeline) under the ring and chain collectives, and grouped point-to-point.
#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "tools/cpu-nccl/comm.h"
#include "tools/cpu-nccl/comm_internal.h"

namespace dq::cpunccl {
namespace {

constexpr int kWindow = 4;  // messages in flight per direction (pipeline depth)

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
  std::function<bool(size_t i, size_t recv_done, const std::vector<uint8_t>& send_done)> send_ready;
  std::function<Span(size_t)> recv_span;
  std::function<bool(size_t i, const std::vector<uint8_t>& send_done)> recv_ready;
  std::function<void(size_t i, const char* landed, size_t bytes)> on_recv;
  std::vector<std::pair<const void*, size_t>> send_buffers;  // to register on the send comm
  std::vector<std::pair<const void*, size_t>> recv_buffers;  // to register on the recv comm
};

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
    if (comm->revoked())
      DQ_FAIL(Status::kUnsupported, "cpu-nccl rank %d: communicator revoked mid-operation", rank);
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
          DQ_FAIL(Status::kSystemError, "cpu-nccl rank %d: receive from peer rank %d failed", rank,
                  p.recv_peer);
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
        DQ_FAIL(Status::kSystemError,
                "cpu-nccl rank %d: send to peer rank %d failed "
                "(connection lost?)",
                rank, p.send_peer);
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
          DQ_FAIL(ts,
                  "cpu-nccl rank %d: receive from peer rank %d failed "
                  "(connection lost?)",
                  rank, p.recv_peer);
        if (!done) break;
        if (bytes != recv_at[i].bytes)
          DQ_FAIL(Status::kMalformedPayload,
                  "cpu-nccl rank %d: peer rank %d sent %zu bytes, "
                  "expected %zu (mismatched calls?)",
                  rank, p.recv_peer, bytes, recv_at[i].bytes);
      }
      if (p.on_recv) p.on_recv(i, recv_at[i].ptr, recv_at[i].bytes);
      ++recv_processed;
      progress = true;
    }
    if (progress) {
      clock.progressed();
    } else if (!clock.idle()) {
      const int peer = recv_processed < p.recvs ? p.recv_peer : p.send_peer;
      DQ_FAIL(Status::kTimeout,
              "cpu-nccl rank %d: no progress with peer rank %d for %ld ms "
              "(peer dead or not calling the same collective)",
              rank, peer, clock.idle_ms());
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
    case CollKind::kReduceScatter:
      return ring(a);
    case CollKind::kBroadcast:
      return chain_broadcast(a);
    case CollKind::kReduce:
      return chain_reduce(a);
    case CollKind::kAllToAll: {
      const size_t esize = dtype_size(a.dtype);
      const size_t bytes = a.count * esize;
      std::vector<P2pArgs> ops;
      for (int p = 0; p < nranks_; ++p) {
        ops.push_back(
            {true, p, const_cast<char*>(static_cast<const char*>(a.sendbuff)) + p * bytes, bytes});
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
  // With 2 ranks no other block is ever partial (step 0 sends the input, the one receive lands
  // in our block): no scratch. Never zeroed: every byte read was written by an earlier step.
  std::unique_ptr<char[]> scratch;
  const size_t scratch_bytes =
      a.kind == CollKind::kReduceScatter && n > 2 ? total_count * esize : 0;
  if (scratch_bytes > 0) scratch.reset(new char[scratch_bytes]);
  auto partial = [&](size_t k) -> char* {
    if (allreduce) return out + seg.offset(k) * esize;
    return static_cast<int>(k) == r ? out : scratch.get() + seg.offset(k) * esize;
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
    return g < rs_steps ? mod(r - static_cast<long>(g) - 1)
                        : mod(r - static_cast<long>(g - rs_steps));
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
    if (scratch_bytes > 0) p.send_buffers.push_back({scratch.get(), scratch_bytes});
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
    DQ_FAIL(Status::kInvalidArgument, "cpu-nccl rank %d: %zu sends to self but %zu receives", rank_,
            self_sends.size(), self_recvs.size());
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
      DQ_FAIL(Status::kSystemError, "cpu-nccl rank %d: connection to peer rank %d is closed", rank_,
              op.peer);
    DQ_CHECK(mrs.add(s.comm, op.buffer, op.bytes));
    char* base = static_cast<char*>(op.buffer);
    for (size_t off = 0; off < op.bytes; off += chunk)
      s.items.push_back(Item{base + off, std::min(chunk, op.bytes - off)});
  }
  AbortOnError abort_on_error(this, &mrs);
  IdleClock clock(timeout_ms_);
  for (;;) {
    if (revoked())
      DQ_FAIL(Status::kUnsupported, "cpu-nccl rank %d: communicator revoked mid-operation", rank_);
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
          DQ_FAIL(Status::kSystemError,
                  "cpu-nccl rank %d: %s peer rank %d failed (connection "
                  "lost?)",
                  rank_, s.is_send ? "send to" : "receive from", s.peer);
        if (!done) continue;
        if (!s.is_send && bytes != it.bytes)
          DQ_FAIL(Status::kMalformedPayload,
                  "cpu-nccl rank %d: peer rank %d sent %zu bytes, "
                  "expected %zu (send/recv counts differ?)",
                  rank_, s.peer, bytes, it.bytes);
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
          DQ_FAIL(Status::kTimeout,
                  "cpu-nccl rank %d: no progress %s peer rank %d for %ld ms "
                  "(peer dead or not matching this call)",
                  rank_, s.is_send ? "sending to" : "receiving from", s.peer, clock.idle_ms());
      return Status::kTimeout;
    }
  }
}

}  // namespace dq::cpunccl
