// BF16 baseline: every hop rounds the FP32 partial sum to nearest even BF16.
// Payload after the chunk header: one little-endian BF16 word per element. The tiles:
// kernels/baselines/baselines_hot.h.
#include "kernels/baselines/baselines.h"
#include "kernels/baselines/block_codec.h"

namespace dq {
namespace {

class Bf16Codec final : public baselines::BlockCodec {
 public:
  Bf16Codec() : BlockCodec(CodecId::kBf16, 0, 1, 2, baselines::TileSpec{CodecId::kBf16}) {}
  std::string name() const override { return "bf16"; }
};

}  // namespace

std::unique_ptr<Codec> make_bf16_codec() {
  return std::make_unique<Bf16Codec>();
}

}  // namespace dq
