// DynamiQ's fused hop (leaf included) and finish on the device: the bytes of the host codec's
// DynamiqCodec::fused_hop and decode_finish (kernels/dynamiq_codec.cc), following its scalar
// path (the AVX2 path gives the same bytes; tests/kernels/golden_test.cc).
//
// Work split: a block of 256 threads takes one super-group at a time (blocks stride over the
// chunk's wire positions); thread k owns value k. Per super-group of the hop:
//  - threads 0..31 draw the 32 Philox blocks of the super-group's rounding bits into shared
//    memory (rounding_block(): block j*32 + 8*(g % 4) + (k % 8), word g / 4, half (k / 8) % 2),
//    threads 32..47 the shared permutation's stratum of each group (correlated rounding);
//  - v = own - mu, plus each input's decoded value in input order (the host's order);
//  - group maxima on the magnitude bits (16-lane shuffles), the super-group maximum over the 16
//    groups, the unit and group factors (group_factor(), as the host's scalar path);
//  - each value rounded with round_up_threshold / round_up_coarse / round_up_tie on the host's
//    level tables; codes packed LSB first from shared memory.
#include "kernels/bf16.h"
#include "kernels/cuda/block.cuh"
#include "kernels/cuda/dynamiq.h"
#include "kernels/dynamiq_range.h"

