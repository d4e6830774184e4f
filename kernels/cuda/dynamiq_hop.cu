// DynamiQ's fused hop (leaf included) on the device: the bytes of the host codec's
// DynamiqCodec::fused_hop (kernels/dynamiq_codec.cc), following its scalar path (the AVX2 path
// gives the same bytes; tests/kernels/golden_test.cc).
//
// Work split: a block of 256 threads takes a contiguous run of the chunk's wire positions, in
// batches of 8 super-groups; thread k owns value k of the super-group in hand. A block first
// stages the level tables in shared memory; per batch, every thread draws one of the batch's
// 256 Philox blocks of rounding bits (rounding_block(): block j*32 + 8*(g % 4) + (k % 8), word
// g / 4, half (k / 8) % 2) and threads 0..127 one group's stratum of the shared permutation
// (correlated rounding), and warp s copies member s's own values and first input record to
// shared memory (16-byte vector loads where aligned) and decodes that record's group scales.
// Per super-group:
//  - v = own - mu, plus each input's decoded value in input order (the host's order), a further
//    input's record copied to shared memory first;
//  - group maxima on the magnitude bits (16-lane shuffles); then warp 0 alone, once: the
//    super-group maximum, the unit and group factors (group_factor(), as the host's scalar path),
//    published to every thread in shared memory;
//  - each value rounded with round_up_threshold / round_up_coarse / round_up_tie on the host's
//    level tables; codes packed LSB first by shuffles within the warp.
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

// The scales of a record at bits < 16, computed once a super-group by warp 0 (its other warps
// would repeat the same two IEEE divisions): lane q < 16 takes group q, from the group maxima
// `gmax` (magnitude bit patterns). Writes the record's scale bytes and group q's scale to
// scale[q]; every lane of warp 0 calls it (the super-group maximum is a shuffle reduction).
__device__ __forceinline__ void write_record_scales(bool hierarchical, const uint32_t* gmax,
                                                    int lane, uint8_t* rec, float* scale) {
  const int q = lane & (kGroupsPerSuperGroup - 1);
  const uint32_t group_max = gmax[q];
  if (hierarchical) {
    // Lanes 16..31 mirror lanes 0..15, so the xor shuffles below 16 cover every group.
    uint32_t sgmax = group_max;
    DQ_UNROLL
    for (int off = kGroupsPerSuperGroup / 2; off > 0; off >>= 1) {
      const uint32_t o = __shfl_xor_sync(kFullMask, sgmax, off);
      sgmax = o > sgmax ? o : sgmax;
    }
    if (lane >= kGroupsPerSuperGroup) return;
    const uint16_t unit_bits = supergroup_unit_bf16(f32_from_bits(sgmax));
    const float unit = bf16_to_f32(unit_bits);
    const uint8_t f = group_factor(f32_from_bits(group_max), unit);
    if (lane == 0) {
      store_global(rec, static_cast<uint8_t>(unit_bits));
      store_global(rec + 1, static_cast<uint8_t>(unit_bits >> 8));
    }
    store_global(rec + 2 + q, f);
    scale[q] = static_cast<float>(f) * unit;
    return;
  }
  if (lane >= kGroupsPerSuperGroup) return;
  const uint16_t sb = f32_to_bf16_up(f32_from_bits(group_max));
  store_global(rec + 2 * q, static_cast<uint8_t>(sb));
  store_global(rec + 2 * q + 1, static_cast<uint8_t>(sb >> 8));
  scale[q] = bf16_to_f32(sb);
}

