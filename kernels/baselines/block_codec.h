// Shared machinery of the baseline codecs: fixed-size blocks, chunks cut on block boundaries,
// the chunk header, and the tiled hop/finish drivers (TBB over tiles, no heap allocation).
// Chunks follow from the plan alone, so the per-call layout is one u64 word: the call number.
// Internal to kernels/baselines.
#pragma once
#include <atomic>
#include <cstring>

#include <tbb/blocked_range.h>

#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "kernels/parallel.h"
#include "kernels/payload.h"

namespace dq::baselines {

// Elements of one processing tile: a 4 KiB FP32 accumulator on the stack.
constexpr size_t kTileElems = 1024;
// Chunks above this many elements are processed in parallel.
constexpr size_t kParallelElems = size_t{1} << 16;

struct ChunkSpan {
  size_t begin = 0;  // first element
  size_t end = 0;    // one past the last element
  size_t first_block = 0;
  size_t n_blocks = 0;  // blocks of this chunk, the last one possibly partial
};

// A codec whose payload is a sequence of independent fixed-size blocks after the chunk header.
// Derived classes provide a Kernel (see run_hop) and call the drivers below.
class BlockCodec : public Codec {
 public:
  Status plan(size_t count, int n_chunks, int n_workers) override;
  size_t layout_bytes() const override { return sizeof(uint64_t); }
  Status build_layout(const uint16_t* reduced_stats_bf16, uint64_t call,
                      void* layout) const override;
  size_t chunk_capacity() const override { return capacity_; }
  void layout_ranges(const void* layout, int chunk,
                     std::vector<std::pair<size_t, size_t>>* ranges) const override;

 protected:
  // variant distinguishes codecs sharing an id (the uniform bit count); block_elems divides
  // kTileElems.
  BlockCodec(CodecId id, uint32_t variant, size_t block_elems, size_t block_bytes)
      : id_(id), variant_(variant), block_elems_(block_elems), block_bytes_(block_bytes) {}

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

  // Kernel interface (all members const, called concurrently on disjoint tiles):
  //   bool decode(const uint8_t* src, size_t n_blocks, float* dst) const;
  //     writes n_blocks * block_elems values; false when the bytes are not a valid encoding.
  //   bool validate(const uint8_t* src, size_t n_blocks) const;
  //   void encode(const float* src, size_t n_blocks, size_t first_elem, const RoundingKey& key,
  //               uint8_t* dst) const;   // first_elem: index of src[0] in the caller's whole
  //                                      // tensor (key.element_base included): keys the draws
  template <class Kernel>
  Status run_hop(const Kernel& k, const void* layout, int chunk, const ConstTensor& own,
                 const ByteView* in, int n_in, uint8_t* out, const RoundingKey& key) const;
  template <class Kernel>
  Status run_finish(const Kernel& k, const void* layout, int chunk, ByteView in, void* out,
                    DType out_dtype, ReduceOp op, int n_contrib) const;

 private:
  template <class Body>
  void for_each_tile(const ChunkSpan& s, Body&& body) const;

