// BF16 baseline: every hop rounds the FP32 partial sum to nearest even BF16.
// Payload after the chunk header: one little-endian BF16 word per element.
#include "kernels/baselines/baselines.h"
#include "kernels/baselines/block_codec.h"

namespace dq {
namespace {

struct Bf16Kernel {
  bool decode(const uint8_t* src, size_t n, float* dst) const {
    for (size_t i = 0; i < n; ++i)
      dst[i] = bf16_to_f32(static_cast<uint16_t>(src[2 * i] | (src[2 * i + 1] << 8)));
    return true;
  }
  bool validate(const uint8_t*, size_t) const { return true; }  // every bit pattern is valid
  void encode(const float* src, size_t n, size_t, const RoundingKey&, uint8_t* dst) const {
    for (size_t i = 0; i < n; ++i) {
      uint16_t h = f32_to_bf16_rne(src[i]);
      dst[2 * i] = static_cast<uint8_t>(h);
      dst[2 * i + 1] = static_cast<uint8_t>(h >> 8);
    }
  }
};

class Bf16Codec final : public baselines::BlockCodec {
 public:
  Bf16Codec() : BlockCodec(CodecId::kBf16, 0, 1, 2) {}
  std::string name() const override { return "bf16"; }
  Status fused_hop(const void* layout, int chunk, const ConstTensor& own, const ByteView* in,
                   int n_in, uint8_t* out, const RoundingKey& key) const override {
    return run_hop(Bf16Kernel{}, layout, chunk, own, in, n_in, out, key);
  }
  Status decode_finish(const void* layout, int chunk, ByteView in, void* out, DType out_dtype,
                       ReduceOp op, int n_contrib) const override {
    return run_finish(Bf16Kernel{}, layout, chunk, in, out, out_dtype, op, n_contrib);
  }
};

}  // namespace

std::unique_ptr<Codec> make_bf16_codec() {
  return std::make_unique<Bf16Codec>();
}

}  // namespace dq
