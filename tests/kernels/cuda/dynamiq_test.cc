// DynamiQ's layout, fused-hop and finish kernels (kernels/cuda/dynamiq_layout.cu,
// kernels/cuda/dynamiq_hop.cu, kernels/cuda/dynamiq_finish.cu) under the CUDA emulation against the
// host codec byte for byte:
//  - CudaDynamiqLayout: the whole layout buffer (padding included) of build_layout() for counts
//    from 0 to 4097 super-groups (odd, partial last super-group), 1 to 64 chunks, 1 and 4 workers,
//    poisoned super-groups, every option the layout reads (fixed widths, no width 16, no mean
//    subtraction, flat scales); widths 2, 4, 8 and 16 all occur.
//  - CudaDynamiqHop: every chunk's message of fused_hop() (header, records, padding) for n_in =
//    0..3 inputs, FP32 and BF16 own values, 2 to 64 chunks, correlated and plain rounding,
//    hierarchical and flat scales, uniform levels, no mean subtraction, fixed widths without
//    width 16, a non-zero element base; then decode_finish() of each message (1..4 workers)
//    into FP32 and BF16, SUM and AVG, every output word compared (NaN only as NaN).
//  - Malformed inputs: both sides flag the same messages; the finish leaves the output untouched.
//  - A finish step: a range of chunks in one launch, as the host's finish of each in turn; one
//    bad chunk in it leaves every chunk's output untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "kernels/cuda/dynamiq.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/stats_sum.h"
#include "tests/kernels/cuda/device_buffers.h"

namespace dq::cuda {
namespace {

using test::DeviceArray;
using test::kernel_fault;
using test::reduced_matrix;

struct Config {
  size_t count;
  int n_chunks;
  int n_workers;
  bool bf16;
  bool poison;
  DynamiqOptions opt;
  uint64_t element_base = 0;
  int scale_log2 = 0;  // every value times 2^scale_log2 (the whole-range cases)
};

// Super-group scales spread over 2^-20..2^20, so the allocation uses every width; NaN or Inf
// in one worker's super-group where `poison`.
std::vector<float> make_values(size_t count, uint32_t seed, bool poison) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(count);
  for (size_t base = 0; base < count; base += 256) {
    const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
    const float offset = (rng() % 3 == 0) ? normal(rng) * scale * 4.0f : 0.0f;
    const bool zero = rng() % 17 == 0;
    for (size_t i = base; i < std::min(count, base + 256); ++i)
      x[i] = zero ? 0.0f : normal(rng) * scale + offset;
    if (poison && rng() % 6 == 0) {
      const size_t at = base + rng() % std::min<size_t>(256, count - base);
      x[at] = (rng() % 2) ? std::numeric_limits<float>::quiet_NaN() : -INFINITY;
    }
  }
  return x;
}

struct Case {
  Config cfg;
  std::unique_ptr<Codec> codec;
  DynamiqDeviceParams params;
  LevelTable levels[3];
  std::vector<std::vector<float>> f32;      // per worker
  std::vector<std::vector<uint16_t>> bf16;  // per worker
  std::vector<uint16_t> reduced;
  std::vector<uint64_t> host_layout, dev_layout;
  uint64_t call = 0;

