#include "tools/cpu-nccl/net.h"

#include <dlfcn.h>

#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "config/settings.h"

namespace dq::cpunccl {
namespace {

constexpr const char* kPluginName = "libnccl-net-dynamiq.so";
constexpr const char* kPluginSymbol = "ncclNetPlugin_v11";

// NCCL's logger signature; the plugin's WARN/INFO lines end up in our log.
void plugin_logger(dqNetLogLevel level, unsigned long /*flags*/, const char* file, int line,
                   const char* fmt, ...) {
  char body[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(body, sizeof body, fmt, ap);
  va_end(ap);
  if (level == dqNetLogWarn || level == dqNetLogAbort) {
    ::dq::log_message(LogLevel::kWarn, Subsys::kNet, file ? file : "plugin", line, "%s", body);
  } else if (level == dqNetLogInfo || level == dqNetLogVersion) {
    DQ_INFO(Subsys::kNet, "plugin: %s", body);
  } else if (level == dqNetLogTrace) {
    DQ_TRACE(Subsys::kNet, "plugin: %s", body);
  }
}

// Directory of this shared library (to find the plugin in the build tree).
std::string own_directory() {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&own_directory), &info) || !info.dli_fname) return "";
  std::string path = info.dli_fname;
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

void* open_plugin(std::string* tried) {
  if (const std::string path = config::current().cpu_nccl_net_plugin; !path.empty()) {
    *tried += path;
    return dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);  // an explicit path must not fall back
  }
  void* lib = dlopen(kPluginName, RTLD_NOW | RTLD_LOCAL);
  *tried += kPluginName;
  if (lib) return lib;
  std::string beside = own_directory() + "/../../plugin/abi/" + kPluginName;
  *tried += ", " + beside;
  return dlopen(beside.c_str(), RTLD_NOW | RTLD_LOCAL);
}

Status net_to_status(dqNetResult r) {
  switch (r) {
    case dqNetSuccess:
      return Status::kOk;
    case dqNetInvalidArgument:
    case dqNetInvalidUsage:
      return Status::kInvalidArgument;
    case dqNetInternalError:
      return Status::kInternal;
    // A peer's bytes failed validation (or it timed out): maps back to ncclRemoteError.
    case dqNetRemoteError:
      return Status::kMalformedPayload;
    default:
      return Status::kSystemError;
  }
}

#define DQ_NET_CALL(call, what)                                                            \
  do {                                                                                     \
    dqNetResult r_ = (call);                                                               \
    if (r_ != dqNetSuccess)                                                                \
      DQ_FAIL(net_to_status(r_), "net plugin %s failed (%d)", what, static_cast<int>(r_)); \
  } while (0)

}  // namespace

Status Net::get(Net** net) {
  static std::once_flag once;
  static Net* instance = nullptr;
  static Status load_status = Status::kInternal;
  std::call_once(once, [] {
    std::string tried;
    void* lib = open_plugin(&tried);
    if (!lib) {
      DQ_WARN(Subsys::kNet, "cpu-nccl: cannot load the net plugin (tried %s): %s", tried.c_str(),
              dlerror());
      load_status = Status::kSystemError;
      return;
    }
    auto* table = static_cast<const dqNetV11*>(dlsym(lib, kPluginSymbol));
    if (!table || !table->init || !table->listen || !table->connect || !table->accept ||
        !table->isend || !table->irecv || !table->test || !table->closeSend || !table->closeRecv ||
        !table->closeListen) {
      DQ_WARN(Subsys::kNet, "cpu-nccl: %s has no usable %s table", tried.c_str(), kPluginSymbol);
      load_status = Status::kSystemError;
      return;
    }
    instance = new Net(table);
    load_status = Status::kOk;
    DQ_INFO(Subsys::kNet, "cpu-nccl: using net plugin '%s' from %s", instance->name(),
            tried.c_str());
  });
  *net = instance;
  return load_status;
}

