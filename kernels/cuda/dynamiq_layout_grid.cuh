// The layout over the whole grid (included by kernels/cuda/dynamiq_layout.cu, whose helpers it
// uses): the same bytes as the one-block kernel, for layouts large enough that one block would
// hold up the call. Blocks of kGridThreads threads, one super-group per thread (block b: super-
// groups [256 b, 256 b + 256)), seven kernels in stream order, no grid-wide barrier (no block
// ever waits for one that may not have started: NCCL's kernels may hold SMs meanwhile):
//  1. extent:      per block, the largest key magnitude and the poisoned count; the last block
//                  done (a ticket) reduces them to the layout's, so a later block reads one word
//                  where it would read one a block (O(blocks) bytes a layout, not O(blocks^2));
//  2. breakpoints: the width keys (the shift from the layout's maximum) and, per super-group
//                  and width w in {4, 8, 16}, b_w: how many thresholds theta (bit patterns
//                  0 .. 0x7f800000) give it at least w bits (the host's width_class() is monotone
//                  in theta, so those thresholds are 0 .. b_w - 1). The record bytes at theta are
//                  then n_sg rec2 + sum of (rec4 - rec2) [b4 > theta] + (rec8 - rec4) [b8 > theta]
//                  + (rec16 - rec8) [b16 > theta] (integers: the host's total), and the host's
//                  bisection result is the smallest theta whose bytes fit (the bytes never grow
//                  with theta). A radix select finds it: digits of 11, 11 and 10 bits, each a
//                  histogram of the breakpoints' weights (shared memory, then one atomic per bin
//                  and block); the first digit's histogram here, from which the last block done
//                  (a ticket) picks the first digit (a block scan of the 2048 bins) and writes
//                  the prefix so far (its bits, whether found, the bytes no later digit changes:
//                  the pick words, 16 bytes);
//  3-4. digits:    the next digits' histograms, over the breakpoints under the prefix the pick
//                  words hold (one read a block, not the histograms before); the last block done
//                  picks the level's digit and writes the longer prefix;
//  5. widths:      theta (the pick words), each super-group's width from its breakpoints, per
//                  block class counts, which the last block done (a ticket) scans into sums over
//                  the blocks up to each (blocks / 256 steps of a block scan, in place);
//  6. partition:   each super-group's wire position (its class's start, the blocks before it,
//                  its rank in its block), order, by_index, chunk_first (closed forms of the
//                  one-block kernel; a chunk's first position by binary search);
//  7. digests:     FNV-1a is a chain, but the hash after a run of bytes is T(h) = h P^n + G(h mod
//                  256) (an xor with a byte changes only the low byte, and the low byte of a
//                  product depends only on the low bytes): each block takes a segment of 256
//                  records of one chunk, its 256 threads run the segment from each low byte x
//                  (T(x), and T(x + 256) - T(x) = 256 P^n), and only the lookup T(h) = T(h mod
//                  256) + (h / 256) 256 P^n is chained, block to block (a ticket orders the
//                  segments by when their blocks started, so a block waits only for blocks that
//                  run); the means and exponents of the segment's super-groups; then, in the
//                  same kernel (it needs only the partition's results), the finish: the class
//                  starts (a block search: widths fall along the wire order), the record offsets,
//                  chunk contents and the capacity check, the header and the padding; the offsets
//                  whose words hold the chain are written by the last block done (a ticket).
// A launch builds every grid layout of a batch: its grid is their blocks one after the other
// (each layout's grid_blocks(), its chunks too in the digest kernel), and each block finds its
// layout from blockIdx.x in the batch's table (a binary search over the layouts' first blocks).
// Everything shared between blocks (scratch, tickets, the digest chain) is the layout's own, so a
// block still waits only for a block of its layout that took an earlier ticket; a ticket's last
// holder alone carries on, and no block waits for it. The tickets start at 0 in every build: the
// histogram kernels' and the widths kernel's (words of the exponent section) and the digest
// kernel's (the chain's) are zeroed by an earlier kernel of the build; the extent kernel's, which
// no kernel precedes, is a word of the layout's table entry, 0 from the host and put back to 0 by
// the launch's last block (every block takes it, a block whose lane failed too).
// Scratch lives in the layout's own sections until they are written: the per-block values and the
// histograms in the mean section (written in 7), the breakpoints in order, offset and by_index
// (written in 6 and 7), the tickets of the histogram and widths kernels (words 0-3) and the pick
// words (4-7: each histogram kernel's last block writes them after every block of its kernel has
// read them, the widths kernel reads them last) in the exponent section (written in 7), the digest
// chain in the offset section (written in 7, its first words last).

