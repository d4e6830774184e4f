// Bootstrap of a CPU NCCL communicator's full mesh: ncclCommInitRank (init: handles from the
// bootstrap root, root.cc) and ncclCommSplit (split: handles gathered over the parent comm).
// Every rank keeps one send and one receive plugin connection per peer.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tools/cpu-nccl/comm.h"
#include "tools/cpu-nccl/comm_internal.h"

namespace dq::cpunccl {

// The first message on every connection: a rank's hello to the root (kind kRankToRoot, with
// its listen handle) or to a peer (kPeer); the root's rank table starts with the same header.
struct Comm::Hello {
  uint64_t magic;
  uint64_t comm_tag;
  int32_t kind;
  int32_t rank;
  int32_t nranks;
  int32_t reserved;
  NetHandle handle;  // kRankToRoot: the sender's listen handle
};

Status Comm::init(const unsigned char id[kUniqueIdBytes]) {
  uint64_t magic, job;
  std::memcpy(&magic, id, 8);
  std::memcpy(&job, id + 8, 8);
  if (magic != kIdMagic)
    DQ_FAIL(Status::kInvalidArgument,
            "cpu-nccl: ncclUniqueId was not made by ncclGetUniqueId "
            "of this library");
  DQ_CHECK(init_plugin(job));
  NetHandle my_handle;
  DQ_CHECK(open_listener(job, &my_handle));
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
  static_assert(sizeof(Hello) == kHelloHeaderBytes + kNetHandleBytes);
  Status s = send_blocking(net_, root_send, &hello, sizeof hello, timeout_ms_,
                           "sending this rank's address to the bootstrap root");
  if (s == Status::kOk) {
    s = build_mesh(&peer_handles_, /*handles_from_root=*/true);
  }
  net_->close_send(root_send);
  if (s != Status::kOk) DQ_FAIL(s, "cpu-nccl rank %d of %d: bootstrap failed", rank_, nranks_);
  DQ_INFO(Subsys::kNet, "cpu-nccl rank %d of %d: connected to every peer (job %016llx)", rank_,
          nranks_, static_cast<unsigned long long>(job));
  return Status::kOk;
}

// One mesh build (Comm::build_mesh): the accepted connections whose one message (a peer's
// hello, or the root's rank table) is awaited, and the hello this rank sends to every peer.
// Lives on build_mesh's stack: `out` stays registered with the plugin while sends are posted.
struct Comm::MeshBuilder {
  MeshBuilder(Comm& comm, std::vector<NetHandle>* handles, bool handles_from_root)
      : c(comm),
        handles(handles),
        handles_from_root(handles_from_root),
        table_bytes(kHelloHeaderBytes + kNetHandleBytes * static_cast<size_t>(comm.nranks_)),
        have_table(!handles_from_root),
        hello_req(comm.nranks_, nullptr),
        hello_mh(comm.nranks_, nullptr),
        hello_sent(comm.nranks_, 0) {
    out.magic = kHelloMagic;
    out.comm_tag = comm.comm_tag_;
    out.kind = kPeer;
    out.rank = comm.rank_;
    out.nranks = comm.nranks_;
  }
  MeshBuilder(const MeshBuilder&) = delete;
  MeshBuilder& operator=(const MeshBuilder&) = delete;

  bool finished() const {
    return have_table && accepted_peers == c.nranks_ - 1 && connected_peers == c.nranks_ - 1;
  }

  // Accepts at most one new connection.
  Status accept_connection(bool* progress) {
    void* rc = nullptr;
    if (const Status s = c.net_->accept(c.listener_->comm, &rc); s != Status::kOk) return s;
    if (rc) {
      auto in = std::make_unique<Incoming>();
      in->comm = rc;
      in->buffer = std::make_unique<unsigned char[]>(std::max(sizeof(Hello), table_bytes));
      incoming.push_back(std::move(in));
      *progress = true;
    }
    return Status::kOk;
  }

  // Closes an accepted connection the mesh does not keep.
  void drop(Incoming& in) {
    c.net_->dereg(in.comm, in.mhandle);
    c.net_->close_recv(in.comm);
    in.comm = nullptr;
  }

