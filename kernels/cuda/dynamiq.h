// DynamiQ's per-call kernels on device buffers (kernels/cuda/dynamiq_layout.cu,
// kernels/cuda/dynamiq_hop.cu, kernels/cuda/dynamiq_finish.cu): the layout build, the fused hop
// (leaf included) and the finish, with the bytes of the host codec's DynamiqCodec::build_layout,
// fused_hop and decode_finish (kernels/dynamiq_layout.cc, kernels/dynamiq_codec.cc; byte layout
// docs/FORMAT.md). The arithmetic is the host's DQ_HD functions of kernels/dynamiq_math.h; where
// the host has AVX2 code the kernels follow its scalar path, which gives the same bytes
// (tests/kernels/golden_test.cc).
//
// Every launch is asynchronous on `stream`. Errors of the data (what the host returns as
// kMalformedPayload or kInternal) cannot come back from a launch: the kernels OR flags into a
// device word the caller zeroes first and reads when the stream is done (DynamiqError).
// A word that has kSkipFlag when a launch starts (the caller arms it, cuda_compat.h) means the lane
// failed before: the launch's kernels then write nothing and leave the word as it is.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/codec.h"
#include "kernels/cuda/cuda_compat.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_layout.h"
#include "kernels/dynamiq_math.h"
#include "kernels/payload.h"

