// The DynamiQ host codec's hot loops (statistics, fused hop, finish), written once and compiled
// once per host instruction set: kernels/dynamiq_host_scalar.cc (baseline x86-64),
// kernels/dynamiq_host_avx2.cc (AVX2, no FMA) and kernels/dynamiq_host_avx512.cc (the AVX2 source
// compiled for AVX-512 at 256 bits) include this file inside their own namespace
// (DQ_HOST_ISA_NS) with DQ_HOST_AVX2 = 0 or 1 (the AVX2 intrinsics of kernels/dynamiq_avx2.h),
// after every shared header, so that nothing else is compiled for the wider target (an inline
// function of a shared header compiled for AVX2 could be the copy the linker keeps, and fault on
// a CPU without it). Every path gives the same bytes: the same IEEE operations in the same order
// as the pointwise functions of dynamiq_math.h.
// Not a stand-alone header: no include guard, no includes.

namespace dq::DQ_HOST_ISA_NS {

#if DQ_HOST_AVX2
using namespace avx2;
#else
// Width-specific code (un)packing, LSB-first in coordinate order; loops the compiler vectorises.
inline void unpack_supergroup(int bits, const uint8_t* in, uint8_t* codes) {
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

inline void pack_supergroup(int bits, const uint8_t* codes, uint8_t* out) {
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
#endif

// One super-group's values as FP32 (valid of them; the rest of v untouched), times `scale`
// (2^K_j, exact) less the (scaled) mean.
template <typename T>
inline void load_supergroup(const T* x, int valid, float scale, float mu, float* v) {
  if (scale != 1.0f) {  // far from unit scale (kernels/dynamiq_range.h)
    for (int k = 0; k < valid; ++k) {
      if constexpr (sizeof(T) == 4)
        v[k] = x[k] * scale - mu;
      else
        v[k] = bf16_to_f32(x[k]) * scale - mu;
    }
    return;
  }
  for (int k = 0; k < valid; ++k) {
    if constexpr (sizeof(T) == 4)
      v[k] = x[k] - mu;
    else
      v[k] = bf16_to_f32(x[k]) - mu;
  }
}

// Sum and sum of squares of one super-group, sequential within each group of 16 and then over
// groups (the canonical order the device uses); non_zero: any value != 0, NaN included.
template <typename T>
inline void supergroup_sums(const T* x, int valid, float* sum, float* sum_sq, bool* non_zero) {
  float s = 0.0f, q = 0.0f;
  bool nz = false;
  for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
    float gs = 0.0f, gq = 0.0f;
    const int end = valid < (g + 1) * kGroup ? valid : (g + 1) * kGroup;
    for (int k = g * kGroup; k < end; ++k) {
      float v;
      if constexpr (sizeof(T) == 4)
        v = x[k];
      else
        v = bf16_to_f32(x[k]);
      gs += v;
      gq += v * v;
      nz = nz || v != 0.0f;
    }
    s += gs;
    q += gq;
  }
  *sum = s;
  *sum_sq = q;
  *non_zero = nz;
}

#if DQ_HOST_AVX2
// supergroup_sums() of a whole super-group (256 values), eight groups at a time: the same
// floats (group_sums_x8() keeps each group's order; the groups' sums are added as there).
template <typename T>
inline void full_supergroup_sums(const T* x, float* sum, float* sum_sq, bool* non_zero) {
  alignas(32) float gs[kGroupsPerSuperGroup], gq[kGroupsPerSuperGroup];
  __m256 nz = _mm256_setzero_ps();
  for (int half = 0; half < 2; ++half) {
    __m256 s, q, z;
    group_sums_x8(x + 8 * kGroup * half, &s, &q, &z);
    _mm256_store_ps(gs + 8 * half, s);
    _mm256_store_ps(gq + 8 * half, q);
    nz = _mm256_or_ps(nz, z);
  }
  float s = 0.0f, q = 0.0f;
  for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
    s += gs[g];
    q += gq[g];
  }
  *sum = s;
  *sum_sq = q;
  *non_zero = _mm256_movemask_ps(nz) != 0;
}
#endif

// supergroup_sums() of `valid` values, on the path's fastest form.
template <typename T>
inline void statistic_sums(const T* x, int valid, float* sum, float* sum_sq, bool* non_zero) {
#if DQ_HOST_AVX2
  if (valid == kSuperGroup) return full_supergroup_sums(x, sum, sum_sq, non_zero);
#endif
  supergroup_sums(x, valid, sum, sum_sq, non_zero);
}

class HotCodec final : public DynamiqCodecBase {
 public:
  explicit HotCodec(const DynamiqOptions& o) : DynamiqCodecBase(o) {
#if DQ_HOST_AVX2
    for (int i = 0; i < 3; ++i) {
      build_fast_levels(levels_[i], &fast_[i]);
      init_levels_x8(levels_[i], fast_[i], &levels_x8_[i]);
    }
#endif
  }

