// kernels/cuda/budget.cu under the CUDA emulation against the host's run_budget_job()
// (kernels/budget_model.h), bit for bit: calls of one to several parts, partial last
// super-groups, zero, tiny and huge energies, every target kind, DynamiQ and MX calls, fixed and
// auto budgets, candidates that do not fit; a non-finite statistic; a preset error word.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/budget_model.h"
#include "kernels/codec.h"
#include "kernels/cuda/budget.h"
#include "kernels/dynamiq_codec.h"
#include "tests/kernels/cuda/layout_stats.h"
#include "topo/schedule.h"

namespace dq::cuda {
namespace {

uint64_t bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}

// Reduced statistics of `n_sg` super-groups as the all-reduce leaves them: summed means, summed
// sums of squares and all-zero counts (BF16), super-group scales spread over `decades` orders of
// magnitude, some super-groups all zero, counts anywhere in 1 .. n_workers and now and then out
// of range (a bad peer word).
void append_stats(size_t n_sg, int n_workers, double decades, std::mt19937* rng,
                  std::vector<uint16_t>* out) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<unsigned> counts(n_sg);
  for (size_t j = 0; j < n_sg; ++j) {
    const double scale = std::pow(10.0, decades * normal(*rng) / 2.0);
    const bool zero = (*rng)() % 16 == 0;
    const double mean = zero ? 0.0 : 0.1 * scale * normal(*rng);
    const double energy =
        zero ? 0.0 : 256.0 * n_workers * scale * scale * (1.0 + 0.1 * normal(*rng));
    out->push_back(f32_to_bf16_rne(static_cast<float>(mean)));
    out->push_back(f32_to_bf16_rne(static_cast<float>(std::fabs(energy))));
    counts[j] = zero ? 0u : 1u + (*rng)() % static_cast<unsigned>(n_workers);
  }
  test::append_count_words(counts, n_workers, rng, out);
}

DynamiqPlan plan_of(const char* spec, size_t count, int chunks, int n_workers) {
  std::string err;
  std::unique_ptr<Codec> c = make_codec(spec, &err);
  EXPECT_TRUE(c) << err;
  EXPECT_EQ(c->plan(count, chunks, n_workers), Status::kOk);
  DynamiqOptions o;
  DynamiqPlan p;
  EXPECT_TRUE(dynamiq_parameters(*c, &o, &p));
  return p;
}

struct Call {
  std::vector<BudgetPartJob> parts;
  std::vector<uint16_t> stats;
  HopTables hop;
  BudgetJob job;
};

// A call of `counts.size()` parts of these element counts, planned for `chunks` chunks each.
Call make_call(const std::vector<size_t>& counts, int n_workers, int chunks, double decades,
               uint32_t seed) {
  std::mt19937 rng(seed);
  Call call;
  for (size_t count : counts) {
    BudgetPartJob part;
    part.count = count;
    part.stats_offset = call.stats.size();
    for (int r = 0; r < kLadderRungs; ++r) {
      char spec[32];
      std::snprintf(spec, sizeof spec, "dynamiq:%g", ladder_bits(r));
      part.rungs[r] = plan_of(spec, count, chunks, n_workers);
    }
    for (int c = 0; c < kCandidates; ++c) part.fits[c] = rng() % 8 != 0 ? 1 : 0;
    part.used = part.rungs[rng() % kLadderRungs];
    append_stats((count + 255) / 256, n_workers, decades, &rng, &call.stats);
    call.parts.push_back(part);
  }
  call.job.n_parts = static_cast<uint32_t>(call.parts.size());
  call.job.n_workers = n_workers;
  topo::Schedule sched;
  EXPECT_EQ(
      topo::make_schedule(seed % 2 ? topo::Kind::kRing : topo::Kind::kButterfly, n_workers, &sched),
      Status::kOk);
  call.hop = hop_profile(sched);
  call.job.hop = call.hop.view();
  call.job.parts = call.parts.data();
  return call;
}

