// The one C-ABI boundary of the net plugin: every entry point converts dq::Status to the NCCL
// result code and no exception crosses it. Older versions adapt their argument types to v11.
#include "plugin/net_tables.h"

#include <climits>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "common/abi_guard.h"
#include "common/nccl_result.h"
#include "config/settings.h"
#include "plugin/net_backend.h"
#include "plugin/net_devices.h"
#include "plugin/net_env.h"
#include "plugin/net_log.h"

namespace dq::net {

// The defaults of the optional backend calls (the socket backend keeps them): DMA-BUF and flushes
// exist only for device memory, which a backend without GPUDirect never advertises.
Status NetBackend::reg_mr_dma_buf(void* comm, void* data, size_t size, int type,
                                  uint64_t /*offset*/, int /*fd*/, void** mhandle) {
  if (type == NCCL_PTR_HOST) return reg_mr(comm, data, size, type, mhandle);
  NET_WARN(
      "regMrDmaBuf: DMA-BUF memory (type %d) is not supported by this transport; host "
      "memory only",
      type);
  return Status::kInvalidArgument;
}

Status NetBackend::iflush(void* /*recv_comm*/, int /*n*/, void** /*data*/, const int* /*sizes*/,
                          void** /*mhandles*/, void** request) {
  *request = nullptr;  // host memory needs no flush: nothing to wait for
  return Status::kOk;
}
namespace {

// NCCL's result values (common/nccl_result.h): dqNetResult is NCCL's enum under another name.
static_assert(dqNetSuccess == static_cast<int>(ncclSuccess) &&
              dqNetSystemError == static_cast<int>(ncclSystemError) &&
              dqNetInternalError == static_cast<int>(ncclInternalError) &&
              dqNetInvalidArgument == static_cast<int>(ncclInvalidArgument) &&
              dqNetInvalidUsage == static_cast<int>(ncclInvalidUsage) &&
              dqNetRemoteError == static_cast<int>(ncclRemoteError));

dqNetResult ToResult(Status s) {
  return static_cast<dqNetResult>(nccl_result(s));
}

template <typename Fn>
dqNetResult Guard(const char* what, Fn&& fn) {
  return abi_guard([&] { return ToResult(fn()); },
                   [what](AbiFault fault, const char* exception_text) {
                     switch (fault) {
                       case AbiFault::kOutOfMemory:
                         NET_WARN("%s: out of memory", what);
                         return dqNetSystemError;
                       case AbiFault::kException:
                         NET_WARN("%s: %s", what, exception_text);
                         return dqNetInternalError;
                       case AbiFault::kUnknown:
                         break;
                     }
                     NET_WARN("%s: unknown exception", what);
                     return dqNetInternalError;
                   });
}

NetBackend& backend() {
  // DYNAMIQ_NET_BACKEND picks the transport once per process. A misconfiguration never breaks a
  // job: `ib` without a usable verbs port warns once and runs on sockets.
  static NetBackend* chosen = [] {
    NetEnv env = read_net_env();
    if (env.backend == "socket") {
      // The default, on a machine with an RDMA fabric: the job that loaded this plugin in place
      // of NCCL's own transports would otherwise move its inter-node bytes over TCP unawares
      // (unless it turned verbs off, as NCCL_IB_DISABLE=1 does for NCCL's own).
      const std::string port = config::set_in_environment("DYNAMIQ_NET_BACKEND") || env.ib_disable
                                   ? std::string()
                                   : first_active_verbs_port();
      if (!port.empty()) {
        NET_WARN(
            "backend socket (DYNAMIQ_NET_BACKEND unset: the default) although verbs port %s is "
            "active: the traffic goes over TCP; DYNAMIQ_NET_BACKEND=auto uses the verbs ports "
            "(=socket keeps TCP without this warning)",
            port.c_str());
      } else {
        NET_INFO("backend socket (DYNAMIQ_NET_BACKEND=socket)");
      }
      return &socket_backend();
    }
    std::string why;
    if (env.backend == "auto" && env.ib_disable) {
      NET_INFO(
          "backend socket (DYNAMIQ_NET_BACKEND=auto, verbs turned off by "
          "DYNAMIQ_NET_IB_DISABLE or NCCL_IB_DISABLE)");
      return &socket_backend();
    }
    if (ib_usable(&why)) {
      NET_INFO("backend ib (DYNAMIQ_NET_BACKEND=%s, an active verbs port exists)",
               env.backend.c_str());
      return &ib_backend();
    }
    if (env.backend == "ib") {
      NET_WARN("DYNAMIQ_NET_BACKEND=ib but the verbs backend cannot run: %s; using socket",
               why.c_str());
    } else {
      NET_INFO("backend socket (DYNAMIQ_NET_BACKEND=auto: %s)", why.c_str());
    }
    return &socket_backend();
  }();
  return *chosen;
}

const CommContext kNoCommContext{};

const CommContext& context_of(void* ctx) {
  return ctx != nullptr ? *static_cast<CommContext*>(ctx) : kNoCommContext;
}

// ---- shared entry points (same signature in every version) ----
dqNetResult devices(int* ndev) {
  return Guard("devices",
               [&] { return ndev ? backend().devices(ndev) : Status::kInvalidArgument; });
}
dqNetResult accept(void* listen_comm, void** recv_comm, dqNetDeviceHandle** /*dev_handle*/) {
  return Guard("accept", [&] { return backend().accept(listen_comm, recv_comm); });
}
dqNetResult reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  return Guard("regMr", [&] { return backend().reg_mr(comm, data, size, type, mhandle); });
}
dqNetResult reg_mr_dma_buf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                           void** mhandle) {
  return Guard("regMrDmaBuf", [&] {
    return mhandle ? backend().reg_mr_dma_buf(comm, data, size, type, offset, fd, mhandle)
                   : Status::kInvalidArgument;
  });
}
dqNetResult dereg_mr(void* comm, void* mhandle) {
  return Guard("deregMr", [&] { return backend().dereg_mr(comm, mhandle); });
}
dqNetResult iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                   void** request) {
  return Guard("iflush", [&] {
    if (request == nullptr || (n > 0 && (data == nullptr || sizes == nullptr)))
      return Status::kInvalidArgument;
    *request = nullptr;
    return backend().iflush(recv_comm, n, data, sizes, mhandles, request);
  });
}
dqNetResult test(void* request, int* done, int* sizes) {
  return Guard("test", [&] {
    return done ? backend().test(request, done, sizes) : Status::kInvalidArgument;
  });
}
dqNetResult close_send(void* c) {
  return Guard("closeSend", [&] { return backend().close_send(c); });
}
dqNetResult close_recv(void* c) {
  return Guard("closeRecv", [&] { return backend().close_recv(c); });
}
dqNetResult close_listen(void* c) {
  return Guard("closeListen", [&] { return backend().close_listen(c); });
}
dqNetResult make_vdevice(int* d, dqNetVDeviceProps* props) {
  return Guard("makeVDevice", [&] {
    int ndev = 0;
    DQ_CHECK(backend().devices(&ndev));
    if (d == nullptr || props == nullptr || props->ndevs != 1 || props->devs[0] < 0 ||
        props->devs[0] >= ndev) {
      NET_WARN("makeVDevice: only single-device virtual NICs are supported (ndevs=%d)",
               props ? props->ndevs : -1);
      return Status::kUnsupported;
    }
    *d = props->devs[0];
    return Status::kOk;
  });
}
dqNetResult isend_sized(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                        void** request) {
  return Guard("isend",
               [&] { return backend().isend(send_comm, data, size, tag, mhandle, request); });
}
dqNetResult irecv_sized(void* recv_comm, int n, void** data, const size_t* sizes, int* tags,
                        void** mhandles, void** request) {
  return Guard("irecv", [&] {
    if (data == nullptr || sizes == nullptr || tags == nullptr || request == nullptr) {
      return Status::kInvalidArgument;
    }
    return backend().irecv(recv_comm, n, data, sizes, tags, mhandles, request);
  });
}