 protected:
  void stats_range(const ConstTensor& x, size_t first, size_t last,
                   uint16_t* stats) const override {
    const size_t per = static_cast<size_t>(zero_counts_per_word(n_workers_));
    const size_t n_sg = (count_ + kSuperGroup - 1) / kSuperGroup;
    unsigned all_zero = 0;  // bit j % per: super-group j's values are all zero
    for (size_t j = first; j != last; ++j) {
      const size_t base = j * kSuperGroup;
      const int valid = static_cast<int>(std::min<size_t>(kSuperGroup, count_ - base));
      float sum, sum_sq;
      bool non_zero;  // this worker changes the sum
      if (x.dtype == DType::kF32)
        statistic_sums(static_cast<const float*>(x.data) + base, valid, &sum, &sum_sq, &non_zero);
      else
        statistic_sums(static_cast<const uint16_t*>(x.data) + base, valid, &sum, &sum_sq,
                       &non_zero);
      float mean = sum / static_cast<float>(valid);
      uint16_t energy_word = f32_to_bf16_sat(sum_sq);
      if (!energy_in_window(sum_sq)) {  // far from unit scale: dynamiq_range.h
        if (x.dtype == DType::kF32) {
          const float* xs = static_cast<const float*>(x.data) + base;
          wide_statistics([xs](int k) { return xs[k]; }, valid, sum_sq, &mean, &energy_word);
        } else {
          const uint16_t* xs = static_cast<const uint16_t*>(x.data) + base;
          wide_statistics([xs](int k) { return bf16_to_f32(xs[k]); }, valid, sum_sq, &mean,
                          &energy_word);
        }
      }
      stats[stat_word(j, kStatMean)] = f32_to_bf16_sat(mean);
      stats[stat_word(j, kStatEnergy)] = energy_word;
      if (!non_zero) all_zero |= 1u << (j % per);
      if (j % per == per - 1 || j + 1 == n_sg) {  // `first` starts a word (local_stats)
        stats[zero_count_word(n_sg, j, n_workers_)] = zero_count_word_of(all_zero, n_workers_);
        all_zero = 0;
      }
    }
  }

  bool fuse_range(const DynamiqLayout& l, uint32_t first, uint32_t last,
                  const HopArgs& a) const override {
    const uint8_t* recs[kMaxFusedInputs];
    bool ok = true;
    for (uint32_t t = first; t != last; ++t) {
      const uint32_t i = l.by_index[t];  // wire position, visited in super-group order
      // The records of the four width classes are four interleaved streams: fetch them and
      // the own values kPrefetchAhead super-groups ahead.
      if (t + kPrefetchAhead < a.end) {
        const uint32_t ahead = l.by_index[t + kPrefetchAhead];
        prefetch_own(*a.own, l.order[ahead]);
        for (int k = 0; k < a.n_in; ++k)
          prefetch_line(reinterpret_cast<const char*>(a.inputs[k] + l.offset[ahead]));
      }
      for (int k = 0; k < a.n_in; ++k) recs[k] = a.inputs[k] + l.offset[i];
      ok &= fuse_supergroup(l, l.order[i], *a.own, recs, a.n_in, a.body + l.offset[i], *a.key,
                            a.sg_base);
    }
    return ok;
  }