  // Posts the receive on every accepted connection and takes the messages that arrived: the
  // root sends one message (header + table); peers send one Hello.
  Status receive_messages(bool* progress) {
    for (auto& in : incoming) {
      if (in->done || !in->comm) continue;
      if (!in->request) {
        size_t cap = handles_from_root ? std::max(sizeof(Hello), table_bytes) : sizeof(Hello);
        if (!in->mhandle) {
          const Status s = c.net_->reg(in->comm, in->buffer.get(), cap, &in->mhandle);
          if (s != Status::kOk) return s;
        }
        const Status s = c.net_->irecv(in->comm, in->buffer.get(), cap, in->mhandle, &in->request);
        if (s != Status::kOk) return s;
        if (!in->request) continue;
      }
      bool done = false;
      size_t bytes = 0;
      if (c.net_->test(in->request, &done, &bytes) != Status::kOk) {
        DQ_WARN(Subsys::kNet,
                "cpu-nccl rank %d: an incoming connection failed during "
                "bootstrap; ignoring it",
                c.rank_);
        drop(*in);
        in->done = true;
        continue;
      }
      if (!done) continue;
      in->done = true;
      *progress = true;
      take_message(*in, bytes);
    }
    return Status::kOk;
  }

  // One arrived message of `bytes` bytes: the rank table (kept in *handles), a peer's hello
  // (its connection becomes recv_comms_[peer]), or something else (dropped with a warning).
  void take_message(Incoming& in, size_t bytes) {
    Hello h{};
    std::memcpy(&h, in.buffer.get(), std::min(bytes, sizeof h));
    bool valid = bytes >= kHelloHeaderBytes && h.magic == kHelloMagic && h.comm_tag == c.comm_tag_;
    if (valid && h.kind == kRootToRank && handles_from_root && !have_table &&
        h.nranks == c.nranks_ && bytes == table_bytes) {
      handles->resize(c.nranks_);
      for (int r = 0; r < c.nranks_; ++r)
        std::memcpy((*handles)[r].bytes, in.buffer.get() + kHelloHeaderBytes + kNetHandleBytes * r,
                    kNetHandleBytes);
      have_table = true;
      drop(in);
      return;
    }
    if (valid && h.kind == kPeer && bytes == sizeof(Hello) &&
        take_peer(in.comm, h.rank, h.nranks)) {
      c.net_->dereg(in.comm, in.mhandle);
      in.comm = nullptr;  // owned by recv_comms_ now
      return;
    }
    if (bytes == sizeof(Hello) && h.magic == kHelloMagic && h.kind == kPeer &&
        h.comm_tag != c.comm_tag_) {
      // A peer's hello for another communicator on this listener, which communicators made by
      // ncclCommShrink share: a survivor that finished its own set-up earlier may already be
      // building the shrunk mesh while this rank still builds the parent's. Kept for that build.
      c.net_->dereg(in.comm, in.mhandle);
      if (c.listener_->park(Listener::Parked{in.comm, h.comm_tag, h.rank, h.nranks})) {
        in.comm = nullptr;
        return;
      }
      in.mhandle = nullptr;
    }
    DQ_WARN(Subsys::kNet,
            "cpu-nccl rank %d: rejected an unexpected connection during "
            "bootstrap (kind %d, rank %d)",
            c.rank_, h.kind, h.rank);
    drop(in);
  }

  // Keeps `comm` as the receive connection from `rank` when it is a peer this mesh still waits
  // for; false otherwise.
  bool take_peer(void* comm, int rank, int nranks) {
    if (nranks != c.nranks_ || rank < 0 || rank >= c.nranks_ || rank == c.rank_ ||
        c.recv_comms_[rank])
      return false;
    c.recv_comms_[rank] = comm;
    ++accepted_peers;
    return true;
  }

  // Takes the hellos for this mesh that another build on the shared listener kept for it.
  void claim_parked(bool* progress) {
    for (const Listener::Parked& p : c.listener_->claim(c.comm_tag_)) {
      *progress = true;
      if (take_peer(p.comm, p.rank, p.nranks)) continue;
      DQ_WARN(Subsys::kNet,
              "cpu-nccl rank %d: rejected an unexpected connection during bootstrap (rank %d of "
              "%d, kept by an earlier build)",
              c.rank_, p.rank, p.nranks);
      c.net_->close_recv(p.comm);
    }
  }

