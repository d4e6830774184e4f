// The baseline codecs' layout, fused hop (leaf included) and finish on the device: the bytes of
// the host codecs' BlockCodec::build_layout, run_hop and run_finish with the BF16, MX and uniform
// kernels of kernels/baselines/ (bf16_codec.cc, mx_codec.cc, uniform_codec.cc).
//
// Work split: a block of 256 threads takes 256 consecutive values of the chunk at a time (blocks
// stride over the chunk); thread k owns value k, so an MX block of 32 values is one warp and a
// uniform group of 16 values is a half warp. Per value of the hop:
//  - v = own, plus each input's decoded value in input order (the host's order); values past the
//    end of the tensor in the chunk's last block stay 0 and take nothing from the inputs;
//  - the block's (group's) largest magnitude by shuffles on the FP32 bit patterns (NaN and Inf
//    above every finite value, as on the host), the scale from it (mx_scale_byte,
//    f32_to_bf16_up), the element code (mx_encode_element; the uniform rounding with Philox word
//    e % 4 of block e / 4, e the value's index in the caller's whole tensor);
//  - codes packed LSB first by shuffles (every byte from the up to four codes it holds bits of).
// Chunk spans and layout digests follow from the plan alone, so the launch functions compute
// them on the host, as BlockCodec::span and layout_digest do (the finish of a range of chunks
// also on the device, for each chunk's header). A finish of several chunks is one launch.
#include "kernels/baselines/mx_element.h"
#include "kernels/bf16.h"
#include "kernels/bitpack.h"
#include "kernels/cuda/baselines.h"
#include "kernels/cuda/block.cuh"
#include "kernels/philox.h"