  bool records_valid(const DynamiqLayout& l, const uint8_t* body, uint32_t first,
                     uint32_t last) const override {
    bool ok = true;
    for (uint32_t i = first; i != last; ++i)
      ok &= record_valid(l.width[l.order[i]], body + l.offset[i]);
    return ok;
  }

  void finish_range(const DynamiqLayout& l, const uint8_t* body, uint32_t first, uint32_t last,
                    void* out, DType out_dtype, ReduceOp op, float contributors) const override {
    alignas(32) float v[kSuperGroup];
    for (uint32_t t = first; t != last; ++t) {
      const uint32_t i = l.by_index[t];  // the output is written front to back
      const uint32_t j = l.order[i];
      const int bits = l.width[j];
      // The record decoded into v as if added to zeros (0 + x, so a -0 reads +0): no fill of v,
      // which as a 1 KiB memset (and the copy out, below) took most of this loop's own time.
      accumulate_record<true>(bits, body + l.offset[i], v);  // validated before
      const size_t base = static_cast<size_t>(j) * kSuperGroup;
      const int valid = static_cast<int>(std::min<size_t>(kSuperGroup, count_ - base));
      const float shift = bits == 16 ? 0.0f : contributors * l.mean[j];
      // The mean back, the average, then back from 2^K_j (kernels/dynamiq_range.h), each rounded
      // in that order, written where the FP32 output goes (no copy after).
      float* y = out_dtype == DType::kF32 ? static_cast<float*>(out) + base : v;
      const bool scaled = l.exponent[j] != 0;
      const float back = scaled ? pow2f(-l.exponent[j]) : 1.0f;
      const bool average = op == ReduceOp::kAvg;
      for (int k = 0; k < valid; ++k) {  // (the compiler takes the two tests out of the loop)
        float r = v[k] + shift;
        if (average) r = r / contributors;
        if (scaled) r = r * back;
        y[k] = r;
      }
      if (out_dtype != DType::kF32) {
        uint16_t* o = static_cast<uint16_t*>(out) + base;
        for (int k = 0; k < valid; ++k) o[k] = f32_to_bf16_rne(v[k]);
      }
    }
  }

 private:
  // Super-groups (1 KiB of FP32 each) ahead: 2 left the fused hop at 3.9 ns/value on 64 MiB,
  // 6..12 gave 2.9..3.1 (in-cache compute: 2.45), on the 2-core development machine.
  static constexpr uint32_t kPrefetchAhead = 8;

  // Always inlined: GCC's IPA marks a function holding only prefetches as const and then
  // deletes its calls.
  __attribute__((always_inline)) void prefetch_own(const ConstTensor& own, uint32_t j) const {
    if (static_cast<size_t>(j + 1) * kSuperGroup > count_) return;  // partial: not worth it
    const char* p = static_cast<const char*>(own.data) +
                    static_cast<size_t>(j) * kSuperGroup * dtype_size(own.dtype);
    const int lines = kSuperGroup * static_cast<int>(dtype_size(own.dtype)) / 64;
    for (int line = 0; line < lines; ++line) prefetch_line(p + 64 * line);
  }
  __attribute__((always_inline)) static void prefetch_line(const char* p) {
    __builtin_prefetch(p, 0, 3);
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
      if (bits == 8)
        bad |= x == 0xFF;
      else if (bits == 4)
        bad |= (x & 0x0F) == 0x0F || (x & 0xF0) == 0xF0;
      else
        bad |= (x & (x >> 1) & 0x55) != 0;  // a 2-bit code 3
    }
    return bad == 0;
  }

