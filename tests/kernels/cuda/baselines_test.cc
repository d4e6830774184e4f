// The baseline codecs' kernels (kernels/cuda/baselines.cu) under the CUDA emulation against the
// host codecs byte for byte, for every baseline (bf16, mxfp8, mxfp6e3m2, mxfp6e2m3, mxfp4,
// uniform:3 .. uniform:9):
//  - the device parameters give the host plan's capacity; the layout kernel writes the bytes of
//    build_layout();
//  - every chunk's message of fused_hop() (header, blocks, zero padding) for n_in = 0..3 inputs,
//    FP32 and BF16 own values, 0 to 20003 values (odd counts, a partial last block, empty chunks),
//    2 to 64 chunks, grids of 1 to 4096 blocks, non-zero element bases, values from subnormal to
//    FLT_MAX, zero blocks, NaN and Inf in one worker's values; then decode_finish() of each message
//    (1..4 workers) into FP32 and BF16, SUM and AVG, every output word compared. A NaN word is
//    compared as "both NaN" where the host's word is NaN (BF16 words of the bf16 codec, finish
//    outputs): x86 keeps a NaN operand's payload, a GPU returns the canonical NaN
//    (kernels/cuda/EMULATION.md). MX and uniform messages never carry a NaN payload.
//  - malformed inputs (another call's header, too many workers, invalid uniform codes and scales):
//    the same outcome as the host (message untouched, or all zero), the finish's output untouched.
//  - a finish step: a range of chunks in one launch, as the host's finish of each in turn; one bad
//    chunk in it leaves every chunk's output untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "kernels/cuda/baselines.h"
#include "kernels/payload.h"

namespace dq::cuda {
namespace {

// launch_baseline_finish with a plain flags word: a StepWord without kFoldFlag around it (its
// flags stay for the caller); the launch must leave its tickets at 0.
cudaError_t finish_with_word(const BaselineDeviceParams& p, const void* layout, int chunk,
                             const uint8_t* in, void* out, bool out_bf16, bool avg, int n_contrib,
                             unsigned* error, int max_blocks = 0) {
  StepWord w{};
  w.flags = *error;
  const cudaError_t e = launch_baseline_finish(p, layout, chunk, in, out, out_bf16, avg, n_contrib,
                                               &w, nullptr, max_blocks);
  *error = w.flags;
  EXPECT_EQ(w.tickets + w.validated + w.finished, 0u) << "the finish left its tickets set";
  return e;
}

// launch_baseline_finishes with a plain flags word, as finish_with_word(); *launches: the kernels
// it started.
cudaError_t finishes_with_word(const BaselineDeviceParams& p, const void* layout, int first, int n,
                               const uint8_t* in, size_t stride, void* out, bool out_bf16, bool avg,
                               int n_contrib, unsigned* error, int max_blocks, uint64_t* launches) {
  StepWord w{};
  w.flags = *error;
  const uint64_t before = emu::launches();
  const cudaError_t e = launch_baseline_finishes(p, layout, first, n, in, stride, out, out_bf16,
                                                 avg, n_contrib, &w, nullptr, max_blocks);
  *launches = emu::launches() - before;
  *error = w.flags;
  EXPECT_EQ(w.tickets + w.validated + w.finished, 0u) << "the finishes left their tickets set";
  return e;
}

const char* const kSpecs[] = {"bf16",      "mxfp8",     "mxfp6e3m2", "mxfp6e2m3",
                              "mxfp4",     "uniform:3", "uniform:4", "uniform:5",
                              "uniform:6", "uniform:7", "uniform:8", "uniform:9"};

bool nan32(uint32_t w) {
  return (w & 0x7fffffffu) > 0x7f800000u;
}
bool nan16(uint16_t w) {
  return (w & 0x7fffu) > 0x7f80u;
}

// Per 32 values one regime: zeros, subnormals, values near FLT_MAX (sums overflow), or normal
// values at a scale in 2^-30..2^30; where `poison`, NaN or +-Inf in some of them.
std::vector<float> make_values(size_t count, uint32_t seed, bool poison) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(count);
  for (size_t base = 0; base < count; base += 32) {
    const size_t end = std::min(count, base + 32);
    const uint32_t regime = rng() % 16;
    const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 60) - 30);
    for (size_t i = base; i < end; ++i) {
      if (regime == 0)
        x[i] = 0.0f;
      else if (regime == 1)
        x[i] = std::ldexp(normal(rng), -140);
      else if (regime == 2)
        x[i] = (rng() % 4 == 0) ? (rng() % 2 ? FLT_MAX : -FLT_MAX) : normal(rng) * 0x1p125f;
      else
        x[i] = normal(rng) * scale;
    }
    if (poison && rng() % 5 == 0) {
      const uint32_t kind = rng() % 3;
      x[base + rng() % (end - base)] = kind == 0   ? std::numeric_limits<float>::quiet_NaN()
                                       : kind == 1 ? INFINITY
                                                   : -INFINITY;
    }
  }
  return x;
}

