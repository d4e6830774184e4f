// Uniform k-bit stochastic quantizer ("uniform:B", k = B - 1): per group of 16 values one BF16
// scale S = max|x| rounded up, and codes q in -L..L (L = 2^(k-1) - 1) on uniform levels q*S/L,
// rounded up with probability equal to the fractional position (unbiased). No mean subtraction,
// no variable widths, no correlated rounding: it isolates what DynamiQ adds.
// Group layout: BF16 scale (little-endian), then 16 codes q + L packed LSB-first (k bits each).
// The tiles: kernels/baselines/baselines_hot.h.
#include "kernels/baselines/baselines.h"
#include "kernels/baselines/block_codec.h"

namespace dq {
namespace {

constexpr size_t kGroupElems = 16;

class UniformCodec final : public baselines::BlockCodec {
 public:
  explicit UniformCodec(int total_bits)
      : BlockCodec(CodecId::kUniform, static_cast<uint32_t>(total_bits), kGroupElems,
                   2 + 2 * static_cast<size_t>(total_bits - 1),
                   baselines::TileSpec{CodecId::kUniform, MxKind::kFp8E4M3, total_bits - 1}),
        total_bits_(total_bits) {}
  std::string name() const override { return "uniform:" + std::to_string(total_bits_); }

 private:
  const int total_bits_;
};

}  // namespace

std::unique_ptr<Codec> make_uniform_codec(int total_bits) {
  if (total_bits < 3 || total_bits > 9) return nullptr;
  return std::make_unique<UniformCodec>(total_bits);
}

}  // namespace dq