  // One round over the peers not greeted yet: connects, posts this rank's hello, tests it.
  Status send_hellos(bool* progress) {
    Status status = Status::kOk;
    for (int p = 0; p < c.nranks_ && status == Status::kOk; ++p) {
      if (p == c.rank_ || hello_sent[p]) continue;
      if (!c.send_comms_[p]) {
        status = c.net_->connect(c.ctx_, &(*handles)[p], &c.send_comms_[p]);
        if (status != Status::kOk || !c.send_comms_[p]) continue;
        status = c.net_->reg(c.send_comms_[p], &out, sizeof out, &hello_mh[p]);
        *progress = true;
        if (status != Status::kOk) break;
      }
      if (!hello_req[p]) {
        status = c.net_->isend(c.send_comms_[p], &out, sizeof out, hello_mh[p], &hello_req[p]);
        if (status != Status::kOk || !hello_req[p]) continue;
        *progress = true;
      }
      bool done = false;
      status = c.net_->test(hello_req[p], &done, nullptr);
      if (status == Status::kOk && done) {
        hello_sent[p] = 1;
        c.net_->dereg(c.send_comms_[p], hello_mh[p]);
        hello_mh[p] = nullptr;
        ++connected_peers;
        *progress = true;
      }
    }
    return status;
  }

  void warn_timeout() const {
    std::string missing;
    for (int p = 0; p < c.nranks_; ++p)
      if (p != c.rank_ && (!c.recv_comms_[p] || !hello_sent[p])) {
        if (!missing.empty()) missing.push_back(',');
        missing.append(std::to_string(p));
      }
    DQ_WARN(Subsys::kNet,
            "cpu-nccl rank %d: bootstrap timed out after %d ms: %s; peers "
            "not connected: %s",
            c.rank_, c.timeout_ms_, have_table ? "mesh incomplete" : "no rank table from the root",
            missing.c_str());
  }

  // Closes the connections not kept and releases the hellos' registrations.
  void close_leftovers() {
    for (auto& in : incoming) {
      if (!in->comm) continue;
      // Accepted, its hello not arrived: it may be a survivor's for a shrunk mesh that is built
      // on this listener next.
      if (!in->done && c.listener_->leave_unread(in)) continue;
      drop(*in);
    }
    for (int p = 0; p < c.nranks_; ++p)
      if (hello_mh[p] && c.send_comms_[p]) c.net_->dereg(c.send_comms_[p], hello_mh[p]);
  }

  Comm& c;
  std::vector<NetHandle>* const handles;
  const bool handles_from_root;
  const size_t table_bytes;  // the root's message: hello header + nranks handles
  std::vector<std::unique_ptr<Incoming>> incoming;
  bool have_table;
  int accepted_peers = 0, connected_peers = 0;
  std::vector<void*> hello_req, hello_mh;  // by peer rank
  std::vector<uint8_t> hello_sent;
  Hello out{};
};

Status Comm::build_mesh(std::vector<NetHandle>* handles, bool handles_from_root) {
  MeshBuilder mesh(*this, handles, handles_from_root);
  IdleClock clock(timeout_ms_);
  Status status = Status::kOk;
  mesh.incoming = listener_->adopt_unread();
  while (!mesh.finished()) {
    bool progress = false;
    mesh.claim_parked(&progress);
    status = mesh.accept_connection(&progress);
    if (status == Status::kOk) status = mesh.receive_messages(&progress);
    if (status == Status::kOk && mesh.have_table) status = mesh.send_hellos(&progress);
    if (status != Status::kOk) break;
    if (progress) {
      clock.progressed();
    } else if (!clock.idle()) {
      mesh.warn_timeout();
      status = Status::kTimeout;
      break;
    }
  }
  mesh.close_leftovers();
  return status;
}

Status Comm::split(Comm* parent, int color, int key, const std::string& name, Comm** child) {
  *child = nullptr;
  const uint64_t tag = mix(parent->comm_tag_ ^ mix(++parent->split_count_));
  const uint64_t child_tag = mix(tag ^ static_cast<uint64_t>(color));  // also its plugin comm id
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
    local = fresh->net_->init(child_tag, &fresh->ctx_);
    if (local == Status::kOk) local = fresh->open_listener(child_tag, &my_handle);
    if (local != Status::kOk) mine.color = -2;  // tells the others this rank cannot join
    mine.handle = my_handle;
  }
  CollArgs gather{CollKind::kAllGather, &mine, table.data(), sizeof(Entry), DType::kUint8,
                  RedOp::kSum,          0};
  DQ_CHECK(parent->collective(gather));
  if (local != Status::kOk) DQ_FAIL(local, "cpu-nccl: ncclCommSplit: cannot listen");
  if (color < 0) return Status::kOk;
  std::vector<int> members;
  for (int r = 0; r < parent->nranks_; ++r) {
    if (table[r].color == -2 && color >= 0)
      DQ_FAIL(Status::kSystemError, "cpu-nccl: ncclCommSplit: parent rank %d failed to listen", r);
    if (table[r].color == color) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return table[a].key < table[b].key; });
  const int new_rank =
      static_cast<int>(std::find(members.begin(), members.end(), parent->rank_) - members.begin());
  auto made = std::make_unique<Comm>(new_rank, static_cast<int>(members.size()));
  made->net_ = fresh->net_;
  made->ctx_ = fresh->ctx_;
  made->listener_ = std::move(fresh->listener_);
  fresh->ctx_ = nullptr;
  std::vector<NetHandle> handles(made->nranks_);
  for (int i = 0; i < made->nranks_; ++i) handles[i] = table[members[i]].handle;
  DQ_CHECK(made->join_child_mesh(*parent, child_tag, name, std::move(handles)));
  *child = made.release();
  return Status::kOk;
}