  const void* own(int rank) const {
    return cfg.bf16 ? static_cast<const void*>(bf16[rank].data())
                    : static_cast<const void*>(f32[rank].data());
  }
  ConstTensor tensor(int rank) const {
    return ConstTensor{own(rank), cfg.bf16 ? DType::kBF16 : DType::kF32, cfg.count};
  }
};

// The kernels on device copies of their arguments (under the emulation, the host arrays
// themselves: tests/kernels/cuda/device_buffers.h); what they write comes back to the host.
cudaError_t device_layout(const DynamiqDeviceParams& params, const std::vector<uint16_t>& reduced,
                          uint64_t call, std::vector<uint64_t>* layout, unsigned* error) {
  const DeviceArray<uint16_t> d_reduced(reduced);
  const DeviceArray<uint64_t> d_layout(*layout);
  const DeviceArray<unsigned> d_error(error, 1);
  cudaError_t e =
      launch_dynamiq_layout(params, d_reduced.get(), call, d_layout.get(), d_error.get(), nullptr);
  if (e == cudaSuccess) e = d_layout.fetch(*layout);
  return e == cudaSuccess ? d_error.fetch(error) : e;
}

// The hop of `chunk` with own values of worker key.rank and n_in input messages of
// chunk_capacity() bytes each, on the device's layout; the own values `own_shift` elements past a
// 16-byte boundary (a tensor's view at an offset).
cudaError_t device_hop(const Case& s, int chunk, const uint8_t* const* inputs, int n_in,
                       std::vector<uint8_t>* out, const RoundingKey& key, unsigned* error,
                       int max_blocks = 0, int own_shift = 0) {
  const size_t cap = s.codec->chunk_capacity();
  const DeviceArray<LevelTable> d_levels(s.levels, 3);
  const DeviceArray<uint64_t> d_layout(s.dev_layout);
  const size_t size = s.cfg.bf16 ? 2 : 4;
  std::vector<uint8_t> shifted((s.cfg.count + own_shift) * size);
  std::memcpy(shifted.data() + own_shift * size, s.own(key.rank), s.cfg.count * size);
  const DeviceArray<uint8_t> d_own(shifted.data(), shifted.size());
  std::vector<DeviceArray<uint8_t>> d_inputs;
  d_inputs.reserve(n_in);
  std::vector<const uint8_t*> ptrs;
  for (int i = 0; i < n_in; ++i) {
    d_inputs.emplace_back(inputs[i], cap);
    ptrs.push_back(d_inputs.back().get());
  }
  const DeviceArray<uint8_t> d_out(*out);
  const DeviceArray<unsigned> d_error(error, 1);
  cudaError_t e = launch_dynamiq_hop(s.params, d_levels.get(), d_layout.get(), chunk,
                                     d_own.get() + own_shift * size, s.cfg.bf16, ptrs.data(), n_in,
                                     d_out.get(), key, d_error.get(), nullptr, max_blocks);
  if (e == cudaSuccess) e = d_out.fetch(*out);
  return e == cudaSuccess ? d_error.fetch(error) : e;
}

// The finish of `chunk` from `message` into `out` (the whole tensor, as many bytes as `out` holds).
template <class T>
cudaError_t device_finish(const Case& s, int chunk, const std::vector<uint8_t>& message,
                          std::vector<T>* out, bool out_bf16, bool avg, int n_contrib,
                          unsigned* error, int max_blocks = 0, size_t out_shift_bytes = 0) {
  const DeviceArray<LevelTable> d_levels(s.levels, 3);
  const DeviceArray<uint64_t> d_layout(s.dev_layout);
  const DeviceArray<uint8_t> d_message(message);
  const DeviceArray<T> d_out(*out);
  // A StepWord without kFoldFlag: its flags stay for the caller; the tickets must end at 0.
  StepWord w{};
  w.flags = *error;
  const DeviceArray<StepWord> d_word(&w, 1);
  cudaError_t e =
      launch_dynamiq_finish(s.params, d_levels.get(), d_layout.get(), chunk, d_message.get(),
                            reinterpret_cast<uint8_t*>(d_out.get()) + out_shift_bytes, out_bf16,
                            avg, n_contrib, d_word.get(), nullptr, max_blocks);
  if (e == cudaSuccess) e = d_out.fetch(*out);
  if (e == cudaSuccess) e = d_word.fetch(&w);
  if (e == cudaSuccess && (w.tickets != 0 || w.validated != 0 || w.finished != 0))
    ADD_FAILURE() << "the finish left its tickets at " << w.tickets << "/" << w.validated << "/"
                  << w.finished;
  *error = w.flags;
  return e;
}

// launch_dynamiq_finishes() of chunks first .. first + n - 1, their messages in `messages` at
// `stride` bytes apart, into `out`; *launches (emulation: the kernels it started; else 1).
template <class T>
cudaError_t device_finishes(const Case& s, int first, int n, const std::vector<uint8_t>& messages,
                            size_t stride, std::vector<T>* out, bool out_bf16, bool avg,
                            int n_contrib, unsigned* error, int max_blocks, uint64_t* launches) {
  const DeviceArray<LevelTable> d_levels(s.levels, 3);
  const DeviceArray<uint64_t> d_layout(s.dev_layout);
  const DeviceArray<uint8_t> d_messages(messages);
  const DeviceArray<T> d_out(*out);
  StepWord w{};
  w.flags = *error;
  const DeviceArray<StepWord> d_word(&w, 1);
  *launches = 1;
#if DQ_CUDA_EMULATED
  const uint64_t before = emu::launches();
#endif
  cudaError_t e = launch_dynamiq_finishes(s.params, d_levels.get(), d_layout.get(), first, n,
                                          d_messages.get(), stride, d_out.get(), out_bf16, avg,
                                          n_contrib, d_word.get(), nullptr, max_blocks);
#if DQ_CUDA_EMULATED
  *launches = emu::launches() - before;
#endif
  if (e == cudaSuccess) e = d_out.fetch(*out);
  if (e == cudaSuccess) e = d_word.fetch(&w);
  if (e == cudaSuccess && (w.tickets != 0 || w.validated != 0 || w.finished != 0))
    ADD_FAILURE() << "the finishes left their tickets at " << w.tickets << "/" << w.validated << "/"
                  << w.finished;
  *error = w.flags;
  return e;
}

void make_case(const Config& cfg, uint32_t seed, Case* s) {
  s->cfg = cfg;
  s->codec = make_dynamiq_codec(cfg.opt);
  ASSERT_EQ(s->codec->plan(cfg.count, cfg.n_chunks, cfg.n_workers), Status::kOk);
  s->params = dynamiq_device_params(cfg.count, cfg.n_chunks, cfg.n_workers,
                                    s->codec->chunk_capacity(), cfg.opt);
  ASSERT_EQ(s->params.sections.bytes, s->codec->layout_bytes());
  dynamiq_level_tables(cfg.opt, s->levels);
  s->f32.resize(cfg.n_workers);
  s->bf16.resize(cfg.n_workers);
  StatsSum sum(s->codec->stats_words(), s->codec->stats_byte_sum_words());
  for (int r = 0; r < cfg.n_workers; ++r) {
    s->f32[r] = make_values(cfg.count, seed * 31 + r, cfg.poison && r == cfg.n_workers - 1);
    for (float& v : s->f32[r]) v = std::ldexp(v, cfg.scale_log2);
    s->bf16[r].resize(cfg.count);
    for (size_t i = 0; i < cfg.count; ++i) s->bf16[r][i] = f32_to_bf16_rne(s->f32[r][i]);
    std::vector<uint16_t> local(s->codec->stats_words());
    ASSERT_EQ(s->codec->local_stats(s->tensor(r), local.data()), Status::kOk);
    sum.add(local.data());
  }
  s->reduced.resize(s->codec->stats_words());
  sum.result(s->reduced.data(), true);
  s->call = 0x100000000ull * seed + 17;
  const size_t words = s->codec->layout_bytes() / 8;
  s->host_layout.assign(words, 0x5a5a5a5a5a5a5a5aull);
  s->dev_layout.assign(words, 0xa5a5a5a5a5a5a5a5ull);
  ASSERT_EQ(s->codec->build_layout(s->reduced.data(), s->call, s->host_layout.data()), Status::kOk);
  unsigned error = 0;
  ASSERT_EQ(device_layout(s->params, s->reduced, s->call, &s->dev_layout, &error), cudaSuccess)
      << kernel_fault();
  EXPECT_EQ(error, 0u);
}

bool nan32(uint32_t w) {
  return (w & 0x7fffffffu) > 0x7f800000u;
}
bool nan16(uint16_t w) {
  return (w & 0x7fffu) > 0x7f80u;
}

// The layouts byte for byte, except that a NaN mean equals any NaN mean: x86 keeps the NaN
// operand's payload in mu = NaN / n, a GPU returns the canonical NaN (EMULATION.md). Under the
// emulation both are the host CPU's, so this only matters on a GPU.
void expect_same_layout(const Case& s, const char* what) {
  const uint8_t* h = reinterpret_cast<const uint8_t*>(s.host_layout.data());
  const uint8_t* d = reinterpret_cast<const uint8_t*>(s.dev_layout.data());
  const DynamiqSections& sec = s.params.sections;
  for (size_t b = 0; b < sec.bytes; ++b) {
    if (h[b] == d[b]) continue;
    if (b >= sec.mean && b < sec.mean + 4 * s.params.plan.n_sg) {
      const size_t w = (b - sec.mean) / 4;
      uint32_t hw, dw;
      std::memcpy(&hw, h + sec.mean + 4 * w, 4);
      std::memcpy(&dw, d + sec.mean + 4 * w, 4);
      if (nan32(hw) && nan32(dw)) continue;
    }
    FAIL() << what << ": count " << s.cfg.count << " chunks " << s.cfg.n_chunks << " workers "
           << s.cfg.n_workers << ": layout byte " << b << " host " << int(h[b]) << " device "
           << int(d[b]) << " (sections: content " << sec.chunk_content << " mean " << sec.mean
           << " order " << sec.order << " offset " << sec.offset << " by_index " << sec.by_index
           << " chunk_first " << sec.chunk_first << " check " << sec.chunk_check << " width "
           << sec.width << ")";
  }
}

void note_widths(const Case& s, std::set<int>* widths, int* poisoned) {
  const DynamiqLayoutView v = dynamiq_layout(*s.codec, s.host_layout.data());
  for (size_t j = 0; j < v.n_supergroups; ++j) widths->insert(v.widths[j]);
  const DynamiqLayout l(reinterpret_cast<const uint8_t*>(s.host_layout.data()), s.params.sections);
  for (size_t j = 0; j < v.n_supergroups; ++j) *poisoned += l.poisoned(j) ? 1 : 0;
}

TEST(CudaDynamiqLayout, MatchesHostByteForByte) {
  DynamiqOptions fixed, no16, no_mean, flat;
  fixed.variable_widths = false;
  no16.allow_width16 = false;
  no_mean.mean_subtraction = false;
  flat.hierarchical_scales = false;
  const DynamiqOptions options[] = {DynamiqOptions{}, fixed, no16, no_mean, flat};
  const size_t counts[] = {
      0, 1, 255, 256, 257, 21 * 256 + 77, 100 * 256 + 1, 517 * 256 + 255, 4097 * 256 + 3};
  const int chunk_counts[] = {1, 2, 3, 8, 64};
  std::set<int> widths;
  int poisoned = 0, runs = 0, honest = 0;
  uint32_t seed = 1;
  for (size_t oi = 0; oi < std::size(options); ++oi)
    for (size_t count : counts)
      for (int chunks : chunk_counts) {
        // Every option on the middle sizes; the defaults on all.
        if (oi > 0 && (count < 256 || count > 600 * 256)) continue;
        if (reduced_matrix() && count > 600 * 256) continue;  // under compute-sanitizer
        for (int workers : {1, 4}) {
          if (workers == 1 && (oi > 0 || count > 600 * 256)) continue;
          Case s;
          make_case(Config{count, chunks, workers, false, (seed % 2) == 0, options[oi]}, seed++,
                    &s);
          if (HasFatalFailure()) return;
          expect_same_layout(s, "layout");
          if (HasFatalFailure()) return;
          note_widths(s, &widths, &poisoned);
          honest += s.codec->fits_budget() ? 1 : 0;
          ++runs;
        }
      }
  EXPECT_EQ(widths, (std::set<int>{2, 4, 8, 16}));
  EXPECT_GT(poisoned, 0);
  EXPECT_GT(honest, runs / 3);
}

// Plans whose chunk messages hold fewer bytes than every super-group's 2-bit record (the only
// way a layout of a consistent plan runs over: every chunk but the last holds at most its body,
// and the widths fit the record budget whenever 2 bits do): the device flags a chunk over
// capacity exactly where the host's build fails, and writes the host's bytes where it does not.
TEST(CudaDynamiqLayout, ChunkOverCapacityIsFlaggedWhereTheHostFails) {
  Case s;
  make_case(Config{30 * 256, 2, 4, false, false, DynamiqOptions{}}, 5, &s);
  ASSERT_FALSE(HasFatalFailure());
  const size_t max_record = static_cast<size_t>(s.params.plan.record[3]);
  // The plan at `capacity` bytes a message, its stride as DynamiqCodec::plan() sets it.
  auto at = [&](size_t capacity) {
    DynamiqDeviceParams p = s.params;
    p.plan.capacity = capacity;
    p.plan.stride = dynamiq_stride(capacity, max_record);
    return p;
  };
  std::vector<uint64_t> host(s.host_layout.size(), 0);
  auto host_fits = [&](size_t capacity) {
    return build_dynamiq_layout(at(capacity).plan, s.reduced.data(), s.call, host.data()) ==
           Status::kOk;
  };
  // The smallest capacity the host fits (its record budget grows with the capacity), bisected
  // between a stride of one byte and the planned capacity.
  size_t lo = kChunkHeaderBytes + max_record, hi = s.params.plan.capacity;
  ASSERT_FALSE(host_fits(lo));
  ASSERT_TRUE(host_fits(hi));
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    (host_fits(mid) ? hi : lo) = mid;
  }
  for (size_t capacity : {s.params.plan.capacity, hi, hi - 1}) {
    const bool fits = host_fits(capacity);
    EXPECT_EQ(fits, capacity >= hi);
    unsigned error = 0;
    ASSERT_EQ(device_layout(at(capacity), s.reduced, s.call, &s.dev_layout, &error), cudaSuccess)
        << kernel_fault();
    EXPECT_EQ(error, fits ? 0u : unsigned{kDynamiqChunkOverCapacity}) << "capacity " << capacity;
    if (fits) {
      s.host_layout = host;
      expect_same_layout(s, "fitting capacity");
    }
  }
}

