// What the socket and the verbs backend share around their comms (net_backend_common.h).
#include "plugin/net_backend_common.h"

#include <cstring>

#include "plugin/net_backend.h"

namespace dq::net {

int64_t ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

Status check_region(const void* mhandle, uint32_t magic, const void* data, size_t size) {
  if (mhandle == nullptr) return Status::kOk;
  const auto* r = static_cast<const RegisteredRegion*>(mhandle);
  const char* p = static_cast<const char*>(data);
  if (r->magic != magic) {
    NET_WARN("memory handle %p is not registered with this plugin", mhandle);
    return Status::kInvalidArgument;
  }
  if (size > 0 && (p < r->base || p + size > r->base + r->size)) {
    NET_WARN("buffer %p+%zu lies outside its registered region %p+%zu", data, size,
             static_cast<const void*>(r->base), r->size);
    return Status::kInvalidArgument;
  }
  return Status::kOk;
}

Status check_grouped_count(const char* call, int n, int min_n) {
  if (n < min_n || n > kMaxGroupedRecvs) {
    NET_WARN("%s: %d grouped receives (maxRecvs is %d)", call, n, kMaxGroupedRecvs);
    return Status::kInvalidArgument;
  }
  return Status::kOk;
}

Status check_recv_buffers(int n, void* const* data, const size_t* sizes, void* const* mhandles,
                          uint32_t mr_magic) {
  for (int i = 0; i < n; ++i) {
    DQ_CHECK(
        check_region(mhandles != nullptr ? mhandles[i] : nullptr, mr_magic, data[i], sizes[i]));
    if (sizes[i] > 0 && data[i] == nullptr) {
      NET_WARN("irecv: NULL buffer for %zu bytes", sizes[i]);
      return Status::kInvalidArgument;
    }
  }
  return Status::kOk;
}

Status check_device_index(const char* kind, int dev, size_t ndevs) {
  if (dev < 0 || dev >= static_cast<int>(ndevs)) {
    NET_WARN("%s %d does not exist (%zu devices)", kind, dev, ndevs);
    return Status::kInvalidArgument;
  }
  return Status::kOk;
}

void fill_common_properties(int dev, const std::string& name, const std::string& pci_path,
                            uint64_t guid, int speed_mbps, dqNetPropertiesV11* props) {
  std::memset(props, 0, sizeof(*props));
  // NCCL reads these strings while the backend (which owns them) lives.
  props->name = const_cast<char*>(name.c_str());
  props->pciPath = pci_path.empty() ? nullptr : const_cast<char*>(pci_path.c_str());
  props->guid = guid;
  props->ptrSupport = NCCL_PTR_HOST;
  props->regIsGlobal = 0;
  props->forceFlush = 0;
  props->speed = speed_mbps;
  props->port = 0;
  props->latency = 0;
  props->maxComms = 65536;
  props->maxRecvs = kMaxGroupedRecvs;
  props->netDeviceType = DQNET_DEVICE_HOST;
  props->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION;
  props->vProps.ndevs = 1;
  props->vProps.devs[0] = dev;
  props->maxP2pBytes = 1ull << 30;  // sizes reported by test() are int
  props->maxCollBytes = 1ull << 30;
  props->maxMultiRequestSize = 1;
}

void* PendingConnects::find(uint64_t connect_state) {
  if (connect_state == 0) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = set_.find(reinterpret_cast<void*>(connect_state));
  return it != set_.end() ? *it : nullptr;
}

void PendingConnects::add(void* pending) {
  std::lock_guard<std::mutex> lock(mu_);
  set_.insert(pending);
}

void PendingConnects::remove(void* pending) {
  std::lock_guard<std::mutex> lock(mu_);
  set_.erase(pending);
}

}  // namespace dq::net
