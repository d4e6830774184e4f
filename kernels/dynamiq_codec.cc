#include "kernels/dynamiq_codec.h"

#include <tbb/blocked_range.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/c_locale.h"
#include "kernels/dynamiq_codec_impl.h"
#include "kernels/dynamiq_layout.h"
#include "kernels/host_isa.h"
#include "kernels/parallel.h"
#include "kernels/payload.h"

namespace dq {

void build_level_table(int bits, float eps, bool nonuniform, LevelTable* t) {
  std::memset(t, 0, sizeof *t);
  const int L = max_magnitude(bits);
  t->max_mag = L;
  const double q = 1.0 + 2.0 * static_cast<double>(eps) * eps;
  const double top = std::pow(q, L) - 1.0;
  // An eps below about 1e-8 makes q round to 1 and top 0, and 0 / 0 would make every level NaN
  // (and every result of a finite input): such levels are the uniform ones, the limit of
  // (q^r - 1) / (q^L - 1) as q -> 1.
  const bool geometric = nonuniform && L > 1 && eps > 0.0f && top > 0.0;
  for (int r = 0; r <= L; ++r) {
    double f = geometric ? (std::pow(q, r) - 1.0) / top : static_cast<double>(r) / L;
    t->level[r] = static_cast<float>(f);
  }
  t->level[L] = 1.0f;
  t->level[L + 1] = 2.0f;  // sentinel: never <= a magnitude in [0, 1]
  for (int r = 0; r < L; ++r) t->inv_gap[r] = 1.0f / (t->level[r + 1] - t->level[r]);
  t->inv_gap[L] = 0.0f;
  int most = 0;
  for (int cell = 0; cell <= kLevelGrid; ++cell) {
    float lo = static_cast<float>(cell) / kLevelGrid;
    int r = 0;
    while (r < L && t->level[r + 1] <= lo) ++r;
    t->start[cell] = r;
    // Levels strictly inside this cell: each needs one fix-up step in level_floor().
    float hi = static_cast<float>(cell + 1) / kLevelGrid;
    int inside = 0;
    for (int k = r + 1; k <= L; ++k)
      if (t->level[k] < hi) ++inside;
    most = std::max(most, inside);
  }
  t->extra_steps = most;
  for (int code = 0; code <= 2 * L; ++code) {
    const int signed_mag = code - L;
    const float mag = t->level[signed_mag < 0 ? -signed_mag : signed_mag];
    t->decode[code] = signed_mag < 0 ? -mag : mag;
  }
}

DynamiqCodecBase::DynamiqCodecBase(const DynamiqOptions& o) : opt_(o) {
  const int bits[3] = {2, 4, 8};
  for (int i = 0; i < 3; ++i)
    build_level_table(bits[i], o.eps[i], o.nonuniform_levels, &levels_[i]);
  for (int b : {2, 4, 8, 16}) record_[width_index(b)] = record_bytes(b, o.hierarchical_scales);
  plan_.mean_subtraction = o.mean_subtraction;
  plan_.variable_widths = o.variable_widths;
  plan_.allow_width16 = o.allow_width16;
  for (int i = 0; i < 4; ++i) plan_.record[i] = record_[i];
}

std::string DynamiqCodecBase::name() const {
  return "dynamiq:" + number_text(opt_.budget_bits, 6) +
         (opt_.correlated_rounding ? "" : ":corr=0") +
         (opt_.nonuniform_levels ? "" : ":levels=uniform") +
         (opt_.hierarchical_scales ? "" : ":scales=flat") +
         (opt_.variable_widths ? "" : ":widths=fixed") + (opt_.mean_subtraction ? "" : ":mean=0");
}

Status DynamiqCodecBase::plan(size_t count, int n_chunks, int n_workers) {
  if (n_chunks < 1 || n_workers < 1 || n_chunks > 65535 || n_workers > 65535)
    DQ_FAIL(Status::kInvalidArgument,
            "dynamiq plan: n_chunks=%d n_workers=%d out of range 1..65535", n_chunks, n_workers);
  if (count > kMaxElementIndex)
    DQ_FAIL(Status::kInvalidArgument, "dynamiq plan: %zu elements exceed the 2^34 limit", count);
  const size_t n_sg = (count + kSuperGroup - 1) / kSuperGroup;
  const size_t max_record = static_cast<size_t>(record_[opt_.allow_width16 ? 3 : 2]);
  const size_t min_record = static_cast<size_t>(record_[0]);
  size_t capacity = kChunkHeaderBytes, stride = 0;
  bool honest = true;
  if (n_sg > 0) {
    // Bytes the budget allows for one compressed copy, minus the statistics (BF16 words).
    const double budget_bytes = std::floor(opt_.budget_bits * static_cast<double>(count) / 8.0);
    const double for_chunks =
        budget_bytes - 2.0 * static_cast<double>(dq::stats_words(n_sg, n_workers));
    const size_t by_budget = for_chunks > 0 ? static_cast<size_t>(for_chunks) / n_chunks : 0;
    // Cuts fall where a record starts: a chunk holds at most stride - 1 + max_record bytes.
    auto capacity_for = [&](size_t record) {
      const size_t per_chunk = (record * n_sg + n_chunks - 1) / n_chunks;
      return kChunkHeaderBytes + max_record - 1 + std::max<size_t>(1, per_chunk);
    };
    // Too small for the budget (a few super-groups per chunk): compressing cannot pay, so
    // give every super-group room for the widest record rather than starving it at 2 bits.
    honest = by_budget >= capacity_for(min_record);
    capacity = honest ? by_budget : capacity_for(max_record);
    stride = dynamiq_stride(capacity, max_record);
  }
  // Record offsets within a chunk are 32-bit layout words.
  if (capacity > UINT32_MAX)
    DQ_FAIL(Status::kInvalidArgument, "dynamiq plan: %zu-byte chunk messages; cut into more chunks",
            capacity);
  count_ = count;
  n_chunks_ = n_chunks;
  n_workers_ = n_workers;
  plan_.count = count;
  plan_.n_sg = n_sg;
  plan_.n_chunks = n_chunks;
  plan_.n_workers = n_workers;
  plan_.capacity = capacity;
  plan_.stride = stride;
  honest_ = honest;
  sections_ = dynamiq_sections(n_sg, static_cast<size_t>(n_chunks));
  return Status::kOk;
}

Status DynamiqCodecBase::local_stats(const ConstTensor& x, uint16_t* stats) const {
  if (x.count != count_)
    DQ_FAIL(Status::kInvalidArgument, "dynamiq stats: tensor has %zu elements, plan has %zu",
            x.count, count_);
  if (x.dtype != DType::kF32 && x.dtype != DType::kBF16)
    DQ_FAIL(Status::kInvalidArgument, "dynamiq stats: dtype %d is neither FP32 nor BF16",
            static_cast<int>(x.dtype));
  if ((x.data == nullptr && count_ > 0) || (stats == nullptr && plan_.n_sg > 0))
    DQ_FAIL(Status::kInvalidArgument, "dynamiq stats: no tensor or no statistics buffer");
  // In tiles of 16 super-groups, so that no two tasks share a word of all-zero counts (a tile
  // holds whole words: zero_counts_per_word() divides 16).
  constexpr size_t kTile = 16;
  const size_t tiles = (plan_.n_sg + kTile - 1) / kTile;
  dq::parallel_for(tbb::blocked_range<size_t>(0, tiles, 16), [&](const auto& range) {
    stats_range(x, range.begin() * kTile, std::min(range.end() * kTile, plan_.n_sg), stats);
  });
  return Status::kOk;
}

Status DynamiqCodecBase::fused_hop(const void* layout, int chunk, const ConstTensor& own,
                                   const ByteView* in, int n_in, uint8_t* out,
                                   const RoundingKey& key) const {
  DQ_CHECK(check_chunk_arg(chunk));
  DQ_CHECK(check_layout(layout));
  if (own.count != count_ || (own.data == nullptr && count_ > 0))
    DQ_FAIL(Status::kInvalidArgument, "dynamiq hop: own tensor has %zu elements, plan has %zu",
            own.count, count_);
  if (own.dtype != DType::kF32 && own.dtype != DType::kBF16)
    DQ_FAIL(Status::kInvalidArgument, "dynamiq hop: dtype %d is neither FP32 nor BF16",
            static_cast<int>(own.dtype));
  if (n_in < 0 || n_in > kMaxFusedInputs || (n_in > 0 && in == nullptr))
    DQ_FAIL(Status::kInvalidArgument, "dynamiq hop: %d inputs, at most %d", n_in, kMaxFusedInputs);
  if (out == nullptr) DQ_FAIL(Status::kInvalidArgument, "dynamiq hop: no output buffer");
  if (key.strata < 1 || key.stratum >= key.strata)
    DQ_FAIL(Status::kInvalidArgument, "dynamiq hop: stratum %u of %u", key.stratum, key.strata);
  DQ_CHECK(check_element_base(key, count_));
  const DynamiqLayout l = view(layout);
  DQ_CHECK(check_chunk_records(l, chunk));
  int contrib = 1;
  const uint8_t* inputs[kMaxFusedInputs];
  for (int i = 0; i < n_in; ++i) {
    ChunkHeader h;
    DQ_CHECK(check_input(l, chunk, in[i], &h));
    contrib += h.n_contrib;
    inputs[i] = in[i].data + kChunkHeaderBytes;
  }
  if (contrib > n_workers_)
    DQ_FAIL(Status::kMalformedPayload, "dynamiq hop: inputs sum %d workers, only %d exist", contrib,
            n_workers_);
  write_chunk_header(out, ChunkHeader{CodecId::kDynamiq, static_cast<uint16_t>(chunk),
                                      static_cast<uint16_t>(contrib),
                                      static_cast<uint32_t>(l.call()), l.chunk_check[chunk]});
  uint8_t* body = out + kChunkHeaderBytes;
  std::memset(body + l.chunk_content[chunk], 0,
              plan_.capacity - kChunkHeaderBytes - l.chunk_content[chunk]);
  std::atomic<bool> malformed{false};
  const uint32_t first = l.chunk_first[chunk], last = l.chunk_first[chunk + 1];
  const HopArgs args{&own, inputs, n_in, body, &key, key.element_base / kSuperGroup, last};
  dq::parallel_for(tbb::blocked_range<uint32_t>(first, last, 16), [&](const auto& range) {
    if (!fuse_range(l, range.begin(), range.end(), args))
      malformed.store(true, std::memory_order_relaxed);
  });
  if (malformed.load())
    DQ_FAIL(Status::kMalformedPayload, "dynamiq hop: chunk %d input holds invalid codes or scales",
            chunk);
  return Status::kOk;
}

Status DynamiqCodecBase::decode_finish(const void* layout, int chunk, ByteView in, void* out,
                                       DType out_dtype, ReduceOp op, int n_contrib) const {
  DQ_CHECK(check_chunk_arg(chunk));
  DQ_CHECK(check_layout(layout));
  const DynamiqLayout l = view(layout);
  DQ_CHECK(check_chunk_records(l, chunk));
  if (out == nullptr && count_ > 0) DQ_FAIL(Status::kInvalidArgument, "dynamiq finish: no output");
  if (out_dtype != DType::kF32 && out_dtype != DType::kBF16)
    DQ_FAIL(Status::kInvalidArgument, "dynamiq finish: output dtype %d is neither FP32 nor BF16",
            static_cast<int>(out_dtype));
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg)
    DQ_FAIL(Status::kInvalidArgument, "dynamiq finish: reduction %d is neither SUM nor AVG",
            static_cast<int>(op));
  ChunkHeader h;
  DQ_CHECK(check_input(l, chunk, in, &h));
  if (h.n_contrib != n_contrib)
    DQ_FAIL(Status::kMalformedPayload, "dynamiq finish: payload sums %u workers, expected %d",
            h.n_contrib, n_contrib);
  const uint8_t* body = in.data + kChunkHeaderBytes;
  // Validate the whole chunk before writing anything: a malformed payload leaves the caller's
  // output untouched (one extra read of the compressed bytes, about 1/6 of the output's).
  std::atomic<bool> malformed{false};
  dq::parallel_for(tbb::blocked_range<uint32_t>(l.chunk_first[chunk], l.chunk_first[chunk + 1], 64),
                   [&](const auto& range) {
                     if (!records_valid(l, body, range.begin(), range.end()))
                       malformed.store(true, std::memory_order_relaxed);
                   });
  if (malformed.load())
    DQ_FAIL(Status::kMalformedPayload,
            "dynamiq finish: chunk %d holds invalid codes or scales; output left untouched", chunk);
  const float contributors = static_cast<float>(n_contrib);
  dq::parallel_for(tbb::blocked_range<uint32_t>(l.chunk_first[chunk], l.chunk_first[chunk + 1], 16),
                   [&](const auto& range) {
                     finish_range(l, body, range.begin(), range.end(), out, out_dtype, op,
                                  contributors);
                   });
  return Status::kOk;
}

