// The baseline codecs' tile work (decode, add in FP32, encode; validate; finish), written once and
// compiled once per host instruction set, as the DynamiQ codec's hot loops are
// (kernels/dynamiq_hot.h): kernels/baselines/baselines_host_scalar.cc (baseline x86-64),
// kernels/baselines/baselines_host_avx2.cc (AVX2, no FMA) and
// kernels/baselines/baselines_host_avx512.cc (AVX-512 at 256 bits) include this file inside their
// own namespace (DQ_HOST_ISA_NS), after every shared header, so that only what is defined here is
// compiled for the wider target. Plain loops the compiler vectorises for each target; every path
// gives the same bytes: the same IEEE operations in the same order, no contraction.
// Byte layouts: docs/FORMAT.md. Not a stand-alone header: no include guard, no includes.

namespace dq::baselines::DQ_HOST_ISA_NS {

// BF16: every hop rounds the FP32 partial sum to nearest even BF16, one little-endian word per
// element.
struct Bf16Kernel {
  static constexpr size_t kBlockElems = 1;

  bool decode(const uint8_t* src, size_t n, float* dst) const {
    for (size_t i = 0; i < n; ++i)
      dst[i] = bf16_to_f32(static_cast<uint16_t>(src[2 * i] | (src[2 * i + 1] << 8)));
    return true;
  }
  bool validate(const uint8_t*, size_t) const { return true; }  // every bit pattern is valid
  void encode(const float* src, size_t n, size_t, const RoundingKey&, uint8_t* dst) const {
    for (size_t i = 0; i < n; ++i) {  // a finite value stays finite (NaN, Inf stay)
      const uint16_t h = f32_to_bf16_sat(src[i]);
      dst[2 * i] = static_cast<uint8_t>(h);
      dst[2 * i + 1] = static_cast<uint8_t>(h >> 8);
    }
  }
};

// OCP MX v1.0: blocks of 32 elements = 1 E8M0 scale byte, then the 32 element codes packed
// LSB-first.
struct MxKernel {
  static constexpr size_t kBlockElems = 32;
  MxKind kind;
  int bits;                      // element width
  size_t block_bytes;            // 1 + 32 * bits / 8
  std::array<float, 256> table;  // element code -> value