namespace {

constexpr int kGridThreads = 256;
constexpr uint32_t kDigitBins = 2048;
constexpr uint32_t kNoDigit = 0xffffffffu;
// A digest block's wait for the block before it, in polls: far longer than a block runs; past it
// the layout is flagged (the host's kInternal) rather than the stream hung.
constexpr uint32_t kMaxChainPolls = 1u << 26;

// Digit `level` (0: bits 31..21, 1: bits 20..10, 2: bits 9..0) of v, and the bits above it.
__device__ __forceinline__ uint32_t digit_of(uint32_t v, int level) {
  return level == 0 ? v >> 21 : level == 1 ? (v >> 10) & 0x7ffu : v & 0x3ffu;
}
__device__ __forceinline__ uint32_t above_digit(uint32_t v, int level) {
  return level == 0 ? 0u : level == 1 ? v >> 21 : v >> 10;
}

struct GridScratch {
  uint32_t* largest;          // [blocks] the block's largest key_magnitude(); after the extent
                              // kernel, word 0: the layout's                      (mean section)
  uint32_t* poisoned;         // [blocks] the block's poisoned super-groups; after it, word 0:
                              // the layout's                                      (mean)
  uint32_t* hist;             // [3][kDigitBins] the digits' histograms            (mean)
  uint32_t* counts;           // [blocks][4] the block's super-groups per class; after the widths
                              // kernel, those of the blocks up to it (inclusive)  (mean)
  uint32_t* b4;               // [n_sg] breakpoints                                 (order)
  uint32_t* b8;               //                                                    (offset)
  uint32_t* b16;              //                                                    (by_index)
  unsigned long long* chain;  // [segments + 2] digests so far (bit 32: set), then two tickets
  uint32_t* hist_done;        // [3] the histogram kernels' tickets (levels 0-2)  (exponent)
  uint32_t* widths_done;      // the widths kernel's ticket                        (exponent)
  uint32_t* picked;           // [4] the radix select's prefix so far (Picked)     (exponent)
};

// The radix select's prefix after the digits picked so far, as the last block of each histogram
// kernel leaves it in the pick words: the digits' bits, whether every digit was found (0: no
// threshold fits, and no later digit is picked), the record bytes no later digit changes (two
// words, low first). A later block reads these 16 bytes, not the histograms before its level.
struct Picked {
  uint32_t bits, found;
  unsigned long long fixed;
};

__device__ __forceinline__ uint32_t grid_blocks(const DynamiqPlan& p) {
  return static_cast<uint32_t>((p.n_sg + kGridThreads - 1) / kGridThreads);
}

__device__ __forceinline__ GridScratch grid_scratch(const DynamiqPlan& p, const LayoutPtrs& l) {
  const uint32_t blocks = grid_blocks(p);
  uint32_t* m = reinterpret_cast<uint32_t*>(l.mean);
  uint32_t* e = reinterpret_cast<uint32_t*>(l.exponent);  // words 0-2, 3, 4-7 (n_sg >= 4096 bytes)
  return GridScratch{
      m,       m + blocks, m + 2 * blocks, m + 2 * blocks + 3 * kDigitBins,
      l.order, l.offset,   l.by_index,     reinterpret_cast<unsigned long long*>(l.offset),
      e,       e + 3,      e + 4};
}

// A block of a batched launch: its layout, its index among that layout's blocks and their number.
struct GridBlock {
  const LayoutTableJob* job;
  uint32_t block, blocks;
  uint32_t index;  // the layout's among the jobs
};

// This block's layout among the n_jobs > 0 grid layouts `jobs` (their first blocks ascending):
// the last whose first block is at or before blockIdx.x, copied into the shared words
// `job_words` (kJobWords of them; the result's job points there, so its fields are read from
// shared memory, not global). `digest`: the digest kernel's grid. Collective (ends with a
// barrier).
__device__ __forceinline__ GridBlock grid_block(const LayoutTableJob* jobs, uint32_t n_jobs,
                                                bool digest, unsigned long long* job_words) {
  const uint32_t b = blockIdx.x;
  uint32_t lo = 0, hi = n_jobs - 1;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo + 1) / 2;
    const uint32_t first = load_global(digest ? &jobs[mid].first_digest : &jobs[mid].first_block);
    if (first <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  const LayoutTableJob* job = &stage_job(jobs + lo, job_words);
  const uint32_t blocks = grid_blocks(job->plan);
  return digest ? GridBlock{job, b - job->first_digest,
                            blocks + static_cast<uint32_t>(job->plan.n_chunks), lo}
                : GridBlock{job, b - job->first_block, blocks, lo};
}

__device__ __forceinline__ LayoutPtrs job_ptrs(const LayoutTableJob& job) {
  return layout_ptrs(job.sections, job.base);
}

// Flags that do not stop the sequence: the capacity flag, which this launch sequence raises
// itself, and a step word's kFoldFlag (step_fold.h), which no kernel raises.
constexpr unsigned kGridPassFlags = static_cast<unsigned>(kDynamiqChunkOverCapacity) | kFoldFlag;

// One decision per block: the lane failed before this step, or an earlier kernel of it did.
__device__ __forceinline__ bool grid_block_skips(const unsigned* error, unsigned* flag) {
  if (threadIdx.x == 0) *flag = (load_global_relaxed(error) & ~kGridPassFlags) != 0u;
  __syncthreads();
  return *flag != 0u;
}

// The thresholds 0 .. result - 1 give the super-group at least w bits.
__device__ uint32_t breakpoint(bool poisoned, float f, int w, bool allow_width16) {
  uint32_t lo = 0, hi = 0x7f800001u;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (width_for(poisoned, f, f32_from_bits(mid), allow_width16) >= w)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Adds super-group j's breakpoints whose digits above `level` are `above` to the block's bins.
__device__ __forceinline__ void bin_breakpoints(const DynamiqPlan& p, const GridScratch& g,
                                                uint32_t j, int level, uint32_t above,
                                                uint32_t* bins) {
  const uint32_t b[3] = {load_global(g.b4 + j), load_global(g.b8 + j), load_global(g.b16 + j)};
  for (int w = 0; w < 3; ++w)
    if (b[w] > 0 && above_digit(b[w], level) == above)
      atomicAdd(&bins[digit_of(b[w], level)], static_cast<uint32_t>(p.record[w + 1] - p.record[w]));
}

// The block's bins added to the histogram of `level` (one atomic per non-empty bin). Starts with
// a barrier.
__device__ __forceinline__ void publish_bins(const GridScratch& g, int level,
                                             const uint32_t* bins) {
  __syncthreads();
  for (uint32_t k = threadIdx.x; k < kDigitBins; k += blockDim.x)
    if (bins[k] != 0) atomic_add_global(g.hist + level * kDigitBins + k, bins[k]);
}

// The smallest digit d of histogram h with *fixed + (the weights of the digits above d) <= budget,
// or kNoDigit; *fixed then gains those weights. `fixed`: the record bytes no later digit changes.
__device__ uint32_t pick_digit(const uint32_t* h, unsigned long long budget,
                               unsigned long long* fixed, unsigned long long* scratch) {
  const uint32_t per = kDigitBins / blockDim.x, first = threadIdx.x * per;
  unsigned long long own = 0;
  for (uint32_t i = 0; i < per; ++i) own += load_global(h + first + i);
  unsigned long long total = 0;
  unsigned long long upto = block_exclusive_scan(own, scratch, &total);
  unsigned long long own_best = kNoDigit,
                     own_above = 0;  // the smallest such digit of this thread's
  for (uint32_t i = 0; i < per; ++i) {
    upto += load_global(h + first + i);
    if (own_best == kNoDigit && *fixed + (total - upto) <= budget) {
      own_best = first + i;
      own_above = total - upto;
    }
  }
  const unsigned long long best = block_reduce(own_best, MinOp(), scratch);
  if (best == kNoDigit) return kNoDigit;  // the same in every thread
  // The thread whose digits hold the smallest one adds its weights above.
  *fixed += block_reduce(own_best == best ? own_above : 0ull, SumOp(), scratch);
  return static_cast<uint32_t>(best);
}

// Whether this block is the last of the layout's `blocks` to take the ticket `word` (a ticket taken
// after a fence: the last holder sees every other block's writes before theirs, and no block
// waits). `reset`: the last puts the word back to 0. Collective (barriers).
__device__ __forceinline__ bool last_to_finish(uint32_t* word, uint32_t blocks, bool reset,
                                               unsigned* last) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    *last = atomic_add_global(word, 1u) + 1 == blocks ? 1u : 0u;
    if (*last != 0) {
      if (reset) store_global(word, 0u);
      __threadfence();
    }
  }
  __syncthreads();
  return *last != 0;
}