namespace dq::cuda {

constexpr int kLayoutThreads = 512;  // one block builds the whole layout
// Threads of a hop or finish block: the hop's 8 warps take a super-group each at a time, the
// finish's threads a value each.
constexpr int kHopThreads = 256;
constexpr int kMaxHopInputs = 64;  // as the host codec
// Blocks of kHopThreads an SM must hold at once: 4 x 256 = 1,024 threads, half of an sm_80 or
// sm_90 SM's 2,048, which caps the fused hop at 64 registers a thread (it needs no spills there;
// tests/kernels/cuda/check_resource_usage.sh checks both).
constexpr int kHopMinBlocks = 4;

// The fused hop's split of a chunk's `positions` wire positions over `blocks` blocks: each block
// takes this many consecutive positions, a multiple of its warps (kHopThreads / 32), the last
// block fewer or none.
DQ_HD uint64_t hop_block_positions(uint64_t positions, uint64_t blocks) {
  constexpr uint64_t kWarps = kHopThreads / 32;
  return ((positions + blocks - 1) / blocks + kWarps - 1) / kWarps * kWarps;
}

// The level tables (bit width_index(w)) a hop block stages for wire positions whose widths run
// from `widest` down to `narrowest` (wire order is widest first): those of 2, 4 and 8 bits
// between them.
DQ_HD unsigned hop_level_tables(int widest, int narrowest) {
  unsigned tables = 0;
  for (int w = 0; w < 3; ++w) {
    const int bits = 2 << w;
    if (bits >= narrowest && bits <= widest) tables |= 1u << w;
  }
  return tables;
}

// What the kernels need of a planned DynamiQ codec, passed to them by value.
struct DynamiqDeviceParams {
  DynamiqPlan plan;          // the host's plan (kernels/dynamiq_layout.h)
  DynamiqSections sections;  // where the layout's sections lie
  bool hierarchical_scales = true;
  bool correlated_rounding = true;
};

// The parameters of a DynamiQ codec with `options`, planned for (count, n_chunks, n_workers),
// whose chunk_capacity() is `capacity`: the same plan DynamiqCodec::plan() fixes (host code).
inline DynamiqDeviceParams dynamiq_device_params(size_t count, int n_chunks, int n_workers,
                                                 size_t capacity, const DynamiqOptions& o) {
  DynamiqDeviceParams d;
  DynamiqPlan& p = d.plan;
  for (int b : {2, 4, 8, 16}) p.record[width_index(b)] = record_bytes(b, o.hierarchical_scales);
  p.count = count;
  p.n_sg = (count + kSuperGroup - 1) / kSuperGroup;
  p.n_chunks = n_chunks;
  p.n_workers = n_workers;
  p.capacity = capacity;
  const size_t max_record = static_cast<size_t>(p.record[o.allow_width16 ? 3 : 2]);
  p.stride = p.n_sg > 0 ? dynamiq_stride(capacity, max_record) : 0;
  p.mean_subtraction = o.mean_subtraction;
  p.variable_widths = o.variable_widths;
  p.allow_width16 = o.allow_width16;
  d.sections = dynamiq_sections(p.n_sg, static_cast<size_t>(n_chunks));
  d.hierarchical_scales = o.hierarchical_scales;
  d.correlated_rounding = o.correlated_rounding;
  return d;
}

// The host codec's level tables for widths 2, 4, 8 (build_level_table, the host's own builder:
// the kernels never compute a level). Copy `out` to device memory for the kernels.
inline void dynamiq_level_tables(const DynamiqOptions& o, LevelTable out[3]) {
  const int bits[3] = {2, 4, 8};
  for (int i = 0; i < 3; ++i) build_level_table(bits[i], o.eps[i], o.nonuniform_levels, &out[i]);
}

// Flags OR-ed into the caller's error word.
enum DynamiqError : unsigned {
  kDynamiqBadHeader = 1u,       // an input's chunk header disagrees (host: kMalformedPayload)
  kDynamiqBadRecord = 2u,       // invalid codes or scales (host: kMalformedPayload)
  kDynamiqTooManyWorkers = 4u,  // inputs sum more workers than exist (host: kMalformedPayload)
  kDynamiqChunkOverCapacity =
      8u  // a chunk does not fit its message (host: kInternal): raised
          // by the layout, and by the hop (and the finish's check) for a
          // record past the capacity, which they then neither write nor read
};

// The layout of `params` for this call from the all-reduced statistics (stats_words() BF16
// words) into `layout` (params.sections.bytes bytes, 8-byte aligned): the bytes of
// build_dynamiq_layout(), padding included. One block, or seven grid-wide kernels for a large
// layout (kernels/cuda/dynamiq_layout_grid.cuh): a batch of one (launch_dynamiq_layouts below), its
// table copied to the device on `stream` for the launches (a stream-ordered allocation, freed after
// them; a copy from pageable memory, which CUDA refuses during a stream capture: a capturing caller
// plans a batch and copies its table beforehand).
cudaError_t launch_dynamiq_layout(const DynamiqDeviceParams& params, const uint16_t* reduced_stats,
                                  uint64_t call, void* layout, unsigned* error,
                                  cudaStream_t stream);

// Every layout of a call in a constant number of launches, whatever the number of codec parts:
// one launch of the one-block kernel, a block a small layout, and the grid path's seven kernels
// once each, their grids every large layout's blocks one after the other (each block finds its
// layout in a table; every hand-off between blocks stays within its layout's own sections).
//
// One layout of a batch: the codec part's kernel parameters, its reduced statistics (device
// memory; nullptr when n_sg == 0) and its layout buffer (params.sections.bytes, 8-byte aligned).
struct LayoutJob {
  DynamiqDeviceParams params;
  const uint16_t* reduced_stats = nullptr;
  void* layout = nullptr;
};

// A batch planned once (host code, at plan time): the launch shapes and the image of the table
// the kernels read (the caller copies `table` to device memory once and passes that copy to
// every launch; its pointers are the jobs' device pointers, so a new table for new buffers).
struct LayoutBatch {
  int n_small = 0;             // layouts built by one block each (one launch, n_small blocks)
  int n_grid = 0;              // layouts over the grid (seven launches)
  unsigned grid_blocks = 0;    // blocks of six of the grid launches: every grid layout's together
  unsigned digest_blocks = 0;  // blocks of the last grid launch (each layout's + its chunks)
  std::vector<unsigned char> table;
};

// Plans `jobs` (host code). False, with a cleared batch, when a job is invalid where
// launch_dynamiq_layout would answer cudaErrorInvalidValue, or the grids would not fit a launch.
bool plan_layout_batch(const LayoutJob* jobs, int n_jobs, LayoutBatch* out);

// Every layout of `batch` for call `call`: the bytes of build_dynamiq_layout() of each job.
// `device_table`: the device copy of batch.table (8-byte aligned; writable: a grid layout's ticket
// word in it counts the extent kernel's blocks and is back to 0 when the launch ends, so the copy
// serves every call, one launch on it at a time). `error`: the step's flags word, as for
// launch_dynamiq_layout (the batch's last launch folds a StepWord's).
cudaError_t launch_dynamiq_layouts(const LayoutBatch& batch, void* device_table, uint64_t call,
                                   unsigned* error, cudaStream_t stream);

// Launches launch_dynamiq_layouts makes: (any small layout ? 1 : 0) + (any grid layout ? 7 : 0).
int layout_batch_launches(const LayoutBatch& batch);

// The fused hop of `chunk`: out (chunk_capacity() bytes) = compress(own + sum of the n_in input
// chunk messages `inputs[i]`), keyed by `key`; n_in = 0 is the leaf. `levels`: the three tables
// of dynamiq_level_tables() in device memory. `max_blocks` caps the grid (0: up to 4096).
cudaError_t launch_dynamiq_hop(const DynamiqDeviceParams& params, const LevelTable* levels,
                               const void* layout, int chunk, const void* own, bool own_bf16,
                               const uint8_t* const* inputs, int n_in, uint8_t* out,
                               const RoundingKey& key, unsigned* error, cudaStream_t stream,
                               int max_blocks = 0);

// The blocks launch_dynamiq_hop() gives a chunk of `params`' plan with `max_blocks` (host code;
// the current device's SM count): 16 super-groups a block, or more blocks where that leaves an SM
// fewer than kHopMinBlocks, while each warp still gets a super-group; at most max_blocks (0:
// 4096). Any grid gives the same bytes; tests/gpu/hop_bandwidth.cu times a few.
unsigned dynamiq_hop_grid(const DynamiqDeviceParams& params, int max_blocks = 0);

// The finish of `chunk`: decodes the chunk message `in` (the sum of n_contrib workers), restores
// the means, divides by n_contrib for AVG, and writes this chunk's elements of `out` (the whole
// tensor, FP32 or BF16). A message whose header or records are invalid leaves `out` untouched
// (and sets the error word), as on the host. One launch (FinishGate, kernels/cuda/step_fold.h):
// `word` is a StepWord in device memory, its flags the error word (a word without kFoldFlag,
// zeroed, keeps them for the caller); its tickets are 0 as the launch starts and as it ends.
// `max_blocks` caps each of the launch's two roles. launch_dynamiq_finishes() of one chunk.
cudaError_t launch_dynamiq_finish(const DynamiqDeviceParams& params, const LevelTable* levels,
                                  const void* layout, int chunk, const uint8_t* in, void* out,
                                  bool out_bf16, bool avg, int n_contrib, StepWord* word,
                                  cudaStream_t stream, int max_blocks = 0);

// The finish of chunks first_chunk .. first_chunk + n_finish - 1 in one launch: chunk c's message
// at in_base + (c - first_chunk) * in_stride bytes (each params.plan.capacity bytes long at least;
// in_stride >= capacity when n_finish > 1), decoded into `out` as launch_dynamiq_finish() does,
// every message the sum of the same n_contrib workers. If any record or header of ANY of these
// chunks is invalid, no chunk of the launch writes any output: stricter than one chunk at a time
// (and than the host's decode_finish, per chunk), where the valid chunks would still be written;
// the error word does not say which chunk was invalid. The word, tickets and `max_blocks` as
// launch_dynamiq_finish(); the validators and the decoders each share the range's records evenly.
cudaError_t launch_dynamiq_finishes(const DynamiqDeviceParams& params, const LevelTable* levels,
                                    const void* layout, int first_chunk, int n_finish,
                                    const uint8_t* in_base, size_t in_stride, void* out,
                                    bool out_bf16, bool avg, int n_contrib, StepWord* word,
                                    cudaStream_t stream, int max_blocks = 0);

// Loads every kernel of dynamiq_finish.cu (load_dynamiq_hop_kernels() calls it).
cudaError_t load_dynamiq_finish_kernels();

// Loads every kernel of dynamiq_hop.cu and dynamiq_finish.cu (device set-up; see
// cudaFuncGetAttributes in EMULATION.md).
cudaError_t load_dynamiq_hop_kernels();

// Loads every kernel of dynamiq_layout.cu (device set-up; see cudaFuncGetAttributes in
// EMULATION.md).
cudaError_t load_dynamiq_layout_kernels();

}  // namespace dq::cuda