  // Decodes one record and adds it into v[0..255] (kFirst: into zeros, whatever v holds). Returns
  // false on invalid content.
  template <bool kFirst = false>
  bool accumulate_record(int bits, const uint8_t* rec, float* v) const {
    if (bits == 16) {
      for (int k = 0; k < kSuperGroup; ++k)
        v[k] = (kFirst ? 0.0f : v[k]) +
               bf16_to_f32(static_cast<uint16_t>(rec[2 * k] | (rec[2 * k + 1] << 8)));
      return true;
    }
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
#if DQ_HOST_AVX2
    const LevelsX8& lv = levels_x8_[quantized_index(bits)];
    const bool codes_ok = with_width(bits, lv.lookup, [&](auto width, auto lookup) {
      constexpr int kBits = decltype(width)::value;
      constexpr Lookup kLookup = decltype(lookup)::value;
      const __m256i max_code = _mm256_set1_epi32(2 * ((1 << (kBits - 1)) - 1));
      __m256i bad = _mm256_setzero_si256();
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
        __m256i a, b;
        unpack_group<kBits>(codes, g, &a, &b);
        bad = _mm256_or_si256(
            bad, _mm256_or_si256(_mm256_cmpgt_epi32(a, max_code), _mm256_cmpgt_epi32(b, max_code)));
        const __m256 s = _mm256_set1_ps(scale[g]);
        float* vg = v + g * kGroup;
        const __m256 before = kFirst ? _mm256_setzero_ps() : _mm256_loadu_ps(vg);
        const __m256 before8 = kFirst ? _mm256_setzero_ps() : _mm256_loadu_ps(vg + 8);
        _mm256_storeu_ps(vg,
                         _mm256_add_ps(before, _mm256_mul_ps(decode_levels<kLookup>(lv, a), s)));
        _mm256_storeu_ps(vg + 8,
                         _mm256_add_ps(before8, _mm256_mul_ps(decode_levels<kLookup>(lv, b), s)));
      }
      return _mm256_testz_si256(bad, bad) != 0;
    });
    return ok && codes_ok;
#else
    const LevelTable& t = levels_[width_index(bits)];
    uint8_t unpacked[kSuperGroup];
    unpack_supergroup(bits, codes, unpacked);
    const uint8_t max_code = static_cast<uint8_t>(2 * t.max_mag);
    uint8_t bad = 0;
    for (int k = 0; k < kSuperGroup; ++k) {
      bad |= unpacked[k] > max_code ? 1 : 0;
      v[k] = (kFirst ? 0.0f : v[k]) + decode_code(t, unpacked[k], scale[k / kGroup]);
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
      std::memset(out, 0, scale_bytes);  // unit / scales 0
      if (opt_.hierarchical_scales) std::memset(out + 2, 1, kGroupsPerSuperGroup);  // factors 1
      std::memset(out + scale_bytes, 0x55, kSuperGroup * 2 / 8);  // 2-bit code 1 = zero
      return true;
    }
    alignas(32) float v[kSuperGroup];
    const float mu = bits == 16 ? 0.0f : l.mean[j];
    const float scale = pow2f(l.exponent[j]);
    if (own.dtype == DType::kF32)
      load_supergroup(static_cast<const float*>(own.data) + base, valid, scale, mu, v);
    else
      load_supergroup(static_cast<const uint16_t*>(own.data) + base, valid, scale, mu, v);
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
  // super-group's index in the caller's whole tensor. One Philox block gives 8 elements' bits
  // (32 blocks per super-group), where drawing per element would cost 256.
  static void rounding_bits(uint64_t jr, const RoundingKey& key, uint16_t* bits) {
    const uint32_t block0 = rounding_block(jr * kSuperGroup);
    for (int q = 0; q < 4; ++q) {
      uint32_t words[4][8];
#if DQ_HOST_AVX2
      store_words(philox_draw_x8(key.seed, key.call, key.rank, kStreamRounding, block0 + 8 * q),
                  words);
#else
      for (int i = 0; i < 8; ++i) {
        const Philox4 w =
            philox_draw(key.seed, key.call, key.rank, kStreamRounding, block0 + 8 * q + i);
        for (int word = 0; word < 4; ++word) words[word][i] = w.v[word];
      }
#endif
      for (int word = 0; word < 4; ++word)
        for (int p = 0; p < kGroup; ++p)
          bits[(4 * word + q) * kGroup + p] =
              static_cast<uint16_t>(words[word][p & 7] >> (16 * (p >> 3)));
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

  // Group maxima of |v| on the magnitude bit patterns (ordered like the floats, NaN above Inf);
  // returns the super-group's.
  static uint32_t group_maxima(const float* v, uint32_t* gmax_bits) {
    uint32_t sgmax_bits = 0;
#if DQ_HOST_AVX2
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
    return sgmax_bits;
  }

  // Writes the record's scales (hierarchical: BF16 unit and 16 factors; flat: 16 BF16 scales),
  // fills scale[] with each group's decoded scale, and returns where the codes go.
  uint8_t* write_scales(const uint32_t* gmax_bits, uint32_t sgmax_bits, uint8_t* out,
                        float* scale) const {
    if (!opt_.hierarchical_scales) {
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
        const uint16_t s = f32_to_bf16_up(f32_from_bits(gmax_bits[g]));
        out[2 * g] = static_cast<uint8_t>(s);
        out[2 * g + 1] = static_cast<uint8_t>(s >> 8);
        scale[g] = bf16_to_f32(s);
      }
      return out + 2 * kGroupsPerSuperGroup;
    }
    const uint16_t unit_bits = supergroup_unit_bf16(f32_from_bits(sgmax_bits));
    const float unit = bf16_to_f32(unit_bits);
    out[0] = static_cast<uint8_t>(unit_bits);
    out[1] = static_cast<uint8_t>(unit_bits >> 8);
#if DQ_HOST_AVX2
    if (unit > 0.0f) {  // group_factor() for 8 groups at a time
      const __m256 vunit = _mm256_set1_ps(unit);
      __m256i factor[2];
      for (int h = 0; h < 2; ++h) {
        const __m256 gmax = _mm256_loadu_ps(reinterpret_cast<const float*>(gmax_bits + 8 * h));
        const __m256 q = _mm256_div_ps(gmax, vunit);
        __m256i f = _mm256_cvttps_epi32(q);
        // ceil: one up where truncation dropped a fraction
        f = _mm256_sub_epi32(
            f, _mm256_castps_si256(_mm256_cmp_ps(_mm256_cvtepi32_ps(f), q, _CMP_LT_OQ)));
        f = _mm256_max_epi32(f, _mm256_set1_epi32(1));
        const __m256 below = _mm256_cmp_ps(q, _mm256_set1_ps(255.0f), _CMP_LT_OQ);  // false for NaN
        f = _mm256_blendv_epi8(_mm256_set1_epi32(255), f, _mm256_castps_si256(below));
        _mm256_storeu_ps(scale + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(f), vunit));
        factor[h] = f;
      }
      const __m256i words16 =
          _mm256_permute4x64_epi64(_mm256_packus_epi32(factor[0], factor[1]), 0xD8);
      _mm_storeu_si128(
          reinterpret_cast<__m128i*>(out + 2),
          _mm_packus_epi16(_mm256_castsi256_si128(words16), _mm256_extracti128_si256(words16, 1)));
      return out + 2 + kGroupsPerSuperGroup;
    }
#endif
    for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
      const uint8_t f = group_factor(f32_from_bits(gmax_bits[g]), unit);
      out[2 + g] = f;
      scale[g] = static_cast<float>(f) * unit;
    }
    return out + 2 + kGroupsPerSuperGroup;
  }

  // Correlated rounding: each group's position pi in the shared permutation of the hop's
  // stratum class (0 with plain rounding); returns the strata count as a float (1 when plain).
  float permutation_positions(uint64_t jr, const RoundingKey& key, float* pi) const {
    const bool corr = opt_.correlated_rounding && key.strata > 1;
    if (!corr) {
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) pi[g] = 0.0f;
      return 1.0f;
    }
    // permutation_key(): group 4q + i takes word i of block group0 / 4 + q.
    uint32_t perm_key[kGroupsPerSuperGroup];
    const uint64_t group0 = jr * kGroupsPerSuperGroup;
