// What the socket and the verbs backend share around their comms: the registry of connects in
// progress (a connect call resumes the one its handle names), the checks of a memory handle and
// of a grouped receive's arguments, the device index check, the properties both report alike,
// and the close of a comm that carries a magic word.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>

#include "common/status.h"
#include "plugin/net_abi.h"
#include "plugin/net_log.h"

namespace dq::net {

using Clock = std::chrono::steady_clock;

// Milliseconds from `t` to now.
int64_t ms_since(Clock::time_point t);

// The first fields of every memory handle either backend returns: a magic word naming the
// backend's handles, then the registered bytes [base, base + size).
struct RegisteredRegion {
  uint32_t magic = 0;
  const char* base = nullptr;
  size_t size = 0;
};

// A buffer of `size` bytes at `data` against its memory handle: no handle (NULL) passes, a handle
// without `magic` or whose region does not hold every byte is refused (kInvalidArgument, logged).
Status check_region(const void* mhandle, uint32_t magic, const void* data, size_t size);

// n grouped receives for `call` ("irecv", "iflush"): min_n..kMaxGroupedRecvs.
Status check_grouped_count(const char* call, int n, int min_n);

// The buffers of an irecv: each inside its handle's region (handles of `mr_magic`; mhandles may
// be NULL) and not NULL when it has bytes.
Status check_recv_buffers(int n, void* const* data, const size_t* sizes, void* const* mhandles,
                          uint32_t mr_magic);

// `dev` indexes a list of `ndevs` devices; `kind` names them in the warning ("verbs device").
Status check_device_index(const char* kind, int dev, size_t ndevs);

// The v11 properties whose values both backends share: a host-memory device with one physical
// port, grouped receives up to kMaxGroupedRecvs and messages up to 1 GiB (test() reports sizes
// as int). The backend sets what differs (ptrSupport, forceFlush, port, maxComms) afterwards.
void fill_common_properties(int dev, const std::string& name, const std::string& pci_path,
                            uint64_t guid, int speed_mbps, dqNetPropertiesV11* props);

// The close of a listen, send or receive comm: NULL is a no-op, a comm without `magic` is refused
// with `foreign` as the warning, and the magic is cleared before the delete so that a second
// close of the same pointer is caught. `teardown` runs first (threads, sockets, queue pairs).
template <class Comm, class Teardown>
Status close_comm(Comm* c, uint32_t magic, const char* foreign, Teardown teardown) {
  if (c == nullptr) return Status::kOk;
  if (c->magic != magic) {
    NET_WARN("%s", foreign);
    return Status::kInvalidArgument;
  }
  teardown(c);
  c->magic = 0;
  delete c;
  return Status::kOk;
}

// Connects in progress of one backend, keyed by the pointer a connect stores in the caller's
// handle (its connect_state word), so that the next connect call with that handle resumes it.
// Both backends keep theirs in a static that is never destroyed: a proxy thread may still be
// connecting while the process exits, and a static set's destructor would run under it
// (ThreadSanitizer reported that race at exit).
class PendingConnects {
 public:
  // The connect that `connect_state` names, or NULL when it names none of this registry's.
  void* find(uint64_t connect_state);
  void add(void* pending);
  void remove(void* pending);

 private:
  std::mutex mu_;
  std::unordered_set<void*> set_;
};

// One connect call of a backend: resumes the connect `*connect_state` names, else starts one
// (`start` fills a fresh Pending; a failure drops it) and stores it in *connect_state; then
// `progress` advances it. Once it has made *send_comm or failed, it is forgotten and deleted and
// *connect_state is 0 again. The caller writes *connect_state back into the handle.
template <class Pending, class Start, class Progress>
Status drive_connect(PendingConnects& registry, uint64_t* connect_state, Start start,
                     Progress progress, void** send_comm) {
  auto* pc = static_cast<Pending*>(registry.find(*connect_state));
  if (pc == nullptr) {
    auto fresh = std::make_unique<Pending>();
    DQ_CHECK(start(fresh.get()));
    pc = fresh.release();
    registry.add(pc);
    *connect_state = reinterpret_cast<uint64_t>(pc);
  }
  const Status st = progress(pc, send_comm);
  if (st != Status::kOk || *send_comm != nullptr) {
    registry.remove(pc);
    delete pc;
    *connect_state = 0;
  }
  return st;
}

}  // namespace dq::net
