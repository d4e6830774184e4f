// The NCCL external network plugin ABI ("ext-net"), versions 8 to 11, as NCCL 2.28 loads it.
//
// Written from the documented layout: field order, field types and function signatures match
// NCCL's ncclNet_v8_t .. ncclNet_v11_t; only the C type names here are ours (type names are not
// part of the ABI). The exported symbol names are: ncclNetPlugin_v11, _v10, _v9, _v8.
//
// How a consumer (NCCL itself, or our CPU NCCL) uses it:
//   void* lib = dlopen("libnccl-net-dynamiq.so", RTLD_NOW | RTLD_LOCAL);
//   auto* net = static_cast<const dqNetV11*>(dlsym(lib, "ncclNetPlugin_v11"));
//   void* ctx; net->init(&ctx, comm_id, &config, logger_or_null, nullptr);
//   net->devices(&n); net->getProperties(0, &props);
//   char handle[NCCL_NET_HANDLE_MAXSIZE];
//   net->listen(ctx, 0, handle, &listen_comm);      // receiver; ship `handle` to the sender
//   net->connect(ctx, 0, handle, &send_comm, &dh);  // sender; repeat while send_comm == NULL,
//                                                   // passing the SAME handle buffer each time
//                                                   // (like NCCL, the plugin keeps its connect
//                                                   // progress inside the handle bytes)
//   net->accept(listen_comm, &recv_comm, &dh);      // receiver; repeat while recv_comm == NULL
//   net->isend / irecv -> request (NULL = try again later), then test(request, &done, sizes)
//   until done; closeSend / closeRecv / closeListen; finalize(ctx).
// Every entry point returns a dqNetResult; never throws.
//
// Plain C so that C and C++ consumers share it; no NCCL header is needed (the result type is
// an int-sized enum, ABI-identical to ncclResult_t).
#ifndef DYNAMIQ_PLUGIN_NET_ABI_H_
#define DYNAMIQ_PLUGIN_NET_ABI_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---- constants (values fixed by NCCL) ----------------------------------------------------
#ifndef NCCL_NET_HANDLE_MAXSIZE
#define NCCL_NET_HANDLE_MAXSIZE 128  // bytes NCCL reserves for a listen handle
#endif
#ifndef NCCL_PTR_HOST
#define NCCL_PTR_HOST 0x1
#define NCCL_PTR_CUDA 0x2
#define NCCL_PTR_DMABUF 0x4
#endif
#ifndef NCCL_NET_MAX_REQUESTS
#define NCCL_NET_MAX_REQUESTS 32  // requests NCCL keeps in flight per comm
#endif
#ifndef NCCL_NET_MAX_DEVS_PER_NIC
#define NCCL_NET_MAX_DEVS_PER_NIC 4  // physical devices merged into one virtual NIC
#endif
#ifndef NCCL_NET_TRAFFIC_CLASS_UNDEF
#define NCCL_NET_TRAFFIC_CLASS_UNDEF -1
#endif
#ifndef NCCL_NET_DEVICE_INVALID_VERSION
#define NCCL_NET_DEVICE_INVALID_VERSION 0x0
#endif
// Largest maxP2pBytes / maxCollBytes NCCL accepts (1 TiB).
#define DQNET_MAX_NET_SIZE_BYTES (1024LL * 1024 * 1024 * 1024)

// ---- results and logging -----------------------------------------------------------------
// Same values as ncclResult_t.
typedef enum {
  dqNetSuccess = 0,
  dqNetUnhandledCudaError = 1,
  dqNetSystemError = 2,
  dqNetInternalError = 3,
  dqNetInvalidArgument = 4,
  dqNetInvalidUsage = 5,
  dqNetRemoteError = 6,
  dqNetInProgress = 7,
} dqNetResult;

// Same values as ncclDebugLogLevel.
typedef enum {
  dqNetLogNone = 0,
  dqNetLogVersion = 1,
  dqNetLogWarn = 2,
  dqNetLogInfo = 3,
  dqNetLogAbort = 4,
  dqNetLogTrace = 5,
} dqNetLogLevel;

// Subsystem flags (ncclDebugLogSubSys) a plugin passes with its messages.
#define DQNET_LOGSUB_INIT 1ul
#define DQNET_LOGSUB_NET 16ul