struct Case {
  std::string spec;
  size_t count = 0;
  int n_chunks = 0;
  int n_workers = 4;
  bool bf16 = false;
  uint64_t element_base = 0;
  std::unique_ptr<Codec> codec;
  BaselineDeviceParams params;
  std::vector<std::vector<float>> f32;     // per worker
  std::vector<std::vector<uint16_t>> b16;  // per worker
  uint64_t host_layout = 0, dev_layout = 0;
  uint64_t call = 0;

  const void* own(int rank) const {
    return bf16 ? static_cast<const void*>(b16[rank].data())
                : static_cast<const void*>(f32[rank].data());
  }
  ConstTensor tensor(int rank) const {
    return ConstTensor{own(rank), bf16 ? DType::kBF16 : DType::kF32, count};
  }
  std::string where() const {
    return spec + " count " + std::to_string(count) + " chunks " + std::to_string(n_chunks) +
           (bf16 ? " bf16" : " fp32") + " base " + std::to_string(element_base);
  }
};

void make_case(const std::string& spec, size_t count, int n_chunks, bool bf16,
               uint64_t element_base, uint32_t seed, bool poison, Case* s) {
  s->spec = spec;
  s->count = count;
  s->n_chunks = n_chunks;
  s->bf16 = bf16;
  s->element_base = element_base;
  std::string error;
  s->codec = make_codec(spec, &error);
  ASSERT_NE(s->codec, nullptr) << error;
  ASSERT_EQ(s->codec->plan(count, n_chunks, s->n_workers), Status::kOk);
  ASSERT_TRUE(baseline_device_params(s->codec->name(), count, n_chunks, s->n_workers, &s->params))
      << spec;
  ASSERT_EQ(s->params.capacity, s->codec->chunk_capacity()) << s->where();
  ASSERT_EQ(s->codec->layout_bytes(), 8u);
  s->f32.resize(s->n_workers);
  s->b16.resize(s->n_workers);
  for (int r = 0; r < s->n_workers; ++r) {
    s->f32[r] = make_values(count, seed * 31 + r, poison && r == s->n_workers - 1);
    s->b16[r].resize(count);
    for (size_t i = 0; i < count; ++i) s->b16[r][i] = f32_to_bf16_rne(s->f32[r][i]);
  }
  s->call = 0x100000000ull * seed + 0x1234567ull * seed + 5;
  s->host_layout = 0x5a5a5a5a5a5a5a5aull;
  s->dev_layout = 0xa5a5a5a5a5a5a5a5ull;
  ASSERT_EQ(s->codec->build_layout(nullptr, s->call, &s->host_layout), Status::kOk);
  ASSERT_EQ(launch_baseline_layout(s->call, &s->dev_layout, nullptr), cudaSuccess)
      << emu::last_report().message;
  ASSERT_EQ(s->host_layout, s->dev_layout) << s->where();
}

struct Seen {
  int nan_words = 0;       // bf16 codec: NaN words in the host's messages
  int mx_nan_scales = 0;   // MX blocks with the NaN scale
  int mx_zero_scales = 0;  // MX blocks with scale byte 0 (all zero, or subnormal)
  int uniform_nan_scales = 0;
};

void note(const Case& s, int chunk, const std::vector<uint8_t>& m, Seen* seen) {
  const BaselineDeviceParams& p = s.params;
  const uint8_t* body = m.data() + kChunkHeaderBytes;
  const size_t blocks =
      (chunk + 1) * p.n_blocks / p.n_chunks - chunk * p.n_blocks / p.n_chunks;  // no padding
  for (size_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = body + b * p.block_bytes;
    if (p.codec == CodecId::kBf16)
      seen->nan_words += nan16(static_cast<uint16_t>(blk[0] | blk[1] << 8));
    else if (p.codec == CodecId::kUniform)
      seen->uniform_nan_scales += (blk[0] | blk[1] << 8) == 0x7FC0;
    else {
      seen->mx_nan_scales += blk[0] == 0xFF;
      seen->mx_zero_scales += blk[0] == 0;
    }
  }
}

