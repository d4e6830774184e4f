// The baseline codecs' tiles for baseline x86-64 (kernels/baselines/baselines_hot.h): the path of
// CPUs without AVX2, and of DYNAMIQ_HOST_ISA=scalar.
#include <array>
#include <cstdint>
#include <memory>

#include "kernels/baselines/block_codec.h"
#include "kernels/baselines/mx_element.h"
#include "kernels/bf16.h"
#include "kernels/bitpack.h"
#include "kernels/philox.h"

#define DQ_HOST_ISA_NS host_scalar
#include "kernels/baselines/baselines_hot.h"

namespace dq::baselines {

std::unique_ptr<TileKernel> make_tile_kernel_scalar(const TileSpec& spec) {
  return host_scalar::make_tiles(spec);
}

}  // namespace dq::baselines