void expect_same(const BudgetResult& host, const BudgetResult& dev, const std::string& what) {
  ASSERT_EQ(host.state, dev.state) << what;
  EXPECT_EQ(bits(host.used_vnmse), bits(dev.used_vnmse))
      << what << ": " << host.used_vnmse << " vs " << dev.used_vnmse;
  for (int w = 0; w < 4; ++w) EXPECT_EQ(host.used_widths.n[w], dev.used_widths.n[w]) << what;
  const BudgetPrediction& h = host.prediction;
  const BudgetPrediction& d = dev.prediction;
  EXPECT_EQ(h.rung, d.rung) << what;
  EXPECT_EQ(bits(h.target), bits(d.target)) << what;
  for (int c = 0; c < kCandidates; ++c) {
    EXPECT_EQ(bits(h.vnmse[c]), bits(d.vnmse[c])) << what << " candidate " << c;
    for (int w = 0; w < 4; ++w) EXPECT_EQ(h.widths[c].n[w], d.widths[c].n[w]) << what;
  }
}

BudgetResult on_device(const Call& call, const unsigned* error = nullptr) {
  // Garbage: must be cleared.
  std::vector<unsigned char> scratch(budget_scratch_bytes(call.job), 0xA5);
  BudgetResult out;
  out.state = 77;  // a sentinel no run writes
  const uint64_t before = emu::launches();
  EXPECT_EQ(launch_budget(&call.job, call.stats.data(), scratch.data(), scratch.size(), &out, error,
                          nullptr),
            cudaSuccess);
  // A constant per call, whatever its parts.
  EXPECT_EQ(emu::launches() - before, kBudgetLaunches);
  return out;
}

TEST(CudaBudget, MatchesHostBitForBit) {
  uint32_t seed = 1;
  const std::vector<std::vector<size_t>> shapes = {
      {256}, {1}, {300}, {65536}, {100000}, {40000, 40000, 12345}, {4096, 1, 70000, 257}};
  const BudgetTarget targets[] = {{BudgetTarget::Kind::kMxfp8, 0},
                                  {BudgetTarget::Kind::kMxfp6, 0},
                                  {BudgetTarget::Kind::kVnmse, 3e-3}};
  int predicted = 0, mx_chosen = 0, dynamiq_chosen = 0;
  for (const auto& shape : shapes)
    for (int n_workers : {2, 16})
      for (double decades : {0.0, 1.5, 6.0})
        for (int t = 0; t < 3; ++t) {
          Call call =
              make_call(shape, n_workers, shape.size() > 1 ? 1 : n_workers, decades, seed++);
          call.job.auto_budget = t != 2 || decades > 1.0;  // some fixed-budget calls
          call.job.target = targets[t];
          call.job.used_mx = seed % 5 == 0 ? kRoundingErrorMxfp8 : 0.0;
          BudgetResult host;
          run_budget_job(call.job, call.stats.data(), &host);
          const BudgetResult dev = on_device(call);
          const std::string what = "parts " + std::to_string(shape.size()) + " n " +
                                   std::to_string(n_workers) + " decades " +
                                   std::to_string(decades) + " target " + std::to_string(t);
          expect_same(host, dev, what);
          ASSERT_EQ(host.state, kBudgetPredicted) << what;
          ++predicted;
          if (call.job.auto_budget) {
            candidate_is_mx(host.prediction.rung) ? ++mx_chosen : ++dynamiq_chosen;
            // The host's two entry points agree: the engine's job and the tools' summaries.
            std::vector<StatsSummary> summaries(shape.size());
            std::vector<const StatsSummary*> parts;
            std::vector<std::vector<DynamiqPlan>> plans;
            std::vector<std::vector<bool>> fits;
            for (size_t i = 0; i < shape.size(); ++i) {
              const BudgetPartJob& p = call.parts[i];
              ASSERT_TRUE(summaries[i].load(call.stats.data() + p.stats_offset, p.count, n_workers,
                                            call.job.hop));
              parts.push_back(&summaries[i]);
              plans.emplace_back(p.rungs, p.rungs + kLadderRungs);
              fits.emplace_back(p.fits, p.fits + kCandidates);
            }
            BudgetPrediction direct;
            predict_budget(parts, plans, fits, call.job.target, &direct);
            EXPECT_EQ(direct.rung, host.prediction.rung) << what;
            EXPECT_EQ(bits(direct.vnmse[direct.rung]), bits(host.prediction.vnmse[direct.rung]));
          }
        }
  // The matrix reaches both kinds of choice, so a kernel that always took one would fail.
  EXPECT_GT(mx_chosen, 0);
  EXPECT_GT(dynamiq_chosen, 0);
  EXPECT_GT(predicted, 100);
}

