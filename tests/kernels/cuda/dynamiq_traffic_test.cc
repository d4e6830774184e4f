// The fused DynamiQ hop's global-memory traffic under the CUDA emulation (the accessors of
// kernels/cuda/cuda_compat.h count every byte a thread reads or writes): at a realistic size
// (2^20 values, 2 chunks) the hop must move at most 1.25x the least it has to: each input
// message's header and content, the rank's own values of the chunk's super-groups, and the whole
// outgoing message (capacity bytes, written once each). FP32 and BF16 own values; the first hop
// (a leaf, no input) and middle hops (one and two inputs). Each case is also checked against the
// host codec's bytes, so the counted kernel is a correct one. The finish of each chunk, and of
// both chunks in one launch, within 1.25x of its messages read twice and its values written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <initializer_list>
#include <random>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/cuda/dynamiq.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/stats_sum.h"
#include "tests/kernels/cuda/device_buffers.h"

namespace dq::cuda {
namespace {

constexpr double kMostOverMinimum = 1.25;

struct Traffic {
  uint64_t read = 0, written = 0;
};

// The least traffic of the hop of `chunk`: own values of the chunk's super-groups, n_in input
// messages (header and content), the outgoing message (capacity bytes).
Traffic least_traffic(const DynamiqLayoutT<const uint8_t>& l, const DynamiqPlan& p, int chunk,
                      int n_in, size_t value_bytes) {
  Traffic t;
  for (uint32_t i = l.chunk_first[chunk]; i < l.chunk_first[chunk + 1]; ++i) {
    const size_t base = static_cast<size_t>(l.order[i]) * kSuperGroup;
    const size_t valid = std::min<size_t>(kSuperGroup, p.count - base);
    if (!l.poisoned(l.order[i])) t.read += valid * value_bytes;
  }
  t.read += static_cast<uint64_t>(n_in) * (kChunkHeaderBytes + l.chunk_content[chunk]);
  t.written = p.capacity;
  return t;
}

// The finish of `chunk` from `message` (the sum of n_contrib workers) into an output of the
// values' type: it writes each of the chunk's values once and reads the message twice (its
// validators, then its decoders: kernels/cuda/step_fold.h, FinishGate), so its least is the
// output and the message once, and what it may read is bounded against the message twice and
// the output (kMostOverMinimum); the output matches the host's.
void check_finish_traffic(const Codec& codec, const DynamiqDeviceParams& params,
                          const LevelTable* levels, const void* layout,
                          const DynamiqLayoutT<const uint8_t>& l, int chunk,
                          const std::vector<uint8_t>& message, int n_contrib, bool bf16) {
  const DynamiqPlan& p = params.plan;
  const size_t value_bytes = bf16 ? 2 : 4;
  std::vector<uint8_t> host(p.count * value_bytes, 0x5A), dev(p.count * value_bytes, 0x5A);
  ASSERT_EQ(
      codec.decode_finish(layout, chunk, ByteView{message.data(), message.size()}, host.data(),
                          bf16 ? DType::kBF16 : DType::kF32, ReduceOp::kSum, n_contrib),
      Status::kOk);
  StepWord word{};
  ASSERT_EQ(launch_dynamiq_finish(params, levels, layout, chunk, message.data(), dev.data(), bf16,
                                  false, n_contrib, &word, nullptr),
            cudaSuccess)
      << test::kernel_fault();
  const emu::Counters c = emu::last_counters();
  EXPECT_EQ(word.flags, 0u);
  ASSERT_EQ(host, dev) << "finish of chunk " << chunk;
  const Traffic least = least_traffic(l, p, chunk, 0, value_bytes);  // the chunk's values
  const uint64_t msg = kChunkHeaderBytes + l.chunk_content[chunk];
  const double ratio =
      static_cast<double>(c.global_read + c.global_written) / static_cast<double>(msg + least.read);
  const double ratio_twice = static_cast<double>(c.global_read + c.global_written) /
                             static_cast<double>(2 * msg + least.read);
  std::printf(
      "%s finish chunk %d: read %llu (message %llu), written %llu (values %llu), %llu blocks: "
      "%.3fx the least traffic, %.3fx the message twice and the values\n",
      bf16 ? "bf16" : "fp32", chunk, static_cast<unsigned long long>(c.global_read),
      static_cast<unsigned long long>(msg), static_cast<unsigned long long>(c.global_written),
      static_cast<unsigned long long>(least.read), static_cast<unsigned long long>(c.blocks), ratio,
      ratio_twice);
  EXPECT_EQ(c.global_written, least.read) << "every value written exactly once";
  EXPECT_GE(c.global_read, 2 * msg);
  EXPECT_LE(ratio_twice, kMostOverMinimum) << (bf16 ? "bf16" : "fp32") << " chunk " << chunk;
}

// Block barriers a thread of each launch in `launches` (one that filled the device, one on a few
// blocks) printed, and each at most `bound`: barriers only in a kernel's set-up, whatever a block's
// share of the work.
void expect_setup_barriers(std::initializer_list<emu::Counters> launches, double bound) {
  for (const emu::Counters& b : launches) {
    const double per_thread = static_cast<double>(b.barriers) / static_cast<double>(b.threads);
    std::printf("  %llu blocks: %.2f block barriers a thread\n",
                static_cast<unsigned long long>(b.blocks), per_thread);
    EXPECT_LE(per_thread, bound) << "blocks " << b.blocks;
  }
}

// The finish's block barriers a thread, a decoder's (a validator has fewer): the range's extent,
// the ticket (two), the level tables (three), the validators' verdict (two) and the tickets'
// reset.
constexpr double kFinishSetupBarriers = 9.0;

// The finish of every chunk in one launch (launch_dynamiq_finishes(), messages `stride` bytes
// apart in `packed`): the same bound against every message twice and every value, every value
// written once, the output the host's finish of each chunk in turn; block barriers only in the
// set-up, on a grid that fills the device and on 8 blocks.
void check_range_finish_traffic(const Codec& codec, const DynamiqDeviceParams& params,
                                const LevelTable* levels, const void* layout,
                                const DynamiqLayoutT<const uint8_t>& l,
                                const std::vector<uint8_t>& packed, size_t stride, int n_contrib,
                                bool bf16) {
  const DynamiqPlan& p = params.plan;
  const size_t value_bytes = bf16 ? 2 : 4;
  std::vector<uint8_t> host(p.count * value_bytes, 0x5A), dev(p.count * value_bytes, 0x5A);
  uint64_t msgs = 0, values = 0;
  for (int chunk = 0; chunk < p.n_chunks; ++chunk) {
    ASSERT_EQ(codec.decode_finish(layout, chunk, ByteView{packed.data() + chunk * stride, stride},
                                  host.data(), bf16 ? DType::kBF16 : DType::kF32, ReduceOp::kSum,
                                  n_contrib),
              Status::kOk);
    msgs += kChunkHeaderBytes + l.chunk_content[chunk];
    values += least_traffic(l, p, chunk, 0, value_bytes).read;
  }
  StepWord word{};
  const uint64_t launches = emu::launches();
  ASSERT_EQ(launch_dynamiq_finishes(params, levels, layout, 0, p.n_chunks, packed.data(), stride,
                                    dev.data(), bf16, false, n_contrib, &word, nullptr),
            cudaSuccess)
      << test::kernel_fault();
  const emu::Counters c = emu::last_counters();
  EXPECT_EQ(emu::launches() - launches, 1u);
  EXPECT_EQ(word.flags, 0u);
  ASSERT_EQ(host, dev) << "finish of every chunk";
  const double ratio_twice = static_cast<double>(c.global_read + c.global_written) /
                             static_cast<double>(2 * msgs + values);
  std::printf(
      "%s finish of chunks 0..%d in one launch: read %llu (messages %llu), written %llu, %llu "
      "blocks: %.3fx the messages twice and the values\n",
      bf16 ? "bf16" : "fp32", p.n_chunks - 1, static_cast<unsigned long long>(c.global_read),
      static_cast<unsigned long long>(msgs), static_cast<unsigned long long>(c.global_written),
      static_cast<unsigned long long>(c.blocks), ratio_twice);
  EXPECT_EQ(c.global_written, values) << "every value written exactly once";
  EXPECT_GE(c.global_read, 2 * msgs);
  EXPECT_LE(ratio_twice, kMostOverMinimum) << (bf16 ? "bf16" : "fp32");
  std::vector<uint8_t> few_blocks(p.count * value_bytes, 0x5A);
  ASSERT_EQ(launch_dynamiq_finishes(params, levels, layout, 0, p.n_chunks, packed.data(), stride,
                                    few_blocks.data(), bf16, false, n_contrib, &word, nullptr, 4),
            cudaSuccess)
      << test::kernel_fault();
  EXPECT_EQ(word.flags, 0u);
  ASSERT_EQ(host, few_blocks) << "finish of every chunk on 8 blocks";
  expect_setup_barriers({c, emu::last_counters()}, kFinishSetupBarriers);
}

// Values of a gradient-like spread (super-group scales over 2^-12..2^12), so every width occurs.
std::vector<float> gradient(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(count);
  for (size_t base = 0; base < count; base += kSuperGroup) {
    const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 24) - 12);
    for (size_t i = base; i < std::min(count, base + kSuperGroup); ++i) x[i] = normal(rng) * scale;
  }
  return x;
}

