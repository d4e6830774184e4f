// DynamiQ's per-call layout on the device: the bytes of build_dynamiq_layout()
// (kernels/dynamiq_layout.cc), padding included, from the all-reduced statistics.
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

// mu_j before mean subtraction is applied.
__device__ __forceinline__ float raw_mean(const uint16_t* reduced, size_t j, float n_workers) {
  return bf16_to_f32(reduced[stat_word(j, kStatMean)]) / n_workers;
}

// The energy key of super-group j (kernels/dynamiq_range.h): negative when poisoned.
__device__ __forceinline__ double key_of(const uint16_t* reduced, uint32_t j, int n_workers) {
  return energy_key(reduced[stat_word(j, kStatEnergy)],
                    contributing_workers(reduced[stat_word(j, kStatAllZero)], n_workers), j);
}

// The host's width_for(): the width of a super-group at threshold offset theta.
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
  const uint32_t key = l.by_index[j];
  return width_for(key == kPoisonedKey, f32_from_bits(key), theta, allow_width16);
}

__device__ __forceinline__ uint32_t clamp_u32(uint32_t x, uint32_t lo, uint32_t hi) {
  return x < lo ? lo : x > hi ? hi : x;
}

// The host's agree_means_and_keys() for super-group j: its mean as the hops subtract it (scaled
// like its values; non-finite: poisoned) and its scale exponent (0 when poisoned: the host leaves
// it zeroed). Returns its energy key (negative: poisoned).
__device__ __forceinline__ double supergroup_mean(const DynamiqPlan& p, const uint16_t* reduced,
                                                  uint32_t j, float* mean, int8_t* exponent) {
  const float mu = raw_mean(reduced, j, static_cast<float>(p.n_workers));
  const double key = key_of(reduced, j, p.n_workers);
  if (key < 0.0) {
    *mean = non_finite(mu) ? mu : f32_from_bits(0x7fc00000u);
    *exponent = 0;
    return key;
  }
  const bool subtract = p.mean_subtraction && supergroup_dense(reduced, j) && !non_finite(mu);
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
    const double key = supergroup_mean(p, reduced, j, &l.mean[j], &l.exponent[j]);
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
  for (size_t b = t; b < s.bytes / 8; b += nt) words[b] = 0;
  __syncthreads();
  if (t == 0) {
    l.header[0] = call;
    l.header[1] = p.count;
    l.header[2] = static_cast<uint32_t>(p.n_chunks) |
                  static_cast<uint64_t>(static_cast<uint32_t>(p.n_workers)) << 32;
  }
  const int shift = agree_means(p, l, reduced, scratch);  // every thread: the same
  // The width keys, computed once (the bisection reads them ~31 times): parked in by_index, which
  // phase 5 writes only after the widths are final (barriers between).
  for (uint32_t j = t; j < static_cast<uint32_t>(p.n_sg); j += nt) {
    const double key = key_of(reduced, j, p.n_workers);
    l.by_index[j] = key < 0.0 ? kPoisonedKey : f32_bits(width_key(key, shift));
  }
}

// 2a. Variable widths: the smallest threshold (bit pattern, monotone for non-negative floats)
// whose widths fit the budget; each step a block sum of record bytes (an integer sum: any order
// gives the host's total). Adds this thread's super-groups per class to `count`.
__device__ void layout_variable_widths(const DynamiqPlan& p, const LayoutPtrs& l,
                                       unsigned long long* scratch, uint32_t count[4]) {
  const uint32_t t = threadIdx.x, nt = blockDim.x, n_sg = static_cast<uint32_t>(p.n_sg);
  const unsigned long long budget = static_cast<unsigned long long>(p.stride) * p.n_chunks;
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
    l.width[j] = static_cast<uint8_t>(w);
    ++count[width_index(w)];
  }
}

