// The data path of the ibverbs backend. A receiver posts each irecv into a slot of the FIFO
// on the sender (an RDMA WRITE of the buffers' addresses, sizes, keys and tags); the sender
// matches its isends to those postings in order and writes the payload with RDMA WRITE, striped
// over the connection's queue pairs, each stripe ending with a WRITE WITH IMMEDIATE that tells
// the receiver which entry it completes. test() advances both directions; every comm fails on
// a work completion error, a malformed peer message, the peer's death or a stall longer than
// DYNAMIQ_NET_TIMEOUT_MS.
#include <endian.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>

#include "plugin/ibverbs/ib_internal.h"

namespace dq::net::ib {

std::string Conn::wc_error(const ibv_wc& wc) const {
  return std::string("work completion error: ") + verbs().wc_status_str(wc.status) + " (status " +
         std::to_string(wc.status) + ", vendor error " + std::to_string(wc.vendor_err) + ")";
}

SendComm::~SendComm() {
  for (SendReq* r : reqs) {
    if (r->own_mr != nullptr) verbs().dereg_mr(r->own_mr);
    delete r;
  }
}

bool SendComm::take_new_posting(uint32_t pos) {
  const auto* src = reinterpret_cast<const volatile uint64_t*>(&fifo[pos]);
  if (src[offsetof(FifoSlot, seq) / 8] == cur_seq[pos]) return false;
  uint64_t w[sizeof(FifoSlot) / 8];
  for (size_t i = 0; i < sizeof(FifoSlot) / 8; ++i) w[i] = src[i];
  std::atomic_thread_fence(std::memory_order_acquire);
  FifoSlot copy;
  std::memcpy(&copy, w, sizeof(copy));
  if (copy.seq == 0 || copy.seq == cur_seq[pos]) return false;
  if (ibwire::slot_check(w, ibwire::kSlotCheckedWords) != copy.check) return false;
  snap[pos] = copy;
  cur_seq[pos] = copy.seq;
  used[pos] = 0;
  return true;
}

Status SendComm::post(SendReq* r, uint32_t pos, int e) {
  const ibwire::FifoEntry& fe = snap[pos].e[e];
  const bool fits = r->size <= fe.size;
  const size_t payload = fits ? r->size : 0;
  const uint32_t idx = static_cast<uint32_t>(pos * kMaxGroupedRecvs + static_cast<size_t>(e));
  records[idx] = fits ? r->size : (r->size | ibwire::kOversize);
  const uint32_t stripes = stripes_for(payload);
  std::vector<ibv_send_wr> wrs;
  std::vector<ibv_sge> sges;
  int posted = 0;
  for (uint32_t q = 0; q < stripes; ++q) {
    uint64_t begin = 0, len = 0;
    ibwire::stripe_range(payload, stripes, q, &begin, &len);
    const size_t chunk = chunk_bytes(len);
    const size_t chunks = (len + chunk - 1) / chunk;
    wrs.assign(chunks + 1, ibv_send_wr{});
    sges.assign(chunks + 1, ibv_sge{});
    for (size_t c = 0; c < chunks; ++c) {
      const size_t off = begin + c * chunk;
      sges[c].addr = reinterpret_cast<uint64_t>(r->data + off);
      sges[c].length = static_cast<uint32_t>(std::min<uint64_t>(chunk, begin + len - off));
      sges[c].lkey = r->lkey;
      wrs[c].wr_id = reinterpret_cast<uint64_t>(r);
      wrs[c].sg_list = &sges[c];
      wrs[c].num_sge = 1;
      wrs[c].opcode = IBV_WR_RDMA_WRITE;
      wrs[c].send_flags = IBV_SEND_SIGNALED;
      wrs[c].wr.rdma.remote_addr = fe.addr + off;
      wrs[c].wr.rdma.rkey = fe.rkey;
      wrs[c].next = &wrs[c + 1];
    }
    // The stripe's end: QP 0 writes the size record, the others nothing; each immediate tells
    // the receiver one more stripe of the entry is in place (RC: after this QP's writes).
    ibv_send_wr& last = wrs[chunks];
    if (q == 0) {
      sges[chunks].addr = reinterpret_cast<uint64_t>(&records[idx]);
      sges[chunks].length = sizeof(uint64_t);
      sges[chunks].lkey = records_lkey;
      last.sg_list = &sges[chunks];
      last.num_sge = 1;
    }
    last.wr_id = reinterpret_cast<uint64_t>(r);
    last.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    last.send_flags = IBV_SEND_SIGNALED;
    last.imm_data = htobe32(ibwire::stripe_imm(idx, stripes));
    last.wr.rdma.remote_addr = remote_records + idx * sizeof(uint64_t);
    last.wr.rdma.rkey = remote_records_rkey;
    last.next = nullptr;
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(qps[q], wrs.data(), &bad);
    if (rc != 0) {
      fail(std::string("ibv_post_send failed: ") + std::strerror(rc));
      return Status::kSystemError;
    }
    qp_used[q] += static_cast<int>(chunks + 1);
    posted += static_cast<int>(chunks + 1);
  }
  if (sq_used == 0) last_progress = Clock::now();
  r->wr_left = posted;
  sq_used += posted;
  r->posted = true;
  return Status::kOk;
}

void SendComm::progress() {  // mu held
  if (failed) return;
  ibv_wc wc[16];
  int n = 0;
  while ((n = ibv_poll_cq(cq, 16, wc)) > 0) {  // bounded by the work requests in flight
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) return fail(wc_error(wc[i]));
      auto* r = reinterpret_cast<SendReq*>(wc[i].wr_id);
      const int q = qp_index(wc[i].qp_num);
      if (reqs.count(r) == 0 || q < 0) return fail("completion for an unknown request");
      --sq_used;
      --qp_used[q];
      last_progress = Clock::now();
      // Done when the work requests of every stripe, on every QP, have completed.
      if (--r->wr_left == 0) r->done = true;
    }
  }
  if (n < 0) return fail("ibv_poll_cq failed");
  // The receiver reuses a slot only once every entry of it has been received, so a slot whose
  // seq changed is a new posting. Postings are matched strictly in seq (posting) order: the
  // scan below reads the slots one after another while the receiver's writes keep landing, so
  // it can see posting k + 1 and miss posting k (its slot read a moment before it landed);
  // k + 1 waits for k (taking it first paired the wrong send and receive: wrong data, size
  // mismatches). A slot cannot be reposted before its posting was matched, so a posting
  // beyond the frontier stays in its slot until the gap fills.
  std::pair<uint64_t, uint32_t> live[kFifoDepth];  // (seq, slot)
  int nlive = 0;
  for (uint32_t pos = 0; pos < kFifoDepth; ++pos) {
    if (take_new_posting(pos)) {
      const uint32_t nrecv = snap[pos].n;
      if (nrecv < 1 || nrecv > static_cast<uint32_t>(kMaxGroupedRecvs) ||
          cur_seq[pos] <= frontier) {
        return fail(Status::kMalformedPayload,
                    "malformed FIFO slot: posting " + std::to_string(cur_seq[pos]) + " with " +
                        std::to_string(nrecv) + " grouped receives (postings up to " +
                        std::to_string(frontier) + " already taken)");
      }
    }
    if (cur_seq[pos] == 0) continue;
    if (used[pos] != (1u << snap[pos].n) - 1) live[nlive++] = {cur_seq[pos], pos};
  }
  std::sort(live, live + nlive);
  for (int l = 0; l < nlive; ++l) {
    if (live[l].first == frontier + 1) ++frontier;
  }
  while (nlive > 0 && live[nlive - 1].first > frontier) --nlive;  // not in order yet
  // Match in isend order; each send takes the oldest unused posted entry with its tag.
  bool sq_full = false;
  for (auto it = waiting.begin(); it != waiting.end() && !sq_full && !failed;) {
    SendReq* r = *it;
    bool matched = false;
    for (int l = 0; l < nlive && !matched && !sq_full; ++l) {
      const uint32_t pos = live[l].second;
      const uint32_t nrecv = snap[pos].n;
      for (uint32_t e = 0; e < nrecv; ++e) {
        if (((used[pos] >> e) & 1u) != 0 || snap[pos].e[e].tag != r->tag) continue;
        if (!fits(r->size <= snap[pos].e[e].size ? r->size : 0)) {
          sq_full = true;
          break;
        }
        if (post(r, pos, static_cast<int>(e)) != Status::kOk) return;
        used[pos] = static_cast<uint8_t>(used[pos] | (1u << e));
        matched = true;
        break;
      }
    }
    it = matched ? waiting.erase(it) : it + 1;
  }
  poll_side();
  if (failed) return;
  if (sq_used > 0 && ms_since(last_progress) > stall_ms) {
    return fail(Status::kTimeout,
                "no completion for " + std::to_string(stall_ms) +
                    " ms (DYNAMIQ_NET_TIMEOUT_MS, or the queue pairs' own retries) with " +
                    std::to_string(sq_used) + " work requests in flight");
  }
  // kBye travels on TCP, the ACKs of our last writes on the QP: a receiver that got every
  // message and closed may overtake them, so writes in flight are left to their completions
  // (success, or an error once the retries to the destroyed peer QP run out) and the stall
  // bound above. A send no posted receive took can never complete.
  if (peer_closed && !waiting.empty()) {
    fail("the peer closed the connection with " + std::to_string(waiting.size()) +
         " sends that no receive of its took");
  }
}

