// Shared machinery of the baseline codecs: fixed-size blocks, chunks cut on block boundaries,
// the chunk header, and the tiled hop/finish drivers (TBB over tiles, no heap allocation).
// Chunks follow from the plan alone, so the per-call layout is one u64 word: the call number.
// The work inside a tile (decode, add, encode) is a TileKernel compiled once per host
// instruction set (kernels/baselines/baselines_hot.h) and picked when the codec is made, from
// host_isa() as the DynamiQ codec is. Internal to kernels/baselines.
#pragma once
#include <cstring>
#include <memory>

#include "kernels/baselines/baselines.h"
#include "kernels/codec.h"
#include "kernels/payload.h"

namespace dq::baselines {

// Elements of one processing tile: a 4 KiB FP32 accumulator on the stack.
constexpr size_t kTileElems = 1024;
// Chunks above this many elements are processed in parallel.
constexpr size_t kParallelElems = size_t{1} << 16;

// One baseline codec's work on one tile of whole blocks, on one host path. Every path gives the
// same bytes. Members are const and called concurrently on disjoint tiles.
class TileKernel {
 public:
  virtual ~TileKernel() = default;
  // Values per block (divides kTileElems).
  virtual size_t block_elems() const = 0;
  // The hop of n_blocks blocks starting at element e0 of own (valid of them inside the tensor,
  // the rest of the last block taken as 0): own plus each input's blocks at in[j].data +
  // in_offset, added in FP32 and encoded into dst. False when an input holds invalid codes
  // (dst is written anyway).
  virtual bool hop_tile(const ConstTensor& own, size_t e0, size_t valid, size_t n_blocks,
                        const ByteView* in, int n_in, size_t in_offset, const RoundingKey& key,
                        uint8_t* dst) const = 0;
  // False when the blocks are not a valid encoding.
  virtual bool validate(const uint8_t* src, size_t n_blocks) const = 0;
  // Decodes n_blocks blocks (already validated) and writes the first valid values, divided by
  // `divisor` under AVG, to out from element e0 on.
  virtual void finish_tile(const uint8_t* src, size_t n_blocks, size_t valid, ReduceOp op,
                           float divisor, void* out, DType out_dtype, size_t e0) const = 0;
};

// Which baseline a TileKernel encodes: the codec id, with the MX element kind (MX codecs) or the
// code width k = B - 1 (uniform:B).
struct TileSpec {
  CodecId id;
  MxKind mx = MxKind::kFp8E4M3;
  int uniform_code_bits = 0;
};

// The kernel of the path host_isa() names now (kernels/host_isa.h).
std::unique_ptr<TileKernel> make_tile_kernel(const TileSpec& spec);
// Each path's own (kernels/baselines/baselines_host_{scalar,avx2,avx512}.cc).
std::unique_ptr<TileKernel> make_tile_kernel_scalar(const TileSpec& spec);
std::unique_ptr<TileKernel> make_tile_kernel_avx2(const TileSpec& spec);
std::unique_ptr<TileKernel> make_tile_kernel_avx512(const TileSpec& spec);

struct ChunkSpan {
  size_t begin = 0;  // first element
  size_t end = 0;    // one past the last element
  size_t first_block = 0;
  size_t n_blocks = 0;  // blocks of this chunk, the last one possibly partial
};

// A codec whose payload is a sequence of independent fixed-size blocks after the chunk header:
// the hop and the finish check arguments and headers here and run the tiles on the TileKernel of
// the codec's TileSpec (host_isa()'s path when made). A derived class gives its geometry and name.
class BlockCodec : public Codec {
 public:
  Status plan(size_t count, int n_chunks, int n_workers) override;
  Status fused_hop(const void* layout, int chunk, const ConstTensor& own, const ByteView* in,
                   int n_in, uint8_t* out, const RoundingKey& key) const final;
  Status decode_finish(const void* layout, int chunk, ByteView in, void* out, DType out_dtype,
                       ReduceOp op, int n_contrib) const final;
  size_t layout_bytes() const override { return sizeof(uint64_t); }
  Status build_layout(const uint16_t* reduced_stats_bf16, uint64_t call,
                      void* layout) const override;
  size_t chunk_capacity() const override { return capacity_; }
  void layout_ranges(const void* layout, int chunk,
                     std::vector<std::pair<size_t, size_t>>* ranges) const override;

 protected:
  // variant distinguishes codecs sharing an id (the uniform bit count); block_elems divides
  // kTileElems.
  BlockCodec(CodecId id, uint32_t variant, size_t block_elems, size_t block_bytes,
             const TileSpec& tiles)
      : id_(id),
        variant_(variant),
        block_elems_(block_elems),
        block_bytes_(block_bytes),
        tiles_(make_tile_kernel(tiles)) {}

  ChunkSpan span(int chunk) const;
  uint32_t layout_digest(const ChunkSpan& s) const;
  Status check_hop_args(const void* layout, int chunk, const ConstTensor& own, const ByteView* in,
                        int n_in, const uint8_t* out, const RoundingKey& key) const;
  // Validates the header and size of every input payload; *contrib = sum of their n_contrib.
  Status check_inputs(uint32_t call, int chunk, const ChunkSpan& s, const ByteView* in, int n_in,
                      int* contrib) const;
  // Low 32 bits of the layout's call number (chunk headers carry these).
  static uint32_t layout_call(const void* layout) {
    uint64_t call;
    std::memcpy(&call, layout, sizeof call);
    return static_cast<uint32_t>(call);
  }

 private:
  template <class Body>
  void for_each_tile(const ChunkSpan& s, Body&& body) const;

  const CodecId id_;
  const uint32_t variant_;
  const size_t block_elems_;
  const size_t block_bytes_;
  const std::unique_ptr<TileKernel> tiles_;
  size_t n_blocks_total_ = 0;
  size_t capacity_ = 0;
  bool planned_ = false;
};

}  // namespace dq::baselines