// The radix select's prefix (the pick words), read by thread 0 into `shared` and returned to every
// thread. Collective (ends with a barrier).
__device__ __forceinline__ Picked read_picked(const GridScratch& g, Picked* shared) {
  if (threadIdx.x == 0) {
    shared->bits = load_global(g.picked);
    shared->found = load_global(g.picked + 1);
    shared->fixed = load_global(g.picked + 2) |
                    static_cast<unsigned long long>(load_global(g.picked + 3)) << 32;
  }
  __syncthreads();
  return *shared;
}

// The last block of histogram kernel `level`: the level's digit picked from its histogram after
// `above` (the prefix of the digits before it, every one found), the new prefix written to the
// pick words (not found: the host's bisection ends at 0x7f800000, and no later kernel picks).
// Collective.
__device__ void pick_level(const DynamiqPlan& p, const GridScratch& g, int level, Picked above,
                           unsigned long long* scratch) {
  const unsigned long long budget = dynamiq_record_budget(p);
  const uint32_t digit = pick_digit(g.hist + level * kDigitBins, budget, &above.fixed, scratch);
  if (threadIdx.x != 0) return;
  const uint32_t bits = above.bits << (level == 2 ? 10 : 11);  // digits of 11, 11 and 10 bits
  store_global(g.picked, digit == kNoDigit ? bits : bits | digit);
  store_global(g.picked + 1, digit == kNoDigit ? 0u : 1u);
  store_global(g.picked + 2, static_cast<uint32_t>(above.fixed));
  store_global(g.picked + 3, static_cast<uint32_t>(above.fixed >> 32));
}

// The last extent block's reduction of the blocks' largest keys and poisoned counts into word 0 of
// each, so a block of the next kernels reads one word, not one a block. Collective.
__device__ void reduce_extents(const GridScratch& g, uint32_t blocks, unsigned long long* scratch) {
  unsigned long long largest = 0, poisoned = 0;
  for (uint32_t b = threadIdx.x; b < blocks; b += blockDim.x) {
    const unsigned long long v = load_global(g.largest + b);
    largest = v > largest ? v : largest;
    poisoned += load_global(g.poisoned + b);
  }
  largest = block_reduce(largest, MaxOp(), scratch);  // ends with a barrier: the reads are done
  poisoned = block_reduce(poisoned, SumOp(), scratch);
  if (threadIdx.x == 0) {
    store_global(g.largest, static_cast<uint32_t>(largest));
    store_global(g.poisoned, static_cast<uint32_t>(poisoned));  // below n_sg < 2^32
  }
}

