#include "kernels/dynamiq_codec.h"

#include <tbb/blocked_range.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/dynamiq_avx2.h"
#include "kernels/dynamiq_layout.h"
#include "kernels/parallel.h"
#include "kernels/payload.h"

namespace dq {

void build_level_table(int bits, float eps, bool nonuniform, LevelTable* t) {
  std::memset(t, 0, sizeof *t);
  const int L = max_magnitude(bits);
  t->max_mag = L;
  const double q = 1.0 + 2.0 * static_cast<double>(eps) * eps;
  const double top = std::pow(q, L) - 1.0;
  for (int r = 0; r <= L; ++r) {
    double f = (nonuniform && L > 1 && eps > 0.0f) ? (std::pow(q, r) - 1.0) / top
                                                   : static_cast<double>(r) / L;
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

namespace {

constexpr int kMaxInputs = 64;  // fused inputs per hop (butterfly: log2(n) + 1 <= 11)

#if !defined(__AVX2__)
// Width-specific code (un)packing, LSB-first in coordinate order; loops the compiler vectorises.
void unpack_supergroup(int bits, const uint8_t* in, uint8_t* codes) {
  if (bits == 8) {
    std::memcpy(codes, in, kSuperGroup);
  } else if (bits == 4) {
    for (int i = 0; i < kSuperGroup / 2; ++i) {
      codes[2 * i] = in[i] & 15;
      codes[2 * i + 1] = in[i] >> 4;
    }
  } else {
    for (int i = 0; i < kSuperGroup / 4; ++i) {
      codes[4 * i] = in[i] & 3;
      codes[4 * i + 1] = (in[i] >> 2) & 3;
      codes[4 * i + 2] = (in[i] >> 4) & 3;
      codes[4 * i + 3] = in[i] >> 6;
    }
  }
}

void pack_supergroup(int bits, const uint8_t* codes, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, codes, kSuperGroup);
  } else if (bits == 4) {
    for (int i = 0; i < kSuperGroup / 2; ++i)
      out[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
  } else {
    for (int i = 0; i < kSuperGroup / 4; ++i)
      out[i] = static_cast<uint8_t>(codes[4 * i] | (codes[4 * i + 1] << 2) |
                                    (codes[4 * i + 2] << 4) | (codes[4 * i + 3] << 6));
  }
}

#else
using namespace avx2;
#endif

inline float load_value(const void* base, DType t, size_t i) {
  if (t == DType::kF32) return static_cast<const float*>(base)[i];
  return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
}

class DynamiqCodec final : public Codec {
 public:
  DynamiqCodec(const DynamiqCodec&) = delete;  // levels_x8_ points into this object
  DynamiqCodec& operator=(const DynamiqCodec&) = delete;
  explicit DynamiqCodec(const DynamiqOptions& o) : opt_(o) {
    const int bits[3] = {2, 4, 8};
    for (int i = 0; i < 3; ++i) build_level_table(bits[i], o.eps[i], o.nonuniform_levels, &levels_[i]);
#if defined(__AVX2__)
    for (int i = 0; i < 3; ++i) {
      build_fast_levels(levels_[i], &fast_[i]);
      init_levels_x8(levels_[i], fast_[i], &levels_x8_[i]);
    }
#endif
    for (int b : {2, 4, 8, 16}) record_[width_index(b)] = record_bytes(b, o.hierarchical_scales);
    plan_.mean_subtraction = o.mean_subtraction;
    plan_.variable_widths = o.variable_widths;
    plan_.allow_width16 = o.allow_width16;
    for (int i = 0; i < 4; ++i) plan_.record[i] = record_[i];
  }

  std::string name() const override {
    char buf[160];
    std::snprintf(buf, sizeof buf, "dynamiq:%g%s%s%s%s%s", opt_.budget_bits,
                  opt_.correlated_rounding ? "" : ":corr=0",
                  opt_.nonuniform_levels ? "" : ":levels=uniform",
                  opt_.hierarchical_scales ? "" : ":scales=flat",
                  opt_.variable_widths ? "" : ":widths=fixed", opt_.mean_subtraction ? "" : ":mean=0");
    return buf;
  }

  Status plan(size_t count, int n_chunks, int n_workers) override {
    if (n_chunks < 1 || n_workers < 1 || n_chunks > 65535 || n_workers > 65535)
      DQ_FAIL(Status::kInvalidArgument, "dynamiq plan: n_chunks=%d n_workers=%d out of range 1..65535",
              n_chunks, n_workers);
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
          budget_bytes - 2.0 * static_cast<double>(kStatsWordsPerSupergroup * n_sg);
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
      stride = capacity - kChunkHeaderBytes - max_record + 1;
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

  size_t stats_words() const override { return kStatsWordsPerSupergroup * plan_.n_sg; }

  Status local_stats(const ConstTensor& x, uint16_t* stats) const override {
    if (x.count != count_)
      DQ_FAIL(Status::kInvalidArgument, "dynamiq stats: tensor has %zu elements, plan has %zu",
              x.count, count_);
    dq::parallel_for(tbb::blocked_range<size_t>(0, plan_.n_sg, 256), [&](const auto& range) {
      for (size_t j = range.begin(); j != range.end(); ++j) {
        const size_t base = j * kSuperGroup;
        const int valid = static_cast<int>(std::min<size_t>(kSuperGroup, count_ - base));
        float sum = 0.0f, sum_sq = 0.0f;
        bool non_zero = false;  // any value != 0 (NaN included): this worker changes the sum
        for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
          float gs = 0.0f, gq = 0.0f;
          for (int k = g * kGroup; k < std::min(valid, (g + 1) * kGroup); ++k) {
            float v = load_value(x.data, x.dtype, base + k);
            gs += v;
            gq += v * v;
            non_zero = non_zero || v != 0.0f;
          }
          sum += gs;
          sum_sq += gq;
        }
        stats[stat_word(j, kStatMean)] = f32_to_bf16_sat(sum / static_cast<float>(valid));
        stats[stat_word(j, kStatEnergy)] = f32_to_bf16_sat(sum_sq);
        stats[stat_word(j, kStatAllZero)] = non_zero ? 0 : kBf16One;
      }
    });
    return Status::kOk;
  }

  size_t layout_bytes() const override { return sections_.bytes; }
  Status build_layout(const uint16_t* reduced, uint64_t call, void* layout) const override {
    return build_dynamiq_layout(plan_, reduced, call, layout);
  }

  size_t chunk_capacity() const override { return plan_.capacity; }
  bool fits_budget() const override { return honest_; }

  Status fused_hop(const void* layout, int chunk, const ConstTensor& own, const ByteView* in,
                   int n_in, uint8_t* out, const RoundingKey& key) const override {
    DQ_CHECK(check_chunk_arg(chunk));
    DQ_CHECK(check_layout(layout));
    if (own.count != count_ || (own.data == nullptr && count_ > 0))
      DQ_FAIL(Status::kInvalidArgument, "dynamiq hop: own tensor has %zu elements, plan has %zu",
              own.count, count_);
    if (n_in < 0 || n_in > kMaxInputs || (n_in > 0 && in == nullptr))
      DQ_FAIL(Status::kInvalidArgument, "dynamiq hop: %d inputs, at most %d", n_in, kMaxInputs);
    if (out == nullptr) DQ_FAIL(Status::kInvalidArgument, "dynamiq hop: no output buffer");
    if (key.strata < 1 || key.stratum >= key.strata)
      DQ_FAIL(Status::kInvalidArgument, "dynamiq hop: stratum %u of %u", key.stratum, key.strata);
    DQ_CHECK(check_element_base(key, count_));
    const DynamiqLayout l = view(layout);
    int contrib = 1;
    const uint8_t* inputs[kMaxInputs];
    for (int i = 0; i < n_in; ++i) {
      ChunkHeader h;
      DQ_CHECK(check_input(l, chunk, in[i], &h));
      contrib += h.n_contrib;
      inputs[i] = in[i].data + kChunkHeaderBytes;
    }
    if (contrib > n_workers_)
      DQ_FAIL(Status::kMalformedPayload, "dynamiq hop: inputs sum %d workers, only %d exist",
              contrib, n_workers_);
    write_chunk_header(out, ChunkHeader{CodecId::kDynamiq, static_cast<uint16_t>(chunk),
                                        static_cast<uint16_t>(contrib),
                                        static_cast<uint32_t>(l.call()), l.chunk_check[chunk]});
    uint8_t* body = out + kChunkHeaderBytes;
    std::memset(body + l.chunk_content[chunk], 0,
                plan_.capacity - kChunkHeaderBytes - l.chunk_content[chunk]);
    std::atomic<bool> malformed{false};
    const uint32_t first = l.chunk_first[chunk], last = l.chunk_first[chunk + 1];
    const uint64_t sg_base = key.element_base / kSuperGroup;  // whole-tensor index of super-group 0
    dq::parallel_for(tbb::blocked_range<uint32_t>(first, last, 16), [&](const auto& range) {
      const uint8_t* recs[kMaxInputs];
      for (uint32_t t = range.begin(); t != range.end(); ++t) {
        const uint32_t i = l.by_index[t];  // wire position, visited in super-group order
        // The records of the four width classes are four interleaved streams: fetch them and
        // the own values kPrefetchAhead super-groups ahead.
        if (t + kPrefetchAhead < last) {
          const uint32_t ahead = l.by_index[t + kPrefetchAhead];
          prefetch_own(own, l.order[ahead]);
          for (int k = 0; k < n_in; ++k) prefetch_line(reinterpret_cast<const char*>(inputs[k] + l.offset[ahead]));
        }
        for (int k = 0; k < n_in; ++k) recs[k] = inputs[k] + l.offset[i];
        if (!fuse_supergroup(l, l.order[i], own, recs, n_in, body + l.offset[i], key, sg_base))
          malformed.store(true, std::memory_order_relaxed);
      }
    });
    if (malformed.load())
      DQ_FAIL(Status::kMalformedPayload, "dynamiq hop: chunk %d input holds invalid codes or scales",
              chunk);
    return Status::kOk;
  }

  Status decode_finish(const void* layout, int chunk, ByteView in, void* out, DType out_dtype,
                       ReduceOp op, int n_contrib) const override {
    DQ_CHECK(check_chunk_arg(chunk));
    DQ_CHECK(check_layout(layout));
    const DynamiqLayout l = view(layout);
    ChunkHeader h;
    DQ_CHECK(check_input(l, chunk, in, &h));
    if (h.n_contrib != n_contrib)
      DQ_FAIL(Status::kMalformedPayload, "dynamiq finish: payload sums %u workers, expected %d",
              h.n_contrib, n_contrib);
    const uint8_t* body = in.data + kChunkHeaderBytes;
    // Validate the whole chunk before writing anything: a malformed payload leaves the caller's
    // output untouched (one extra read of the compressed bytes, about 1/6 of the output's).
    std::atomic<bool> malformed{false};
    dq::parallel_for(
        tbb::blocked_range<uint32_t>(l.chunk_first[chunk], l.chunk_first[chunk + 1], 64),
        [&](const auto& range) {
          for (uint32_t i = range.begin(); i != range.end(); ++i)
            if (!record_valid(l.width[l.order[i]], body + l.offset[i]))
              malformed.store(true, std::memory_order_relaxed);
        });
    if (malformed.load())
      DQ_FAIL(Status::kMalformedPayload,
              "dynamiq finish: chunk %d holds invalid codes or scales; output left untouched",
              chunk);
    const float contributors = static_cast<float>(n_contrib);
    dq::parallel_for(
        tbb::blocked_range<uint32_t>(l.chunk_first[chunk], l.chunk_first[chunk + 1], 16),
        [&](const auto& range) {
          float v[kSuperGroup];
          for (uint32_t t = range.begin(); t != range.end(); ++t) {
            const uint32_t i = l.by_index[t];  // the output is written front to back
            const uint32_t j = l.order[i];
            const int bits = l.width[j];
            std::fill(v, v + kSuperGroup, 0.0f);
            accumulate_record(bits, body + l.offset[i], v);  // validated above
            const size_t base = static_cast<size_t>(j) * kSuperGroup;
            const int valid = static_cast<int>(std::min<size_t>(kSuperGroup, count_ - base));
            const float shift = bits == 16 ? 0.0f : contributors * l.mean[j];
            for (int k = 0; k < valid; ++k) {
              float s = v[k] + shift;
              if (op == ReduceOp::kAvg) s = s / contributors;
              if (out_dtype == DType::kF32) static_cast<float*>(out)[base + k] = s;
              else static_cast<uint16_t*>(out)[base + k] = f32_to_bf16_rne(s);
            }
          }
        });
    return Status::kOk;
  }

  void layout_ranges(const void* layout, int chunk,
                     std::vector<std::pair<size_t, size_t>>* ranges) const override {
    ranges->clear();
    if (chunk < 0 || chunk >= n_chunks_ || layout == nullptr) return;
    const DynamiqLayout l = view(layout);
    std::vector<uint32_t> sgs(l.order + l.chunk_first[chunk], l.order + l.chunk_first[chunk + 1]);
    std::sort(sgs.begin(), sgs.end());
    for (uint32_t j : sgs) {
      size_t b = static_cast<size_t>(j) * kSuperGroup, e = std::min(count_, b + kSuperGroup);
      if (!ranges->empty() && ranges->back().second == b) ranges->back().second = e;
      else ranges->emplace_back(b, e);
    }
  }

  void parameters(DynamiqOptions* options, DynamiqPlan* plan) const {
    *options = opt_;
    *plan = plan_;
  }

  // Introspection (tests): pointers into `layout`, null where it is.
  DynamiqLayoutView introspect(const void* layout) const {
    DynamiqLayoutView v{nullptr, nullptr, nullptr, plan_.n_sg, honest_};
    if (layout == nullptr) return v;
    const DynamiqLayout l = view(layout);
    v.widths = l.width;
    v.order = l.order;
    v.chunk_first = l.chunk_first;
    return v;
  }

 private:
  DynamiqLayout view(const void* layout) const {
    return DynamiqLayout(static_cast<const uint8_t*>(layout), sections_);
  }

  // A layout built for this plan (its header names count, chunks and workers).
  Status check_layout(const void* layout) const {
    if (layout == nullptr)
      DQ_FAIL(Status::kInvalidArgument, "dynamiq: no layout (agree()/build_layout() first)");
    const DynamiqLayout l = view(layout);
    if (l.header[1] != count_ || l.header[2] != dynamiq_plan_shape(n_chunks_, n_workers_))
      DQ_FAIL(Status::kInvalidArgument, "dynamiq: layout built for another plan (%llu elements)",
              static_cast<unsigned long long>(l.header[1]));
    return Status::kOk;
  }

  Status check_chunk_arg(int chunk) const {
    if (chunk < 0 || chunk >= n_chunks_)
      DQ_FAIL(Status::kInvalidArgument, "dynamiq: chunk %d outside 0..%d", chunk, n_chunks_ - 1);
    return Status::kOk;
  }

  Status check_input(const DynamiqLayout& l, int chunk, ByteView in, ChunkHeader* h) const {
    const size_t need = kChunkHeaderBytes + l.chunk_content[chunk];
    if (in.data == nullptr || in.size < need)
      DQ_FAIL(Status::kMalformedPayload, "dynamiq: chunk %d payload has %zu bytes, layout needs %zu",
              chunk, in.size, need);
    ChunkHeader expect{CodecId::kDynamiq, static_cast<uint16_t>(chunk), 0,
                       static_cast<uint32_t>(l.call()), l.chunk_check[chunk]};
    return check_chunk_header(in, expect, n_workers_, h);
  }

  // Super-groups (1 KiB of FP32 each) ahead: 2 left the fused hop at 3.9 ns/value on 64 MiB,
  // 6..12 gave 2.9..3.1 (in-cache compute: 2.45), on the 2-core development machine.
  static constexpr uint32_t kPrefetchAhead = 8;

  // Always inlined: GCC's IPA marks a function holding only prefetches as const and then
  // deletes its calls.
  __attribute__((always_inline)) void prefetch_own(const ConstTensor& own, uint32_t j) const {
    if (static_cast<size_t>(j + 1) * kSuperGroup > count_) return;  // partial: not worth it
    const char* p = static_cast<const char*>(own.data) +
                    static_cast<size_t>(j) * kSuperGroup * dtype_size(own.dtype);
    if (own.dtype == DType::kF32) {
      for (int line = 0; line < kSuperGroup * 4 / 64; ++line) prefetch_line(p + 64 * line);
    } else {
      for (int line = 0; line < kSuperGroup * 2 / 64; ++line) prefetch_line(p + 64 * line);
    }
  }
  __attribute__((always_inline)) static void prefetch_line(const char* p) {
#if defined(__AVX2__)
    _mm_prefetch(p, _MM_HINT_T0);
#else
    __builtin_prefetch(p, 0, 3);
#endif
  }

  // True when a record holds only valid content (docs/FORMAT.md: a non-negative unit, non-zero
  // group factors, no all-ones code).
  bool record_valid(int bits, const uint8_t* rec) const {
    if (bits == 16) return true;
    const uint8_t* codes;
    if (opt_.hierarchical_scales) {
      if (rec[1] & 0x80) return false;
      for (int g = 0; g < kGroupsPerSuperGroup; ++g)
        if (rec[2 + g] == 0) return false;
      codes = rec + 2 + kGroupsPerSuperGroup;
    } else {
      for (int g = 0; g < kGroupsPerSuperGroup; ++g)
        if (rec[2 * g + 1] & 0x80) return false;
      codes = rec + 2 * kGroupsPerSuperGroup;
    }
    int bad = 0;
    for (int i = 0; i < kSuperGroup * bits / 8; ++i) {
      const uint8_t x = codes[i];
      if (bits == 8) bad |= x == 0xFF;
      else if (bits == 4) bad |= (x & 0x0F) == 0x0F || (x & 0xF0) == 0xF0;
      else bad |= (x & (x >> 1) & 0x55) != 0;  // a 2-bit code 3
    }
    return bad == 0;
  }

  // Decodes one record and adds it into v[0..255]. Returns false on invalid content.
  bool accumulate_record(int bits, const uint8_t* rec, float* v) const {
    if (bits == 16) {
      for (int k = 0; k < kSuperGroup; ++k)
        v[k] += bf16_to_f32(static_cast<uint16_t>(rec[2 * k] | (rec[2 * k + 1] << 8)));
      return true;
    }
    [[maybe_unused]] const LevelTable& t = levels_[width_index(bits)];
    float scale[kGroupsPerSuperGroup];
    const uint8_t* codes;
    bool ok = true;
    if (opt_.hierarchical_scales) {
      const float unit = bf16_to_f32(static_cast<uint16_t>(rec[0] | (rec[1] << 8)));
      ok &= (rec[1] & 0x80) == 0;  // negative unit: never written
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
        ok &= rec[2 + g] != 0;
        scale[g] = static_cast<float>(rec[2 + g]) * unit;
      }
      codes = rec + 2 + kGroupsPerSuperGroup;
    } else {
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
        ok &= (rec[2 * g + 1] & 0x80) == 0;
        scale[g] = bf16_to_f32(static_cast<uint16_t>(rec[2 * g] | (rec[2 * g + 1] << 8)));
      }
      codes = rec + 2 * kGroupsPerSuperGroup;
    }
#if defined(__AVX2__)
    const LevelsX8& lv = levels_x8_[width_index(bits)];
    const bool codes_ok = with_width(bits, lv.lookup, [&](auto width, auto lookup) {
      constexpr int kBits = decltype(width)::value;
      constexpr Lookup kLookup = decltype(lookup)::value;
      const __m256i max_code = _mm256_set1_epi32(2 * ((1 << (kBits - 1)) - 1));
      __m256i bad = _mm256_setzero_si256();
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
        __m256i a, b;
        unpack_group<kBits>(codes, g, &a, &b);
        bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_cmpgt_epi32(a, max_code), _mm256_cmpgt_epi32(b, max_code)));
        const __m256 s = _mm256_set1_ps(scale[g]);
        float* vg = v + g * kGroup;
        _mm256_storeu_ps(vg, _mm256_add_ps(_mm256_loadu_ps(vg), _mm256_mul_ps(decode_levels<kLookup>(lv, a), s)));
        _mm256_storeu_ps(vg + 8, _mm256_add_ps(_mm256_loadu_ps(vg + 8), _mm256_mul_ps(decode_levels<kLookup>(lv, b), s)));
      }
      return _mm256_testz_si256(bad, bad) != 0;
    });
    return ok && codes_ok;
