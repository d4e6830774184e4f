// What DynamiQ's fused hop (kernels/cuda/dynamiq_hop.cu) and finish
// (kernels/cuda/dynamiq_finish.cu) share on the device: the layout's sections, a chunk header's
// check, a record's codes and scales decoded and checked as the host's record_valid() and
// accumulate_record() do, a warp's lanes each holding 8 values of a super-group (a record staged
// in the warp's shared memory, a lane's bytes moved in the widest accesses its address allows),
// the level tables staged in shared memory, and the launches' grid sizing.
// Included by those two files only; every name is internal to the including file.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/cuda/block.cuh"
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

// ---- a warp per super-group (the fused hop and the finish): lane l holds values 8l .. 8l+7, half
// of group l / 2

constexpr int kHopWarps = kHopThreads / kWarp;    // super-groups a block has in hand at once
constexpr int kLaneValues = kSuperGroup / kWarp;  // values a lane holds
static_assert(kLaneValues == 8 && kGroup == 2 * kLaneValues, "a group is a lane pair");

// The calling thread's lane, recomputed where it is asked (opaque()): the hop's loop would
// otherwise hold the lane and every index derived from it in registers across a super-group,
// which needs them all.
__device__ __forceinline__ int opaque_lane() {
  return static_cast<int>(opaque(threadIdx.x) % kWarp);
}

// Where a lane's n bytes (n = 2, 4, 8 or 16) may move in one access each: the widest size of at
// most 8 bytes that divides both n and the address. Lane l's bytes start at base + l x n, so every
// lane of the warp gets the same answer.
__device__ __forceinline__ int lane_access_size(const void* p, int n) {
  const unsigned a = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p)) | 8u;
  const int by_address = static_cast<int>(a & (0u - a));  // lowest set bit, at most 8
  return by_address < n ? by_address : n;
}

// n bytes at dst (global memory), byte b at bits 8(b % 8) of lo (b < 8) or hi (b >= 8).
__device__ __forceinline__ void store_lane_bytes(uint8_t* dst, uint64_t lo, uint64_t hi, int n) {
  const int size = lane_access_size(dst, n);
  for (int b = 0; b < n; b += size) {
    const uint64_t w = b < 8 ? lo >> (8 * b) : hi >> (8 * (b - 8));
    if (size == 8) {
      store_global(reinterpret_cast<uint64_t*>(dst + b), w);
    } else if (size == 4) {
      store_global(reinterpret_cast<uint32_t*>(dst + b), static_cast<uint32_t>(w));
    } else if (size == 2) {
      store_global(reinterpret_cast<uint16_t*>(dst + b), static_cast<uint16_t>(w));
    } else {
      store_global(dst + b, static_cast<uint8_t>(w));
    }
  }
}

// n bytes at src (shared memory) into *lo and *hi, as store_lane_bytes() lays them out.
__device__ __forceinline__ void load_lane_bytes(const uint8_t* src, int n, uint64_t* lo,
                                                uint64_t* hi) {
  const int size = lane_access_size(src, n);
  *lo = 0;
  *hi = 0;
  for (int b = 0; b < n; b += size) {
    uint64_t w;
    if (size == 8) {
      w = *reinterpret_cast<const uint64_t*>(src + b);
    } else if (size == 4) {
      w = *reinterpret_cast<const uint32_t*>(src + b);
    } else if (size == 2) {
      w = *reinterpret_cast<const uint16_t*>(src + b);
    } else {
      w = src[b];
    }
    if (b < 8) {
      *lo |= w << (8 * b);
    } else {
      *hi |= w << (8 * (b - 8));
    }
  }
}

// The record at `src` (global memory, `n` bytes) copied into the warp's stage; every lane has read
// the stage's previous record before, and sees the whole record after. Returns where it starts.
__device__ __forceinline__ const uint8_t* stage_record_warp(const uint8_t* src, int n, uint4* stage,
                                                            int lane) {
  __syncwarp();
  const uint8_t* r = group_copy_to_shared(src, n, stage, lane, kWarp);
  __syncwarp();
  return r;
}