TEST(CudaBudget, NonFiniteStatisticGivesNoPrediction) {
  Call call = make_call({4096, 4096}, 4, 1, 1.0, 99);
  call.job.auto_budget = 1;
  const size_t nan_at = call.parts[1].stats_offset + stat_word(7, kStatMean);
  // A non-finite mean alone is a sum of finite means that overflowed (the codec then subtracts
  // none): still predicted. A non-finite input makes the energy non-finite too.
  call.stats[nan_at] = 0x7fc0;
  BudgetResult host;
  run_budget_job(call.job, call.stats.data(), &host);
  EXPECT_EQ(host.state, kBudgetPredicted);
  EXPECT_EQ(on_device(call).state, kBudgetPredicted);
  call.stats[nan_at + (kStatEnergy - kStatMean)] = 0x7fc0;  // a NaN input in the second part
  run_budget_job(call.job, call.stats.data(), &host);
  EXPECT_EQ(host.state, kBudgetNoPrediction);
  EXPECT_EQ(on_device(call).state, kBudgetNoPrediction);
  call.stats[nan_at] = 0x3f80;
  call.stats[nan_at + (kStatEnergy - kStatMean)] = 0x3f80;
  call.stats[stat_word(3, kStatEnergy)] = 0x7f80;  // an infinite energy in the first part
  EXPECT_EQ(on_device(call).state, kBudgetNoPrediction);
}

// Every part of a call in the same launches: a reduce-scatter's parts (one a rank and pipeline
// block: 16 ranks x 3 blocks, the last block shorter), each its own keys and terms, added in part
// order; bits as the host's. Keys shared between two parts, or the terms added in the order the
// blocks finish, would differ.
TEST(CudaBudget, ManyPartsInConstantLaunches) {
  EXPECT_EQ(kBudgetLaunches, 7u);
  std::vector<size_t> counts;
  for (int block = 0; block < 3; ++block)
    for (int rank = 0; rank < 16; ++rank) counts.push_back(block < 2 ? 9000 : 4097);
  for (double decades : {1.5, 6.0}) {
    Call call = make_call(counts, 16, 1, decades, decades > 2 ? 31 : 32);
    call.job.auto_budget = 1;
    ASSERT_EQ(call.job.n_parts, 48u);
    BudgetResult host;
    run_budget_job(call.job, call.stats.data(), &host);
    ASSERT_EQ(host.state, kBudgetPredicted);
    expect_same(host, on_device(call), "48 parts, decades " + std::to_string(decades));
  }
}

