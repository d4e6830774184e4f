// Absolute figures for every codec, so that a change to the arithmetic cannot pass because the
// expected values come from the library's own helpers (the wire format's regression pins):
//  - Golden.PayloadsAndDecodeMatchCommitted: for fixed inputs (golden_value(), a formula), the
//    leaf and fused-hop chunk messages must equal the bytes committed under tests/kernels/golden/,
//    and finish() of the committed messages must give the committed decoded vectors bit for bit.
//    tests/kernels/golden_decode.py decodes the same files from docs/FORMAT.md alone.
//  - GoldenVnmse.WithinBandOfCommitted: the vNMSE of each codec through the simulator's ring of
//    4 on fixed data (the committed real-gradient sample and a formula) must lie within 15% of
//    the value committed in tests/kernels/golden/vnmse.txt.
// Regenerate (only for an intended format or accuracy change, and say so in the commit):
//   DQ_GOLDEN_WRITE=1 <build>/tests/kernels/test_golden
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/stats_sum.h"
#include "tools/sim/gradients.h"
#include "tools/sim/simulate.h"
#include "topo/schedule.h"

#ifndef DQ_GOLDEN_DIR
#error "DQ_GOLDEN_DIR must name tests/kernels/golden"
#endif
#ifndef DQ_SAMPLE_NPY
#error "DQ_SAMPLE_NPY must name tools/gradients/sample/step00079.npy"
#endif

namespace dq {
namespace {

bool writing() {
  const char* w = std::getenv("DQ_GOLDEN_WRITE");
  return w != nullptr && *w != '\0' && std::strcmp(w, "0") != 0;
}

std::string golden_path(const std::string& name) {
  return std::string(DQ_GOLDEN_DIR) + "/" + name;
}

bool read_file(const std::string& path, std::vector<uint8_t>* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  out->assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return true;
}

void write_file(const std::string& path, const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  ASSERT_TRUE(f) << "cannot write " << path;
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  ASSERT_TRUE(f.good()) << "short write to " << path;
}

template <class T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// "identical", or where and how often two byte strings differ.
std::string compare_bytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size())
    return "size " + std::to_string(got.size()) + ", committed " + std::to_string(want.size());
  size_t first = got.size(), n = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {
      if (first == got.size()) first = i;
      ++n;
    }
  if (n == 0) return "identical";
  char buf[160];
  std::snprintf(buf, sizeof buf,
                "%zu of %zu bytes differ, first at byte %zu (0x%02x, committed 0x%02x)", n,
                got.size(), first, got[first], want[first]);
  return buf;
}

// ---- Fixed inputs -------------------------------------------------------------------------------
// Element i of worker w (tests/kernels/golden/README.md gives the same formula in words). Only
// integer arithmetic and single IEEE operations, so every machine computes the same floats.
// j = i / 256 (super-group), g = (i % 256) / 16 (group of 16):
//   t = (((i * 7919 + w * 104729 + 17) mod 2003) - 1001) / 1001      in [-1, 1]
//   A = 2^(((7 j) mod 19) - 9)                                         amplitude, 2^-9 .. 2^9
//   s = 1/64 for g = 5, else ((g mod 4) + 1) / 4                       group shape
//   x = 0 when i mod 13 = 0 or j = 2 (an all-zero super-group);
//       A * (s * t - 2) for j = 5 (all negative), A * (s * t + 3) for j = 7 (a large mean);
//       otherwise A * s * t.
//   variant 1 (a width-16 super-group): j = 9 has A = 2^15, and its zeros are -0 for worker 1.
float golden_value(int variant, int worker, size_t i) {
  const size_t j = i / 256, g = (i % 256) / 16;
  if (variant == 1 && j == 9 && worker == 1 && i % 13 == 0) return -0.0f;  // width 16 keeps -0
  if (i % 13 == 0 || j == 2) return 0.0f;
  const long h = static_cast<long>((i * 7919 + static_cast<size_t>(worker) * 104729 + 17) % 2003);
  const float t = static_cast<float>(h - 1001) / 1001.0f;
  int e = static_cast<int>((7 * j) % 19) - 9;
  if (variant == 1 && j == 9) e = 15;
  const float a = std::ldexp(1.0f, e);
  const float s = g == 5 ? 1.0f / 64.0f : static_cast<float>(g % 4 + 1) / 4.0f;
  if (j == 5) return a * (s * t - 2.0f);
  if (j == 7) return a * (s * t + 3.0f);
  return a * (s * t);
}

