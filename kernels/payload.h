// The 16-byte header that opens every chunk message (layout in docs/FORMAT.md). It lets a
// receiver reject bytes that belong to another call, chunk, codec or layout instead of
// decoding garbage when ranks fall out of step.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "kernels/codec.h"

namespace dq {

enum class CodecId : uint8_t {
  kDynamiq = 1,
  kBf16 = 2,
  kMxfp8 = 3,     // E4M3 elements
  kMxfp6E3M2 = 4,
  kMxfp6E2M3 = 5,
  kMxfp4 = 6,     // E2M1 elements
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

void write_chunk_header(uint8_t* out, const ChunkHeader& h);
// Validates magic, version and every field against `expected` (n_contrib must be in
// [1, max_contrib]); on success returns kOk and the decoded header in *got.
Status check_chunk_header(ByteView in, const ChunkHeader& expected, int max_contrib,
                          ChunkHeader* got);

}  // namespace dq
