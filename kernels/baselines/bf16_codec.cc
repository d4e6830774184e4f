// BF16 baseline: every hop rounds the FP32 partial sum to nearest even BF16.
// Payload after the chunk header: one little-endian BF16 word per element. The tiles:
// kernels/baselines/baselines_hot.h.
#include "kernels/baselines/baselines.h"
#include "kernels/baselines/block_codec.h"

namespace dq {
namespace {

class Bf16Codec final : public baselines::BlockCodec {
 public:
  Bf16Codec()
      : BlockCodec(CodecId::kBf16, 0, 1, 2),
        tiles_(baselines::make_tile_kernel(baselines::TileSpec{CodecId::kBf16})) {}
  std::string name() const override { return "bf16"; }
  Status fused_hop(const void* layout, int chunk, const ConstTensor& own, const ByteView* in,
                   int n_in, uint8_t* out, const RoundingKey& key) const override {
    return run_hop(*tiles_, layout, chunk, own, in, n_in, out, key);
  }
  Status decode_finish(const void* layout, int chunk, ByteView in, void* out, DType out_dtype,
                       ReduceOp op, int n_contrib) const override {
    return run_finish(*tiles_, layout, chunk, in, out, out_dtype, op, n_contrib);
  }

 private:
  const std::unique_ptr<baselines::TileKernel> tiles_;  // host_isa()'s path when made
};

}  // namespace

std::unique_ptr<Codec> make_bf16_codec() {
  return std::make_unique<Bf16Codec>();
}

}  // namespace dq
