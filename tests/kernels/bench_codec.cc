// Host codec throughput on one core, in bytes of FP32 input per second, with memcpy of the same
// bytes measured in the same run as the ceiling, for each host codec path (kernels/host_isa.h:
// names end in /scalar or /avx2; the AVX2 ones are skipped on a CPU without it).
// Run: build/tests/kernels/bench_codec
#include <benchmark/benchmark.h>
#include <tbb/global_control.h>

#include <cstring>
#include <memory>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "kernels/host_isa.h"
#include "tools/sim/gradients.h"

namespace {

constexpr size_t kCount = size_t{1} << 24;       // 64 MiB of FP32: beyond the caches
constexpr size_t kSmallCount = size_t{1} << 16;  // 256 KiB: in cache, the arithmetic alone
constexpr int kWorkers = 4;

struct Fixture {
  dq::sim::Matrix data;
  std::unique_ptr<dq::Codec> codec;
  std::vector<uint8_t> leaf, hop;
  std::vector<uint16_t> reduced_stats;  // kWorkers times one worker's (agree()'s input)
  std::vector<float> out;
  size_t count;
  Fixture(const char* spec, size_t n, dq::HostIsa isa) : count(n) {
    dq::sim::SyntheticSpec syn;
    syn.rows = 2;
    syn.cols = count;
    syn.spread = 1.0;
    dq::sim::make_synthetic(syn, &data);
    std::string err;
    {
      const dq::ThreadHostIsa on_path(isa);
      codec = dq::make_codec(spec, &err);
    }
    if (!codec || codec->plan(count, 1, kWorkers) != dq::Status::kOk) std::abort();
    std::vector<uint16_t>& stats = reduced_stats;
    stats.resize(codec->stats_words());
    if (!stats.empty()) {
      codec->local_stats(tensor(0), stats.data());
      for (auto& w : stats) w = dq::f32_to_bf16_rne(dq::bf16_to_f32(w) * kWorkers);
    }
    if (codec->agree(stats.empty() ? nullptr : stats.data(), 0) != dq::Status::kOk) std::abort();
    leaf.resize(codec->chunk_capacity());
    hop.resize(codec->chunk_capacity());
    out.resize(count);
    if (codec->hop(0, tensor(0), nullptr, 0, leaf.data(), key(0)) != dq::Status::kOk) std::abort();
  }
  dq::ConstTensor tensor(int r) const { return {data.row(r), dq::DType::kF32, count}; }
  // A ring hop: plain rounding (each ring hop is its own stratum class).
  static dq::RoundingKey key(uint32_t rank) { return {1, 0, rank, 0, 1, rank}; }
  // A butterfly of 4's leaf or an 8's middle hop: correlated rounding over 2 strata (the default
  // topology at 4 and 8 ranks, topo::rounding_strata()).
  static dq::RoundingKey correlated_key(uint32_t rank) { return {1, 0, rank, rank % 2, 2, 0}; }
};

Fixture& fixture(const char* spec, dq::HostIsa isa, size_t count = kCount) {
  static std::vector<std::pair<std::string, std::unique_ptr<Fixture>>> cache;
  const std::string name =
      std::string(spec) + "@" + std::to_string(count) + "@" + dq::host_isa_name(isa);
  for (auto& [s, f] : cache)
    if (s == name) return *f;
  cache.emplace_back(name, std::make_unique<Fixture>(spec, count, isa));
  return *cache.back().second;
}

// False (the benchmark skipped) where this CPU cannot run the path.
bool runnable(benchmark::State& state, dq::HostIsa isa) {
  if (dq::host_isa_supported(isa)) return true;
  state.SkipWithError("this CPU lacks the instruction set");
  return false;
}

void BM_memcpy(benchmark::State& state) {
  std::vector<float> a(kCount, 1.0f), b(kCount);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), kCount * 4);
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kCount * 4);
}

// A leaf (no input); `correlated`: the rounding over 2 strata (Fixture::correlated_key).
void compress(benchmark::State& state, const char* spec, dq::HostIsa isa, bool correlated) {
  if (!runnable(state, isa)) return;
  Fixture& f = fixture(spec, isa);
  const dq::RoundingKey key = correlated ? Fixture::correlated_key(0) : Fixture::key(0);
  for (auto _ : state)
    if (f.codec->hop(0, f.tensor(0), nullptr, 0, f.hop.data(), key) != dq::Status::kOk)
      state.SkipWithError("hop failed");
  state.SetBytesProcessed(state.iterations() * kCount * 4);
}