// The last widths block's scan: each block's class counts replaced, in place, by those of the
// blocks up to it, blockDim.x blocks a step (32-bit halves of two classes a word: the sums are
// below n_sg < 2^32). Collective.
__device__ void scan_class_counts(const GridScratch& g, uint32_t blocks,
                                  unsigned long long* scratch) {
  unsigned long long carry[2] = {0, 0};
  for (uint32_t first = 0; first < blocks; first += blockDim.x) {  // the same in every thread
    const uint32_t b = first + threadIdx.x;
    for (int h = 0; h < 2; ++h) {
      uint32_t* at = g.counts + 4 * b + 2 * h;
      const unsigned long long v =
          b < blocks ? load_global(at) | static_cast<unsigned long long>(load_global(at + 1)) << 32
                     : 0ull;
      unsigned long long step_total = 0;
      const unsigned long long upto = carry[h] + block_exclusive_scan(v, scratch, &step_total) + v;
      if (b < blocks) {
        store_global(at, static_cast<uint32_t>(upto));
        store_global(at + 1, static_cast<uint32_t>(upto >> 32));
      }
      carry[h] += step_total;
    }
  }
}

// Block gb's largest key and poisoned count; the histograms and the tickets of the histogram and
// widths kernels zeroed (the layout's blocks share them out). Collective.
__device__ __forceinline__ void extent_of_block(const GridBlock& gb, unsigned long long* scratch) {
  const DynamiqPlan& p = gb.job->plan;
  const uint16_t* reduced = gb.job->reduced;
  const GridScratch g = grid_scratch(p, job_ptrs(*gb.job));
  const uint32_t j = gb.block * kGridThreads + threadIdx.x;
  unsigned long long largest = 0, poisoned = 0;
  if (j < p.n_sg) {
    const double key = key_of(p, reduced, j);
    largest = key_magnitude(key);
    poisoned = key < 0.0 ? 1 : 0;
  }
  largest = block_reduce(largest, MaxOp(), scratch);
  poisoned = block_reduce(poisoned, SumOp(), scratch);
  if (threadIdx.x == 0) {
    store_global(g.largest + gb.block, static_cast<uint32_t>(largest));
    store_global(g.poisoned + gb.block, static_cast<uint32_t>(poisoned));
  }
  for (uint32_t k = gb.block * blockDim.x + threadIdx.x; k < 3 * kDigitBins;
       k += gb.blocks * blockDim.x)
    store_global(g.hist + k, 0u);
  if (gb.block == 0 && threadIdx.x < 4) store_global(g.hist_done + threadIdx.x, 0u);  // widths' too
}

}  // namespace

// Every block takes the layout's ticket in the table, one whose lane failed too (so the word is
// back to 0 at every launch's end); the last reduces the blocks' extents.
__global__ void __launch_bounds__(kGridThreads)
    layout_extent_kernel(LayoutTableJob* jobs, uint32_t n_jobs, unsigned* error) {
  __shared__ unsigned long long scratch[kWarp + 1];
  __shared__ unsigned long long job_words[kJobWords];
  __shared__ unsigned skip, last;
  const GridBlock gb = grid_block(jobs, n_jobs, false, job_words);
  const bool skips = grid_block_skips(error, &skip);
  if (!skips) extent_of_block(gb, scratch);
  if (last_to_finish(&jobs[gb.index].extent_done, gb.blocks, true, &last) && !skips)
    reduce_extents(grid_scratch(gb.job->plan, job_ptrs(*gb.job)), gb.blocks, scratch);
}

__global__ void __launch_bounds__(kGridThreads)
    layout_breakpoints_kernel(const LayoutTableJob* jobs, uint32_t n_jobs, unsigned* error) {
  __shared__ unsigned long long scratch[kWarp + 1];
  __shared__ uint32_t bins[kDigitBins];
  __shared__ unsigned long long job_words[kJobWords];
  __shared__ unsigned skip, last;
  if (grid_block_skips(error, &skip)) return;
  const GridBlock gb = grid_block(jobs, n_jobs, false, job_words);
  const DynamiqPlan& p = gb.job->plan;
  const uint16_t* reduced = gb.job->reduced;
  const GridScratch g = grid_scratch(p, job_ptrs(*gb.job));
  // The layout's largest key (the extent kernel's last block put it in word 0), to every thread.
  const unsigned long long largest = threadIdx.x == 0 ? load_global(g.largest) : 0ull;
  const int shift = shift_of(block_reduce(largest, MaxOp(), scratch));
  for (uint32_t k = threadIdx.x; k < kDigitBins; k += blockDim.x) bins[k] = 0;
  __syncthreads();
  const uint32_t j = gb.block * kGridThreads + threadIdx.x;
  if (j < p.n_sg) {
    const double key = key_of(p, reduced, j);
    const float f = width_key(key, shift);
    store_global(g.b4 + j, breakpoint(key < 0.0, f, 4, p.allow_width16));
    store_global(g.b8 + j, breakpoint(key < 0.0, f, 8, p.allow_width16));
    store_global(g.b16 + j, breakpoint(key < 0.0, f, 16, p.allow_width16));
    if (p.variable_widths) bin_breakpoints(p, g, j, 0, 0u, bins);
  }
  if (!p.variable_widths) return;  // the same in every block of the layout
  publish_bins(g, 0, bins);
  // The last block done picks the first digit (the tickets were zeroed by the extent kernel).
  if (last_to_finish(g.hist_done, gb.blocks, false, &last))
    pick_level(p, g, 0, Picked{0u, 1u, static_cast<unsigned long long>(p.n_sg) * p.record[0]},
               scratch);
}