#else
    uint8_t unpacked[kSuperGroup];
    unpack_supergroup(bits, codes, unpacked);
    const uint8_t max_code = static_cast<uint8_t>(2 * t.max_mag);
    uint8_t bad = 0;
    for (int k = 0; k < kSuperGroup; ++k) {
      bad |= unpacked[k] > max_code ? 1 : 0;
      v[k] += decode_code(t, unpacked[k], scale[k / kGroup]);
    }
    return ok && bad == 0;
#endif
  }

  // One super-group of the fused hop: own (mean-subtracted) + decoded inputs -> record.
  // sg_base + j, the super-group's index in the caller's whole tensor, keys its randomness.
  bool fuse_supergroup(const DynamiqLayout& l, uint32_t j, const ConstTensor& own,
                       const uint8_t* const* recs, int n_in, uint8_t* out, const RoundingKey& key,
                       uint64_t sg_base) const {
    const int bits = l.width[j];
    const size_t base = static_cast<size_t>(j) * kSuperGroup;
    const int valid = static_cast<int>(std::min<size_t>(kSuperGroup, count_ - base));
    if (l.poisoned(j)) {  // the non-finite mean carries the result; keep the record inert
      const int scale_bytes = record_[0] - kSuperGroup * 2 / 8;
      std::memset(out, 0, scale_bytes);                                  // unit / scales 0
      if (opt_.hierarchical_scales) std::memset(out + 2, 1, kGroupsPerSuperGroup);  // factors 1
      std::memset(out + scale_bytes, 0x55, kSuperGroup * 2 / 8);         // 2-bit code 1 = zero
      return true;
    }
    alignas(32) float v[kSuperGroup];
    const float mu = bits == 16 ? 0.0f : l.mean[j];
    if (own.dtype == DType::kF32) {
      const float* x = static_cast<const float*>(own.data) + base;
      for (int k = 0; k < valid; ++k) v[k] = x[k] - mu;
    } else {
      const uint16_t* x = static_cast<const uint16_t*>(own.data) + base;
      for (int k = 0; k < valid; ++k) v[k] = bf16_to_f32(x[k]) - mu;
    }
    for (int k = valid; k < kSuperGroup; ++k) v[k] = 0.0f;
    bool ok = true;
    for (int i = 0; i < n_in; ++i) ok &= accumulate_record(bits, recs[i], v);
    if (bits == 16) {
      write_bf16_record(sg_base + j, v, out, key);
      return ok;
    }
    quantize_supergroup(sg_base + j, bits, v, out, key);
    return ok;
  }

  // The 16 random bits of each of super-group jr's 256 elements (rounding_bits16()); jr is the
  // super-group's index in the caller's whole tensor.
  static void rounding_bits(uint64_t jr, const RoundingKey& key, uint16_t* bits) {
    const uint32_t block0 = rounding_block(jr * kSuperGroup);
    for (int q = 0; q < 4; ++q) {
      uint32_t words[4][8];
#if defined(__AVX2__)
      const Philox4x8 w = philox_draw_x8(key.seed, key.call, key.rank, kStreamRounding, block0 + 8 * q);
      for (int word = 0; word < 4; ++word)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[word]), w.v[word]);
