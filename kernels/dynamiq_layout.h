// The per-call DynamiQ layout (docs/FORMAT.md, "DynamiQ"): what every rank derives from the
// all-reduced statistics (means, widths, wire order, chunk cuts, digests, the call number), as
// one flat buffer the caller owns (device memory in the engine). build_dynamiq_layout() writes it
// once per call; the hot path reads it through DynamiqLayout, whose section pointers are plain
// arithmetic on (n_sg, n_chunks), computed once per hop.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/status.h"
#include "kernels/bf16.h"
#include "kernels/chunk_header.h"
#include "kernels/hd.h"

namespace dq {

// The statistics all-reduce (docs/FORMAT.md, "Statistics"): words summed element-wise over the
// workers. Per super-group j, its mean and sum of squares at stat_word(j, kStatMean /
// kStatEnergy), BF16 words; after those 2 n_sg words, the all-zero counts,
// zero_counts_per_word(n_workers) super-groups to a word (zero_count_word()), each in a digit of
// zero_count_bits(n_workers) bits. The count words are BF16 words too, except from 16 to 255
// workers (zero_counts_are_bytes()): there each count is one byte, summed as an unsigned 8-bit
// integer (NCCL's ncclUint8), two to a word in memory order, since a digit of 5 to 8 bits would
// leave a BF16 sum room for one count alone.
inline constexpr size_t kStatMean = 0;    // the worker's mean over the valid elements
inline constexpr size_t kStatEnergy = 1;  // the worker's sum of squares
inline constexpr size_t kStatPairWords = 2;
DQ_HD constexpr size_t stat_word(size_t j, size_t word) {
  return kStatPairWords * j + word;
}

// From 16 to 255 workers an all-zero count is a byte of its own, summed as an unsigned 8-bit
// integer: exact for any count up to 255 in any order of additions.
inline constexpr int kByteCountMinWorkers = 16;
inline constexpr int kByteCountMaxWorkers = 255;
DQ_HD constexpr bool zero_counts_are_bytes(int n_workers) {
  return n_workers >= kByteCountMinWorkers && n_workers <= kByteCountMaxWorkers;
}
// Bits of one all-zero count digit: enough for 0 .. n_workers (a count of workers); a byte from
// 16 to 255 workers.
DQ_HD constexpr int zero_count_bits(int n_workers) {
  if (zero_counts_are_bytes(n_workers)) return 8;
  int bits = 1;
  while (bits < 17 && (1 << bits) <= n_workers) ++bits;
  return bits;
}
// Super-groups whose all-zero counts share one word, as a power of two: 2^this. A summed word is
// then an integer of at most 8 bits, exact in BF16 after any order of additions; a power of two,
// so that a tile of 16 super-groups (the CUDA statistics kernel's) writes whole words and a word's
// index is a shift, not a division (the kernels compute it per super-group). Two bytes a word
// from 16 to 255 workers; from 256 on, one BF16 word a super-group, the count itself.
DQ_HD constexpr int zero_counts_per_word_log2(int n_workers) {
  const int bits = zero_count_bits(n_workers);
  return bits == 1 ? 3 : bits == 2 ? 2 : bits <= 4 || bits == 8 ? 1 : 0;
}
DQ_HD constexpr int zero_counts_per_word(int n_workers) {
  return 1 << zero_counts_per_word_log2(n_workers);
}
// BF16 words of the statistics of n_sg super-groups summed over n_workers.
DQ_HD constexpr size_t stats_words(size_t n_sg, int n_workers) {
  const size_t per = static_cast<size_t>(zero_counts_per_word(n_workers));
  return kStatPairWords * n_sg + (n_sg + per - 1) / per;
}
// The word that holds super-group j's all-zero count.
DQ_HD constexpr size_t zero_count_word(size_t n_sg, size_t j, int n_workers) {
  return kStatPairWords * n_sg + (j >> zero_counts_per_word_log2(n_workers));
}
// Words at the end of the statistics of n_sg super-groups that the all-reduce sums as unsigned
// 8-bit integers (two byte lanes a word): the count words from 16 to 255 workers, else none.
DQ_HD constexpr size_t stats_byte_sum_words(size_t n_sg, int n_workers) {
  return zero_counts_are_bytes(n_workers) ? stats_words(n_sg, n_workers) - kStatPairWords * n_sg
                                          : 0;
}
// The word two byte lanes make in memory (little-endian, as every CUDA platform): byte 0, the
// lower address, is the low half.
DQ_HD constexpr uint16_t byte_lanes_word(unsigned byte0, unsigned byte1) {
  return static_cast<uint16_t>((byte0 & 0xffu) | ((byte1 & 0xffu) << 8));
}
// The all-reduce of two byte-summed words: each lane summed modulo 256, as ncclUint8 does.
DQ_HD constexpr uint16_t byte_lanes_sum(uint16_t a, uint16_t b) {
  return byte_lanes_word((a & 0xffu) + (b & 0xffu), (a >> 8) + (b >> 8));
}
// A worker's count word: bit i of `all_zero` set when super-group i of the word's super-groups
// has all of its values zero; it counts 1 in that super-group's digit. The digits' integer is
// the word itself where the counts are bytes (8-bit digits: byte_lanes_word()), else its BF16
// (an integer below 256, so the pattern is exact).
DQ_HD uint16_t zero_count_word_of(unsigned all_zero, int n_workers) {
  const int bits = zero_count_bits(n_workers), per = zero_counts_per_word(n_workers);
  unsigned value = 0;
  for (int i = 0; i < per; ++i)
    if ((all_zero >> i) & 1u) value |= 1u << (bits * i);
  return zero_counts_are_bytes(n_workers)
             ? static_cast<uint16_t>(value)
             : static_cast<uint16_t>(f32_bits(static_cast<float>(value)) >> 16);
}
// Super-group j's summed all-zero count as one BF16 word (the number of workers whose values are
// all zero there), from its summed count word `word`. One super-group a word: the word itself.
// Several: the digit of j of the word's integer: where the counts are bytes the word itself
// (any byte is a count; out of range it reads as every worker contributing), else its BF16 value
// when that is an integer in [0, 255], else (a peer's bad word) NaN, which reads as not dense
// with every worker contributing (contributing_workers()).
DQ_HD uint16_t summed_all_zero(uint16_t word, size_t j, int n_workers) {
  const int per = zero_counts_per_word(n_workers);
  if (per == 1) return word;
  unsigned value = word;
  if (!zero_counts_are_bytes(n_workers)) {
    const float v = bf16_to_f32(word);
    if (!(v >= 0.0f && v <= 255.0f) || v != static_cast<float>(static_cast<int>(v))) return 0x7fc0u;
    value = static_cast<unsigned>(v);
  }
  const int bits = zero_count_bits(n_workers);
  const unsigned digit = (value >> (bits * static_cast<int>(j & (per - 1)))) & ((1u << bits) - 1u);
  return static_cast<uint16_t>(f32_bits(static_cast<float>(digit)) >> 16);
}

// A super-group's summed statistics as the layout and the budget read them: the mean and energy
// words and its all-zero count (summed_all_zero()).
struct SupergroupStatWords {
  uint16_t mean = 0, energy = 0, all_zero = 0;
};
DQ_HD SupergroupStatWords supergroup_stat_words(const uint16_t* reduced, size_t n_sg, size_t j,
                                                int n_workers) {
  SupergroupStatWords w;
  w.mean = reduced[stat_word(j, kStatMean)];
  w.energy = reduced[stat_word(j, kStatEnergy)];
  w.all_zero = summed_all_zero(reduced[zero_count_word(n_sg, j, n_workers)], j, n_workers);
  return w;
}

// A super-group is dense when no worker's values are all zero (its summed count is +0 or -0: a
// sum of non-negative integers that holds a 1 is never 0). Only a dense super-group has its mean
// subtracted: a worker whose values are all zero then adds exact zeros, and re-rounding a partial
// sum that did not change adds no error (docs/FORMAT.md).
DQ_HD constexpr bool supergroup_dense(uint16_t summed_all_zero_word) {
  return (summed_all_zero_word & 0x7fffu) == 0;
}

// Plan parameters the layout build needs; fixed by DynamiqCodec::plan().
struct DynamiqPlan {
  size_t count = 0;  // elements
  size_t n_sg = 0;   // super-groups, ceil(count / 256)
  int n_chunks = 0;
  int n_workers = 0;
  size_t capacity = 0;  // bytes of every chunk message
  size_t stride = 0;    // spacing of the chunk cuts in the record stream, bytes
  int record[4] = {};   // record bytes of widths 2, 4, 8, 16
  bool mean_subtraction = true;
  bool variable_widths = true;
  bool allow_width16 = true;
};

// The plan's stride for chunk messages of `capacity` bytes whose widest record is `max_record`
// bytes. The layout cuts the record stream every stride bytes, where a record starts: a chunk
// before the last then holds at most stride - 1 + max_record bytes, its whole body, so the
// stride leaves max_record - 1 bytes of such a message for the record a cut runs into.
DQ_HD constexpr size_t dynamiq_stride(size_t capacity, size_t max_record) {
  return capacity - kChunkHeaderBytes - max_record + 1;
}

// Record bytes the plan's widths may take, all chunks together. Each chunk before the last holds
// the records that start within its stride; the last chunk, past every cut, may fill its whole
// body. The slack for a record a cut runs into is thus kept once per cut, not once per message:
// with it kept per message, a plan a few records over its budget's floor (64-68 super-groups a
// chunk at 5 bits) sent some super-groups at 2 bits, up to 2.7x the vNMSE of the call.
DQ_HD constexpr uint64_t dynamiq_record_budget(const DynamiqPlan& p) {
  return p.n_chunks < 1 || p.n_sg == 0
             ? 0
             : static_cast<uint64_t>(p.stride) * static_cast<uint64_t>(p.n_chunks - 1) +
                   (p.capacity - kChunkHeaderBytes);
}

// Byte offsets of the sections of one layout buffer, a function of (n_sg, n_chunks) alone.
// Wider elements first, so every section is aligned in an 8-byte aligned buffer.
struct DynamiqSections {
  size_t header;         // u64[3]: call, count, n_chunks | n_workers << 32 (the plan it is for)
  size_t chunk_content;  // u64[n_chunks]: body bytes of chunk c
  size_t mean;           // f32[n_sg]: mu_j, subtracted by hops and restored by finish (0 without
                         //   mean subtraction); non-finite marks a poisoned super-group
  size_t order;          // u32[n_sg]: super-group at wire position i (widest first, stable)
  size_t offset;         // u32[n_sg]: byte offset of wire record i in its chunk's body
  size_t by_index;       // u32[n_sg]: each chunk's wire positions in super-group order
  size_t chunk_first;    // u32[n_chunks + 1]: first wire position of chunk c
  size_t chunk_check;    // u32[n_chunks]: layout digest of chunk c (its chunk header)
  size_t width;          // u8[n_sg]: bits of super-group j (2, 4, 8, 16)
  size_t exponent;       // i8[n_sg]: K_j, super-group j is coded as its values times 2^K_j
                         //   (0 near unit scale; kernels/dynamiq_range.h)
  size_t bytes;          // total, a multiple of 8
};

constexpr DynamiqSections dynamiq_sections(size_t n_sg, size_t n_chunks) {
  DynamiqSections s{};
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t here = at;
    at += (bytes + 7) / 8 * 8;
    return here;
  };
  s.header = take(3 * 8);
  s.chunk_content = take(8 * n_chunks);
  s.mean = take(4 * n_sg);
  s.order = take(4 * n_sg);
  s.offset = take(4 * n_sg);
  s.by_index = take(4 * n_sg);
  s.chunk_first = take(4 * (n_chunks + 1));
  s.chunk_check = take(4 * n_chunks);
  s.width = take(n_sg);
  s.exponent = take(n_sg);
  s.bytes = at;
  return s;
}