#if DQ_HOST_AVX2
    uint32_t words[4][8];  // blocks group0 / 4 .. + 7 (the first 4 used)
    store_words(philox_draw_x8(key.seed, key.call, key.stratum_class, kStreamPermutation,
                               static_cast<uint32_t>(group0 >> 2)),
                words);
    for (int q = 0; q < kGroupsPerSuperGroup / 4; ++q)
      for (int i = 0; i < 4; ++i) perm_key[4 * q + i] = words[i][q];
    uint32_t position[kGroupsPerSuperGroup];
    shuffle_positions_x16(perm_key, key.stratum, key.strata, position);
    for (int g = 0; g < kGroupsPerSuperGroup; ++g) pi[g] = static_cast<float>(position[g]);
#else
    for (int q = 0; q < kGroupsPerSuperGroup / 4; ++q) {
      const Philox4 w = philox_draw(key.seed, key.call, key.stratum_class, kStreamPermutation,
                                    static_cast<uint32_t>((group0 >> 2) + q));
      for (int i = 0; i < 4; ++i) perm_key[4 * q + i] = w.v[i];
    }
    for (int g = 0; g < kGroupsPerSuperGroup; ++g)
      pi[g] = static_cast<float>(shuffle_position(perm_key[g], key.stratum, key.strata));