// A layout that claims more than the message holds (the plan's capacity one byte short of the
// largest chunk): the hop flags it and writes nothing past the capacity (guard bytes after the
// message stay as they were), on one block and many.
TEST(CudaDynamiqHop, ChunkOverCapacityIsFlaggedAndNothingIsWrittenPastIt) {
  Case s;
  make_case(Config{30 * 256, 2, 4, false, false, DynamiqOptions{}, 0}, 5, &s);
  ASSERT_FALSE(HasFatalFailure());
  const DynamiqLayout l(reinterpret_cast<const uint8_t*>(s.host_layout.data()), s.params.sections);
  const int big = l.chunk_content[0] >= l.chunk_content[1] ? 0 : 1;
  const uint64_t capacity = l.chunk_content[big] + kChunkHeaderBytes - 1;
  unsigned error = 0;
  ASSERT_EQ(device_layout(s.params, s.reduced, s.call, &s.dev_layout, &error), cudaSuccess)
      << kernel_fault();
  ASSERT_EQ(error, 0u);
  s.params.plan.capacity = capacity;  // the hop's plan, not the layout's: one byte short
  constexpr size_t kGuard = 512;
  for (int max_blocks : {1, 0}) {
    std::vector<uint8_t> out(capacity + kGuard, 0xEE);
    error = 0;  // the hop alone: it must find the overflow itself
    const RoundingKey key{99, s.call, 1, 0, 1, 0, 0};
    ASSERT_EQ(device_hop(s, big, nullptr, 0, &out, key, &error, max_blocks), cudaSuccess)
        << kernel_fault();
    EXPECT_EQ(error, unsigned{kDynamiqChunkOverCapacity}) << "max_blocks " << max_blocks;
    for (size_t b = capacity; b < out.size(); ++b)
      ASSERT_EQ(int(out[b]), 0xEE) << "max_blocks " << max_blocks << ": byte " << b - capacity
                                   << " past the " << capacity << "-byte message";
    EXPECT_EQ(out[0], kPayloadMagic & 0xff) << "the header is still written";
  }
}