Status Net::init(uint64_t comm_id, void** ctx) {
  dqNetCommConfig config{NCCL_NET_TRAFFIC_CLASS_UNDEF};
  *ctx = nullptr;
  DQ_NET_CALL(table_->init(ctx, comm_id, &config, plugin_logger, nullptr), "init");
  int ndev = 0;
  if (table_->devices) DQ_NET_CALL(table_->devices(&ndev), "devices");
  if (ndev < 1) DQ_FAIL(Status::kUnsupported, "net plugin '%s' reports no device", name());
  if (table_->getProperties) {
    dqNetPropertiesV11 props{};
    DQ_NET_CALL(table_->getProperties(0, &props), "getProperties");
    if (!(props.ptrSupport & NCCL_PTR_HOST))
      DQ_FAIL(Status::kUnsupported, "net plugin device 0 does not support host memory");
    size_t limit = size_t{1} << 30;  // `test` reports sizes as int: stay well below INT_MAX
    if (props.maxP2pBytes > 0 && props.maxP2pBytes < limit) limit = props.maxP2pBytes;
    max_message_bytes_.store(limit, std::memory_order_relaxed);
  }
  return Status::kOk;
}

void Net::finalize(void* ctx) {
  if (ctx && table_->finalize) table_->finalize(ctx);
}

Status Net::listen(void* ctx, NetHandle* handle, void** listen_comm) {
  std::memset(handle->bytes, 0, sizeof handle->bytes);
  *listen_comm = nullptr;
  DQ_NET_CALL(table_->listen(ctx, 0, handle->bytes, listen_comm), "listen");
  if (!*listen_comm) DQ_FAIL(Status::kSystemError, "net plugin listen returned no comm");
  return Status::kOk;
}

Status Net::connect(void* ctx, NetHandle* handle, void** send_comm) {
  dqNetDeviceHandle* dev_handle = nullptr;
  DQ_NET_CALL(table_->connect(ctx, 0, handle->bytes, send_comm, &dev_handle), "connect");
  return Status::kOk;
}

Status Net::accept(void* listen_comm, void** recv_comm) {
  dqNetDeviceHandle* dev_handle = nullptr;
  DQ_NET_CALL(table_->accept(listen_comm, recv_comm, &dev_handle), "accept");
  return Status::kOk;
}

Status Net::reg(void* comm, void* data, size_t size, void** mhandle) {
  *mhandle = nullptr;
  if (!table_->regMr || size == 0) return Status::kOk;
  DQ_NET_CALL(table_->regMr(comm, data, size, NCCL_PTR_HOST, mhandle), "regMr");
  return Status::kOk;
}

void Net::dereg(void* comm, void* mhandle) {
  if (mhandle && table_->deregMr) table_->deregMr(comm, mhandle);
}

Status Net::isend(void* send_comm, void* data, size_t size, void* mhandle, void** request) {
  *request = nullptr;
  DQ_NET_CALL(table_->isend(send_comm, data, size, /*tag=*/0, mhandle, nullptr, request), "isend");
  return Status::kOk;
}

Status Net::irecv(void* recv_comm, void* data, size_t size, void* mhandle, void** request) {
  *request = nullptr;
  size_t sizes[1] = {size};
  int tags[1] = {0};
  void* datas[1] = {data};
  void* mhandles[1] = {mhandle};
  void* phandles[1] = {nullptr};
  DQ_NET_CALL(table_->irecv(recv_comm, 1, datas, sizes, tags, mhandles, phandles, request),
              "irecv");
  return Status::kOk;
}

Status Net::test(void* request, bool* done, size_t* bytes) {
  int finished = 0;
  int sizes[1] = {0};
  DQ_NET_CALL(table_->test(request, &finished, sizes), "test");
  *done = finished != 0;
  if (bytes) *bytes = static_cast<size_t>(sizes[0] < 0 ? 0 : sizes[0]);
  return Status::kOk;
}

void Net::close_send(void* comm) {
  if (comm) table_->closeSend(comm);
}
void Net::close_recv(void* comm) {
  if (comm) table_->closeRecv(comm);
}
void Net::close_listen(void* comm) {
  if (comm) table_->closeListen(comm);
}

}  // namespace dq::cpunccl
