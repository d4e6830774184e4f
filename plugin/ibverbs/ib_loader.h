// libibverbs, loaded at run time: dlopen("libibverbs.so.1") and a table of the entry points the
// backend calls, so that the plugin loads on machines without rdma-core. The types come from
// <infiniband/verbs.h>; the data-path calls (ibv_post_send, ibv_post_recv, ibv_poll_cq) are
// inline in that header and go through the device context, not through this table.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <string>

namespace dq::net::ib {

struct Verbs {
  void* lib = nullptr;
  ibv_device** (*get_device_list)(int*) = nullptr;
  void (*free_device_list)(ibv_device**) = nullptr;
  const char* (*get_device_name)(ibv_device*) = nullptr;
  __be64 (*get_device_guid)(ibv_device*) = nullptr;
  ibv_context* (*open_device)(ibv_device*) = nullptr;
  int (*close_device)(ibv_context*) = nullptr;
  int (*query_device)(ibv_context*, ibv_device_attr*) = nullptr;
  int (*query_port)(ibv_context*, uint8_t, ibv_port_attr*) = nullptr;
  int (*query_gid)(ibv_context*, uint8_t, int, ibv_gid*) = nullptr;
  ibv_pd* (*alloc_pd)(ibv_context*) = nullptr;
  int (*dealloc_pd)(ibv_pd*) = nullptr;
  ibv_mr* (*reg_mr)(ibv_pd*, void*, size_t, int) = nullptr;
  int (*dereg_mr)(ibv_mr*) = nullptr;
  ibv_cq* (*create_cq)(ibv_context*, int, void*, ibv_comp_channel*, int) = nullptr;
  int (*destroy_cq)(ibv_cq*) = nullptr;
  ibv_qp* (*create_qp)(ibv_pd*, ibv_qp_init_attr*) = nullptr;
  int (*destroy_qp)(ibv_qp*) = nullptr;
  int (*modify_qp)(ibv_qp*, ibv_qp_attr*, int) = nullptr;
  int (*query_qp)(ibv_qp*, ibv_qp_attr*, int, ibv_qp_init_attr*) = nullptr;
  const char* (*wc_status_str)(ibv_wc_status) = nullptr;
  // Optional (rdma-core 35 and later for the second): fork support, asked for before any
  // verbs resource exists (ib_discovery.cc).
  int (*fork_init)() = nullptr;
  ibv_fork_status (*is_fork_initialized)() = nullptr;
  // Optional (rdma-core 28 and later): a registration with optional access flags (relaxed
  // ordering), which ibv_reg_mr's exported symbol does not take.
  ibv_mr* (*reg_mr_iova2)(ibv_pd*, void*, size_t, uint64_t iova, unsigned access) = nullptr;
  // Optional (rdma-core 34 and later): device memory exported as a DMA-BUF.
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd*, uint64_t offset, size_t length, uint64_t iova, int fd,
                           int access) = nullptr;
};

// Opens libibverbs.so.1 and fills *v; false with *why naming the missing library or symbol.
bool load_verbs(Verbs* v, std::string* why);

// The process's table (filled by the first discovery, ib_discovery.cc). Never destroyed: comms
// may outlive statics.
Verbs& verbs();

}  // namespace dq::net::ib