// The host's hop and the device's on the same inputs; the host's message comes back.
void expect_same_hop(const Case& s, int chunk, int n_in,
                     const std::vector<std::vector<uint8_t>>& inputs, const RoundingKey& key,
                     std::vector<uint8_t>* message) {
  const size_t cap = s.codec->chunk_capacity();
  std::vector<ByteView> views;
  std::vector<const uint8_t*> ptrs;
  for (int i = 0; i < n_in; ++i) {
    views.push_back(ByteView{inputs[i].data(), inputs[i].size()});
    ptrs.push_back(inputs[i].data());
  }
  std::vector<uint8_t> host(cap, 0xAB), dev(cap, 0xCD);
  ASSERT_EQ(s.codec->fused_hop(&s.host_layout, chunk, s.tensor(key.rank), views.data(), n_in,
                               host.data(), key),
            Status::kOk);
  unsigned error = 0;
  const int max_blocks = chunk % 4 == 3 ? 0 : 1 + chunk % 3;
  ASSERT_EQ(launch_baseline_hop(s.params, &s.dev_layout, chunk, s.own(key.rank), s.bf16,
                                ptrs.data(), n_in, dev.data(), key, &error, nullptr, max_blocks),
            cudaSuccess)
      << emu::last_report().message;
  EXPECT_EQ(error, 0u) << s.where();
  const bool bf16_codec = s.params.codec == CodecId::kBf16;
  for (size_t b = 0; b < cap; ++b) {
    if (host[b] == dev[b]) continue;
    if (bf16_codec && b >= kChunkHeaderBytes) {  // a NaN word as a NaN
      const size_t w = kChunkHeaderBytes + ((b - kChunkHeaderBytes) & ~size_t{1});
      if (nan16(static_cast<uint16_t>(host[w] | host[w + 1] << 8)) &&
          nan16(static_cast<uint16_t>(dev[w] | dev[w + 1] << 8)))
        continue;
    }
    FAIL() << s.where() << " chunk " << chunk << " n_in " << n_in << ": message byte " << b
           << " of " << cap << " host " << int(host[b]) << " device " << int(dev[b]);
  }
  *message = host;
}

void expect_same_finish(const Case& s, int chunk, const std::vector<uint8_t>& message,
                        int n_contrib) {
  for (bool out_bf16 : {false, true})
    for (bool avg : {false, true}) {
      const size_t word = out_bf16 ? 2 : 4;
      const size_t bytes = s.count * word;
      std::vector<uint8_t> host(bytes + 1, 0x77), dev(bytes + 1, 0x77);
      ASSERT_EQ(
          s.codec->decode_finish(&s.host_layout, chunk, ByteView{message.data(), message.size()},
                                 host.data(), out_bf16 ? DType::kBF16 : DType::kF32,
                                 avg ? ReduceOp::kAvg : ReduceOp::kSum, n_contrib),
          Status::kOk);
      unsigned error = 0;
      ASSERT_EQ(finish_with_word(s.params, &s.dev_layout, chunk, message.data(), dev.data(),
                                 out_bf16, avg, n_contrib, &error, 1 + chunk % 3),
                cudaSuccess)
          << emu::last_report().message;
      EXPECT_EQ(error, 0u);
      for (size_t i = 0; i < s.count; ++i) {
        uint32_t h = 0, d = 0;
        std::memcpy(&h, host.data() + i * word, word);
        std::memcpy(&d, dev.data() + i * word, word);
        if (h == d) continue;
        if (out_bf16 ? (nan16(static_cast<uint16_t>(h)) && nan16(static_cast<uint16_t>(d)))
                     : (nan32(h) && nan32(d)))
          continue;
        FAIL() << "finish " << s.where() << " chunk " << chunk
               << (out_bf16 ? " to bf16" : " to fp32") << (avg ? " avg" : " sum") << " n_contrib "
               << n_contrib << ": element " << i << " host 0x" << std::hex << h << " device 0x"
               << d;
      }
      EXPECT_EQ(host[bytes], 0x77);
      EXPECT_EQ(dev[bytes], 0x77);
    }
}

