// The NCCL 2.28 host API as the CPU NCCL implements it: types and entry points.
//
// Written from the documented ABI (enum values, struct layouts, signatures of NCCL 2.28); the
// names are NCCL's because programs link against them. tests/nccl/abi_vs_real_header_test.cc
// checks every value and offset here against the real nccl.h when one is installed.
// The CPU NCCL, the shim and their tests include this header; applications keep using nccl.h.
#ifndef DYNAMIQ_COMMON_NCCL_API_H_
#define DYNAMIQ_COMMON_NCCL_API_H_

#include <limits.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DQ_NCCL_EXPORT __attribute__((visibility("default")))

// Version reported by ncclGetVersion: 2.28.9 (code = major*10000 + minor*100 + patch).
#define DQ_NCCL_VERSION_CODE 22809
#define DQ_NCCL_CONFIG_MAGIC 0xcafebeefu
#define DQ_NCCL_SPLIT_NOCOLOR (-1)
#define DQ_NCCL_CONFIG_UNDEF_INT INT_MIN
#define DQ_NCCL_UNIQUE_ID_BYTES 128
// ncclCommShrink's flags (NCCL 2.27+): DEFAULT shrinks a healthy parent; ABORT first ends the
// parent's operations in flight (a parent with a dead or hung peer).
#define DQ_NCCL_SHRINK_DEFAULT 0x00
#define DQ_NCCL_SHRINK_ABORT 0x01
// ncclCommRevoke's flags (NCCL 2.28+): only the default exists.
#define DQ_NCCL_REVOKE_DEFAULT 0x00

// In C++ the enums get int as their fixed underlying type (the C ABI is unchanged: NCCL's enums
// are int-sized). Without it a caller's out-of-range value (a bad dtype, a negative op) is
// undefined the moment it is loaded, before any validation (UBSan's enum check reported it).
#ifdef __cplusplus
#define DQ_NCCL_ENUM enum : int
#else
#define DQ_NCCL_ENUM enum
#endif

typedef struct ncclComm* ncclComm_t;
typedef struct CUstream_st* cudaStream_t;  // accepted and ignored: everything is host memory

typedef struct {
  char internal[DQ_NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef DQ_NCCL_ENUM{
    ncclSuccess = 0,       ncclUnhandledCudaError = 1, ncclSystemError = 2,
    ncclInternalError = 3, ncclInvalidArgument = 4,    ncclInvalidUsage = 5,
    ncclRemoteError = 6,   ncclInProgress = 7,         ncclNumResults = 8} ncclResult_t;

typedef DQ_NCCL_ENUM{ncclInt8 = 0,     ncclUint8 = 1,    ncclInt32 = 2,       ncclUint32 = 3,
                     ncclInt64 = 4,    ncclUint64 = 5,   ncclFloat16 = 6,     ncclFloat32 = 7,
                     ncclFloat64 = 8,  ncclBfloat16 = 9, ncclFloat8e4m3 = 10, ncclFloat8e5m2 = 11,
                     ncclNumTypes = 12} ncclDataType_t;

// Signed 32-bit in NCCL (values above ncclNumOps are user-created operators).
typedef DQ_NCCL_ENUM{ncclSum = 0,
                     ncclProd = 1,
                     ncclMax = 2,
                     ncclMin = 3,
                     ncclAvg = 4,
                     ncclNumOps = 5,
                     ncclMaxRedOp = 0x7fffffff} ncclRedOp_t;

typedef DQ_NCCL_ENUM{ncclScalarDevice = 0, ncclScalarHostImmediate = 1} ncclScalarResidence_t;

// ncclConfig_t of NCCL 2.28 (struct ncclConfig_v22800).
typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
  int trafficClass;
  const char* commName;
  int collnetEnable;
  int CTAPolicy;
  int shrinkShare;
  int nvlsCTAs;
  int nChannelsPerNetPeer;
  int nvlinkCentricSched;
} ncclConfig_t;

// NCCL_CONFIG_INITIALIZER's values: the header, and every other field undefined (NCCL's default).
#define DQ_NCCL_CONFIG_INITIALIZER                                                              \
  {                                                                                             \
    sizeof(ncclConfig_t), DQ_NCCL_CONFIG_MAGIC, DQ_NCCL_VERSION_CODE,                           \
        DQ_NCCL_CONFIG_UNDEF_INT /* blocking */, DQ_NCCL_CONFIG_UNDEF_INT /* cgaCluster */,     \
        DQ_NCCL_CONFIG_UNDEF_INT /* minCTAs */, DQ_NCCL_CONFIG_UNDEF_INT /* maxCTAs */,         \
        NULL /* netName */, DQ_NCCL_CONFIG_UNDEF_INT /* splitShare */,                          \
        DQ_NCCL_CONFIG_UNDEF_INT /* trafficClass */, NULL /* commName */,                       \
        DQ_NCCL_CONFIG_UNDEF_INT /* collnetEnable */, DQ_NCCL_CONFIG_UNDEF_INT /* CTAPolicy */, \
        DQ_NCCL_CONFIG_UNDEF_INT /* shrinkShare */, DQ_NCCL_CONFIG_UNDEF_INT /* nvlsCTAs */,    \
        DQ_NCCL_CONFIG_UNDEF_INT /* nChannelsPerNetPeer */,                                     \
        DQ_NCCL_CONFIG_UNDEF_INT /* nvlinkCentricSched */                                       \
  }

// ncclGroupSimulateEnd's answer (NCCL 2.22+): the group's estimated time, in microseconds.
#define DQ_NCCL_SIM_INFO_MAGIC 0x74685283u
typedef struct ncclSimInfo_v22200 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  float estimatedTime;
} ncclSimInfo_t;
#define DQ_NCCL_SIM_INFO_INITIALIZER \
  { sizeof(ncclSimInfo_t), DQ_NCCL_SIM_INFO_MAGIC, DQ_NCCL_VERSION_CODE, -1.0f }