#else
      for (int i = 0; i < 8; ++i) {
        const Philox4 w = philox_draw(key.seed, key.call, key.rank, kStreamRounding, block0 + 8 * q + i);
        for (int word = 0; word < 4; ++word) words[word][i] = w.v[word];
      }
#endif
      for (int word = 0; word < 4; ++word)
        for (int p = 0; p < kGroup; ++p)
          bits[(4 * word + q) * kGroup + p] = static_cast<uint16_t>(words[word][p & 7] >> (16 * (p >> 3)));
    }
  }

  // Width 16: stochastic rounding to BF16 with the element's 16 random bits: unbiased (exactly
  // 16 bits are discarded) and exact for BF16-representable sums.
  static void write_bf16_record(uint64_t jr, const float* v, uint8_t* out, const RoundingKey& key) {
    uint16_t bits[kSuperGroup];
    rounding_bits(jr, key, bits);
    for (int k = 0; k < kSuperGroup; ++k) {
      const uint16_t h = f32_to_bf16_stochastic(v[k], bits[k]);
      out[2 * k] = static_cast<uint8_t>(h);
      out[2 * k + 1] = static_cast<uint8_t>(h >> 8);
    }
  }

  // Records the 256 values v of super-group jr (index in the caller's whole tensor: it keys the
  // uniforms and the permutation) at `bits` wide.
  void quantize_supergroup(uint64_t jr, int bits, const float* v, uint8_t* out,
                           const RoundingKey& key) const {
    [[maybe_unused]] const LevelTable& t = levels_[width_index(bits)];
    // Group maxima on the magnitude bit patterns: ordered like the floats, NaN above Inf.
    uint32_t gmax_bits[kGroupsPerSuperGroup];
    uint32_t sgmax_bits = 0;
#if defined(__AVX2__)
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
      const __m256i* vg = reinterpret_cast<const __m256i*>(v + g * kGroup);
      const __m256i m8 = _mm256_max_epu32(_mm256_and_si256(_mm256_loadu_si256(vg), abs_mask),
                                          _mm256_and_si256(_mm256_loadu_si256(vg + 1), abs_mask));
      __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(m8), _mm256_extracti128_si256(m8, 1));
      m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(1, 0, 3, 2)));
      m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(2, 3, 0, 1)));
      gmax_bits[g] = static_cast<uint32_t>(_mm_cvtsi128_si32(m4));
    }
    for (int g = 0; g < kGroupsPerSuperGroup; ++g) sgmax_bits = std::max(sgmax_bits, gmax_bits[g]);