// Leaves of workers 1..3 (host), then worker 0's hop over 0..3 of them and the finish of each.
void run_hops(const std::string& spec, size_t count, int n_chunks, bool bf16, uint64_t element_base,
              uint32_t seed, Seen* seen) {
  Case s;
  make_case(spec, count, n_chunks, bf16, element_base, seed, true, &s);
  if (::testing::Test::HasFatalFailure()) return;
  const size_t cap = s.codec->chunk_capacity();
  for (int chunk = 0; chunk < n_chunks; ++chunk) {
    std::vector<std::vector<uint8_t>> leaves(3, std::vector<uint8_t>(cap));
    for (int r = 1; r <= 3; ++r) {
      const RoundingKey leaf{seed, s.call, static_cast<uint32_t>(r), 0, 1, 0, element_base};
      ASSERT_EQ(s.codec->fused_hop(&s.host_layout, chunk, s.tensor(r), nullptr, 0,
                                   leaves[r - 1].data(), leaf),
                Status::kOk);
    }
    for (int n_in = 0; n_in <= 3; ++n_in) {
      const RoundingKey key{seed, s.call, 0, 0, 1, 0, element_base};
      std::vector<uint8_t> message;
      expect_same_hop(s, chunk, n_in, leaves, key, &message);
      if (::testing::Test::HasFatalFailure()) return;
      note(s, chunk, message, seen);
      expect_same_finish(s, chunk, message, 1 + n_in);  // 1..4 workers: AVG divides by 3 too
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(CudaBaselines, ParamsAndLayoutMatchTheHostPlan) {
  for (const char* spec : kSpecs)
    for (size_t count :
         {size_t{0}, size_t{1}, size_t{31}, size_t{33}, size_t{1000}, size_t{123457}})
      for (int chunks : {1, 2, 7, 64}) {
        std::unique_ptr<Codec> c = make_codec(spec, nullptr);
        ASSERT_NE(c, nullptr);
        ASSERT_EQ(c->plan(count, chunks, 3), Status::kOk);
        BaselineDeviceParams p;
        ASSERT_TRUE(baseline_device_params(c->name(), count, chunks, 3, &p)) << spec;
        EXPECT_EQ(p.capacity, c->chunk_capacity()) << spec << " " << count << " " << chunks;
      }
  BaselineDeviceParams p;
  EXPECT_FALSE(baseline_device_params("dynamiq:5", 100, 2, 2, &p));
  EXPECT_FALSE(baseline_device_params("uniform:2", 100, 2, 2, &p));
  EXPECT_FALSE(baseline_device_params("uniform:10", 100, 2, 2, &p));
  EXPECT_FALSE(baseline_device_params("bf16", 100, 0, 2, &p));
  EXPECT_FALSE(baseline_device_params("bf16", 100, 65537, 2, &p));
  EXPECT_FALSE(baseline_device_params("bf16", 100, 2, 0, &p));
  EXPECT_FALSE(baseline_device_params("bf16", (size_t{1} << 34) + 1, 2, 2, &p));
  for (uint64_t call : {uint64_t{0}, uint64_t{1}, uint64_t{0xfedcba9876543210ull}}) {
    uint64_t host = 1, dev = 2;
    std::unique_ptr<Codec> c = make_codec("mxfp8", nullptr);
    ASSERT_EQ(c->plan(100, 2, 2), Status::kOk);
    ASSERT_EQ(c->build_layout(nullptr, call, &host), Status::kOk);
    ASSERT_EQ(launch_baseline_layout(call, &dev, nullptr), cudaSuccess);
    EXPECT_EQ(host, dev);
  }
}

TEST(CudaBaselines, HopAndFinishMatchHostByteForByte) {
  uint32_t seed = 21;
  for (const char* spec : kSpecs) {
    Seen seen;
    run_hops(spec, 1007, 2, false, 0, seed++, &seen);
    if (HasFatalFailure()) return;
    run_hops(spec, 3001, 3, true, 256 * 5, seed++, &seen);
    if (HasFatalFailure()) return;
    run_hops(spec, 2113, 64, false, 256 * 3, seed++, &seen);
    if (HasFatalFailure()) return;
    run_hops(spec, 5, 4, true, 0, seed++, &seen);  // empty chunks (the MX and uniform ones)
    if (HasFatalFailure()) return;
    run_hops(spec, 0, 2, false, 0, seed++, &seen);
    if (HasFatalFailure()) return;
    run_hops(spec, 20003, 2, false, 0, seed++, &seen);
    if (HasFatalFailure()) return;
    const std::string name(spec);
    if (name == "bf16") {
      EXPECT_GT(seen.nan_words, 0);
    } else if (name.rfind("mx", 0) == 0) {
      EXPECT_GT(seen.mx_nan_scales, 0) << spec;
      EXPECT_GT(seen.mx_zero_scales, 0) << spec;
    } else {
      EXPECT_GT(seen.uniform_nan_scales, 0) << spec;
    }
  }
}

// A lane that failed before the step: the word is armed (kSkipFlag, with an earlier flag) when the
// launch starts, so the layout, the hop (leaf, and with an input: uniform's clear pass included,
// which kBaselineBadCodes in the word would otherwise trigger) and the finish write nothing, and
// leave the word as it was.
TEST(CudaBaselines, PresetErrorWordWritesNothing) {
  uint32_t seed = 301;
  for (const char* spec : kSpecs) {
    Case s;
    make_case(spec, 5000, 2, false, 0, seed++, false, &s);
    ASSERT_FALSE(HasFatalFailure());
    const unsigned preset = kBaselineBadCodes | kSkipFlag;
    uint64_t layout = 0x3c3c3c3c3c3c3c3cull;
    unsigned error = preset;
    ASSERT_EQ(launch_baseline_layout(s.call + 1, &layout, nullptr, &error), cudaSuccess)
        << emu::last_report().message;
    EXPECT_EQ(layout, 0x3c3c3c3c3c3c3c3cull) << spec;
    EXPECT_EQ(error, preset) << spec;
    const size_t cap = s.codec->chunk_capacity();
    const RoundingKey key{seed, s.call, 1, 0, 1, 0, 0};
    std::vector<uint8_t> leaf(cap);
    ASSERT_EQ(s.codec->fused_hop(&s.host_layout, 1, s.tensor(1), nullptr, 0, leaf.data(), key),
              Status::kOk);
    const uint8_t* ptr = leaf.data();
    for (int n_in : {0, 1})
      for (int max_blocks : {1, 0}) {
        std::vector<uint8_t> out(cap, 0xCD);
        error = preset;
        ASSERT_EQ(launch_baseline_hop(s.params, &s.dev_layout, 1, s.own(0), false, &ptr, n_in,
                                      out.data(), key, &error, nullptr, max_blocks),
                  cudaSuccess)
            << emu::last_report().message;
        EXPECT_EQ(error, preset) << spec << " n_in " << n_in;
        for (size_t b = 0; b < cap; ++b)
          ASSERT_EQ(int(out[b]), 0xCD) << spec << " n_in " << n_in << ": hop byte " << b;
      }
    // The finish, with a worker count its check would refuse.
    std::vector<float> out(s.count, 5.0f);
    error = preset;
    ASSERT_EQ(finish_with_word(s.params, &s.dev_layout, 1, leaf.data(), out.data(), false, false, 2,
                               &error),
              cudaSuccess)
        << emu::last_report().message;
    EXPECT_EQ(error, preset) << spec;
    for (size_t i = 0; i < out.size(); ++i)
      ASSERT_EQ(out[i], 5.0f) << spec << " finish element " << i;
  }
}

TEST(CudaBaselines, MalformedInputsAreFlaggedLikeTheHost) {
  uint32_t seed = 77;
  for (const char* spec : kSpecs) {
    Case s;
    make_case(spec, 700, 2, false, 0, seed++, false, &s);
    ASSERT_FALSE(HasFatalFailure());
    const size_t cap = s.codec->chunk_capacity();
    const bool uniform = s.params.codec == CodecId::kUniform;
    const RoundingKey leaf_key{seed, s.call, 1, 0, 1, 0, 0};
    std::vector<uint8_t> leaf(cap), three(cap);
    ASSERT_EQ(s.codec->fused_hop(&s.host_layout, 1, s.tensor(1), nullptr, 0, leaf.data(), leaf_key),
              Status::kOk);
    // A message that sums every worker: one more is too many.
    {
      const ByteView v[3] = {{leaf.data(), cap}, {leaf.data(), cap}, {leaf.data(), cap}};
      ASSERT_EQ(s.codec->fused_hop(&s.host_layout, 1, s.tensor(2), v, 3, three.data(), leaf_key),
                Status::kOk);
    }
    std::vector<uint8_t> other_call = leaf, other_digest = leaf, bad_code = leaf, bad_scale = leaf;
    other_call[8] ^= 1;
    other_digest[13] ^= 0x10;
    bad_code[kChunkHeaderBytes + 2 * s.params.block_bytes + (uniform ? 2 : 0)] =
        0xFF;                                                        // uniform: code 0 all ones
    bad_scale[kChunkHeaderBytes + 3 * s.params.block_bytes] = 0x80;  // uniform: scale -1.0
    bad_scale[kChunkHeaderBytes + 3 * s.params.block_bytes + 1] = 0xBF;
    struct Variant {
      const char* what;
      const std::vector<uint8_t>* msg;
      unsigned flag;  // the device's flag
      bool zeroes;    // the host leaves the message all zero (else untouched)
    };
    const Variant variants[] = {
        {"another call", &other_call, kBaselineBadHeader, false},
        {"another digest", &other_digest, kBaselineBadHeader, false},
        {"too many workers", &three, kBaselineTooManyWorkers, false},
        {"invalid code", &bad_code, uniform ? kBaselineBadCodes : 0u, uniform},
        {"invalid scale", &bad_scale, uniform ? kBaselineBadCodes : 0u, uniform}};
    const RoundingKey key{seed, s.call, 0, 0, 1, 0, 0};
    for (const Variant& v : variants) {
      // The hop, with the bad message second of two inputs.
      const ByteView views[2] = {{leaf.data(), cap}, {v.msg->data(), cap}};
      const uint8_t* ptrs[2] = {leaf.data(), v.msg->data()};
      const int n_in = v.msg == &three ? 1 : 2;
      const ByteView* vp = n_in == 1 ? views + 1 : views;
      const uint8_t* const* pp = n_in == 1 ? ptrs + 1 : ptrs;
      std::vector<uint8_t> host(cap, 0xAB), dev(cap, 0xAB);
      const Status st =
          s.codec->fused_hop(&s.host_layout, 1, s.tensor(0), vp, n_in, host.data(), key);
      EXPECT_EQ(st, v.flag ? Status::kMalformedPayload : Status::kOk) << spec << " " << v.what;
      unsigned error = 0;
      ASSERT_EQ(launch_baseline_hop(s.params, &s.dev_layout, 1, s.own(0), false, pp, n_in,
                                    dev.data(), key, &error, nullptr, 2),
                cudaSuccess)
          << emu::last_report().message;
      EXPECT_EQ(error, v.flag) << spec << " " << v.what;
      EXPECT_EQ(host, dev) << spec << " " << v.what;
      if (v.flag) {
        EXPECT_EQ(dev, std::vector<uint8_t>(cap, v.zeroes ? 0 : 0xAB)) << spec << " " << v.what;
      }
      // The finish of the bad message alone; `three` sums 3 workers where 1 is expected.
      std::vector<float> h(s.count, 5.0f), d(s.count, 5.0f);
      const Status fs = s.codec->decode_finish(&s.host_layout, 1, ByteView{v.msg->data(), cap},
                                               h.data(), DType::kF32, ReduceOp::kSum, 1);
      EXPECT_EQ(fs, v.flag ? Status::kMalformedPayload : Status::kOk) << spec << " " << v.what;
      error = 0;
      ASSERT_EQ(finish_with_word(s.params, &s.dev_layout, 1, v.msg->data(), d.data(), false, false,
                                 1, &error),
                cudaSuccess)
          << emu::last_report().message;
      EXPECT_EQ(error, v.flag == kBaselineTooManyWorkers ? unsigned{kBaselineBadHeader} : v.flag)
          << spec << " " << v.what;
      for (size_t i = 0; i < h.size(); ++i) {
        const bool both_nan = std::isnan(h[i]) && std::isnan(d[i]);
        ASSERT_TRUE(both_nan || std::memcmp(&h[i], &d[i], 4) == 0)
            << spec << " " << v.what << " element " << i;
      }
      if (v.flag) {
        EXPECT_EQ(d, std::vector<float>(s.count, 5.0f)) << spec << " " << v.what;
      }
    }
  }
}

// Uniform's finish in one launch (validator blocks, then decoders behind them): one invalid code
// in the chunk's last group leaves every element untouched at grids of one, two and many blocks a
// role, as on the host; the valid message decodes as the host's.
TEST(CudaBaselines, UniformLateBadCodeLeavesTheFinishOutputUntouched) {
  Case s;
  make_case("uniform:5", 40000, 2, false, 0, 77, false, &s);
  ASSERT_FALSE(HasFatalFailure());
  const size_t cap = s.codec->chunk_capacity();
  const RoundingKey key{77, s.call, 1, 0, 1, 0, 0};
  std::vector<uint8_t> leaf(cap);
  ASSERT_EQ(s.codec->fused_hop(&s.host_layout, 1, s.tensor(1), nullptr, 0, leaf.data(), key),
            Status::kOk);
  // The chunk's last group the host validates: code 0 of it set to all ones.
  const size_t groups = (cap - kChunkHeaderBytes) / s.params.block_bytes;
  std::vector<uint8_t> bad;
  std::vector<float> h(s.count, 5.0f), d(s.count, 5.0f);
  size_t late = groups;
  while (late-- > 0) {
    bad = leaf;
    bad[kChunkHeaderBytes + late * s.params.block_bytes + 2] = 0xFF;
    if (s.codec->decode_finish(&s.host_layout, 1, ByteView{bad.data(), cap}, h.data(), DType::kF32,
                               ReduceOp::kSum, 1) == Status::kMalformedPayload)
      break;
  }
  ASSERT_LT(late, groups);
  ASSERT_GT(late, groups / 2) << "the bad group is late in the chunk";
  for (int max_blocks : {1, 2, 0}) {
    std::fill(d.begin(), d.end(), 5.0f);
    unsigned error = 0;
    ASSERT_EQ(finish_with_word(s.params, &s.dev_layout, 1, bad.data(), d.data(), false, false, 1,
                               &error, max_blocks),
              cudaSuccess)
        << emu::last_report().message;
    EXPECT_EQ(error, unsigned{kBaselineBadCodes}) << "max_blocks " << max_blocks;
    for (size_t i = 0; i < d.size(); ++i)
      ASSERT_EQ(d[i], 5.0f) << "element " << i << " written, max_blocks " << max_blocks;
    error = 0;
    ASSERT_EQ(s.codec->decode_finish(&s.host_layout, 1, ByteView{leaf.data(), cap}, h.data(),
                                     DType::kF32, ReduceOp::kSum, 1),
              Status::kOk);
    ASSERT_EQ(finish_with_word(s.params, &s.dev_layout, 1, leaf.data(), d.data(), false, false, 1,
                               &error, max_blocks),
              cudaSuccess)
        << emu::last_report().message;
    EXPECT_EQ(error, 0u);
    EXPECT_EQ(std::memcmp(h.data(), d.data(), 4 * h.size()), 0) << "max_blocks " << max_blocks;
  }
}

TEST(CudaBaselines, BadArgumentsAreRefusedLikeTheHost) {
  Case s;
  make_case("uniform:5", 600, 2, false, 0, 3, false, &s);
  ASSERT_FALSE(HasFatalFailure());
  std::vector<uint8_t> out(s.codec->chunk_capacity());
  unsigned error = 0;
  for (uint64_t base : {uint64_t{100}, (uint64_t{1} << 34) - 256}) {
    const RoundingKey key{1, 2, 0, 0, 1, 0, base};
    EXPECT_EQ(s.codec->fused_hop(&s.host_layout, 0, s.tensor(0), nullptr, 0, out.data(), key),
              Status::kInvalidArgument);
    EXPECT_EQ(launch_baseline_hop(s.params, &s.dev_layout, 0, s.own(0), false, nullptr, 0,
                                  out.data(), key, &error, nullptr),
              cudaErrorInvalidValue);
  }
  const RoundingKey key{1, 2, 0, 0, 1, 0, 0};
  EXPECT_EQ(launch_baseline_hop(s.params, &s.dev_layout, 2, s.own(0), false, nullptr, 0, out.data(),
                                key, &error, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(launch_baseline_hop(s.params, nullptr, 0, s.own(0), false, nullptr, 0, out.data(), key,
                                &error, nullptr),
            cudaErrorInvalidValue);
  std::vector<float> f(s.count);
  EXPECT_EQ(
      finish_with_word(s.params, &s.dev_layout, 0, out.data(), f.data(), false, false, 5, &error),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      finish_with_word(s.params, &s.dev_layout, 0, out.data(), f.data(), false, false, 0, &error),
      cudaErrorInvalidValue);
  EXPECT_EQ(error, 0u);
}

// ---- a finish step: a range of chunks in one launch (launch_baseline_finishes) -----------------

// Every chunk's message of a 2-worker sum (worker 0's hop over worker 1's leaf), `stride` bytes
// apart, as the engine's finish step finds them.
std::vector<uint8_t> packed_messages(const Case& s, size_t stride) {
  const size_t cap = s.codec->chunk_capacity();
  std::vector<uint8_t> packed(stride * (s.n_chunks - 1) + cap, 0xE1);
  for (int chunk = 0; chunk < s.n_chunks; ++chunk) {
    std::vector<uint8_t> leaf(cap);
    const RoundingKey leaf_key{31, s.call, 1, 0, 1, 0, 0};
    EXPECT_EQ(
        s.codec->fused_hop(&s.host_layout, chunk, s.tensor(1), nullptr, 0, leaf.data(), leaf_key),
        Status::kOk);
    const ByteView in{leaf.data(), cap};
    const RoundingKey key{31, s.call, 0, 0, 1, 0, 0};
    EXPECT_EQ(s.codec->fused_hop(&s.host_layout, chunk, s.tensor(0), &in, 1,
                                 packed.data() + chunk * stride, key),
              Status::kOk);
  }
  return packed;
}

// The host's decode_finish of chunks first .. first + n - 1 (messages from packed[0] at
// `stride`), one at a time, into `out`.
Status host_finishes(const Case& s, int first, int n, const uint8_t* packed, size_t stride,
                     void* out, bool out_bf16, bool avg, int n_contrib) {
  for (int c = first; c < first + n; ++c) {
    const Status st = s.codec->decode_finish(
        &s.host_layout, c, ByteView{packed + (c - first) * stride, s.codec->chunk_capacity()}, out,
        out_bf16 ? DType::kBF16 : DType::kF32, avg ? ReduceOp::kAvg : ReduceOp::kSum, n_contrib);
    if (st != Status::kOk) return st;
  }
  return Status::kOk;
}

// Every baseline, 5 chunks at 20,003 and 100 values (an MX chunk of none): all chunks of a step and
// ranges starting past chunk 0, one launch each, every output word as the host's decode_finish of
// each chunk in turn (a NaN as a NaN), the rest untouched, FP32 and BF16, SUM and AVG, messages at
// a stride of no multiple of 4; the tickets end at 0 (finishes_with_word()).
TEST(CudaBaselines, AFinishStepDecodesItsChunksInOneLaunch) {
  const int ranges[][2] = {{0, 5}, {1, 3}, {4, 1}};
  for (const char* spec : kSpecs)
    for (size_t count : {size_t{20003}, size_t{100}}) {
      Case s;
      make_case(spec, count, 5, false, 0, 17, false, &s);
      ASSERT_FALSE(HasFatalFailure());
      const size_t stride = s.codec->chunk_capacity() + 3;
      const std::vector<uint8_t> all = packed_messages(s, stride);
      ASSERT_FALSE(HasFailure());
      for (const auto& r : ranges)
        for (bool out_bf16 : {false, true})
          for (bool avg : {false, true})
            for (int max_blocks : {1, 0}) {
              const std::string what =
                  s.where() + " chunks " + std::to_string(r[0]) + ".." +
                  std::to_string(r[0] + r[1] - 1) + (out_bf16 ? " to bf16" : " to fp32") +
                  (avg ? " avg" : " sum") + " max_blocks " + std::to_string(max_blocks);
              const uint8_t* msgs = all.data() + r[0] * stride;
              const size_t word = out_bf16 ? 2 : 4;
              std::vector<uint8_t> host(s.count * word + 1, 0x77), dev(s.count * word + 1, 0x77);
              ASSERT_EQ(host_finishes(s, r[0], r[1], msgs, stride, host.data(), out_bf16, avg, 2),
                        Status::kOk)
                  << what;
              unsigned error = 0;
              uint64_t launches = 0;
              ASSERT_EQ(
                  finishes_with_word(s.params, &s.dev_layout, r[0], r[1], msgs, stride, dev.data(),
                                     out_bf16, avg, 2, &error, max_blocks, &launches),
                  cudaSuccess)
                  << emu::last_report().message;
              EXPECT_EQ(error, 0u) << what;
              EXPECT_EQ(launches, 1u) << what;
              for (size_t i = 0; i <= s.count; ++i) {
                uint32_t h = 0, d = 0;
                const size_t w = i < s.count ? word : 1;  // the byte past the output
                std::memcpy(&h, host.data() + i * word, w);
                std::memcpy(&d, dev.data() + i * word, w);
                if (h == d) continue;
                if (i < s.count &&
                    (out_bf16 ? (nan16(static_cast<uint16_t>(h)) && nan16(static_cast<uint16_t>(d)))
                              : (nan32(h) && nan32(d))))
                  continue;
                FAIL() << what << ": element " << i << " host 0x" << std::hex << h << " device 0x"
                       << d;
              }
            }
    }
}

// A bad header in the LAST chunk of a range (every baseline family), or an invalid uniform code
// late in it: no chunk of the launch writes anything (stricter than the host, which writes the
// range's valid chunks before it), the flag is raised, at 1, 2, 3, 7 and the default blocks a
// role; the tickets end at 0.
TEST(CudaBaselines, ABadLastChunkLeavesEveryChunkOfTheFinishStepUntouched) {
  const int ranges[][2] = {{0, 5}, {1, 3}};
  for (const char* spec : {"bf16", "mxfp8", "uniform:5"})
    for (int variant = 0; variant < 2; ++variant) {
      const bool codes = variant == 1;
      if (codes && std::string(spec) != "uniform:5") continue;
      Case s;
      make_case(spec, 40000, 5, false, 0, 19, false, &s);
      ASSERT_FALSE(HasFatalFailure());
      const size_t cap = s.codec->chunk_capacity();
      const size_t stride = cap + 8;
      const std::vector<uint8_t> all = packed_messages(s, stride);
      ASSERT_FALSE(HasFailure());
      for (const auto& r : ranges) {
        const int last = r[0] + r[1] - 1;
        std::vector<uint8_t> msgs(all.begin() + r[0] * stride, all.end());
        uint8_t* last_msg = msgs.data() + (r[1] - 1) * stride;
        if (codes) {
          // The last chunk's last whole group: its code 0 all ones (an invalid code).
          const unsigned long long blocks =
              (last + 1) * s.params.n_blocks / 5 - last * s.params.n_blocks / 5;
          last_msg[kChunkHeaderBytes + (blocks - 2) * s.params.block_bytes + 2] |= 0x0F;
        } else {
          last_msg[8] ^= 1;  // the header names another call
        }
        std::vector<float> h(s.count, 5.0f);
        ASSERT_EQ(host_finishes(s, r[0], r[1], msgs.data(), stride, h.data(), false, false, 2),
                  Status::kMalformedPayload)
            << s.where();
        for (int max_blocks : {1, 2, 3, 7, 0}) {
          const std::string what = s.where() + " chunks " + std::to_string(r[0]) + ".." +
                                   std::to_string(last) + (codes ? " bad code" : " bad header") +
                                   " max_blocks " + std::to_string(max_blocks);
          std::vector<float> d(s.count, 5.0f);
          unsigned error = 0;
          uint64_t launches = 0;
          ASSERT_EQ(finishes_with_word(s.params, &s.dev_layout, r[0], r[1], msgs.data(), stride,
                                       d.data(), false, false, 2, &error, max_blocks, &launches),
                    cudaSuccess)
              << emu::last_report().message;
          EXPECT_EQ(error, codes ? unsigned{kBaselineBadCodes} : unsigned{kBaselineBadHeader})
              << what;
          EXPECT_EQ(launches, 1u) << what;
          for (size_t i = 0; i < d.size(); ++i)
            ASSERT_EQ(d[i], 5.0f) << what << ": element " << i << " written";
        }
      }
    }
}

}  // namespace
}  // namespace dq::cuda
