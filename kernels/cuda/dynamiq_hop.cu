// DynamiQ's fused hop (leaf included) on the device: the bytes of the host codec's
// DynamiqCodec::fused_hop (kernels/dynamiq_codec.cc), following its scalar path (the AVX2 path
// gives the same bytes; tests/kernels/golden_test.cc).
//
// Work split: a block of 256 threads takes a contiguous run of the chunk's wire positions and
// stages the level tables in shared memory (the only block barriers); each warp then takes one
// super-group at a time, lane l holding values 8l .. 8l+7 (half of group l / 2), so that the
// scales come from shuffles and nothing waits on a block barrier. Per super-group:
//  - lane q reads the layout words of the warp's q-th next super-group into shared memory, 32 at
//    a time; every lane draws one of the super-group's 32 Philox blocks of rounding bits and
//    reads its 8 values' halves from the warp's shared words (rounding_block()); with correlated
//    rounding, each lane draws one group's stratum, for two super-groups at a time;
//  - v = own - mu (16-byte vector loads where aligned), plus each input's decoded value in input
//    order (the host's order), each input's record staged in the warp's shared memory first;
//  - group maxima on the magnitude bits (one shuffle), the super-group maximum, the unit and the
//    lane's group factor (group_factor(), as the host's scalar path);
//  - each value rounded with round_up_threshold / round_up_coarse / round_up_tie on the host's
//    level tables; a lane's 8 codes packed LSB first and stored in the widest aligned stores.
// The finish is kernels/cuda/dynamiq_finish.cu; what both decode with is dynamiq_record.cuh.
#include "kernels/bf16.h"
#include "kernels/cuda/block.cuh"
#include "kernels/cuda/dynamiq.h"
#include "kernels/cuda/dynamiq_record.cuh"
#include "kernels/dynamiq_range.h"