#endif
    return static_cast<float>(key.strata);
  }

  // Records the 256 values v of super-group jr (index in the caller's whole tensor: it keys the
  // uniforms and the permutation) at `bits` wide.
  void quantize_supergroup(uint64_t jr, int bits, const float* v, uint8_t* out,
                           const RoundingKey& key) const {
    uint32_t gmax_bits[kGroupsPerSuperGroup];
    const uint32_t sgmax_bits = group_maxima(v, gmax_bits);
    alignas(32) float scale[kGroupsPerSuperGroup];
    uint8_t* codes_out = write_scales(gmax_bits, sgmax_bits, out, scale);
    float pi[kGroupsPerSuperGroup];
    const float strata = permutation_positions(jr, key, pi);
    round_codes_out(jr, bits, v, scale, pi, strata, key, codes_out);
  }

  // Stochastic rounding of the 256 values to codes (round_magnitude() and encode_code() per
  // value), packed `bits` wide into codes_out.
  void round_codes_out(uint64_t jr, int bits, const float* v, const float* scale, const float* pi,
                       float strata, const RoundingKey& key, uint8_t* codes_out) const {
#if DQ_HOST_AVX2
    // Blocks j*32 + 8q .. +7 hold the random bits of groups q, 4+q, 8+q, 12+q (word g / 4, low
    // halves then high halves; rounding_block()), so each 8-lane draw feeds four groups.
    const LevelsX8& lv = levels_x8_[quantized_index(bits)];
    const __m256 strata_v = _mm256_set1_ps(strata);
    const uint32_t block0 = rounding_block(jr * kSuperGroup);
    with_width(bits, lv.lookup, [&](auto width, auto lookup) {
      constexpr int kBits = decltype(width)::value;
      constexpr Lookup kLookup = decltype(lookup)::value;
      const __m256i low16 = _mm256_set1_epi32(0xffff);
      for (int q = 0; q < 4; ++q) {
        const Philox4x8 w =
            philox_draw_x8(key.seed, key.call, key.rank, kStreamRounding, block0 + 8 * q);
        for (int word = 0; word < 4; ++word) {
          const int g = 4 * word + q;
          const uint64_t e0 = jr * kSuperGroup + g * kGroup;
          const __m256 s = _mm256_set1_ps(scale[g]), p = _mm256_set1_ps(pi[g]);
          const __m256i a =
              round_codes<kBits, kLookup>(lv, _mm256_loadu_ps(v + g * kGroup), s,
                                          _mm256_and_si256(w.v[word], low16), p, strata_v, key, e0);
          const __m256i b = round_codes<kBits, kLookup>(lv, _mm256_loadu_ps(v + g * kGroup + 8), s,
                                                        _mm256_srli_epi32(w.v[word], 16), p,
                                                        strata_v, key, e0 + 8);
          pack_group<kBits>(a, b, g, codes_out);
        }
      }
    });
#else
    // The random bits of the whole super-group at once: 32 Philox blocks, not one per value.
    uint16_t u16[kSuperGroup];
    rounding_bits(jr, key, u16);
    uint8_t codes[kSuperGroup];
    const LevelTable& t = levels_[width_index(bits)];
    if (bits == 2)
      round_supergroup<2>(t, jr, v, scale, pi, strata, key, u16, codes);
    else if (bits == 4)
      round_supergroup<4>(t, jr, v, scale, pi, strata, key, u16, codes);
    else
      round_supergroup<8>(t, jr, v, scale, pi, strata, key, u16, codes);
    pack_supergroup(bits, codes, codes_out);
#endif
  }