struct GoldenCase {
  const char* name;  // directory under tests/kernels/golden
  const char* spec;  // make_codec() spec
  int variant;       // golden_value() variant
  size_t count;
};

// DynamiQ needs enough super-groups per chunk for widths above 2 to fit the budget; the block
// codecs need only a few blocks (520 = 16.25 MX blocks, 32.5 uniform groups: partial ends).
const GoldenCase kCases[] = {
    {"dynamiq5", "dynamiq:5", 0, 27 * 256 - 100},
    {"dynamiq5_w16", "dynamiq:5", 1, 27 * 256 - 100},
    {"mxfp8", "mxfp8", 0, 520},
    {"mxfp6e3m2", "mxfp6", 0, 520},
    {"mxfp6e2m3", "mxfp6e2m3", 0, 520},
    {"mxfp4", "mxfp4", 0, 520},
    {"bf16", "bf16", 0, 520},
    {"uniform5", "uniform:5", 0, 520},
};

// gtest names a failing case by this instead of its bytes.
void PrintTo(const GoldenCase& gc, std::ostream* os) {
  *os << gc.name << " (" << gc.spec << ")";
}

constexpr int kChunks = 2;
constexpr int kWorkers = 2;
constexpr uint64_t kCall = (uint64_t{1} << 32) + 7;  // the header carries the low 32 bits: 7
constexpr uint64_t kSeed = 0x5eed;

// Everything one case produces: worker 1 compresses each chunk as a leaf (rank 1), worker 0
// fuses it with its own values (rank 0, n_in = 1); finish() decodes both (SUM, FP32).
struct GoldenSet {
  std::string meta;
  std::vector<uint16_t> stats;                  // the all-reduced statistics words (DynamiQ)
  std::vector<std::vector<uint8_t>> leaf, hop;  // per chunk, chunk_capacity() bytes each
  std::vector<float> decoded_leaf, decoded_hop;
};

std::unique_ptr<Codec> codec_for(const GoldenCase& gc) {
  std::string err;
  auto c = make_codec(gc.spec, &err);
  EXPECT_TRUE(c) << err;
  if (c) {
    EXPECT_EQ(c->plan(gc.count, kChunks, kWorkers), Status::kOk);
  }
  return c;
}

std::string meta_text(const GoldenCase& gc, const Codec& c) {
  std::ostringstream m;
  m << "# tests/kernels/golden_test.cc, case " << gc.name << " (fields: golden/README.md)\n"
    << "spec " << gc.spec << "\n"
    << "variant " << gc.variant << "\n"
    << "count " << gc.count << "\n"
    << "n_chunks " << kChunks << "\n"
    << "n_workers " << kWorkers << "\n"
    << "call " << kCall << "\n"
    << "seed " << kSeed << "\n"
    << "capacity " << c.chunk_capacity() << "\n"
    << "stats_words " << c.stats_words() << "\n";
  if (std::string(gc.spec).rfind("dynamiq", 0) == 0)
    m << "budget_bits 5\neps 0.23 0.30 0.05\n";  // the defaults of DynamiqOptions
  return m.str();
}

// finish() of every chunk of `payloads` into one vector (elements no chunk holds stay NaN).
std::vector<float> decode_all(const Codec& c, const std::vector<std::vector<uint8_t>>& payloads,
                              int n_contrib) {
  std::vector<float> v(c.count(), std::nanf(""));
  for (int ch = 0; ch < kChunks; ++ch)
    EXPECT_EQ(c.finish(ch, {payloads[ch].data(), payloads[ch].size()}, v.data(), DType::kF32,
                       ReduceOp::kSum, n_contrib),
              Status::kOk)
        << "chunk " << ch;
  return v;
}