__global__ void __launch_bounds__(kGridThreads)
    layout_digit_kernel(const LayoutTableJob* jobs, uint32_t n_jobs, unsigned* error, int level) {
  __shared__ unsigned long long scratch[kWarp + 1];
  __shared__ uint32_t bins[kDigitBins];
  __shared__ unsigned long long job_words[kJobWords];
  __shared__ Picked picked;
  __shared__ unsigned skip, last;
  if (grid_block_skips(error, &skip)) return;
  const GridBlock gb = grid_block(jobs, n_jobs, false, job_words);
  const DynamiqPlan& p = gb.job->plan;
  if (!p.variable_widths) return;  // the same in every block of the layout
  const GridScratch g = grid_scratch(p, job_ptrs(*gb.job));
  // The digits before this level, as the previous kernel's last block picked them.
  const Picked above = read_picked(g, &picked);
  if (above.found == 0) return;  // the same in every block of the layout
  for (uint32_t k = threadIdx.x; k < kDigitBins; k += blockDim.x) bins[k] = 0;
  __syncthreads();
  const uint32_t j = gb.block * kGridThreads + threadIdx.x;
  if (j < p.n_sg) bin_breakpoints(p, g, j, level, above.bits, bins);
  publish_bins(g, level, bins);
  // The last block done picks this level's digit: every block has read the pick words by then.
  if (last_to_finish(g.hist_done + level, gb.blocks, false, &last))
    pick_level(p, g, level, above, scratch);
}

__global__ void __launch_bounds__(kGridThreads)
    layout_widths_kernel(const LayoutTableJob* jobs, uint32_t n_jobs, unsigned* error) {
  __shared__ unsigned long long scratch[kWarp + 1];
  __shared__ unsigned long long job_words[kJobWords];
  __shared__ Picked picked;
  __shared__ unsigned skip, last;
  if (grid_block_skips(error, &skip)) return;
  const GridBlock gb = grid_block(jobs, n_jobs, false, job_words);
  const DynamiqPlan& p = gb.job->plan;
  const LayoutPtrs l = job_ptrs(*gb.job);
  const GridScratch g = grid_scratch(p, l);
  uint32_t theta = 0x7f800000u;  // variable widths: the threshold's bit pattern
  int fixed = 2;                 // fixed widths: the width of the finite super-groups
  if (p.variable_widths) {
    // The three digits, as the last digit kernel's last block left them.
    const Picked all = read_picked(g, &picked);
    if (all.found != 0) theta = all.bits < theta ? all.bits : theta;
  } else {
    // The layout's poisoned count (word 0, as the largest key), to every thread.
    const unsigned long long poisoned = threadIdx.x == 0 ? load_global(g.poisoned) : 0ull;
    fixed = fixed_width(p, block_reduce(poisoned, SumOp(), scratch));
  }
  const uint32_t j = gb.block * kGridThreads + threadIdx.x;
  unsigned long long one = 0;  // one-hot class count, 16 bits per class
  if (j < p.n_sg) {
    int w;
    if (p.variable_widths)
      w = theta < load_global(g.b16 + j)  ? 16
          : theta < load_global(g.b8 + j) ? 8
          : theta < load_global(g.b4 + j) ? 4
                                          : 2;
    else
      w = load_global(g.b4 + j) == 0 ? 2 : fixed;  // no threshold gives a poisoned one 4 bits
    store_global(l.width + j, static_cast<uint8_t>(w));
    one = 1ull << (16 * width_index(w));
  }
  one = block_reduce(one, SumOp(), scratch);
  if (threadIdx.x < 4)
    store_global(g.counts + 4 * gb.block + threadIdx.x,
                 static_cast<uint32_t>((one >> (16 * threadIdx.x)) & 0xffffu));
  // The last block done turns the counts into sums over the blocks up to each (the ticket was
  // zeroed by the extent kernel; a block that skipped leaves the layout to no later kernel).
  if (last_to_finish(g.widths_done, gb.blocks, false, &last))
    scan_class_counts(g, gb.blocks, scratch);
}