// ---- v11 ----
dqNetResult init_v11(void** ctx, uint64_t comm_id, dqNetCommConfig* config, dqNetLogger logger,
                     dqNetProfilerCallback /*profiler*/) {
  return Guard("init", [&] {
    if (logger != nullptr) set_net_logger(logger);
    DQ_CHECK(backend().init());
    if (ctx != nullptr) {
      auto* c = new CommContext;
      c->comm_id = comm_id;
      c->has_comm_id = true;
      if (config != nullptr) c->traffic_class = config->trafficClass;
      *ctx = c;
    }
    return Status::kOk;
  });
}
dqNetResult get_properties_v11(int dev, dqNetPropertiesV11* props) {
  return Guard("getProperties", [&] {
    return props ? backend().get_properties(dev, props) : Status::kInvalidArgument;
  });
}
dqNetResult listen_v11(void* ctx, int dev, void* handle, void** listen_comm) {
  return Guard("listen",
               [&] { return backend().listen(context_of(ctx), dev, handle, listen_comm); });
}
dqNetResult connect_v11(void* ctx, int dev, void* handle, void** send_comm,
                        dqNetDeviceHandle** /*dev_handle*/) {
  return Guard("connect",
               [&] { return backend().connect(context_of(ctx), dev, handle, send_comm); });
}
dqNetResult isend_v11(void* c, void* data, size_t size, int tag, void* mh, void* /*phandle*/,
                      void** request) {
  return isend_sized(c, data, size, tag, mh, request);
}
dqNetResult irecv_v11(void* c, int n, void** data, size_t* sizes, int* tags, void** mh,
                      void** /*phandles*/, void** request) {
  return irecv_sized(c, n, data, sizes, tags, mh, request);
}
dqNetResult finalize_v11(void* ctx) {
  delete static_cast<CommContext*>(ctx);
  return dqNetSuccess;
}
dqNetResult set_net_attr_v11(void* /*ctx*/, dqNetAttr* /*attr*/) {
  return dqNetSuccess;
}

