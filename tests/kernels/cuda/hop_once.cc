// One fused DynamiQ hop under the CUDA emulation, its bytes checked against the host codec's.
// tools/perf/hop_instructions.sh builds this file with gcov's instrumentation: the emulated
// kernel's line counts weight the hop's SASS (tools/perf/sass_estimate.py).
//
//   hop_once [--log2-count N] [--bits B] [--bf16] [--inputs K] [--strata S] [--fixed-widths]
//
// Values: independent N(0, 1) per worker; one chunk, 8 workers; the inputs are other workers'
// leaves. Prints the super-groups the hop encoded (the estimator's units) and the blocks it ran
// on; exits 1 when the kernel fails or its bytes differ from the host codec's.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/cuda/dynamiq.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/stats_sum.h"

namespace {

struct Options {
  int log2_count = 20;
  double bits = 5.0;
  bool bf16 = false;
  int inputs = 1;
  uint32_t strata = 4;
  bool fixed_widths = false;
};

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--bf16") {
      o->bf16 = true;
    } else if (a == "--fixed-widths") {
      o->fixed_widths = true;
    } else if (a == "--log2-count" && has_value) {
      o->log2_count = std::atoi(argv[++i]);
    } else if (a == "--bits" && has_value) {
      o->bits = std::atof(argv[++i]);
    } else if (a == "--inputs" && has_value) {
      o->inputs = std::atoi(argv[++i]);
    } else if (a == "--strata" && has_value) {
      o->strata = static_cast<uint32_t>(std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "hop_once: unknown or incomplete option %s\n", a.c_str());
      return false;
    }
  }
  if (o->log2_count < 8 || o->log2_count > 26 || o->inputs < 0 ||
      o->inputs > dq::cuda::kMaxHopInputs || o->strata < 1 || o->bits <= 0.0) {
    std::fprintf(stderr,
                 "hop_once: --log2-count 8..26, --inputs 0..%d, --strata >= 1, --bits > 0\n",
                 dq::cuda::kMaxHopInputs);
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dq;
  Options o;
  if (!parse(argc, argv, &o)) return 2;
  const size_t count = size_t{1} << o.log2_count;
  const int n_workers = 8;
  DynamiqOptions opt;
  opt.budget_bits = o.bits;
  opt.variable_widths = !o.fixed_widths;
  const std::unique_ptr<Codec> codec = make_dynamiq_codec(opt);
  if (codec->plan(count, 1, n_workers) != Status::kOk) {
    std::fprintf(stderr, "hop_once: %.3g bits a value does not fit %zu values\n", o.bits, count);
    return 2;
  }
  const cuda::DynamiqDeviceParams params =
      cuda::dynamiq_device_params(count, 1, n_workers, codec->chunk_capacity(), opt);
  LevelTable levels[3];
  cuda::dynamiq_level_tables(opt, levels);
  const int rows = 1 + o.inputs;
  std::vector<std::vector<float>> f32(rows);
  std::vector<std::vector<uint16_t>> b16(rows);
  StatsSum sum(codec->stats_words(), codec->stats_byte_sum_words());
  auto tensor = [&](int r) {
    return ConstTensor{o.bf16 ? static_cast<const void*>(b16[r].data()) : f32[r].data(),
                       o.bf16 ? DType::kBF16 : DType::kF32, count};
  };
  for (int r = 0; r < rows; ++r) {
    std::mt19937 rng(41 + r);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    f32[r].resize(count);
    b16[r].resize(count);
    for (size_t i = 0; i < count; ++i) {
      f32[r][i] = normal(rng);
      b16[r][i] = f32_to_bf16_rne(f32[r][i]);
    }
    std::vector<uint16_t> local(codec->stats_words());
    if (codec->local_stats(tensor(r), local.data()) != Status::kOk) return 1;
    sum.add(local.data());
  }
  std::vector<uint16_t> reduced(codec->stats_words());
  sum.result(reduced.data(), true);
  std::vector<uint64_t> layout(codec->layout_bytes() / 8);
  if (codec->build_layout(reduced.data(), 99, layout.data()) != Status::kOk) return 1;
  const size_t cap = codec->chunk_capacity();
  std::vector<std::vector<uint8_t>> leaves(o.inputs, std::vector<uint8_t>(cap));
  std::vector<ByteView> views;
  std::vector<const uint8_t*> ptrs;
  for (int r = 1; r <= o.inputs; ++r) {
    const RoundingKey leaf{7, 99, static_cast<uint32_t>(r), 0, 1, 0, 0};
    if (codec->fused_hop(layout.data(), 0, tensor(r), nullptr, 0, leaves[r - 1].data(), leaf) !=
        Status::kOk)
      return 1;
    views.push_back(ByteView{leaves[r - 1].data(), cap});
    ptrs.push_back(leaves[r - 1].data());
  }
  // This rank's hop: stratum 1 of o.strata (correlated rounding when o.strata > 1), class 2.
  const RoundingKey key{7, 99, 0, o.strata > 1 ? 1u : 0u, o.strata, 2, 0};
  std::vector<uint8_t> host(cap), dev(cap);
  if (codec->fused_hop(layout.data(), 0, tensor(0), views.data(), o.inputs, host.data(), key) !=
      Status::kOk)
    return 1;
  unsigned error = 0;
  if (cuda::launch_dynamiq_hop(params, levels, layout.data(), 0, tensor(0).data, o.bf16,
                               ptrs.data(), o.inputs, dev.data(), key, &error,
                               nullptr) != cudaSuccess ||
      error != 0) {
    std::fprintf(stderr, "hop_once: the kernel failed (error word %u)\n", error);
    return 1;
  }
  if (host != dev) {
    std::fprintf(stderr, "hop_once: the kernel's bytes differ from the host codec's\n");
    return 1;
  }
  // The level tables the blocks stage, by the kernel's own split of the positions and choice of
  // tables (kernels/cuda/dynamiq.h) over the launch's grid.
  const uint64_t blocks = emu::last_counters().blocks;
  const DynamiqLayoutView view = dynamiq_layout(*codec, layout.data());
  const uint64_t first = view.chunk_first[0], last = view.chunk_first[1];
  const uint64_t per = cuda::hop_block_positions(last - first, blocks);
  uint64_t tables = 0, working = 0;
  for (uint64_t b = 0; b < blocks; ++b) {
    const uint64_t begin = first + b * per, end = std::min(begin + per, last);
    if (begin >= end) continue;
    tables += static_cast<uint64_t>(__builtin_popcount(
        cuda::hop_level_tables(view.widths[view.order[begin]], view.widths[view.order[end - 1]])));
    ++working;
  }
  std::printf(
      "hop_once: %zu %s values, %zu super-groups, %d inputs, strata %u, %s widths at %.3g "
      "bits, %llu blocks of %d threads (level tables staged: %.3f a working block): the host "
      "codec's bytes\n",
      count, o.bf16 ? "BF16" : "FP32", count / kSuperGroup, o.inputs, o.strata,
      o.fixed_widths ? "fixed" : "variable", o.bits, static_cast<unsigned long long>(blocks),
      cuda::kHopThreads,
      working > 0 ? static_cast<double>(tables) / static_cast<double>(working) : 0.0);
  return 0;
}