// The fused hop's block barriers a thread: one for the chunk's extent, three for the level tables.
constexpr double kHopSetupBarriers = 4.0;

void check_traffic(bool bf16) {
  const size_t count = (size_t{1} << 20) + 77;
  const int n_chunks = 2, n_workers = 4;
  const DynamiqOptions opt;
  const std::unique_ptr<Codec> codec = make_dynamiq_codec(opt);
  ASSERT_EQ(codec->plan(count, n_chunks, n_workers), Status::kOk);
  const DynamiqDeviceParams params =
      dynamiq_device_params(count, n_chunks, n_workers, codec->chunk_capacity(), opt);
  LevelTable levels[3];
  dynamiq_level_tables(opt, levels);
  std::vector<std::vector<float>> f32(n_workers);
  std::vector<std::vector<uint16_t>> b16(n_workers);
  StatsSum sum(codec->stats_words(), codec->stats_byte_sum_words());
  for (int r = 0; r < n_workers; ++r) {
    f32[r] = gradient(count, 41 + r);
    b16[r].resize(count);
    for (size_t i = 0; i < count; ++i) b16[r][i] = f32_to_bf16_rne(f32[r][i]);
    std::vector<uint16_t> local(codec->stats_words());
    const ConstTensor t{bf16 ? static_cast<const void*>(b16[r].data()) : f32[r].data(),
                        bf16 ? DType::kBF16 : DType::kF32, count};
    ASSERT_EQ(codec->local_stats(t, local.data()), Status::kOk);
    sum.add(local.data());
  }
  std::vector<uint16_t> reduced(codec->stats_words());
  sum.result(reduced.data(), true);
  std::vector<uint64_t> layout(codec->layout_bytes() / 8);
  ASSERT_EQ(codec->build_layout(reduced.data(), 99, layout.data()), Status::kOk);
  const DynamiqLayoutT<const uint8_t> l(reinterpret_cast<const uint8_t*>(layout.data()),
                                        params.sections);
  const size_t cap = codec->chunk_capacity();
  std::vector<uint8_t> finals(cap * n_chunks);  // every chunk's 3-worker message, for the finish
  auto own = [&](int r) {
    return ConstTensor{bf16 ? static_cast<const void*>(b16[r].data()) : f32[r].data(),
                       bf16 ? DType::kBF16 : DType::kF32, count};
  };
  for (int chunk = 0; chunk < n_chunks; ++chunk) {
    // Leaves of workers 1 and 2: the middle hops' inputs.
    std::vector<std::vector<uint8_t>> leaves(2, std::vector<uint8_t>(cap));
    std::vector<ByteView> views;
    std::vector<const uint8_t*> ptrs;
    for (int r = 1; r <= 2; ++r) {
      const RoundingKey key{7, 99, static_cast<uint32_t>(r), 0, 1, 0, 0};
      ASSERT_EQ(
          codec->fused_hop(layout.data(), chunk, own(r), nullptr, 0, leaves[r - 1].data(), key),
          Status::kOk);
      views.push_back(ByteView{leaves[r - 1].data(), cap});
      ptrs.push_back(leaves[r - 1].data());
    }
    for (int n_in : {0, 1, 2}) {
      const RoundingKey key{7, 99, 0, 0, 1, 0, 0};
      std::vector<uint8_t> host(cap, 0xAB), dev(cap, 0xCD);
      ASSERT_EQ(
          codec->fused_hop(layout.data(), chunk, own(0), views.data(), n_in, host.data(), key),
          Status::kOk);
      unsigned error = 0;
      ASSERT_EQ(launch_dynamiq_hop(params, levels, layout.data(), chunk, own(0).data, bf16,
                                   ptrs.data(), n_in, dev.data(), key, &error, nullptr),
                cudaSuccess)
          << test::kernel_fault();
      const emu::Counters c = emu::last_counters();
      EXPECT_EQ(c.blocks, dynamiq_hop_grid(params)) << "the grid the benchmarks report";
      EXPECT_EQ(error, 0u);
      ASSERT_EQ(host, dev) << "chunk " << chunk << " n_in " << n_in;
      const Traffic least = least_traffic(l, params.plan, chunk, n_in, bf16 ? 2 : 4);
      const double ratio = static_cast<double>(c.global_read + c.global_written) /
                           static_cast<double>(least.read + least.written);
      std::printf(
          "%s chunk %d n_in %d: read %llu (least %llu), written %llu (least %llu), "
          "%llu blocks: %.3fx the least traffic\n",
          bf16 ? "bf16" : "fp32", chunk, n_in, static_cast<unsigned long long>(c.global_read),
          static_cast<unsigned long long>(least.read),
          static_cast<unsigned long long>(c.global_written),
          static_cast<unsigned long long>(least.written), static_cast<unsigned long long>(c.blocks),
          ratio);
      EXPECT_EQ(c.global_written, least.written) << "every message byte written exactly once";
      EXPECT_GE(c.global_read, least.read);
      EXPECT_LE(ratio, kMostOverMinimum)
          << (bf16 ? "bf16" : "fp32") << " chunk " << chunk << " n_in " << n_in;
      // Block barriers only in the set-up (the extent, the level tables), whatever a block's
      // share: 8 blocks of a few hundred super-groups each wait at as many as 1,000 blocks do.
      // The launch above filled the device; the same hop again on 8 blocks.
      std::vector<uint8_t> few_blocks(cap, 0xCD);
      ASSERT_EQ(launch_dynamiq_hop(params, levels, layout.data(), chunk, own(0).data, bf16,
                                   ptrs.data(), n_in, few_blocks.data(), key, &error, nullptr, 8),
                cudaSuccess)
          << test::kernel_fault();
      ASSERT_EQ(host, few_blocks) << "chunk " << chunk << " n_in " << n_in << " on 8 blocks";
      EXPECT_EQ(emu::last_counters().blocks, dynamiq_hop_grid(params, 8));
      expect_setup_barriers({c, emu::last_counters()}, kHopSetupBarriers);
      if (n_in == 2) {
        check_finish_traffic(*codec, params, levels, layout.data(), l, chunk, host, 3, bf16);
        std::copy(host.begin(), host.end(), finals.begin() + chunk * cap);
      }
    }
  }
  check_range_finish_traffic(*codec, params, levels, layout.data(), l, finals, cap, 3, bf16);
}