// The lane's 8 codes of a staged record `r` at `bits` (2, 4 or 8) wide, in value order, and its
// group's scale. Returns whether what the lane read is invalid: its group's scale, or a code above
// 2 * max_mag (the table's top signed level).
__device__ __forceinline__ bool lane_codes(bool hierarchical, const uint8_t* r, int bits,
                                           int max_mag, int lane, uint32_t codes[kLaneValues],
                                           float* scale) {
  bool bad = false;
  *scale = record_group_scale(hierarchical, r, lane / 2, &bad);
  const uint8_t* packed = r + (hierarchical ? 2 + kGroupsPerSuperGroup : 2 * kGroupsPerSuperGroup);
  uint64_t lo, hi;
  load_lane_bytes(packed + bits * lane, bits, &lo, &hi);  // 8 codes of `bits` bits: `bits` bytes
  const uint32_t mask = (1u << bits) - 1u;
  DQ_UNROLL
  for (int i = 0; i < kLaneValues; ++i) {
    codes[i] = static_cast<uint32_t>(lo >> (bits * i)) & mask;
    bad |= codes[i] > static_cast<uint32_t>(2 * max_mag);
  }
  return bad;
}

// The lane's 8 values of a staged record `r` at `bits` wide added to v, in value order
// (accumulate_record()'s terms): BF16 at width 16, else its group's scale and its 8 codes. Returns
// whether what the lane read is invalid (lane_codes()); a width-16 record is always valid.
__device__ __forceinline__ bool add_record_lane(bool hierarchical, const LevelTable* levels,
                                                const uint8_t* r, int bits, int lane, float* v) {
  if (bits == 16) {
    uint64_t lo, hi;
    load_lane_bytes(r + 2 * kLaneValues * lane, 2 * kLaneValues, &lo, &hi);
    DQ_UNROLL
    for (int i = 0; i < kLaneValues; ++i)
      v[i] += bf16_to_f32(static_cast<uint16_t>((i < 4 ? lo : hi) >> (16 * (i % 4))));
    return false;
  }
  const LevelTable& t = levels[width_index(bits)];
  uint32_t codes[kLaneValues];
  float scale;
  const bool bad = lane_codes(hierarchical, r, bits, t.max_mag, lane, codes, &scale);
  DQ_UNROLL
  for (int i = 0; i < kLaneValues; ++i) v[i] += decode_code(t, codes[i], scale);
  return bad;
}

// The host's three level tables in shared memory. Only max_mag, extra_steps and level[0..L+1] are
// read (588 bytes instead of 18.5 KB a block); inv_gap, start and decode are derived from them
// by build_level_table()'s own arithmetic (IEEE division, the same scan, a sign flip), so they
// hold the host's bits; `lookups` false (a decode only: the finish) leaves inv_gap and start
// unset. `widths`, when given, is a shared word written before the call: bit w set for each
// table w (width_index()) the block reads; the others are left unset. Ends with a barrier: the
// tables are ready when it returns.
__device__ inline void stage_level_tables(const LevelTable* g, LevelTable* t, bool lookups = true,
                                          const unsigned* widths = nullptr) {
  const int k = static_cast<int>(threadIdx.x);
  if (k < 3) {
    t[k].max_mag = load_global(&g[k].max_mag);
    t[k].extra_steps = load_global(&g[k].extra_steps);
  }
  __syncthreads();
  const unsigned staged = widths != nullptr ? *widths : 7u;  // the same in every thread
  for (int w = 0; w < 3; ++w)
    if ((staged >> w & 1u) != 0 && k <= t[w].max_mag + 1 && k < 130)
      t[w].level[k] = load_global(&g[w].level[k]);
  __syncthreads();
  constexpr int kCells = (kLevelGrid + 1 + kHopThreads - 1) / kHopThreads;  // cells a thread
  for (int w = 0; w < 3; ++w) {
    if ((staged >> w & 1u) == 0) continue;
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
    // The host's scan from r = 0 stops at the number of levels 1..top at or below the cell's
    // lower edge, since levels never decrease (build_level_table). The thread's first cell's
    // answer by bisection, the largest r with level[r] <= lo (level[0] = 0), then the scan resumes
    // from the previous cell's answer. A scan from 0 at the first cell made each warp wait for its
    // highest lane: 617 passes a block for the default 8-bit levels where this takes 98.
    const int first = k * kCells;
    const float first_lo = static_cast<float>(first) / kLevelGrid;
    int r = 0, above = top;  // the answer lies in [r, above]
    while (r < above) {
      const int mid = (r + above + 1) / 2;
      if (x.level[mid] <= first_lo) {
        r = mid;
      } else {
        above = mid - 1;
      }
    }
    for (int cell = first; cell < (k + 1) * kCells && cell <= kLevelGrid; ++cell) {
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