// A lane that failed before the step: the word is armed (kSkipFlag, with an earlier flag) when the
// launch starts, so the layout, the hop and the finish write nothing (their outputs keep the
// sentinel), launch no gate kernel, and leave the word as it was (the finish's check adds no flag
// of its own).
TEST(CudaDynamiqHop, PresetErrorWordWritesNothing) {
  Case s;
  make_case(Config{24 * 256 + 100, 3, 4, false, false, DynamiqOptions{}, 0}, 41, &s);
  ASSERT_FALSE(HasFatalFailure());
  const unsigned preset = kDynamiqBadRecord | kSkipFlag;
  // The layout.
  std::vector<uint64_t> layout(s.dev_layout.size(), 0x3c3c3c3c3c3c3c3cull);
  unsigned error = preset;
  ASSERT_EQ(device_layout(s.params, s.reduced, s.call, &layout, &error), cudaSuccess)
      << kernel_fault();
  EXPECT_EQ(error, preset);
  for (size_t w = 0; w < layout.size(); ++w)
    ASSERT_EQ(layout[w], 0x3c3c3c3c3c3c3c3cull) << "layout word " << w;
  // The hop, leaf and with an input whose header is wrong (it would raise a flag).
  const size_t cap = s.codec->chunk_capacity();
  const RoundingKey key{99, s.call, 1, 0, 1, 0, 0};
  std::vector<uint8_t> other(cap, 0);
  const uint8_t* ptr = other.data();
  for (int n_in : {0, 1})
    for (int max_blocks : {1, 0}) {
      std::vector<uint8_t> out(cap, 0xCD);
      error = preset;
#if DQ_CUDA_EMULATED
      const uint64_t launches = emu::launches();
#endif
      ASSERT_EQ(device_hop(s, 1, &ptr, n_in, &out, key, &error, max_blocks), cudaSuccess)
          << kernel_fault();
#if DQ_CUDA_EMULATED
      EXPECT_EQ(emu::launches() - launches, 1u) << "the hop is one kernel";
#endif
      EXPECT_EQ(error, preset) << "n_in " << n_in;
      for (size_t b = 0; b < cap; ++b)
        ASSERT_EQ(int(out[b]), 0xCD) << "n_in " << n_in << ": hop byte " << b;
    }
  // The finish of a valid message with the wrong worker count (its check would raise a flag).
  std::vector<uint8_t> leaf(cap);
  ASSERT_EQ(s.codec->fused_hop(s.host_layout.data(), 1, s.tensor(1), nullptr, 0, leaf.data(), key),
            Status::kOk);
  std::vector<float> out(s.cfg.count, 5.0f);
  error = preset;
  ASSERT_EQ(device_finish(s, 1, leaf, &out, false, false, 2, &error), cudaSuccess)
      << kernel_fault();
  EXPECT_EQ(error, preset);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], 5.0f) << "finish element " << i;
}

// The host's hop and the device's on the same inputs; returns the message for the next step.
void expect_same_hop(const Case& s, int chunk, int n_in,
                     const std::vector<std::vector<uint8_t>>& inputs, const RoundingKey& key,
                     std::vector<uint8_t>* message) {
  const size_t cap = s.codec->chunk_capacity();
  std::vector<ByteView> views;
  std::vector<const uint8_t*> ptrs;
  for (int i = 0; i < n_in; ++i) {
    EXPECT_EQ(inputs[i].size(), cap);
    views.push_back(ByteView{inputs[i].data(), inputs[i].size()});
    ptrs.push_back(inputs[i].data());
  }
  std::vector<uint8_t> host(cap, 0xAB), dev(cap, 0xCD);
  ASSERT_EQ(s.codec->fused_hop(s.host_layout.data(), chunk, s.tensor(key.rank), views.data(), n_in,
                               host.data(), key),
            Status::kOk);
  unsigned error = 0;
  ASSERT_EQ(device_hop(s, chunk, ptrs.data(), n_in, &dev, key, &error,
                       chunk % 4 == 3 ? 0 : 1 + chunk % 3),
            cudaSuccess)
      << kernel_fault();
  EXPECT_EQ(error, 0u);
  for (size_t b = 0; b < cap; ++b)
    ASSERT_EQ(int(host[b]), int(dev[b]))
        << "count " << s.cfg.count << " chunks " << s.cfg.n_chunks << " chunk " << chunk << " n_in "
        << n_in << (s.cfg.bf16 ? " bf16" : " fp32") << ": message byte " << b << " of " << cap;
  *message = host;
}

void expect_same_finish(const Case& s, int chunk, const std::vector<uint8_t>& message,
                        int n_contrib) {
  for (bool out_bf16 : {false, true})
    for (bool avg : {false, true}) {
      const size_t bytes = s.cfg.count * (out_bf16 ? 2 : 4);
      std::vector<uint8_t> host(bytes + 1, 0x77), dev(bytes + 1, 0x77);
      ASSERT_EQ(s.codec->decode_finish(s.host_layout.data(), chunk,
                                       ByteView{message.data(), message.size()}, host.data(),
                                       out_bf16 ? DType::kBF16 : DType::kF32,
                                       avg ? ReduceOp::kAvg : ReduceOp::kSum, n_contrib),
                Status::kOk);
      unsigned error = 0;
      ASSERT_EQ(device_finish(s, chunk, message, &dev, out_bf16, avg, n_contrib, &error, 2),
                cudaSuccess)
          << kernel_fault();
      EXPECT_EQ(error, 0u);
      const size_t word = out_bf16 ? 2 : 4;
      for (size_t i = 0; i < s.cfg.count; ++i) {
        uint32_t h = 0, d = 0;
        std::memcpy(&h, host.data() + i * word, word);
        std::memcpy(&d, dev.data() + i * word, word);
        if (h == d) continue;
        // NaN only as NaN (a poisoned super-group: x86 keeps a payload, a GPU does not).
        if (out_bf16 ? (nan16(h) && nan16(d)) : (nan32(h) && nan32(d))) continue;
        FAIL() << "finish count " << s.cfg.count << " chunk " << chunk
               << (out_bf16 ? " bf16" : " fp32") << (avg ? " avg" : " sum") << ": element " << i
               << " host 0x" << std::hex << h << " device 0x" << d;
      }
      EXPECT_EQ(host[bytes], 0x77);
      EXPECT_EQ(dev[bytes], 0x77);
    }
}

