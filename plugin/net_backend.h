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
  virtual Status init() = 0;
  virtual Status devices(int* ndev) = 0;
  virtual Status get_properties(int dev, dqNetPropertiesV11* props) = 0;
  // `handle` points at NCCL_NET_HANDLE_MAXSIZE bytes.
  virtual Status listen(const CommContext& ctx, int dev, void* handle, void** listen_comm) = 0;
  virtual Status connect(const CommContext& ctx, int dev, void* handle, void** send_comm) = 0;
  virtual Status accept(void* listen_comm, void** recv_comm) = 0;
  virtual Status reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) = 0;
  // Device memory exported as a DMA-BUF file descriptor (`offset` into it); only where the
  // device's properties advertise NCCL_PTR_DMABUF.
  virtual Status reg_mr_dma_buf(void* comm, void* data, size_t size, int type, uint64_t offset,
                                int fd, void** mhandle);
  virtual Status dereg_mr(void* comm, void* mhandle) = 0;
  virtual Status isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                       void** request) = 0;
  virtual Status irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
                       void** mhandles, void** request) = 0;
  // Makes completed receives into device memory visible to the device (GPUDirect RDMA); a NULL
  // *request: nothing to wait for.
  virtual Status iflush(void* recv_comm, int n, void** data, const int* sizes, void** mhandles,
                        void** request);
  // sizes (when non-NULL) gets one entry per grouped receive (one for a send).
  virtual Status test(void* request, int* done, int* sizes) = 0;
  virtual Status close_send(void* send_comm) = 0;
  virtual Status close_recv(void* recv_comm) = 0;
  virtual Status close_listen(void* listen_comm) = 0;
};

// The socket backend (plugin/socket/).
NetBackend& socket_backend();
// Whether the peer still holds its end of socket send comm `send_comm`: kOk while every socket
// is up, kSystemError (the comm fails, logged) once the peer closed or reset one or it failed.
// Never blocks. A send comm's sockets carry nothing back, so any byte, end of stream or error
// read on one says so. The verbs backend watches its side channel with it.
Status socket_send_peer_alive(void* send_comm);
// Drops the socket connect in progress that `handle` (a socket listen handle a connect call was
// given) names, closing its sockets, and zeroes its connect_state; nothing where it names none
// (not started, or already made or failed). For the verbs backend, whose set-up can give up on
// a side-channel connect that NCCL never calls again.
void socket_forget_connect(void* handle);

// The ibverbs backend (plugin/ibverbs/); usable only when ib_usable() says so.
NetBackend& ib_backend();
// Whether the ibverbs backend found an active, selected port; otherwise *why says what is
// missing (libibverbs, a device, an active port, an address). Initialises it on first call.
bool ib_usable(std::string* why);

}  // namespace dq::net
