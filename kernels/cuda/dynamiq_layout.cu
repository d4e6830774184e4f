// DynamiQ's per-call layout on the device: the bytes of build_dynamiq_layout()
// (kernels/dynamiq_layout.cc), padding included, from the all-reduced statistics.
//
// The kernels build a batch of layouts (every codec part of a call): one launch of the one-block
// kernel for every small layout (block b: the table's job b) and one of each grid kernel for every
// large one (each block finds its layout by a search over the table), 1 + 7 launches at most.
// The table (LayoutTableJob) is planned on the host and copied to the device by the caller.
//
// A layout of fewer than kGridMinSupergroups super-groups (or whose sections cannot hold the grid
// path's scratch) is built by one block, in phases separated by barriers (larger ones over the
// whole grid: kernels/cuda/dynamiq_layout_grid.cuh, the same bytes):
//  1. zero the buffer; the header, the means (mu_j = BF16 mean / n_workers), the scale exponents
//     and the width keys' shift (a block max; kernels/dynamiq_range.h); the width keys, computed
//     once and parked in by_index (as float bits) until phase 5 overwrites it;
//  2. the widths: the host's bisection over the threshold's bit pattern, each step a block sum of
//     record bytes (an integer sum: any order gives the host's total) over the parked keys;
//  3. the width classes' sizes (block sums), hence each class's first wire position;
//  4. the chunk cuts: in wire order the record sizes are constant within a class, so the byte
//     offset of wire position i is a closed form, and the chunk of position i is
//     min(n_chunks - 1, offset / stride): chunk c starts at the first position whose record
//     starts at or after c * stride (the host's cut_chunks, empty chunks included);
//  5. the stable partition by width: a block exclusive scan of one-hot class counts (four 16-bit
//     fields of one 64-bit word per tile) gives each super-group its rank in its class, so its
//     wire position; its rank among its chunk's super-groups (by_index) is the sum over the four
//     classes of its class prefix clamped to the class's range in that chunk;
//  6. the digests: one warp per chunk, FNV-1a over the chunk's records in wire order (the lanes
//     load 32 records at once; the chain's arithmetic stays serial).
#include <cfloat>
#include <cstddef>
#include <cstring>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/cuda/block.cuh"
#include "kernels/cuda/dynamiq.h"
#include "kernels/dynamiq_range.h"