namespace dq::cuda {
namespace {

enum Family : int { kFamilyBf16 = 0, kFamilyMx = 1, kFamilyUniform = 2 };

DQ_HD int family_of(CodecId codec) {
  return codec == CodecId::kBf16      ? kFamilyBf16
         : codec == CodecId::kUniform ? kFamilyUniform
                                      : kFamilyMx;
}

struct HopInputs {
  const uint8_t* p[kMaxBaselineInputs];
};

// One chunk of the plan: BlockCodec::span() and the header fields expected of its messages.
struct ChunkArgs {
  unsigned long long begin;     // first element
  unsigned long long n_real;    // elements of the chunk (end - begin)
  unsigned long long n_blocks;  // blocks of the chunk, the last one possibly partial
  uint32_t digest;              // BlockCodec::layout_digest()
  int chunk;
};

constexpr uint16_t kUniformScaleNaN = 0x7FC0;

__device__ __forceinline__ uint32_t layout_call(const void* layout) {
  return static_cast<uint32_t>(*static_cast<const uint64_t*>(layout));
}

// The chunk's message header checked against the expected one (kernels/chunk_header.h):
// returns n_contrib, or 0 when anything disagrees.
__device__ __forceinline__ int check_header(const uint8_t* h, CodecId codec, const ChunkArgs& c,
                                            uint32_t call, int max_contrib) {
  const ChunkHeader expected{codec, static_cast<uint16_t>(c.chunk), 0, call, c.digest};
  return chunk_header_contributors(h, expected, max_contrib);
}

// UniformKernel::scale_valid: NaN (a non-finite input upstream), or non-negative and finite.
__device__ __forceinline__ bool uniform_scale_valid(uint16_t s) {
  return (s & 0x7fffu) > 0x7f80u || s < 0x7f80u;
}

// UniformKernel::group_valid's code test: codes are q + L for q in [-L, L], 0 .. 2^bits - 2, so
// the all-ones code has no level.
__device__ __forceinline__ bool uniform_code_valid(uint32_t code, int bits) {
  return code != (1u << bits) - 1u;
}

// The decoded value at position `pos` of block `blk` (the host kernels' decode()); *bad is set
// where the block holds content the host's validate() refuses (uniform only).
template <int F>
__device__ __forceinline__ float decode_value(const BaselineDeviceParams& d, const uint8_t* blk,
                                              int pos, bool* bad) {
  if (F == kFamilyBf16) return bf16_to_f32(get16(blk));
  if (F == kFamilyMx) {
    const MxKind kind = static_cast<MxKind>(d.variant);
    const uint32_t code = unpack_code(blk + 1, pos, d.element_bits);
    return mx_decode_element(kind, static_cast<uint8_t>(code)) * mx_scale_value(blk[0]);
  }
  const uint16_t scale_bits = get16(blk);
  const uint32_t code = unpack_code(blk + 2, pos, d.element_bits);
  *bad |= !uniform_scale_valid(scale_bits) || !uniform_code_valid(code, d.element_bits);
  const int q = static_cast<int>(code) - d.levels;
  return uniform_level_value(q, bf16_to_f32(scale_bits), static_cast<float>(d.levels));
}

// Byte `lane % width` of the codes of the `width` lanes of this segment packed LSB first at
// `bits` each (pack_codes()); meaningful for the first width * bits / 8 lanes. Every lane of the
// warp calls it. A byte holds bits of at most four codes (bits >= 2); codes past the segment
// come in only above bit 7.
__device__ __forceinline__ uint8_t pack_byte(uint32_t code, int bits, int width) {
  const int b = static_cast<int>(threadIdx.x) & (width - 1);
  const int bit0 = 8 * b;
  const int first = bit0 / bits, shift = bit0 % bits;
  uint32_t acc = 0;
  DQ_UNROLL
  for (int t = 0; t < 4; ++t) {
    const uint32_t c = __shfl_sync(kFullMask, code, first + t, width);  // lane first + t mod width
    acc |= t == 0 ? (c >> shift) : (c << (t * bits - shift));           // shifts of 1 .. 24
  }
  return static_cast<uint8_t>(acc);
}

// Largest magnitude bit pattern over the `width` lanes of this segment.
__device__ __forceinline__ uint32_t segment_max(uint32_t a, int width) {
  DQ_UNROLL
  for (int off = 16; off > 0; off >>= 1) {
    const uint32_t o = __shfl_xor_sync(kFullMask, a, off, 32);
    a = (off < width && o > a) ? o : a;
  }
  return a;
}

__device__ __forceinline__ uint32_t word_of(const Philox4& r, uint64_t i) {
  const uint32_t j = static_cast<uint32_t>(i & 3u);
  return j == 0 ? r.v[0] : j == 1 ? r.v[1] : j == 2 ? r.v[2] : r.v[3];
}

// Every thread checks the inputs' headers (a few bytes, the same answer everywhere): a message the
// host refuses before writing leaves `out` untouched here too. Returns n_contrib of the output,
// or 0 when the hop writes nothing (block 0 then raises the flags).
__device__ __forceinline__ int hop_contributors(const BaselineDeviceParams& d, const ChunkArgs& c,
                                                const HopInputs& in, int n_in, uint32_t call,
                                                unsigned* error) {
  int contrib = 0;
  bool bad_header = false;
  for (int m = 0; m < n_in; ++m) {
    const int n = check_header(in.p[m], d.codec, c, call, d.n_workers);
    bad_header |= n == 0;
    contrib += n;
  }
  if (!bad_header && contrib + 1 <= d.n_workers) return contrib + 1;
  if (blockIdx.x == 0 && threadIdx.x == 0)
    atomicOr(error, (bad_header ? unsigned{kBaselineBadHeader} : 0u) |
                        (contrib + 1 > d.n_workers ? unsigned{kBaselineTooManyWorkers} : 0u));
  return 0;
}

// The output message's header (kernels/chunk_header.h), written by one thread.
__device__ __forceinline__ void write_hop_header(const BaselineDeviceParams& d, const ChunkArgs& c,
                                                 uint32_t n, uint32_t call, uint8_t* out) {
  const uint8_t h[kChunkHeaderBytes] = {static_cast<uint8_t>(kPayloadMagic & 0xff),
                                        static_cast<uint8_t>(kPayloadMagic >> 8),
                                        kPayloadVersion,
                                        static_cast<uint8_t>(d.codec),
                                        static_cast<uint8_t>(c.chunk & 0xff),
                                        static_cast<uint8_t>((c.chunk >> 8) & 0xff),
                                        static_cast<uint8_t>(n & 0xff),
                                        static_cast<uint8_t>((n >> 8) & 0xff),
                                        static_cast<uint8_t>(call),
                                        static_cast<uint8_t>(call >> 8),
                                        static_cast<uint8_t>(call >> 16),
                                        static_cast<uint8_t>(call >> 24),
                                        static_cast<uint8_t>(c.digest),
                                        static_cast<uint8_t>(c.digest >> 8),
                                        static_cast<uint8_t>(c.digest >> 16),
                                        static_cast<uint8_t>(c.digest >> 24)};
  for (size_t b = 0; b < kChunkHeaderBytes; ++b) out[b] = h[b];
}

// The message's bytes past the chunk's blocks, up to its capacity: zero (grid-strided).
__device__ __forceinline__ void zero_hop_tail(const BaselineDeviceParams& d, const ChunkArgs& c,
                                              uint8_t* body) {
  const unsigned long long body_bytes = c.n_blocks * static_cast<unsigned long long>(d.block_bytes);
  const unsigned long long body_capacity = d.capacity - kChunkHeaderBytes;
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * kBaselineThreads;
  for (unsigned long long b = body_bytes +
                              blockIdx.x * static_cast<unsigned long long>(kBaselineThreads) +
                              threadIdx.x;
       b < body_capacity; b += stride)
    body[b] = 0;
}

// The value at chunk position `rel`: own, plus each input's decoded value in input order (the
// host's order); padding past the tensor stays 0 but its codes are still checked.
template <int F>
__device__ __forceinline__ float hop_sum(const BaselineDeviceParams& d, const ChunkArgs& c,
                                         const void* own, int own_bf16, const HopInputs& in,
                                         int n_in, unsigned long long rel, unsigned long long blk,
                                         int pos, bool* bad) {
  const bool in_block = rel < c.n_blocks * static_cast<unsigned long long>(d.block_elems);
  const bool real = rel < c.n_real;
  float v = 0.0f;
  if (real) {
    const unsigned long long e = c.begin + rel;
    v = own_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(own)[e])
                 : static_cast<const float*>(own)[e];
  }
  if (in_block)
    for (int m = 0; m < n_in; ++m) {
      const uint8_t* src =
          in.p[m] + kChunkHeaderBytes + blk * static_cast<unsigned long long>(d.block_bytes);
      const float x = decode_value<F>(d, src, pos, bad);
      if (real) v += x;
    }
  return v;
}

// An MX block's bytes (scale, then packed elements) from its 32 values, one per lane. Every lane
// of the warp calls it (the shuffles); only lanes `in_block` write.
__device__ __forceinline__ void encode_mx(const BaselineDeviceParams& d, float v, int pos,
                                          bool in_block, uint8_t* dst) {
  const uint32_t amax = segment_max(f32_bits(v) & 0x7fffffffu, d.block_elems);
  const MxKind kind = static_cast<MxKind>(d.variant);
  const uint8_t scale = mx_scale_byte(kind, amax);
  const uint32_t code =
      scale == kMxScaleNaN ? 0u : mx_encode_element(mx_format(kind), v * mx_inverse_scale(scale));
  const uint8_t byte = pack_byte(code, d.element_bits, 32);
  if (in_block) {
    if (pos == 0) dst[0] = scale;
    if (pos < 32 * d.element_bits / 8) dst[1 + pos] = byte;
  }
}

// A uniform group's bytes (BF16 scale, then packed codes) from its 16 values, one per lane, with
// the stochastic rounding of element `e` (the caller's whole tensor). Every lane calls it.
__device__ __forceinline__ void encode_uniform(const BaselineDeviceParams& d,
                                               const RoundingKey& key, unsigned long long e,
                                               float v, int pos, bool in_block, uint8_t* dst) {
  const uint32_t amax = segment_max(f32_bits(v) & 0x7fffffffu, d.block_elems);
  const float levels = static_cast<float>(d.levels);
  uint16_t scale_bits;
  uint32_t code;
  if (amax >= 0x7f800000u || amax == 0) {
    scale_bits = amax == 0 ? 0 : kUniformScaleNaN;
    code = static_cast<uint32_t>(d.levels);
  } else {
    scale_bits = f32_to_bf16_up(f32_from_bits(amax));
    const float scale = bf16_to_f32(scale_bits);
    const Philox4 r =
        philox_draw(key.seed, key.call, key.rank, kStreamRounding, static_cast<uint32_t>(e / 4));
    float x = (v / scale) * levels;
    x = x > levels ? levels : (x < -levels ? -levels : x);
    int fl = static_cast<int>(x);
    fl -= static_cast<float>(fl) > x ? 1 : 0;
    const float frac = x - static_cast<float>(fl);
    int q = fl + (uniform24(word_of(r, e)) < frac ? 1 : 0);
    q = q > d.levels ? d.levels : q;
    code = static_cast<uint32_t>(q + d.levels);
  }
  const uint8_t byte = pack_byte(code, d.element_bits, 16);
  if (in_block) {
    if (pos == 0) {
      dst[0] = static_cast<uint8_t>(scale_bits);
      dst[1] = static_cast<uint8_t>(scale_bits >> 8);
    }
    if (pos < 2 * d.element_bits) dst[2 + pos] = byte;
  }
}

template <int F>
__global__ void __launch_bounds__(kBaselineThreads)
    baseline_hop_kernel(BaselineDeviceParams d, const void* layout, ChunkArgs c, const void* own,
                        int own_bf16, HopInputs in, int n_in, uint8_t* out, RoundingKey key,
                        unsigned* error) {
  // The step's last kernel unless the uniform clear follows (launch_baseline_hop; step_fold.h).
  const StepFold fold(error, F != kFamilyUniform || n_in == 0);
  // The lane failed before this step (the caller armed the word): nothing is written. This launch
  // never raises kSkipFlag, so every thread of the grid decides alike, before any shuffle.
  if ((load_relaxed(error) & kSkipFlag) != 0) return;
  const uint32_t call = layout_call(layout);
  const int n = hop_contributors(d, c, in, n_in, call, error);
  if (n == 0) return;  // the whole grid: no barrier follows
  if (blockIdx.x == 0 && threadIdx.x == 0)
    write_hop_header(d, c, static_cast<uint32_t>(n), call, out);
  uint8_t* body = out + kChunkHeaderBytes;
  zero_hop_tail(d, c, body);

  const unsigned long long n_vals = c.n_blocks * static_cast<unsigned long long>(d.block_elems);
  bool bad = false;
  // The same trips in every thread of the block (the shuffles below need the whole warp).
  for (unsigned long long t = blockIdx.x; t * kBaselineThreads < n_vals; t += gridDim.x) {
    const unsigned long long rel = t * kBaselineThreads + threadIdx.x;
    const bool in_block = rel < n_vals;  // a value of one of the chunk's blocks (maybe padding)
    const unsigned long long blk = rel / static_cast<unsigned long long>(d.block_elems);
    const int pos = static_cast<int>(rel % static_cast<unsigned long long>(d.block_elems));
    const float v = hop_sum<F>(d, c, own, own_bf16, in, n_in, rel, blk, pos, &bad);
    uint8_t* dst = body + blk * static_cast<unsigned long long>(d.block_bytes);
    if (F == kFamilyBf16) {
      const uint16_t h = f32_to_bf16_sat(v);  // the host's encode(): finite stays finite
      if (in_block) {
        dst[0] = static_cast<uint8_t>(h);
        dst[1] = static_cast<uint8_t>(h >> 8);
      }
    } else if (F == kFamilyMx) {
      encode_mx(d, v, pos, in_block, dst);
    } else {
      encode_uniform(d, key, key.element_base + c.begin + rel, v, pos, in_block, dst);
    }
  }
  if (bad) atomicOr(error, unsigned{kBaselineBadCodes});
}

// After a uniform hop: an input with invalid codes leaves the whole message zero (run_hop()).
__global__ void __launch_bounds__(kBaselineThreads)
    baseline_hop_clear_kernel(unsigned long long capacity, uint8_t* out, const unsigned* error) {
  const StepFold fold(error);  // the step's last kernel (step_fold.h)
  if ((load_relaxed(error) & (kSkipFlag | kBaselineBadCodes)) != kBaselineBadCodes) return;
  for (unsigned long long b =
           blockIdx.x * static_cast<unsigned long long>(kBaselineThreads) + threadIdx.x;
       b < capacity; b += static_cast<unsigned long long>(gridDim.x) * kBaselineThreads)
    out[b] = 0;
}

// BlockCodec::span() and layout_digest(): on the host for a hop, on the device for each chunk of a
// finish.
DQ_HD ChunkArgs chunk_args(const BaselineDeviceParams& d, int chunk) {
  const unsigned long long n = static_cast<unsigned long long>(d.n_chunks);
  const unsigned long long ch = static_cast<unsigned long long>(chunk);
  const unsigned long long first = ch * d.n_blocks / n;
  const unsigned long long n_blocks = (ch + 1) * d.n_blocks / n - first;
  unsigned long long begin = first * static_cast<unsigned long long>(d.block_elems);
  unsigned long long end = (first + n_blocks) * static_cast<unsigned long long>(d.block_elems);
  begin = begin > d.count ? d.count : begin;
  end = end > d.count ? d.count : end;
  // FNV-1a-64 over the little-endian bytes of [codec id, variant, count, begin, end], folded.
  const uint64_t words[5] = {static_cast<uint64_t>(d.codec), d.variant, d.count, begin, end};
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint64_t w : words)
    for (int b = 0; b < 8; ++b) {
      h ^= (w >> (8 * b)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  return ChunkArgs{begin, end - begin, n_blocks,
                   static_cast<uint32_t>(h) ^ static_cast<uint32_t>(h >> 32), chunk};
}

// ---- the finish: one launch (FinishGate, kernels/cuda/step_fold.h) -------------------------

// The chunks of a finish: chunk first + m's message at base + m * stride bytes; the range's
// elements and blocks (contiguous in the tensor: BlockCodec::span() of each chunk in turn).
struct FinishRange {
  const uint8_t* base;
  unsigned long long stride;  // bytes
  int first;
  int n;
  unsigned long long begin;        // the range's first element
  unsigned long long n_real;       // its elements
  unsigned long long first_block;  // its first block, of the whole tensor's
  unsigned long long n_blocks;     // its blocks, the last one possibly partial
};

// Where block `b` (of the whole tensor's, in the range) lies: in the message of the chunk that
// holds it, the last chunk c with c * n_blocks / n_chunks <= b (span()'s cut).
__device__ __forceinline__ const uint8_t* range_block(const BaselineDeviceParams& d,
                                                      const FinishRange& r, unsigned long long b) {
  const unsigned long long n = static_cast<unsigned long long>(d.n_chunks);
  const unsigned long long c = ((b + 1) * n - 1) / d.n_blocks;
  const unsigned long long first = c * d.n_blocks / n;
  return r.base + (c - static_cast<unsigned long long>(r.first)) * r.stride + kChunkHeaderBytes +
         (b - first) * static_cast<unsigned long long>(d.block_bytes);
}

// A validator's share of the range: the chunks' headers (one thread a header: its worker count
// n_contrib), and for uniform every code and scale of the range's groups, padding included
// (UniformKernel::validate()).
__device__ void baseline_finish_validate(const BaselineDeviceParams& d, const void* layout,
                                         const FinishRange& r, int n_contrib, unsigned share,
                                         unsigned shares, unsigned* error) {
  const unsigned long long step = static_cast<unsigned long long>(shares) * kBaselineThreads;
  const unsigned long long own =
      share * static_cast<unsigned long long>(kBaselineThreads) + threadIdx.x;
  for (unsigned long long m = own; m < static_cast<unsigned long long>(r.n); m += step) {
    const ChunkArgs c = chunk_args(d, r.first + static_cast<int>(m));
    if (check_header(r.base + m * r.stride, d.codec, c, layout_call(layout), d.n_workers) !=
        n_contrib)
      atomicOr(error, unsigned{kBaselineBadHeader});
  }
  if (family_of(d.codec) != kFamilyUniform) return;
  const unsigned long long n_vals = r.n_blocks * static_cast<unsigned long long>(d.block_elems);
  bool bad = false;
  // Each value's code; a group's scale once, by the thread at its first value (decode_value()
  // would check it, and decode, at every value).
  for (unsigned long long rel = own; rel < n_vals; rel += step) {
    const uint8_t* blk = range_block(d, r, r.first_block + rel / 16);
    const int pos = static_cast<int>(rel % 16);
    bad |= !uniform_code_valid(unpack_code(blk + 2, pos, d.element_bits), d.element_bits);
    if (pos == 0) bad |= !uniform_scale_valid(get16(blk));
  }
  if (bad) atomicOr(error, unsigned{kBaselineBadCodes});
}

// A share of the range's elements decoded (every message is valid), AVG's division, written once.
template <int F>
__device__ void baseline_finish_values(const BaselineDeviceParams& d, const FinishRange& r,
                                       void* out, int out_bf16, int avg, int n_contrib,
                                       unsigned share, unsigned shares) {
  const float divisor = static_cast<float>(n_contrib);
  const unsigned long long elems = static_cast<unsigned long long>(d.block_elems);
  bool bad = false;
  for (unsigned long long rel =
           share * static_cast<unsigned long long>(kBaselineThreads) + threadIdx.x;
       rel < r.n_real; rel += static_cast<unsigned long long>(shares) * kBaselineThreads) {
    const unsigned long long e = r.begin + rel;
    float v = decode_value<F>(d, range_block(d, r, e / elems), static_cast<int>(e % elems), &bad);
    if (avg) v /= divisor;
    if (out_bf16)
      static_cast<uint16_t*>(out)[e] = f32_to_bf16_rne(v);
    else
      static_cast<float*>(out)[e] = v;
  }
}

// The finish of a range of chunks in one launch (FinishGate): tickets 0 .. validators-1 check
// the chunks' headers and (uniform) their codes and scales; the other tickets wait for them, then
// decode their share of the range's elements unless a flag was raised.
__global__ void __launch_bounds__(kBaselineThreads)
    baseline_finish_kernel(BaselineDeviceParams d, const void* layout, FinishRange r, void* out,
                           int out_bf16, int avg, int n_contrib, StepWord* word,
                           unsigned validators) {
  __shared__ unsigned s_word;
  unsigned* error = &word->flags;
  const StepFold fold(error);  // the step's only kernel (step_fold.h)
  // The lane failed before this step: nothing is written. Never raised here: the grid decides
  // alike, before any barrier or ticket.
  if ((load_relaxed(error) & kSkipFlag) != 0) return;
  FinishGate gate(word, validators, &s_word);
  if (gate.validator()) {
    baseline_finish_validate(d, layout, r, n_contrib, gate.share(), gate.shares(), error);
    gate.validated();
    return;
  }
  if (gate.chunk_failed()) return;  // the same in every thread: nothing is written
  const int family = family_of(d.codec);
  if (family == kFamilyBf16)
    baseline_finish_values<kFamilyBf16>(d, r, out, out_bf16, avg, n_contrib, gate.share(),
                                        gate.shares());
  else if (family == kFamilyMx)
    baseline_finish_values<kFamilyMx>(d, r, out, out_bf16, avg, n_contrib, gate.share(),
                                      gate.shares());
  else
    baseline_finish_values<kFamilyUniform>(d, r, out, out_bf16, avg, n_contrib, gate.share(),
                                           gate.shares());
}

__global__ void baseline_layout_kernel(uint64_t call, uint64_t* layout, const unsigned* error) {
  const StepFold fold(error);  // the step's only kernel (step_fold.h)
  // The lane failed before: the layout stays.
  if (error != nullptr && step_failed(load_relaxed(error))) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) *layout = call;
}

unsigned grid_for(unsigned long long work, int max_blocks) {
  const unsigned long long cap =
      max_blocks > 0 ? static_cast<unsigned long long>(max_blocks) : 4096;
  const unsigned long long n = work < cap ? work : cap;
  return static_cast<unsigned>(n > 0 ? n : 1);
}

bool params_ok(const BaselineDeviceParams& d) {
  const bool mx = d.codec == CodecId::kMxfp8 || d.codec == CodecId::kMxfp6E3M2 ||
                  d.codec == CodecId::kMxfp6E2M3 || d.codec == CodecId::kMxfp4;
  if (!mx && d.codec != CodecId::kBf16 && d.codec != CodecId::kUniform) return false;
  if (mx && (d.variant > 3 || d.block_elems != 32)) return false;
  if (d.codec == CodecId::kUniform &&
      (d.block_elems != 16 || d.element_bits < 2 || d.element_bits > 8))
    return false;
  if (d.codec == CodecId::kBf16 && d.block_elems != 1) return false;
  return d.n_chunks >= 1 && d.n_workers >= 1 && d.capacity >= kChunkHeaderBytes;
}

}  // namespace