  const CodecId id_;
  const uint32_t variant_;
  const size_t block_elems_;
  const size_t block_bytes_;
  size_t n_blocks_total_ = 0;
  size_t capacity_ = 0;
  bool planned_ = false;
};

template <class Body>
void BlockCodec::for_each_tile(const ChunkSpan& s, Body&& body) const {
  const size_t tile_blocks = kTileElems / block_elems_;
  const size_t n_tiles = (s.n_blocks + tile_blocks - 1) / tile_blocks;
  auto run = [&](size_t t0, size_t t1) {
    for (size_t t = t0; t < t1; ++t) {
      size_t b0 = t * tile_blocks;
      size_t nb = s.n_blocks - b0 < tile_blocks ? s.n_blocks - b0 : tile_blocks;
      body(b0, nb);
    }
  };
  if (s.end - s.begin > kParallelElems) {
    dq::parallel_for(tbb::blocked_range<size_t>(0, n_tiles, 8),
                     [&](const tbb::blocked_range<size_t>& r) { run(r.begin(), r.end()); });
  } else {
    run(0, n_tiles);
  }
}

template <class Kernel>
Status BlockCodec::run_hop(const Kernel& k, const void* layout, int chunk, const ConstTensor& own,
                           const ByteView* in, int n_in, uint8_t* out,
                           const RoundingKey& key) const {
  DQ_CHECK(check_hop_args(layout, chunk, own, in, n_in, out, key));
  const uint32_t call = layout_call(layout);
  const ChunkSpan s = span(chunk);
  int contrib = 0;
  DQ_CHECK(check_inputs(call, chunk, s, in, n_in, &contrib));
  if (contrib + 1 > n_workers_)
    DQ_FAIL(Status::kMalformedPayload, "inputs of chunk %d sum %d workers; with this one %d > %d",
            chunk, contrib, contrib + 1, n_workers_);
  write_chunk_header(out, ChunkHeader{id_, static_cast<uint16_t>(chunk),
                                      static_cast<uint16_t>(contrib + 1), call, layout_digest(s)});
  uint8_t* body_out = out + kChunkHeaderBytes;
  const size_t body_bytes = s.n_blocks * block_bytes_;
  std::memset(body_out + body_bytes, 0, capacity_ - kChunkHeaderBytes - body_bytes);

  std::atomic<bool> malformed{false};
  for_each_tile(s, [&](size_t b0, size_t nb) {
    alignas(64) float acc[kTileElems];
    alignas(64) float decoded[kTileElems];
    const size_t e0 = s.begin + b0 * block_elems_;
    const size_t padded = nb * block_elems_;
    const size_t valid = (s.end - e0) < padded ? (s.end - e0) : padded;
    if (own.dtype == DType::kF32) {
      const float* src = static_cast<const float*>(own.data) + e0;
      for (size_t i = 0; i < valid; ++i) acc[i] = src[i];
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(own.data) + e0;
      for (size_t i = 0; i < valid; ++i) acc[i] = bf16_to_f32(src[i]);
    }
    for (size_t i = valid; i < padded; ++i) acc[i] = 0.0f;
    for (int j = 0; j < n_in; ++j) {
      const uint8_t* src = in[j].data + kChunkHeaderBytes + b0 * block_bytes_;
      if (!k.decode(src, nb, decoded)) malformed.store(true, std::memory_order_relaxed);
      for (size_t i = 0; i < valid; ++i) acc[i] += decoded[i];
    }
    k.encode(acc, nb, key.element_base + e0, key, body_out + b0 * block_bytes_);
  });
  if (malformed.load()) {
    std::memset(out, 0, capacity_);
    DQ_FAIL(Status::kMalformedPayload, "chunk %d: an input payload holds invalid codes", chunk);
  }
  return Status::kOk;
}

template <class Kernel>
Status BlockCodec::run_finish(const Kernel& k, const void* layout, int chunk, ByteView in, void* out,
                              DType out_dtype, ReduceOp op, int n_contrib) const {
  if (!planned_) DQ_FAIL(Status::kInvalidArgument, "%s: finish() before plan()", name().c_str());
  if (layout == nullptr)
    DQ_FAIL(Status::kInvalidArgument, "%s: finish() without a layout (agree() first)", name().c_str());
  if (chunk < 0 || chunk >= n_chunks_)
    DQ_FAIL(Status::kInvalidArgument, "chunk %d out of range 0..%d", chunk, n_chunks_ - 1);
  if (n_contrib < 1 || n_contrib > n_workers_)
    DQ_FAIL(Status::kInvalidArgument, "n_contrib %d out of range 1..%d", n_contrib, n_workers_);
  if (out_dtype != DType::kF32 && out_dtype != DType::kBF16)
    DQ_FAIL(Status::kInvalidArgument, "unknown output dtype %d", static_cast<int>(out_dtype));
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg)
    DQ_FAIL(Status::kInvalidArgument, "unknown reduce op %d", static_cast<int>(op));
  const ChunkSpan s = span(chunk);
  if (out == nullptr && s.end > s.begin) DQ_FAIL(Status::kInvalidArgument, "finish(): null output");
  int contrib = 0;
  DQ_CHECK(check_inputs(layout_call(layout), chunk, s, &in, 1, &contrib));
  if (contrib != n_contrib)
    DQ_FAIL(Status::kMalformedPayload, "chunk %d payload sums %d workers, caller expects %d", chunk,
            contrib, n_contrib);
  const uint8_t* body = in.data + kChunkHeaderBytes;

  // Validate everything before writing any output, so a bad payload leaves `out` untouched.
  std::atomic<bool> malformed{false};
  for_each_tile(s, [&](size_t b0, size_t nb) {
    if (!k.validate(body + b0 * block_bytes_, nb)) malformed.store(true, std::memory_order_relaxed);
  });
  if (malformed.load())
    DQ_FAIL(Status::kMalformedPayload, "chunk %d: payload holds invalid codes", chunk);

  const float divisor = op == ReduceOp::kAvg ? static_cast<float>(n_contrib) : 1.0f;
  for_each_tile(s, [&](size_t b0, size_t nb) {
    alignas(64) float decoded[kTileElems];
    const size_t e0 = s.begin + b0 * block_elems_;
    const size_t padded = nb * block_elems_;
    const size_t valid = (s.end - e0) < padded ? (s.end - e0) : padded;
    k.decode(body + b0 * block_bytes_, nb, decoded);
    if (op == ReduceOp::kAvg)
      for (size_t i = 0; i < valid; ++i) decoded[i] /= divisor;
    if (out_dtype == DType::kF32) {
      float* dst = static_cast<float*>(out) + e0;
      for (size_t i = 0; i < valid; ++i) dst[i] = decoded[i];
    } else {
      uint16_t* dst = static_cast<uint16_t*>(out) + e0;
      for (size_t i = 0; i < valid; ++i) dst[i] = f32_to_bf16_rne(decoded[i]);
    }
  });
  return Status::kOk;
}

}  // namespace dq::baselines
