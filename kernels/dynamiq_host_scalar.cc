// The DynamiQ host codec's hot loops for baseline x86-64 (kernels/dynamiq_hot.h): the path of
// CPUs without AVX2, and of DYNAMIQ_HOST_ISA=scalar.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "kernels/bf16.h"
#include "kernels/dynamiq_codec_impl.h"
#include "kernels/philox.h"

#define DQ_HOST_ISA_NS host_scalar
#define DQ_HOST_AVX2 0
#include "kernels/dynamiq_hot.h"

namespace dq {

std::unique_ptr<DynamiqCodecBase> make_dynamiq_codec_scalar(const DynamiqOptions& options) {
  return std::make_unique<host_scalar::HotCodec>(options);
}

}  // namespace dq