void BM_compress(benchmark::State& state, const char* spec, dq::HostIsa isa) {
  compress(state, spec, isa, false);
}

void BM_compress_correlated(benchmark::State& state, const char* spec, dq::HostIsa isa) {
  compress(state, spec, isa, true);
}

// One input; `correlated`: the rounding over 2 strata (Fixture::correlated_key) instead of plain.
void fused_hop(benchmark::State& state, const char* spec, dq::HostIsa isa, bool correlated) {
  if (!runnable(state, isa)) return;
  Fixture& f = fixture(spec, isa);
  dq::ByteView in{f.leaf.data(), f.leaf.size()};
  const dq::RoundingKey key = correlated ? Fixture::correlated_key(1) : Fixture::key(1);
  for (auto _ : state)
    if (f.codec->hop(0, f.tensor(1), &in, 1, f.hop.data(), key) != dq::Status::kOk)
      state.SkipWithError("hop failed");
  state.SetBytesProcessed(state.iterations() * kCount * 4);
}

void BM_fused_hop(benchmark::State& state, const char* spec, dq::HostIsa isa) {
  fused_hop(state, spec, isa, false);
}

void BM_fused_hop_correlated(benchmark::State& state, const char* spec, dq::HostIsa isa) {
  fused_hop(state, spec, isa, true);
}

// The fused hop on 64 Ki values that stay in cache: the arithmetic without the memory stalls
// (which vary with what else the machine runs), per width when the spec fixes it.
void BM_fused_hop_in_cache(benchmark::State& state, const char* spec, dq::HostIsa isa) {
  if (!runnable(state, isa)) return;
  Fixture& f = fixture(spec, isa, kSmallCount);
  dq::ByteView in{f.leaf.data(), f.leaf.size()};
  for (auto _ : state)
    if (f.codec->hop(0, f.tensor(1), &in, 1, f.hop.data(), Fixture::key(1)) != dq::Status::kOk)
      state.SkipWithError("hop failed");
  state.SetBytesProcessed(state.iterations() * kSmallCount * 4);
}

// The super-group statistics of the whole tensor (every rank's first step of a call).
void BM_local_stats(benchmark::State& state, const char* spec, dq::HostIsa isa) {
  if (!runnable(state, isa)) return;
  Fixture& f = fixture(spec, isa);
  std::vector<uint16_t> stats(f.codec->stats_words());
  for (auto _ : state) {
    if (f.codec->local_stats(f.tensor(1), stats.data()) != dq::Status::kOk)
      state.SkipWithError("statistics failed");
    benchmark::DoNotOptimize(stats.data());
  }
  state.SetBytesProcessed(state.iterations() * kCount * 4);
}

// The layout from the reduced statistics (widths, wire order, chunk cuts): every rank, every call.
void BM_layout(benchmark::State& state, const char* spec, dq::HostIsa isa) {
  if (!runnable(state, isa)) return;
  Fixture& f = fixture(spec, isa);
  for (auto _ : state)
    if (f.codec->agree(f.reduced_stats.data(), 0) != dq::Status::kOk)
      state.SkipWithError("layout failed");
  state.SetBytesProcessed(state.iterations() * kCount * 4);
}

void BM_decompress(benchmark::State& state, const char* spec, dq::HostIsa isa) {
  if (!runnable(state, isa)) return;
  Fixture& f = fixture(spec, isa);
  for (auto _ : state)
    if (f.codec->finish(0, dq::ByteView{f.leaf.data(), f.leaf.size()}, f.out.data(),
                        dq::DType::kF32, dq::ReduceOp::kSum, 1) != dq::Status::kOk)
      state.SkipWithError("finish failed");
  state.SetBytesProcessed(state.iterations() * kCount * 4);
}

}  // namespace

constexpr dq::HostIsa kScalar = dq::HostIsa::kScalar, kAvx2 = dq::HostIsa::kAvx2,
                      kAvx512 = dq::HostIsa::kAvx512;

