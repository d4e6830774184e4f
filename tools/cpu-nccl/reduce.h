// Element types and reduction operators of the CPU NCCL, on host memory.
//
// Exact per-type arithmetic: integers wrap (two's complement), float32/float64 use their own
// IEEE operations, and the narrow float types (half, bfloat16, fp8) compute each binary
// operation exactly in double and round once to the type (ties to even), so a reduction's result
// depends only on the order of its operands, which the ring fixes. Average is sum, then one
// division by the rank count (integers: truncating division of the wrapped sum).
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/nccl_types.h"
#include "common/status.h"

namespace dq::cpunccl {

// Values are NCCL's ncclDataType_t / ncclRedOp_t values (common/nccl_types.h).
using DType = ::dq::DType;
using RedOp = ::dq::RedOp;

bool dtype_valid(int dtype);
bool redop_valid(int op);
size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
const char* redop_name(RedOp op);

// out[i] = op(incoming[i], local[i]) for i < count; out may alias either input.
// kAvg combines like kSum; call finish_average on the final sum.
void reduce_elements(DType dtype, RedOp op, const void* incoming, const void* local, void* out,
                     size_t count);

// data[i] = data[i] / nranks (the last step of kAvg).
void finish_average(DType dtype, void* data, size_t count, int nranks);

// Narrow float conversions (exposed for tests): decode is exact; encode rounds to nearest,
// ties to even. Overflow gives Inf for half, bfloat16 and e5m2, NaN for e4m3 (no Inf there).
double narrow_to_double(DType dtype, uint32_t bits);
uint32_t narrow_from_double(DType dtype, double value);

}  // namespace dq::cpunccl
