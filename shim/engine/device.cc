// The Device interface's steps over every codec part of a call, part by part: what a device
// without batched kernels (the host device) runs, and what a CUDA device falls back to where its
// kernels do not serve every part.
#include "shim/engine/device.h"

namespace dq::engine {

Status Device::parts_stats(const PreparedParts& parts, const void* input, Lane lane) {
  const size_t esize = dtype_size(parts.dtype());
  for (const PartSteps& part : parts.parts())
    if (part.stats_codec != nullptr) {
      const ConstTensor values{static_cast<const uint8_t*>(input) + part.offset * esize,
                               parts.dtype(), part.count};
      DQ_CHECK(local_stats(*part.stats_codec, values, part.stats, lane));
    }
  return Status::kOk;
}

Status Device::parts_layouts(const PreparedParts& parts, uint64_t call, Lane lane) {
  for (const PartSteps& part : parts.parts())
    DQ_CHECK(build_layout(*part.codec, part.reduced, call, part.layout, lane));
  return Status::kOk;
}

}  // namespace dq::engine
