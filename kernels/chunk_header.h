// The 16-byte header that opens every chunk message (layout in docs/FORMAT.md), its little-endian
// field loads and the check of a received header against the expected one, written once for
// the host (kernels/payload.cc) and the CUDA kernels (kernels/cuda/baselines.cu,
// kernels/cuda/dynamiq_hop.cu): the header lets a receiver reject bytes that belong to another
// call, chunk, codec or layout instead of decoding garbage when ranks fall out of step.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/hd.h"

namespace dq {

enum class CodecId : uint8_t {
  kDynamiq = 1,
  kBf16 = 2,
  kMxfp8 = 3,  // E4M3 elements
  kMxfp6E3M2 = 4,
  kMxfp6E2M3 = 5,
  kMxfp4 = 6,  // E2M1 elements
  kUniform = 7,
};

constexpr uint16_t kPayloadMagic = 0x5144;  // "DQ" little-endian
constexpr uint8_t kPayloadVersion = 1;
constexpr size_t kChunkHeaderBytes = 16;

struct ChunkHeader {
  CodecId codec;
  uint16_t chunk;         // chunk index
  uint16_t n_contrib;     // workers summed into this payload
  uint32_t call;          // low 32 bits of the call sequence number
  uint32_t layout_check;  // codec-defined digest of the chunk's layout (widths, ranges)
};

// Little-endian loads of the wire formats (headers and records), whatever the host's order.
DQ_HD uint16_t get16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}
DQ_HD uint32_t get32(const uint8_t* p) {
  return p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// The fields of the kChunkHeaderBytes bytes at p (magic and version not included).
DQ_HD ChunkHeader read_chunk_header(const uint8_t* p) {
  return ChunkHeader{static_cast<CodecId>(p[3]), get16(p + 4), get16(p + 6), get32(p + 8),
                     get32(p + 12)};
}

// The first part of a received header that disagrees with the expected one, in this order.
enum class ChunkHeaderMismatch : int {
  kNone = 0,
  kMagicOrVersion,
  kCodec,
  kChunk,
  kCall,
  kLayout,
  kContributors,  // n_contrib outside [1, max_contrib]
};

// Checks the header at p (kChunkHeaderBytes readable) against `expected` (its n_contrib is not
// used): magic, version, codec, chunk, call, layout digest, then n_contrib in [1, max_contrib].
DQ_HD ChunkHeaderMismatch chunk_header_mismatch(const uint8_t* p, const ChunkHeader& expected,
                                                int max_contrib) {
  if (get16(p) != kPayloadMagic || p[2] != kPayloadVersion)
    return ChunkHeaderMismatch::kMagicOrVersion;
  const ChunkHeader h = read_chunk_header(p);
  if (h.codec != expected.codec) return ChunkHeaderMismatch::kCodec;
  if (h.chunk != expected.chunk) return ChunkHeaderMismatch::kChunk;
  if (h.call != expected.call) return ChunkHeaderMismatch::kCall;
  if (h.layout_check != expected.layout_check) return ChunkHeaderMismatch::kLayout;
  if (h.n_contrib < 1 || h.n_contrib > max_contrib) return ChunkHeaderMismatch::kContributors;
  return ChunkHeaderMismatch::kNone;
}

// The kernels' form: the header's n_contrib when it passes chunk_header_mismatch(), else 0.
DQ_HD int chunk_header_contributors(const uint8_t* p, const ChunkHeader& expected,
                                    int max_contrib) {
  return chunk_header_mismatch(p, expected, max_contrib) == ChunkHeaderMismatch::kNone
             ? get16(p + 6)
             : 0;
}

}  // namespace dq