// Many more parts than the 64 a dense table each once allowed at once: 16 ranks x 9 blocks = 144
// parts, then 520 small ones, each in the same 7 launches (on_device counts them), every part's
// keys and terms kept apart to the end; bits as the host's.
TEST(CudaBudget, HundredsOfPartsMatchHost) {
  std::vector<size_t> counts;
  for (int block = 0; block < 9; ++block)
    for (int rank = 0; rank < 16; ++rank) counts.push_back(block < 8 ? 1500 : 333);
  Call call = make_call(counts, 16, 1, 3.0, 41);
  call.job.auto_budget = 1;
  ASSERT_EQ(call.job.n_parts, 144u);
  BudgetResult host;
  run_budget_job(call.job, call.stats.data(), &host);
  ASSERT_EQ(host.state, kBudgetPredicted);
  expect_same(host, on_device(call), "144 parts");
  // A poisoned super-group in one of the last parts: no prediction, as on the host.
  call.stats[call.parts[140].stats_offset + stat_word(1, kStatEnergy)] = 0x7fc0;  // of 2
  run_budget_job(call.job, call.stats.data(), &host);
  EXPECT_EQ(host.state, kBudgetNoPrediction);
  EXPECT_EQ(on_device(call).state, kBudgetNoPrediction);
  Call small = make_call(std::vector<size_t>(520, 700), 8, 1, 4.0, 43);
  small.job.auto_budget = 1;
  run_budget_job(small.job, small.stats.data(), &host);
  ASSERT_EQ(host.state, kBudgetPredicted);
  expect_same(host, on_device(small), "520 parts");
}

// A part with more distinct keys than a directory group or a run holds, and more super-groups
// than there are keys (its entries capped at kEnergyKeys): energies spread over many decades, so
// the ranks cross every group of 128 keys and several runs of 1,024 entries; bits as the host's.
TEST(CudaBudget, ThousandsOfDistinctKeysMatchHost) {
  const size_t count = 256 * (static_cast<size_t>(kEnergyKeys) + 1000);
  EXPECT_EQ(budget_key_entries(count), kEnergyKeys);
  EXPECT_EQ(budget_key_entries(256 * 100 + 1), 101u);
  Call call = make_call({count, 4096}, 4, 4, 1.0, 47);
  call.job.auto_budget = 1;
  // The first part's energies: BF16 patterns of uniformly random exponents over 200 binades and
  // random mantissas (each binade has 128 keys).
  std::mt19937 rng(48);
  for (size_t j = 0; j < (count + 255) / 256; ++j)
    call.stats[stat_word(j, kStatEnergy)] =
        static_cast<uint16_t>((27 + rng() % 200) << 7 | rng() % 128);
  BudgetResult host;
  run_budget_job(call.job, call.stats.data(), &host);
  ASSERT_EQ(host.state, kBudgetPredicted);
  // The matrix is worth its time only if the part has thousands of keys.
  size_t distinct = 0;
  StatsSummary summary;
  ASSERT_TRUE(summary.load(call.stats.data(), count, 4, call.job.hop));
  const BudgetSums sums = summary.sums();
  for (uint32_t k = 0; k < kEnergyKeys; ++k)
    if (sums.count[k] != sums.count[k + 1]) ++distinct;
  EXPECT_GT(distinct, 10000u);
  expect_same(host, on_device(call), "a part of many keys");
}