RecvComm::~RecvComm() {
  for (FlushReq* f : flushes) delete f;
  for (RecvReq* r : reqs) {
    for (ibv_mr* m : r->own_mr) {
      if (m != nullptr) verbs().dereg_mr(m);
    }
    delete r;
  }
}

Status RecvComm::post_receives(size_t q, int n) {
  ibv_recv_wr rw[16];
  while (n > 0) {
    const int k = std::min(n, 16);
    for (int i = 0; i < k; ++i) {
      rw[i] = ibv_recv_wr{};
      rw[i].wr_id = kWrRecv;
      rw[i].next = i + 1 < k ? &rw[i + 1] : nullptr;
    }
    ibv_recv_wr* bad = nullptr;
    const int e = ibv_post_recv(qps[q], rw, &bad);
    if (e != 0) {
      fail(std::string("posting receives failed: ") + std::strerror(e));
      return Status::kSystemError;
    }
    n -= k;
  }
  return Status::kOk;
}

void RecvComm::progress() {  // mu held
  if (failed) return;
  ibv_wc wc[16];
  int n = 0;
  while ((n = ibv_poll_cq(cq, 16, wc)) > 0) {  // bounded by the work requests in flight
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) return fail(wc_error(wc[i]));
      last_progress = Clock::now();
      if (wc[i].wr_id == kWrFifo) {
        --sq_used;
        continue;
      }
      const int q = qp_index(wc[i].qp_num);
      if (wc[i].wr_id != kWrRecv || wc[i].opcode != IBV_WC_RECV_RDMA_WITH_IMM || q < 0) {
        return fail("unexpected completion (opcode " + std::to_string(wc[i].opcode) + ")");
      }
      if (post_receives(static_cast<size_t>(q), 1) != Status::kOk) return;
      const uint32_t imm = be32toh(wc[i].imm_data);
      const uint32_t idx = ibwire::imm_index(imm);
      const uint32_t slot = idx / kMaxGroupedRecvs;
      const int e = static_cast<int>(idx % kMaxGroupedRecvs);
      RecvReq* r = slot < kFifoDepth ? by_slot[slot] : nullptr;
      if (r == nullptr || e >= r->n || r->got[e] || ibwire::imm_stripes(imm) > ibwire::kMaxQps) {
        return fail(Status::kMalformedPayload,
                    "immediate " + std::to_string(idx) + " (slot " + std::to_string(slot) +
                        ", entry " + std::to_string(e) + ") names no pending receive: " +
                        (r == nullptr ? std::string("the slot is free")
                                      : "posting " + std::to_string(r->seq) + " of " +
                                            std::to_string(r->n) + " entries, entry " +
                                            (e >= r->n   ? "out of range"
                                             : r->got[e] ? "already received"
                                                         : "stripe count out of range")) +
                        " (next posting " + std::to_string(next_seq) + ", local QP " +
                        std::to_string(wc[i].qp_num) + ", " + std::to_string(wc[i].byte_len) +
                        " bytes)");
      }
      bool complete = false;
      const char* refused = r->stripes[e].take(static_cast<uint32_t>(q), ibwire::imm_stripes(imm),
                                               static_cast<uint32_t>(qps.size()), &complete);
      if (refused != nullptr) {
        return fail(Status::kMalformedPayload, "immediate " + std::to_string(imm) + " on QP " +
                                                   std::to_string(q) + " for posting " +
                                                   std::to_string(r->seq) + ", entry " +
                                                   std::to_string(e) + ": " + refused);
      }
      if (!complete) continue;  // the size record came with QP 0's stripe
      const uint64_t rec = records[idx];
      const uint64_t size = rec & ~ibwire::kOversize;
      if ((rec & ibwire::kOversize) != 0 || size > r->capacity[e]) {
        return fail("message with tag " + std::to_string(r->tag[e]) + " carries " +
                    std::to_string(size) + " bytes but the posted receive holds only " +
                    std::to_string(r->capacity[e]));
      }
      r->got[e] = true;
      r->received[e] = size;
      // The sender matched every entry of the slot: it may carry the next posting.
      if (--r->remaining == 0) by_slot[slot] = nullptr;
    }
  }
  if (n < 0) return fail("ibv_poll_cq failed");
  poll_side();
  if (failed) return;
  if (sq_used > 0 && ms_since(last_progress) > stall_ms) {
    return fail(Status::kTimeout,
                "no completion of a receive posting for " + std::to_string(stall_ms) +
                    " ms (DYNAMIQ_NET_TIMEOUT_MS, or the queue pairs' own retries)");
  }
  bool pending = std::any_of(reqs.begin(), reqs.end(), [](RecvReq* r) { return r->remaining; });
  if (peer_closed && pending) fail("the peer closed the connection with receives pending");
}