namespace dq::cuda {
namespace {

struct HopInputs {
  const uint8_t* p[kMaxHopInputs];
};

// The hop's output header (one thread): the inputs' headers checked, their contributors summed
// with this rank's own.
__device__ __forceinline__ void write_hop_header(const LayoutView& l, int chunk,
                                                 const HopInputs& in, int n_in, int n_workers,
                                                 uint8_t* out, unsigned* error) {
  const uint32_t call = static_cast<uint32_t>(load_global(&l.header[0]));
  const uint32_t check = load_global(&l.chunk_check[chunk]);
  const ChunkHeader expected{CodecId::kDynamiq, static_cast<uint16_t>(chunk), 0, call, check};
  int contrib = 1;
  for (int i = 0; i < n_in; ++i) {
    uint8_t got[kChunkHeaderBytes];
    for (size_t b = 0; b < kChunkHeaderBytes; ++b) got[b] = load_global(in.p[i] + b);
    const int c = chunk_header_contributors(got, expected, n_workers);
    if (c == 0) atomicOr(error, kDynamiqBadHeader);
    contrib += c;
  }
  if (contrib > n_workers) atomicOr(error, kDynamiqTooManyWorkers);
  const uint8_t h[kChunkHeaderBytes] = {static_cast<uint8_t>(kPayloadMagic & 0xff),
                                        static_cast<uint8_t>(kPayloadMagic >> 8),
                                        kPayloadVersion,
                                        static_cast<uint8_t>(CodecId::kDynamiq),
                                        static_cast<uint8_t>(chunk & 0xff),
                                        static_cast<uint8_t>((chunk >> 8) & 0xff),
                                        static_cast<uint8_t>(contrib & 0xff),
                                        static_cast<uint8_t>((contrib >> 8) & 0xff),
                                        static_cast<uint8_t>(call),
                                        static_cast<uint8_t>(call >> 8),
                                        static_cast<uint8_t>(call >> 16),
                                        static_cast<uint8_t>(call >> 24),
                                        static_cast<uint8_t>(check),
                                        static_cast<uint8_t>(check >> 8),
                                        static_cast<uint8_t>(check >> 16),
                                        static_cast<uint8_t>(check >> 24)};
  for (size_t b = 0; b < kChunkHeaderBytes; ++b) store_global(out + b, h[b]);
}

// ---- the fused hop, a warp per super-group (dynamiq_record.cuh: lane l holds values 8l .. 8l+7)

// Super-groups a block should take at least (the launch's grid): its set-up (the level tables,
// about 0.6 KB read, and three block barriers) stays a few percent of the block's traffic.
constexpr int kHopSupergroupsPerBlock = 16;

// The level tables (bit width_index(w)) of the widths w of wire positions first .. last of a
// chunk, widest first.
__device__ __forceinline__ unsigned widths_between(const LayoutView& l, uint32_t first,
                                                   uint32_t last) {
  return hop_level_tables(load_global(&l.width[load_global(&l.order[first])]),
                          load_global(&l.width[load_global(&l.order[last])]));
}

// A super-group's layout words.
struct SgLayout {
  uint32_t j;       // its index in the tensor (the wire position's super-group)
  uint32_t offset;  // its record's offset in the message body
  float mean;
  int exponent;  // K_j
  int bits;
};

__device__ __forceinline__ SgLayout load_sg_layout(const LayoutView& l, uint32_t i) {
  SgLayout s;
  s.j = load_global(&l.order[i]);
  s.offset = load_global(&l.offset[i]);
  s.bits = load_global(&l.width[s.j]);
  s.mean = load_global(&l.mean[s.j]);
  s.exponent = load_global(&l.exponent[s.j]);
  return s;
}

// A warp's shared memory. What a lane would otherwise hold for the whole loop (the layout words
// it read, the strata it drew) is kept here: the encoding needs every register.
struct HopWarpShared {
  uint32_t words[kWarp * 4];  // the super-group's 32 Philox blocks of rounding bits: block b at 4b
  // An input's record, at its offset modulo 16 (add_input()); while encoding, each lane's tie
  // thresholds (encode_values()).
  uint4 stage[kRecordStage > 4 * kSuperGroup / 16 ? kRecordStage : 4 * kSuperGroup / 16];
  SgLayout sg[kWarp];                  // the layout words of the warp's next 32 super-groups
  float pi[2 * kGroupsPerSuperGroup];  // the strata of the next two super-groups' groups
  uint32_t first;                      // the wire position of the warp's first super-group
};

// The lane's own values of super-group j less the mean (0 past the tensor's end): 16-byte vector
// loads where the lane's values are whole and aligned, element loads otherwise.
__device__ __forceinline__ void load_own(const DynamiqPlan& p, const void* own, int own_bf16,
                                         const SgLayout& sg, int lane, float* v) {
  const size_t first = static_cast<size_t>(sg.j) * kSuperGroup + lane * kLaneValues;
  const size_t left = first < p.count ? p.count - first : 0;
  const int valid = left < static_cast<size_t>(kLaneValues) ? static_cast<int>(left) : kLaneValues;
  float x[kLaneValues];
  if (own_bf16) {
    const uint16_t* src = static_cast<const uint16_t*>(own) + first;
    if (valid == kLaneValues && (reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
      const uint4 w = load_global(reinterpret_cast<const uint4*>(src));
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      DQ_UNROLL
      for (int i = 0; i < kLaneValues; ++i)
        x[i] = f32_from_bits((i % 2 ? words[i / 2] >> 16 : words[i / 2]) << 16);
    } else {
      DQ_UNROLL
      for (int i = 0; i < kLaneValues; ++i)
        x[i] = i < valid ? bf16_to_f32(load_global(src + i)) : 0.0f;
    }
  } else {
    const float* src = static_cast<const float*>(own) + first;
    if (valid == kLaneValues && (reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
      const uint4 a = load_global(reinterpret_cast<const uint4*>(src));
      const uint4 b = load_global(reinterpret_cast<const uint4*>(src) + 1);
      const uint32_t words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      DQ_UNROLL
      for (int i = 0; i < kLaneValues; ++i) x[i] = f32_from_bits(words[i]);
    } else {
      DQ_UNROLL
      for (int i = 0; i < kLaneValues; ++i) x[i] = i < valid ? load_global(src + i) : 0.0f;
    }
  }
  const float mu = sg.bits == 16 ? 0.0f : sg.mean;
  const float scale = sg.exponent == 0 ? 1.0f : pow2f(sg.exponent);
  DQ_UNROLL
  for (int i = 0; i < kLaneValues; ++i) {
    if (i >= valid) {
      v[i] = 0.0f;
    } else {
      v[i] = sg.exponent == 0 ? x[i] - mu : x[i] * scale - mu;
    }
  }
}

// Input record `src` (in the message body) added to the lane's values, decoded as the host's
// accumulate_record(): staged in the warp's shared buffer, then add_record_lane(). Returns whether
// what the lane read is invalid, so that the warp checks every byte record_valid() checks.
__device__ __forceinline__ bool add_input(const DynamiqDeviceParams& d, const LevelTable* levels,
                                          const uint8_t* src, int bits, int lane, HopWarpShared& ws,
                                          float* v) {
  const uint8_t* r = stage_record_warp(src, d.plan.record[width_index(bits)], ws.stage, lane);
  return add_record_lane(d.hierarchical_scales, levels, r, bits, lane, v);
}

// The record's scales from the lane's values: its group's maximum (the magnitude bit patterns,
// ordered like the floats, NaN above Inf) and, with hierarchical scales, the super-group's; the
// scale bytes written by lane 0 (the unit) and the even lanes (their group's). Returns the
// lane's group scale.
__device__ __forceinline__ float encode_scales(bool hierarchical, const float* v, int lane,
                                               uint8_t* rec) {
  uint32_t a = 0;
  DQ_UNROLL
  for (int i = 0; i < kLaneValues; ++i) {
    const uint32_t m = f32_bits(v[i]) & 0x7fffffffu;
    a = m > a ? m : a;
  }
  const uint32_t pair = __shfl_xor_sync(kFullMask, a, 1);
  const uint32_t group_max = pair > a ? pair : a;
  const int g = lane / 2;
  if (hierarchical) {
    uint32_t sgmax = group_max;
    DQ_UNROLL
    for (int off = 2; off < kWarp; off <<= 1) {
      const uint32_t o = __shfl_xor_sync(kFullMask, sgmax, off);
      sgmax = o > sgmax ? o : sgmax;
    }
    const uint16_t unit_bits = supergroup_unit_bf16(f32_from_bits(sgmax));
    const float unit = bf16_to_f32(unit_bits);
    const uint8_t f = group_factor(f32_from_bits(group_max), unit);
    if (lane == 0) {
      store_lane_bytes(rec, unit_bits, 0, 2);
    }
    if (lane % 2 == 0) store_global(rec + 2 + g, f);
    return static_cast<float>(f) * unit;
  }
  const uint16_t sb = f32_to_bf16_up(f32_from_bits(group_max));
  if (lane % 2 == 0) store_lane_bytes(rec + 2 * g, sb, 0, 2);
  return bf16_to_f32(sb);
}

// The lane's values stochastically rounded into the record: the super-group's 32 Philox blocks
// drawn a block a lane and exchanged through shared memory (value k takes half (k / 8) % 2 of
// word k / 64 of block 8 ((k / 16) % 4) + k % 8: rounding_block()), to BF16 at width 16, else
// on the host's levels with the lane's group scale and stratum pi, the codes packed LSB first.
__device__ __forceinline__ void encode_values(const DynamiqDeviceParams& d,
                                              const LevelTable* levels, const float* v, int bits,
                                              uint64_t jr, float scale, float pi, float strata,
                                              const RoundingKey& key, int lane, HopWarpShared& ws,
                                              uint8_t* rec) {
  const uint32_t* words = ws.words + 4 * (8 * ((lane / 2) % 4)) + (lane / 8) % 4;
  const int half = 16 * (lane % 2);
  uint64_t lo = 0, hi = 0;
  if (bits == 16) {
    DQ_UNROLL
    for (int i = 0; i < kLaneValues; ++i) {
      const uint32_t u16 = (words[4 * i] >> half) & 0xffffu;
      const uint64_t h = f32_to_bf16_stochastic(v[i], u16);
      if (i < 4) {
        lo |= h << (16 * i);
      } else {
        hi |= h << (16 * (i - 4));
      }
    }
    store_lane_bytes(rec + 2 * kLaneValues * lane, lo, hi, 2 * kLaneValues);
    return;
  }
  const LevelTable& t = levels[width_index(bits)];
  // A tie (the 16 bits leave the rounding open, probability 2^-16 a value) is settled after the
  // loop from its threshold x, kept in the warp's stage: one copy of the tie's Philox draw, and
  // no value held while it runs.
  float* tie_x = reinterpret_cast<float*>(ws.stage) + kLaneValues * lane;
  unsigned ties = 0, negative = 0;
  DQ_UNROLL
  for (int i = 0; i < kLaneValues; ++i) {
    const uint32_t u16 = (words[4 * i] >> half) & 0xffffu;
    const float m = magnitude_ratio(v[i], scale);
    const int r = level_floor(t, m);
    const float x = round_up_threshold(t, m, r, pi, strata);
    int up = round_up_coarse(x, u16);
    if (up < 0) {
      ties |= 1u << i;
      tie_x[i] = x;
      up = 0;
    }
    negative |= (v[i] < 0.0f ? 1u : 0u) << i;
    lo |= static_cast<uint64_t>(encode_code(r + up, v[i] < 0.0f, t.max_mag)) << (bits * i);
  }
  DQ_NO_UNROLL
  for (int i = 0; i < kLaneValues; ++i) {
    if ((ties >> i & 1u) == 0) continue;
    const uint32_t u16 = (words[4 * i] >> half) & 0xffffu;
    const uint64_t e = jr * kSuperGroup + static_cast<uint64_t>(kLaneValues * lane + i);
    if (round_up_tie(tie_x[i], u16,
                     rounding_tie_uniform(opaque(key.seed), opaque(key.call), key.rank, e)) != 0) {
      // One level up in magnitude: encode_code() of r + 1, within 0..2L.
      const uint64_t one = uint64_t{1} << (bits * i);
      lo = (negative >> i & 1u) != 0 ? lo - one : lo + one;
    }
  }
  uint8_t* codes =
      rec + (d.hierarchical_scales ? 2 + kGroupsPerSuperGroup : 2 * kGroupsPerSuperGroup);
  store_lane_bytes(codes + bits * lane, lo, 0, bits);  // 8 codes of `bits` bits: `bits` bytes
}

// Block set-up: the chunk's extent (thread 0, into meta[0..2]: the content bytes, the first and
// end wire position), the output header (block 0) and the padding after the body (all blocks).
// Ends with the barrier that publishes meta.
__device__ void hop_setup(const DynamiqDeviceParams& d, const LayoutView& l, int chunk,
                          const HopInputs& in, int n_in, uint8_t* out, unsigned* error,
                          unsigned long long* meta) {
  const int k = static_cast<int>(threadIdx.x);
  const DynamiqPlan& p = d.plan;
  if (k == 0) {
    meta[0] = load_global(&l.chunk_content[chunk]);
    meta[1] = load_global(&l.chunk_first[chunk]);
    meta[2] = load_global(&l.chunk_first[chunk + 1]);
    if (blockIdx.x == 0) {
      if (meta[0] + kChunkHeaderBytes > p.capacity) atomicOr(error, kDynamiqChunkOverCapacity);
      write_hop_header(l, chunk, in, n_in, p.n_workers, out, error);
    }
  }
  __syncthreads();
  uint8_t* body = out + kChunkHeaderBytes;
  const unsigned long long body_capacity = p.capacity - kChunkHeaderBytes;
  for (unsigned long long b =
           meta[0] + blockIdx.x * static_cast<unsigned long long>(kHopThreads) + k;
       b < body_capacity; b += static_cast<unsigned long long>(gridDim.x) * kHopThreads)
    store_global(body + b, uint8_t{0});
}

// One super-group by one warp: its record checked against the capacity, an inert record for a
// non-finite mean, else the own values, every input in input order (the host's order) and the
// compression. `pi`: the lane's group's stratum (0 without correlated rounding). The same
// branches in every lane.
__device__ void hop_supergroup(const DynamiqDeviceParams& d, const LevelTable* levels,
                               const void* own, int own_bf16, const HopInputs& in, int n_in,
                               uint8_t* body, const SgLayout& sg, uint64_t sg_base, float pi,
                               float strata, const RoundingKey& key, unsigned* error,
                               HopWarpShared& ws) {
  const int lane = opaque_lane();
  const DynamiqPlan& p = d.plan;
  // A record the message cannot hold is neither written nor read, nor are its own values.
  if (record_past_capacity(p, sg.offset, sg.bits)) {
    if (lane == 0) atomicOr(error, kDynamiqChunkOverCapacity);
    return;
  }
  uint8_t* rec = body + sg.offset;
  if ((f32_bits(sg.mean) & 0x7f800000u) == 0x7f800000u) {
    // The non-finite mean carries the result: an inert 2-bit record.
    const int scale_bytes = p.record[0] - kSuperGroup * 2 / 8;
    for (int b = lane; b < p.record[0]; b += kWarp) {
      uint8_t byte = 0x55;                                                    // code 1 = zero
      if (b < scale_bytes) byte = (d.hierarchical_scales && b >= 2) ? 1 : 0;  // factors 1, unit 0
      store_global(rec + b, byte);
    }
    return;
  }
  // The rounding bits first, while no value is held: the draw needs a dozen registers.
  const Philox4 w =
      philox_draw(opaque(key.seed), opaque(key.call), key.rank, kStreamRounding,
                  rounding_block((sg_base + sg.j) * kSuperGroup) + static_cast<uint32_t>(lane));
  __syncwarp();  // every lane has read the previous super-group's words
  DQ_UNROLL
  for (int q = 0; q < 4; ++q) ws.words[4 * lane + q] = w.v[q];
  // (add_input()'s or encode_values()' barrier publishes them)
  float v[kLaneValues];
  load_own(p, own, own_bf16, sg, lane, v);
  bool bad = false;
  for (int m = 0; m < n_in; ++m)
    bad |= add_input(d, levels, in.p[m] + kChunkHeaderBytes + sg.offset, sg.bits, lane, ws, v);
  if (bad) atomicOr(error, kDynamiqBadRecord);
  const float scale = sg.bits == 16 ? 0.0f : encode_scales(d.hierarchical_scales, v, lane, rec);
  __syncwarp();  // the rounding words
  encode_values(d, levels, v, sg.bits, sg_base + sg.j, scale, pi, strata, key, lane, ws, rec);
}

// The warp's super-groups of the block's run [begin, end): positions begin + warp + 8t. Lane q
// reads the layout words of 32 of them at a time; the strata of correlated rounding are drawn two
// super-groups at a time (lanes 0..15 the first's groups, lanes 16..31 the second's), so that no
// lane idles through the 12-round shuffle.
__device__ void hop_warp(const DynamiqDeviceParams& d, const LayoutView& l,
                         const LevelTable* levels, const void* own, int own_bf16,
                         const HopInputs& in, int n_in, uint8_t* body, uint32_t begin, uint32_t end,
                         bool corr, const RoundingKey& key, unsigned* error, HopWarpShared& ws) {
  const uint32_t warp = static_cast<uint32_t>(threadIdx.x) / kWarp;
  const uint32_t count = end > begin + warp ? (end - begin - warp + kHopWarps - 1) / kHopWarps : 0;
  const uint64_t sg_base = key.element_base / kSuperGroup;
  const float strata = corr ? static_cast<float>(key.strata) : 1.0f;
  if (threadIdx.x % kWarp == 0) ws.first = begin + warp;  // (the loop's first barrier publishes it)
  for (uint32_t t0 = 0; t0 < count; t0 += kWarp) {        // the same trips in the warp
    const int n = count - t0 < static_cast<uint32_t>(kWarp) ? static_cast<int>(count - t0) : kWarp;
    int lane = opaque_lane();
    __syncwarp();  // every lane has read the previous 32 super-groups' words
    if (lane < n) ws.sg[lane] = load_sg_layout(l, ws.first + kHopWarps * (t0 + lane));
    for (int q = 0; q < n; q += 2) {
      lane = opaque_lane();
      __syncwarp();  // the layout words written; the previous two super-groups' strata read
      const int member = q + lane / 16;  // lane l: group l % 16 of super-group q + l / 16
      if (member < n) {
        const uint64_t group = (sg_base + ws.sg[member].j) * kGroupsPerSuperGroup + lane % 16;
        ws.pi[lane] = corr ? static_cast<float>(correlated_stratum(
                                 opaque(key.seed), opaque(key.call), key.stratum_class, group,
                                 opaque(key.stratum), opaque(key.strata)))
                           : 0.0f;
      }
      __syncwarp();
      for (int h = 0; h < 2 && q + h < n; ++h)
        hop_supergroup(d, levels, own, own_bf16, in, n_in, body, ws.sg[q + h], sg_base,
                       ws.pi[16 * h + opaque_lane() / 2], strata, key, error, ws);
    }
  }
}

}  // namespace

// Work split: each block takes a contiguous run of the chunk's wire positions, its warps a
// super-group each at a time (hop_warp()); a block barrier only in the set-up.
__global__ void __launch_bounds__(kHopThreads, kHopMinBlocks)
    dynamiq_hop_kernel(DynamiqDeviceParams d, const LevelTable* levels, const void* layout,
                       int chunk, const void* own, int own_bf16, HopInputs in, int n_in,
                       uint8_t* out, RoundingKey key, unsigned* error) {
  __shared__ LevelTable s_levels[3];
  __shared__ HopWarpShared s_warp[kHopWarps];
  __shared__ unsigned long long s_meta[3];
  __shared__ unsigned s_widths;  // the level tables the block reads (stage_level_tables())
  const StepFold fold(error);    // the step's only kernel (step_fold.h)
  // The lane failed before this step (the caller armed the word): nothing is written. This launch
  // never raises kSkipFlag, so every thread of the grid decides alike, before any barrier.
  if ((load_relaxed(error) & kSkipFlag) != 0) return;
  const LayoutView l = layout_view(layout, d.sections);
  hop_setup(d, l, chunk, in, n_in, out, error, s_meta);
  // Wire positions are 32-bit words of the layout (chunk_first).
  const uint64_t first = s_meta[1], last = s_meta[2];
  const uint64_t n = last > first ? last - first : 0;
  const uint64_t per = hop_block_positions(n, gridDim.x);
  const uint64_t begin = first + blockIdx.x * per;
  const uint64_t end = begin + per < last ? begin + per : last;
  if (begin >= end) return;  // the whole block alike: no work, no level tables
  // Only the level tables of the widths the block's super-groups have: wire order is widest
  // first, so its first and last positions bound them, and a block of a few dozen super-groups
  // mostly has one width. The set-up, most of it deriving each table's lookup grid, is then
  // about a third (a warp's set-up was about as much work as a super-group's encoding).
  if (threadIdx.x == 0)
    s_widths = widths_between(l, static_cast<uint32_t>(begin), static_cast<uint32_t>(end - 1));
  stage_level_tables(levels, s_levels, true, &s_widths);
  hop_warp(d, l, s_levels, own, own_bf16, in, n_in, out + kChunkHeaderBytes,
           static_cast<uint32_t>(begin), static_cast<uint32_t>(end),
           d.correlated_rounding && key.strata > 1, key, error, s_warp[threadIdx.x / kWarp]);
}

namespace {
// Blocks of the fused hop for a chunk of an even share of the super-groups (where the cuts fall
// is on the device): kHopSupergroupsPerBlock a block, but at least enough to fill the device
// (kHopMinBlocks an SM) while each warp still gets a super-group.
size_t hop_blocks(const DynamiqPlan& p) {
  const size_t per_chunk = (p.n_sg + p.n_chunks - 1) / p.n_chunks;
  size_t blocks = (per_chunk + kHopSupergroupsPerBlock - 1) / kHopSupergroupsPerBlock;
  const size_t fill = static_cast<size_t>(multiprocessors()) * kHopMinBlocks;
  const size_t most = (per_chunk + kHopWarps - 1) / kHopWarps;
  if (blocks < fill) blocks = fill < most ? fill : most;
  return blocks;
}
}  // namespace

unsigned dynamiq_hop_grid(const DynamiqDeviceParams& params, int max_blocks) {
  return grid_for(hop_blocks(params.plan), max_blocks);
}

cudaError_t launch_dynamiq_hop(const DynamiqDeviceParams& params, const LevelTable* levels,
                               const void* layout, int chunk, const void* own, bool own_bf16,
                               const uint8_t* const* inputs, int n_in, uint8_t* out,
                               const RoundingKey& key, unsigned* error, cudaStream_t stream,
                               int max_blocks) {
  const DynamiqPlan& p = params.plan;
  if (levels == nullptr || layout == nullptr || out == nullptr || error == nullptr || chunk < 0 ||
      chunk >= p.n_chunks || n_in < 0 || n_in > kMaxHopInputs || (n_in > 0 && inputs == nullptr) ||
      (own == nullptr && p.count > 0) || key.strata < 1 || key.stratum >= key.strata)
    return cudaErrorInvalidValue;
  HopInputs in{};
  for (int i = 0; i < n_in; ++i) in.p[i] = inputs[i];
  // A chunk holds about n_sg / n_chunks super-groups (where the cuts fall is on the device).
  DQ_LAUNCH(dynamiq_hop_kernel, dim3(dynamiq_hop_grid(params, max_blocks)), dim3(kHopThreads), 0,
            stream, params, levels, layout, chunk, own, own_bf16 ? 1 : 0, in, n_in, out, key,
            error);
  return cudaGetLastError();
}

// Every kernel of this file loaded now (the attributes query loads its module): at device set-up,
// never first mid-call.
cudaError_t load_dynamiq_hop_kernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, dynamiq_hop_kernel);
  if (e == cudaSuccess) e = load_dynamiq_finish_kernels();  // dynamiq_finish.cu
  return e;
}

}  // namespace dq::cuda