// The record's codes packed LSB first in value order, from value k's code (every lane of the warp
// calls it, with the block's one width): lane k writes byte k / (8 / bits) when it holds that
// byte's first value, gathering the byte's other codes from the next lanes by shuffles.
__device__ __forceinline__ void store_packed_codes(uint32_t code, int bits, int k, uint8_t* codes) {
  uint32_t byte = code;
  if (bits == 4) {
    byte |= __shfl_down_sync(kFullMask, code, 1) << 4;
  } else if (bits == 2) {
    byte |= __shfl_down_sync(kFullMask, code, 1) << 2;
    byte |= __shfl_down_sync(kFullMask, code, 2) << 4;
    byte |= __shfl_down_sync(kFullMask, code, 3) << 6;
  }
  const int per_byte = 8 / bits;
  if (k % per_byte == 0) store_global(codes + k / per_byte, static_cast<uint8_t>(byte));
}

// ---- the fused hop's phases; its shared memory is declared in the kernel and passed by pointer

constexpr int kHopBatch = 8;  // super-groups per round of draws: 8 x 32 Philox blocks, one a thread
// Super-groups a block should take at least (the launch's grid): its set-up (the level tables,
// about 0.6 KB read) stays a few percent of the block's traffic.
constexpr int kHopSupergroupsPerBlock = 16;
// uint4s of a super-group's staged own values: 256 FP32 values at any offset modulo 16.
constexpr int kOwnStage = (4 * kSuperGroup + 15 + 15) / 16;

// The layout words of a batch's super-groups, read once by threads 0..7.
struct HopBatch {
  uint32_t j[kHopBatch];
  uint32_t offset[kHopBatch];
  float mean[kHopBatch];
  int8_t exponent[kHopBatch];
  uint8_t bits[kHopBatch];
};

struct HopShared {
  LevelTable* levels;  // [3]: the host's tables (stage_level_tables)
  uint32_t* words;     // [kHopBatch * 32 * 4]: Philox block b of member s, word w at 4(32s+b)+w
  float* pi;           // [kHopBatch * kGroupsPerSuperGroup]: each group's stratum
  HopBatch* batch;     //
  uint32_t* gmax;      // [kGroupsPerSuperGroup]: group maxima (magnitude bit patterns)
  float* scale;        // [kGroupsPerSuperGroup]: each group's scale (write_record_scales)
  uint4* record;       // [2 * kRecordStage]: input records, alternating
  uint4* own;          // [kHopBatch * kOwnStage]: the batch's own values
  uint4* first_input;  // [kHopBatch * kRecordStage]: the batch's records of input 0
  float* first_scale;  // [kHopBatch * kGroupsPerSuperGroup]: those records' group scales
  unsigned long long* meta;  // [3]: the chunk's content bytes, first and end wire position
};

// Block set-up: the chunk's extent (thread 0, into shared memory), the output header (block 0)
// and the padding after the body (all blocks). Ends with the barrier that publishes sh.meta.
__device__ void hop_setup(const DynamiqDeviceParams& d, const LayoutView& l, int chunk,
                          const HopInputs& in, int n_in, uint8_t* out, unsigned* error,
                          const HopShared& sh) {
  const int k = static_cast<int>(threadIdx.x);
  const DynamiqPlan& p = d.plan;
  if (k == 0) {
    sh.meta[0] = load_global(&l.chunk_content[chunk]);
    sh.meta[1] = load_global(&l.chunk_first[chunk]);
    sh.meta[2] = load_global(&l.chunk_first[chunk + 1]);
    if (blockIdx.x == 0) {
      if (sh.meta[0] + kChunkHeaderBytes > p.capacity) atomicOr(error, kDynamiqChunkOverCapacity);
      write_hop_header(l, chunk, in, n_in, p.n_workers, out, error);
    }
  }
  __syncthreads();
  uint8_t* body = out + kChunkHeaderBytes;
  const unsigned long long body_capacity = p.capacity - kChunkHeaderBytes;
  for (unsigned long long b =
           sh.meta[0] + blockIdx.x * static_cast<unsigned long long>(kHopThreads) + k;
       b < body_capacity; b += static_cast<unsigned long long>(gridDim.x) * kHopThreads)
    store_global(body + b, uint8_t{0});
}

