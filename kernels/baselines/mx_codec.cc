// OCP Microscaling v1.0 baselines (MXFP8 E4M3, MXFP6 E3M2/E2M3, MXFP4 E2M1), re-quantized at
// every hop: decode, add in FP32, encode. Block of 32 elements = 1 E8M0 scale byte followed by
// the 32 element codes packed LSB-first (33 / 25 / 25 / 17 bytes). The tiles:
// kernels/baselines/baselines_hot.h.
#include "kernels/baselines/baselines.h"
#include "kernels/baselines/block_codec.h"
#include "kernels/baselines/mx_element.h"

namespace dq {
namespace {

constexpr size_t kMxBlockElems = 32;

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
                   mx_block_bytes(kind), baselines::TileSpec{mx_codec_id(kind), kind}),
        kind_(kind) {}
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

 private:
  const MxKind kind_;
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