void run_hops(const Config& cfg, uint32_t seed, const std::vector<int>& n_ins,
              std::set<int>* widths) {
  Case s;
  make_case(cfg, seed, &s);
  if (::testing::Test::HasFatalFailure()) return;
  expect_same_layout(s, "hop setup");
  if (::testing::Test::HasFatalFailure()) return;
  int poisoned = 0;
  note_widths(s, widths, &poisoned);
  if (cfg.poison) {
    EXPECT_GT(poisoned, 0) << "count " << cfg.count;
  }
  const size_t cap = s.codec->chunk_capacity();
  for (int chunk = 0; chunk < cfg.n_chunks; ++chunk) {
    // Leaves of workers 1..3, stratified rounding among the 4 workers of class 0.
    std::vector<std::vector<uint8_t>> leaves(3, std::vector<uint8_t>(cap));
    for (int r = 1; r <= 3; ++r) {
      const RoundingKey leaf{seed, s.call, static_cast<uint32_t>(r), static_cast<uint32_t>(r),
                             4,    0,      cfg.element_base};
      ASSERT_EQ(s.codec->fused_hop(s.host_layout.data(), chunk, s.tensor(r), nullptr, 0,
                                   leaves[r - 1].data(), leaf),
                Status::kOk);
    }
    for (int n_in : n_ins) {
      const RoundingKey key{seed,
                            s.call,
                            0,
                            static_cast<uint32_t>(n_in % 2),
                            static_cast<uint32_t>(n_in > 0 ? 2 : 1),
                            static_cast<uint32_t>(n_in),
                            cfg.element_base};
      std::vector<uint8_t> message;
      expect_same_hop(s, chunk, n_in, leaves, key, &message);
      if (::testing::Test::HasFatalFailure()) return;
      expect_same_finish(s, chunk, message, 1 + n_in);  // 1..4 workers: AVG divides by 3 too
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(CudaDynamiqHop, MatchesHostByteForByte) {
  DynamiqOptions flat_plain, fixed_no16, uniform_no_mean;
  flat_plain.hierarchical_scales = false;
  flat_plain.correlated_rounding = false;
  fixed_no16.variable_widths = false;
  fixed_no16.allow_width16 = false;
  uniform_no_mean.nonuniform_levels = false;
  uniform_no_mean.mean_subtraction = false;
  uniform_no_mean.eps[1] = 0.2f;
  std::set<int> widths;
  uint32_t seed = 11;
  const std::vector<int> all{0, 1, 2, 3};
  run_hops(Config{21 * 256 + 77, 2, 4, false, true, DynamiqOptions{}, 0}, seed++, all, &widths);
  run_hops(Config{40 * 256, 3, 4, true, true, DynamiqOptions{}, 256 * 7}, seed++, all, &widths);
  run_hops(Config{33 * 256 + 1, 2, 4, true, false, flat_plain, 0}, seed++, all, &widths);
  run_hops(Config{19 * 256 + 200, 2, 4, false, true, fixed_no16, 256 * 3}, seed++, all, &widths);
  run_hops(Config{27 * 256 + 31, 2, 4, false, true, uniform_no_mean, 0}, seed++, all, &widths);
  run_hops(Config{9 * 256 + 5, 8, 4, false, true, DynamiqOptions{}, 0}, seed++, all,
           &widths);      // whole-record plan
  if (!reduced_matrix())  // left out under compute-sanitizer
    run_hops(Config{470 * 256 + 129, 64, 4, true, true, DynamiqOptions{}, 0}, seed++, {0, 2, 3},
             &widths);
  EXPECT_EQ(widths, (std::set<int>{2, 4, 8, 16}));
}

// Far from unit scale (kernels/dynamiq_range.h): compressed energies, a width-key shift, scale
// exponents K_j != 0, subnormal inputs; every layout, hop and finish byte as the host's.
TEST(CudaDynamiqHop, MatchesHostAcrossTheRange) {
  std::set<int> widths;
  uint32_t seed = 71;
  const std::vector<int> all{0, 1, 2, 3};
  for (int scale : {-125, -100, -60, 50, 95})
    for (bool bf16 : {false, true}) {
      Config cfg{24 * 256 + 9, 2, 4, bf16, scale == 50, DynamiqOptions{}, 0, scale};
      Case s;
      make_case(cfg, seed, &s);
      if (HasFatalFailure()) return;
      const DynamiqLayout l(reinterpret_cast<const uint8_t*>(s.host_layout.data()),
                            s.params.sections);
      int scaled = 0;
      for (size_t j = 0; j < s.params.plan.n_sg; ++j) scaled += l.exponent[j] != 0 ? 1 : 0;
      if (scale < -60 || scale > 50) {
        EXPECT_GT(scaled, 0) << "scale 2^" << scale;
      }
      run_hops(cfg, seed++, all, &widths);
      if (HasFatalFailure()) return;
    }
  for (int w : {2, 4, 8}) EXPECT_EQ(widths.count(w), 1u) << w;
}

// Own values at any element offset from a 16-byte boundary (a view into a larger tensor): the hop
// reads them in 16-byte vectors only where a lane's 8 values are aligned, element by element
// otherwise (the emulator refuses a misaligned vector load, as CUDA does), with the same bytes.
TEST(CudaDynamiqHop, OwnValuesAtAnyElementOffsetGiveTheHostBytes) {
  uint32_t seed = 131;
  for (bool bf16 : {false, true}) {
    Case s;
    make_case(Config{13 * 256 + 45, 2, 4, bf16, true, DynamiqOptions{}, 0}, seed++, &s);
    ASSERT_FALSE(HasFatalFailure());
    const size_t cap = s.codec->chunk_capacity();
    const RoundingKey leaf_key{seed, s.call, 1, 1, 4, 1, 0};
    std::vector<uint8_t> leaf(cap);
    ASSERT_EQ(
        s.codec->fused_hop(s.host_layout.data(), 1, s.tensor(2), nullptr, 0, leaf.data(), leaf_key),
        Status::kOk);
    const uint8_t* input = leaf.data();
    const ByteView view{leaf.data(), leaf.size()};
    for (int n_in : {0, 1}) {
      const RoundingKey key{seed, s.call, 1, 0, 2, static_cast<uint32_t>(n_in), 0};
      std::vector<uint8_t> host(cap, 0xAB);
      ASSERT_EQ(
          s.codec->fused_hop(s.host_layout.data(), 1, s.tensor(1), &view, n_in, host.data(), key),
          Status::kOk);
      for (int shift : {0, 1, 2, 3, 7}) {
        std::vector<uint8_t> dev(cap, 0xCD);
        unsigned error = 0;
        ASSERT_EQ(device_hop(s, 1, &input, n_in, &dev, key, &error, 0, shift), cudaSuccess)
            << (bf16 ? "bf16" : "fp32") << " shift " << shift << ": " << kernel_fault();
        EXPECT_EQ(error, 0u);
        for (size_t b = 0; b < cap; ++b)
          ASSERT_EQ(int(host[b]), int(dev[b])) << (bf16 ? "bf16" : "fp32") << " n_in " << n_in
                                               << " shift " << shift << ": byte " << b;
      }
    }
  }
}

// The finish's output at any element offset from a 16-byte boundary (a view into a larger
// tensor): a lane writes its 8 values in 16-byte stores only where they are aligned, element by
// element otherwise (the emulator refuses a misaligned vector store, as CUDA does), with the
// host's bytes and nothing written outside the chunk's elements.
TEST(CudaDynamiqHop, FinishOutputAtAnyElementOffsetGivesTheHostBytes) {
  Case s;
  make_case(Config{13 * 256 + 45, 2, 4, false, false, DynamiqOptions{}, 0}, 151, &s);
  ASSERT_FALSE(HasFatalFailure());
  const size_t cap = s.codec->chunk_capacity();
  for (int chunk = 0; chunk < 2; ++chunk) {
    const RoundingKey key{151, s.call, 1, 0, 1, 0, 0};
    std::vector<uint8_t> leaf(cap);
    ASSERT_EQ(
        s.codec->fused_hop(s.host_layout.data(), chunk, s.tensor(1), nullptr, 0, leaf.data(), key),
        Status::kOk);
    for (bool out_bf16 : {false, true}) {
      const size_t word = out_bf16 ? 2 : 4, bytes = s.cfg.count * word;
      std::vector<uint8_t> host(bytes, 0x77);
      ASSERT_EQ(s.codec->decode_finish(s.host_layout.data(), chunk,
                                       ByteView{leaf.data(), leaf.size()}, host.data(),
                                       out_bf16 ? DType::kBF16 : DType::kF32, ReduceOp::kSum, 1),
                Status::kOk);
      for (int shift : {0, 1, 2, 3, 7}) {
        std::vector<uint8_t> dev(bytes + 8 * word, 0x77);
        unsigned error = 0;
        ASSERT_EQ(device_finish(s, chunk, leaf, &dev, out_bf16, false, 1, &error, 0, shift * word),
                  cudaSuccess)
            << (out_bf16 ? "bf16" : "fp32") << " shift " << shift << ": " << kernel_fault();
        EXPECT_EQ(error, 0u);
        for (size_t b = 0; b < dev.size(); ++b) {
          const size_t at = b - shift * word;  // the output's byte b - shift * word
          const int want = b >= shift * word && at < bytes ? host[at] : 0x77;
          ASSERT_EQ(want, int(dev[b])) << "chunk " << chunk << (out_bf16 ? " bf16" : " fp32")
                                       << " shift " << shift << ": byte " << b;
        }
      }
    }
  }
}

TEST(CudaDynamiqHop, MalformedInputsAreFlaggedLikeTheHost) {
  Case s;
  make_case(Config{24 * 256, 2, 4, false, false, DynamiqOptions{}, 0}, 99, &s);
  ASSERT_FALSE(HasFatalFailure());
  const size_t cap = s.codec->chunk_capacity();
  const RoundingKey leaf_key{99, s.call, 1, 0, 1, 0, 0};
  std::vector<uint8_t> leaf(cap);
  ASSERT_EQ(
      s.codec->fused_hop(s.host_layout.data(), 0, s.tensor(1), nullptr, 0, leaf.data(), leaf_key),
      Status::kOk);
  const DynamiqLayout l(reinterpret_cast<const uint8_t*>(s.host_layout.data()), s.params.sections);
  // A record at width < 16 in chunk 0: set one of its codes to all ones.
  uint32_t victim = UINT32_MAX;
  for (uint32_t i = l.chunk_first[0]; i < l.chunk_first[1] && victim == UINT32_MAX; ++i)
    if (l.width[l.order[i]] < 16) victim = i;
  ASSERT_NE(victim, UINT32_MAX);
  std::vector<uint8_t> bad = leaf;
  bad[kChunkHeaderBytes + l.offset[victim] + 2 + kGroupsPerSuperGroup + 5] = 0xFF;
  const RoundingKey key{99, s.call, 0, 0, 1, 0, 0};
  const ByteView view{bad.data(), bad.size()};
  std::vector<uint8_t> host(cap), dev(cap);
  EXPECT_EQ(s.codec->fused_hop(s.host_layout.data(), 0, s.tensor(0), &view, 1, host.data(), key),
            Status::kMalformedPayload);
  unsigned error = 0;
  const uint8_t* ptr = bad.data();
  ASSERT_EQ(device_hop(s, 0, &ptr, 1, &dev, key, &error), cudaSuccess) << kernel_fault();
  EXPECT_EQ(error, unsigned{kDynamiqBadRecord});
  EXPECT_EQ(host, dev);  // both still write the whole message
  // A header naming another call.
  std::vector<uint8_t> other = leaf;
  other[8] ^= 1;
  ptr = other.data();
  error = 0;
  ASSERT_EQ(device_hop(s, 0, &ptr, 1, &dev, key, &error), cudaSuccess) << kernel_fault();
  EXPECT_EQ(error, unsigned{kDynamiqBadHeader});
  // The finish: a bad record, or the wrong worker count, leaves the output untouched.
  for (int variant = 0; variant < 2; ++variant) {
    const std::vector<uint8_t>& msg = variant == 0 ? bad : leaf;
    const int n_contrib = variant == 0 ? 1 : 2;
    std::vector<float> h(s.cfg.count, 5.0f), d(s.cfg.count, 5.0f);
    EXPECT_EQ(s.codec->decode_finish(s.host_layout.data(), 0, ByteView{msg.data(), msg.size()},
                                     h.data(), DType::kF32, ReduceOp::kSum, n_contrib),
              Status::kMalformedPayload);
    error = 0;
    ASSERT_EQ(device_finish(s, 0, msg, &d, false, false, n_contrib, &error), cudaSuccess)
        << kernel_fault();
    EXPECT_EQ(error, variant == 0 ? unsigned{kDynamiqBadRecord} : unsigned{kDynamiqBadHeader});
    EXPECT_EQ(std::memcmp(h.data(), d.data(), 4 * h.size()), 0);
    EXPECT_EQ(d[0], 5.0f);
  }
}

// Invalid scale bytes in either input of a two-input hop (a zero group factor, a negative unit,
// a negative flat group scale): the device flags the record as the host does, and both still
// write the same message. The hop decodes its first input's scales once a record and a further
// input's at every value, so each input is corrupted in turn. The finish of that message alone
// is refused and writes nothing (its validators check the scales once a record).
TEST(CudaDynamiqHop, ABadScaleIsFlaggedLikeTheHostByTheHopAndTheFinish) {
  DynamiqOptions flat;
  flat.hierarchical_scales = false;
  for (const DynamiqOptions& opt : {DynamiqOptions{}, flat}) {
    Case s;
    make_case(Config{24 * 256, 2, 4, false, false, opt, 0}, 7, &s);
    ASSERT_FALSE(HasFatalFailure());
    const size_t cap = s.codec->chunk_capacity();
    std::vector<uint8_t> leaves[2] = {std::vector<uint8_t>(cap), std::vector<uint8_t>(cap)};
    for (int i = 0; i < 2; ++i)
      ASSERT_EQ(
          s.codec->fused_hop(s.host_layout.data(), 0, s.tensor(i + 1), nullptr, 0, leaves[i].data(),
                             RoundingKey{7, s.call, static_cast<uint32_t>(i + 1), 0, 1, 0, 0}),
          Status::kOk);
    const DynamiqLayout l(reinterpret_cast<const uint8_t*>(s.host_layout.data()),
                          s.params.sections);
    uint32_t victim = UINT32_MAX;  // the chunk's last record at a width below 16
    for (uint32_t i = l.chunk_first[0]; i < l.chunk_first[1]; ++i)
      if (l.width[l.order[i]] < 16) victim = i;
    ASSERT_NE(victim, UINT32_MAX);
    const size_t rec = kChunkHeaderBytes + l.offset[victim];
    // (byte, value): the unit's sign or group 11's factor; flat: group 11's scale sign.
    const std::pair<size_t, uint8_t> hier[2] = {{rec + 1, 0x80}, {rec + 2 + 11, 0x00}};
    const std::pair<size_t, uint8_t> flat_bad[1] = {{rec + 2 * 11 + 1, 0xC0}};
    const RoundingKey key{7, s.call, 0, 0, 1, 0, 0};
    const auto check = [&](int input, size_t byte, uint8_t value) {
      std::vector<uint8_t> in[2] = {leaves[0], leaves[1]};
      in[input][byte] = value;
      const ByteView views[2] = {{in[0].data(), cap}, {in[1].data(), cap}};
      std::vector<uint8_t> host(cap), dev(cap);
      EXPECT_EQ(
          s.codec->fused_hop(s.host_layout.data(), 0, s.tensor(0), views, 2, host.data(), key),
          Status::kMalformedPayload);
      unsigned error = 0;
      const uint8_t* ptrs[2] = {in[0].data(), in[1].data()};
      ASSERT_EQ(device_hop(s, 0, ptrs, 2, &dev, key, &error), cudaSuccess) << kernel_fault();
      EXPECT_EQ(error, unsigned{kDynamiqBadRecord}) << "input " << input << ", byte " << byte;
      EXPECT_EQ(host, dev) << "input " << input << ", byte " << byte;
      // The finish of the corrupted message alone: refused, the output untouched.
      std::vector<float> h(s.cfg.count, 5.0f), d(s.cfg.count, 5.0f);
      EXPECT_EQ(s.codec->decode_finish(s.host_layout.data(), 0, views[input], h.data(), DType::kF32,
                                       ReduceOp::kSum, 1),
                Status::kMalformedPayload);
      error = 0;
      ASSERT_EQ(device_finish(s, 0, in[input], &d, false, false, 1, &error), cudaSuccess)
          << kernel_fault();
      EXPECT_EQ(error, unsigned{kDynamiqBadRecord}) << "finish, byte " << byte;
      EXPECT_EQ(d, h) << "finish, byte " << byte;
    };
    for (int input = 0; input < 2; ++input) {
      if (opt.hierarchical_scales)
        for (const auto& [byte, value] : hier) check(input, byte, value);
      else
        for (const auto& [byte, value] : flat_bad) check(input, byte, value);
    }
  }
}

// One bad record late in a chunk, after most of it would have been decoded: the finish (one
// launch: validator blocks, then decoder blocks behind them) leaves every element untouched, at
// grids of one, two and many blocks a role, as the host does; the same message made valid again
// decodes as the host's.
TEST(CudaDynamiqHop, ALateBadRecordLeavesTheFinishOutputUntouched) {
  Case s;
  make_case(Config{96 * 256 + 40, 2, 4, false, false, DynamiqOptions{}, 0}, 123, &s);
  ASSERT_FALSE(HasFatalFailure());
  const size_t cap = s.codec->chunk_capacity();
  const RoundingKey key{5, s.call, 1, 0, 1, 0, 0};
  const int chunk = 1;
  std::vector<uint8_t> leaf(cap);
  ASSERT_EQ(
      s.codec->fused_hop(s.host_layout.data(), chunk, s.tensor(1), nullptr, 0, leaf.data(), key),
      Status::kOk);
  const DynamiqLayout l(reinterpret_cast<const uint8_t*>(s.host_layout.data()), s.params.sections);
  // The chunk's last record at width < 16, its last code byte all ones (an invalid code).
  uint32_t victim = UINT32_MAX;
  for (uint32_t i = l.chunk_first[chunk]; i < l.chunk_first[chunk + 1]; ++i)
    if (l.width[l.order[i]] < 16) victim = i;
  ASSERT_NE(victim, UINT32_MAX);
  ASSERT_GT(victim - l.chunk_first[chunk],
            (l.chunk_first[chunk + 1] - l.chunk_first[chunk]) * 3 / 4)
      << "the bad record is late in the chunk";
  const int bits = l.width[l.order[victim]];
  std::vector<uint8_t> bad = leaf;
  bad[kChunkHeaderBytes + l.offset[victim] + record_bytes(bits, s.cfg.opt.hierarchical_scales) -
      1] = 0xFF;
  for (int max_blocks : {1, 2, 3, 0}) {
    std::vector<float> h(s.cfg.count, 5.0f), d(s.cfg.count, 5.0f);
    EXPECT_EQ(s.codec->decode_finish(s.host_layout.data(), chunk, ByteView{bad.data(), cap},
                                     h.data(), DType::kF32, ReduceOp::kSum, 1),
              Status::kMalformedPayload);
    unsigned error = 0;
    ASSERT_EQ(device_finish(s, chunk, bad, &d, false, false, 1, &error, max_blocks), cudaSuccess)
        << kernel_fault();
    EXPECT_EQ(error, unsigned{kDynamiqBadRecord}) << "max_blocks " << max_blocks;
    for (size_t i = 0; i < d.size(); ++i)
      ASSERT_EQ(d[i], 5.0f) << "element " << i << " written, max_blocks " << max_blocks;
    // The valid message: every element of the chunk as the host decodes it.
    error = 0;
    ASSERT_EQ(s.codec->decode_finish(s.host_layout.data(), chunk, ByteView{leaf.data(), cap},
                                     h.data(), DType::kF32, ReduceOp::kSum, 1),
              Status::kOk);
    ASSERT_EQ(device_finish(s, chunk, leaf, &d, false, false, 1, &error, max_blocks), cudaSuccess)
        << kernel_fault();
    EXPECT_EQ(error, 0u);
    EXPECT_EQ(std::memcmp(h.data(), d.data(), 4 * h.size()), 0) << "max_blocks " << max_blocks;
  }
}

// ---- a finish step: a range of chunks in one launch (launch_dynamiq_finishes) ------------------

// Every chunk's message of a 2-worker sum (the hop of worker 0 over worker 1's leaf), laid out
// `stride` bytes apart (the first at offset 0), as the engine's finish step finds them.
std::vector<uint8_t> packed_messages(const Case& s, size_t stride) {
  const size_t cap = s.codec->chunk_capacity();
  std::vector<uint8_t> packed(stride * (s.cfg.n_chunks - 1) + cap, 0xE1);
  for (int chunk = 0; chunk < s.cfg.n_chunks; ++chunk) {
    std::vector<uint8_t> leaf(cap);
    const RoundingKey leaf_key{21, s.call, 1, 1, 2, 0, 0};
    EXPECT_EQ(s.codec->fused_hop(s.host_layout.data(), chunk, s.tensor(1), nullptr, 0, leaf.data(),
                                 leaf_key),
              Status::kOk);
    const ByteView in{leaf.data(), cap};
    const RoundingKey key{21, s.call, 0, 0, 2, 0, 0};
    EXPECT_EQ(s.codec->fused_hop(s.host_layout.data(), chunk, s.tensor(0), &in, 1,
                                 packed.data() + chunk * stride, key),
              Status::kOk);
  }
  return packed;
}

// The host's decode_finish of chunks first .. first + n - 1, one at a time, into `out`.
Status host_finishes(const Case& s, int first, int n, const std::vector<uint8_t>& packed,
                     size_t stride, void* out, bool out_bf16, bool avg, int n_contrib) {
  for (int c = first; c < first + n; ++c) {
    const Status st = s.codec->decode_finish(
        s.host_layout.data(), c,
        ByteView{packed.data() + (c - first) * stride, s.codec->chunk_capacity()}, out,
        out_bf16 ? DType::kBF16 : DType::kF32, avg ? ReduceOp::kAvg : ReduceOp::kSum, n_contrib);
    if (st != Status::kOk) return st;
  }
  return Status::kOk;
}

// The messages of chunks first .. first + n - 1 of `all` (at `stride`), alone at `stride`.
std::vector<uint8_t> range_of(const std::vector<uint8_t>& all, const Case& s, int first, int n,
                              size_t stride) {
  const size_t bytes = stride * (n - 1) + s.codec->chunk_capacity();
  return std::vector<uint8_t>(all.begin() + first * stride, all.begin() + first * stride + bytes);
}

// All chunks of a step, and ranges that start past chunk 0 (a sub-range, the last chunk alone):
// one launch each, every output byte as the host's decode_finish of each chunk in turn (elements
// of chunks outside the range untouched on both), FP32 and BF16, SUM and AVG, messages at a
// stride that is no multiple of 4 (each message's records at another alignment), at 1, 3 and
// the default blocks a role; the tickets end at 0 (device_finishes()).
TEST(CudaDynamiqHop, AFinishStepDecodesItsChunksInOneLaunch) {
  Case s;
  make_case(Config{150 * 256 + 77, 5, 4, false, false, DynamiqOptions{}, 0}, 211, &s);
  ASSERT_FALSE(HasFatalFailure());
  const size_t cap = s.codec->chunk_capacity();
  const size_t stride = cap + 37;
  const std::vector<uint8_t> all = packed_messages(s, stride);
  ASSERT_FALSE(HasFailure());
  const int ranges[][2] = {{0, 5}, {1, 3}, {4, 1}, {2, 3}};
  for (const auto& r : ranges)
    for (bool out_bf16 : {false, true})
      for (bool avg : {false, true})
        for (int max_blocks : {1, 3, 0}) {
          const std::vector<uint8_t> msgs = range_of(all, s, r[0], r[1], stride);
          const size_t bytes = s.cfg.count * (out_bf16 ? 2 : 4);
          std::vector<uint8_t> host(bytes + 1, 0x77), dev(bytes + 1, 0x77);
          ASSERT_EQ(host_finishes(s, r[0], r[1], msgs, stride, host.data(), out_bf16, avg, 2),
                    Status::kOk);
          unsigned error = 0;
          uint64_t launches = 0;
          ASSERT_EQ(device_finishes(s, r[0], r[1], msgs, stride, &dev, out_bf16, avg, 2, &error,
                                    max_blocks, &launches),
                    cudaSuccess)
              << kernel_fault();
          const std::string what = "chunks " + std::to_string(r[0]) + ".." +
                                   std::to_string(r[0] + r[1] - 1) +
                                   (out_bf16 ? " bf16" : " fp32") + (avg ? " avg" : " sum") +
                                   " max_blocks " + std::to_string(max_blocks);
          EXPECT_EQ(error, 0u) << what;
          EXPECT_EQ(launches, 1u) << what;
#if DQ_CUDA_EMULATED
          if (max_blocks > 0) {
            EXPECT_EQ(emu::last_counters().blocks, 2u * max_blocks) << what;
          }
#endif
          size_t untouched = 0;
          for (size_t b = 0; b < bytes; ++b) {
            ASSERT_EQ(int(host[b]), int(dev[b])) << what << ": output byte " << b;
            untouched += host[b] == 0x77 ? 1 : 0;
          }
          EXPECT_EQ(dev[bytes], 0x77) << what;
          if (r[1] < 5) {
            EXPECT_GT(untouched, bytes / 10) << what << ": other chunks untouched";
          }
        }
}

// One bad record late in the LAST chunk of a range, or a bad header there: no chunk of the launch
// writes anything (stricter than the host, which writes the range's valid chunks before it), the
// flag is raised, at 1, 2, 3, 7 and the default blocks a role; the tickets end at 0.
TEST(CudaDynamiqHop, ABadLastChunkLeavesEveryChunkOfTheFinishStepUntouched) {
  Case s;
  make_case(Config{150 * 256 + 77, 5, 4, false, false, DynamiqOptions{}, 0}, 223, &s);
  ASSERT_FALSE(HasFatalFailure());
  const size_t cap = s.codec->chunk_capacity();
  const size_t stride = cap + 8;
  const std::vector<uint8_t> all = packed_messages(s, stride);
  ASSERT_FALSE(HasFailure());
  const DynamiqLayout l(reinterpret_cast<const uint8_t*>(s.host_layout.data()), s.params.sections);
  const int ranges[][2] = {{0, 5}, {1, 3}};
  for (const auto& r : ranges)
    for (int variant = 0; variant < 2; ++variant) {
      const int last = r[0] + r[1] - 1;
      std::vector<uint8_t> msgs = range_of(all, s, r[0], r[1], stride);
      uint8_t* last_msg = msgs.data() + (r[1] - 1) * stride;
      if (variant == 0) {
        // The last chunk's last record at width < 16: its last code byte all ones.
        uint32_t victim = UINT32_MAX;
        for (uint32_t i = l.chunk_first[last]; i < l.chunk_first[last + 1]; ++i)
          if (l.width[l.order[i]] < 16) victim = i;
        ASSERT_NE(victim, UINT32_MAX);
        const int bits = l.width[l.order[victim]];
        last_msg[kChunkHeaderBytes + l.offset[victim] +
                 record_bytes(bits, s.cfg.opt.hierarchical_scales) - 1] = 0xFF;
      } else {
        last_msg[8] ^= 1;  // the header names another call
      }
      std::vector<float> h(s.cfg.count, 5.0f);
      EXPECT_EQ(host_finishes(s, r[0], r[1], msgs, stride, h.data(), false, false, 2),
                Status::kMalformedPayload);
      for (int max_blocks : {1, 2, 3, 7, 0}) {
        const std::string what = "chunks " + std::to_string(r[0]) + ".." + std::to_string(last) +
                                 (variant == 0 ? " bad record" : " bad header") + " max_blocks " +
                                 std::to_string(max_blocks);
        std::vector<float> d(s.cfg.count, 5.0f);
        unsigned error = 0;
        uint64_t launches = 0;
        ASSERT_EQ(device_finishes(s, r[0], r[1], msgs, stride, &d, false, false, 2, &error,
                                  max_blocks, &launches),
                  cudaSuccess)
            << kernel_fault();
        EXPECT_EQ(error, variant == 0 ? unsigned{kDynamiqBadRecord} : unsigned{kDynamiqBadHeader})
            << what;
        EXPECT_EQ(launches, 1u) << what;
        for (size_t i = 0; i < d.size(); ++i)
          ASSERT_EQ(d[i], 5.0f) << what << ": element " << i << " written";
      }
    }
}

}  // namespace
}  // namespace dq::cuda