void DynamiqCodecBase::layout_ranges(const void* layout, int chunk,
                                     std::vector<std::pair<size_t, size_t>>* ranges) const {
  ranges->clear();
  if (chunk < 0 || chunk >= n_chunks_ || layout == nullptr) return;
  const DynamiqLayout l = view(layout);
  std::vector<uint32_t> sgs(l.order + l.chunk_first[chunk], l.order + l.chunk_first[chunk + 1]);
  std::sort(sgs.begin(), sgs.end());
  for (uint32_t j : sgs) {
    size_t b = static_cast<size_t>(j) * kSuperGroup, e = std::min(count_, b + kSuperGroup);
    if (!ranges->empty() && ranges->back().second == b)
      ranges->back().second = e;
    else
      ranges->emplace_back(b, e);
  }
}

DynamiqLayoutView DynamiqCodecBase::introspect(const void* layout) const {
  DynamiqLayoutView v{nullptr, nullptr, nullptr, plan_.n_sg, honest_};
  if (layout == nullptr) return v;
  const DynamiqLayout l = view(layout);
  v.widths = l.width;
  v.order = l.order;
  v.chunk_first = l.chunk_first;
  return v;
}

// A layout built for this plan (its header names count, chunks and workers).
Status DynamiqCodecBase::check_layout(const void* layout) const {
  if (layout == nullptr)
    DQ_FAIL(Status::kInvalidArgument, "dynamiq: no layout (agree()/build_layout() first)");
  const DynamiqLayout l = view(layout);
  if (l.header[1] != count_ || l.header[2] != dynamiq_plan_shape(n_chunks_, n_workers_))
    DQ_FAIL(Status::kInvalidArgument, "dynamiq: layout built for another plan (%llu elements)",
            static_cast<unsigned long long>(l.header[1]));
  return Status::kOk;
}

