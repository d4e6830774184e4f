// The baseline codecs' tiles compiled for AVX2 (kernels/baselines/baselines_hot.h), in the
// portable binary: everything after the target pragma below is compiled for AVX2 (FMA stays off:
// -ffp-contract=off and no "fma" target, so no multiply-add is contracted), everything included
// before it for the build's baseline. make_tile_kernel() takes this path only where host_isa()
// is kAvx2, which host_isa_supported() allows (kernels/host_isa.cc).
#include <array>
#include <cstdint>
#include <memory>

#include "kernels/baselines/block_codec.h"
#include "kernels/baselines/mx_element.h"
#include "kernels/bf16.h"
#include "kernels/bitpack.h"
#include "kernels/philox.h"

#include "kernels/host_avx2_begin.h"

#define DQ_HOST_ISA_NS host_avx2
#include "kernels/baselines/baselines_hot.h"

#include "kernels/host_avx2_end.h"

namespace dq::baselines {

std::unique_ptr<TileKernel> make_tile_kernel_avx2(const TileSpec& spec) {
  return host_avx2::make_tiles(spec);
}

}  // namespace dq::baselines