// Defining DQ_NCCL_API_TYPES_ONLY leaves out the functions (the ABI test includes the types next
// to the real nccl.h).
#ifndef DQ_NCCL_API_TYPES_ONLY
DQ_NCCL_EXPORT ncclResult_t ncclGetVersion(int* version);
DQ_NCCL_EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId* unique_id);
DQ_NCCL_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId comm_id,
                                             int rank);
DQ_NCCL_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks,
                                                   ncclUniqueId comm_id, int rank,
                                                   ncclConfig_t* config);
DQ_NCCL_EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t* comm, int nranks, int rank,
                                                     int n_ids, ncclUniqueId* comm_ids,
                                                     ncclConfig_t* config);
DQ_NCCL_EXPORT ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist);
DQ_NCCL_EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                          ncclConfig_t* config);
// Survivors of a failure make a communicator without the ranks listed (every survivor passes the
// same list, the listed ranks do not call it); ranks keep their order.
DQ_NCCL_EXPORT ncclResult_t ncclCommShrink(ncclComm_t comm, int* exclude_ranks, int exclude_count,
                                           ncclComm_t* newcomm, ncclConfig_t* config,
                                           int shrink_flags);
// Ends the operations in flight on `comm` and refuses new ones; afterwards only destroy, abort,
// split and shrink are valid on it.
DQ_NCCL_EXPORT ncclResult_t ncclCommRevoke(ncclComm_t comm, int revoke_flags);
DQ_NCCL_EXPORT ncclResult_t ncclCommFinalize(ncclComm_t comm);
DQ_NCCL_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm);
DQ_NCCL_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm);
DQ_NCCL_EXPORT ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
DQ_NCCL_EXPORT ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device);
DQ_NCCL_EXPORT ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
DQ_NCCL_EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error);
DQ_NCCL_EXPORT ncclResult_t ncclCommRegister(const ncclComm_t comm, void* buff, size_t size,
                                             void** handle);
DQ_NCCL_EXPORT ncclResult_t ncclCommDeregister(const ncclComm_t comm, void* handle);
DQ_NCCL_EXPORT const char* ncclGetErrorString(ncclResult_t result);
DQ_NCCL_EXPORT const char* ncclGetLastError(ncclComm_t comm);
DQ_NCCL_EXPORT ncclResult_t ncclMemAlloc(void** ptr, size_t size);
DQ_NCCL_EXPORT ncclResult_t ncclMemFree(void* ptr);
DQ_NCCL_EXPORT ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar,
                                                     ncclDataType_t datatype,
                                                     ncclScalarResidence_t residence,
                                                     ncclComm_t comm);
DQ_NCCL_EXPORT ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);

DQ_NCCL_EXPORT ncclResult_t ncclGroupStart(void);
DQ_NCCL_EXPORT ncclResult_t ncclGroupEnd(void);
// Ends the group as ncclGroupEnd would, without running its operations: *sim_info gets their
// estimated time.
DQ_NCCL_EXPORT ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t* sim_info);

DQ_NCCL_EXPORT ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype,
                                     int peer, ncclComm_t comm, cudaStream_t stream);
DQ_NCCL_EXPORT ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype,
                                     int peer, ncclComm_t comm, cudaStream_t stream);
DQ_NCCL_EXPORT ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                                          ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                          cudaStream_t stream);
DQ_NCCL_EXPORT ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                                          ncclDataType_t datatype, int root, ncclComm_t comm,
                                          cudaStream_t stream);
DQ_NCCL_EXPORT ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root,
                                      ncclComm_t comm, cudaStream_t stream);
DQ_NCCL_EXPORT ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count,
                                       ncclDataType_t datatype, ncclRedOp_t op, int root,
                                       ncclComm_t comm, cudaStream_t stream);
DQ_NCCL_EXPORT ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                                          ncclDataType_t datatype, ncclComm_t comm,
                                          cudaStream_t stream);
DQ_NCCL_EXPORT ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff,
                                              size_t recvcount, ncclDataType_t datatype,
                                              ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
DQ_NCCL_EXPORT ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count,
                                         ncclDataType_t datatype, ncclComm_t comm,
                                         cudaStream_t stream);

// dynamiq extension: the commName given in ncclConfig_t (or inherited by a split), "" if none.
DQ_NCCL_EXPORT const char* dqCpuNcclCommName(ncclComm_t comm);
#endif  // DQ_NCCL_API_TYPES_ONLY

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // DYNAMIQ_COMMON_NCCL_API_H_
