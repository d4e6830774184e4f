// Memory registration of the ibverbs backend: host memory, GPU memory through the peer-memory
// module or as a DMA-BUF (GPUDirect RDMA), and the flush that makes received bytes in GPU memory
// visible to the GPU (iflush: RDMA READs on a queue pair connected to itself).
#include <atomic>
#include <cerrno>
#include <cstdint>

#include "plugin/ibverbs/ib_internal.h"

namespace dq::net::ib {
namespace {

std::atomic<int> g_relaxed_mode{0};    // DYNAMIQ_NET_IB_PCI_RELAXED_ORDERING, as set at discovery
std::atomic<int> g_relaxed_access{0};  // IBV_ACCESS_RELAXED_ORDERING while on, else 0

}  // namespace

void set_relaxed_ordering(int mode) {
  g_relaxed_mode = mode;
  const bool available = verbs().reg_mr_iova2 != nullptr;
  g_relaxed_access = mode != 0 && available ? IBV_ACCESS_RELAXED_ORDERING : 0;
  if (mode == 1 && !available) {
    NET_WARN(
        "verbs relaxed ordering: asked for (DYNAMIQ_NET_IB_PCI_RELAXED_ORDERING=1, or "
        "NCCL_IB_PCI_RELAXED_ORDERING) but libibverbs has no ibv_reg_mr_iova2: off");
  } else {
    NET_INFO("verbs relaxed ordering: %s (mode %d%s)", g_relaxed_access != 0 ? "on" : "off", mode,
             mode != 0 && !available ? ": libibverbs has no ibv_reg_mr_iova2" : "");
  }
}

int relaxed_ordering_access() {
  return g_relaxed_access.load(std::memory_order_relaxed);
}

namespace {

// Mode 2 takes relaxed ordering only where the device takes it: a registration that failed with
// it is made again without, and only where that succeeds was the failure relaxed ordering's, which
// is then off for every later registration (one INFO line). A region that fails both ways (a bad
// address, memory short) says nothing about relaxed ordering, which stays on. Mode 1 never
// retries: the failure stands.
bool may_retry_without_relaxed_ordering() {
  return g_relaxed_mode.load() == 2;
}
void relaxed_ordering_refused(const char* what, int relaxed_errno) {
  if (g_relaxed_access.exchange(0) != 0)
    NET_INFO(
        "verbs relaxed ordering: %s failed with it and succeeded without (%s): off from now on",
        what, std::strerror(relaxed_errno));
}

}  // namespace

Status register_bytes(ibv_pd* pd, void* data, size_t size, ibv_mr** out) {
  const int relaxed = relaxed_ordering_access();
  if (relaxed != 0) {
    *out = verbs().reg_mr_iova2(pd, data, size, reinterpret_cast<uintptr_t>(data),
                                static_cast<unsigned>(kAccess | relaxed));
    if (*out != nullptr) return Status::kOk;
    if (!may_retry_without_relaxed_ordering()) {
      NET_WARN("ibv_reg_mr_iova2 of %p+%zu with relaxed ordering failed: %s", data, size,
               std::strerror(errno));
      return Status::kSystemError;
    }
  }
  const int relaxed_errno = errno;
  *out = verbs().reg_mr(pd, data, size, kAccess);
  if (*out == nullptr) {
    NET_WARN("ibv_reg_mr of %p+%zu failed: %s", data, size, std::strerror(errno));
    return Status::kSystemError;
  }
  if (relaxed != 0) relaxed_ordering_refused("a registration", relaxed_errno);
  return Status::kOk;
}

Status RecvComm::make_flush_qp() {  // mu held
  auto f = std::make_unique<Conn>();
  f->dev = dev;
  f->peer = dev->name + " (its own flush QP)";
  f->set_timeouts(timeout_ms);
  DQ_CHECK(f->make_qps(1, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE));
  ibwire::Ctl self{};
  f->fill_ctl(&self, ibwire::kConnect);
  DQ_CHECK(f->connect(self, -1));
  void* scratch = f->alloc(64);
  ibv_mr* mr = nullptr;
  if (scratch == nullptr) return Status::kOutOfMemory;
  DQ_CHECK(register_bytes(dev->pd, scratch, 64, &mr));
  f->mrs.push_back(mr);
  flush_scratch = static_cast<uint32_t*>(scratch);
  flush_lkey = mr->lkey;
  flush = std::move(f);
  return Status::kOk;
}

Status RecvComm::poll_flushes() {  // mu held
  if (!flush) return Status::kOk;
  ibv_wc wc[16];
  int n = 0;
  while ((n = ibv_poll_cq(flush->cq, 16, wc)) > 0) {  // bounded by the READs in flight
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        fail("flush: " + wc_error(wc[i]));
        return Status::kSystemError;
      }
      auto* r = reinterpret_cast<FlushReq*>(wc[i].wr_id);
      if (flushes.count(r) == 0) {
        fail("flush: a completion names no pending flush");
        return Status::kInternal;
      }
      r->done = true;
      flush->sq_used -= r->wrs;
    }
  }
  if (n < 0) {
    fail("flush: ibv_poll_cq failed");
    return Status::kSystemError;
  }
  // Bounded by the flushes waiting; each posts its READs whole or stops the loop.
  while (!failed && !unposted_flushes.empty() &&
         flush->sq_used + unposted_flushes.front()->wrs <= kSqDepth) {
    FlushReq* r = unposted_flushes.front();
    ibv_sge sge[kMaxGroupedRecvs];
    ibv_send_wr wr[kMaxGroupedRecvs];
    for (int j = 0; j < r->wrs; ++j) {
      sge[j] = ibv_sge{reinterpret_cast<uint64_t>(flush_scratch), 1, flush_lkey};
      wr[j] = ibv_send_wr{};
      wr[j].opcode = IBV_WR_RDMA_READ;
      wr[j].wr.rdma.remote_addr = r->addr[j];
      wr[j].wr.rdma.rkey = r->rkey[j];
      wr[j].sg_list = &sge[j];
      wr[j].num_sge = 1;
      wr[j].next = j + 1 < r->wrs ? &wr[j + 1] : nullptr;
      // Only the last is signalled: READs on one QP complete in order.
      wr[j].send_flags = j + 1 == r->wrs ? IBV_SEND_SIGNALED : 0;
      wr[j].wr_id = j + 1 == r->wrs ? reinterpret_cast<uint64_t>(r) : 0;
    }
    ibv_send_wr* bad = nullptr;
    const int e = ibv_post_send(flush->qp, wr, &bad);
    if (e != 0) {
      fail(std::string("flush: ibv_post_send failed: ") + std::strerror(e));
      return Status::kSystemError;
    }
    // Unsignalled READs still take send queue entries until the signalled one completes.
    flush->sq_used += r->wrs;
    unposted_flushes.pop_front();
  }
  return Status::kOk;
}