Status Comm::join_child_mesh(const Comm& parent, uint64_t comm_tag, const std::string& name,
                             std::vector<NetHandle> handles) {
  comm_tag_ = comm_tag;
  timeout_ms_ = parent.timeout_ms_;
  chunk_bytes_ = parent.chunk_bytes_;
  name_ = name;
  blocking_ = parent.blocking_;
  send_comms_.assign(nranks_, nullptr);
  recv_comms_.assign(nranks_, nullptr);
  peer_handles_ = std::move(handles);
  return build_mesh(&peer_handles_, /*handles_from_root=*/false);
}

Status Comm::shrink(Comm* parent, const std::vector<int>& excluded, bool abort_parent,
                    const std::string& name, Comm** child) {
  *child = nullptr;
  std::vector<uint8_t> out(parent->nranks_, 0);
  for (int r : excluded) {
    if (r < 0 || r >= parent->nranks_)
      DQ_FAIL(Status::kInvalidArgument, "cpu-nccl: ncclCommShrink: excluded rank %d of %d", r,
              parent->nranks_);
    if (r == parent->rank_)
      DQ_FAIL(Status::kInvalidArgument,
              "cpu-nccl: ncclCommShrink: rank %d is in the exclude list (excluded ranks must "
              "not call it)",
              r);
    out[r] = 1;
  }
  if (!parent->listener_ || static_cast<int>(parent->peer_handles_.size()) != parent->nranks_)
    DQ_FAIL(Status::kUnsupported, "cpu-nccl: ncclCommShrink: the parent has no listener");
  if (abort_parent) parent->revoke();  // once the arguments are known good
  std::vector<int> members;
  uint64_t tag = mix(parent->comm_tag_ ^ mix(0x5348524e4bull + ++parent->shrink_count_));
  for (int r = 0; r < parent->nranks_; ++r) {
    if (out[r]) {
      tag = mix(tag ^ static_cast<uint64_t>(r));  // the set left out names the child
    } else {
      members.push_back(r);
    }
  }
  const int new_rank =
      static_cast<int>(std::find(members.begin(), members.end(), parent->rank_) - members.begin());
  auto made = std::make_unique<Comm>(new_rank, static_cast<int>(members.size()));
  made->net_ = parent->net_;
  // Connections to the shared listener must come from a context with its plugin comm id.
  DQ_CHECK(made->net_->init(parent->listener_->net_comm_id, &made->ctx_));
  made->listener_ = parent->listener_;
  std::vector<NetHandle> handles(made->nranks_);
  for (int i = 0; i < made->nranks_; ++i) handles[i] = parent->peer_handles_[members[i]];
  DQ_CHECK(made->join_child_mesh(*parent, tag, name, std::move(handles)));
  *child = made.release();
  return Status::kOk;
}

}  // namespace dq::cpunccl