// Whether batch member s is encoded from the own values: its record fits the message and its
// mean is finite (hop_supergroup()). The same answer in every thread.
__device__ __forceinline__ bool member_encoded(const DynamiqPlan& p, const HopBatch& b, int s) {
  return !record_past_capacity(p, b.offset[s], b.bits[s]) &&
         (f32_bits(b.mean[s]) & 0x7f800000u) != 0x7f800000u;
}

// Where batch member s's own values (at `values`) lie in shared memory after hop_batch_load().
__device__ __forceinline__ const uint8_t* staged_own(const HopShared& sh, int s,
                                                     const uint8_t* values) {
  return reinterpret_cast<const uint8_t*>(sh.own + s * kOwnStage) +
         (reinterpret_cast<uintptr_t>(values) & 15u);
}

// A batch's layout words (threads 0..7); its random bits: every thread draws one Philox block
// (32 a super-group), threads 0..127 one group's stratum each; then warp s copies member s's own
// values and its record of input 0 to shared memory (the 8 super-groups' loads in flight at
// once) and lanes 0..15 of warp s that record's group scales (flagging invalid ones). Ends with a
// barrier.
__device__ void hop_batch_load(const DynamiqDeviceParams& d, const LayoutView& l, const void* own,
                               int own_bf16, const uint8_t* input0, uint64_t i0, uint64_t end,
                               uint64_t sg_base, bool corr, const RoundingKey& key, unsigned* error,
                               const HopShared& sh) {
  const int k = static_cast<int>(threadIdx.x);
  HopBatch& b = *sh.batch;
  if (k < kHopBatch && i0 + k < end) {
    const uint64_t i = i0 + k;
    const uint32_t j = load_global(&l.order[i]);
    b.j[k] = j;
    b.offset[k] = load_global(&l.offset[i]);
    b.bits[k] = load_global(&l.width[j]);
    b.mean[k] = load_global(&l.mean[j]);
    b.exponent[k] = load_global(&l.exponent[j]);
  }
  __syncthreads();
  const int s = k / 32;
  if (i0 + s < end) {
    const uint64_t jr = sg_base + b.j[s];
    const Philox4 w = philox_draw(key.seed, key.call, key.rank, kStreamRounding,
                                  rounding_block(jr * kSuperGroup) + static_cast<uint32_t>(k % 32));
    for (int v = 0; v < 4; ++v) sh.words[4 * k + v] = w.v[v];
  }
  const int member = k / kGroupsPerSuperGroup, group = k % kGroupsPerSuperGroup;
  if (member < kHopBatch && i0 + member < end) {
    const uint64_t jr = sg_base + b.j[member];
    sh.pi[k] = corr ? static_cast<float>(correlated_stratum(key.seed, key.call, key.stratum_class,
                                                            jr * kGroupsPerSuperGroup + group,
                                                            key.stratum, key.strata))
                    : 0.0f;
  }
  if (i0 + s < end && member_encoded(d.plan, b, s)) {
    const size_t base = static_cast<size_t>(b.j[s]) * kSuperGroup;
    const size_t left = d.plan.count - base;
    const int valid =
        left < static_cast<size_t>(kSuperGroup) ? static_cast<int>(left) : kSuperGroup;
    const size_t size = own_bf16 ? 2 : 4;
    group_copy_to_shared(static_cast<const uint8_t*>(own) + base * size,
                         valid * static_cast<int>(size), sh.own + s * kOwnStage, k % 32, 32);
    if (input0 != nullptr) {
      const uint8_t* rec = group_copy_to_shared(input0 + kChunkHeaderBytes + b.offset[s],
                                                d.plan.record[width_index(b.bits[s])],
                                                sh.first_input + s * kRecordStage, k % 32, 32);
      // The record's 16 group scales, once (hop_sum() would decode them at every value).
      __syncwarp();
      const int q = k % 32;
      if (b.bits[s] < 16 && q < kGroupsPerSuperGroup) {
        bool bad = false;
        sh.first_scale[kGroupsPerSuperGroup * s + q] =
            record_group_scale(d.hierarchical_scales, rec, q, &bad);
        if (bad) atomicOr(error, kDynamiqBadRecord);
      }
    }
  }
  __syncthreads();
}