Status DynamiqCodecBase::check_chunk_records(const DynamiqLayout& l, int chunk) const {
  const uint64_t content = l.chunk_content[chunk];
  if (content + kChunkHeaderBytes > plan_.capacity)
    DQ_FAIL(Status::kInvalidArgument,
            "dynamiq: the layout's chunk %d holds %llu bytes, a message %zu: a layout of another "
            "budget",
            chunk, static_cast<unsigned long long>(content), plan_.capacity);
  for (uint32_t i = l.chunk_first[chunk]; i < l.chunk_first[chunk + 1]; ++i) {
    const uint64_t end = static_cast<uint64_t>(l.offset[i]) +
                         static_cast<uint64_t>(plan_.record[width_index(l.width[l.order[i]])]);
    if (end > content)
      DQ_FAIL(Status::kInvalidArgument,
              "dynamiq: the layout's record %u of chunk %d ends at byte %llu of %llu: a layout of "
              "another record format",
              i, chunk, static_cast<unsigned long long>(end),
              static_cast<unsigned long long>(content));
  }
  return Status::kOk;
}

Status DynamiqCodecBase::check_chunk_arg(int chunk) const {
  if (chunk < 0 || chunk >= n_chunks_)
    DQ_FAIL(Status::kInvalidArgument, "dynamiq: chunk %d outside 0..%d", chunk, n_chunks_ - 1);
  return Status::kOk;
}