// The hop's grid rule (dynamiq_hop_grid()): 16 super-groups a block; more blocks where that
// leaves an SM fewer than 4 (kHopMinBlocks), but never fewer than one super-group a warp (8 a
// block); max_blocks caps it. The traffic bound above holds for the blocks this rule picks.
TEST(CudaDynamiqTraffic, TheHopGridFollowsItsRule) {
  const DynamiqOptions opt;
  int before = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&before, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  struct Row {
    size_t supergroups_a_chunk;
    int multiprocessors, max_blocks;
    unsigned blocks;
  };
  for (const Row& row : {
           Row{32768, 132, 0, 2048},   // 16 a block fill the device
           Row{2048, 132, 0, 256},     // an 8-rank step of a 16 MiB block: 8 a block (1 a warp)
           Row{8192, 132, 0, 528},     // 16 a block would be 512 < 4 x 132: 4 an SM
           Row{40, 132, 0, 5},         // a warp a super-group at most
           Row{2048, 8, 0, 128},       // a small device: 16 a block
           Row{32768, 132, 300, 300},  // the caller's cap
           Row{100000, 132, 0, 4096},  // the launch's cap
       }) {
    const int n_chunks = 4;
    const DynamiqDeviceParams params = dynamiq_device_params(
        row.supergroups_a_chunk * n_chunks * kSuperGroup, n_chunks, 2, size_t{1} << 30, opt);
    emu::set_multiprocessors(row.multiprocessors);
    EXPECT_EQ(dynamiq_hop_grid(params, row.max_blocks), row.blocks)
        << row.supergroups_a_chunk << " super-groups a chunk, " << row.multiprocessors
        << " SMs, max_blocks " << row.max_blocks;
  }
  emu::set_multiprocessors(before);
}

TEST(CudaDynamiqTraffic, Fp32HopWithinAQuarterOfTheLeast) {
  check_traffic(false);
}
TEST(CudaDynamiqTraffic, Bf16HopWithinAQuarterOfTheLeast) {
  check_traffic(true);
}

}  // namespace
}  // namespace dq::cuda
