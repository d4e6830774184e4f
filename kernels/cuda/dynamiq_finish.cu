// DynamiQ's finish on the device: the bytes of the host codec's DynamiqCodec::decode_finish
// (kernels/dynamiq_codec.cc) for a contiguous range of chunks, in one launch.
//
// The range's wire positions (chunk_first[first] .. chunk_first[first + n], contiguous in the
// layout) are split evenly over each role's blocks, so a block's run may cross from one chunk's
// records into the next's: each record's chunk, hence its message, is looked up (a binary search
// of chunk_first over the range) when its layout words are read. Validator blocks check every
// chunk's header and every record of the range; decoder blocks wait for all of them (FinishGate,
// kernels/cuda/step_fold.h) and then decode, so one invalid chunk keeps every chunk of the
// launch from writing. Records and decode tables are staged in shared memory.
#include "kernels/bf16.h"
#include "kernels/cuda/block.cuh"
#include "kernels/cuda/dynamiq.h"
#include "kernels/cuda/dynamiq_record.cuh"
#include "kernels/dynamiq_range.h"

namespace dq::cuda {
namespace {

constexpr int kFinishBatch = 8;  // records staged a round: warp s copies member s
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

// The layout words of a batch's records, read once by threads 0..7.
struct FinishBatch {
  uint32_t j[kFinishBatch];
  uint32_t offset[kFinishBatch];
  uint32_t message[kFinishBatch];  // the record's chunk less the range's first: its message
  float mean[kFinishBatch];
  int8_t exponent[kFinishBatch];
  uint8_t bits[kFinishBatch];
};

struct FinishShared {
  LevelTable* levels;        // [3] (decoders; stage_level_tables without the lookups)
  FinishBatch* batch;        //
  uint4* record;             // [kFinishBatch * kRecordStage]: the batch's records
  float* scale;              // [kFinishBatch * kGroupsPerSuperGroup]: their group scales (decoders)
  unsigned long long* meta;  // [2]: the range's first and end wire position
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

// The body (past the header) of batch member s's message.
__device__ __forceinline__ const uint8_t* member_body(const FinishMessages& m, const FinishBatch& b,
                                                      int s) {
  return m.base + b.message[s] * m.stride + kChunkHeaderBytes;
}

// A batch's layout words (threads 0..7; the means and exponents for a decoder), then warp s
// copies member s's record to shared memory unless it ends past the message, and for a decoder
// decodes its 16 group scales once (lanes 0..15; the validators have checked them). Two
// barriers.
__device__ void finish_batch_load(const DynamiqDeviceParams& d, const LayoutView& l,
                                  const FinishMessages& m, uint64_t i0, uint64_t end, bool decode,
                                  const FinishShared& sh) {
  const int k = static_cast<int>(threadIdx.x);
  FinishBatch& b = *sh.batch;
  if (k < kFinishBatch && i0 + k < end) {
    const uint64_t i = i0 + k;
    const uint32_t j = load_global(&l.order[i]);
    b.j[k] = j;
    b.offset[k] = load_global(&l.offset[i]);
    b.message[k] = m.n > 1 ? message_of(l, m, i) : 0u;
    b.bits[k] = load_global(&l.width[j]);
    if (decode) {
      b.mean[k] = load_global(&l.mean[j]);
      b.exponent[k] = load_global(&l.exponent[j]);
    }
  }
  __syncthreads();
  const int s = k / kWarp;
  if (s < kFinishBatch && i0 + s < end && !record_past_capacity(d.plan, b.offset[s], b.bits[s])) {
    const uint8_t* rec = group_copy_to_shared(member_body(m, b, s) + b.offset[s],
                                              d.plan.record[width_index(b.bits[s])],
                                              sh.record + s * kRecordStage, k % kWarp, kWarp);
    const int q = k % kWarp;
    if (decode && b.bits[s] < 16) {
      __syncwarp();
      bool bad = false;  // validated: never set
      if (q < kGroupsPerSuperGroup)
        sh.scale[kGroupsPerSuperGroup * s + q] =
            record_group_scale(d.hierarchical_scales, rec, q, &bad);
    }
  }
  __syncthreads();
}

// Where batch member s's record lies in shared memory after finish_batch_load().
__device__ __forceinline__ const uint8_t* staged_record(const FinishShared& sh,
                                                        const FinishMessages& m, int s) {
  const uint8_t* src = member_body(m, *sh.batch, s) + sh.batch->offset[s];
  return reinterpret_cast<const uint8_t*>(sh.record + s * kRecordStage) +
         (reinterpret_cast<uintptr_t>(src) & 15u);
}

// A validator's batch: every value of every record (record_valid(): all 256 codes, every scale),
// and the capacity. `max_mag`: the three tables' L.
__device__ void finish_validate_batch(const DynamiqDeviceParams& d, const FinishMessages& m,
                                      uint64_t i0, uint64_t end, const int* max_mag,
                                      unsigned* error, const FinishShared& sh) {
  const int k = static_cast<int>(threadIdx.x);
  const FinishBatch& b = *sh.batch;
  bool bad = false;
  for (int s = 0; s < kFinishBatch && i0 + s < end; ++s) {
    const int bits = b.bits[s];
    if (record_past_capacity(d.plan, b.offset[s], bits)) {  // never read past the message
      if (k == 0) atomicOr(error, kDynamiqChunkOverCapacity);
      continue;
    }
    if (bits == 16) continue;
    const uint8_t* rec = staged_record(sh, m, s);
    // Each value's code; the scales once a record (threads 0..15, a group each), not per value.
    (void)record_code(d.hierarchical_scales, bits, rec, k, max_mag[width_index(bits)], &bad);
    bad |= record_scales_bad(d.hierarchical_scales, bits, rec, k);
  }
  if (bad) atomicOr(error, kDynamiqBadRecord);
}

// A validator block: its share of the range's chunk headers (one thread a header), then its run
// [begin, end) of wire positions, batch by batch.
__device__ void finish_validate(const DynamiqDeviceParams& d, const LayoutView& l,
                                const FinishMessages& m, unsigned share, unsigned shares,
                                uint64_t begin, uint64_t end, int n_contrib, const int* max_mag,
                                unsigned* error, const FinishShared& sh) {
  for (unsigned c = share * kHopThreads + threadIdx.x; c < static_cast<unsigned>(m.n);
       c += shares * kHopThreads) {
    const uint8_t* in = m.base + c * m.stride;
    uint8_t h[kChunkHeaderBytes];
    for (size_t b = 0; b < kChunkHeaderBytes; ++b) h[b] = load_global(in + b);
    if (check_header(h, l, m.first + static_cast<int>(c), d.plan.n_workers) != n_contrib)
      atomicOr(error, kDynamiqBadHeader);
  }
  for (uint64_t i0 = begin; i0 < end; i0 += kFinishBatch) {  // the same trips in the block
    finish_batch_load(d, l, m, i0, end, false, sh);
    finish_validate_batch(d, m, i0, end, max_mag, error, sh);
    __syncthreads();  // the batch's shared words are rewritten by the next batch
  }
}

// A decoder's batch (every chunk is valid): each value decoded, the means restored (n_contrib of
// them), AVG's division, the 2^K_j scaling undone, written once.
__device__ void finish_decode_batch(const DynamiqDeviceParams& d, const FinishMessages& m,
                                    uint64_t i0, uint64_t end, void* out, int out_bf16, int avg,
                                    float contributors, const FinishShared& sh) {
  const int k = static_cast<int>(threadIdx.x);
  const FinishBatch& b = *sh.batch;
  for (int s = 0; s < kFinishBatch && i0 + s < end; ++s) {
    const uint32_t j = b.j[s];
    const int bits = b.bits[s];
    const size_t base = static_cast<size_t>(j) * kSuperGroup;
    const size_t left = d.plan.count - base;
    const int valid =
        left < static_cast<size_t>(kSuperGroup) ? static_cast<int>(left) : kSuperGroup;
    if (k >= valid) continue;
    bool bad = false;  // validated: never set
    const uint8_t* rec = staged_record(sh, m, s);
    float v = 0.0f;
    if (bits == 16) {
      v += bf16_to_f32(get16(rec + 2 * k));
    } else {
      const LevelTable& t = sh.levels[width_index(bits)];
      const uint32_t code = record_code(d.hierarchical_scales, bits, rec, k, t.max_mag, &bad);
      v += decode_code(t, code, sh.scale[kGroupsPerSuperGroup * s + k / kGroup]);
    }
    const float shift = bits == 16 ? 0.0f : contributors * b.mean[s];
    float x = v + shift;
    if (avg) x = x / contributors;
    if (b.exponent[s] != 0) x = x * pow2f(-b.exponent[s]);  // back from 2^K_j
    if (out_bf16)
      store_global(static_cast<uint16_t*>(out) + base + k, f32_to_bf16_rne(x));
    else
      store_global(static_cast<float*>(out) + base + k, x);
  }
}

}  // namespace

// The finish of a range of chunks in one launch (FinishGate): tickets 0 .. validators-1 check
// their share of the chunks' headers and of the range's records; the other tickets wait for them,
// then decode their share unless a flag was raised. Each takes a contiguous run of the range's
// wire positions, in batches of kFinishBatch records staged in shared memory.
__global__ void __launch_bounds__(kHopThreads)
    dynamiq_finish_kernel(DynamiqDeviceParams d, const LevelTable* levels, const void* layout,
                          FinishMessages m, void* out, int out_bf16, int avg, int n_contrib,
                          StepWord* word, unsigned validators) {
  __shared__ LevelTable s_levels[3];
  __shared__ FinishBatch s_batch;
  __shared__ uint4 s_record[kFinishBatch * kRecordStage];
  __shared__ float s_scale[kFinishBatch * kGroupsPerSuperGroup];
  __shared__ unsigned long long s_meta[2];
  __shared__ unsigned s_gate;
  __shared__ int s_max_mag[3];
  unsigned* error = &word->flags;
  const StepFold fold(error);  // the step's only kernel (step_fold.h)
  // The lane failed before this step: nothing is written. This launch never raises kSkipFlag, so
  // every thread of the grid decides alike, before any barrier or ticket.
  if ((*error & kSkipFlag) != 0) return;
  FinishGate gate(word, validators, &s_gate);
  const FinishShared sh{s_levels, &s_batch, s_record, s_scale, s_meta};
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
      ((n + gate.shares() - 1) / gate.shares() + kFinishBatch - 1) / kFinishBatch * kFinishBatch;
  const uint64_t begin = first + gate.share() * per;
  const uint64_t end = begin + per < last ? begin + per : last;
  if (gate.validator()) {
    finish_validate(d, l, m, gate.share(), gate.shares(), begin, end, n_contrib, s_max_mag, error,
                    sh);
    gate.validated();
    return;
  }
  // A decoder: its tables staged while the validators run, then the wait.
  if (begin < end) stage_level_tables(levels, s_levels, false);
  if (gate.chunk_failed()) return;  // the same in every thread: nothing is written
  const float contributors = static_cast<float>(n_contrib);
  for (uint64_t i0 = begin; i0 < end; i0 += kFinishBatch) {
    finish_batch_load(d, l, m, i0, end, true, sh);
    finish_decode_batch(d, m, i0, end, out, out_bf16, avg, contributors, sh);
    __syncthreads();
  }
}

namespace {
// Blocks of each role of the finish (validators, decoders) for `n_finish` chunks of an even
// share: kFinishSupergroupsPerBlock super-groups a block, but at least enough to fill the device
// at half the hop's blocks an SM (the two roles share it), while each block still gets a whole
// batch.
size_t finish_blocks(const DynamiqPlan& p, int n_finish) {
  size_t per_range = (p.n_sg + p.n_chunks - 1) / p.n_chunks * static_cast<size_t>(n_finish);
  if (per_range > p.n_sg) per_range = p.n_sg;
  size_t blocks = (per_range + kFinishSupergroupsPerBlock - 1) / kFinishSupergroupsPerBlock;
  const size_t fill = static_cast<size_t>(multiprocessors()) * kHopMinBlocks / 2;
  const size_t most = (per_range + kFinishBatch - 1) / kFinishBatch;
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