// This thread's value of batch member s: own value less the mean, plus every input's decoded
// value in input order (the host's order). Input 0's record is in shared memory already
// (hop_batch_load()); each further input's is staged here (one barrier each); *stage counts
// those stagings, whose buffers alternate.
__device__ float hop_sum(const DynamiqDeviceParams& d, const void* own, int own_bf16,
                         const HopInputs& in, int n_in, int s, int* stage, unsigned* error,
                         const HopShared& sh) {
  const int k = static_cast<int>(threadIdx.x);
  const HopBatch& b = *sh.batch;
  const int bits = b.bits[s];
  const size_t base = static_cast<size_t>(b.j[s]) * kSuperGroup;
  const size_t left = d.plan.count - base;
  const int valid = left < static_cast<size_t>(kSuperGroup) ? static_cast<int>(left) : kSuperGroup;
  float v = 0.0f;
  if (k < valid) {
    const size_t size = own_bf16 ? 2 : 4;
    const uint8_t* staged = staged_own(sh, s, static_cast<const uint8_t*>(own) + base * size);
    const float x = own_bf16 ? bf16_to_f32(reinterpret_cast<const uint16_t*>(staged)[k])
                             : reinterpret_cast<const float*>(staged)[k];
    const float mu = bits == 16 ? 0.0f : b.mean[s];
    const int8_t e = b.exponent[s];
    v = e == 0 ? x - mu : x * pow2f(e) - mu;
  }
  bool bad = false;
  const int record = d.plan.record[width_index(bits)];
  for (int m = 0; m < n_in; ++m) {
    const uint8_t* src = in.p[m] + kChunkHeaderBytes + b.offset[s];
    if (m == 0) {  // staged, its scales decoded and checked (hop_batch_load())
      const uint8_t* r = reinterpret_cast<const uint8_t*>(sh.first_input + s * kRecordStage) +
                         (reinterpret_cast<uintptr_t>(src) & 15u);
      if (bits == 16) {
        v += decode_value(sh.levels, d.hierarchical_scales, bits, r, k, &bad);
      } else {
        const LevelTable& t = sh.levels[width_index(bits)];
        const uint32_t code = record_code(d.hierarchical_scales, bits, r, k, t.max_mag, &bad);
        v += decode_code(t, code, sh.first_scale[kGroupsPerSuperGroup * s + k / kGroup]);
      }
      continue;
    }
    const uint8_t* r = block_copy_to_shared(src, record, sh.record + (*stage & 1) * kRecordStage);
    ++*stage;
    __syncthreads();  // the staged record
    v += decode_value(sh.levels, d.hierarchical_scales, bits, r, k, &bad);
    bad |= record_scales_bad(d.hierarchical_scales, bits, r, k);
  }
  if (bad) atomicOr(error, kDynamiqBadRecord);
  return v;
}

