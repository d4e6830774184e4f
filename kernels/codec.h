// The codec interface every compressor implements (DynamiQ and the baselines), so that every
// comparison runs exactly the same hops. Sizes are fixed by plan(); after it a codec is immutable
// plain parameters. What one call agrees on (widths, order, chunk cuts, digests, the call number)
// is a flat per-call layout in memory the caller owns (device memory in the engine), built by
// build_layout() and read by the hot path, fused_hop() / decode_finish().
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/nccl_types.h"
#include "common/status.h"

namespace dq {

// The codecs take DType::kF32 and DType::kBF16 (common/nccl_types.h).
enum class ReduceOp : uint8_t { kSum = 0, kAvg = 1 };

inline size_t dtype_size(DType t) {
  return t == DType::kF32 ? 4 : 2;
}

struct ConstTensor {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  size_t count = 0;  // elements
};

struct ByteView {
  const uint8_t* data = nullptr;
  size_t size = 0;  // bytes actually available to read
};

// Identifies one compression event. Every rank can rebuild it, so randomness is reproducible
// and the CUDA kernels draw identical bits. Each worker compresses each chunk exactly once per
// call (ring and butterfly), so `rank` identifies the hop within the chunk's in-tree.
//
// Correlated rounding stratifies the uniforms of `strata` roundings that are independent of one
// another: tree nodes of equal height (topo::rounding_strata). A rounding must never be
// stratified with one that fed its own input, or the estimate becomes biased; in a ring every
// hop feeds the next, so there every class has one member and rounding stays plain.
struct RoundingKey {
  uint64_t seed = 0;
  uint64_t call = 0;           // per-communicator call sequence number
  uint32_t rank = 0;           // compressing worker: keys its private uniforms
  uint32_t stratum = 0;        // its position among the stratified roundings, 0 .. strata-1
  uint32_t strata = 1;         // size of that set (1 = plain stochastic rounding)
  uint32_t stratum_class = 0;  // which set (tree height): keys the shared permutation
  // Index in the caller's whole tensor of this tensor's element 0 (a multiple of 256). The
  // engine cuts large calls into pipeline blocks, each a codec planned over its own slice: every
  // draw is keyed by element_base + local index, so no two blocks reuse the same randomness.
  uint64_t element_base = 0;
};

// Rounding draws key element indices into 32-bit Philox counters (index / 4): element_base +
// count must stay within this many elements.
inline constexpr uint64_t kMaxElementIndex = uint64_t{1} << 34;

// kInvalidArgument unless key.element_base is a multiple of 256 and element_base + count <=
// kMaxElementIndex (every fused_hop checks this).
Status check_element_base(const RoundingKey& key, size_t count);

// Fewer 256-value super-groups per chunk message than this and the budget's fixed costs (one
// header per message, one widest record of slack per chunk cut) push most DynamiQ widths down to
// 2 bits, although the plan still fits the budget: dynamiq-sim --synthetic --spread 0 at 5 bits,
// ring, n = 3 and 8 measured vNMSE 0.022 / 0.044 at 64 super-groups per chunk (the same as at
// 72), 0.088 / 0.17 at 32, 0.28 / 0.48 at 16, 0.64 / 1.1 at 8; n = 64, with a cut every message,
// 0.121 at 64 against 0.115 at 72. The engine passes such tensors through; the simulator reports
// them (SimResult::chunks_large_enough).
inline constexpr size_t kMinSuperGroupsPerChunk = 64;

// True when `count` values cut into `n_chunks` chunk messages keep at least
// kMinSuperGroupsPerChunk whole super-groups per message.
inline bool chunks_large_enough(size_t count, int n_chunks) {
  return n_chunks > 0 && count / 256 >= kMinSuperGroupsPerChunk * static_cast<size_t>(n_chunks);
}

// Elements of one pipeline block (DYNAMIQ_BLOCK_BYTES): whole super-groups of `block_bytes` of
// the caller's elements, over `slices` (a reduce-scatter's block spans one slice of every rank
// block: n), and at least what its `n_chunks` chunk messages need to compress
// (chunks_large_enough), so that no setting or rank count makes every block, and so the whole
// call, pass through. The engine cuts its blocks with it, the simulator predicts them with it.
inline size_t pipeline_block_elems(uint64_t block_bytes, size_t element_bytes, int slices,
                                   int n_chunks) {
  const size_t floor =
      kMinSuperGroupsPerChunk * 256 * static_cast<size_t>(n_chunks > 1 ? n_chunks : 1);
  if (element_bytes == 0 || slices < 1) return floor;
  const uint64_t elems = block_bytes / element_bytes / static_cast<uint64_t>(slices) / 256 * 256;
  return elems > floor ? static_cast<size_t>(elems) : floor;
}

class Codec {
 public:
  virtual ~Codec() = default;
  virtual std::string name() const = 0;