// Typed pointers into one layout buffer: Byte = const uint8_t to read, uint8_t to build.
template <class Byte>
struct DynamiqLayoutT {
  template <class T>
  using Ptr = std::conditional_t<std::is_const_v<Byte>, const T*, T*>;
  Ptr<uint64_t> header, chunk_content;
  Ptr<float> mean;
  Ptr<uint32_t> order, offset, by_index, chunk_first, chunk_check;
  Ptr<uint8_t> width;
  Ptr<int8_t> exponent;

  DynamiqLayoutT(Byte* base, const DynamiqSections& s)
      : header(at<uint64_t>(base, s.header)),
        chunk_content(at<uint64_t>(base, s.chunk_content)),
        mean(at<float>(base, s.mean)),
        order(at<uint32_t>(base, s.order)),
        offset(at<uint32_t>(base, s.offset)),
        by_index(at<uint32_t>(base, s.by_index)),
        chunk_first(at<uint32_t>(base, s.chunk_first)),
        chunk_check(at<uint32_t>(base, s.chunk_check)),
        width(at<uint8_t>(base, s.width)),
        exponent(at<int8_t>(base, s.exponent)) {}

  uint64_t call() const { return header[0]; }
  // Exponent all ones: the mean is Inf or NaN, so a non-finite input was present.
  bool poisoned(size_t j) const {
    uint32_t bits;
    std::memcpy(&bits, mean + j, 4);
    return (bits & 0x7f800000u) == 0x7f800000u;
  }

 private:
  template <class T>
  static Ptr<T> at(Byte* base, size_t offset) {
    return reinterpret_cast<Ptr<T>>(base + offset);
  }
};
using DynamiqLayout = DynamiqLayoutT<const uint8_t>;

// The plan a layout header must name (words 1 and 2).
constexpr uint64_t dynamiq_plan_shape(int n_chunks, int n_workers) {
  return static_cast<uint32_t>(n_chunks) | static_cast<uint64_t>(static_cast<uint32_t>(n_workers))
                                               << 32;
}

// Builds the layout for `plan` from the all-reduced statistics (stats_words() words)
// into `layout` (dynamiq_sections(plan.n_sg, plan.n_chunks).bytes bytes, 8-byte aligned).
// Deterministic: identical inputs give identical bytes. Host code (TBB inside).
Status build_dynamiq_layout(const DynamiqPlan& plan, const uint16_t* reduced_stats_bf16,
                            uint64_t call, void* layout);

}  // namespace dq
