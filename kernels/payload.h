// Writing and checking the 16-byte header that opens every chunk message on the host (layout in
// docs/FORMAT.md; the fields and the check shared with the CUDA kernels: kernels/chunk_header.h).
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "kernels/chunk_header.h"
#include "kernels/codec.h"

namespace dq {

void write_chunk_header(uint8_t* out, const ChunkHeader& h);
// Validates magic, version and every field against `expected` (n_contrib must be in
// [1, max_contrib]); on success returns kOk and the decoded header in *got.
Status check_chunk_header(ByteView in, const ChunkHeader& expected, int max_contrib,
                          ChunkHeader* got);

}  // namespace dq