  // Fixes every size for a tensor of `count` elements cut into `n_chunks` chunk messages,
  // reduced over `n_workers`. Called once per (count, topology); never in the hot path.
  virtual Status plan(size_t count, int n_chunks, int n_workers) = 0;
  size_t count() const { return count_; }
  int n_chunks() const { return n_chunks_; }

  // Per-rank statistics contribution (BF16 words, summed element-wise by the statistics
  // all-reduce). 0 for codecs that need none.
  virtual size_t stats_words() const { return 0; }
  // The last this-many of those words the all-reduce sums as unsigned 8-bit integers, two byte
  // lanes a word (ncclUint8), not as BF16: DynamiQ's all-zero counts from 16 to 255 workers.
  virtual size_t stats_byte_sum_words() const { return 0; }
  virtual Status local_stats(const ConstTensor& x, uint16_t* stats_bf16) const;

  // Bytes of the per-call layout (widths, order, chunk cuts, digests, the call number): memory the
  // caller owns (device memory in the engine). Fixed by plan(). At least 8.
  virtual size_t layout_bytes() const = 0;
  // Builds the per-call layout from the all-reduced statistics (nullptr when stats_words() == 0)
  // into `layout` (layout_bytes() bytes, 8-byte aligned). Deterministic: identical input bytes
  // give identical layout bytes on every rank.
  virtual Status build_layout(const uint16_t* reduced_stats_bf16, uint64_t call,
                              void* layout) const = 0;

  // Bytes of every chunk message; a function of (count, budget, n_chunks) alone.
  virtual size_t chunk_capacity() const = 0;
  // Bytes per coordinate actually carried by one full copy of the compressed vector
  // (all chunk messages plus the statistics), times 8 / count.
  double bits_per_coord() const;
  // False when the tensor is too small for the budget (the plan then exceeds it; callers should
  // pass such tensors through uncompressed). Fixed by plan().
  virtual bool fits_budget() const { return true; }

  // Fused hop under `layout`: out = compress(own + sum_i decode(in[i])) for the elements of
  // `chunk`. n_in == 0 is the leaf compression. `out` has chunk_capacity() bytes.
  virtual Status fused_hop(const void* layout, int chunk, const ConstTensor& own,
                           const ByteView* in, int n_in, uint8_t* out,
                           const RoundingKey& key) const = 0;
  // Decodes a chunk payload holding the sum of `n_contrib` workers into `out` (full tensor,
  // elements of this chunk only), restoring means; AVG divides by n_contrib.
  virtual Status decode_finish(const void* layout, int chunk, ByteView in, void* out,
                               DType out_dtype, ReduceOp op, int n_contrib) const = 0;
  // Element ranges [begin, end) of `chunk` under `layout` (for analysis tools); empty when the
  // layout is needed and null.
  virtual void layout_ranges(const void* layout, int chunk,
                             std::vector<std::pair<size_t, size_t>>* ranges) const = 0;

