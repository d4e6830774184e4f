// What DynamiQ's fused hop (kernels/cuda/dynamiq_hop.cu) and finish
// (kernels/cuda/dynamiq_finish.cu) share on the device: the layout's sections, a chunk header's
// check, a record's codes and scales decoded and checked as the host's record_valid() and
// accumulate_record() do, the level tables staged in shared memory, and the launches' grid sizing.
// Included by those two files only; every name is internal to the including file.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/cuda/cuda_compat.h"
#include "kernels/cuda/dynamiq.h"

namespace dq::cuda {
namespace {

struct LayoutView {
  const uint64_t* header;
  const uint64_t* chunk_content;
  const float* mean;
  const uint32_t* order;
  const uint32_t* offset;
  const uint32_t* chunk_first;
  const uint32_t* chunk_check;
  const uint8_t* width;
  const int8_t* exponent;  // K_j: coded as the values times 2^K_j (kernels/dynamiq_range.h)
};

__device__ __forceinline__ LayoutView layout_view(const void* layout, const DynamiqSections& s) {
  const unsigned char* b = static_cast<const unsigned char*>(layout);
  return LayoutView{reinterpret_cast<const uint64_t*>(b + s.header),
                    reinterpret_cast<const uint64_t*>(b + s.chunk_content),
                    reinterpret_cast<const float*>(b + s.mean),
                    reinterpret_cast<const uint32_t*>(b + s.order),
                    reinterpret_cast<const uint32_t*>(b + s.offset),
                    reinterpret_cast<const uint32_t*>(b + s.chunk_first),
                    reinterpret_cast<const uint32_t*>(b + s.chunk_check),
                    reinterpret_cast<const uint8_t*>(b + s.width),
                    reinterpret_cast<const int8_t*>(b + s.exponent)};
}

// This chunk's message header checked against the expected one (kernels/chunk_header.h):
// returns n_contrib, or 0 when anything disagrees.
__device__ __forceinline__ int check_header(const uint8_t* h, const LayoutView& l, int chunk,
                                            int max_contrib) {
  const ChunkHeader expected{CodecId::kDynamiq, static_cast<uint16_t>(chunk), 0,
                             static_cast<uint32_t>(l.header[0]), l.chunk_check[chunk]};
  return chunk_header_contributors(h, expected, max_contrib);
}

// Value k's code in the packed codes of a record at `bits` wide.
__device__ __forceinline__ uint32_t code_at(const uint8_t* codes, int bits, int k) {
  if (bits == 8) return codes[k];
  if (bits == 4) return (codes[k >> 1] >> (4 * (k & 1))) & 15u;
  return (codes[k >> 2] >> (2 * (k & 3))) & 3u;
}

// Group g's scale in a record at a width below 16; *bad is set where the scale bytes are invalid
// (a negative unit or scale, a zero factor: record_valid()).
__device__ __forceinline__ float record_group_scale(bool hierarchical, const uint8_t* rec, int g,
                                                    bool* bad) {
  if (hierarchical) {
    *bad |= (rec[1] & 0x80) != 0 || rec[2 + g] == 0;
    return static_cast<float>(rec[2 + g]) * bf16_to_f32(get16(rec));
  }
  *bad |= (rec[2 * g + 1] & 0x80) != 0;
  return bf16_to_f32(get16(rec + 2 * g));
}

// Value k's code in a record at `bits` < 16 wide; *bad is set for a code above 2L (L = max_mag).
__device__ __forceinline__ uint32_t record_code(bool hierarchical, int bits, const uint8_t* rec,
                                                int k, int max_mag, bool* bad) {
  const uint8_t* codes = rec + (hierarchical ? 2 + kGroupsPerSuperGroup : 2 * kGroupsPerSuperGroup);
  const uint32_t code = code_at(codes, bits, k);
  *bad |= code > static_cast<uint32_t>(2 * max_mag);
  return code;
}

// Value k of a record (accumulate_record()'s decoded term) at `bits` wide; *bad is set where the
// record holds invalid content that this value reads (its group's scale, its code). A width-16
// record is always valid.
__device__ __forceinline__ float decode_value(const LevelTable* levels, bool hierarchical, int bits,
                                              const uint8_t* rec, int k, bool* bad) {
  if (bits == 16) return bf16_to_f32(get16(rec + 2 * k));
  const LevelTable& t = levels[width_index(bits)];
  const float scale = record_group_scale(hierarchical, rec, k / kGroup, bad);
  return decode_code(t, record_code(hierarchical, bits, rec, k, t.max_mag, bad), scale);
}

// The checks of the record's scales for thread k < 16 (group k's scale and the unit), so that a
// block checks every scale once (record_valid()) whatever values it decodes.
__device__ __forceinline__ bool record_scales_bad(bool hierarchical, int bits, const uint8_t* rec,
                                                  int k) {
  if (bits == 16 || k >= kGroupsPerSuperGroup) return false;
  bool bad = false;
  (void)record_group_scale(hierarchical, rec, k, &bad);
  return bad;
}

// Whether a record (its offset in the body, `bits` wide) ends past the message's capacity: the
// layout claims more than the message holds. The same answer in every thread.
__device__ __forceinline__ bool record_past_capacity(const DynamiqPlan& p, uint32_t offset,
                                                     int bits) {
  return kChunkHeaderBytes + static_cast<unsigned long long>(offset) +
             static_cast<unsigned long long>(p.record[width_index(bits)]) >
         p.capacity;
}

// uint4s of a staged record: a width-16 record (512 bytes) at any offset modulo 16.
constexpr int kRecordStage = (2 * kSuperGroup + 15 + 15) / 16;

// The host's three level tables in shared memory. Only max_mag, extra_steps and level[0..L+1] are
// read (588 bytes instead of 18.5 KB a block); inv_gap, start and decode are derived from them
// by build_level_table()'s own arithmetic (IEEE division, the same scan, a sign flip), so they
// hold the host's bits; `lookups` false (a decode only: the finish) leaves inv_gap and start
// unset. Ends with a barrier: the tables are ready when it returns.
__device__ inline void stage_level_tables(const LevelTable* g, LevelTable* t, bool lookups = true) {
  const int k = static_cast<int>(threadIdx.x);
  if (k < 3) {
    t[k].max_mag = load_global(&g[k].max_mag);
    t[k].extra_steps = load_global(&g[k].extra_steps);
  }
  __syncthreads();
  for (int w = 0; w < 3; ++w)
    if (k <= t[w].max_mag + 1 && k < 130) t[w].level[k] = load_global(&g[w].level[k]);
  __syncthreads();
  constexpr int kCells = (kLevelGrid + 1 + kHopThreads - 1) / kHopThreads;  // cells a thread
  for (int w = 0; w < 3; ++w) {
    LevelTable& x = t[w];
    const int top = x.max_mag;
    const int signed_mag = k - top;  // code k (kHopThreads = 256 codes)
    if (k <= 2 * top) {
      const float mag = x.level[signed_mag < 0 ? -signed_mag : signed_mag];
      x.decode[k] = signed_mag < 0 ? -mag : mag;
    } else {
      x.decode[k] = 0.0f;
    }
    if (!lookups) continue;
    if (k < top) x.inv_gap[k] = 1.0f / (x.level[k + 1] - x.level[k]);
    if (k == top) x.inv_gap[k] = 0.0f;
    // The scan resumes from the previous cell's answer: the host's answer never decreases with
    // the cell (each test level[r+1] <= lo that holds for one cell holds for the next).
    int r = 0;
    for (int cell = k * kCells; cell < (k + 1) * kCells && cell <= kLevelGrid; ++cell) {
      const float lo = static_cast<float>(cell) / kLevelGrid;
      while (r < top && x.level[r + 1] <= lo) ++r;
      x.start[cell] = r;
    }
  }
  __syncthreads();
}

// A launch's blocks for `work` blocks' worth: at most max_blocks (0: 4096), at least 1.
inline unsigned grid_for(size_t work, int max_blocks) {
  const size_t cap = max_blocks > 0 ? static_cast<size_t>(max_blocks) : 4096;
  const size_t n = work < cap ? work : cap;
  return static_cast<unsigned>(n > 0 ? n : 1);
}

// The device's SM count, 0 when it cannot be asked (the query's error is not left behind).
inline int multiprocessors() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace
}  // namespace dq::cuda
