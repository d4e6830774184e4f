#include <cstdlib>
#include <cstring>

#include "shim/engine/device.h"

namespace dq::engine {
namespace {

class HostDevice final : public Device {
 public:
  const char* name() const override { return "host"; }
  Status alloc(size_t bytes, void** out) override {
    // 64-byte alignment: whole cache lines for the codec's vector loads.
    *out = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (*out == nullptr)
      DQ_FAIL(Status::kOutOfMemory, "host device: cannot allocate %zu bytes", bytes);
    return Status::kOk;
  }
  void release(void* p) override { std::free(p); }
  bool capturing(void*) const override { return false; }
  bool owns(const void*) const override { return true; }
  Status local_stats(const Codec& codec, const ConstTensor& x, uint16_t* stats, void*) override {
    return codec.local_stats(x, stats);
  }
  Status agree(Codec& codec, const uint16_t* reduced, uint64_t call, void*) override {
    return codec.agree(reduced, call);
  }
  Status hop(const Codec& codec, int chunk, const ConstTensor& own, const ByteView* in, int n_in,
             uint8_t* out, const RoundingKey& key, void*) override {
    return codec.hop(chunk, own, in, n_in, out, key);
  }
  Status finish(const Codec& codec, int chunk, ByteView in, void* out, DType dtype, ReduceOp op,
                int n_contrib, void*) override {
    return codec.finish(chunk, in, out, dtype, op, n_contrib);
  }
  Status copy(void* dst, const void* src, size_t bytes, void*) override {
    if (bytes) std::memcpy(dst, src, bytes);
    return Status::kOk;
  }
};

}  // namespace

Device* host_device() {
  static HostDevice device;
  return &device;
}

}  // namespace dq::engine