// Batch member s compressed into its record: group maxima, scales, stochastic rounding on the
// host's levels, the codes packed LSB first. Two barriers at widths below 16: the group maxima
// written, then the scales (warp 0 alone reads the maxima, and every thread has read the scales
// before it reaches the next super-group's first barrier, so neither buffer alternates).
__device__ void hop_encode(bool hierarchical, float v, int s, uint64_t jr, float strata,
                           const RoundingKey& key, uint8_t* rec, const HopShared& sh) {
  const int k = static_cast<int>(threadIdx.x);
  const int g = k / kGroup;
  const int bits = sh.batch->bits[s];
  const uint32_t word = sh.words[4 * (32 * s + ((k >> 4) & 3) * 8 + (k & 7)) + ((k >> 6) & 3)];
  const uint32_t u16 = (word >> (16 * ((k >> 3) & 1))) & 0xffffu;
  if (bits == 16) {  // stochastic rounding to BF16 with the value's 16 bits
    const uint16_t h = f32_to_bf16_stochastic(v, u16);
    store_global(rec + 2 * k, static_cast<uint8_t>(h));
    store_global(rec + 2 * k + 1, static_cast<uint8_t>(h >> 8));
    return;
  }
  // Group maxima on the magnitude bit patterns (ordered like the floats, NaN above Inf).
  uint32_t a = f32_bits(v) & 0x7fffffffu;
  DQ_UNROLL
  for (int off = kGroup / 2; off > 0; off >>= 1) {
    const uint32_t o = __shfl_xor_sync(kFullMask, a, off);
    a = o > a ? o : a;
  }
  if ((k & (kGroup - 1)) == 0) sh.gmax[g] = a;
  __syncthreads();
  if (k < 32) write_record_scales(hierarchical, sh.gmax, k, rec, sh.scale);
  __syncthreads();
  uint8_t* codes_out = rec + (hierarchical ? 2 + kGroupsPerSuperGroup : 2 * kGroupsPerSuperGroup);
  const LevelTable& t = sh.levels[width_index(bits)];
  const float m = magnitude_ratio(v, sh.scale[g]);
  const int r = level_floor(t, m);
  const float x = round_up_threshold(t, m, r, sh.pi[kGroupsPerSuperGroup * s + g], strata);
  int up = round_up_coarse(x, u16);
  if (up < 0)
    up = round_up_tie(x, u16,
                      rounding_tie_uniform(key.seed, key.call, key.rank, jr * kSuperGroup + k));
  store_packed_codes(encode_code(r + up, v < 0.0f, t.max_mag), bits, k, codes_out);
}

// Batch member s: its record checked against the capacity, an inert record for a non-finite
// mean, else the sum and its compression. The same branches in every thread (shared words).
__device__ void hop_supergroup(const DynamiqDeviceParams& d, const void* own, int own_bf16,
                               const HopInputs& in, int n_in, uint8_t* body, uint64_t sg_base,
                               float strata, const RoundingKey& key, unsigned* error, int s,
                               int* stage, const HopShared& sh) {
  const int k = static_cast<int>(threadIdx.x);
  const DynamiqPlan& p = d.plan;
  const HopBatch& b = *sh.batch;
  const int bits = b.bits[s];
  // A record the message cannot hold is neither written nor read from the inputs (nor were its
  // own values: member_encoded()).
  if (record_past_capacity(p, b.offset[s], bits)) {
    if (k == 0) atomicOr(error, kDynamiqChunkOverCapacity);
    return;
  }
  uint8_t* rec = body + b.offset[s];
  if ((f32_bits(b.mean[s]) & 0x7f800000u) == 0x7f800000u) {
    // The non-finite mean carries the result: an inert 2-bit record.
    const int scale_bytes = p.record[0] - kSuperGroup * 2 / 8;
    uint8_t byte = 0x55;                                                    // code 1 = zero
    if (k < scale_bytes) byte = (d.hierarchical_scales && k >= 2) ? 1 : 0;  // factors 1, unit 0
    if (k < p.record[0]) store_global(rec + k, byte);
    return;
  }
  const float v = hop_sum(d, own, own_bf16, in, n_in, s, stage, error, sh);
  hop_encode(d.hierarchical_scales, v, s, sg_base + b.j[s], strata, key, rec, sh);
}

}  // namespace

