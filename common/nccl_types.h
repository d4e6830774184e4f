// The element types, reduction operations and collectives every layer and tool names, defined
// once. DType and RedOp mirror NCCL's ncclDataType_t and ncclRedOp_t value for value (the
// CPU NCCL casts between them; common/nccl_api.h holds NCCL's own names); Collective is
// dynamiq's: the collectives it compresses, in the order its plans and tools list them.
#pragma once
#include <cstdint>

namespace dq {

enum class DType : int {
  kInt8 = 0,
  kUint8 = 1,
  kInt32 = 2,
  kUint32 = 3,
  kInt64 = 4,
  kUint64 = 5,
  kFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBfloat16 = 9,
  kFloat8e4m3 = 10,
  kFloat8e5m2 = 11,
  kCount = 12,  // NCCL's ncclNumTypes: not a type
  // The codecs' names of the two types they compress (kernels/, shim/engine/).
  kF32 = kFloat32,
  kBF16 = kBfloat16,
};

enum class RedOp : int {
  kSum = 0,
  kProd = 1,
  kMax = 2,
  kMin = 3,
  kAvg = 4,
  kCount = 5,  // NCCL's ncclNumOps: not an operation
};

enum class Collective : uint8_t { kAllReduce = 0, kReduceScatter = 1, kReduce = 2 };

}  // namespace dq
