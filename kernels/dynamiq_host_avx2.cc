// The DynamiQ host codec's hot loops compiled for AVX2 (kernels/dynamiq_hot.h with the
// intrinsics of kernels/dynamiq_avx2.h), in the portable binary: everything inside the AVX2 region
// (kernels/host_avx2_begin.h .. host_avx2_end.h) is compiled for AVX2, everything included before
// it for the build's baseline. The codec runs this path only where
// host_isa_supported(HostIsa::kAvx2) (kernels/host_isa.cc).
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

#include "kernels/host_avx2_begin.h"

#define DQ_HOST_ISA_NS host_avx2
#define DQ_HOST_AVX2 1
#include "kernels/dynamiq_avx2.h"
#include "kernels/dynamiq_hot.h"

namespace dq {

std::unique_ptr<DynamiqCodecBase> make_dynamiq_codec_avx2(const DynamiqOptions& options) {
  return std::make_unique<host_avx2::HotCodec>(options);
}

namespace {
void philox_x8_words(uint64_t seed, uint64_t call, uint32_t hop, uint32_t stream, uint32_t block,
                     uint32_t words[4][8]) {
  host_avx2::avx2::store_words(host_avx2::avx2::philox_draw_x8(seed, call, hop, stream, block),
                               words);
}
void shuffle_x16_words(const uint32_t keys[16], uint32_t member, uint32_t strata,
                       uint32_t positions[16]) {
  host_avx2::avx2::shuffle_positions_x16(keys, member, strata, positions);
}
}  // namespace

#include "kernels/host_avx2_end.h"

bool philox_draw_x8_avx2(uint64_t seed, uint64_t call, uint32_t hop, uint32_t stream,
                         uint32_t block, uint32_t words[4][8]) {
  if (!host_isa_supported(HostIsa::kAvx2)) return false;
  philox_x8_words(seed, call, hop, stream, block, words);
  return true;
}

bool shuffle_positions_x16_avx2(const uint32_t keys[16], uint32_t member, uint32_t strata,
                                uint32_t positions[16]) {
  if (!host_isa_supported(HostIsa::kAvx2) || strata == 0) return false;
  shuffle_x16_words(keys, member, strata, positions);
  return true;
}

}  // namespace dq
