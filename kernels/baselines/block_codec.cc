#include "kernels/baselines/block_codec.h"

#include <tbb/blocked_range.h>

#include <atomic>
#include <limits>

#include "kernels/host_isa.h"
#include "kernels/parallel.h"

namespace dq::baselines {
namespace {

// 64-bit FNV-1a over the little-endian bytes of each word.
uint64_t fnv1a_words(const uint64_t* words, int n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int w = 0; w < n; ++w)
    for (int b = 0; b < 8; ++b) {
      h ^= (words[w] >> (8 * b)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  return h;
}

}  // namespace

std::unique_ptr<TileKernel> make_tile_kernel(const TileSpec& spec) {
  return for_host_isa(&make_tile_kernel_scalar, &make_tile_kernel_avx2,
                      &make_tile_kernel_avx512)(spec);
}

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

Status BlockCodec::fused_hop(const void* layout, int chunk, const ConstTensor& own,
                             const ByteView* in, int n_in, uint8_t* out,
                             const RoundingKey& key) const {
  const TileKernel& k = *tiles_;
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
    const size_t e0 = s.begin + b0 * block_elems_;
    const size_t padded = nb * block_elems_;
    const size_t valid = (s.end - e0) < padded ? (s.end - e0) : padded;
    if (!k.hop_tile(own, e0, valid, nb, in, n_in, kChunkHeaderBytes + b0 * block_bytes_, key,
                    body_out + b0 * block_bytes_))
      malformed.store(true, std::memory_order_relaxed);
  });
  if (malformed.load()) {
    std::memset(out, 0, capacity_);
    DQ_FAIL(Status::kMalformedPayload, "chunk %d: an input payload holds invalid codes", chunk);
  }
  return Status::kOk;
}

Status BlockCodec::decode_finish(const void* layout, int chunk, ByteView in, void* out,
                                 DType out_dtype, ReduceOp op, int n_contrib) const {
  const TileKernel& k = *tiles_;
  if (!planned_) DQ_FAIL(Status::kInvalidArgument, "%s: finish() before plan()", name().c_str());
  if (layout == nullptr)
    DQ_FAIL(Status::kInvalidArgument, "%s: finish() without a layout (agree() first)",
            name().c_str());
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
    const size_t e0 = s.begin + b0 * block_elems_;
    const size_t padded = nb * block_elems_;
    const size_t valid = (s.end - e0) < padded ? (s.end - e0) : padded;
    k.finish_tile(body + b0 * block_bytes_, nb, valid, op, divisor, out, out_dtype, e0);
  });
  return Status::kOk;
}

Status BlockCodec::plan(size_t count, int n_chunks, int n_workers) {
  planned_ = false;
  if (n_chunks < 1 || n_chunks > 65536)
    DQ_FAIL(Status::kInvalidArgument, "%s: n_chunks %d outside 1..65536", name().c_str(), n_chunks);
  if (n_workers < 1 || n_workers > 65535)
    DQ_FAIL(Status::kInvalidArgument, "%s: n_workers %d outside 1..65535", name().c_str(),
            n_workers);
  // Global element indices key the rounding draws as (index / 4) in a 32-bit Philox counter.
  if (count > (size_t{1} << 34))
    DQ_FAIL(Status::kInvalidArgument, "%s: %zu elements exceed the 2^34 limit", name().c_str(),
            count);
  count_ = count;
  n_chunks_ = n_chunks;
  n_workers_ = n_workers;
  n_blocks_total_ = (count + block_elems_ - 1) / block_elems_;
  const size_t max_blocks = (n_blocks_total_ + n_chunks - 1) / n_chunks;
  capacity_ = kChunkHeaderBytes + max_blocks * block_bytes_;
  planned_ = true;
  return Status::kOk;
}

Status BlockCodec::build_layout(const uint16_t* /*reduced_stats_bf16: none*/, uint64_t call,
                                void* layout) const {
  if (layout == nullptr) DQ_FAIL(Status::kInvalidArgument, "%s: no layout buffer", name().c_str());
  std::memcpy(layout, &call, sizeof call);
  return Status::kOk;
}

