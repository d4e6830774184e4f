// DynamiQ's finish on the device: the bytes of the host codec's DynamiqCodec::decode_finish
// (kernels/dynamiq_codec.cc) for a contiguous range of chunks, in one launch.
//
// The range's wire positions (chunk_first[first] .. chunk_first[first + n], contiguous in the
// layout) are split evenly over each role's blocks, so a block's run may cross from one chunk's
// records into the next's: each record's chunk, hence its message, is looked up (a binary search
// of chunk_first over the range) when its layout words are read. Validator blocks check every
// chunk's header and every record of the range; decoder blocks wait for all of them (FinishGate,
// kernels/cuda/step_fold.h) and then decode, so one invalid chunk keeps every chunk of the
// launch from writing. Within a block each warp takes one super-group at a time, lane l reading
// (validators) or decoding and writing (decoders) values 8l .. 8l+7 (dynamiq_record.cuh), so no
// block barrier follows the set-up; the warp stages each record in its shared memory, a decoder
// its block's level tables.
#include "kernels/bf16.h"
#include "kernels/cuda/block.cuh"
#include "kernels/cuda/dynamiq.h"
#include "kernels/cuda/dynamiq_record.cuh"
#include "kernels/dynamiq_range.h"

namespace dq::cuda {
namespace {

// Super-groups a block should take at least: a decoder's set-up (the level tables, about 0.6 KB
// read) stays a few percent of its traffic.
constexpr int kFinishSupergroupsPerBlock = 32;

// The messages of the launch's chunks: chunk first + m's at base + m * stride bytes.
struct FinishMessages {
  const uint8_t* base;
  unsigned long long stride;  // bytes
  int first;
  int n;
};

// A super-group's layout words, as the finish reads them (the mean and K_j for a decoder only).
struct FinishSg {
  uint32_t j;        // its index in the tensor
  uint32_t offset;   // its record's offset in the message body
  uint32_t message;  // its chunk less the range's first: its message
  float mean;
  int8_t exponent;  // K_j
  uint8_t bits;
};

// A warp's shared memory: the record it reads, and the layout words of its next 32 super-groups.
struct FinishWarpShared {
  uint4 stage[kRecordStage];
  FinishSg sg[kWarp];
};

// The message (index in the range) holding wire position i of the range: the last chunk c of
// the range with chunk_first[c] <= i (an empty chunk holds no position, so it is skipped).
__device__ __forceinline__ uint32_t message_of(const LayoutView& l, const FinishMessages& m,
                                               uint64_t i) {
  int lo = m.first, hi = m.first + m.n - 1;
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (load_global(&l.chunk_first[mid]) <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  return static_cast<uint32_t>(lo - m.first);
}

__device__ __forceinline__ FinishSg load_finish_sg(const LayoutView& l, const FinishMessages& m,
                                                   uint64_t i, bool decode) {
  FinishSg s;
  s.j = load_global(&l.order[i]);
  s.offset = load_global(&l.offset[i]);
  s.message = m.n > 1 ? message_of(l, m, i) : 0u;
  s.bits = load_global(&l.width[s.j]);
  s.mean = decode ? load_global(&l.mean[s.j]) : 0.0f;
  s.exponent = decode ? load_global(&l.exponent[s.j]) : int8_t{0};
  return s;
}

// Where super-group sg's record starts in global memory.
__device__ __forceinline__ const uint8_t* record_of(const FinishMessages& m, const FinishSg& sg) {
  return m.base + sg.message * m.stride + kChunkHeaderBytes + sg.offset;
}

// A validator's super-group: the record inside the message, then every byte record_valid()
// checks (the lane's group scale, the lane's 8 codes: the warp checks all 256 and every scale).
// Returns whether the lane found the record invalid.
__device__ __forceinline__ bool finish_validate_sg(const DynamiqDeviceParams& d,
                                                   const FinishMessages& m, const FinishSg& sg,
                                                   const int* max_mag, int lane, unsigned* error,
                                                   FinishWarpShared& ws) {
  if (record_past_capacity(d.plan, sg.offset, sg.bits)) {  // never read past the message
    if (lane == 0) atomicOr(error, kDynamiqChunkOverCapacity);
    return false;
  }
  if (sg.bits == 16) return false;
  const uint8_t* r =
      stage_record_warp(record_of(m, sg), d.plan.record[width_index(sg.bits)], ws.stage, lane);
  uint32_t codes[kLaneValues];
  float scale;  // unused: the validator checks, the decode comes after
  return lane_codes(d.hierarchical_scales, r, sg.bits, max_mag[width_index(sg.bits)], lane, codes,
                    &scale);
}

// The lane's 8 results written (0 < valid <= 8 of them): 16-byte stores where all 8 are there
// and the address allows, element stores otherwise.
__device__ __forceinline__ void store_lane_values(void* out, int out_bf16, size_t first,
                                                  const float* x, int valid) {
  if (out_bf16) {
    uint16_t* dst = static_cast<uint16_t*>(out) + first;
    if (valid == kLaneValues && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
      uint32_t w[4];
      DQ_UNROLL
      for (int i = 0; i < 4; ++i)
        w[i] = static_cast<uint32_t>(f32_to_bf16_rne(x[2 * i])) |
               static_cast<uint32_t>(f32_to_bf16_rne(x[2 * i + 1])) << 16;
      store_global(reinterpret_cast<uint4*>(dst), uint4{w[0], w[1], w[2], w[3]});
    } else {
      for (int i = 0; i < valid; ++i) store_global(dst + i, f32_to_bf16_rne(x[i]));
    }
    return;
  }
  float* dst = static_cast<float*>(out) + first;
  if (valid == kLaneValues && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
    uint4* v = reinterpret_cast<uint4*>(dst);
    store_global(v, uint4{f32_bits(x[0]), f32_bits(x[1]), f32_bits(x[2]), f32_bits(x[3])});
    store_global(v + 1, uint4{f32_bits(x[4]), f32_bits(x[5]), f32_bits(x[6]), f32_bits(x[7])});
  } else {
    for (int i = 0; i < valid; ++i) store_global(dst + i, x[i]);
  }
}

// A decoder's super-group (every chunk is valid): the lane's values decoded, the means restored
// (n_contrib of them), AVG's division, the 2^K_j scaling undone, each written once.
__device__ __forceinline__ void finish_decode_sg(const DynamiqDeviceParams& d,
                                                 const LevelTable* levels, const FinishMessages& m,
                                                 const FinishSg& sg, void* out, int out_bf16,
                                                 int avg, float contributors, int lane,
                                                 FinishWarpShared& ws) {
  if (record_past_capacity(d.plan, sg.offset, sg.bits)) return;  // flagged: never decoded
  const uint8_t* r =
      stage_record_warp(record_of(m, sg), d.plan.record[width_index(sg.bits)], ws.stage, lane);
  float x[kLaneValues] = {};
  (void)add_record_lane(d.hierarchical_scales, levels, r, sg.bits, lane, x);  // validated
  const size_t first = static_cast<size_t>(sg.j) * kSuperGroup + lane * kLaneValues;
  if (first >= d.plan.count) return;
  const size_t left = d.plan.count - first;
  const int valid = left < static_cast<size_t>(kLaneValues) ? static_cast<int>(left) : kLaneValues;
  const float shift = sg.bits == 16 ? 0.0f : contributors * sg.mean;
  DQ_UNROLL
  for (int i = 0; i < kLaneValues; ++i) {
    x[i] = x[i] + shift;
    if (avg) x[i] = x[i] / contributors;
    if (sg.exponent != 0) x[i] = x[i] * pow2f(-sg.exponent);  // back from 2^K_j
  }
  store_lane_values(out, out_bf16, first, x, valid);
}

// The warp's super-groups of the block's run [begin, end): positions begin + warp + 8t, their
// layout words read 32 at a time (lane q the q-th), each then validated or decoded by the whole
// warp. A validator's flags raised before it returns.
__device__ void finish_warp(const DynamiqDeviceParams& d, const LayoutView& l,
                            const LevelTable* levels, const FinishMessages& m, uint64_t begin,
                            uint64_t end, bool decode, const int* max_mag, void* out, int out_bf16,
                            int avg, float contributors, unsigned* error, FinishWarpShared& ws) {
  const uint64_t warp = threadIdx.x / kWarp;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const uint64_t count = end > begin + warp ? (end - begin - warp + kHopWarps - 1) / kHopWarps : 0;
  bool bad = false;
  for (uint64_t t0 = 0; t0 < count; t0 += kWarp) {  // the same trips in the warp
    const int n = count - t0 < static_cast<uint64_t>(kWarp) ? static_cast<int>(count - t0) : kWarp;
    __syncwarp();  // every lane has read the previous 32 super-groups' words
    if (lane < n)
      ws.sg[lane] = load_finish_sg(l, m, begin + warp + kHopWarps * (t0 + lane), decode);
    __syncwarp();
    for (int q = 0; q < n; ++q) {
      if (decode)
        finish_decode_sg(d, levels, m, ws.sg[q], out, out_bf16, avg, contributors, lane, ws);
      else
        bad |= finish_validate_sg(d, m, ws.sg[q], max_mag, lane, error, ws);
    }
  }
  if (bad) atomicOr(error, kDynamiqBadRecord);
}

// A validator block's share of the range's chunk headers (one thread a header).
__device__ void finish_validate_headers(const LayoutView& l, const FinishMessages& m,
                                        unsigned share, unsigned shares, int n_workers,
                                        int n_contrib, unsigned* error) {
  for (unsigned c = share * kHopThreads + threadIdx.x; c < static_cast<unsigned>(m.n);
       c += shares * kHopThreads) {
    const uint8_t* in = m.base + c * m.stride;
    uint8_t h[kChunkHeaderBytes];
    for (size_t b = 0; b < kChunkHeaderBytes; ++b) h[b] = load_global(in + b);
    if (check_header(h, l, m.first + static_cast<int>(c), n_workers) != n_contrib)
      atomicOr(error, kDynamiqBadHeader);
  }
}

}  // namespace

// The finish of a range of chunks in one launch (FinishGate): tickets 0 .. validators-1 check
// their share of the chunks' headers and of the range's records; the other tickets wait for them,
// then decode their share unless a flag was raised. Each takes a contiguous run of the range's
// wire positions, its warps a super-group each at a time (finish_warp()): block barriers only in
// the set-up and the gate.
__global__ void __launch_bounds__(kHopThreads)
    dynamiq_finish_kernel(DynamiqDeviceParams d, const LevelTable* levels, const void* layout,
                          FinishMessages m, void* out, int out_bf16, int avg, int n_contrib,
                          StepWord* word, unsigned validators) {
  __shared__ LevelTable s_levels[3];
  __shared__ FinishWarpShared s_warp[kHopWarps];
  __shared__ unsigned long long s_meta[2];
  __shared__ unsigned s_gate;
  __shared__ int s_max_mag[3];
  unsigned* error = &word->flags;
  const StepFold fold(error);  // the step's only kernel (step_fold.h)
  // The lane failed before this step: nothing is written. This launch never raises kSkipFlag, so
  // every thread of the grid decides alike, before any barrier or ticket.
  if ((load_relaxed(error) & kSkipFlag) != 0) return;
  FinishGate gate(word, validators, &s_gate);
  const LayoutView l = layout_view(layout, d.sections);
  const int k = static_cast<int>(threadIdx.x);
  if (k == 0) {
    s_meta[0] = load_global(&l.chunk_first[m.first]);
    s_meta[1] = load_global(&l.chunk_first[m.first + m.n]);
  }
  if (k < 3) s_max_mag[k] = load_global(&levels[k].max_mag);
  __syncthreads();
  const uint64_t first = s_meta[0], last = s_meta[1];
  const uint64_t n = last > first ? last - first : 0;
  const uint64_t per =
      ((n + gate.shares() - 1) / gate.shares() + kHopWarps - 1) / kHopWarps * kHopWarps;
  const uint64_t begin = first + gate.share() * per;
  const uint64_t end = begin + per < last ? begin + per : last;
  FinishWarpShared& ws = s_warp[k / kWarp];
  if (gate.validator()) {
    finish_validate_headers(l, m, gate.share(), gate.shares(), d.plan.n_workers, n_contrib, error);
    finish_warp(d, l, nullptr, m, begin, end, false, s_max_mag, nullptr, 0, 0, 0.0f, error, ws);
    gate.validated();
    return;
  }
  // A decoder: its tables staged while the validators run, then the wait.
  if (begin < end) stage_level_tables(levels, s_levels, false);
  if (gate.chunk_failed()) return;  // the same in every thread: nothing is written
  finish_warp(d, l, s_levels, m, begin, end, true, s_max_mag, out, out_bf16, avg,
              static_cast<float>(n_contrib), error, ws);
}

namespace {
// Blocks of each role of the finish (validators, decoders) for `n_finish` chunks of an even
// share: kFinishSupergroupsPerBlock super-groups a block, but at least enough to fill the device
// at half the hop's blocks an SM (the two roles share it), while each warp still gets a
// super-group.
size_t finish_blocks(const DynamiqPlan& p, int n_finish) {
  size_t per_range = (p.n_sg + p.n_chunks - 1) / p.n_chunks * static_cast<size_t>(n_finish);
  if (per_range > p.n_sg) per_range = p.n_sg;
  size_t blocks = (per_range + kFinishSupergroupsPerBlock - 1) / kFinishSupergroupsPerBlock;
  const size_t fill = static_cast<size_t>(multiprocessors()) * kHopMinBlocks / 2;
  const size_t most = (per_range + kHopWarps - 1) / kHopWarps;
  if (blocks < fill) blocks = fill < most ? fill : most;
  return blocks;
}
}  // namespace

cudaError_t launch_dynamiq_finishes(const DynamiqDeviceParams& params, const LevelTable* levels,
                                    const void* layout, int first_chunk, int n_finish,
                                    const uint8_t* in_base, size_t in_stride, void* out,
                                    bool out_bf16, bool avg, int n_contrib, StepWord* word,
                                    cudaStream_t stream, int max_blocks) {
  const DynamiqPlan& p = params.plan;
  if (levels == nullptr || layout == nullptr || in_base == nullptr || word == nullptr ||
      first_chunk < 0 || n_finish < 1 || n_finish > p.n_chunks - first_chunk ||
      (n_finish > 1 && in_stride < p.capacity) || (out == nullptr && p.count > 0))
    return cudaErrorInvalidValue;
  // As many validators as decoders: a validator reads what a decoder reads but writes nothing,
  // so the validation, which every decoder waits for, takes less than half the launch.
  const unsigned per_role = grid_for(finish_blocks(p, n_finish), max_blocks);
  const FinishMessages m{in_base, in_stride, first_chunk, n_finish};
  DQ_LAUNCH(dynamiq_finish_kernel, dim3(2 * per_role), dim3(kHopThreads), 0, stream, params, levels,
            layout, m, out, out_bf16 ? 1 : 0, avg ? 1 : 0, n_contrib, word, per_role);
  return cudaGetLastError();
}

cudaError_t launch_dynamiq_finish(const DynamiqDeviceParams& params, const LevelTable* levels,
                                  const void* layout, int chunk, const uint8_t* in, void* out,
                                  bool out_bf16, bool avg, int n_contrib, StepWord* word,
                                  cudaStream_t stream, int max_blocks) {
  return launch_dynamiq_finishes(params, levels, layout, chunk, 1, in, params.plan.capacity, out,
                                 out_bf16, avg, n_contrib, word, stream, max_blocks);
}

// Every kernel of this file loaded now (the attributes query loads its module): at device set-up,
// never first mid-call.
cudaError_t load_dynamiq_finish_kernels() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, dynamiq_finish_kernel);
}

}  // namespace dq::cuda