// Each codec benchmark once per host path: DQ_BENCH_PATHS(function, label, spec, unit) registers
// label/scalar, label/avx2 and label/avx512 (real time; the _CPU form: CPU time).
#define DQ_BENCH_PATHS(fn, label, spec, unit)                                                 \
  BENCHMARK_CAPTURE(fn, label / scalar, spec, kScalar)->Unit(benchmark::unit)->UseRealTime(); \
  BENCHMARK_CAPTURE(fn, label / avx2, spec, kAvx2)->Unit(benchmark::unit)->UseRealTime();     \
  BENCHMARK_CAPTURE(fn, label / avx512, spec, kAvx512)->Unit(benchmark::unit)->UseRealTime()
#define DQ_BENCH_PATHS_CPU(fn, label, spec, unit)                              \
  BENCHMARK_CAPTURE(fn, label / scalar, spec, kScalar)->Unit(benchmark::unit); \
  BENCHMARK_CAPTURE(fn, label / avx2, spec, kAvx2)->Unit(benchmark::unit);     \
  BENCHMARK_CAPTURE(fn, label / avx512, spec, kAvx512)->Unit(benchmark::unit)

BENCHMARK(BM_memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();
DQ_BENCH_PATHS(BM_compress, dynamiq5, "dynamiq:5", kMillisecond);
DQ_BENCH_PATHS(BM_fused_hop, dynamiq5, "dynamiq:5", kMillisecond);
DQ_BENCH_PATHS(BM_decompress, dynamiq5, "dynamiq:5", kMillisecond);
DQ_BENCH_PATHS(BM_local_stats, dynamiq5, "dynamiq:5", kMillisecond);
DQ_BENCH_PATHS(BM_layout, dynamiq5, "dynamiq:5", kMillisecond);
DQ_BENCH_PATHS(BM_compress_correlated, dynamiq5, "dynamiq:5", kMillisecond);
DQ_BENCH_PATHS(BM_fused_hop_correlated, dynamiq5, "dynamiq:5", kMillisecond);
DQ_BENCH_PATHS(BM_fused_hop, mxfp8, "mxfp8", kMillisecond);
// The same rates over the thread's CPU time (TBB runs on the calling thread here): on a shared
// machine, time-slicing inflates real time but not the work one core does per byte.
BENCHMARK(BM_memcpy)->Name("BM_memcpy_cputime")->Unit(benchmark::kMillisecond);
DQ_BENCH_PATHS_CPU(BM_fused_hop, dynamiq5_cputime, "dynamiq:5", kMillisecond);
DQ_BENCH_PATHS_CPU(BM_fused_hop_in_cache, dynamiq5, "dynamiq:5", kMicrosecond);
DQ_BENCH_PATHS_CPU(BM_fused_hop_in_cache, width2, "dynamiq:3:widths=fixed", kMicrosecond);
DQ_BENCH_PATHS_CPU(BM_fused_hop_in_cache, width4, "dynamiq:5:widths=fixed", kMicrosecond);
DQ_BENCH_PATHS_CPU(BM_fused_hop_in_cache, width8, "dynamiq:9.5:widths=fixed", kMicrosecond);
DQ_BENCH_PATHS_CPU(BM_fused_hop_in_cache, width16, "dynamiq:17:widths=fixed", kMicrosecond);
// The baselines take the same paths (kernels/baselines/baselines_hot.h).
DQ_BENCH_PATHS_CPU(BM_fused_hop, mxfp8_cputime, "mxfp8", kMillisecond);
DQ_BENCH_PATHS_CPU(BM_fused_hop_in_cache, mxfp8, "mxfp8", kMicrosecond);
DQ_BENCH_PATHS_CPU(BM_fused_hop_in_cache, mxfp4, "mxfp4", kMicrosecond);
DQ_BENCH_PATHS_CPU(BM_fused_hop_in_cache, bf16, "bf16", kMicrosecond);
DQ_BENCH_PATHS_CPU(BM_fused_hop_in_cache, uniform5, "uniform:5", kMicrosecond);

int main(int argc, char** argv) {
  // One core: the figure is per-core throughput.
  tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