cudaError_t launch_baseline_layout(uint64_t call, void* layout, cudaStream_t stream,
                                   const unsigned* error) {
  if (layout == nullptr) return cudaErrorInvalidValue;
  DQ_LAUNCH(baseline_layout_kernel, dim3(1), dim3(kWarp), 0, stream, call,
            static_cast<uint64_t*>(layout), error);
  return cudaGetLastError();
}

cudaError_t launch_baseline_hop(const BaselineDeviceParams& params, const void* layout, int chunk,
                                const void* own, bool own_bf16, const uint8_t* const* inputs,
                                int n_in, uint8_t* out, const RoundingKey& key, unsigned* error,
                                cudaStream_t stream, int max_blocks) {
  // check_hop_args() and check_element_base() of the host.
  if (!params_ok(params) || layout == nullptr || out == nullptr || error == nullptr || chunk < 0 ||
      chunk >= params.n_chunks || n_in < 0 || n_in > kMaxBaselineInputs ||
      (n_in > 0 && inputs == nullptr) || (own == nullptr && params.count > 0) ||
      key.element_base % 256 != 0 || params.count > kMaxElementIndex ||
      key.element_base > kMaxElementIndex - params.count)
    return cudaErrorInvalidValue;
  HopInputs in{};
  for (int i = 0; i < n_in; ++i) {
    if (inputs[i] == nullptr) return cudaErrorInvalidValue;
    in.p[i] = inputs[i];
  }
  const ChunkArgs c = chunk_args(params, chunk);
  const unsigned long long tiles =
      (c.n_blocks * static_cast<unsigned long long>(params.block_elems) + kBaselineThreads - 1) /
      kBaselineThreads;
  const dim3 grid(grid_for(tiles, max_blocks));
  const int b16 = own_bf16 ? 1 : 0;
  switch (family_of(params.codec)) {
    case kFamilyBf16:
      DQ_LAUNCH(baseline_hop_kernel<kFamilyBf16>, grid, dim3(kBaselineThreads), 0, stream, params,
                layout, c, own, b16, in, n_in, out, key, error);
      break;
    case kFamilyMx:
      DQ_LAUNCH(baseline_hop_kernel<kFamilyMx>, grid, dim3(kBaselineThreads), 0, stream, params,
                layout, c, own, b16, in, n_in, out, key, error);
      break;
    default: {
      DQ_LAUNCH(baseline_hop_kernel<kFamilyUniform>, grid, dim3(kBaselineThreads), 0, stream,
                params, layout, c, own, b16, in, n_in, out, key, error);
      const cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess || n_in == 0) return e;
      DQ_LAUNCH(
          baseline_hop_clear_kernel,
          dim3(grid_for((params.capacity + kBaselineThreads - 1) / kBaselineThreads, max_blocks)),
          dim3(kBaselineThreads), 0, stream, params.capacity, out,
          static_cast<const unsigned*>(error));
    }
  }
  return cudaGetLastError();
}