// The widest width of {16, 8, 4} whose records fit the budget with `poisoned` super-groups at 2
// bits and the others at it; 2 if none.
__device__ int fixed_width(const DynamiqPlan& p, unsigned long long poisoned) {
  const unsigned long long budget = static_cast<unsigned long long>(p.stride) * p.n_chunks;
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
  for (uint32_t j = t; j < n_sg; j += nt) poisoned += l.by_index[j] == kPoisonedKey;
  const int fixed = fixed_width(p, block_reduce(poisoned, SumOp(), scratch));
  for (uint32_t j = t; j < n_sg; j += nt) {
    const int w = l.by_index[j] == kPoisonedKey ? 2 : fixed;
    l.width[j] = static_cast<uint8_t>(w);
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
    for (uint32_t cc = before + 1; cc <= c; ++cc) l.chunk_first[cc] = i;
  }
  if (t == 0) {
    l.chunk_first[0] = 0;
    const uint32_t last = n_sg > 0 ? chunk_of(k, n_sg - 1, stride, p.n_chunks) : 0u;
    for (uint32_t cc = last + 1; cc <= static_cast<uint32_t>(p.n_chunks); ++cc)
      l.chunk_first[cc] = n_sg;
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
    l.chunk_content[c] = wire_offset(k, l.chunk_first[c + 1]) - wire_offset(k, l.chunk_first[c]);
  uint32_t running[4] = {0, 0, 0, 0};                 // class members before this tile
  for (uint32_t tile = 0; tile < n_sg; tile += nt) {  // the same trips in every thread
    const uint32_t j = tile + t;
    const int w = j < n_sg ? width_index(l.width[j]) : -1;
    const unsigned long long one = w >= 0 ? 1ull << (16 * w) : 0ull;
    unsigned long long tile_total = 0;
    const unsigned long long before = block_exclusive_scan(one, scratch, &tile_total);
    if (w >= 0) {
      uint32_t prefix[4];  // class members before j
      for (int v = 0; v < 4; ++v)
        prefix[v] = running[v] + static_cast<uint32_t>((before >> (16 * v)) & 0xffffu);
      const uint32_t pos = k.start[w] + prefix[w];
      l.order[pos] = j;
      const uint32_t c = chunk_of(k, pos, stride, p.n_chunks);
      const uint32_t first = l.chunk_first[c], end = l.chunk_first[c + 1];
      l.offset[pos] = static_cast<uint32_t>(wire_offset(k, pos) - wire_offset(k, first));
      // Chunk c holds class v's ranks [lo, hi); those before j are [lo, clamp(prefix)).
      uint32_t rank = 0;
      for (int v = 0; v < 4; ++v) {
        const uint32_t lo = clamp_u32(first > k.start[v] ? first - k.start[v] : 0u, 0u, k.size[v]);
        const uint32_t hi = clamp_u32(end > k.start[v] ? end - k.start[v] : 0u, 0u, k.size[v]);
        rank += clamp_u32(prefix[v], lo, hi) - lo;
      }
      l.by_index[first + rank] = pos;
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
    if (lane == 0 && l.chunk_content[c] + kChunkHeaderBytes > p.capacity)
      atomicOr(error, kDynamiqChunkOverCapacity);
    uint32_t h = fnv1a_word(2166136261u, c);
    h = fnv1a_word(h, static_cast<uint32_t>(p.count));
    const uint32_t first = l.chunk_first[c], end = l.chunk_first[c + 1];
    for (uint32_t at = first; at < end; at += kWarp) {
      uint32_t word = 0, scale_word = 0;  // scale_word: 0 when the exponent is 0 (not hashed)
      if (at + lane < end) {
        const uint32_t j = l.order[at + lane];
        word = j * 32u + l.width[j] + (non_finite(l.mean[j]) ? 1u : 0u);
        if (l.exponent[j] != 0) scale_word = 0x100u | static_cast<uint8_t>(l.exponent[j]);
      }
      const uint32_t n = end - at < static_cast<uint32_t>(kWarp) ? end - at : kWarp;
      for (uint32_t k = 0; k < n; ++k) {
        const uint32_t a = __shfl_sync(kFullMask, word, static_cast<int>(k));
        const uint32_t b = __shfl_sync(kFullMask, scale_word, static_cast<int>(k));
        h = fnv1a_word(h, a);
        if (b != 0) h = fnv1a_word(h, b);
      }
    }
    if (lane == 0) l.chunk_check[c] = h;
  }
}

}  // namespace

#include "kernels/cuda/dynamiq_layout_grid.cuh"

__global__ void __launch_bounds__(kLayoutThreads)
    dynamiq_layout_kernel(DynamiqPlan p, DynamiqSections s, const uint16_t* reduced,
                          unsigned long long call, unsigned char* base, unsigned* error) {
  __shared__ unsigned long long scratch[kWarp + 1];
  // The lane failed before this step: the layout is left as it is. One block; its only flag is
  // raised after the last barrier, so every thread reads the word before anything of this launch
  // can change it: the same decision in the whole block, before any barrier.
  const StepFold fold(error);  // the step's only kernel (step_fold.h)
  if (step_failed(*error)) return;
  const LayoutPtrs l = layout_ptrs(s, base);
  layout_header_and_means(p, s, l, reduced, call, base, scratch);
  uint32_t count[4] = {0, 0, 0, 0};  // this thread's super-groups per class
  if (p.variable_widths)
    layout_variable_widths(p, l, scratch, count);
  else
    layout_fixed_widths(p, l, scratch, count);
  const Classes k = layout_classes(p, count, scratch);
  layout_chunk_cuts(p, k, l);
  layout_partition(p, k, l, scratch);
  layout_digests(p, l, error);
}

namespace {

// Layouts below this many super-groups stay in one block (their work is bounded by it).
constexpr unsigned long long kGridMinSupergroups = 4096;

// Whether the layout runs over the grid: large enough, its sections hold the grid path's scratch
// (mean: 6 words a block and the histograms; offset: the digest chain), its record sizes grow with
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

cudaError_t launch_dynamiq_layout(const DynamiqDeviceParams& params, const uint16_t* reduced_stats,
                                  uint64_t call, void* layout, unsigned* error,
                                  cudaStream_t stream) {
  const DynamiqPlan& p = params.plan;
  if (layout == nullptr || error == nullptr || p.n_chunks < 1 ||
      (p.n_sg > 0 && reduced_stats == nullptr))
    return cudaErrorInvalidValue;
  unsigned char* base = static_cast<unsigned char*>(layout);
  const DynamiqSections& s = params.sections;
  if (!layout_on_grid(p)) {
    DQ_LAUNCH(dynamiq_layout_kernel, dim3(1), dim3(kLayoutThreads), 0, stream, p, s, reduced_stats,
              static_cast<unsigned long long>(call), base, error);
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>((p.n_sg + kGridThreads - 1) / kGridThreads));
  const dim3 block(kGridThreads);
  cudaError_t e = cudaSuccess;
  DQ_LAUNCH(layout_extent_kernel, grid, block, 0, stream, p, s, reduced_stats, base, error);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  DQ_LAUNCH(layout_breakpoints_kernel, grid, block, 0, stream, p, s, reduced_stats, base, error);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  for (int level = 1; level < 3; ++level) {
    DQ_LAUNCH(layout_digit_kernel, grid, block, 0, stream, p, s, base, error, level);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  DQ_LAUNCH(layout_widths_kernel, grid, block, 0, stream, p, s, base, error);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  DQ_LAUNCH(layout_partition_kernel, grid, block, 0, stream, p, s, base, error);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  const dim3 digest_grid(grid.x + static_cast<unsigned>(p.n_chunks));
  DQ_LAUNCH(layout_digest_finish_kernel, digest_grid, block, 0, stream, p, s, reduced_stats,
            static_cast<unsigned long long>(call), base, error);
  return cudaGetLastError();
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
