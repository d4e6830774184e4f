// Verbs as plain objects, for tests of the verbs backend in one process (ib_flush_test,
// ib_connect_test): the backend's verbs table (ib_loader.h) pointed at functions whose queue pairs,
// completion queues and registrations are objects allocated and freed here, and a device on a
// context and protection domain the test owns. The context's inline operations (post_send,
// post_recv, poll_cq: <infiniband/verbs.h> calls them through the context) are each test's own.
#pragma once
#include <atomic>
#include <cerrno>
#include <cstdint>

#include "plugin/ibverbs/ib_internal.h"

namespace dq::net::ib::fake_verbs {

// Queue pair numbers and registration keys, distinct across the process.
inline uint32_t next_number() {
  static uint32_t n = 1;
  return n++;
}

// The objects made and not yet destroyed, for the tests that a failed set-up leaks nothing.
struct Live {
  std::atomic<int> cqs{0}, qps{0}, mrs{0};
};
inline Live& live() {
  static Live l;
  return l;
}

// Registrations that succeed before the rest fail as ibv_reg_mr fails (NULL, errno ENOMEM); -1
// (the default): none fails.
inline std::atomic<int>& registrations_before_failure() {
  static std::atomic<int> n{-1};
  return n;
}

inline ibv_cq* create_cq(ibv_context* ctx, int, void*, ibv_comp_channel*, int) {
  ++live().cqs;
  auto* cq = new ibv_cq{};
  cq->context = ctx;
  return cq;
}
inline int destroy_cq(ibv_cq* cq) {
  --live().cqs;
  delete cq;
  return 0;
}
inline ibv_qp* create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) {
  ++live().qps;
  auto* qp = new ibv_qp{};
  qp->context = pd->context;
  qp->pd = pd;
  qp->send_cq = attr->send_cq;
  qp->recv_cq = attr->recv_cq;
  qp->qp_num = next_number();
  qp->state = IBV_QPS_RESET;
  return qp;
}
inline int destroy_qp(ibv_qp* qp) {
  --live().qps;
  delete qp;
  return 0;
}
inline int modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask) {
  if ((mask & IBV_QP_STATE) != 0) qp->state = attr->qp_state;  // RESET -> INIT -> RTR -> RTS
  return 0;
}
inline int query_qp(ibv_qp*, ibv_qp_attr* attr, int, ibv_qp_init_attr*) {
  *attr = ibv_qp_attr{};
  return 0;
}
inline ibv_mr* reg_mr(ibv_pd* pd, void* addr, size_t length, int) {
  if (registrations_before_failure().load() == 0) {
    errno = ENOMEM;
    return nullptr;
  }
  if (registrations_before_failure().load() > 0) --registrations_before_failure();
  ++live().mrs;
  auto* mr = new ibv_mr{};
  mr->pd = pd;
  mr->addr = addr;
  mr->length = length;
  mr->lkey = mr->rkey = next_number();
  return mr;
}
inline int dereg_mr(ibv_mr* mr) {
  --live().mrs;
  delete mr;
  return 0;
}
inline const char* wc_status_str(ibv_wc_status) {
  return "fake status";
}

// The verbs table pointed at the functions above, and `dev` made a RoCE device named fake0 (MTU
// 1024) on `ctx` and `pd` (pd->context set to ctx).
inline void install(ibv_context* ctx, ibv_pd* pd, IbDevice* dev) {
  Verbs& v = verbs();
  v.create_cq = create_cq;
  v.destroy_cq = destroy_cq;
  v.create_qp = create_qp;
  v.destroy_qp = destroy_qp;
  v.modify_qp = modify_qp;
  v.query_qp = query_qp;
  v.reg_mr = reg_mr;
  v.dereg_mr = dereg_mr;
  v.wc_status_str = wc_status_str;
  pd->context = ctx;
  dev->name = "fake0";
  dev->link_layer = IBV_LINK_LAYER_ETHERNET;
  dev->mtu = IBV_MTU_1024;
  dev->ctx = ctx;
  dev->pd = pd;
}

}  // namespace dq::net::ib::fake_verbs