ChunkSpan BlockCodec::span(int chunk) const {
  ChunkSpan s;
  const size_t n = static_cast<size_t>(n_chunks_);
  const size_t c = static_cast<size_t>(chunk);
  s.first_block = c * n_blocks_total_ / n;
  s.n_blocks = (c + 1) * n_blocks_total_ / n - s.first_block;
  s.begin = s.first_block * block_elems_;
  s.end = (s.first_block + s.n_blocks) * block_elems_;
  if (s.begin > count_) s.begin = count_;
  if (s.end > count_) s.end = count_;
  return s;
}

uint32_t BlockCodec::layout_digest(const ChunkSpan& s) const {
  const uint64_t words[5] = {static_cast<uint64_t>(id_), variant_, count_, s.begin, s.end};
  const uint64_t h = fnv1a_words(words, 5);
  return static_cast<uint32_t>(h) ^ static_cast<uint32_t>(h >> 32);
}

void BlockCodec::layout_ranges(const void* /*layout: ranges follow from the plan*/, int chunk,
                               std::vector<std::pair<size_t, size_t>>* ranges) const {
  ranges->clear();
  if (!planned_ || chunk < 0 || chunk >= n_chunks_) return;
  const ChunkSpan s = span(chunk);
  ranges->emplace_back(s.begin, s.end);
}

Status BlockCodec::check_hop_args(const void* layout, int chunk, const ConstTensor& own,
                                  const ByteView* in, int n_in, const uint8_t* out,
                                  const RoundingKey& key) const {
  if (!planned_) DQ_FAIL(Status::kInvalidArgument, "%s: hop() before plan()", name().c_str());
  if (layout == nullptr)
    DQ_FAIL(Status::kInvalidArgument, "%s: hop() without a layout (agree() first)", name().c_str());
  if (chunk < 0 || chunk >= n_chunks_)
    DQ_FAIL(Status::kInvalidArgument, "chunk %d out of range 0..%d", chunk, n_chunks_ - 1);
  if (n_in < 0 || (n_in > 0 && in == nullptr))
    DQ_FAIL(Status::kInvalidArgument, "hop(): %d inputs at %p", n_in, static_cast<const void*>(in));
  if (out == nullptr) DQ_FAIL(Status::kInvalidArgument, "hop(): null output buffer");
  if (own.dtype != DType::kF32 && own.dtype != DType::kBF16)
    DQ_FAIL(Status::kInvalidArgument, "hop(): unknown input dtype %d", static_cast<int>(own.dtype));
  // `own` is the whole local tensor; the hop reads only this chunk's elements.
  if (own.count != count_)
    DQ_FAIL(Status::kInvalidArgument, "hop(): own tensor has %zu elements, plan has %zu", own.count,
            count_);
  if (own.data == nullptr && count_ > 0)
    DQ_FAIL(Status::kInvalidArgument, "hop(): null own tensor");
  return check_element_base(key, count_);
}

Status BlockCodec::check_inputs(uint32_t call, int chunk, const ChunkSpan& s, const ByteView* in,
                                int n_in, int* contrib) const {
  const ChunkHeader expected{id_, static_cast<uint16_t>(chunk), 0, call, layout_digest(s)};
  const size_t needed = kChunkHeaderBytes + s.n_blocks * block_bytes_;
  int sum = 0;
  for (int j = 0; j < n_in; ++j) {
    if (in[j].data == nullptr || in[j].size < needed)
      DQ_FAIL(Status::kMalformedPayload, "%s chunk %d input %d: %zu bytes, needs %zu",
              name().c_str(), chunk, j, in[j].data ? in[j].size : 0, needed);
    ChunkHeader got;
    DQ_CHECK(check_chunk_header(in[j], expected, n_workers_, &got));
    sum += got.n_contrib;
    if (sum > n_workers_)
      DQ_FAIL(Status::kMalformedPayload, "%s chunk %d: inputs sum %d workers, only %d exist",
              name().c_str(), chunk, sum, n_workers_);
  }
  *contrib = sum;
  return Status::kOk;
}

}  // namespace dq::baselines