// NCCL's logger: level, subsystem flags, file, line, printf format.
typedef void (*dqNetLogger)(dqNetLogLevel level, unsigned long flags, const char* file, int line,
                            const char* fmt, ...);
// NCCL's profiler callback (v10+); we accept it and never call it.
typedef dqNetResult (*dqNetProfilerCallback)(void** event_handle, int type, void* phandle,
                                             int64_t plugin_id, void* ext_data);

// ---- shared structures -------------------------------------------------------------------
// ncclNetDeviceType: 0 = host (no device offload), 1 = unpack offload.
#define DQNET_DEVICE_HOST 0
#define DQNET_DEVICE_UNPACK 1

// Device-offload handle; identical for v8..v11. We never offload, so we never fill one.
typedef struct {
  int netDeviceType;  // enum, int-sized
  int netDeviceVersion;
  void* handle;
  size_t size;
  int needsProxyProgress;
} dqNetDeviceHandle;

typedef struct {
  int ndevs;
  int devs[NCCL_NET_MAX_DEVS_PER_NIC];
} dqNetVDeviceProps;  // v9, v10, v11

typedef struct {
  int trafficClass;  // plugin-specific; NCCL_NET_TRAFFIC_CLASS_UNDEF when unset
} dqNetCommConfig;   // v10 (connect), v11 (init)

// v8 properties (no forceFlush, no virtual devices, no size limits).
typedef struct {
  char* name;       // interface name, for logs
  char* pciPath;    // sysfs path of the PCI device (NULL is accepted)
  uint64_t guid;    // unique per physical NIC
  int ptrSupport;   // NCCL_PTR_* bit mask
  int regIsGlobal;  // 1: an mhandle is usable on every comm
  int speed;        // Mbps
  int port;
  float latency;  // microseconds
  int maxComms;
  int maxRecvs;  // receives grouped in one irecv
  int netDeviceType;
  int netDeviceVersion;
} dqNetPropertiesV8;

// v9 and v10 properties: v8 plus forceFlush (after regIsGlobal), vProps and size limits.
typedef struct {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;  // 1: NCCL must call iflush after every receive
  int speed;       // Mbps
  int port;
  float latency;  // microseconds
  int maxComms;
  int maxRecvs;
  int netDeviceType;
  int netDeviceVersion;
  dqNetVDeviceProps vProps;
  size_t maxP2pBytes;   // largest single point-to-point transfer
  size_t maxCollBytes;  // largest single collective transfer
} dqNetPropertiesV10;
typedef dqNetPropertiesV10 dqNetPropertiesV9;

// v11 properties: v10 plus maxMultiRequestSize at the end.
typedef struct {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;  // Mbps
  int port;
  float latency;  // microseconds
  int maxComms;
  int maxRecvs;
  int netDeviceType;
  int netDeviceVersion;
  dqNetVDeviceProps vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
  int maxMultiRequestSize;  // requests accepted in one multi-request (1 = feature unused)
} dqNetPropertiesV11;

// v11 application hints (setNetAttr); -1 = undefined.
typedef struct {
  int32_t maxConcurrentPeers;
  int32_t minConcurrentPeers;
  int32_t maxFlowsPerPeer;
  int32_t minFlowsPerPeer;
} dqNetCommAttr;
typedef struct {
  dqNetCommAttr sendCommAttr;
  dqNetCommAttr recvCommAttr;
  uint32_t op;
  uint32_t algo;
  uint32_t proto;
} dqNetAttr;

// ---- function tables ---------------------------------------------------------------------
// Semantics shared by all versions:
//  listen fills `handle` (<= NCCL_NET_HANDLE_MAXSIZE bytes) that the peer passes to connect.
//  connect/accept never block: they may succeed with *comm == NULL; call again until non-NULL.
//  isend/irecv may succeed with *request == NULL (would block); call again later.
//  irecv posts n grouped receives (n <= maxRecvs) with one request; sizes[i] is the capacity.
//  test sets *done; when done, sizes[i] (if non-NULL) gets the bytes actually transferred, and
//  the request is freed. An error from test means the request (and usually the comm) failed.

