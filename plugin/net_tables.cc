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
#include "plugin/net_backend.h"
#include "plugin/net_env.h"
#include "plugin/net_log.h"

namespace dq::net {

// The defaults of the optional backend calls (the socket backend keeps them): DMA-BUF and flushes
// exist only for device memory, which a backend without GPUDirect never advertises.
Status NetBackend::RegMrDmaBuf(void* comm, void* data, size_t size, int type, uint64_t /*offset*/,
                               int /*fd*/, void** mhandle) {
  if (type == NCCL_PTR_HOST) return RegMr(comm, data, size, type, mhandle);
  NET_WARN("regMrDmaBuf: DMA-BUF memory (type %d) is not supported by this transport; host "
           "memory only",
           type);
  return Status::kInvalidArgument;
}

Status NetBackend::Iflush(void* /*recv_comm*/, int /*n*/, void** /*data*/, const int* /*sizes*/,
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

dqNetResult ToResult(Status s) { return static_cast<dqNetResult>(nccl_result(s)); }

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

NetBackend& Backend() {
  // DYNAMIQ_NET_BACKEND picks the transport once per process. A misconfiguration never breaks a
  // job: `ib` without a usable verbs port warns once and runs on sockets.
  static NetBackend* chosen = [] {
    NetEnv env = ReadNetEnv();
    if (env.backend == "socket") {
      NET_INFO("backend socket (DYNAMIQ_NET_BACKEND=socket)");
      return &SocketBackend();
    }
    std::string why;
    if (IbUsable(&why)) {
      NET_INFO("backend ib (DYNAMIQ_NET_BACKEND=%s, an active verbs port exists)",
               env.backend.c_str());
      return &IbBackend();
    }
    if (env.backend == "ib") {
      NET_WARN("DYNAMIQ_NET_BACKEND=ib but the verbs backend cannot run: %s; using socket",
               why.c_str());
    } else {
      NET_INFO("backend socket (DYNAMIQ_NET_BACKEND=auto: %s)", why.c_str());
    }
    return &SocketBackend();
  }();
  return *chosen;
}

const CommContext kNoCommContext{};

const CommContext& ContextOf(void* ctx) {
  return ctx != nullptr ? *static_cast<CommContext*>(ctx) : kNoCommContext;
}

// ---- shared entry points (same signature in every version) ----
dqNetResult Devices(int* ndev) {
  return Guard("devices",
               [&] { return ndev ? Backend().Devices(ndev) : Status::kInvalidArgument; });
}
dqNetResult Accept(void* listen_comm, void** recv_comm, dqNetDeviceHandle** /*dev_handle*/) {
  return Guard("accept", [&] { return Backend().Accept(listen_comm, recv_comm); });
}
dqNetResult RegMr(void* comm, void* data, size_t size, int type, void** mhandle) {
  return Guard("regMr", [&] { return Backend().RegMr(comm, data, size, type, mhandle); });
}
dqNetResult RegMrDmaBuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                        void** mhandle) {
  return Guard("regMrDmaBuf", [&] {
    return mhandle ? Backend().RegMrDmaBuf(comm, data, size, type, offset, fd, mhandle)
                   : Status::kInvalidArgument;
  });
}
dqNetResult DeregMr(void* comm, void* mhandle) {
  return Guard("deregMr", [&] { return Backend().DeregMr(comm, mhandle); });
}
dqNetResult Iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                   void** request) {
  return Guard("iflush", [&] {
    if (request == nullptr || (n > 0 && (data == nullptr || sizes == nullptr)))
      return Status::kInvalidArgument;
    *request = nullptr;
    return Backend().Iflush(recv_comm, n, data, sizes, mhandles, request);
  });
}
dqNetResult Test(void* request, int* done, int* sizes) {
  return Guard("test", [&] {
    return done ? Backend().Test(request, done, sizes) : Status::kInvalidArgument;
  });
}
dqNetResult CloseSend(void* c) {
  return Guard("closeSend", [&] { return Backend().CloseSend(c); });
}
dqNetResult CloseRecv(void* c) {
  return Guard("closeRecv", [&] { return Backend().CloseRecv(c); });
}
dqNetResult CloseListen(void* c) {
  return Guard("closeListen", [&] { return Backend().CloseListen(c); });
}
dqNetResult MakeVDevice(int* d, dqNetVDeviceProps* props) {
  return Guard("makeVDevice", [&] {
    int ndev = 0;
    DQ_CHECK(Backend().Devices(&ndev));
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
dqNetResult IsendSized(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                       void** request) {
  return Guard("isend",
               [&] { return Backend().Isend(send_comm, data, size, tag, mhandle, request); });
}
dqNetResult IrecvSized(void* recv_comm, int n, void** data, const size_t* sizes, int* tags,
                       void** mhandles, void** request) {
  return Guard("irecv", [&] {
    if (data == nullptr || sizes == nullptr || tags == nullptr || request == nullptr) {
      return Status::kInvalidArgument;
    }
    return Backend().Irecv(recv_comm, n, data, sizes, tags, mhandles, request);
  });
}

// ---- v11 ----
dqNetResult InitV11(void** ctx, uint64_t comm_id, dqNetCommConfig* config, dqNetLogger logger,
                    dqNetProfilerCallback /*profiler*/) {
  return Guard("init", [&] {
    if (logger != nullptr) SetNetLogger(logger);
    DQ_CHECK(Backend().Init());
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
dqNetResult GetPropertiesV11(int dev, dqNetPropertiesV11* props) {
  return Guard("getProperties", [&] {
    return props ? Backend().GetProperties(dev, props) : Status::kInvalidArgument;
  });
}
dqNetResult ListenV11(void* ctx, int dev, void* handle, void** listen_comm) {
  return Guard("listen",
               [&] { return Backend().Listen(ContextOf(ctx), dev, handle, listen_comm); });
}
dqNetResult ConnectV11(void* ctx, int dev, void* handle, void** send_comm,
                       dqNetDeviceHandle** /*dev_handle*/) {
  return Guard("connect",
               [&] { return Backend().Connect(ContextOf(ctx), dev, handle, send_comm); });
}
dqNetResult IsendV11(void* c, void* data, size_t size, int tag, void* mh, void* /*phandle*/,
                     void** request) {
  return IsendSized(c, data, size, tag, mh, request);
}
dqNetResult IrecvV11(void* c, int n, void** data, size_t* sizes, int* tags, void** mh,
                     void** /*phandles*/, void** request) {
  return IrecvSized(c, n, data, sizes, tags, mh, request);
}
dqNetResult FinalizeV11(void* ctx) {
  delete static_cast<CommContext*>(ctx);
  return dqNetSuccess;
}
dqNetResult SetNetAttrV11(void* /*ctx*/, dqNetAttr* /*attr*/) {
  return dqNetSuccess;
}

// ---- v10 / v9 / v8 adapters ----
dqNetResult InitV10(dqNetLogger logger, dqNetProfilerCallback profiler) {
  return InitV11(nullptr, 0, nullptr, logger, profiler);
}
dqNetResult InitV9(dqNetLogger logger) {
  return InitV11(nullptr, 0, nullptr, logger, nullptr);
}

dqNetResult GetPropertiesV10(int dev, dqNetPropertiesV10* out) {
  dqNetPropertiesV11 p;
  dqNetResult r = GetPropertiesV11(dev, out ? &p : nullptr);
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
dqNetResult GetPropertiesV8(int dev, dqNetPropertiesV8* out) {
  dqNetPropertiesV11 p;
  dqNetResult r = GetPropertiesV11(dev, out ? &p : nullptr);
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
dqNetResult ListenOld(int dev, void* handle, void** listen_comm) {
  return ListenV11(nullptr, dev, handle, listen_comm);
}
dqNetResult ConnectV10(int dev, dqNetCommConfig* /*config*/, void* handle, void** send_comm,
                       dqNetDeviceHandle** dh) {
  return ConnectV11(nullptr, dev, handle, send_comm, dh);
}
dqNetResult ConnectOld(int dev, void* handle, void** send_comm, dqNetDeviceHandle** dh) {
  return ConnectV11(nullptr, dev, handle, send_comm, dh);
}
dqNetResult IsendV10(void* c, void* data, size_t size, int tag, void* mh, void* /*phandle*/,
                     void** request) {
  return IsendSized(c, data, size, tag, mh, request);
}
dqNetResult IrecvV10(void* c, int n, void** data, size_t* sizes, int* tags, void** mh,
                     void** /*phandles*/, void** request) {
  return IrecvSized(c, n, data, sizes, tags, mh, request);
}
dqNetResult IsendV9(void* c, void* data, size_t size, int tag, void* mh, void** request) {
  return IsendSized(c, data, size, tag, mh, request);
}
dqNetResult IrecvV9(void* c, int n, void** data, size_t* sizes, int* tags, void** mh,
                    void** request) {
  return IrecvSized(c, n, data, sizes, tags, mh, request);
}
dqNetResult IsendV8(void* c, void* data, int size, int tag, void* mh, void** request) {
  if (size < 0) {
    NET_WARN("isend: negative size %d", size);
    return dqNetInvalidArgument;
  }
  return IsendSized(c, data, static_cast<size_t>(size), tag, mh, request);
}
dqNetResult IrecvV8(void* c, int n, void** data, int* sizes, int* tags, void** mh, void** request) {
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
  return IrecvSized(c, n, data, wide, tags, mh, request);
}

constexpr const char* kName = "dynamiq";

}  // namespace

const dqNetV11& NetTableV11() {
  static const dqNetV11 table = {kName,
                                 InitV11,
                                 Devices,
                                 GetPropertiesV11,
                                 ListenV11,
                                 ConnectV11,
                                 Accept,
                                 RegMr,
                                 RegMrDmaBuf,
                                 DeregMr,
                                 IsendV11,
                                 IrecvV11,
                                 Iflush,
                                 Test,
                                 CloseSend,
                                 CloseRecv,
                                 CloseListen,
                                 /*getDeviceMr=*/nullptr,
                                 /*irecvConsumed=*/nullptr,
                                 MakeVDevice,
                                 FinalizeV11,
                                 SetNetAttrV11};
  return table;
}

const dqNetV10& NetTableV10() {
  static const dqNetV10 table = {
      kName,     InitV10,     Devices,     GetPropertiesV10, ListenOld, ConnectV10, Accept,
      RegMr,     RegMrDmaBuf, DeregMr,     IsendV10,         IrecvV10,  Iflush,     Test,
      CloseSend, CloseRecv,   CloseListen, nullptr,          nullptr,   MakeVDevice};
  return table;
}

const dqNetV9& NetTableV9() {
  static const dqNetV9 table = {
      kName,     InitV9,      Devices,     GetPropertiesV10, ListenOld, ConnectOld, Accept,
      RegMr,     RegMrDmaBuf, DeregMr,     IsendV9,          IrecvV9,   Iflush,     Test,
      CloseSend, CloseRecv,   CloseListen, nullptr,          nullptr,   MakeVDevice};
  return table;
}

const dqNetV8& NetTableV8() {
  static const dqNetV8 table = {
      kName,     InitV9,      Devices,     GetPropertiesV8, ListenOld, ConnectOld, Accept,
      RegMr,     RegMrDmaBuf, DeregMr,     IsendV8,         IrecvV8,   Iflush,     Test,
      CloseSend, CloseRecv,   CloseListen, nullptr,         nullptr};
  return table;
}

}  // namespace dq::net
