// OCP Microscaling v1.0 baselines (MXFP8 E4M3, MXFP6 E3M2/E2M3, MXFP4 E2M1), re-quantized at
// every hop: decode, add in FP32, encode. Block of 32 elements = 1 E8M0 scale byte followed by
// the 32 element codes packed LSB-first (33 / 25 / 25 / 17 bytes).
#include <array>

#include "kernels/baselines/baselines.h"
#include "kernels/baselines/block_codec.h"
#include "kernels/baselines/mx_element.h"
#include "kernels/bitpack.h"

namespace dq {
namespace {

constexpr size_t kMxBlockElems = 32;

struct MxKernel {
  MxKind kind;
  int bits;                             // element width
  size_t block_bytes;                   // 1 + 32 * bits / 8
  const std::array<float, 256>* table;  // element code -> value

  bool decode(const uint8_t* src, size_t n_blocks, float* dst) const {
    for (size_t b = 0; b < n_blocks; ++b, src += block_bytes, dst += kMxBlockElems) {
      const float scale = mx_scale_value(src[0]);
      const uint8_t* codes = src + 1;
      if (bits == 8) {
        for (size_t i = 0; i < kMxBlockElems; ++i) dst[i] = (*table)[codes[i]] * scale;
      } else {
        for (size_t i = 0; i < kMxBlockElems; ++i)
          dst[i] = (*table)[unpack_code(codes, static_cast<int>(i), bits)] * scale;
      }
    }
    return true;
  }
  bool validate(const uint8_t*, size_t) const { return true; }  // every byte pattern decodes
  void encode(const float* src, size_t n_blocks, size_t, const RoundingKey&, uint8_t* dst) const {
    const MxFormat format = mx_format(kind);
    for (size_t b = 0; b < n_blocks; ++b, src += kMxBlockElems, dst += block_bytes) {
      uint32_t amax = 0;  // FP32 bits of the largest magnitude; NaN/Inf compare above finite
      for (size_t i = 0; i < kMxBlockElems; ++i) {
        uint32_t a = f32_bits(src[i]) & 0x7fffffffu;
        amax = a > amax ? a : amax;
      }
      const uint8_t scale = mx_scale_byte(kind, amax);
      dst[0] = scale;
      uint8_t codes[kMxBlockElems];
      if (scale == kMxScaleNaN) {
        for (size_t i = 0; i < kMxBlockElems; ++i) codes[i] = 0;
      } else {
        const float inv = mx_inverse_scale(scale);  // exact power of two
        for (size_t i = 0; i < kMxBlockElems; ++i)
          codes[i] = mx_encode_element(format, src[i] * inv);
      }
      pack_codes(codes, static_cast<int>(kMxBlockElems), bits, dst + 1);
    }
  }
};

CodecId mx_codec_id(MxKind kind) {
  switch (kind) {
    case MxKind::kFp8E4M3:
      return CodecId::kMxfp8;
    case MxKind::kFp6E3M2:
      return CodecId::kMxfp6E3M2;
    case MxKind::kFp6E2M3:
      return CodecId::kMxfp6E2M3;
    default:
      return CodecId::kMxfp4;
  }
}

size_t mx_block_bytes(MxKind kind) {
  return 1 + kMxBlockElems * static_cast<size_t>(mx_element_bits(kind)) / 8;
}

class MxCodec final : public baselines::BlockCodec {
 public:
  explicit MxCodec(MxKind kind)
      : BlockCodec(mx_codec_id(kind), static_cast<uint32_t>(kind), kMxBlockElems,
                   mx_block_bytes(kind)),
        kind_(kind) {
    for (int c = 0; c < 256; ++c) table_[c] = mx_decode_element(kind, static_cast<uint8_t>(c));
  }
  std::string name() const override {
    switch (kind_) {
      case MxKind::kFp8E4M3:
        return "mxfp8";
      case MxKind::kFp6E3M2:
        return "mxfp6e3m2";
      case MxKind::kFp6E2M3:
        return "mxfp6e2m3";
      default:
        return "mxfp4";
    }
  }
  Status fused_hop(const void* layout, int chunk, const ConstTensor& own, const ByteView* in,
                   int n_in, uint8_t* out, const RoundingKey& key) const override {
    return run_hop(kernel(), layout, chunk, own, in, n_in, out, key);
  }
  Status decode_finish(const void* layout, int chunk, ByteView in, void* out, DType out_dtype,
                       ReduceOp op, int n_contrib) const override {
    return run_finish(kernel(), layout, chunk, in, out, out_dtype, op, n_contrib);
  }

 private:
  MxKernel kernel() const {
    return MxKernel{kind_, mx_element_bits(kind_), mx_block_bytes(kind_), &table_};
  }
  const MxKind kind_;
  std::array<float, 256> table_;
};

}  // namespace

std::unique_ptr<Codec> make_mx_codec(MxKind kind) {
  switch (kind) {
    case MxKind::kFp8E4M3:
    case MxKind::kFp6E3M2:
    case MxKind::kFp6E2M3:
    case MxKind::kFp4E2M1:
      return std::make_unique<MxCodec>(kind);
  }
  return nullptr;
}

}  // namespace dq