typedef struct {
  const char* name;
  dqNetResult (*init)(void** ctx, uint64_t commId, dqNetCommConfig* config, dqNetLogger logger,
                      dqNetProfilerCallback profiler);
  dqNetResult (*devices)(int* ndev);
  dqNetResult (*getProperties)(int dev, dqNetPropertiesV11* props);
  dqNetResult (*listen)(void* ctx, int dev, void* handle, void** listenComm);
  dqNetResult (*connect)(void* ctx, int dev, void* handle, void** sendComm,
                         dqNetDeviceHandle** sendDevComm);
  dqNetResult (*accept)(void* listenComm, void** recvComm, dqNetDeviceHandle** recvDevComm);
  dqNetResult (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  dqNetResult (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                             void** mhandle);
  dqNetResult (*deregMr)(void* comm, void* mhandle);
  dqNetResult (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                       void* phandle, void** request);
  dqNetResult (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags,
                       void** mhandles, void** phandles, void** request);
  dqNetResult (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                        void** request);
  dqNetResult (*test)(void* request, int* done, int* sizes);
  dqNetResult (*closeSend)(void* sendComm);
  dqNetResult (*closeRecv)(void* recvComm);
  dqNetResult (*closeListen)(void* listenComm);
  dqNetResult (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  dqNetResult (*irecvConsumed)(void* recvComm, int n, void* request);
  dqNetResult (*makeVDevice)(int* d, dqNetVDeviceProps* props);
  dqNetResult (*finalize)(void* ctx);
  dqNetResult (*setNetAttr)(void* ctx, dqNetAttr* netAttr);
} dqNetV11;

typedef struct {
  const char* name;
  dqNetResult (*init)(dqNetLogger logger, dqNetProfilerCallback profiler);
  dqNetResult (*devices)(int* ndev);
  dqNetResult (*getProperties)(int dev, dqNetPropertiesV10* props);
  dqNetResult (*listen)(int dev, void* handle, void** listenComm);
  dqNetResult (*connect)(int dev, dqNetCommConfig* config, void* handle, void** sendComm,
                         dqNetDeviceHandle** sendDevComm);
  dqNetResult (*accept)(void* listenComm, void** recvComm, dqNetDeviceHandle** recvDevComm);
  dqNetResult (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  dqNetResult (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                             void** mhandle);
  dqNetResult (*deregMr)(void* comm, void* mhandle);
  dqNetResult (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                       void* phandle, void** request);
  dqNetResult (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags,
                       void** mhandles, void** phandles, void** request);
  dqNetResult (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                        void** request);
  dqNetResult (*test)(void* request, int* done, int* sizes);
  dqNetResult (*closeSend)(void* sendComm);
  dqNetResult (*closeRecv)(void* recvComm);
  dqNetResult (*closeListen)(void* listenComm);
  dqNetResult (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  dqNetResult (*irecvConsumed)(void* recvComm, int n, void* request);
  dqNetResult (*makeVDevice)(int* d, dqNetVDeviceProps* props);
} dqNetV10;

typedef struct {
  const char* name;
  dqNetResult (*init)(dqNetLogger logger);
  dqNetResult (*devices)(int* ndev);
  dqNetResult (*getProperties)(int dev, dqNetPropertiesV9* props);
  dqNetResult (*listen)(int dev, void* handle, void** listenComm);
  dqNetResult (*connect)(int dev, void* handle, void** sendComm, dqNetDeviceHandle** sendDevComm);
  dqNetResult (*accept)(void* listenComm, void** recvComm, dqNetDeviceHandle** recvDevComm);
  dqNetResult (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  dqNetResult (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                             void** mhandle);
  dqNetResult (*deregMr)(void* comm, void* mhandle);
  dqNetResult (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                       void** request);
  dqNetResult (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags,
                       void** mhandles, void** request);
  dqNetResult (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                        void** request);
  dqNetResult (*test)(void* request, int* done, int* sizes);
  dqNetResult (*closeSend)(void* sendComm);
  dqNetResult (*closeRecv)(void* recvComm);
  dqNetResult (*closeListen)(void* listenComm);
  dqNetResult (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  dqNetResult (*irecvConsumed)(void* recvComm, int n, void* request);
  dqNetResult (*makeVDevice)(int* d, dqNetVDeviceProps* props);
} dqNetV9;

// v8: int sizes in isend/irecv, no makeVDevice.
typedef struct {
  const char* name;
  dqNetResult (*init)(dqNetLogger logger);
  dqNetResult (*devices)(int* ndev);
  dqNetResult (*getProperties)(int dev, dqNetPropertiesV8* props);
  dqNetResult (*listen)(int dev, void* handle, void** listenComm);
  dqNetResult (*connect)(int dev, void* handle, void** sendComm, dqNetDeviceHandle** sendDevComm);
  dqNetResult (*accept)(void* listenComm, void** recvComm, dqNetDeviceHandle** recvDevComm);
  dqNetResult (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  dqNetResult (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                             void** mhandle);
  dqNetResult (*deregMr)(void* comm, void* mhandle);
  dqNetResult (*isend)(void* sendComm, void* data, int size, int tag, void* mhandle,
                       void** request);
  dqNetResult (*irecv)(void* recvComm, int n, void** data, int* sizes, int* tags, void** mhandles,
                       void** request);
  dqNetResult (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                        void** request);
  dqNetResult (*test)(void* request, int* done, int* sizes);
  dqNetResult (*closeSend)(void* sendComm);
  dqNetResult (*closeRecv)(void* recvComm);
  dqNetResult (*closeListen)(void* listenComm);
  dqNetResult (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  dqNetResult (*irecvConsumed)(void* recvComm, int n, void* request);
} dqNetV8;

#ifdef __cplusplus
}  // extern "C"
#endif

// ---- layout checks (LP64) ------------------------------------------------------------------
#ifdef __cplusplus
#define DQNET_STATIC_ASSERT static_assert
#else
#define DQNET_STATIC_ASSERT _Static_assert
#endif
#if defined(__LP64__)
DQNET_STATIC_ASSERT(sizeof(dqNetResult) == sizeof(int), "result must be int-sized");
DQNET_STATIC_ASSERT(sizeof(dqNetDeviceHandle) == 32, "device handle layout");
DQNET_STATIC_ASSERT(sizeof(dqNetVDeviceProps) == 20, "vProps layout");
DQNET_STATIC_ASSERT(offsetof(dqNetPropertiesV8, guid) == 16, "v8 props layout");
DQNET_STATIC_ASSERT(offsetof(dqNetPropertiesV8, speed) == 32, "v8 props layout");
DQNET_STATIC_ASSERT(offsetof(dqNetPropertiesV8, netDeviceVersion) == 56, "v8 props layout");
DQNET_STATIC_ASSERT(sizeof(dqNetPropertiesV8) == 64, "v8 props layout");
DQNET_STATIC_ASSERT(offsetof(dqNetPropertiesV10, speed) == 36, "v10 props layout");
DQNET_STATIC_ASSERT(offsetof(dqNetPropertiesV10, vProps) == 64, "v10 props layout");
DQNET_STATIC_ASSERT(offsetof(dqNetPropertiesV10, maxP2pBytes) == 88, "v10 props layout");
DQNET_STATIC_ASSERT(sizeof(dqNetPropertiesV10) == 104, "v10 props layout");
DQNET_STATIC_ASSERT(offsetof(dqNetPropertiesV11, maxMultiRequestSize) == 104, "v11 props layout");
DQNET_STATIC_ASSERT(sizeof(dqNetPropertiesV11) == 112, "v11 props layout");
DQNET_STATIC_ASSERT(sizeof(dqNetAttr) == 44, "net attr layout");
DQNET_STATIC_ASSERT(sizeof(dqNetV8) == 19 * sizeof(void*), "v8 table: name + 18 functions");
DQNET_STATIC_ASSERT(sizeof(dqNetV9) == 20 * sizeof(void*), "v9 table: name + 19 functions");
DQNET_STATIC_ASSERT(sizeof(dqNetV10) == 20 * sizeof(void*), "v10 table: name + 19 functions");
DQNET_STATIC_ASSERT(sizeof(dqNetV11) == 22 * sizeof(void*), "v11 table: name + 21 functions");
DQNET_STATIC_ASSERT(offsetof(dqNetV11, finalize) == 20 * sizeof(void*), "v11 table layout");
#endif

#endif  // DYNAMIQ_PLUGIN_NET_ABI_H_