  // Conveniences for tools and tests: the same operations on a layout this object owns.
  // agree() builds it (= build_layout into the owned buffer); before agree() the others see a
  // null layout and hop()/finish() fail with kInvalidArgument.
  Status agree(const uint16_t* reduced_stats_bf16, uint64_t call);
  Status hop(int chunk, const ConstTensor& own, const ByteView* in, int n_in, uint8_t* out,
             const RoundingKey& key) const {
    return fused_hop(owned_layout(), chunk, own, in, n_in, out, key);
  }
  Status finish(int chunk, ByteView in, void* out, DType out_dtype, ReduceOp op,
                int n_contrib) const {
    return decode_finish(owned_layout(), chunk, in, out, out_dtype, op, n_contrib);
  }
  void chunk_ranges(int chunk, std::vector<std::pair<size_t, size_t>>* ranges) const {
    layout_ranges(owned_layout(), chunk, ranges);
  }
  // The layout agree() built, or nullptr (none yet, or one from before a plan() that needs more).
  const void* owned_layout() const {
    return !owned_layout_.empty() && owned_layout_.size() * 8 >= layout_bytes()
               ? owned_layout_.data()
               : nullptr;
  }

 protected:
  size_t count_ = 0;
  int n_chunks_ = 0;
  int n_workers_ = 0;

 private:
  std::vector<uint64_t> owned_layout_;  // 8-byte words: the layout's alignment
};

// A codec and its parameters as a value. Parsed once from its text (parse_codec_spec: a setting,
// a command line) and carried as is to make_codec; the text (codec_spec_text) is for the edges
// only: logs, metrics, tools.
struct CodecSpec {
  enum class Family : uint8_t { kDynamiq, kBf16, kMxfp8, kMxfp6E3M2, kMxfp6E2M3, kMxfp4, kUniform };
  Family family = Family::kDynamiq;
  // DynamiQ: the budget, bits per coordinate in [3, 32] (metadata included); uniform: its integer
  // bits per coordinate B in 3..9, scale included; 0 for the other families.
  double bits = 5.0;
  // DynamiQ options the text set; each unset one keeps DynamiqOptions' default
  // (kernels/dynamiq_codec.h). Keys as in the text: corr, levels, scales, widths, mean, w16.
  std::optional<bool> correlated_rounding;  // corr=1|0
  std::optional<bool> nonuniform_levels;    // levels=nonuniform|uniform
  std::optional<bool> hierarchical_scales;  // scales=hier|flat
  std::optional<bool> variable_widths;      // widths=var|fixed
  std::optional<bool> mean_subtraction;     // mean=1|0
  std::optional<bool> allow_width16;        // w16=1|0
  std::optional<float> eps[3];              // eps2, eps4, eps8: level shape, 0..2
  bool operator==(const CodecSpec&) const = default;
};

// Parses a codec spec such as "dynamiq:5", "dynamiq:5:corr=0", "mxfp8", "mxfp6e3m2", "mxfp4",
// "bf16", "uniform:5" ("dynamiq" alone: 5 bits; "mxfp6": "mxfp6e3m2"). On error returns false and
// sets *error to a message naming the problem.
bool parse_codec_spec(std::string_view text, CodecSpec* out, std::string* error);
// The spec's canonical text: the family ("mxfp6" for E3M2), its bits (%.17g: the settings' own
// spelling of DYNAMIQ_BITS), then the options set, in the order of CodecSpec's fields, e.g.
// "dynamiq:5:corr=0". parse_codec_spec reads it back to the same value.
std::string codec_spec_text(const CodecSpec& spec);

// The codec of a parsed spec (nullptr only for a family this build lacks).
std::unique_ptr<Codec> make_codec(const CodecSpec& spec);
// parse_codec_spec, then make_codec: for tools and tests that hold a spec as text.
std::unique_ptr<Codec> make_codec(std::string_view spec, std::string* error);

}  // namespace dq