namespace {

// The first wire position of chunk c (the host's cut_chunks, empty chunks included): the first
// position whose chunk_of() is at least c, n_sg if none.
__device__ uint32_t chunk_start(const DynamiqPlan& p, const Classes& k, uint32_t c) {
  const uint32_t n_sg = static_cast<uint32_t>(p.n_sg);
  if (c == 0) return 0;
  if (c >= static_cast<uint32_t>(p.n_chunks)) return n_sg;
  uint32_t lo = 0, hi = n_sg;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (chunk_of(k, mid, p.stride, p.n_chunks) >= c)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

__device__ __forceinline__ Classes classes_of(const DynamiqPlan& p, const uint32_t size[4]) {
  Classes k;
  for (int w = 0; w < 4; ++w) {
    k.size[w] = size[w];
    k.record[w] = p.record[w];
  }
  k.start[3] = 0;
  k.start[2] = k.size[3];
  k.start[1] = k.start[2] + k.size[2];
  k.start[0] = k.start[1] + k.size[1];
  return k;
}

// Words of the digest chain: one per digest block, then the segments' ticket, then the ticket of
// the blocks done (kernels/cuda/dynamiq_layout.cu's layout_on_grid() checks they fit).
__device__ __forceinline__ uint32_t chain_words(const DynamiqPlan& p) {
  return grid_blocks(p) + static_cast<uint32_t>(p.n_chunks) + 2;
}

}  // namespace

__global__ void __launch_bounds__(kGridThreads)
    layout_partition_kernel(const LayoutTableJob* jobs, uint32_t n_jobs, unsigned* error) {
  __shared__ unsigned long long scratch[kWarp + 1];
  __shared__ uint32_t sums[8];  // the classes' sizes, then the blocks before this one's
  __shared__ unsigned long long job_words[kJobWords];
  __shared__ unsigned skip;
  if (grid_block_skips(error, &skip)) return;
  const GridBlock gb = grid_block(jobs, n_jobs, false, job_words);
  const DynamiqPlan& p = gb.job->plan;
  const LayoutPtrs l = job_ptrs(*gb.job);
  const GridScratch g = grid_scratch(p, l);
  // The classes' sizes (the last block's sums) and this block's class prefix (the block before's),
  // eight words read by eight threads.
  if (threadIdx.x < 8) {
    const uint32_t v = threadIdx.x & 3u, from = threadIdx.x < 4 ? gb.blocks : gb.block;
    sums[threadIdx.x] = from > 0 ? load_global(g.counts + 4 * (from - 1) + v) : 0u;
  }
  __syncthreads();
  uint32_t size[4], prefix[4];
  for (int v = 0; v < 4; ++v) {
    size[v] = sums[v];
    prefix[v] = sums[4 + v];
  }
  const Classes k = classes_of(p, size);
  const uint32_t j = gb.block * kGridThreads + threadIdx.x;
  const int w = j < p.n_sg ? width_index(load_global(l.width + j)) : -1;
  const unsigned long long in_block = block_exclusive_scan(
      w >= 0 ? 1ull << (16 * w) : 0ull, scratch, static_cast<unsigned long long*>(nullptr));
  if (w >= 0) {
    for (int v = 0; v < 4; ++v)
      prefix[v] += static_cast<uint32_t>((in_block >> (16 * v)) & 0xffffu);  // before j
    const uint32_t pos = k.start[w] + prefix[w];
    store_global(l.order + pos, j);
    const uint32_t c = chunk_of(k, pos, p.stride, p.n_chunks);
    const uint32_t first = chunk_start(p, k, c), end = chunk_start(p, k, c + 1);
    uint32_t rank = 0;  // chunk c holds class v's ranks [lo, hi); those before j: [lo, prefix)
    for (int v = 0; v < 4; ++v) {
      const uint32_t lo = clamp_u32(first > k.start[v] ? first - k.start[v] : 0u, 0u, k.size[v]);
      const uint32_t hi = clamp_u32(end > k.start[v] ? end - k.start[v] : 0u, 0u, k.size[v]);
      rank += clamp_u32(prefix[v], lo, hi) - lo;
    }
    store_global(l.by_index + first + rank, pos);
  }
  const uint32_t at = gb.block * blockDim.x + threadIdx.x, step = gb.blocks * blockDim.x;
  for (uint32_t c = at; c <= static_cast<uint32_t>(p.n_chunks); c += step)
    store_global(l.chunk_first + c, chunk_start(p, k, c));
  for (uint32_t i = at; i < chain_words(p); i += step) store_global(g.chain + i, 0ull);
}

namespace {

// The digest chain's value before segment `seg` (its chunk's earlier segments), waited for.
__device__ __forceinline__ uint32_t chain_before(const GridScratch& g, uint32_t seg,
                                                 unsigned* error) {
  const unsigned long long* word = g.chain + seg - 1;
  const unsigned* flags = error;
  for (uint32_t poll = 0; poll < kMaxChainPolls; ++poll) {
    const unsigned long long v = load_global_relaxed(word);
    if ((v >> 32) != 0) return static_cast<uint32_t>(v);
    if ((load_global_relaxed(flags) & ~kGridPassFlags) != 0u) return 0;
    poll_missed();  // the emulator: a fault now, not 2^26 polls on a block that cannot run
  }
  atomic_or_global(error, static_cast<unsigned>(
                              kDynamiqChunkOverCapacity));  // never seen: a block that never ran
  return 0;
}

struct Segment {
  uint32_t seg, chunk, first, end, last;  // positions [first, end); last: the chunk's last segment
};

// The segment of this block's ticket; chunk = n_chunks: none (the grid has spare blocks).
__device__ __forceinline__ Segment take_segment(const DynamiqPlan& p, const LayoutPtrs& l,
                                                const GridScratch& g) {
  Segment s{0, static_cast<uint32_t>(p.n_chunks), 0, 0, 0};
  s.seg = static_cast<uint32_t>(atomic_add_global(g.chain + chain_words(p) - 2, 1ull));
  uint32_t before = 0;
  for (uint32_t c = 0; c < static_cast<uint32_t>(p.n_chunks); ++c) {
    const uint32_t first = load_global(l.chunk_first + c), end = load_global(l.chunk_first + c + 1);
    const uint32_t n = end > first ? (end - first + kGridThreads - 1) / kGridThreads : 1u;
    if (s.seg < before + n) {
      s.chunk = c;
      s.first = first + (s.seg - before) * kGridThreads;
      s.end = s.first + kGridThreads < end ? s.first + kGridThreads : end;
      s.last = s.end == end ? 1u : 0u;  // an empty chunk: one segment, [first, first)
      return s;
    }
    before += n;
  }
  return s;
}

// Segment sg's digest (collective: every thread of the block calls it): the means and exponents
// of its super-groups, its run of the hash from each low byte, then (thread 0) the chain.
__device__ __forceinline__ void digest_segment(const DynamiqPlan& p, const LayoutPtrs& l,
                                               const GridScratch& g, const uint16_t* reduced,
                                               const Segment& sg, unsigned* error, uint32_t* words,
                                               uint32_t* scale_words, uint32_t* table,
                                               uint32_t* step_raw) {
  const uint32_t t = threadIdx.x, n = sg.end - sg.first;
  if (t < n) {
    const uint32_t j = load_global(l.order + sg.first + t);
    float mean;
    int8_t e;
    supergroup_mean(p, reduced, j, &mean, &e);
    store_global(l.mean + j, mean);
    store_global(l.exponent + j, e);
    words[t] = j * 32u + load_global(l.width + j) + (non_finite(mean) ? 1u : 0u);
    scale_words[t] = e != 0 ? 0x100u | static_cast<uint8_t>(e) : 0u;  // 0: not hashed
  }
  __syncthreads();
  uint32_t h = t, h_next = t + 256u;  // the segment run from low byte t (and t + 256)
  for (uint32_t i = 0; i < n; ++i) {
    h = fnv1a_word(h, words[i]);
    h_next = fnv1a_word(h_next, words[i]);
    if (scale_words[i] != 0) {
      h = fnv1a_word(h, scale_words[i]);
      h_next = fnv1a_word(h_next, scale_words[i]);
    }
  }
  table[t] = h;
  if (t == 0) *step_raw = h_next - h;
  __syncthreads();
  if (t != 0) return;
  uint32_t in;
  if (sg.first == load_global(l.chunk_first + sg.chunk)) {
    in = fnv1a_word(2166136261u, sg.chunk);
    in = fnv1a_word(in, static_cast<uint32_t>(p.count));
  } else {
    in = chain_before(g, sg.seg, error);
  }
  const uint32_t out = table[in & 0xffu] + (in >> 8) * *step_raw;
  if (sg.last != 0) store_global(l.chunk_check + sg.chunk, out);
  __threadfence();
#if DQ_CUDA_EMULATED
  ::dq::emu::count_global_read(8);  // an exchange: one read and one write of the word
  ::dq::emu::count_global_written(8);
#endif
  atomicExch(&g.chain[sg.seg], (1ull << 32) | out);
}

}  // namespace

namespace {

// The first position i in [lo, hi) with pred(i) (pred false then true along the positions), hi if
// none: each round every thread tests one of blockDim.x evenly spaced positions. Collective.
template <class Pred>
__device__ uint32_t block_lower_bound(uint32_t lo, uint32_t hi, Pred pred,
                                      unsigned long long* scratch) {
  while (lo < hi) {  // the same in every thread
    const uint32_t step = (hi - lo + blockDim.x - 1) / blockDim.x;
    const uint32_t i = lo + threadIdx.x * step;
    const unsigned long long probe = i < hi && pred(i) ? i : hi;
    const uint32_t f = static_cast<uint32_t>(block_reduce(probe, MinOp(), scratch));
    if (step == 1) return f;
    // The probe before f was false (or f is lo): the answer lies in (f - step, f].
    lo = f >= lo + step ? f - step + 1 : lo;
    hi = f;
  }
  return hi;
}

// Writes the zero bytes after a section of `bytes` bytes at `at` (its padding to 8 bytes).
__device__ __forceinline__ void zero_padding(unsigned char* base, size_t at, size_t bytes) {
  for (size_t b = at + bytes; b % 8 != 0; ++b) store_global<unsigned char>(base + b, 0);
}

// The classes, from the widths along the wire order: class w starts where the wider ones end.
// Collective.
__device__ __forceinline__ Classes wire_classes(const DynamiqPlan& p, const LayoutPtrs& l,
                                                unsigned long long* scratch) {
  const uint32_t n_sg = static_cast<uint32_t>(p.n_sg);
  uint32_t start[4], size[4];
  start[3] = 0;
  for (int w = 2; w >= 0; --w) {
    const int wider = w == 2 ? 16 : w == 1 ? 8 : 4;
    start[w] = block_lower_bound(
        start[w + 1], n_sg,
        [&](uint32_t i) { return load_global(l.width + load_global(l.order + i)) < wider; },
        scratch);
  }
  for (int w = 3; w >= 0; --w) size[w] = (w == 0 ? n_sg : start[w - 1]) - start[w];
  return classes_of(p, size);
}

// Record offsets within their chunks of the wire positions [from, to) this thread takes (`at`,
// then every `step`-th).
__device__ __forceinline__ void write_offsets(const DynamiqPlan& p, const LayoutPtrs& l,
                                              const Classes& k, uint32_t from, uint32_t to,
                                              uint32_t at, uint32_t step) {
  for (uint32_t i = from + at; i < to; i += step) {
    const uint32_t first = load_global(l.chunk_first + chunk_of(k, i, p.stride, p.n_chunks));
    store_global(l.offset + i, static_cast<uint32_t>(wire_offset(k, i) - wire_offset(k, first)));
  }
}

// The finish of the layout: chunk contents and the capacity check, the header, the padding (the
// layout's blocks share them out: this thread takes `at`, then every `step`-th).
__device__ __forceinline__ void finish_layout(const DynamiqPlan& p, const DynamiqSections& s,
                                              const LayoutPtrs& l, const Classes& k,
                                              unsigned long long call, unsigned char* base,
                                              unsigned* error, uint32_t at, uint32_t step) {
  for (uint32_t c = at; c < static_cast<uint32_t>(p.n_chunks); c += step) {
    const unsigned long long content = wire_offset(k, load_global(l.chunk_first + c + 1)) -
                                       wire_offset(k, load_global(l.chunk_first + c));
    store_global<uint64_t>(l.chunk_content + c, content);
    if (content + kChunkHeaderBytes > p.capacity)
      atomic_or_global(error, static_cast<unsigned>(kDynamiqChunkOverCapacity));
  }
  if (at == 0) {
    store_header(p, l, call);
    const size_t n = p.n_sg, chunks = static_cast<size_t>(p.n_chunks);
    zero_padding(base, s.mean, 4 * n);
    zero_padding(base, s.order, 4 * n);
    zero_padding(base, s.offset, 4 * n);
    zero_padding(base, s.by_index, 4 * n);
    zero_padding(base, s.chunk_first, 4 * (chunks + 1));
    zero_padding(base, s.chunk_check, 4 * chunks);
    zero_padding(base, s.width, n);
    zero_padding(base, s.exponent, n);
  }
}

}  // namespace

// The sequence's last kernel: a segment's digest a block (blocks taking the segments in the order
// they start, so the chain waits only for blocks that run), then the finish, which needs only the
// partition's results: every block writes the record offsets of its share of the wire positions,
// except those whose words still hold the digest chain; the last block done (a ticket after a
// fence: every chain word has been read by then) writes those. At least 4 blocks an SM (at most 64
// registers a thread): when it was added, ptxas without it held the kernel to 32 registers on
// sm_90 and spilled 4 bytes; with it ptxas now reports 56 registers on sm_80 and sm_90, no spill
// (cuda_resource_usage prints the figures).
__global__ void __launch_bounds__(kGridThreads, 4)
    layout_digest_finish_kernel(const LayoutTableJob* jobs, uint32_t n_jobs,
                                unsigned long long call, unsigned* error) {
  __shared__ uint32_t words[kGridThreads], scale_words[kGridThreads], table[kGridThreads];
  __shared__ uint32_t step_raw;  // T(x + 256) - T(x)
  __shared__ unsigned long long scratch[kWarp + 1];
  __shared__ Segment segment;
  __shared__ unsigned long long job_words[kJobWords];
  __shared__ unsigned skip, last;
  const StepFold fold(error);  // the sequence's last kernel folds the step (step_fold.h)
  if (grid_block_skips(error, &skip)) return;
  const GridBlock gb = grid_block(jobs, n_jobs, true, job_words);
  const DynamiqPlan& p = gb.job->plan;
  const LayoutPtrs l = job_ptrs(*gb.job);
  const GridScratch g = grid_scratch(p, l);
  if (threadIdx.x == 0) segment = take_segment(p, l, g);
  __syncthreads();
  const Segment sg = segment;
  if (sg.chunk < static_cast<uint32_t>(p.n_chunks))  // the same in every thread
    digest_segment(p, l, g, gb.job->reduced, sg, error, words, scale_words, table, &step_raw);
  const Classes k = wire_classes(p, l, scratch);  // starts with barriers
  const uint32_t n_sg = static_cast<uint32_t>(p.n_sg);
  const uint32_t chain_end = 2 * chain_words(p);  // offset words the chain holds
  const uint32_t at = gb.block * blockDim.x + threadIdx.x, step = gb.blocks * blockDim.x;
  write_offsets(p, l, k, chain_end < n_sg ? chain_end : n_sg, n_sg, at, step);
  finish_layout(p, gb.job->sections, l, k, call, gb.job->base, error, at, step);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomic_add_global(g.chain + chain_words(p) - 1, 1ull) + 1 == gb.blocks ? 1u : 0u;
    if (last != 0) __threadfence();  // every block's chain reads are done
  }
  __syncthreads();
  if (last != 0)
    write_offsets(p, l, k, 0, chain_end < n_sg ? chain_end : n_sg, threadIdx.x, blockDim.x);
}