#else
    for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
      uint32_t m = 0;
      for (int i = 0; i < kGroup; ++i) {
        const uint32_t a = f32_bits(v[g * kGroup + i]) & 0x7fffffffu;
        m = a > m ? a : m;
      }
      gmax_bits[g] = m;
      sgmax_bits = m > sgmax_bits ? m : sgmax_bits;
    }
#endif
    float scale[kGroupsPerSuperGroup];
    uint8_t* codes_out;
    if (opt_.hierarchical_scales) {
      const uint16_t unit_bits = supergroup_unit_bf16(f32_from_bits(sgmax_bits));
      const float unit = bf16_to_f32(unit_bits);
      out[0] = static_cast<uint8_t>(unit_bits);
      out[1] = static_cast<uint8_t>(unit_bits >> 8);
#if defined(__AVX2__)
      if (unit > 0.0f) {  // group_factor() for 8 groups at a time
        const __m256 vunit = _mm256_set1_ps(unit);
        __m256i factor[2];
        for (int h = 0; h < 2; ++h) {
          const __m256 gmax = _mm256_loadu_ps(reinterpret_cast<const float*>(gmax_bits + 8 * h));
          const __m256 q = _mm256_div_ps(gmax, vunit);
          __m256i f = _mm256_cvttps_epi32(q);
          // ceil: one up where truncation dropped a fraction
          f = _mm256_sub_epi32(f, _mm256_castps_si256(_mm256_cmp_ps(_mm256_cvtepi32_ps(f), q, _CMP_LT_OQ)));
          f = _mm256_max_epi32(f, _mm256_set1_epi32(1));
          const __m256 below = _mm256_cmp_ps(q, _mm256_set1_ps(255.0f), _CMP_LT_OQ);  // false for NaN
          f = _mm256_blendv_epi8(_mm256_set1_epi32(255), f, _mm256_castps_si256(below));
          _mm256_storeu_ps(scale + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(f), vunit));
          factor[h] = f;
        }
        const __m256i words16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(factor[0], factor[1]), 0xD8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2),
                         _mm_packus_epi16(_mm256_castsi256_si128(words16), _mm256_extracti128_si256(words16, 1)));
      } else