#if !DQ_HOST_AVX2
  // round_magnitude() and encode_code() for the 256 values, without a data-dependent branch
  // (random rounding decisions mispredict half the time: branchy code ran at about 80 cycles
  // per value): one pass finds each value's floor level and threshold, a second decides up or
  // down from the 16 random bits; the rare ties (2^-16 per value) are settled afterwards.
  template <int kBits>
  static void round_supergroup(const LevelTable& t, uint64_t jr, const float* v, const float* scale,
                               const float* pi, float strata, const RoundingKey& key,
                               const uint16_t* u16, uint8_t* codes) {
    constexpr int kMaxMag = (1 << (kBits - 1)) - 1;
    alignas(16) int32_t r[kSuperGroup];
    alignas(16) float x[kSuperGroup];
    if constexpr (kBits < 8) {
      // Few levels: r = how many of levels 1..L lie at or below m (level_floor()), a count the
      // compiler vectorises.
      alignas(16) float m[kSuperGroup];
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
        const float s = scale[g];
        for (int k = g * kGroup; k < (g + 1) * kGroup; ++k) {
          // magnitude_ratio(), |v| as a bit mask (a -0 magnitude rounds as +0 does)
          const float q = f32_from_bits(f32_bits(v[k]) & 0x7fffffffu) / s;
          m[k] = q < 1.0f ? q : 1.0f;
        }
      }
      for (int k = 0; k < kSuperGroup; ++k) r[k] = 0;
      for (int i = 1; i <= kMaxMag; ++i) {
        const float level_i = t.level[i];
        for (int k = 0; k < kSuperGroup; ++k) r[k] += level_i <= m[k] ? 1 : 0;
      }
      for (int g = 0; g < kGroupsPerSuperGroup; ++g) {
        const float p = pi[g];
        for (int k = g * kGroup; k < (g + 1) * kGroup; ++k)
          x[k] = round_up_threshold(t, m[k], r[k], p, strata);
      }
    } else {
      for (int k = 0; k < kSuperGroup; ++k) {
        const int g = k / kGroup;
        const float m = magnitude_ratio(v[k], scale[g]);
        r[k] = level_floor(t, m);
        x[k] = round_up_threshold(t, m, r[k], pi[g], strata);
      }
    }
    int ties = 0;
    for (int k = 0; k < kSuperGroup; ++k) {  // round_up_coarse()
      const float y = x[k] * 65536.0f, u = static_cast<float>(u16[k]);
      const int up = u + 1.0f <= y ? 1 : 0;
      ties |= (u < y ? 1 : 0) & (up ^ 1);
      const int mag = r[k] + up;
      codes[k] = static_cast<uint8_t>(v[k] < 0.0f ? kMaxMag - mag : kMaxMag + mag);
    }
    if (__builtin_expect(ties == 0, 1)) return;
    for (int k = 0; k < kSuperGroup; ++k) {
      if (round_up_coarse(x[k], u16[k]) >= 0) continue;
      const float tie = rounding_tie_uniform(key.seed, key.call, key.rank, jr * kSuperGroup + k);
      codes[k] = static_cast<uint8_t>(
          encode_code(r[k] + round_up_tie(x[k], u16[k], tie), v[k] < 0.0f, kMaxMag));
    }
  }
#endif

  // The level tables' index of a quantized width (2, 4 or 8 bits).
  static int quantized_index(int bits) {
    return bits == 2 ? 0 : bits == 4 ? 1 : 2;
  }

#if DQ_HOST_AVX2
  FastLevels fast_[3];
  LevelsX8 levels_x8_[3];
#endif
};

}  // namespace dq::DQ_HOST_ISA_NS