Status IbNet::isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                    void** request) {
  *request = nullptr;
  auto* sc = static_cast<SendComm*>(send_comm);
  if (sc == nullptr || sc->magic != kSendMagic) {
    NET_WARN("isend: not a verbs send comm");
    return Status::kInvalidArgument;
  }
  DQ_CHECK(check_region(mhandle, kMrMagic, data, size));
  if (size > INT_MAX || (size > 0 && data == nullptr)) {
    NET_WARN("isend: invalid buffer %p of %zu bytes (at most %d)", data, size, INT_MAX);
    return Status::kInvalidArgument;
  }
  std::lock_guard<std::mutex> lock(sc->mu);
  sc->progress();
  if (sc->failed) {
    NET_WARN("isend to %s: the connection has failed", sc->peer.c_str());
    return sc->fail_status;
  }
  if (sc->reqs.size() >= kMaxSendsPerComm) return Status::kOk;  // NULL: retry later
  auto r = std::make_unique<SendReq>();
  r->comm = sc;
  r->tag = tag;
  r->data = static_cast<char*>(data);
  r->size = size;
  if (size > 0) {
    auto* m = static_cast<IbMr*>(mhandle);
    if (m != nullptr && m->mr != nullptr) {
      r->lkey = m->mr->lkey;
    } else {
      DQ_CHECK(register_bytes(sc->dev->pd, data, size, &r->own_mr));
      r->lkey = r->own_mr->lkey;
    }
  }
  SendReq* raw = r.release();
  sc->reqs.insert(raw);
  sc->waiting.push_back(raw);
  sc->progress();  // match now if the receive is already posted
  *request = raw;
  return Status::kOk;
}

