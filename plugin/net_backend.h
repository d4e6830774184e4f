// The seam between the ABI tables and a transport. The tables (net_tables.cc) translate every
// ABI version to these calls; a backend implements them once: socket (plugin/socket/) or ibverbs
// (plugin/ibverbs/), chosen by DYNAMIQ_NET_BACKEND (net_tables.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"
#include "plugin/net_abi.h"

namespace dq::net {

// Per-communicator context (v11 init); v8..v10 use one without a communicator id.
struct CommContext {
  uint64_t comm_id = 0;
  bool has_comm_id = false;
  int traffic_class = NCCL_NET_TRAFFIC_CLASS_UNDEF;
};

// Largest number of receives grouped in one irecv.
inline constexpr int kMaxGroupedRecvs = 8;

class NetBackend {
 public:
  virtual ~NetBackend() = default;
  virtual Status Init() = 0;
  virtual Status Devices(int* ndev) = 0;
  virtual Status GetProperties(int dev, dqNetPropertiesV11* props) = 0;
  // `handle` points at NCCL_NET_HANDLE_MAXSIZE bytes.
  virtual Status Listen(const CommContext& ctx, int dev, void* handle, void** listen_comm) = 0;
  virtual Status Connect(const CommContext& ctx, int dev, void* handle, void** send_comm) = 0;
  virtual Status Accept(void* listen_comm, void** recv_comm) = 0;
  virtual Status RegMr(void* comm, void* data, size_t size, int type, void** mhandle) = 0;
  // Device memory exported as a DMA-BUF file descriptor (`offset` into it); only where the
  // device's properties advertise NCCL_PTR_DMABUF.
  virtual Status RegMrDmaBuf(void* comm, void* data, size_t size, int type, uint64_t offset,
                             int fd, void** mhandle);
  virtual Status DeregMr(void* comm, void* mhandle) = 0;
  virtual Status Isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                       void** request) = 0;
  virtual Status Irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
                       void** mhandles, void** request) = 0;
  // Makes completed receives into device memory visible to the device (GPUDirect RDMA); a NULL
  // *request: nothing to wait for.
  virtual Status Iflush(void* recv_comm, int n, void** data, const int* sizes, void** mhandles,
                        void** request);
  // sizes (when non-NULL) gets one entry per grouped receive (one for a send).
  virtual Status Test(void* request, int* done, int* sizes) = 0;
  virtual Status CloseSend(void* send_comm) = 0;
  virtual Status CloseRecv(void* recv_comm) = 0;
  virtual Status CloseListen(void* listen_comm) = 0;
};

// The socket backend (plugin/socket/).
NetBackend& SocketBackend();

// The ibverbs backend (plugin/ibverbs/); usable only when IbUsable() says so.
NetBackend& IbBackend();
// Whether the ibverbs backend found an active, selected port; otherwise *why says what is
// missing (libibverbs, a device, an active port, an address). Initialises it on first call.
bool IbUsable(std::string* why);

}  // namespace dq::net
