// The baseline codecs' tiles compiled for AVX-512 (F, VL, BW, DQ) at 256 bits: the AVX2 path's
// source (kernels/baselines/baselines_hot.h) inside the region kernels/host_avx512_begin.h opens,
// everything included before it for the build's baseline (multiply-adds stay uncontracted by
// -ffp-contract=off). make_tile_kernel() takes this path only where host_isa() is kAvx512, which
// host_isa_supported() allows (kernels/host_isa.cc), so that an MX baseline is measured on the
// same instructions as DynamiQ.
#include <array>
#include <cstdint>
#include <memory>

#include "kernels/baselines/block_codec.h"
#include "kernels/baselines/mx_element.h"
#include "kernels/bf16.h"
#include "kernels/bitpack.h"
#include "kernels/philox.h"

#include "kernels/host_avx512_begin.h"

#define DQ_HOST_ISA_NS host_avx512
#include "kernels/baselines/baselines_hot.h"

#include "kernels/host_avx2_end.h"

namespace dq::baselines {

std::unique_ptr<TileKernel> make_tile_kernel_avx512(const TileSpec& spec) {
  return host_avx512::make_tiles(spec);
}

}  // namespace dq::baselines
