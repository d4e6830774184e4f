// Connection setup of the ibverbs backend: the queue pairs of a connection (INIT, RTR, RTS
// towards the peer's), and the handshake over a side channel of the socket backend that carries
// them: the connector sends kConnect (its QPs and FIFO address, and a listen handle to answer
// on), the listener connects back and answers kAccept (its QPs and size record array). kBye on
// the same channel closes a connection in order.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "plugin/ibverbs/ib_internal.h"
#include "plugin/socket/socket_io.h"

namespace dq::net::ib {
namespace {

// Connects in progress of this backend (net_backend_common.h).
PendingConnects& pending_connects() {
  static auto* registry = new PendingConnects;  // never destroyed: see PendingConnects
  return *registry;
}

// Sends `c` on a socket send comm; *req carries the progress across calls.
Status send_ctl(void* comm, Ctl* c, void** req, bool* done) {
  *done = false;
  if (*req == nullptr) {
    DQ_CHECK(socket_backend().isend(comm, c, sizeof(*c), kSideTag, nullptr, req));
    if (*req == nullptr) return Status::kOk;
  }
  int d = 0;
  DQ_CHECK(socket_backend().test(*req, &d, nullptr));
  if (d) *req = nullptr;
  *done = d != 0;
  return Status::kOk;
}

Status recv_ctl(void* comm, Ctl* c, void** req, bool* done) {
  *done = false;
  if (*req == nullptr) {
    void* data = c;
    size_t size = sizeof(*c);
    int tag = kSideTag;
    DQ_CHECK(socket_backend().irecv(comm, 1, &data, &size, &tag, nullptr, req));
    if (*req == nullptr) return Status::kOk;
  }
  int d = 0;
  int got = 0;
  DQ_CHECK(socket_backend().test(*req, &d, &got));
  if (!d) return Status::kOk;
  *req = nullptr;
  if (got != static_cast<int>(sizeof(*c))) {
    NET_WARN("control message of %d bytes, expected %zu", got, sizeof(*c));
    return Status::kMalformedPayload;
  }
  *done = true;
  return Status::kOk;
}

}  // namespace

void Conn::poll_side() {  // mu held
  if (bye_req == nullptr || failed) return;
  int done = 0;
  Status st = socket_backend().test(bye_req, &done, nullptr);
  if (st != Status::kOk) {
    bye_req = nullptr;
    fail("the side channel failed (peer died or closed without notice)");
    return;
  }
  if (!done) return;
  bye_req = nullptr;
  const char* bad = ibwire::check_ctl(bye, ibwire::kBye);
  if (bad != nullptr) {
    fail(Status::kMalformedPayload, std::string("malformed control message: ") + bad);
    return;
  }
  peer_closed = true;
}

Status Conn::post_side_recv() {
  void* data = &bye;
  size_t size = sizeof(bye);
  int tag = kSideTag;
  DQ_CHECK(socket_backend().irecv(side_recv, 1, &data, &size, &tag, nullptr, &bye_req));
  if (bye_req == nullptr) return Status::kInternal;
  return Status::kOk;
}

Status Conn::make_qps(uint32_t nqps, int remote_access) {
  cq = verbs().create_cq(dev->ctx, kCqDepthPerQp * static_cast<int>(nqps), nullptr, nullptr, 0);
  if (cq == nullptr) {
    NET_WARN("ibv_create_cq on %s failed: %s", dev->name.c_str(), std::strerror(errno));
    return Status::kSystemError;
  }
  for (uint32_t i = 0; i < nqps; ++i) {
    ibv_qp_init_attr ia{};
    ia.send_cq = cq;
    ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = kSqDepth;
    ia.cap.max_recv_wr = kRqDepth;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    ibv_qp* q = verbs().create_qp(dev->pd, &ia);
    if (q == nullptr) {
      NET_WARN("ibv_create_qp on %s failed: %s", dev->name.c_str(), std::strerror(errno));
      return Status::kSystemError;
    }
    qps.push_back(q);
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = static_cast<uint8_t>(dev->port);
    a.qp_access_flags = static_cast<unsigned>(remote_access);
    if (verbs().modify_qp(
            q, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) {
      NET_WARN("QP to INIT on %s failed: %s", dev->name.c_str(), std::strerror(errno));
      return Status::kSystemError;
    }
    psns.push_back(static_cast<uint32_t>(random_u64() & 0xffffff));
  }
  qp = qps[0];
  return Status::kOk;
}

void Conn::fill_ctl(Ctl* c, uint16_t kind) const {
  std::memset(c, 0, sizeof(*c));
  c->magic = ibwire::kCtlMagic;
  c->version = ibwire::kVersion;
  c->kind = kind;
  c->nqps = static_cast<uint32_t>(qps.size());
  for (size_t i = 0; i < qps.size(); ++i) {
    c->qpn[i] = qps[i]->qp_num;
    c->psn[i] = psns[i];
  }
  std::memcpy(c->gid, dev->gid.raw, 16);
  c->lid = dev->lid;
  c->link_layer = dev->link_layer;
  c->mtu = static_cast<uint8_t>(dev->mtu);
  c->fifo_depth = kFifoDepth;
  c->max_recvs = kMaxGroupedRecvs;
}

Status Conn::connect(const Ctl& c, int traffic_class) {
  if (c.link_layer != dev->link_layer) {
    NET_WARN("peer %s uses link layer %u, this port %u", peer.c_str(), c.link_layer,
             dev->link_layer);
    return Status::kInvalidArgument;
  }
  if (c.nqps != qps.size()) {
    NET_WARN("peer %s has %u queue pairs for this connection, this end %zu", peer.c_str(), c.nqps,
             qps.size());
    return Status::kMalformedPayload;
  }
  for (size_t i = 0; i < qps.size(); ++i) DQ_CHECK(connect_qp(i, c, traffic_class));
  return Status::kOk;
}

Status Conn::connect_qp(size_t i, const Ctl& c, int traffic_class) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(std::min<int>(c.mtu, dev->mtu));
  a.dest_qp_num = c.qpn[i];
  a.rq_psn = c.psn[i];
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = kRnrTimer;
  a.ah_attr.port_num = static_cast<uint8_t>(dev->port);
  a.ah_attr.sl = dev->service_level;
  if (dev->link_layer == IBV_LINK_LAYER_ETHERNET) {
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, c.gid, 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(dev->gid_index);
    a.ah_attr.grh.hop_limit = 255;
    // The communicator's own class (ncclConfig_t trafficClass) first, as NCCL's transport does.
    a.ah_attr.grh.traffic_class =
        traffic_class >= 0 ? static_cast<uint8_t>(traffic_class) : dev->traffic_class;
  } else {
    a.ah_attr.is_global = 0;
    a.ah_attr.dlid = c.lid;
  }
  if (verbs().modify_qp(qps[i], &a,
                        IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                            IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) !=
      0) {
    NET_WARN("QP to RTR towards %s failed: %s", peer.c_str(), std::strerror(errno));
    return Status::kSystemError;
  }
  std::memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = psns[i];
  a.timeout = dev->ack_timeout;
  a.retry_cnt = dev->retry_count;
  a.rnr_retry = kRnrRetry;
  a.max_rd_atomic = 1;
  if (verbs().modify_qp(qps[i], &a,
                        IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                            IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC) != 0) {
    NET_WARN("QP to RTS towards %s failed: %s", peer.c_str(), std::strerror(errno));
    return Status::kSystemError;
  }
  return Status::kOk;
}

// The first queue pair's attributes as the driver holds them (queried back, not what was
// asked): what an operator checks against the fabric's lossless class and timeouts.
std::string Conn::qp_attributes() const {
  ibv_qp_attr a{};
  ibv_qp_init_attr init{};
  if (qps.empty() ||
      verbs().query_qp(qps[0], &a, IBV_QP_AV | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT, &init) != 0)
    return std::string("attributes unknown: ibv_query_qp failed: ") + std::strerror(errno);
  char text[160];
  std::snprintf(text, sizeof text,
                "traffic class %u, service level %u, ack timeout %u (%.2f s a try), retries %u",
                static_cast<unsigned>(a.ah_attr.grh.traffic_class),
                static_cast<unsigned>(a.ah_attr.sl), static_cast<unsigned>(a.timeout),
                ack_try_ms(static_cast<int>(a.timeout & 31u)) / 1000.0,
                static_cast<unsigned>(a.retry_cnt));
  return text;
}

void Conn::close() {
  {
    std::lock_guard<std::mutex> lock(mu);
    poll_side();
  }
  if (side_send != nullptr) {
    Ctl c = ibwire::bare_ctl(ibwire::kBye);
    void* req = nullptr;
    if (!failed && !peer_closed &&
        socket_backend().isend(side_send, &c, sizeof(c), kSideTag, nullptr, &req) == Status::kOk &&
        req != nullptr) {
      Clock::time_point t = Clock::now();
      int done = 0;
      // Bounded: a small message on an idle socket; at most 1 s or the timeout.
      while (!done && ms_since(t) < std::min<int64_t>(timeout_ms, 1000)) {
        if (socket_backend().test(req, &done, nullptr) != Status::kOk) break;
        if (!done) usleep(100);
      }
    }
  }
  release();
}

void Conn::release() {
  if (side_send != nullptr) socket_backend().close_send(side_send);
  side_send = nullptr;
  if (side_recv != nullptr) socket_backend().close_recv(side_recv);
  side_recv = nullptr;
  bye_req = nullptr;  // freed with side_recv
  for (ibv_qp* q : qps) verbs().destroy_qp(q);
  qps.clear();
  qp = nullptr;
  if (cq != nullptr) verbs().destroy_cq(cq);
  cq = nullptr;
  for (ibv_mr* m : mrs) verbs().dereg_mr(m);
  mrs.clear();
  for (void* b : blocks) free(b);
  blocks.clear();
}

Status IbNet::listen(const CommContext& ctx, int dev, void* handle, void** listen_comm) {
  *listen_comm = nullptr;
  DQ_CHECK(check_dev(dev));
  auto lc = std::make_unique<ListenComm>();
  lc->dev = &devices_[static_cast<size_t>(dev)];
  lc->ctx = ctx;
  lc->timeout_ms = read_net_env().timeout_ms;
  char sock[NCCL_NET_HANDLE_MAXSIZE] = {};
  DQ_CHECK(side_listen(ctx, sock, &lc->sock_lc));
  ibwire::Handle h{};
  std::memcpy(&h.sock, sock, sizeof(h.sock));
  h.sock.nsocks = 1;
  h.magic = ibwire::kHandleMagic;
  h.version = ibwire::kVersion;
  std::memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  std::memcpy(handle, &h, sizeof(h));
  NET_INFO("verbs listen on %s:%d", lc->dev->name.c_str(), lc->dev->port);
  *listen_comm = lc.release();
  return Status::kOk;
}

Status IbNet::connect(const CommContext& ctx, int dev, void* handle, void** send_comm) {
  *send_comm = nullptr;
  DQ_CHECK(check_dev(dev));
  ibwire::Handle h;
  std::memcpy(&h, handle, sizeof(h));
  if (h.magic != ibwire::kHandleMagic || h.version != ibwire::kVersion) {
    NET_WARN("connect: the handle is not a dynamiq verbs listen handle (magic %#x, version %u)",
             h.magic, h.version);
    return Status::kInvalidArgument;
  }
  const IbDevice* device = &devices_[static_cast<size_t>(dev)];
  auto start = [&](PendingConnect* pc) {
    pc->ctx = ctx;
    std::memcpy(pc->sock_handle, &h.sock, sizeof(h.sock));
    return start_connect(device, pc);
  };
  auto progress = [this](PendingConnect* pc, void** out) {
    Status st = progress_connect(pc, out);
    if (st != Status::kOk || *out != nullptr || ms_since(pc->start) <= pc->sc->timeout_ms) {
      return st;
    }
    // Stages 0 and 1 wait on the network and the peer's kernel only (its listen backlog takes
    // the side channel and kConnect before the peer calls accept): bounded. Stages 2 and 3 wait
    // for the peer's NCCL to call accept, which may come minutes later (NCCL's lazy connection,
    // a long first iteration, compilation): no bound while the side channel is up, which
    // progress_connect checks on every call; a hung peer is left to the job's watchdog, as
    // NCCL's own IB transport leaves it.
    if (pc->stage < 2) {
      NET_WARN("verbs connect to %s timed out after %lld ms (DYNAMIQ_NET_TIMEOUT_MS) in stage %d",
               pc->sc->peer.c_str(), static_cast<long long>(pc->sc->timeout_ms), pc->stage);
      return Status::kTimeout;
    }
    if (!pc->wait_logged) {
      pc->wait_logged = true;
      NET_INFO(
          "verbs connect to %s: no answer after %lld ms; waiting for the peer to accept "
          "while its side channel is up",
          pc->sc->peer.c_str(), static_cast<long long>(pc->sc->timeout_ms));
    }
    return st;
  };
  const Status st = drive_connect<PendingConnect>(pending_connects(), &h.connect_state, start,
                                                  progress, send_comm);
  std::memcpy(handle, &h, sizeof(h));
  return st;
}

Status IbNet::accept(void* listen_comm, void** recv_comm) {
  *recv_comm = nullptr;
  auto* lc = static_cast<ListenComm*>(listen_comm);
  if (lc == nullptr || lc->magic != kListenMagic) {
    NET_WARN("accept: not a verbs listen comm");
    return Status::kInvalidArgument;
  }
  std::lock_guard<std::mutex> lock(lc->mu);
  void* side_recv = nullptr;
  DQ_CHECK(socket_backend().accept(lc->sock_lc, &side_recv));
  if (side_recv != nullptr) {
    auto p = std::make_unique<ListenComm::Pending>();
    p->rc = std::make_unique<RecvComm>();
    p->rc->dev = lc->dev;
    p->rc->set_timeouts(lc->timeout_ms);
    p->rc->side_recv = side_recv;
    p->rc->peer = lc->dev->name + " (side channel accepted)";
    lc->pending.push_back(std::move(p));
  }
  for (size_t i = 0; i < lc->pending.size(); ++i) {
    ListenComm::Pending& p = *lc->pending[i];
    bool ready = false;
    Status st = progress_accept(lc, &p, &ready);
    if (st == Status::kOk && !ready && ms_since(p.start) > lc->timeout_ms) {
      NET_WARN("verbs accept: connection setup with %s timed out after %lld ms in stage %d",
               p.rc->peer.c_str(), static_cast<long long>(lc->timeout_ms), p.stage);
      st = Status::kTimeout;
    }
    if (st != Status::kOk) {
      // One bad or slow peer does not fail the listener: drop it (~Pending) and go on.
      lc->pending.erase(lc->pending.begin() + static_cast<long>(i));
      --i;
      continue;
    }
    if (ready) {
      RecvComm* rc = p.rc.release();
      lc->pending.erase(lc->pending.begin() + static_cast<long>(i));
      NET_INFO("verbs connection accepted from %s", rc->peer.c_str());
      *recv_comm = rc;
      return Status::kOk;
    }
  }
  return Status::kOk;
}

Status IbNet::side_listen(const CommContext& ctx, char* handle, void** lc) {
  int n = 0;
  DQ_CHECK(socket_backend().devices(&n));
  if (n < 1) {
    NET_WARN("verbs: no socket interface for the side channel (DYNAMIQ_NET_IFNAME)");
    return Status::kUnsupported;
  }
  return socket_backend().listen(ctx, 0, handle, lc);
}

Status IbNet::add_region(Conn* c, size_t bytes, void** ptr, ibv_mr** mr) {
  *ptr = c->alloc(bytes);
  if (*ptr == nullptr) return Status::kOutOfMemory;
  DQ_CHECK(register_bytes(c->dev->pd, *ptr, bytes, mr));
  c->mrs.push_back(*mr);
  return Status::kOk;
}

Status IbNet::start_connect(const IbDevice* dev, PendingConnect* pc) {
  pc->sc = std::make_unique<SendComm>();
  SendComm* sc = pc->sc.get();
  sc->dev = dev;
  sc->set_timeouts(read_net_env().timeout_ms);
  sc->peer = dev->name + " (connecting)";
  DQ_CHECK(sc->make_qps(static_cast<uint32_t>(read_net_env().ib_qps)));
  void* p = nullptr;
  ibv_mr* fifo_mr = nullptr;
  DQ_CHECK(add_region(sc, sizeof(FifoSlot) * kFifoDepth, &p, &fifo_mr));
  sc->fifo = static_cast<FifoSlot*>(p);
  ibv_mr* rec_mr = nullptr;
  DQ_CHECK(add_region(sc, sizeof(uint64_t) * kRqDepth, &p, &rec_mr));
  sc->records = static_cast<uint64_t*>(p);
  sc->records_lkey = rec_mr->lkey;
  DQ_CHECK(side_listen(pc->ctx, pc->reply_handle, &pc->reply_lc));
  sc->fill_ctl(&pc->out, ibwire::kConnect);
  pc->out.addr = reinterpret_cast<uint64_t>(sc->fifo);
  pc->out.rkey = fifo_mr->rkey;
  wire::Handle reply;
  std::memcpy(&reply, pc->reply_handle, sizeof(reply));
  reply.nsocks = 1;
  std::memcpy(pc->out.reply_handle, &reply, sizeof(reply));
  return Status::kOk;
}

Status IbNet::progress_connect(PendingConnect* pc, void** send_comm) {
  SendComm* sc = pc->sc.get();
  if (pc->stage == 0) {
    DQ_CHECK(socket_backend().connect(pc->ctx, 0, pc->sock_handle, &sc->side_send));
    if (sc->side_send == nullptr) return Status::kOk;
    pc->stage = 1;
  }
  if (pc->stage == 1) {
    bool done = false;
    DQ_CHECK(send_ctl(sc->side_send, &pc->out, &pc->req, &done));
    if (!done) return Status::kOk;
    pc->stage = 2;
  }
  if (pc->stage == 2) {
    DQ_CHECK(socket_backend().accept(pc->reply_lc, &sc->side_recv));
    if (sc->side_recv == nullptr) return peer_alive(pc);
    pc->stage = 3;
  }
  if (pc->stage == 3) {
    bool done = false;
    Status st = recv_ctl(sc->side_recv, &pc->in, &pc->req, &done);
    if (st != Status::kOk) return st;
    if (!done) return peer_alive(pc);
    const char* bad = ibwire::check_ctl(pc->in, ibwire::kAccept);
    if (bad != nullptr) {
      NET_WARN("verbs connect: refused the listener's answer: %s", bad);
      return Status::kMalformedPayload;
    }
    sc->remote_records = pc->in.addr;
    sc->remote_records_rkey = pc->in.rkey;
    DQ_CHECK(sc->connect(pc->in, pc->ctx.traffic_class));
    // The QPs are in RTS: the acceptor may now write into them (its accept waits for this).
    pc->out = ibwire::bare_ctl(ibwire::kReady);
    pc->stage = 4;
  }
  bool sent = false;
  DQ_CHECK(send_ctl(sc->side_send, &pc->out, &pc->req, &sent));
  if (!sent) return Status::kOk;
  DQ_CHECK(sc->post_side_recv());
  sc->peer = sc->dev->name + " -> QP " + std::to_string(pc->in.qpn[0]) +
             (pc->in.nqps > 1 ? " (+" + std::to_string(pc->in.nqps - 1) + " striped)" : "");
  sc->last_progress = Clock::now();
  NET_INFO("verbs connected: %s; %s", sc->peer.c_str(), sc->qp_attributes().c_str());
  socket_backend().close_listen(pc->reply_lc);
  pc->reply_lc = nullptr;
  *send_comm = pc->sc.release();
  return Status::kOk;
}

Status IbNet::peer_alive(PendingConnect* pc) {
  if (socket_send_peer_alive(pc->sc->side_send) == Status::kOk) return Status::kOk;
  pc->sc->peer_closed = true;  // no kBye into a side channel that has ended
  NET_WARN(
      "verbs connect to %s failed in stage %d: the peer closed or reset the side channel "
      "before answering (it died, or refused the handle)",
      pc->sc->peer.c_str(), pc->stage);
  return Status::kSystemError;
}

Status IbNet::progress_accept(ListenComm* lc, ListenComm::Pending* p, bool* ready) {
  *ready = false;
  RecvComm* rc = p->rc.get();
  if (p->stage == 0) {
    bool done = false;
    DQ_CHECK(recv_ctl(rc->side_recv, &p->in, &p->req, &done));
    if (!done) return Status::kOk;
    const char* bad = ibwire::check_ctl(p->in, ibwire::kConnect);
    if (bad != nullptr) {
      NET_WARN("verbs accept: refused a connection: %s", bad);
      return Status::kMalformedPayload;
    }
    wire::Handle reply;
    std::memcpy(&reply, p->in.reply_handle, sizeof(reply));
    if (reply.nsocks != 1) {
      NET_WARN("verbs accept: refused a connection: reply handle asks for %u sockets",
               reply.nsocks);
      return Status::kMalformedPayload;
    }
    reply.connect_state = 0;
    std::memcpy(p->reply, &reply, sizeof(reply));
    DQ_CHECK(rc->make_qps(p->in.nqps));  // the connector's count (check_ctl bounded it)
    void* ptr = nullptr;
    ibv_mr* src_mr = nullptr;
    DQ_CHECK(add_region(rc, sizeof(FifoSlot) * kFifoDepth, &ptr, &src_mr));
    rc->fifo_src = static_cast<FifoSlot*>(ptr);
    rc->fifo_src_lkey = src_mr->lkey;
    ibv_mr* rec_mr = nullptr;
    DQ_CHECK(add_region(rc, sizeof(uint64_t) * kRqDepth, &ptr, &rec_mr));
    rc->records = static_cast<uint64_t*>(ptr);
    rc->remote_fifo = p->in.addr;
    rc->remote_fifo_rkey = p->in.rkey;
    DQ_CHECK(rc->connect(p->in, lc->ctx.traffic_class));
    for (size_t q = 0; q < rc->qps.size(); ++q) DQ_CHECK(rc->post_receives(q, kRqDepth));
    rc->fill_ctl(&p->out, ibwire::kAccept);
    p->out.addr = reinterpret_cast<uint64_t>(rc->records);
    p->out.rkey = rec_mr->rkey;
    p->stage = 1;
  }
  if (p->stage == 1) {
    DQ_CHECK(socket_backend().connect(lc->ctx, 0, p->reply, &rc->side_send));
    if (rc->side_send == nullptr) return Status::kOk;
    p->stage = 2;
  }
  if (p->stage == 2) {
    bool done = false;
    DQ_CHECK(send_ctl(rc->side_send, &p->out, &p->req, &done));
    if (!done) return Status::kOk;
    p->stage = 3;
  }
  // The connector's kReady: its QPs are in RTS, so this end's first FIFO write reaches them.
  bool done = false;
  DQ_CHECK(recv_ctl(rc->side_recv, &p->ready, &p->req, &done));
  if (!done) return Status::kOk;
  const char* bad = ibwire::check_ctl(p->ready, ibwire::kReady);
  if (bad != nullptr) {
    NET_WARN("verbs accept: refused the connector's ready message: %s", bad);
    return Status::kMalformedPayload;
  }
  DQ_CHECK(rc->post_side_recv());
  rc->peer = rc->dev->name + " <- QP " + std::to_string(p->in.qpn[0]) +
             (p->in.nqps > 1 ? " (+" + std::to_string(p->in.nqps - 1) + " striped)" : "");
  rc->last_progress = Clock::now();
  *ready = true;
  return Status::kOk;
}

}  // namespace dq::net::ib