// Produces the set; leaf_in (optional, per chunk) replaces the recomputed leaf as the hop's
// input, so that a wrong leaf and a wrong hop are told apart.
void produce(const GoldenCase& gc, const std::vector<std::vector<uint8_t>>* leaf_in,
             GoldenSet* out) {
  auto c = codec_for(gc);
  ASSERT_TRUE(c);
  std::vector<float> x[kWorkers];
  for (int w = 0; w < kWorkers; ++w) {
    x[w].resize(gc.count);
    for (size_t i = 0; i < gc.count; ++i) x[w][i] = golden_value(gc.variant, w, i);
  }
  out->meta = meta_text(gc, *c);
  const size_t words = c->stats_words();
  out->stats.assign(words, 0);
  if (words > 0) {  // the statistics all-reduce: BF16 words summed in rank order, rounded to BF16
    StatsSum sum(words, c->stats_byte_sum_words());
    std::vector<uint16_t> local(words);
    for (int w = 0; w < kWorkers; ++w) {
      ASSERT_EQ(c->local_stats({x[w].data(), DType::kF32, gc.count}, local.data()), Status::kOk);
      sum.add(local.data());
    }
    sum.result(out->stats.data(), false);
  }
  ASSERT_EQ(c->agree(words ? out->stats.data() : nullptr, kCall), Status::kOk);
  const size_t cap = c->chunk_capacity();
  out->leaf.assign(kChunks, std::vector<uint8_t>(cap));
  out->hop.assign(kChunks, std::vector<uint8_t>(cap));
  for (int ch = 0; ch < kChunks; ++ch) {
    const RoundingKey leaf_key{kSeed, kCall, 1, 0, 1, 0};
    ASSERT_EQ(c->hop(ch, {x[1].data(), DType::kF32, gc.count}, nullptr, 0, out->leaf[ch].data(),
                     leaf_key),
              Status::kOk);
    const std::vector<uint8_t>& fed = leaf_in ? (*leaf_in)[ch] : out->leaf[ch];
    const ByteView in{fed.data(), fed.size()};
    const RoundingKey hop_key{kSeed, kCall, 0, 0, 1, 0};
    ASSERT_EQ(
        c->hop(ch, {x[0].data(), DType::kF32, gc.count}, &in, 1, out->hop[ch].data(), hop_key),
        Status::kOk);
  }
  out->decoded_leaf = decode_all(*c, out->leaf, 1);
  out->decoded_hop = decode_all(*c, out->hop, 2);
}

std::string chunk_file(const char* stage, int ch) {
  return std::string(stage) + ".c" + std::to_string(ch) + ".bin";
}

class Golden : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(Golden, PayloadsAndDecodeMatchCommitted) {
  const GoldenCase& gc = GetParam();
  const std::string dir = golden_path(gc.name) + "/";
  if (writing()) {
    GoldenSet s;
    produce(gc, nullptr, &s);
    ASSERT_EQ(std::system(("mkdir -p '" + dir + "'").c_str()), 0);
    write_file(dir + "meta.txt", s.meta.data(), s.meta.size());
    if (!s.stats.empty()) write_file(dir + "stats.u16", s.stats.data(), 2 * s.stats.size());
    for (int ch = 0; ch < kChunks; ++ch) {
      write_file(dir + chunk_file("leaf", ch), s.leaf[ch].data(), s.leaf[ch].size());
      write_file(dir + chunk_file("hop", ch), s.hop[ch].data(), s.hop[ch].size());
    }
    write_file(dir + "decoded_leaf.f32", s.decoded_leaf.data(), 4 * s.decoded_leaf.size());
    write_file(dir + "decoded_hop.f32", s.decoded_hop.data(), 4 * s.decoded_hop.size());
    std::printf("wrote %s\n", dir.c_str());
    return;
  }
  // The committed files.
  std::vector<uint8_t> meta, stats, dec_leaf, dec_hop;
  std::vector<std::vector<uint8_t>> leaf(kChunks), hop(kChunks);
  ASSERT_TRUE(read_file(dir + "meta.txt", &meta))
      << dir << ": missing (DQ_GOLDEN_WRITE=1 makes it)";
  for (int ch = 0; ch < kChunks; ++ch) {
    ASSERT_TRUE(read_file(dir + chunk_file("leaf", ch), &leaf[ch]));
    ASSERT_TRUE(read_file(dir + chunk_file("hop", ch), &hop[ch]));
  }
  ASSERT_TRUE(read_file(dir + "decoded_leaf.f32", &dec_leaf));
  ASSERT_TRUE(read_file(dir + "decoded_hop.f32", &dec_hop));

  // 1. Recomputed from the formula, byte for byte (the hop fed the committed leaf).
  GoldenSet s;
  produce(gc, &leaf, &s);
  EXPECT_EQ(std::string(meta.begin(), meta.end()), s.meta) << gc.name << ": plan or setup changed";
  if (!s.stats.empty()) {
    ASSERT_TRUE(read_file(dir + "stats.u16", &stats));
    EXPECT_EQ(compare_bytes(as_bytes(s.stats), stats), "identical") << gc.name << " statistics";
  }
  for (int ch = 0; ch < kChunks; ++ch) {
    EXPECT_EQ(compare_bytes(s.leaf[ch], leaf[ch]), "identical") << gc.name << " leaf chunk " << ch;
    EXPECT_EQ(compare_bytes(s.hop[ch], hop[ch]), "identical") << gc.name << " hop chunk " << ch;
  }

