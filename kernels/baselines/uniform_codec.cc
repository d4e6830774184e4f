// Uniform k-bit stochastic quantizer ("uniform:B", k = B - 1): per group of 16 values one BF16
// scale S = max|x| rounded up, and codes q in -L..L (L = 2^(k-1) - 1) on uniform levels q*S/L,
// rounded up with probability equal to the fractional position (unbiased). No mean subtraction,
// no variable widths, no correlated rounding: it isolates what DynamiQ adds.
// Group layout: BF16 scale (little-endian), then 16 codes q + L packed LSB-first (k bits each).
#include "kernels/baselines/baselines.h"
#include "kernels/baselines/block_codec.h"
#include "kernels/bitpack.h"
#include "kernels/philox.h"

namespace dq {
namespace {

constexpr size_t kGroupElems = 16;
constexpr uint16_t kScaleNaN = 0x7FC0;

struct UniformKernel {
  int bits;            // k
  int levels;          // L = 2^(k-1) - 1
  size_t group_bytes;  // 2 + 2k

  static bool scale_valid(uint16_t s) {
    if ((s & 0x7fffu) > 0x7f80u) return true;  // NaN: a non-finite input upstream
    return s < 0x7f80u;                        // non-negative and finite
  }
  bool group_valid(const uint8_t* g) const {
    if (!scale_valid(static_cast<uint16_t>(g[0] | (g[1] << 8)))) return false;
    const uint32_t invalid = (1u << bits) - 1u;
    bool ok = true;
    for (int i = 0; i < static_cast<int>(kGroupElems); ++i)
      ok &= unpack_code(g + 2, i, bits) != invalid;
    return ok;
  }
  bool validate(const uint8_t* src, size_t n_groups) const {
    bool ok = true;
    for (size_t g = 0; g < n_groups; ++g) ok &= group_valid(src + g * group_bytes);
    return ok;
  }
  bool decode(const uint8_t* src, size_t n_groups, float* dst) const {
    bool ok = true;
    const float l = static_cast<float>(levels);
    for (size_t g = 0; g < n_groups; ++g, src += group_bytes, dst += kGroupElems) {
      ok &= group_valid(src);
      const float scale = bf16_to_f32(static_cast<uint16_t>(src[0] | (src[1] << 8)));
      for (int i = 0; i < static_cast<int>(kGroupElems); ++i) {
        const int q = static_cast<int>(unpack_code(src + 2, i, bits)) - levels;
        dst[i] = (static_cast<float>(q) * scale) / l;  // q*S exact, one rounding
      }
    }
    return ok;
  }
  void encode(const float* src, size_t n_groups, size_t first_elem, const RoundingKey& key,
              uint8_t* dst) const {
    const float l = static_cast<float>(levels);
    for (size_t g = 0; g < n_groups; ++g, src += kGroupElems, dst += group_bytes) {
      uint32_t amax = 0;
      for (size_t i = 0; i < kGroupElems; ++i) {
        uint32_t a = f32_bits(src[i]) & 0x7fffffffu;
        amax = a > amax ? a : amax;
      }
      uint8_t codes[kGroupElems];
      uint16_t scale_bits;
      if (amax >= 0x7f800000u || amax == 0) {
        scale_bits = amax == 0 ? 0 : kScaleNaN;
        for (size_t i = 0; i < kGroupElems; ++i) codes[i] = static_cast<uint8_t>(levels);
      } else {
        scale_bits = f32_to_bf16_up(f32_from_bits(amax));  // >= amax unless beyond BF16 max
        const float scale = bf16_to_f32(scale_bits);
        // Element e (index in the caller's whole tensor) draws word e % 4 of Philox block e / 4;
        // groups start at multiples of 16.
        const size_t e0 = first_elem + g * kGroupElems;
        uint32_t words[kGroupElems];
        for (uint32_t w = 0; w < kGroupElems / 4; ++w) {
          Philox4 r = philox_draw(key.seed, key.call, key.rank, kStreamRounding,
                                  static_cast<uint32_t>(e0 / 4) + w);
          for (int j = 0; j < 4; ++j) words[4 * w + j] = r.v[j];
        }
        for (size_t i = 0; i < kGroupElems; ++i) {
          float t = (src[i] / scale) * l;  // |src| <= scale, so t in [-L, L] (clamped anyway)
          t = t > l ? l : (t < -l ? -l : t);
          int fl = static_cast<int>(t);  // truncation, then floor
          fl -= static_cast<float>(fl) > t ? 1 : 0;
          const float frac = t - static_cast<float>(fl);  // exact, in [0, 1)
          int q = fl + (uniform24(words[i]) < frac ? 1 : 0);
          q = q > levels ? levels : q;
          codes[i] = static_cast<uint8_t>(q + levels);
        }
      }
      dst[0] = static_cast<uint8_t>(scale_bits);
      dst[1] = static_cast<uint8_t>(scale_bits >> 8);
      pack_codes(codes, static_cast<int>(kGroupElems), bits, dst + 2);
    }
  }
};

class UniformCodec final : public baselines::BlockCodec {
 public:
  explicit UniformCodec(int total_bits)
      : BlockCodec(CodecId::kUniform, static_cast<uint32_t>(total_bits), kGroupElems,
                   2 + 2 * static_cast<size_t>(total_bits - 1)),
        total_bits_(total_bits) {}
  std::string name() const override { return "uniform:" + std::to_string(total_bits_); }
  Status fused_hop(const void* layout, int chunk, const ConstTensor& own, const ByteView* in,
                   int n_in, uint8_t* out, const RoundingKey& key) const override {
    return run_hop(kernel(), layout, chunk, own, in, n_in, out, key);
  }
  Status decode_finish(const void* layout, int chunk, ByteView in, void* out, DType out_dtype,
                       ReduceOp op, int n_contrib) const override {
    return run_finish(kernel(), layout, chunk, in, out, out_dtype, op, n_contrib);
  }

 private:
  UniformKernel kernel() const {
    const int k = total_bits_ - 1;
    return UniformKernel{k, (1 << (k - 1)) - 1, 2 + 2 * static_cast<size_t>(k)};
  }
  const int total_bits_;
};

}  // namespace

std::unique_ptr<Codec> make_uniform_codec(int total_bits) {
  if (total_bits < 3 || total_bits > 9) return nullptr;
  return std::make_unique<UniformCodec>(total_bits);
}

}  // namespace dq
