// A do-nothing libnccl.so.2 for measuring the shim's own cost per call: ncclAllReduce copies
// send to recv and returns (so the handshake agrees with itself), a communicator claims 4 ranks.
// Not a test: bench_passthrough.sh preloads the shim over it.
#include <cstring>

#include "common/nccl_api.h"

struct ncclComm {
  int dummy;
};
namespace {
ncclComm g_comm;
size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 4;
  }
}
}  // namespace

extern "C" {
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof *id);
  return ncclSuccess;
}
ncclResult_t ncclCommInitRank(ncclComm_t* c, int, ncclUniqueId, int) {
  *c = &g_comm;
  return ncclSuccess;
}
ncclResult_t ncclCommInitRankConfig(ncclComm_t* c, int, ncclUniqueId, int, ncclConfig_t*) {
  *c = &g_comm;
  return ncclSuccess;
}
ncclResult_t ncclCommInitRankScalable(ncclComm_t* c, int, int, int, ncclUniqueId*, ncclConfig_t*) {
  *c = &g_comm;
  return ncclSuccess;
}
ncclResult_t ncclCommInitAll(ncclComm_t* c, int n, const int*) {
  for (int i = 0; i < n; ++i) c[i] = &g_comm;
  return ncclSuccess;
}
ncclResult_t ncclCommSplit(ncclComm_t, int, int, ncclComm_t* c, ncclConfig_t*) {
  *c = &g_comm;
  return ncclSuccess;
}
ncclResult_t ncclCommFinalize(ncclComm_t) {
  return ncclSuccess;
}
ncclResult_t ncclCommDestroy(ncclComm_t) {
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t) {
  return ncclSuccess;
}
ncclResult_t ncclCommCount(const ncclComm_t, int* n) {
  *n = 4;
  return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const ncclComm_t, int* r) {
  *r = 0;
  return ncclSuccess;
}
const char* ncclGetErrorString(ncclResult_t) {
  return "fake";
}
const char* dqCpuNcclCommName(ncclComm_t) {
  return "";
}
ncclResult_t ncclGroupStart(void) {
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd(void) {
  return ncclSuccess;
}
ncclResult_t ncclSend(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) {
  return ncclSuccess;
}
ncclResult_t ncclRecv(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) {
  return ncclSuccess;
}
ncclResult_t ncclAllReduce(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t,
                           ncclComm_t, cudaStream_t) {
  if (s != r) std::memcpy(r, s, n * type_size(t));
  return ncclSuccess;
}
}