  // 2. finish() of the committed messages under the committed statistics, bit for bit.
  auto c = codec_for(gc);
  ASSERT_TRUE(c);
  if (c->stats_words() > 0) {
    ASSERT_TRUE(read_file(dir + "stats.u16", &stats));
    ASSERT_EQ(stats.size(), 2 * c->stats_words());
    std::vector<uint16_t> words(c->stats_words());
    std::memcpy(words.data(), stats.data(), stats.size());
    ASSERT_EQ(c->agree(words.data(), kCall), Status::kOk);
  } else {
    ASSERT_EQ(c->agree(nullptr, kCall), Status::kOk);
  }
  EXPECT_EQ(compare_bytes(as_bytes(decode_all(*c, leaf, 1)), dec_leaf), "identical")
      << gc.name << ": finish() of the committed leaves";
  EXPECT_EQ(compare_bytes(as_bytes(decode_all(*c, hop, 2)), dec_hop), "identical")
      << gc.name << ": finish() of the committed hops";
}

INSTANTIATE_TEST_SUITE_P(Codecs, Golden, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<GoldenCase>& p) {
                           return std::string(p.param.name);
                         });

// The fixed DynamiQ inputs really cover what the golden files claim to: every width 2 / 4 / 8 in
// both cases, and a width-16 super-group in the second.
TEST(GoldenInputs, DynamiqCasesCoverEveryWidth) {
  for (const GoldenCase& gc : kCases) {
    if (std::string(gc.spec).rfind("dynamiq", 0) != 0) continue;
    GoldenSet s;
    produce(gc, nullptr, &s);
    auto c = codec_for(gc);
    ASSERT_EQ(c->agree(s.stats.data(), kCall), Status::kOk);
    const DynamiqLayoutView v = dynamiq_layout(*c);
    ASSERT_NE(v.widths, nullptr);
    EXPECT_TRUE(v.budget_honest) << gc.name;
    int seen[17] = {};
    for (size_t j = 0; j < v.n_supergroups; ++j) ++seen[v.widths[j]];
    std::printf("%s widths: 16 x%d, 8 x%d, 4 x%d, 2 x%d\n", gc.name, seen[16], seen[8], seen[4],
                seen[2]);
    EXPECT_GT(seen[2], 0) << gc.name;
    EXPECT_GT(seen[4], 0) << gc.name;
    EXPECT_GT(seen[8], 0) << gc.name;
    if (gc.variant == 1) {
      EXPECT_GT(seen[16], 0) << gc.name;
    }
  }
}

// ---- vNMSE bands -------------------------------------------------------------------------------

const char* kBandSpecs[] = {"dynamiq:5", "mxfp8", "mxfp6",    "mxfp6e2m3",
                            "mxfp4",     "bf16",  "uniform:5"};
constexpr double kBand = 0.15;  // relative half-width of the band around the committed value
constexpr int kBandWorkers = 4;