// ---- v10 / v9 / v8 adapters ----
dqNetResult init_v10(dqNetLogger logger, dqNetProfilerCallback profiler) {
  return init_v11(nullptr, 0, nullptr, logger, profiler);
}
dqNetResult init_v9(dqNetLogger logger) {
  return init_v11(nullptr, 0, nullptr, logger, nullptr);
}

dqNetResult get_properties_v10(int dev, dqNetPropertiesV10* out) {
  dqNetPropertiesV11 p;
  dqNetResult r = get_properties_v11(dev, out ? &p : nullptr);
  if (r != dqNetSuccess) return r;
  out->name = p.name;
  out->pciPath = p.pciPath;
  out->guid = p.guid;
  out->ptrSupport = p.ptrSupport;
  out->regIsGlobal = p.regIsGlobal;
  out->forceFlush = p.forceFlush;
  out->speed = p.speed;
  out->port = p.port;
  out->latency = p.latency;
  out->maxComms = p.maxComms;
  out->maxRecvs = p.maxRecvs;
  out->netDeviceType = p.netDeviceType;
  out->netDeviceVersion = p.netDeviceVersion;
  out->vProps = p.vProps;
  out->maxP2pBytes = p.maxP2pBytes;
  out->maxCollBytes = p.maxCollBytes;
  return dqNetSuccess;
}
dqNetResult get_properties_v8(int dev, dqNetPropertiesV8* out) {
  dqNetPropertiesV11 p;
  dqNetResult r = get_properties_v11(dev, out ? &p : nullptr);
  if (r != dqNetSuccess) return r;
  out->name = p.name;
  out->pciPath = p.pciPath;
  out->guid = p.guid;
  out->ptrSupport = p.ptrSupport;
  out->regIsGlobal = p.regIsGlobal;
  out->speed = p.speed;
  out->port = p.port;
  out->latency = p.latency;
  out->maxComms = p.maxComms;
  out->maxRecvs = p.maxRecvs;
  out->netDeviceType = p.netDeviceType;
  out->netDeviceVersion = p.netDeviceVersion;
  return dqNetSuccess;
}
dqNetResult listen_old(int dev, void* handle, void** listen_comm) {
  return listen_v11(nullptr, dev, handle, listen_comm);
}
dqNetResult connect_v10(int dev, dqNetCommConfig* /*config*/, void* handle, void** send_comm,
                        dqNetDeviceHandle** dh) {
  return connect_v11(nullptr, dev, handle, send_comm, dh);
}
dqNetResult connect_old(int dev, void* handle, void** send_comm, dqNetDeviceHandle** dh) {
  return connect_v11(nullptr, dev, handle, send_comm, dh);
}
dqNetResult isend_v10(void* c, void* data, size_t size, int tag, void* mh, void* /*phandle*/,
                      void** request) {
  return isend_sized(c, data, size, tag, mh, request);
}
dqNetResult irecv_v10(void* c, int n, void** data, size_t* sizes, int* tags, void** mh,
                      void** /*phandles*/, void** request) {
  return irecv_sized(c, n, data, sizes, tags, mh, request);
}
dqNetResult isend_v9(void* c, void* data, size_t size, int tag, void* mh, void** request) {
  return isend_sized(c, data, size, tag, mh, request);
}
dqNetResult irecv_v9(void* c, int n, void** data, size_t* sizes, int* tags, void** mh,
                     void** request) {
  return irecv_sized(c, n, data, sizes, tags, mh, request);
}
dqNetResult isend_v8(void* c, void* data, int size, int tag, void* mh, void** request) {
  if (size < 0) {
    NET_WARN("isend: negative size %d", size);
    return dqNetInvalidArgument;
  }
  return isend_sized(c, data, static_cast<size_t>(size), tag, mh, request);
}
dqNetResult irecv_v8(void* c, int n, void** data, int* sizes, int* tags, void** mh,
                     void** request) {
  if (n < 1 || n > kMaxGroupedRecvs || sizes == nullptr) {
    NET_WARN("irecv: %d grouped receives (maxRecvs is %d)", n, kMaxGroupedRecvs);
    return dqNetInvalidArgument;
  }
  size_t wide[kMaxGroupedRecvs];
  for (int i = 0; i < n; ++i) {
    if (sizes[i] < 0) {
      NET_WARN("irecv: negative size %d", sizes[i]);
      return dqNetInvalidArgument;
    }
    wide[i] = static_cast<size_t>(sizes[i]);
  }
  return irecv_sized(c, n, data, wide, tags, mh, request);
}