#endif
      {
        for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
          const uint8_t f = group_factor(f32_from_bits(gmax_bits[g]), unit);
          out[2 + g] = f;
          scale[g] = static_cast<float>(f) * unit;
        }
      }
      codes_out = out + 2 + kGroupsPerSuperGroup;
    } else {
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
        const uint16_t s = f32_to_bf16_up(f32_from_bits(gmax_bits[g]));
        out[2 * g] = static_cast<uint8_t>(s);
        out[2 * g + 1] = static_cast<uint8_t>(s >> 8);
        scale[g] = bf16_to_f32(s);
      }
      codes_out = out + 2 * kGroupsPerSuperGroup;
    }
    float pi[kGroupsPerSuperGroup];
    const bool corr = opt_.correlated_rounding && key.strata > 1;
    const float strata = corr ? static_cast<float>(key.strata) : 1.0f;
    if (corr) {
      uint32_t perm_key[kGroupsPerSuperGroup];
      const uint64_t group0 = jr * kGroupsPerSuperGroup;
      for (int q = 0; q < kGroupsPerSuperGroup / 4; ++q) {
        const Philox4 w = philox_draw(key.seed, key.call, key.stratum_class, kStreamPermutation,
                                      static_cast<uint32_t>((group0 >> 2) + q));
        for (int i = 0; i < 4; ++i) perm_key[4 * q + i] = w.v[i];
      }
      for (int g = 0; g < kGroupsPerSuperGroup; ++g)
        pi[g] = static_cast<float>(shuffle_position(perm_key[g], key.stratum, key.strata));
    } else {
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) pi[g] = 0.0f;
    }