Status IbNet::reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  *mhandle = nullptr;
  const IbDevice* dev = dev_of(comm);
  if (dev == nullptr) {
    NET_WARN("regMr: not a verbs comm");
    return Status::kInvalidArgument;
  }
  if (type != NCCL_PTR_HOST && !(type == NCCL_PTR_CUDA && dev->gdr)) {
    NET_WARN(
        "regMr: memory type %d is not supported on %s (GPU memory needs the peer-memory "
        "module, and DYNAMIQ_NET_IB_GDR not off)",
        type, dev->name.c_str());
    return Status::kInvalidArgument;
  }
  auto m = std::make_unique<IbMr>();
  m->region.base = static_cast<const char*>(data);
  m->region.size = size;
  m->type = type;
  if (size > 0) DQ_CHECK(register_bytes(dev->pd, data, size, &m->mr));
  *mhandle = m.release();
  return Status::kOk;
}

Status IbNet::reg_mr_dma_buf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                             void** mhandle) {
  *mhandle = nullptr;
  if (type == NCCL_PTR_HOST) return reg_mr(comm, data, size, type, mhandle);
  const IbDevice* dev = dev_of(comm);
  if (dev == nullptr) {
    NET_WARN("regMrDmaBuf: not a verbs comm");
    return Status::kInvalidArgument;
  }
  if (type != NCCL_PTR_CUDA || !dev->dmabuf || fd < 0) {
    NET_WARN("regMrDmaBuf: memory type %d, fd %d not supported on %s (DMA-BUF %s)", type, fd,
             dev->name.c_str(), dev->dmabuf ? "accepted" : "not accepted by the device");
    return Status::kInvalidArgument;
  }
  auto m = std::make_unique<IbMr>();
  m->region.base = static_cast<const char*>(data);
  m->region.size = size;
  m->type = type;
  if (size > 0) {
    const auto iova = reinterpret_cast<uint64_t>(data);
    const int relaxed = relaxed_ordering_access();
    m->mr = verbs().reg_dmabuf_mr(dev->pd, offset, size, iova, fd, kAccess | relaxed);
    if (m->mr == nullptr && relaxed != 0 && may_retry_without_relaxed_ordering()) {
      const int relaxed_errno = errno;
      m->mr = verbs().reg_dmabuf_mr(dev->pd, offset, size, iova, fd, kAccess);
      if (m->mr != nullptr) relaxed_ordering_refused("a DMA-BUF registration", relaxed_errno);
    }
    if (m->mr == nullptr) {
      NET_WARN("ibv_reg_dmabuf_mr of %p+%zu (fd %d, offset %llu) failed: %s", data, size, fd,
               static_cast<unsigned long long>(offset), std::strerror(errno));
      return Status::kSystemError;
    }
  }
  *mhandle = m.release();
  return Status::kOk;
}

