// The CPU NCCL's view of our net plugin: loads libnccl-net-dynamiq.so with dlopen and calls its
// ncclNetPlugin_v11 table. All point-to-point bytes (bootstrap included) go through it.
//
// Plugin search order: $DYNAMIQ_CPU_NCCL_NET_PLUGIN (a path), then "libnccl-net-dynamiq.so" on
// the library path, then ../../plugin/abi/libnccl-net-dynamiq.so next to this library's own
// build folder (found with dladdr).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "plugin/net_abi.h"

namespace dq::cpunccl {

constexpr size_t kNetHandleBytes = NCCL_NET_HANDLE_MAXSIZE;
struct NetHandle {
  unsigned char bytes[kNetHandleBytes];
};

// Thin checked wrapper; one per process, never unloaded.
class Net {
 public:
  // Loads the plugin once (thread-safe); later calls return the same instance or failure.
  static Status get(Net** net);

  Status init(uint64_t comm_id, void** ctx);
  void finalize(void* ctx);
  Status listen(void* ctx, NetHandle* handle, void** listen_comm);
  // Non-blocking: *send_comm stays null until the connection is established.
  Status connect(void* ctx, NetHandle* handle, void** send_comm);
  Status accept(void* listen_comm, void** recv_comm);
  Status reg(void* comm, void* data, size_t size, void** mhandle);
  void dereg(void* comm, void* mhandle);
  // *request stays null when the plugin would block: call again.
  Status isend(void* send_comm, void* data, size_t size, void* mhandle, void** request);
  Status irecv(void* recv_comm, void* data, size_t size, void* mhandle, void** request);
  Status test(void* request, bool* done, size_t* bytes);
  void close_send(void* comm);
  void close_recv(void* comm);
  void close_listen(void* comm);

  const char* name() const { return table_->name ? table_->name : "?"; }
  // Bytes the plugin accepts per message (maxP2pBytes, capped to what `test` can report).
  size_t max_message_bytes() const { return max_message_bytes_.load(std::memory_order_relaxed); }

 private:
  explicit Net(const dqNetV11* table) : table_(table) {}
  const dqNetV11* table_;
  // Set by every communicator's init (the same value), read by others made at the same time on
  // other threads (ncclCommInitAll, a thread a rank).
  std::atomic<size_t> max_message_bytes_{size_t{1} << 30};
};

}  // namespace dq::cpunccl