#if defined(__AVX2__)
    // Blocks j*32 + 8q .. +7 hold the random bits of groups q, 4+q, 8+q, 12+q (word g / 4, low
    // halves then high halves; rounding_block()), so each 8-lane draw feeds four groups.
    const LevelsX8& lv = levels_x8_[width_index(bits)];
    const __m256 strata_v = _mm256_set1_ps(strata);
    const uint32_t block0 = rounding_block(jr * kSuperGroup);
    with_width(bits, lv.lookup, [&](auto width, auto lookup) {
      constexpr int kBits = decltype(width)::value;
      constexpr Lookup kLookup = decltype(lookup)::value;
      const __m256i low16 = _mm256_set1_epi32(0xffff);
      for (int q = 0; q < 4; ++q) {
        const Philox4x8 w = philox_draw_x8(key.seed, key.call, key.rank, kStreamRounding, block0 + 8 * q);
        for (int word = 0; word < 4; ++word) {
          const int g = 4 * word + q;
          const uint64_t e0 = jr * kSuperGroup + g * kGroup;
          const __m256 s = _mm256_set1_ps(scale[g]), p = _mm256_set1_ps(pi[g]);
          const __m256i a = round_codes<kBits, kLookup>(lv, _mm256_loadu_ps(v + g * kGroup), s,
                                                        _mm256_and_si256(w.v[word], low16), p, strata_v, key, e0);
          const __m256i b = round_codes<kBits, kLookup>(lv, _mm256_loadu_ps(v + g * kGroup + 8), s,
                                                        _mm256_srli_epi32(w.v[word], 16), p, strata_v, key, e0 + 8);
          pack_group<kBits>(a, b, g, codes_out);
        }
      }
    });