Status IbNet::irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
                    void** mhandles, void** request) {
  *request = nullptr;
  RecvComm* rc = nullptr;
  if (Status st = grouped_call("irecv", recv_comm, n, 1, &rc); st != Status::kOk) return st;
  DQ_CHECK(check_recv_buffers(n, data, sizes, mhandles, kMrMagic));
  std::lock_guard<std::mutex> lock(rc->mu);
  rc->progress();
  if (rc->failed || rc->peer_closed) {
    NET_WARN("irecv from %s: the connection has %s", rc->peer.c_str(),
             rc->failed ? "failed" : "been closed by the peer");
    return rc->failed ? rc->fail_status : Status::kSystemError;
  }
  // Any free slot: a receive that stays posted long (an end marker, a control message) holds
  // its slot only, not the ring.
  size_t pos = kFifoDepth;
  for (size_t i = 0; i < kFifoDepth && pos == kFifoDepth; ++i) {
    size_t cand = (rc->next_seq + i) % kFifoDepth;
    if (rc->by_slot[cand] == nullptr) pos = cand;
  }
  if (pos == kFifoDepth || rc->sq_used >= kSqDepth) return Status::kOk;  // NULL: retry
  auto r = std::make_unique<RecvReq>();
  r->comm = rc;
  r->n = n;
  r->remaining = n;
  r->seq = rc->next_seq;
  FifoSlot& s = rc->fifo_src[pos];
  std::memset(&s, 0, sizeof(s));
  for (int i = 0; i < n; ++i) {
    r->capacity[i] = sizes[i];
    r->tag[i] = tags[i];
    uint32_t rkey = 0;
    auto* m = mhandles != nullptr ? static_cast<IbMr*>(mhandles[i]) : nullptr;
    if (sizes[i] > 0) {
      if (m != nullptr && m->mr != nullptr) {
        rkey = m->mr->rkey;
      } else {
        Status st = register_bytes(rc->dev->pd, data[i], sizes[i], &r->own_mr[i]);
        if (st != Status::kOk) {
          for (ibv_mr* own : r->own_mr) {
            if (own != nullptr) verbs().dereg_mr(own);
          }
          return st;
        }
        rkey = r->own_mr[i]->rkey;
      }
    }
    s.e[i].addr = reinterpret_cast<uint64_t>(data[i]);
    s.e[i].size = sizes[i];
    s.e[i].rkey = rkey;
    s.e[i].tag = tags[i];
  }
  s.n = static_cast<uint32_t>(n);
  s.seq = rc->next_seq + 1;
  s.check = ibwire::slot_check(reinterpret_cast<const uint64_t*>(&s), ibwire::kSlotCheckedWords);
  // The immediates' receive work requests are the QPs' standing pool (post_receives).
  ibv_sge sge{reinterpret_cast<uint64_t>(&s), sizeof(s), rc->fifo_src_lkey};
  ibv_send_wr w{};
  w.wr_id = kWrFifo;
  w.sg_list = &sge;
  w.num_sge = 1;
  w.opcode = IBV_WR_RDMA_WRITE;
  w.send_flags = IBV_SEND_SIGNALED;
  w.wr.rdma.remote_addr = rc->remote_fifo + pos * sizeof(FifoSlot);
  w.wr.rdma.rkey = rc->remote_fifo_rkey;
  ibv_send_wr* bad_s = nullptr;
  const int e = ibv_post_send(rc->qp, &w, &bad_s);
  if (e != 0) {
    rc->fail(std::string("posting a receive failed: ") + std::strerror(e));
    for (ibv_mr* own : r->own_mr) {
      if (own != nullptr) verbs().dereg_mr(own);
    }
    return Status::kSystemError;
  }
  if (rc->sq_used == 0) rc->last_progress = Clock::now();
  ++rc->sq_used;
  ++rc->next_seq;
  RecvReq* raw = r.release();
  rc->by_slot[pos] = raw;
  rc->reqs.insert(raw);
  *request = raw;
  return Status::kOk;
}