constexpr const char* kName = "dynamiq";

}  // namespace

const dqNetV11& net_table_v11() {
  static const dqNetV11 table = {kName,
                                 init_v11,
                                 devices,
                                 get_properties_v11,
                                 listen_v11,
                                 connect_v11,
                                 accept,
                                 reg_mr,
                                 reg_mr_dma_buf,
                                 dereg_mr,
                                 isend_v11,
                                 irecv_v11,
                                 iflush,
                                 test,
                                 close_send,
                                 close_recv,
                                 close_listen,
                                 /*getDeviceMr=*/nullptr,
                                 /*irecvConsumed=*/nullptr,
                                 make_vdevice,
                                 finalize_v11,
                                 set_net_attr_v11};
  return table;
}

const dqNetV10& net_table_v10() {
  static const dqNetV10 table = {kName,          init_v10,    devices,    get_properties_v10,
                                 listen_old,     connect_v10, accept,     reg_mr,
                                 reg_mr_dma_buf, dereg_mr,    isend_v10,  irecv_v10,
                                 iflush,         test,        close_send, close_recv,
                                 close_listen,   nullptr,     nullptr,    make_vdevice};
  return table;
}

const dqNetV9& net_table_v9() {
  static const dqNetV9 table = {kName,          init_v9,     devices,    get_properties_v10,
                                listen_old,     connect_old, accept,     reg_mr,
                                reg_mr_dma_buf, dereg_mr,    isend_v9,   irecv_v9,
                                iflush,         test,        close_send, close_recv,
                                close_listen,   nullptr,     nullptr,    make_vdevice};
  return table;
}

const dqNetV8& net_table_v8() {
  static const dqNetV8 table = {
      kName,      init_v9,        devices,      get_properties_v8, listen_old, connect_old, accept,
      reg_mr,     reg_mr_dma_buf, dereg_mr,     isend_v8,          irecv_v8,   iflush,      test,
      close_send, close_recv,     close_listen, nullptr,           nullptr};
  return table;
}

}  // namespace dq::net