#else
    uint8_t codes[kSuperGroup];
    for (int k = 0; k < kSuperGroup; ++k) {
      const int g = k / kGroup;
      const int mag = round_magnitude(t, magnitude_ratio(v[k], scale[g]), pi[g], strata, key.seed,
                                      key.call, key.rank, jr * kSuperGroup + k);
      codes[k] = static_cast<uint8_t>(encode_code(mag, v[k] < 0.0f, t.max_mag));
    }
    pack_supergroup(bits, codes, codes_out);
#endif
  }

  DynamiqOptions opt_;
  LevelTable levels_[3];
#if defined(__AVX2__)
  FastLevels fast_[3];
  LevelsX8 levels_x8_[3];
#endif
  int record_[4];
  DynamiqPlan plan_;           // sizes fixed by plan(); what the layout build needs
  DynamiqSections sections_{};  // where each layout section lies, from (n_sg, n_chunks)
  bool honest_ = true;
};

}  // namespace

std::unique_ptr<Codec> make_dynamiq_codec(const DynamiqOptions& options) {
  return std::make_unique<DynamiqCodec>(options);
}

DynamiqLayoutView dynamiq_layout(const Codec& codec, const void* layout) {
  const auto* d = dynamic_cast<const DynamiqCodec*>(&codec);
  return d ? d->introspect(layout) : DynamiqLayoutView{};
}

DynamiqLayoutView dynamiq_layout(const Codec& codec) {
  return dynamiq_layout(codec, codec.owned_layout());
}

bool dynamiq_parameters(const Codec& codec, DynamiqOptions* options, DynamiqPlan* plan) {
  const auto* d = dynamic_cast<const DynamiqCodec*>(&codec);
  if (d == nullptr) return false;
  d->parameters(options, plan);
  return true;
}

}  // namespace dq