Status IbNet::test(void* request, int* done, int* sizes) {
  *done = 0;
  auto* magic = static_cast<uint32_t*>(request);
  if (magic == nullptr) {
    NET_WARN("test: NULL request");
    return Status::kInvalidArgument;
  }
  if (*magic == kSendReqMagic) {
    auto* r = static_cast<SendReq*>(request);
    SendComm* sc = r->comm;
    std::lock_guard<std::mutex> lock(sc->mu);
    if (!r->done) sc->progress();
    if (r->done) {
      *done = 1;
      if (sizes != nullptr) sizes[0] = static_cast<int>(r->size);
      if (r->own_mr != nullptr) verbs().dereg_mr(r->own_mr);
      sc->reqs.erase(r);
      r->magic = 0;
      delete r;
      return Status::kOk;
    }
    return sc->failed ? sc->fail_status : Status::kOk;
  }
  if (*magic == kFlushReqMagic) {
    auto* r = static_cast<FlushReq*>(request);
    RecvComm* rc = r->comm;
    std::lock_guard<std::mutex> lock(rc->mu);
    Status st = r->done ? Status::kOk : rc->poll_flushes();
    if (r->done) {
      *done = 1;
      if (sizes != nullptr) sizes[0] = 0;
      rc->flushes.erase(r);
      r->magic = 0;
      delete r;
      return Status::kOk;
    }
    if (st == Status::kOk && ms_since(r->start) > rc->stall_ms) {
      rc->fail(Status::kTimeout,
               "a flush did not complete within " + std::to_string(rc->stall_ms) +
                   " ms (DYNAMIQ_NET_TIMEOUT_MS, or the queue pairs' own retries)");
      return rc->fail_status;
    }
    return rc->failed ? rc->fail_status : st;
  }
  if (*magic == kRecvReqMagic) {
    auto* r = static_cast<RecvReq*>(request);
    RecvComm* rc = r->comm;
    std::lock_guard<std::mutex> lock(rc->mu);
    if (r->remaining > 0) rc->progress();
    if (r->remaining == 0) {
      *done = 1;
      for (int i = 0; sizes != nullptr && i < r->n; ++i) {
        sizes[i] = static_cast<int>(r->received[i]);
      }
      for (ibv_mr* own : r->own_mr) {
        if (own != nullptr) verbs().dereg_mr(own);
      }
      rc->reqs.erase(r);
      r->magic = 0;
      delete r;
      return Status::kOk;
    }
    return rc->failed ? rc->fail_status : Status::kOk;
  }
  NET_WARN("test: %p is not a request of this plugin", request);
  return Status::kInvalidArgument;
}

Status IbNet::grouped_call(const char* call, void* recv_comm, int n, int min_n, RecvComm** rc) {
  *rc = static_cast<RecvComm*>(recv_comm);
  if (*rc == nullptr || (*rc)->magic != kRecvMagic) {
    NET_WARN("%s: not a verbs receive comm", call);
    return Status::kInvalidArgument;
  }
  return check_grouped_count(call, n, min_n);
}

}  // namespace dq::net::ib
