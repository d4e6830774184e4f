// The DynamiQ host codec's hot loops compiled for AVX-512 (F, VL, BW, DQ) at 256 bits: the AVX2
// path's source (kernels/dynamiq_hot.h with the intrinsics of kernels/dynamiq_avx2.h) inside the
// region kernels/host_avx512_begin.h opens, everything included before it for the build's
// baseline. The codec runs this path only where host_isa_supported(HostIsa::kAvx512)
// (kernels/host_isa.cc).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "kernels/bf16.h"
#include "kernels/dynamiq_codec_impl.h"
#include "kernels/host_isa.h"
#include "kernels/philox.h"

#include "kernels/host_avx512_begin.h"

#define DQ_HOST_ISA_NS host_avx512
#define DQ_HOST_AVX2 1
#include "kernels/dynamiq_avx2.h"
#include "kernels/dynamiq_hot.h"

namespace dq {

std::unique_ptr<DynamiqCodecBase> make_dynamiq_codec_avx512(const DynamiqOptions& options) {
  return std::make_unique<host_avx512::HotCodec>(options);
}

}  // namespace dq

#include "kernels/host_avx2_end.h"