Status DynamiqCodecBase::check_input(const DynamiqLayout& l, int chunk, ByteView in,
                                     ChunkHeader* h) const {
  const size_t need = kChunkHeaderBytes + l.chunk_content[chunk];
  if (in.data == nullptr || in.size < need)
    DQ_FAIL(Status::kMalformedPayload, "dynamiq: chunk %d payload has %zu bytes, layout needs %zu",
            chunk, in.size, need);
  ChunkHeader expect{CodecId::kDynamiq, static_cast<uint16_t>(chunk), 0,
                     static_cast<uint32_t>(l.call()), l.chunk_check[chunk]};
  return check_chunk_header(in, expect, n_workers_, h);
}

std::unique_ptr<Codec> make_dynamiq_codec(const DynamiqOptions& options) {
  return for_host_isa(&make_dynamiq_codec_scalar, &make_dynamiq_codec_avx2,
                      &make_dynamiq_codec_avx512)(options);
}

DynamiqLayoutView dynamiq_layout(const Codec& codec, const void* layout) {
  const auto* d = dynamic_cast<const DynamiqCodecBase*>(&codec);
  return d ? d->introspect(layout) : DynamiqLayoutView{};
}

DynamiqLayoutView dynamiq_layout(const Codec& codec) {
  return dynamiq_layout(codec, codec.owned_layout());
}

bool dynamiq_parameters(const Codec& codec, DynamiqOptions* options, DynamiqPlan* plan) {
  const auto* d = dynamic_cast<const DynamiqCodecBase*>(&codec);
  if (d == nullptr) return false;
  d->parameters(options, plan);
  return true;
}

}  // namespace dq
