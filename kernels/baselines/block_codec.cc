#include "kernels/baselines/block_codec.h"

#include <limits>

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