cudaError_t launch_baseline_finishes(const BaselineDeviceParams& params, const void* layout,
                                     int first_chunk, int n_finish, const uint8_t* in_base,
                                     size_t in_stride, void* out, bool out_bf16, bool avg,
                                     int n_contrib, StepWord* word, cudaStream_t stream,
                                     int max_blocks) {
  // run_finish()'s argument checks, for each chunk of the range.
  if (!params_ok(params) || layout == nullptr || in_base == nullptr || word == nullptr ||
      first_chunk < 0 || n_finish < 1 || n_finish > params.n_chunks - first_chunk ||
      (n_finish > 1 && in_stride < params.capacity) || n_contrib < 1 ||
      n_contrib > params.n_workers || (out == nullptr && params.count > 0))
    return cudaErrorInvalidValue;
  const ChunkArgs a = chunk_args(params, first_chunk);
  const ChunkArgs z = chunk_args(params, first_chunk + n_finish - 1);
  const unsigned long long chunks = static_cast<unsigned long long>(params.n_chunks);
  const unsigned long long first_block =
      static_cast<unsigned long long>(first_chunk) * params.n_blocks / chunks;
  const FinishRange r{
      in_base,
      in_stride,
      first_chunk,
      n_finish,
      a.begin,
      z.begin + z.n_real - a.begin,
      first_block,
      static_cast<unsigned long long>(first_chunk + n_finish) * params.n_blocks / chunks -
          first_block};
  const unsigned long long vals = r.n_blocks * static_cast<unsigned long long>(params.block_elems);
  // Validators: uniform's, one thread a value of the range's groups; the others' only check the
  // headers, one thread a chunk.
  const unsigned long long checks =
      family_of(params.codec) == kFamilyUniform ? vals : static_cast<unsigned long long>(n_finish);
  const unsigned validators =
      grid_for((checks + kBaselineThreads - 1) / kBaselineThreads, max_blocks);
  const unsigned decoders =
      grid_for((r.n_real + kBaselineThreads - 1) / kBaselineThreads, max_blocks);
  DQ_LAUNCH(baseline_finish_kernel, dim3(validators + decoders), dim3(kBaselineThreads), 0, stream,
            params, layout, r, out, out_bf16 ? 1 : 0, avg ? 1 : 0, n_contrib, word, validators);
  return cudaGetLastError();
}

cudaError_t launch_baseline_finish(const BaselineDeviceParams& params, const void* layout,
                                   int chunk, const uint8_t* in, void* out, bool out_bf16, bool avg,
                                   int n_contrib, StepWord* word, cudaStream_t stream,
                                   int max_blocks) {
  return launch_baseline_finishes(params, layout, chunk, 1, in, params.capacity, out, out_bf16, avg,
                                  n_contrib, word, stream, max_blocks);
}

// Every kernel of this file loaded now (the attributes query loads its module): at device set-up,
// never first mid-call.
cudaError_t load_baseline_kernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, baseline_layout_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, baseline_hop_kernel<kFamilyBf16>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, baseline_hop_kernel<kFamilyMx>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, baseline_hop_kernel<kFamilyUniform>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, baseline_hop_clear_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, baseline_finish_kernel);
  return e;
}

}  // namespace dq::cuda