  bool decode(const uint8_t* src, size_t n_blocks, float* dst) const {
    for (size_t b = 0; b < n_blocks; ++b, src += block_bytes, dst += kBlockElems) {
      const float scale = mx_scale_value(src[0]);
      const uint8_t* codes = src + 1;
      if (bits == 8) {
        for (size_t i = 0; i < kBlockElems; ++i) dst[i] = table[codes[i]] * scale;
      } else {
        for (size_t i = 0; i < kBlockElems; ++i)
          dst[i] = table[unpack_code(codes, static_cast<int>(i), bits)] * scale;
      }
    }
    return true;
  }
  bool validate(const uint8_t*, size_t) const { return true; }  // every byte pattern decodes
  void encode(const float* src, size_t n_blocks, size_t, const RoundingKey&, uint8_t* dst) const {
    const MxFormat format = mx_format(kind);
    for (size_t b = 0; b < n_blocks; ++b, src += kBlockElems, dst += block_bytes) {
      uint32_t amax = 0;  // FP32 bits of the largest magnitude; NaN/Inf compare above finite
      for (size_t i = 0; i < kBlockElems; ++i) {
        const uint32_t a = f32_bits(src[i]) & 0x7fffffffu;
        amax = a > amax ? a : amax;
      }
      const uint8_t scale = mx_scale_byte(kind, amax);
      dst[0] = scale;
      uint8_t codes[kBlockElems];
      if (scale == kMxScaleNaN) {
        for (size_t i = 0; i < kBlockElems; ++i) codes[i] = 0;
      } else {
        const float inv = mx_inverse_scale(scale);  // exact power of two
        for (size_t i = 0; i < kBlockElems; ++i) codes[i] = mx_encode_element(format, src[i] * inv);
      }
      pack_codes(codes, static_cast<int>(kBlockElems), bits, dst + 1);
    }
  }
};

// uniform:B: per group of 16 values a BF16 scale (little-endian), then 16 codes q + L packed
// LSB-first, k = B - 1 bits each (kernels/baselines/uniform_codec.cc).
struct UniformKernel {
  static constexpr size_t kBlockElems = 16;
  static constexpr uint16_t kScaleNaN = 0x7FC0;
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
    for (int i = 0; i < static_cast<int>(kBlockElems); ++i)
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
    for (size_t g = 0; g < n_groups; ++g, src += group_bytes, dst += kBlockElems) {
      ok &= group_valid(src);
      const float scale = bf16_to_f32(static_cast<uint16_t>(src[0] | (src[1] << 8)));
      for (int i = 0; i < static_cast<int>(kBlockElems); ++i) {
        const int q = static_cast<int>(unpack_code(src + 2, i, bits)) - levels;
        dst[i] = uniform_level_value(q, scale, l);
      }
    }
    return ok;
  }
  // Unbiased stochastic rounding of one group with a finite non-zero amax to codes.
  void round_group(const float* src, float scale, size_t e0, const RoundingKey& key,
                   uint8_t* codes) const {
    const float l = static_cast<float>(levels);
    // Element e (index in the caller's whole tensor) draws word e % 4 of Philox block e / 4;
    // groups start at multiples of 16.
    uint32_t words[kBlockElems];
    for (uint32_t w = 0; w < kBlockElems / 4; ++w) {
      const Philox4 r = philox_draw(key.seed, key.call, key.rank, kStreamRounding,
                                    static_cast<uint32_t>(e0 / 4) + w);
      for (int j = 0; j < 4; ++j) words[4 * w + j] = r.v[j];
    }
    for (size_t i = 0; i < kBlockElems; ++i) {
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
  void encode(const float* src, size_t n_groups, size_t first_elem, const RoundingKey& key,
              uint8_t* dst) const {
    for (size_t g = 0; g < n_groups; ++g, src += kBlockElems, dst += group_bytes) {
      uint32_t amax = 0;
      for (size_t i = 0; i < kBlockElems; ++i) {
        const uint32_t a = f32_bits(src[i]) & 0x7fffffffu;
        amax = a > amax ? a : amax;
      }
      uint8_t codes[kBlockElems];
      uint16_t scale_bits;
      if (amax >= 0x7f800000u || amax == 0) {
        scale_bits = amax == 0 ? 0 : kScaleNaN;
        for (size_t i = 0; i < kBlockElems; ++i) codes[i] = static_cast<uint8_t>(levels);
      } else {
        scale_bits = f32_to_bf16_up(f32_from_bits(amax));  // >= amax unless beyond BF16 max
        round_group(src, bf16_to_f32(scale_bits), first_elem + g * kBlockElems, key, codes);
      }
      dst[0] = static_cast<uint8_t>(scale_bits);
      dst[1] = static_cast<uint8_t>(scale_bits >> 8);
      pack_codes(codes, static_cast<int>(kBlockElems), bits, dst + 2);
    }
  }
};

// A kernel's tiles: the loops around decode/encode, here so that they too are compiled per path.
template <class Kernel>
class Tiles final : public TileKernel {
 public:
  explicit Tiles(const Kernel& k) : k_(k) {}
  size_t block_elems() const override { return Kernel::kBlockElems; }

  bool hop_tile(const ConstTensor& own, size_t e0, size_t valid, size_t n_blocks,
                const ByteView* in, int n_in, size_t in_offset, const RoundingKey& key,
                uint8_t* dst) const override {
    alignas(64) float acc[kTileElems];
    alignas(64) float decoded[kTileElems];
    const size_t padded = n_blocks * Kernel::kBlockElems;
    if (own.dtype == DType::kF32) {
      const float* src = static_cast<const float*>(own.data) + e0;
      for (size_t i = 0; i < valid; ++i) acc[i] = src[i];
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(own.data) + e0;
      for (size_t i = 0; i < valid; ++i) acc[i] = bf16_to_f32(src[i]);
    }
    for (size_t i = valid; i < padded; ++i) acc[i] = 0.0f;
    bool ok = true;
    for (int j = 0; j < n_in; ++j) {
      ok &= k_.decode(in[j].data + in_offset, n_blocks, decoded);
      for (size_t i = 0; i < valid; ++i) acc[i] += decoded[i];
    }
    k_.encode(acc, n_blocks, key.element_base + e0, key, dst);
    return ok;
  }

  bool validate(const uint8_t* src, size_t n_blocks) const override {
    return k_.validate(src, n_blocks);
  }

  void finish_tile(const uint8_t* src, size_t n_blocks, size_t valid, ReduceOp op, float divisor,
                   void* out, DType out_dtype, size_t e0) const override {
    alignas(64) float decoded[kTileElems];
    k_.decode(src, n_blocks, decoded);
    if (op == ReduceOp::kAvg)
      for (size_t i = 0; i < valid; ++i) decoded[i] /= divisor;
    if (out_dtype == DType::kF32) {
      float* dst = static_cast<float*>(out) + e0;
      for (size_t i = 0; i < valid; ++i) dst[i] = decoded[i];
    } else {
      uint16_t* dst = static_cast<uint16_t*>(out) + e0;
      for (size_t i = 0; i < valid; ++i) dst[i] = f32_to_bf16_rne(decoded[i]);
    }
  }

 private:
  const Kernel k_;
};

inline std::unique_ptr<TileKernel> make_tiles(const TileSpec& spec) {
  switch (spec.id) {
    case CodecId::kBf16:
      return std::make_unique<Tiles<Bf16Kernel>>(Bf16Kernel{});
    case CodecId::kUniform: {
      const int k = spec.uniform_code_bits;
      return std::make_unique<Tiles<UniformKernel>>(
          UniformKernel{k, (1 << (k - 1)) - 1, 2 + 2 * static_cast<size_t>(k)});
    }
    default: {  // the MX codecs
      MxKernel mx{spec.mx,
                  mx_element_bits(spec.mx),
                  1 + MxKernel::kBlockElems * static_cast<size_t>(mx_element_bits(spec.mx)) / 8,
                  {}};
      for (int c = 0; c < 256; ++c)
        mx.table[c] = mx_decode_element(spec.mx, static_cast<uint8_t>(c));
      return std::make_unique<Tiles<MxKernel>>(mx);
    }
  }
}

}  // namespace dq::baselines::DQ_HOST_ISA_NS