namespace dq::cuda {
namespace {

struct LayoutPtrs {
  uint64_t* header;
  uint64_t* chunk_content;
  float* mean;
  uint32_t* order;
  uint32_t* offset;
  uint32_t* by_index;
  uint32_t* chunk_first;
  uint32_t* chunk_check;
  uint8_t* width;
  int8_t* exponent;
};

// The sections of a layout at `base` (its byte offsets in `s`), for the one-block kernel and the
// grid's (dynamiq_layout_grid.cuh).
__device__ __forceinline__ LayoutPtrs layout_ptrs(const DynamiqSections& s, unsigned char* base) {
  return LayoutPtrs{reinterpret_cast<uint64_t*>(base + s.header),
                    reinterpret_cast<uint64_t*>(base + s.chunk_content),
                    reinterpret_cast<float*>(base + s.mean),
                    reinterpret_cast<uint32_t*>(base + s.order),
                    reinterpret_cast<uint32_t*>(base + s.offset),
                    reinterpret_cast<uint32_t*>(base + s.by_index),
                    reinterpret_cast<uint32_t*>(base + s.chunk_first),
                    reinterpret_cast<uint32_t*>(base + s.chunk_check),
                    reinterpret_cast<uint8_t*>(base + s.width),
                    reinterpret_cast<int8_t*>(base + s.exponent)};
}

__device__ __forceinline__ uint32_t fnv1a_word(uint32_t h, uint32_t v) {
  for (int i = 0; i < 4; ++i) {
    h ^= (v >> (8 * i)) & 0xffu;
    h *= 16777619u;
  }
  return h;
}

__device__ __forceinline__ bool non_finite(float f) {
  return (f32_bits(f) & 0x7f800000u) == 0x7f800000u;
}

// Statistics word `word` (kStatMean, kStatEnergy) of super-group j, loaded from global memory
// (counted: cuda_compat.h).
__device__ __forceinline__ uint16_t stat_of(const uint16_t* reduced, uint32_t j, size_t word) {
  return load_global(reduced + stat_word(j, word));
}
// Super-group j's summed all-zero count (summed_all_zero()), its count word loaded.
__device__ __forceinline__ uint16_t all_zero_of(const uint16_t* reduced, size_t n_sg, uint32_t j,
                                                int n_workers) {
  return summed_all_zero(load_global(reduced + zero_count_word(n_sg, j, n_workers)), j, n_workers);
}

// The energy key (kernels/dynamiq_range.h) of super-group j from its loaded statistics words:
// negative when poisoned.
__device__ __forceinline__ double key_from(uint16_t energy, uint16_t all_zero, uint32_t j,
                                           int n_workers) {
  return energy_key(energy, contributing_workers(all_zero, n_workers), j);
}

// The energy key of super-group j of plan `p`: its energy and all-zero count words loaded (4
// bytes).
__device__ __forceinline__ double key_of(const DynamiqPlan& p, const uint16_t* reduced,
                                         uint32_t j) {
  return key_from(stat_of(reduced, j, kStatEnergy), all_zero_of(reduced, p.n_sg, j, p.n_workers), j,
                  p.n_workers);
}

// The host's width_class() as a width (2 << class): a super-group's width at threshold offset
// theta.
__device__ __forceinline__ int width_for(bool poisoned, float f, float theta, bool allow_width16) {
  if (poisoned) return 2;
  const float t48 = theta * (257.0f / 131072.0f);
  const float t24 = t48 * (17.0f / 512.0f);
  if (f >= theta && allow_width16) return 16;
  if (f >= t48) return 8;
  if (f >= t24) return 4;
  return 2;
}

struct Classes {
  uint32_t start[4];  // first wire position of width class w (width_index order)
  uint32_t size[4];
  int record[4];
};

// Byte offset in the record stream of wire position i (0 <= i <= n_sg): classes lie widest first.
__device__ __forceinline__ unsigned long long wire_offset(const Classes& k, uint32_t i) {
  unsigned long long at = 0;
  for (int w = 3; w >= 0; --w) {
    uint32_t in_class = i > k.start[w] ? i - k.start[w] : 0u;
    if (in_class > k.size[w]) in_class = k.size[w];
    at += static_cast<unsigned long long>(in_class) * static_cast<unsigned long long>(k.record[w]);
  }
  return at;
}

// The chunk holding wire position i < n_sg.
__device__ __forceinline__ uint32_t chunk_of(const Classes& k, uint32_t i,
                                             unsigned long long stride, int n_chunks) {
  const unsigned long long c = wire_offset(k, i) / stride;
  const unsigned long long last = static_cast<unsigned long long>(n_chunks - 1);
  return static_cast<uint32_t>(c < last ? c : last);
}

// A parked width key that marks a poisoned super-group (a NaN pattern no width key has).
constexpr uint32_t kPoisonedKey = 0xffffffffu;

// The width of super-group j at threshold theta from its parked width key.
__device__ __forceinline__ int parked_width(const LayoutPtrs& l, uint32_t j, float theta,
                                            bool allow_width16) {
  const uint32_t key = load_global(l.by_index + j);
  return width_for(key == kPoisonedKey, f32_from_bits(key), theta, allow_width16);
}

__device__ __forceinline__ uint32_t clamp_u32(uint32_t x, uint32_t lo, uint32_t hi) {
  return x < lo ? lo : x > hi ? hi : x;
}

// The header words (the call, the element count, the chunks and workers): one thread.
__device__ __forceinline__ void store_header(const DynamiqPlan& p, const LayoutPtrs& l,
                                             unsigned long long call) {
  store_global<uint64_t>(l.header, call);
  store_global<uint64_t>(l.header + 1, p.count);
  store_global<uint64_t>(l.header + 2, static_cast<uint32_t>(p.n_chunks) |
                                           static_cast<uint64_t>(static_cast<uint32_t>(p.n_workers))
                                               << 32);
}

// The host's agree_means_and_keys() for super-group j: its mean as the hops subtract it (scaled
// like its values; non-finite: poisoned) and its scale exponent (0 when poisoned: the host leaves
// it zeroed). Returns its energy key (negative: poisoned). Its statistics words are loaded once
// (mean, energy and its count word: 6 bytes); `mean` and `exponent` are the caller's registers.
__device__ __forceinline__ double supergroup_mean(const DynamiqPlan& p, const uint16_t* reduced,
                                                  uint32_t j, float* mean, int8_t* exponent) {
  const uint16_t mean_word = stat_of(reduced, j, kStatMean);
  const uint16_t all_zero = all_zero_of(reduced, p.n_sg, j, p.n_workers);
  const float mu = bf16_to_f32(mean_word) / static_cast<float>(p.n_workers);  // before subtraction
  const double key = key_from(stat_of(reduced, j, kStatEnergy), all_zero, j, p.n_workers);
  if (key < 0.0) {
    *mean = non_finite(mu) ? mu : f32_from_bits(0x7fc00000u);
    *exponent = 0;
    return key;
  }
  const bool subtract = p.mean_subtraction && supergroup_dense(all_zero) && !non_finite(mu);
  const int8_t e = scale_exponent(key);
  *exponent = e;
  *mean = subtract ? (e == 0 ? mu : mu * pow2f(e)) : 0.0f;
  return key;
}

// floor(log2 key) + 2048 of a positive key, 0 otherwise (so 0 is "none" in a max).
__device__ __forceinline__ unsigned long long key_magnitude(double key) {
  return key > 0.0 ? static_cast<unsigned long long>(floor_log2(key) + 2048) : 0ull;
}

// The width keys' shift from the largest key_magnitude().
__device__ __forceinline__ int shift_of(unsigned long long largest) {
  return width_key_shift(largest == 0 ? INT32_MIN : static_cast<int>(largest) - 2048);
}

// The means and scale exponents of this thread's super-groups, and the width keys' shift (a block
// max: every thread returns it).
__device__ int agree_means(const DynamiqPlan& p, const LayoutPtrs& l, const uint16_t* reduced,
                           unsigned long long* scratch) {
  const uint32_t t = threadIdx.x, nt = blockDim.x;
  const uint32_t n_sg = static_cast<uint32_t>(p.n_sg);
  unsigned long long largest = 0;  // the largest key_magnitude(); 0: none
  for (uint32_t j = t; j < n_sg; j += nt) {
    float mean;
    int8_t exponent;
    const double key = supergroup_mean(p, reduced, j, &mean, &exponent);
    store_global(l.mean + j, mean);
    store_global(l.exponent + j, exponent);
    const unsigned long long e = key_magnitude(key);
    largest = e > largest ? e : largest;
  }
  return shift_of(block_reduce(largest, MaxOp(), scratch));
}

// 1. Zero the layout (the padding too: the bytes depend on the input alone), then the header, the
// means and scale exponents, and the width keys parked in by_index.
__device__ void layout_header_and_means(const DynamiqPlan& p, const DynamiqSections& s,
                                        const LayoutPtrs& l, const uint16_t* reduced,
                                        unsigned long long call, unsigned char* base,
                                        unsigned long long* scratch) {
  const uint32_t t = threadIdx.x, nt = blockDim.x;
  uint64_t* words = reinterpret_cast<uint64_t*>(base);
  for (size_t b = t; b < s.bytes / 8; b += nt) store_global<uint64_t>(words + b, 0);
  __syncthreads();
  if (t == 0) store_header(p, l, call);
  const int shift = agree_means(p, l, reduced, scratch);  // every thread: the same
  // The width keys, computed once (the bisection reads them ~31 times): parked in by_index, which
  // phase 5 writes only after the widths are final (barriers between).
  for (uint32_t j = t; j < static_cast<uint32_t>(p.n_sg); j += nt) {
    const double key = key_of(p, reduced, j);
    store_global(l.by_index + j, key < 0.0 ? kPoisonedKey : f32_bits(width_key(key, shift)));
  }
}

// 2a. Variable widths: the smallest threshold (bit pattern, monotone for non-negative floats)
// whose widths fit the budget; each step a block sum of record bytes (an integer sum: any order
// gives the host's total). Adds this thread's super-groups per class to `count`.
__device__ void layout_variable_widths(const DynamiqPlan& p, const LayoutPtrs& l,
                                       unsigned long long* scratch, uint32_t count[4]) {
  const uint32_t t = threadIdx.x, nt = blockDim.x, n_sg = static_cast<uint32_t>(p.n_sg);
  const unsigned long long budget = dynamiq_record_budget(p);
  uint32_t lo = 0, hi = 0x7f800000u;
  while (lo < hi) {  // lo and hi are the same in every thread
    const uint32_t mid = lo + (hi - lo) / 2;
    const float theta = f32_from_bits(mid);
    unsigned long long bytes = 0;
    for (uint32_t j = t; j < n_sg; j += nt)
      bytes += p.record[width_index(parked_width(l, j, theta, p.allow_width16))];
    const unsigned long long total = block_reduce(bytes, SumOp(), scratch);
    if (total <= budget)
      hi = mid;
    else
      lo = mid + 1;
  }
  const float theta = f32_from_bits(lo);
  for (uint32_t j = t; j < n_sg; j += nt) {
    const int w = parked_width(l, j, theta, p.allow_width16);
    store_global(l.width + j, static_cast<uint8_t>(w));
    ++count[width_index(w)];
  }
}

// The widest width of {16, 8, 4} whose records fit the budget with `poisoned` super-groups at 2
// bits and the others at it; 2 if none.
__device__ int fixed_width(const DynamiqPlan& p, unsigned long long poisoned) {
  const unsigned long long budget = dynamiq_record_budget(p);
  const int candidates[3] = {16, 8, 4};
  for (int c = 0; c < 3; ++c) {
    const int b = candidates[c];
    if (b == 16 && !p.allow_width16) continue;
    const unsigned long long need =
        poisoned * static_cast<unsigned long long>(p.record[0]) +
        (p.n_sg - poisoned) * static_cast<unsigned long long>(p.record[width_index(b)]);
    if (need <= budget) return b;
  }
  return 2;
}

// 2b. One width for every finite super-group: the widest that fits the budget (poisoned ones are
// 2 bits).
__device__ void layout_fixed_widths(const DynamiqPlan& p, const LayoutPtrs& l,
                                    unsigned long long* scratch, uint32_t count[4]) {
  const uint32_t t = threadIdx.x, nt = blockDim.x, n_sg = static_cast<uint32_t>(p.n_sg);
  unsigned long long poisoned = 0;
  for (uint32_t j = t; j < n_sg; j += nt) poisoned += load_global(l.by_index + j) == kPoisonedKey;
  const int fixed = fixed_width(p, block_reduce(poisoned, SumOp(), scratch));
  for (uint32_t j = t; j < n_sg; j += nt) {
    const int w = load_global(l.by_index + j) == kPoisonedKey ? 2 : fixed;
    store_global(l.width + j, static_cast<uint8_t>(w));
    ++count[width_index(w)];
  }
}

// 3. The width classes' sizes (block sums) and first wire positions (widest first).
__device__ Classes layout_classes(const DynamiqPlan& p, const uint32_t count[4],
                                  unsigned long long* scratch) {
  Classes k;
  for (int w = 0; w < 4; ++w) {
    k.size[w] = static_cast<uint32_t>(
        block_reduce(static_cast<unsigned long long>(count[w]), SumOp(), scratch));
    k.record[w] = p.record[w];
  }
  k.start[3] = 0;
  k.start[2] = k.size[3];
  k.start[1] = k.start[2] + k.size[2];
  k.start[0] = k.start[1] + k.size[1];
  return k;
}

// 4. Chunk cuts: chunk c starts at the first wire position i with chunk_of(i) >= c. Ends with a
// barrier: chunk_first and the widths are read by every thread after it.
__device__ void layout_chunk_cuts(const DynamiqPlan& p, const Classes& k, const LayoutPtrs& l) {
  const uint32_t t = threadIdx.x, nt = blockDim.x, n_sg = static_cast<uint32_t>(p.n_sg);
  const unsigned long long stride = p.stride;
  for (uint32_t i = t; i < n_sg; i += nt) {
    const uint32_t c = chunk_of(k, i, stride, p.n_chunks);
    const uint32_t before = i == 0 ? 0u : chunk_of(k, i - 1, stride, p.n_chunks);
    for (uint32_t cc = before + 1; cc <= c; ++cc) store_global(l.chunk_first + cc, i);
  }
  if (t == 0) {
    store_global(l.chunk_first, 0u);
    const uint32_t last = n_sg > 0 ? chunk_of(k, n_sg - 1, stride, p.n_chunks) : 0u;
    for (uint32_t cc = last + 1; cc <= static_cast<uint32_t>(p.n_chunks); ++cc)
      store_global(l.chunk_first + cc, n_sg);
  }
  __syncthreads();
}

// 5. The stable partition by width (order), record offsets within the chunks, by_index, chunk
// contents. Ends with a barrier: order is complete after it.
__device__ void layout_partition(const DynamiqPlan& p, const Classes& k, const LayoutPtrs& l,
                                 unsigned long long* scratch) {
  const uint32_t t = threadIdx.x, nt = blockDim.x, n_sg = static_cast<uint32_t>(p.n_sg);
  const unsigned long long stride = p.stride;
  for (uint32_t c = t; c < static_cast<uint32_t>(p.n_chunks); c += nt)
    store_global<uint64_t>(l.chunk_content + c, wire_offset(k, load_global(l.chunk_first + c + 1)) -
                                                    wire_offset(k, load_global(l.chunk_first + c)));
  uint32_t running[4] = {0, 0, 0, 0};                 // class members before this tile
  for (uint32_t tile = 0; tile < n_sg; tile += nt) {  // the same trips in every thread
    const uint32_t j = tile + t;
    const int w = j < n_sg ? width_index(load_global(l.width + j)) : -1;
    const unsigned long long one = w >= 0 ? 1ull << (16 * w) : 0ull;
    unsigned long long tile_total = 0;
    const unsigned long long before = block_exclusive_scan(one, scratch, &tile_total);
    if (w >= 0) {
      uint32_t prefix[4];  // class members before j
      for (int v = 0; v < 4; ++v)
        prefix[v] = running[v] + static_cast<uint32_t>((before >> (16 * v)) & 0xffffu);
      const uint32_t pos = k.start[w] + prefix[w];
      store_global(l.order + pos, j);
      const uint32_t c = chunk_of(k, pos, stride, p.n_chunks);
      const uint32_t first = load_global(l.chunk_first + c),
                     end = load_global(l.chunk_first + c + 1);
      store_global(l.offset + pos,
                   static_cast<uint32_t>(wire_offset(k, pos) - wire_offset(k, first)));
      // Chunk c holds class v's ranks [lo, hi); those before j are [lo, clamp(prefix)).
      uint32_t rank = 0;
      for (int v = 0; v < 4; ++v) {
        const uint32_t lo = clamp_u32(first > k.start[v] ? first - k.start[v] : 0u, 0u, k.size[v]);
        const uint32_t hi = clamp_u32(end > k.start[v] ? end - k.start[v] : 0u, 0u, k.size[v]);
        rank += clamp_u32(prefix[v], lo, hi) - lo;
      }
      store_global(l.by_index + first + rank, pos);
    }
    for (int v = 0; v < 4; ++v)
      running[v] += static_cast<uint32_t>((tile_total >> (16 * v)) & 0xffffu);
  }
  __syncthreads();
}

// 6. The digests (FNV-1a over each chunk's records in wire order: a serial chain), and the
// capacity check (the host's kInternal). One warp per chunk: its lanes load 32 records at a time
// (order, then width, mean and exponent: independent loads, in parallel) and every lane folds the
// 32 records' words, taken by shuffles, into the chain; only the arithmetic stays serial.
__device__ void layout_digests(const DynamiqPlan& p, const LayoutPtrs& l, unsigned* error) {
  const uint32_t lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const uint32_t n_warps = blockDim.x / kWarp, n_chunks = static_cast<uint32_t>(p.n_chunks);
  for (uint32_t c = warp; c < n_chunks; c += n_warps) {  // the same trips in the whole warp
    if (lane == 0 && load_global(l.chunk_content + c) + kChunkHeaderBytes > p.capacity)
      atomic_or_global(error, static_cast<unsigned>(kDynamiqChunkOverCapacity));
    uint32_t h = fnv1a_word(2166136261u, c);
    h = fnv1a_word(h, static_cast<uint32_t>(p.count));
    const uint32_t first = load_global(l.chunk_first + c), end = load_global(l.chunk_first + c + 1);
    for (uint32_t at = first; at < end; at += kWarp) {
      uint32_t word = 0, scale_word = 0;  // scale_word: 0 when the exponent is 0 (not hashed)
      if (at + lane < end) {
        const uint32_t j = load_global(l.order + at + lane);
        word = j * 32u + load_global(l.width + j) + (non_finite(load_global(l.mean + j)) ? 1u : 0u);
        const int8_t e = load_global(l.exponent + j);
        if (e != 0) scale_word = 0x100u | static_cast<uint8_t>(e);
      }
      const uint32_t n = end - at < static_cast<uint32_t>(kWarp) ? end - at : kWarp;
      for (uint32_t k = 0; k < n; ++k) {
        const uint32_t a = __shfl_sync(kFullMask, word, static_cast<int>(k));
        const uint32_t b = __shfl_sync(kFullMask, scale_word, static_cast<int>(k));
        h = fnv1a_word(h, a);
        if (b != 0) h = fnv1a_word(h, b);
      }
    }
    if (lane == 0) store_global(l.chunk_check + c, h);
  }
}

// One layout of a batch as the kernels read it from the batch's table (device memory; written by
// plan_layout_batch() on the host, in this file, so with the same struct layout).
struct LayoutTableJob {
  DynamiqPlan plan;
  DynamiqSections sections;
  const uint16_t* reduced;
  unsigned char* base;
  uint32_t first_block;   // a grid layout's first block in the grid kernels' launches
  uint32_t first_digest;  // and in the digest kernel's
  // The extent kernel's ticket: its blocks of this layout done so far. 0 from the host; the last
  // block of every launch puts it back to 0 (every block takes it, a failed lane's too), so a table
  // copied once serves every build. No kernel before the extent kernel could zero a word of the
  // layout's own sections (they hold the previous build's layout).
  uint32_t extent_done;
};

constexpr uint32_t kJobWords = (sizeof(LayoutTableJob) + 7) / 8;
static_assert(alignof(LayoutTableJob) <= 8, "a job is staged as 8-byte words");

// `job` copied into the shared words `words` (kJobWords of them): the copy, read through them.
// Collective (ends with a barrier).
__device__ __forceinline__ const LayoutTableJob& stage_job(const LayoutTableJob* job,
                                                           unsigned long long* words) {
  const unsigned long long* from = reinterpret_cast<const unsigned long long*>(job);
  // The word that holds the ticket, which other blocks take atomically meanwhile: read as a
  // relaxed load (a plain one races with them; the copy's ticket is never used).
  constexpr uint32_t kTicketWord = offsetof(LayoutTableJob, extent_done) / 8;
  for (uint32_t i = threadIdx.x; i < kJobWords; i += blockDim.x)
    words[i] = i == kTicketWord ? load_global_relaxed(from + i) : load_global(from + i);
  __syncthreads();
  return *reinterpret_cast<const LayoutTableJob*>(words);
}

}  // namespace

#include "kernels/cuda/dynamiq_layout_grid.cuh"

// Every small layout of a batch, block b the table's job b. `last`: no grid layout follows, so
// this launch folds the step's word (step_fold.h).
__global__ void __launch_bounds__(kLayoutThreads)
    dynamiq_layout_kernel(const LayoutTableJob* jobs, unsigned long long call, unsigned* error,
                          bool last) {
  __shared__ unsigned long long scratch[kWarp + 1];
  __shared__ unsigned long long job_words[kJobWords];
  __shared__ unsigned skip;
  const StepFold fold(error, last);
  // The lane failed before this step: the layout is left as it is. The word is read once a
  // block, ignoring the capacity flag another block of this launch may raise meanwhile.
  if (grid_block_skips(error, &skip)) return;
  // The job in shared memory: its fields are read throughout, and a pointer to global memory held
  // across the phases' calls cost ptxas spills (8 / 20 bytes on sm_80 / sm_90).
  const LayoutTableJob& job = stage_job(jobs + blockIdx.x, job_words);
  const DynamiqPlan& p = job.plan;
  // The section pointers are made again for each phase from the shared copy (held across the
  // phases' calls, ptxas spilled them on sm_80).
  layout_header_and_means(p, job.sections, job_ptrs(job), job.reduced, call, job.base, scratch);
  uint32_t count[4] = {0, 0, 0, 0};  // this thread's super-groups per class
  if (p.variable_widths)
    layout_variable_widths(p, job_ptrs(job), scratch, count);
  else
    layout_fixed_widths(p, job_ptrs(job), scratch, count);
  const Classes k = layout_classes(p, count, scratch);
  layout_chunk_cuts(p, k, job_ptrs(job));
  layout_partition(p, k, job_ptrs(job), scratch);
  layout_digests(p, job_ptrs(job), error);
}

namespace {

// Layouts below this many super-groups stay in one block (their work is bounded by it).
constexpr unsigned long long kGridMinSupergroups = 4096;

// Whether the layout runs over the grid: large enough, its sections hold the grid path's scratch
// (mean: 6 words a block and the histograms; offset: the digest chain; exponent: 8 words, its
// tickets and pick words, within n_sg >= kGridMinSupergroups bytes), its record sizes grow with
// the width and its histogram weights stay below 2^32.
bool layout_on_grid(const DynamiqPlan& p) {
  const unsigned long long n = p.n_sg, blocks = (n + kGridThreads - 1) / kGridThreads;
  if (n < kGridMinSupergroups || 6 * blocks + 3 * kDigitBins > n ||
      2 * (blocks + static_cast<unsigned long long>(p.n_chunks) + 2) > n)
    return false;
  for (int w = 0; w < 3; ++w)
    if (p.record[w + 1] <= p.record[w]) return false;
  return n * static_cast<unsigned long long>(p.record[3] - p.record[0]) < (1ull << 32);
}

}  // namespace

namespace {

// A job launch_dynamiq_layout would refuse (cudaErrorInvalidValue).
bool invalid_job(const LayoutJob& j) {
  const DynamiqPlan& p = j.params.plan;
  return j.layout == nullptr || p.n_chunks < 1 || (p.n_sg > 0 && j.reduced_stats == nullptr);
}

LayoutTableJob table_job(const LayoutJob& j) {
  LayoutTableJob t{};
  t.plan = j.params.plan;
  t.sections = j.params.sections;
  t.reduced = j.reduced_stats;
  t.base = static_cast<unsigned char*>(j.layout);
  t.first_block = 0;
  t.first_digest = 0;
  t.extent_done = 0;
  return t;
}

// The most blocks a batch's launch may have (grid.x is below 2^31).
constexpr unsigned long long kMaxBatchBlocks = 0x7fffffffull;

}  // namespace

bool plan_layout_batch(const LayoutJob* jobs, int n_jobs, LayoutBatch* out) {
  *out = LayoutBatch{};
  if (n_jobs < 0 || (n_jobs > 0 && jobs == nullptr)) return false;
  std::vector<LayoutTableJob> small, grid;
  unsigned long long blocks = 0, digest = 0;
  for (int i = 0; i < n_jobs; ++i) {
    if (invalid_job(jobs[i])) return false;
    LayoutTableJob t = table_job(jobs[i]);
    if (!layout_on_grid(t.plan)) {
      small.push_back(t);
      continue;
    }
    t.first_block = static_cast<uint32_t>(blocks);
    t.first_digest = static_cast<uint32_t>(digest);
    const unsigned long long b = (t.plan.n_sg + kGridThreads - 1) / kGridThreads;
    blocks += b;
    digest += b + static_cast<unsigned long long>(t.plan.n_chunks);
    if (digest > kMaxBatchBlocks) return false;
    grid.push_back(t);
  }
  if (small.size() > kMaxBatchBlocks) return false;
  out->n_small = static_cast<int>(small.size());
  out->n_grid = static_cast<int>(grid.size());
  out->grid_blocks = static_cast<unsigned>(blocks);
  out->digest_blocks = static_cast<unsigned>(digest);
  // The table: the small layouts (block b of the one-block launch: job b), then the grid ones.
  out->table.resize((small.size() + grid.size()) * sizeof(LayoutTableJob));
  unsigned char* at = out->table.data();
  for (const std::vector<LayoutTableJob>* v : {&small, &grid})
    if (!v->empty()) {
      std::memcpy(at, v->data(), v->size() * sizeof(LayoutTableJob));
      at += v->size() * sizeof(LayoutTableJob);
    }
  return true;
}

int layout_batch_launches(const LayoutBatch& batch) {
  return (batch.n_small > 0 ? 1 : 0) + (batch.n_grid > 0 ? 7 : 0);
}

cudaError_t launch_dynamiq_layouts(const LayoutBatch& batch, void* device_table, uint64_t call,
                                   unsigned* error, cudaStream_t stream) {
  if (error == nullptr || (batch.n_small + batch.n_grid > 0 && device_table == nullptr) ||
      batch.table.size() !=
          static_cast<size_t>(batch.n_small + batch.n_grid) * sizeof(LayoutTableJob))
    return cudaErrorInvalidValue;
  const auto* table = static_cast<const LayoutTableJob*>(device_table);
  const unsigned long long c = call;
  cudaError_t e = cudaSuccess;
  if (batch.n_small > 0) {
    DQ_LAUNCH(dynamiq_layout_kernel, dim3(static_cast<unsigned>(batch.n_small)),
              dim3(kLayoutThreads), 0, stream, table, c, error, batch.n_grid == 0);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  if (batch.n_grid == 0) return cudaSuccess;
  const LayoutTableJob* jobs = table + batch.n_small;
  // The extent kernel takes (and returns to 0) each grid job's ticket word in the table.
  LayoutTableJob* extent_jobs = static_cast<LayoutTableJob*>(device_table) + batch.n_small;
  const uint32_t n = static_cast<uint32_t>(batch.n_grid);
  const dim3 grid(batch.grid_blocks), block(kGridThreads);
  DQ_LAUNCH(layout_extent_kernel, grid, block, 0, stream, extent_jobs, n, error);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  DQ_LAUNCH(layout_breakpoints_kernel, grid, block, 0, stream, jobs, n, error);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  for (int level = 1; level < 3; ++level) {
    DQ_LAUNCH(layout_digit_kernel, grid, block, 0, stream, jobs, n, error, level);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  DQ_LAUNCH(layout_widths_kernel, grid, block, 0, stream, jobs, n, error);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  DQ_LAUNCH(layout_partition_kernel, grid, block, 0, stream, jobs, n, error);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  DQ_LAUNCH(layout_digest_finish_kernel, dim3(batch.digest_blocks), block, 0, stream, jobs, n, c,
            error);
  return cudaGetLastError();
}

cudaError_t launch_dynamiq_layout(const DynamiqDeviceParams& params, const uint16_t* reduced_stats,
                                  uint64_t call, void* layout, unsigned* error,
                                  cudaStream_t stream) {
  LayoutJob job;
  job.params = params;
  job.reduced_stats = reduced_stats;
  job.layout = layout;
  LayoutBatch batch;
  if (error == nullptr || !plan_layout_batch(&job, 1, &batch)) return cudaErrorInvalidValue;
#if DQ_CUDA_EMULATED
  // Launches run before they return and "device" memory is the host's: the table as it is.
  return launch_dynamiq_layouts(batch, batch.table.data(), call, error, stream);
#else
  // The table in device memory for the launches, stream-ordered: no host wait (the copy from
  // pageable memory is staged before cudaMemcpyAsync returns).
  void* table = nullptr;
  cudaError_t e = cudaMallocAsync(&table, batch.table.size(), stream);
  if (e != cudaSuccess) return e;
  e = cudaMemcpyAsync(table, batch.table.data(), batch.table.size(), cudaMemcpyHostToDevice,
                      stream);
  if (e == cudaSuccess) e = launch_dynamiq_layouts(batch, table, call, error, stream);
  const cudaError_t f = cudaFreeAsync(table, stream);
  return e != cudaSuccess ? e : f;
#endif
}

// Every kernel of this file loaded now (the attributes query loads its module): at device set-up,
// never first mid-call.
cudaError_t load_dynamiq_layout_kernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, dynamiq_layout_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, layout_extent_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, layout_breakpoints_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, layout_digit_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, layout_widths_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, layout_partition_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, layout_digest_finish_kernel);
  return e;
}

}  // namespace dq::cuda
