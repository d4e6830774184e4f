#include "kernels/payload.h"

#include <cstring>

namespace dq {
namespace {
void put16(uint8_t* p, uint16_t v) {
  p[0] = v & 0xff;
  p[1] = v >> 8;
}
void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = (v >> (8 * i)) & 0xff;
}
}  // namespace

void write_chunk_header(uint8_t* out, const ChunkHeader& h) {
  put16(out + 0, kPayloadMagic);
  out[2] = kPayloadVersion;
  out[3] = static_cast<uint8_t>(h.codec);
  put16(out + 4, h.chunk);
  put16(out + 6, h.n_contrib);
  put32(out + 8, h.call);
  put32(out + 12, h.layout_check);
}

Status check_chunk_header(ByteView in, const ChunkHeader& expected, int max_contrib,
                          ChunkHeader* got) {
  if (in.data == nullptr || in.size < kChunkHeaderBytes)
    DQ_FAIL(Status::kMalformedPayload, "payload truncated: %zu bytes, header needs %zu", in.size,
            kChunkHeaderBytes);
  const uint8_t* p = in.data;
  const ChunkHeader h = read_chunk_header(p);
  switch (chunk_header_mismatch(p, expected, max_contrib)) {
    case ChunkHeaderMismatch::kNone:
      break;
    case ChunkHeaderMismatch::kMagicOrVersion:
      DQ_FAIL(Status::kMalformedPayload, "payload magic/version 0x%04x/%u, expected 0x%04x/%u",
              get16(p), p[2], kPayloadMagic, kPayloadVersion);
    case ChunkHeaderMismatch::kCodec:
      DQ_FAIL(Status::kMalformedPayload, "payload codec %u, expected %u",
              static_cast<unsigned>(h.codec), static_cast<unsigned>(expected.codec));
    case ChunkHeaderMismatch::kChunk:
      DQ_FAIL(Status::kMalformedPayload, "payload chunk %u, expected %u", h.chunk, expected.chunk);
    case ChunkHeaderMismatch::kCall:
      DQ_FAIL(Status::kMalformedPayload, "payload of call %u, expected call %u", h.call,
              expected.call);
    case ChunkHeaderMismatch::kLayout:
      DQ_FAIL(Status::kMalformedPayload,
              "payload layout digest 0x%08x, expected 0x%08x (ranks disagree)", h.layout_check,
              expected.layout_check);
    case ChunkHeaderMismatch::kContributors:
      DQ_FAIL(Status::kMalformedPayload, "payload sums %u workers, must be 1..%d", h.n_contrib,
              max_contrib);
  }
  if (got) *got = h;
  return Status::kOk;
}

}  // namespace dq
