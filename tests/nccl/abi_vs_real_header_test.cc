// Our NCCL declarations (common/nccl_api.h) against the real nccl.h: every enum value,
// the ncclConfig_t layout, NCCL_CONFIG_INITIALIZER's magic/version and our copy of it. Compiled
// only where the real header (and cuda_runtime.h, which it includes) is installed.
#include <nccl.h>

#include <cstddef>
#include <cstdio>
#include <cstring>

namespace mine {
#define DQ_NCCL_API_TYPES_ONLY
#include "common/nccl_api.h"
}  // namespace mine

#define SAME_VALUE(name) \
  static_assert(static_cast<int>(mine::name) == static_cast<int>(::name), #name)
SAME_VALUE(ncclSuccess);
SAME_VALUE(ncclUnhandledCudaError);
SAME_VALUE(ncclSystemError);
SAME_VALUE(ncclInternalError);
SAME_VALUE(ncclInvalidArgument);
SAME_VALUE(ncclInvalidUsage);
SAME_VALUE(ncclRemoteError);
SAME_VALUE(ncclInProgress);
SAME_VALUE(ncclNumResults);
SAME_VALUE(ncclInt8);
SAME_VALUE(ncclUint8);
SAME_VALUE(ncclInt32);
SAME_VALUE(ncclUint32);
SAME_VALUE(ncclInt64);
SAME_VALUE(ncclUint64);
SAME_VALUE(ncclFloat16);
SAME_VALUE(ncclFloat32);
SAME_VALUE(ncclFloat64);
SAME_VALUE(ncclBfloat16);
SAME_VALUE(ncclFloat8e4m3);
SAME_VALUE(ncclFloat8e5m2);
SAME_VALUE(ncclNumTypes);
SAME_VALUE(ncclSum);
SAME_VALUE(ncclProd);
SAME_VALUE(ncclMax);
SAME_VALUE(ncclMin);
SAME_VALUE(ncclAvg);
SAME_VALUE(ncclNumOps);
SAME_VALUE(ncclScalarDevice);
SAME_VALUE(ncclScalarHostImmediate);
static_assert(sizeof(mine::ncclResult_t) == sizeof(::ncclResult_t));
static_assert(sizeof(mine::ncclDataType_t) == sizeof(::ncclDataType_t));
static_assert(sizeof(mine::ncclRedOp_t) == sizeof(::ncclRedOp_t));
static_assert(sizeof(mine::ncclUniqueId) == sizeof(::ncclUniqueId));
static_assert(DQ_NCCL_UNIQUE_ID_BYTES == NCCL_UNIQUE_ID_BYTES);
static_assert(DQ_NCCL_SPLIT_NOCOLOR == NCCL_SPLIT_NOCOLOR);
static_assert(DQ_NCCL_SHRINK_DEFAULT == NCCL_SHRINK_DEFAULT);
static_assert(DQ_NCCL_SHRINK_ABORT == NCCL_SHRINK_ABORT);
static_assert(DQ_NCCL_REVOKE_DEFAULT == NCCL_REVOKE_DEFAULT);
static_assert(sizeof(mine::ncclSimInfo_t) == sizeof(::ncclSimInfo_t));
static_assert(offsetof(mine::ncclSimInfo_t, magic) == offsetof(::ncclSimInfo_t, magic));
static_assert(offsetof(mine::ncclSimInfo_t, version) == offsetof(::ncclSimInfo_t, version));
static_assert(offsetof(mine::ncclSimInfo_t, estimatedTime) ==
              offsetof(::ncclSimInfo_t, estimatedTime));
static_assert(DQ_NCCL_CONFIG_UNDEF_INT == NCCL_CONFIG_UNDEF_INT);

#define SAME_FIELD(f)                                                                \
  static_assert(offsetof(mine::ncclConfig_t, f) == offsetof(::ncclConfig_t, f), #f); \
  static_assert(sizeof(mine::ncclConfig_t::f) == sizeof(::ncclConfig_t::f), #f " size")
SAME_FIELD(size);
SAME_FIELD(magic);
SAME_FIELD(version);
SAME_FIELD(blocking);
SAME_FIELD(cgaClusterSize);
SAME_FIELD(minCTAs);
SAME_FIELD(maxCTAs);
SAME_FIELD(netName);
SAME_FIELD(splitShare);
SAME_FIELD(trafficClass);
SAME_FIELD(commName);
SAME_FIELD(collnetEnable);
SAME_FIELD(CTAPolicy);
SAME_FIELD(shrinkShare);
SAME_FIELD(nvlsCTAs);
SAME_FIELD(nChannelsPerNetPeer);
SAME_FIELD(nvlinkCentricSched);
static_assert(sizeof(mine::ncclConfig_t) == sizeof(::ncclConfig_t), "ncclConfig_t size");

int main() {
  // The initializer's run-time values (magic, version, size) as our library checks them.
  ::ncclConfig_t real = NCCL_CONFIG_INITIALIZER;
  mine::ncclConfig_t ours;
  std::memcpy(&ours, &real, sizeof ours);
  int failures = 0;
  if (ours.magic != DQ_NCCL_CONFIG_MAGIC) {
    std::fprintf(stderr, "magic %#x differs from ours %#x\n", ours.magic, DQ_NCCL_CONFIG_MAGIC);
    ++failures;
  }
  if (ours.size != sizeof(mine::ncclConfig_t)) ++failures;
  if (ours.version / 100 != DQ_NCCL_VERSION_CODE / 100) {
    std::fprintf(stderr, "header is NCCL %u, we report %d\n", ours.version, DQ_NCCL_VERSION_CODE);
    ++failures;
  }
  if (ours.blocking != DQ_NCCL_CONFIG_UNDEF_INT || ours.commName != nullptr) ++failures;
  // DQ_NCCL_CONFIG_INITIALIZER: the real initializer's every field but the version's patch.
  mine::ncclConfig_t init = DQ_NCCL_CONFIG_INITIALIZER;
  init.version = ours.version;
  if (std::memcmp(&init, &ours, sizeof init) != 0) {
    std::fprintf(stderr, "DQ_NCCL_CONFIG_INITIALIZER differs from NCCL_CONFIG_INITIALIZER\n");
    ++failures;
  }
  const ::ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  if (sim.magic != DQ_NCCL_SIM_INFO_MAGIC) {
    std::fprintf(stderr, "ncclSimInfo_t magic %#x differs from ours %#x\n", sim.magic,
                 DQ_NCCL_SIM_INFO_MAGIC);
    ++failures;
  }
  std::printf("ABI matches nccl.h %d.%d.%d: %s\n", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH,
              failures ? "NO" : "yes");
  return failures ? 1 : 0;
}
