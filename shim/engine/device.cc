// The Device interface's steps over several codec parts or chunks, one at a time: what a device
// without batched kernels (the host device) runs, and what a CUDA device falls back to where its
// kernels do not serve them all.
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
  return part_layouts(parts, 0, parts.parts().size(), call, lane);
}

Status Device::part_layouts(const PreparedParts& parts, size_t first, size_t end, uint64_t call,
                            Lane lane) {
  if (first > end || end > parts.parts().size())
    DQ_FAIL(Status::kInternal, "layouts of parts %zu .. %zu of %zu", first, end,
            parts.parts().size());
  for (size_t i = first; i < end; ++i) {
    const PartSteps& part = parts.parts()[i];
    DQ_CHECK(build_layout(*part.codec, part.reduced, call, part.layout, lane));
  }
  return Status::kOk;
}

Status Device::finish_chunks(const PreparedCodec& codec, const void* layout, int first_chunk,
                             int n_chunks, const uint8_t* in, size_t in_stride, size_t in_bytes,
                             void* out, DType dtype, ReduceOp op, int n_contrib, Lane lane) {
  for (int i = 0; i < n_chunks; ++i)
    DQ_CHECK(finish(codec, layout, first_chunk + i,
                    ByteView{in + static_cast<size_t>(i) * in_stride, in_bytes}, out, dtype, op,
                    n_contrib, lane));
  return Status::kOk;
}

}  // namespace dq::engine