uint32_t mix(uint32_t h) {  // murmur3's 32-bit finalizer
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// Approximately Gaussian (sum of four 24-bit uniforms, centred and scaled to unit variance),
// from integer hashing of (i, stream): no library distribution, so identical everywhere.
float hashed_normal(size_t i, uint32_t stream) {
  float sum = 0.0f;
  for (uint32_t k = 0; k < 4; ++k) {
    const uint32_t h = mix(static_cast<uint32_t>(i) * 4u + k + mix(stream * 0x9e3779b9u + 1u));
    sum += static_cast<float>(h >> 8) * 0x1p-24f;
  }
  return (sum - 2.0f) * 1.7320508f;
}

// Formula data for the band: worker w, element i of 131072 (512 super-groups). Super-group j
// has scale 2^(((11 j) mod 13) - 6) and its group g of 16 a further 2^-((3 g) mod 5), so group
// scales inside a super-group differ up to 16x; half the variance is shared by all workers
// (stream 99).
float band_value(int w, size_t i) {
  const size_t j = i / 256, g = (i % 256) / 16;
  const float a =
      std::ldexp(1.0f, static_cast<int>((11 * j) % 13) - 6 - static_cast<int>((3 * g) % 5));
  return a * (0.70710678f * hashed_normal(i, 99) +
              0.70710678f * hashed_normal(i, static_cast<uint32_t>(w)));
}
constexpr size_t kBandFormulaCount = 131072;

struct BandData {
  std::string name;
  std::vector<std::vector<float>> rows;
};

std::vector<BandData> band_data() {
  std::vector<BandData> out;
  sim::Matrix m;
  std::string err;
  EXPECT_EQ(sim::read_npy(DQ_SAMPLE_NPY, kBandWorkers, &m, &err), Status::kOk) << err;
  if (m.rows == static_cast<size_t>(kBandWorkers)) {
    BandData real{"real_step79", {}};
    for (int r = 0; r < kBandWorkers; ++r) real.rows.emplace_back(m.row(r), m.row(r) + m.cols);
    out.push_back(std::move(real));
  }
  BandData formula{"formula", {}};
  for (int w = 0; w < kBandWorkers; ++w) {
    std::vector<float> row(kBandFormulaCount);
    for (size_t i = 0; i < row.size(); ++i) row[i] = band_value(w, i);
    formula.rows.push_back(std::move(row));
  }
  out.push_back(std::move(formula));
  return out;
}

double ring_vnmse(const char* spec, const BandData& d) {
  std::string err;
  auto c = make_codec(spec, &err);
  EXPECT_TRUE(c) << err;
  if (!c) return -1;
  topo::Schedule s;
  EXPECT_EQ(topo::make_schedule(topo::Kind::kRing, kBandWorkers, &s), Status::kOk);
  std::vector<const float*> ptrs;
  for (const auto& r : d.rows) ptrs.push_back(r.data());
  sim::SimOptions opt;  // seed 1, call 0, SUM
  sim::SimResult res;
  EXPECT_EQ(sim::simulate_allreduce(*c, s, ptrs, d.rows[0].size(), opt, nullptr, &res), Status::kOk)
      << spec;
  return res.vnmse;
}

TEST(GoldenVnmse, WithinBandOfCommitted) {
  const std::string path = golden_path("vnmse.txt");
  const std::vector<BandData> data = band_data();
  ASSERT_EQ(data.size(), 2u) << "the real sample " << DQ_SAMPLE_NPY << " did not load";
  if (writing()) {
    std::ostringstream f;
    f << "# vNMSE through sim::simulate_allreduce, ring of " << kBandWorkers
      << " workers, seed 1, call 0, SUM (tests/kernels/golden_test.cc, GoldenVnmse).\n"
      << "# real_step79: tools/gradients/sample/step00079.npy; formula: band_value().\n"
      << "# Produced by: DQ_GOLDEN_WRITE=1 <build>/tests/kernels/test_golden "
         "--gtest_filter='GoldenVnmse.*'\n"
      << "# data spec vnmse\n";
    for (const BandData& d : data)
      for (const char* spec : kBandSpecs) {
        char line[128];
        std::snprintf(line, sizeof line, "%s %s %.6e\n", d.name.c_str(), spec, ring_vnmse(spec, d));
        f << line;
      }
    const std::string text = f.str();
    ASSERT_EQ(std::system(("mkdir -p '" + std::string(DQ_GOLDEN_DIR) + "'").c_str()), 0);
    write_file(path, text.data(), text.size());
    std::printf("wrote %s:\n%s", path.c_str(), text.c_str());
    return;
  }
  std::ifstream in(path);
  ASSERT_TRUE(in) << path << ": missing (DQ_GOLDEN_WRITE=1 makes it)";
  std::map<std::string, double> committed;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string name, spec;
    double v = 0;
    ASSERT_TRUE(ls >> name >> spec >> v) << "bad line in " << path << ": " << line;
    committed[name + " " + spec] = v;
  }
  for (const BandData& d : data)
    for (const char* spec : kBandSpecs) {
      const std::string key = d.name + " " + spec;
      ASSERT_TRUE(committed.count(key)) << key << " missing from " << path;
      const double want = committed[key], got = ring_vnmse(spec, d);
      std::printf("%-22s %.6e (committed %.6e, ratio %.4f)\n", key.c_str(), got, want, got / want);
      EXPECT_GE(got, want * (1.0 - kBand)) << key;
      EXPECT_LE(got, want * (1.0 + kBand)) << key;
    }
}

}  // namespace
}  // namespace dq