// Work split: each block takes a contiguous run of the chunk's wire positions, in batches of
// kHopBatch super-groups; thread k owns value k of the super-group in hand.
__global__ void __launch_bounds__(kHopThreads, kHopMinBlocks)
    dynamiq_hop_kernel(DynamiqDeviceParams d, const LevelTable* levels, const void* layout,
                       int chunk, const void* own, int own_bf16, HopInputs in, int n_in,
                       uint8_t* out, RoundingKey key, unsigned* error) {
  __shared__ LevelTable s_levels[3];
  __shared__ uint32_t s_words[kHopBatch * 32 * 4];
  __shared__ float s_pi[kHopBatch * kGroupsPerSuperGroup];
  __shared__ HopBatch s_batch;
  __shared__ uint32_t s_gmax[kGroupsPerSuperGroup];
  __shared__ float s_scale[kGroupsPerSuperGroup];
  __shared__ uint4 s_record[2 * kRecordStage];
  __shared__ uint4 s_own[kHopBatch * kOwnStage];
  __shared__ uint4 s_first_input[kHopBatch * kRecordStage];
  __shared__ float s_first_scale[kHopBatch * kGroupsPerSuperGroup];
  __shared__ unsigned long long s_meta[3];
  const StepFold fold(error);  // the step's only kernel (step_fold.h)
  // The lane failed before this step (the caller armed the word): nothing is written. This launch
  // never raises kSkipFlag, so every thread of the grid decides alike, before any barrier.
  if ((*error & kSkipFlag) != 0) return;
  const HopShared sh{s_levels, s_words, s_pi,          &s_batch,      s_gmax, s_scale,
                     s_record, s_own,   s_first_input, s_first_scale, s_meta};
  const LayoutView l = layout_view(layout, d.sections);
  hop_setup(d, l, chunk, in, n_in, out, error, sh);
  const uint64_t first = s_meta[1], last = s_meta[2];
  const uint64_t n = last > first ? last - first : 0;
  const uint64_t per = ((n + gridDim.x - 1) / gridDim.x + kHopBatch - 1) / kHopBatch * kHopBatch;
  const uint64_t begin = first + blockIdx.x * per;
  const uint64_t end = begin + per < last ? begin + per : last;
  if (begin < end) stage_level_tables(levels, s_levels);  // a block with no work skips them
  const uint64_t sg_base = key.element_base / kSuperGroup;
  const bool corr = d.correlated_rounding && key.strata > 1;
  const float strata = corr ? static_cast<float>(key.strata) : 1.0f;
  int stage = 0;
  for (uint64_t i0 = begin; i0 < end; i0 += kHopBatch) {  // the same trips in the block
    hop_batch_load(d, l, own, own_bf16, n_in > 0 ? in.p[0] : nullptr, i0, end, sg_base, corr, key,
                   error, sh);
    for (int s = 0; s < kHopBatch && i0 + s < end; ++s)
      hop_supergroup(d, own, own_bf16, in, n_in, out + kChunkHeaderBytes, sg_base, strata, key,
                     error, s, &stage, sh);
    __syncthreads();  // the batch's shared words are rewritten by the next batch
  }
}

namespace {
// Blocks of the fused hop for a chunk of an even share of the super-groups (where the cuts fall
// is on the device): kHopSupergroupsPerBlock a block, but at least enough to fill the device
// (kHopMinBlocks an SM) while each block still gets a whole batch.
size_t hop_blocks(const DynamiqPlan& p) {
  const size_t per_chunk = (p.n_sg + p.n_chunks - 1) / p.n_chunks;
  size_t blocks = (per_chunk + kHopSupergroupsPerBlock - 1) / kHopSupergroupsPerBlock;
  const size_t fill = static_cast<size_t>(multiprocessors()) * kHopMinBlocks;
  const size_t most = (per_chunk + kHopBatch - 1) / kHopBatch;
  if (blocks < fill) blocks = fill < most ? fill : most;
  return blocks;
}
}  // namespace

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
  DQ_LAUNCH(dynamiq_hop_kernel, dim3(grid_for(hop_blocks(p), max_blocks)), dim3(kHopThreads), 0,
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