namespace dq::cuda {
namespace {

struct HopInputs {
  const uint8_t* p[kMaxHopInputs];
};

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

__device__ __forceinline__ bool poisoned(const LayoutView& l, uint32_t j) {
  return (f32_bits(l.mean[j]) & 0x7f800000u) == 0x7f800000u;
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

// Value k of a record (accumulate_record()'s decoded term) at `bits` wide; *bad is set where the
// record holds invalid content that this value reads (a negative unit or scale, a zero factor, a
// code above 2L). A width-16 record is always valid.
__device__ __forceinline__ float decode_value(const LevelTable* levels, bool hierarchical, int bits,
                                              const uint8_t* rec, int k, bool* bad) {
  if (bits == 16) return bf16_to_f32(get16(rec + 2 * k));
  const LevelTable& t = levels[width_index(bits)];
  const int g = k / kGroup;
  float scale;
  const uint8_t* codes;
  if (hierarchical) {
    const float unit = bf16_to_f32(get16(rec));
    *bad |= (rec[1] & 0x80) != 0 || rec[2 + g] == 0;
    scale = static_cast<float>(rec[2 + g]) * unit;
    codes = rec + 2 + kGroupsPerSuperGroup;
  } else {
    *bad |= (rec[2 * g + 1] & 0x80) != 0;
    scale = bf16_to_f32(get16(rec + 2 * g));
    codes = rec + 2 * kGroupsPerSuperGroup;
  }
  const uint32_t code = code_at(codes, bits, k);
  *bad |= code > static_cast<uint32_t>(2 * t.max_mag);
  return decode_code(t, code, scale);
}

// Checks of the whole record that decode_value() makes per value, for the values it skips:
// every group's scale and the record's unit (record_valid()).
__device__ __forceinline__ bool record_scales_bad(bool hierarchical, int bits, const uint8_t* rec,
                                                  int k) {
  if (bits == 16 || k >= kGroupsPerSuperGroup) return false;
  if (hierarchical) return (rec[1] & 0x80) != 0 || rec[2 + k] == 0;
  return (rec[2 * k + 1] & 0x80) != 0;
}

// Whether a record (its offset in the body, `bits` wide) ends past the message's capacity: the
// layout claims more than the message holds. The same answer in every thread.
__device__ __forceinline__ bool record_past_capacity(const DynamiqPlan& p, uint32_t offset,
                                                     int bits) {
  return kChunkHeaderBytes + static_cast<unsigned long long>(offset) +
             static_cast<unsigned long long>(p.record[width_index(bits)]) >
         p.capacity;
}

// The hop's output header (one thread): the inputs' headers checked, their contributors summed
// with this rank's own.
__device__ __forceinline__ void write_hop_header(const LayoutView& l, int chunk,
                                                 const HopInputs& in, int n_in, int n_workers,
                                                 uint8_t* out, unsigned* error) {
  int contrib = 1;
  for (int i = 0; i < n_in; ++i) {
    const int c = check_header(in.p[i], l, chunk, n_workers);
    if (c == 0) atomicOr(error, kDynamiqBadHeader);
    contrib += c;
  }
  if (contrib > n_workers) atomicOr(error, kDynamiqTooManyWorkers);
  const uint32_t call = static_cast<uint32_t>(l.header[0]);
  const uint32_t check = l.chunk_check[chunk];
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
  for (size_t b = 0; b < kChunkHeaderBytes; ++b) out[b] = h[b];
}

// The scales of a record at bits < 16 from the group maxima `gmax` (magnitude bit patterns), for
// value k's group g: writes the record's scale bytes, returns value k's scale and in *codes where
// the record's codes start.
__device__ __forceinline__ float write_record_scales(bool hierarchical, const uint32_t* gmax, int k,
                                                     int g, uint8_t* rec, uint8_t** codes) {
  if (hierarchical) {
    uint32_t sgmax = 0;
    for (int q = 0; q < kGroupsPerSuperGroup; ++q) sgmax = gmax[q] > sgmax ? gmax[q] : sgmax;
    const uint16_t unit_bits = supergroup_unit_bf16(f32_from_bits(sgmax));
    const float unit = bf16_to_f32(unit_bits);
    const uint8_t f = group_factor(f32_from_bits(gmax[g]), unit);
    if (k == 0) {
      rec[0] = static_cast<uint8_t>(unit_bits);
      rec[1] = static_cast<uint8_t>(unit_bits >> 8);
    }
    if ((k & (kGroup - 1)) == 0) rec[2 + g] = f;
    *codes = rec + 2 + kGroupsPerSuperGroup;
    return static_cast<float>(f) * unit;
  }
  const uint16_t sb = f32_to_bf16_up(f32_from_bits(gmax[g]));
  if ((k & (kGroup - 1)) == 0) {
    rec[2 * g] = static_cast<uint8_t>(sb);
    rec[2 * g + 1] = static_cast<uint8_t>(sb >> 8);
  }
  *codes = rec + 2 * kGroupsPerSuperGroup;
  return bf16_to_f32(sb);
}

// Byte k of the record's codes (k < kSuperGroup * bits / 8): the codes packed LSB first in value
// order.
__device__ __forceinline__ uint8_t packed_code_byte(const uint8_t* codes, int bits, int k) {
  if (bits == 8) return codes[k];
  if (bits == 4) return static_cast<uint8_t>(codes[2 * k] | (codes[2 * k + 1] << 4));
  return static_cast<uint8_t>(codes[4 * k] | (codes[4 * k + 1] << 2) | (codes[4 * k + 2] << 4) |
                              (codes[4 * k + 3] << 6));
}

}  // namespace

__global__ void __launch_bounds__(kHopThreads, kHopMinBlocks)
    dynamiq_hop_kernel(DynamiqDeviceParams d, const LevelTable* levels, const void* layout,
                       int chunk, const void* own, int own_bf16, HopInputs in, int n_in,
                       uint8_t* out, RoundingKey key, unsigned* error) {
  __shared__ uint32_t s_words[32 * 4];  // Philox block b, word w at [4b + w]
  __shared__ float s_pi[kGroupsPerSuperGroup];
  __shared__ uint32_t s_gmax[kGroupsPerSuperGroup];
  __shared__ uint8_t s_codes[kSuperGroup];
  const StepFold fold(error);  // the step's only kernel (step_fold.h)
  // The lane failed before this step (the caller armed the word): nothing is written. This launch
  // never raises kSkipFlag, so every thread of the grid decides alike, before any barrier.
  if ((*error & kSkipFlag) != 0) return;
  const int k = static_cast<int>(threadIdx.x);
  const DynamiqPlan& p = d.plan;
  const LayoutView l = layout_view(layout, d.sections);
  uint8_t* body = out + kChunkHeaderBytes;
  const unsigned long long content = l.chunk_content[chunk];
  if (blockIdx.x == 0 && k == 0 && content + kChunkHeaderBytes > p.capacity)
    atomicOr(error, kDynamiqChunkOverCapacity);

  // The chunk header (block 0), the padding after the body (all blocks).
  if (blockIdx.x == 0 && k == 0) write_hop_header(l, chunk, in, n_in, p.n_workers, out, error);
  const unsigned long long body_capacity = p.capacity - kChunkHeaderBytes;
  for (unsigned long long b =
           content + blockIdx.x * static_cast<unsigned long long>(kHopThreads) + k;
       b < body_capacity; b += static_cast<unsigned long long>(gridDim.x) * kHopThreads)
    body[b] = 0;

  const uint32_t first = l.chunk_first[chunk], last = l.chunk_first[chunk + 1];
  const uint64_t sg_base = key.element_base / kSuperGroup;
  const bool corr = d.correlated_rounding && key.strata > 1;
  const float strata = corr ? static_cast<float>(key.strata) : 1.0f;
  const int g = k / kGroup;
  for (uint32_t i = first + blockIdx.x; i < last; i += gridDim.x) {  // the same trips in the block
    const uint32_t j = l.order[i];
    const int bits = l.width[j];
    // A record the message cannot hold is neither written nor read from the inputs (the same
    // layout words in every thread: the whole block skips it).
    if (record_past_capacity(p, l.offset[i], bits)) {
      if (k == 0) atomicOr(error, kDynamiqChunkOverCapacity);
      continue;
    }
    uint8_t* rec = body + l.offset[i];
    if (poisoned(l, j)) {  // the non-finite mean carries the result: an inert 2-bit record
      const int scale_bytes = p.record[0] - kSuperGroup * 2 / 8;
      uint8_t b = 0x55;                                                    // 2-bit code 1 = zero
      if (k < scale_bytes) b = (d.hierarchical_scales && k >= 2) ? 1 : 0;  // factors 1, unit 0
      if (k < p.record[0]) rec[k] = b;
      continue;  // uniform in the block
    }
    const uint64_t jr = sg_base + j;
    // Random bits and strata of this super-group.
    if (k < 32) {
      const Philox4 w = philox_draw(key.seed, key.call, key.rank, kStreamRounding,
                                    rounding_block(jr * kSuperGroup) + static_cast<uint32_t>(k));
      for (int v = 0; v < 4; ++v) s_words[4 * k + v] = w.v[v];
    } else if (k < 32 + kGroupsPerSuperGroup) {
      const int group = k - 32;
      s_pi[group] = corr ? static_cast<float>(correlated_stratum(
                               key.seed, key.call, key.stratum_class,
                               jr * kGroupsPerSuperGroup + group, key.stratum, key.strata))
                         : 0.0f;
    }
    // Own value less the mean, then the inputs in order.
    const size_t base = static_cast<size_t>(j) * kSuperGroup;
    const size_t left = p.count - base;
    const int valid =
        left < static_cast<size_t>(kSuperGroup) ? static_cast<int>(left) : kSuperGroup;
    const float mu = bits == 16 ? 0.0f : l.mean[j];
    float v = 0.0f;
    if (k < valid) {
      const float x = own_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(own)[base + k])
                               : static_cast<const float*>(own)[base + k];
      const int8_t e = l.exponent[j];
      v = e == 0 ? x - mu : x * pow2f(e) - mu;
    }
    bool bad = false;
    for (int m = 0; m < n_in; ++m) {
      const uint8_t* r = in.p[m] + kChunkHeaderBytes + l.offset[i];
      v += decode_value(levels, d.hierarchical_scales, bits, r, k, &bad);
      bad |= record_scales_bad(d.hierarchical_scales, bits, r, k);
    }
    if (bad) atomicOr(error, kDynamiqBadRecord);
    __syncthreads();  // s_words, s_pi
    const uint32_t word = s_words[4 * (((k >> 4) & 3) * 8 + (k & 7)) + ((k >> 6) & 3)];
    const uint32_t u16 = (word >> (16 * ((k >> 3) & 1))) & 0xffffu;
    if (bits == 16) {  // stochastic rounding to BF16 with the value's 16 bits
      const uint16_t h = f32_to_bf16_stochastic(v, u16);
      rec[2 * k] = static_cast<uint8_t>(h);
      rec[2 * k + 1] = static_cast<uint8_t>(h >> 8);
      __syncthreads();  // s_words is rewritten by the next super-group
      continue;
    }
    // Group maxima on the magnitude bit patterns (ordered like the floats, NaN above Inf).
    uint32_t a = f32_bits(v) & 0x7fffffffu;
    DQ_UNROLL
    for (int off = kGroup / 2; off > 0; off >>= 1) {
      const uint32_t o = __shfl_xor_sync(kFullMask, a, off);
      a = o > a ? o : a;
    }
    if ((k & (kGroup - 1)) == 0) s_gmax[g] = a;
    __syncthreads();
    uint8_t* codes_out;
    const float scale = write_record_scales(d.hierarchical_scales, s_gmax, k, g, rec, &codes_out);
    // Stochastic rounding on the host's levels.
    const LevelTable& t = levels[width_index(bits)];
    const float m = magnitude_ratio(v, scale);
    const int r = level_floor(t, m);
    const float x = round_up_threshold(t, m, r, s_pi[g], strata);
    int up = round_up_coarse(x, u16);
    if (up < 0)
      up = round_up_tie(x, u16,
                        rounding_tie_uniform(key.seed, key.call, key.rank, jr * kSuperGroup + k));
    s_codes[k] = static_cast<uint8_t>(encode_code(r + up, v < 0.0f, t.max_mag));
    __syncthreads();
    if (k < kSuperGroup * bits / 8) codes_out[k] = packed_code_byte(s_codes, bits, k);
    __syncthreads();  // shared memory is rewritten by the next super-group
  }
}

// The finish's validation pass: the header and every record of the chunk (record_valid()).
__global__ void __launch_bounds__(kHopThreads)
    dynamiq_finish_check_kernel(DynamiqDeviceParams d, const LevelTable* levels, const void* layout,
                                int chunk, const uint8_t* in, int n_contrib, unsigned* error) {
  if ((*error & kSkipFlag) != 0) return;  // the lane failed before (the caller armed the word)
  const int k = static_cast<int>(threadIdx.x);
  const LayoutView l = layout_view(layout, d.sections);
  if (blockIdx.x == 0 && k == 0 && check_header(in, l, chunk, d.plan.n_workers) != n_contrib)
    atomicOr(error, kDynamiqBadHeader);
  const uint8_t* body = in + kChunkHeaderBytes;
  for (uint32_t i = l.chunk_first[chunk] + blockIdx.x; i < l.chunk_first[chunk + 1];
       i += gridDim.x) {
    const int bits = l.width[l.order[i]];
    if (record_past_capacity(d.plan, l.offset[i], bits)) {  // never read past the message
      if (k == 0) atomicOr(error, kDynamiqChunkOverCapacity);
      continue;
    }
    const uint8_t* rec = body + l.offset[i];
    bool bad = record_scales_bad(d.hierarchical_scales, bits, rec, k);
    (void)decode_value(levels, d.hierarchical_scales, bits, rec, k, &bad);
    if (bad) atomicOr(error, kDynamiqBadRecord);
  }
}

__global__ void __launch_bounds__(kHopThreads)
    dynamiq_finish_kernel(DynamiqDeviceParams d, const LevelTable* levels, const void* layout,
                          int chunk, const uint8_t* in, void* out, int out_bf16, int avg,
                          int n_contrib, const unsigned* error) {
  const StepFold fold(error);       // the step's last kernel, after the check (step_fold.h)
  if (step_failed(*error)) return;  // the same in every thread: nothing is written
  const int k = static_cast<int>(threadIdx.x);
  const LayoutView l = layout_view(layout, d.sections);
  const uint8_t* body = in + kChunkHeaderBytes;
  const float contributors = static_cast<float>(n_contrib);
  for (uint32_t i = l.chunk_first[chunk] + blockIdx.x; i < l.chunk_first[chunk + 1];
       i += gridDim.x) {
    const uint32_t j = l.order[i];
    const int bits = l.width[j];
    const size_t base = static_cast<size_t>(j) * kSuperGroup;
    const size_t left = d.plan.count - base;
    const int valid =
        left < static_cast<size_t>(kSuperGroup) ? static_cast<int>(left) : kSuperGroup;
    if (k >= valid) continue;
    bool bad = false;
    float v = 0.0f;
    v += decode_value(levels, d.hierarchical_scales, bits, body + l.offset[i], k, &bad);
    const float shift = bits == 16 ? 0.0f : contributors * l.mean[j];
    float s = v + shift;
    if (avg) s = s / contributors;
    if (l.exponent[j] != 0) s = s * pow2f(-l.exponent[j]);  // back from 2^K_j
    if (out_bf16)
      static_cast<uint16_t*>(out)[base + k] = f32_to_bf16_rne(s);
    else
      static_cast<float*>(out)[base + k] = s;
  }
}

namespace {
unsigned grid_for(size_t work, int max_blocks) {
  const size_t cap = max_blocks > 0 ? static_cast<size_t>(max_blocks) : 4096;
  const size_t n = work < cap ? work : cap;
  return static_cast<unsigned>(n > 0 ? n : 1);
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
  // As many blocks as the chunk may hold super-groups (the layout is on the device).
  DQ_LAUNCH(dynamiq_hop_kernel, dim3(grid_for(p.n_sg, max_blocks)), dim3(kHopThreads), 0, stream,
            params, levels, layout, chunk, own, own_bf16 ? 1 : 0, in, n_in, out, key, error);
  return cudaGetLastError();
}

cudaError_t launch_dynamiq_finish(const DynamiqDeviceParams& params, const LevelTable* levels,
                                  const void* layout, int chunk, const uint8_t* in, void* out,
                                  bool out_bf16, bool avg, int n_contrib, unsigned* error,
                                  cudaStream_t stream, int max_blocks) {
  const DynamiqPlan& p = params.plan;
  if (levels == nullptr || layout == nullptr || in == nullptr || error == nullptr || chunk < 0 ||
      chunk >= p.n_chunks || (out == nullptr && p.count > 0))
    return cudaErrorInvalidValue;
  const dim3 grid(grid_for(p.n_sg, max_blocks));
  DQ_LAUNCH(dynamiq_finish_check_kernel, grid, dim3(kHopThreads), 0, stream, params, levels, layout,
            chunk, in, n_contrib, error);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  DQ_LAUNCH(dynamiq_finish_kernel, grid, dim3(kHopThreads), 0, stream, params, levels, layout,
            chunk, in, out, out_bf16 ? 1 : 0, avg ? 1 : 0, n_contrib,
            static_cast<const unsigned*>(error));
  return cudaGetLastError();
}

// Every kernel of this file loaded now (the attributes query loads its module): at device set-up,
// never first mid-call.
cudaError_t load_dynamiq_hop_kernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, dynamiq_hop_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, dynamiq_finish_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, dynamiq_finish_check_kernel);
  return e;
}

}  // namespace dq::cuda