// The scratch is sized from the parts on the host; a smaller one is refused before any launch.
TEST(CudaBudget, ScratchTooSmallIsRefused) {
  Call call = make_call({4096, 4096, 300}, 4, 1, 1.0, 7);
  const size_t need = budget_scratch_bytes(call.job);
  std::vector<unsigned char> scratch(need - 8, 0);
  BudgetResult out;
  out.state = 77;
  const uint64_t before = emu::launches();
  EXPECT_EQ(launch_budget(&call.job, call.stats.data(), scratch.data(), scratch.size(), &out,
                          nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(emu::launches(), before);
  EXPECT_EQ(out.state, 77u);
  // A part costs its state, terms and directory, and an entry a super-group (16 + 16 + 2 here).
  EXPECT_EQ(need, budget_scratch_bytes(3, 34));
  EXPECT_EQ(budget_scratch_bytes(3, 34) - budget_scratch_bytes(2, 34), kBudgetPartBytes);
  EXPECT_EQ(budget_scratch_bytes(3, 35) - budget_scratch_bytes(3, 34), kBudgetEntryBytes);
}

// The bytes of global memory a prediction moves (the emulator's count, kernels/cuda/EMULATION.md,
// over the seven launches), per the design in kernels/cuda/budget.cu: per super-group its 3
// statistics words in 3 passes (18 B), and at most one key entry (24 B) zeroed, added to (3
// atomics, counted as a read and a write each), totalled and cumulated (a read, a read and a
// write): below 170 B; per block of 256 super-groups the directory ranked (4 KB), a rank per key
// flushed (up to 4 words) and one atomic OR per directory word set, and the hop tables staged (16
// B a worker, 3 kernels): below 64 B a super-group at 256 a block; per part its directory zeroed
// and ranked again (8 KB), its state (1 KB), its runs and its 14 candidate threads' bisections
// (31 steps of 3 lookups, each up to 4 directory words and an entry: 52 KB): below 128 KB. A dense
// table of every key per part (0.75 MiB zeroed, then totalled and cumulated) or a pass over the
// directory per super-group would break these bounds.
constexpr uint64_t kBytesPerSupergroup = 256;
constexpr uint64_t kBytesPerPart = 128 * 1024;
constexpr uint64_t kBytesPerCall = 64 * 1024;

uint64_t call_bytes(const Call& call) {
  const uint64_t before = emu::global_bytes_so_far();
  EXPECT_EQ(on_device(call).state, kBudgetPredicted);
  return emu::global_bytes_so_far() - before;
}

uint64_t supergroups(const Call& call) {
  uint64_t n = 0;
  for (const BudgetPartJob& p : call.parts) n += (p.count + 255) / 256;
  return n;
}

TEST(CudaBudget, TrafficGrowsWithSupergroupsNotKeys) {
  struct Shape {
    std::vector<size_t> counts;
    int n_workers;
  };
  const Shape shapes[] = {{{4096 * 256}, 8},
                          {{4 * 4096 * 256}, 8},
                          {std::vector<size_t>(64, 64 * 256), 8},
                          {std::vector<size_t>(200, 300), 16}};
  uint64_t bytes_of[4] = {};
  for (int i = 0; i < 4; ++i) {
    Call call = make_call(shapes[i].counts, shapes[i].n_workers, 1, 3.0, 60 + i);
    call.job.auto_budget = 1;
    const uint64_t bytes = call_bytes(call), s = supergroups(call), parts = call.parts.size();
    bytes_of[i] = bytes;
    std::fprintf(stderr,
                 "budget traffic: %llu parts, %llu super-groups: %llu bytes (%.1f B a "
                 "super-group, %.1f KB a part)\n",
                 static_cast<unsigned long long>(parts), static_cast<unsigned long long>(s),
                 static_cast<unsigned long long>(bytes), static_cast<double>(bytes) / s,
                 static_cast<double>(bytes) / parts / 1024);
    EXPECT_LE(bytes, kBytesPerSupergroup * s + kBytesPerPart * parts + kBytesPerCall)
        << parts << " parts, " << s << " super-groups";
  }
  // Linear in the super-groups: four times the part, at most four times the bytes (the part's
  // constant is paid once).
  EXPECT_LE(bytes_of[1], 4 * bytes_of[0]);
  EXPECT_GE(bytes_of[1], 3 * bytes_of[0]);
}

TEST(CudaBudget, PresetErrorWordWritesNothing) {
  Call call = make_call({70000}, 4, 4, 1.0, 5);
  call.job.auto_budget = 1;
  const unsigned failed = 2, clear = 0;
  EXPECT_EQ(on_device(call, &failed).state, 77u);
  EXPECT_EQ(on_device(call, &clear).state, kBudgetPredicted);
}

}  // namespace
}  // namespace dq::cuda