Status IbNet::iflush(void* recv_comm, int n, void** data, const int* sizes, void** mhandles,
                     void** request) {
  *request = nullptr;
  RecvComm* rc = nullptr;
  if (Status st = grouped_call("iflush", recv_comm, n, 0, &rc); st != Status::kOk) return st;
  // The buffers that need one: received bytes in GPU memory (or any, with flush-all).
  auto r = std::make_unique<FlushReq>();
  r->comm = rc;
  int k = 0;
  for (int i = 0; i < n; ++i) {
    auto* m = mhandles != nullptr ? static_cast<IbMr*>(mhandles[i]) : nullptr;
    if (sizes[i] <= 0) continue;
    if (m == nullptr || m->region.magic != kMrMagic || m->mr == nullptr) {
      if (!rc->dev->flush_all) continue;  // unregistered host memory: nothing to flush
      NET_WARN("iflush: buffer %d (%p) has no memory handle of this plugin", i, data[i]);
      return Status::kInvalidArgument;
    }
    if (m->type == NCCL_PTR_HOST && !rc->dev->flush_all) continue;
    DQ_CHECK(check_region(m, kMrMagic, data[i], 1));
    r->addr[k] = reinterpret_cast<uint64_t>(data[i]);
    r->rkey[k] = m->mr->rkey;
    ++k;
  }
  if (k == 0) return Status::kOk;  // nothing to wait for
  r->wrs = k;
  std::lock_guard<std::mutex> lock(rc->mu);
  if (rc->failed) return rc->fail_status;
  if (!rc->flush) DQ_CHECK(rc->make_flush_qp());
  // Never NULL from here on: with the send queue full the READs are posted by a later
  // poll_flushes (iflush or test), once earlier flushes have completed.
  FlushReq* raw = r.release();
  rc->flushes.insert(raw);
  rc->unposted_flushes.push_back(raw);
  DQ_CHECK(rc->poll_flushes());
  *request = raw;
  return Status::kOk;
}

Status IbNet::dereg_mr(void* /*comm*/, void* mhandle) {
  auto* m = static_cast<IbMr*>(mhandle);
  if (m == nullptr) return Status::kOk;
  if (m->region.magic != kMrMagic) {
    NET_WARN("deregMr: not a memory handle of this plugin");
    return Status::kInvalidArgument;
  }
  if (m->mr != nullptr && verbs().dereg_mr(m->mr) != 0) {
    NET_WARN("ibv_dereg_mr failed: %s", std::strerror(errno));
  }
  m->region.magic = 0;
  delete m;
  return Status::kOk;
}

const IbDevice* IbNet::dev_of(void* comm) {
  if (comm == nullptr) return nullptr;
  const uint32_t magic = *static_cast<const uint32_t*>(comm);
  if (magic == kListenMagic) return static_cast<ListenComm*>(comm)->dev;
  if (magic == kSendMagic) return static_cast<SendComm*>(comm)->dev;
  if (magic == kRecvMagic) return static_cast<RecvComm*>(comm)->dev;
  return nullptr;
}
}  // namespace dq::net::ib
