// dq::sim::simulate_reduce_scatter: the reduce-scatter as the engine runs it, one codec
// per chunk over the rank block the chunk ends at.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "tests/tools/sim_test_data.h"
#include "tools/sim/simulate.h"
#include "topo/schedule.h"

namespace dq::sim {
namespace {

using test_data::Data;
using test_data::schedule;
using test_data::synthetic;

TEST(SimReduceScatter, NeedsOneChunkEndingAtEveryWorker) {
  const Data d = synthetic(3, 3 * 20000);
  SimResult r;
  // The butterfly of 3 workers has 2 chunks: the engine runs such a reduce-scatter on the ring.
  EXPECT_EQ(simulate_reduce_scatter("dynamiq:5", schedule(topo::Kind::kButterfly, 3), d.rows, 20000,
                                    SimOptions{}, nullptr, &r),
            Status::kInvalidArgument);
  EXPECT_EQ(simulate_reduce_scatter("dynamiq:5", schedule(topo::Kind::kRing, 3), d.rows, 20000,
                                    SimOptions{}, nullptr, &r),
            Status::kOk);
  EXPECT_EQ(simulate_reduce_scatter("nonsense", schedule(topo::Kind::kRing, 3), d.rows, 20000,
                                    SimOptions{}, nullptr, &r),
            Status::kInvalidArgument);
  EXPECT_EQ(simulate_reduce_scatter("dynamiq:5", schedule(topo::Kind::kRing, 3), d.rows, 0,
                                    SimOptions{}, nullptr, &r),
            Status::kInvalidArgument);
}

// Same data, same schedule: the reduce-scatter is the all-reduce's reduce phase with the chunks
// cut along rank blocks, so its error is of the same size; each block's error is its own.
// Synthetic data with locality (spread 1) has its scales per 256-value super-group of the whole
// row; a rank block that starts off a multiple of 256 cuts its super-groups across two of those,
// and costs up to 2.5x the all-reduce's error there (measured, tools/sim/README.md). So the
// odd size runs on data without locality (spread 0), the aligned one on data with it.
TEST(SimReduceScatter, ErrorComparableToTheAllReduce) {
  for (topo::Kind kind : {topo::Kind::kRing, topo::Kind::kButterfly})
    for (int n : {2, 4, 8})
      for (const size_t recv : {size_t{65536}, size_t{65536 + 777}}) {
        const Data d = synthetic(n, recv * n, recv % 256 == 0 ? 1.0 : 0.0);
        const topo::Schedule s = schedule(kind, n);
        SimOptions opt;
        opt.seed = 24301;
        SimResult rs, ar;
        std::vector<float> out;
        ASSERT_EQ(simulate_reduce_scatter("dynamiq:5", s, d.rows, recv, opt, &out, &rs),
                  Status::kOk);
        std::string error;
        auto codec = make_codec("dynamiq:5", &error);
        ASSERT_EQ(simulate_allreduce(*codec, s, d.rows, recv * n, opt, nullptr, &ar), Status::kOk);
        ASSERT_EQ(rs.block_vnmse.size(), static_cast<size_t>(n));
        EXPECT_TRUE(ar.block_vnmse.empty());
        EXPECT_GE(rs.vnmse, 0.5 * ar.vnmse) << topo::kind_name(kind) << " n=" << n;
        EXPECT_LE(rs.vnmse, 2.0 * ar.vnmse) << topo::kind_name(kind) << " n=" << n;
        double num = 0, den = 0;
        for (int r = 0; r < n; ++r) {
          EXPECT_GT(rs.block_vnmse[r], 0.0);
          EXPECT_LT(rs.block_vnmse[r], 0.05) << "block " << r;
          // The overall figure is the energy-weighted mean of the blocks'.
          double e = 0;
          for (size_t k = r * recv; k < (r + 1) * recv; ++k) {
            double x = 0;
            for (int w = 0; w < n; ++w) x += d.rows[w][k];
            e += x * x;
          }
          num += rs.block_vnmse[r] * e;
          den += e;
        }
        EXPECT_NEAR(rs.vnmse, num / den, 1e-9 * rs.vnmse);
        EXPECT_EQ(out.size(), recv * n);
        EXPECT_TRUE(rs.budget_honest && rs.chunks_large_enough);
      }
}

// One compressed copy within 5 bits per coordinate, statistics included; each worker sends n-1
// chunk messages and its ring share of the statistics.
TEST(SimReduceScatter, BitsWithinTheBudget) {
  for (int n : {2, 3, 4, 8}) {
    const size_t recv = 50001;
    const Data d = synthetic(n, recv * n);
    SimResult r;
    ASSERT_EQ(simulate_reduce_scatter("dynamiq:5", schedule(topo::Kind::kRing, n), d.rows, recv,
                                      SimOptions{}, nullptr, &r),
              Status::kOk);
    EXPECT_LE(r.bits_per_coord, 5.0);
    EXPECT_GT(r.bits_per_coord, 4.9);
    std::string error;
    auto codec = make_codec("dynamiq:5", &error);
    ASSERT_EQ(codec->plan(recv, 1, n), Status::kOk);
    const double cap = static_cast<double>(codec->chunk_capacity());
    const double words = static_cast<double>(codec->stats_words());
    EXPECT_LE(cap + 2 * words, std::floor(5.0 * recv / 8));
    const double per_worker = (n - 1) * cap + 2.0 * (n - 1) * 2.0 * words;
    EXPECT_NEAR(r.wire_bits_per_coord, per_worker * 8 / (static_cast<double>(n) * recv), 1e-12);
  }
}

TEST(SimReduceScatter, DeterministicAndKeyedByCallAndSeed) {
  const int n = 4;
  const size_t recv = 40000;
  const Data d = synthetic(n, recv * n);
  const topo::Schedule s = schedule(topo::Kind::kButterfly, n);
  SimOptions opt;
  opt.seed = 24301;
  SimResult r;
  std::vector<float> a, b, c, e;
  ASSERT_EQ(simulate_reduce_scatter("dynamiq:5", s, d.rows, recv, opt, &a, &r), Status::kOk);
  ASSERT_EQ(simulate_reduce_scatter("dynamiq:5", s, d.rows, recv, opt, &b, &r), Status::kOk);
  EXPECT_EQ(a, b);
  opt.call = 1;
  ASSERT_EQ(simulate_reduce_scatter("dynamiq:5", s, d.rows, recv, opt, &c, &r), Status::kOk);
  EXPECT_NE(a, c);
  opt.call = 0;
  opt.seed = 1;
  ASSERT_EQ(simulate_reduce_scatter("dynamiq:5", s, d.rows, recv, opt, &e, &r), Status::kOk);
  EXPECT_NE(a, e);
}

TEST(SimReduceScatter, AverageIsTheSumOverN) {
  const int n = 3;
  const size_t recv = 30000;
  const Data d = synthetic(n, recv * n);
  const topo::Schedule s = schedule(topo::Kind::kRing, n);
  SimOptions opt;
  SimResult rs, ra;
  std::vector<float> sum, avg;
  ASSERT_EQ(simulate_reduce_scatter("dynamiq:5", s, d.rows, recv, opt, &sum, &rs), Status::kOk);
  opt.op = ReduceOp::kAvg;
  ASSERT_EQ(simulate_reduce_scatter("dynamiq:5", s, d.rows, recv, opt, &avg, &ra), Status::kOk);
  for (size_t k = 0; k < sum.size(); ++k)
    ASSERT_NEAR(avg[k] * n, sum[k], 1e-5 * std::fabs(sum[k]) + 1e-30) << k;
  EXPECT_NEAR(ra.vnmse, rs.vnmse, 1e-3 * rs.vnmse);
}

// Pipeline blocks as the engine cuts them: each its own codec, the last taking the remainder.
TEST(SimReduceScatter, PipelineBlocks) {
  EXPECT_EQ(reduce_scatter_block_elems(16u << 20, 4, 4), 1u << 20);
  EXPECT_EQ(reduce_scatter_block_elems(256u << 10, 2, 8), 16384u);
  EXPECT_EQ(reduce_scatter_block_elems(1000, 4, 8), 16384u);  // one chunk's floor: 64 super-groups
  EXPECT_EQ(reduce_scatter_block_elems(3u << 20, 4, 3), 262144u);
  const int n = 4;
  const size_t recv = 4 * 16384 + 1000;
  const Data d = synthetic(n, recv * n);
  const topo::Schedule s = schedule(topo::Kind::kRing, n);
  SimOptions opt;
  SimResult one, four;
  std::vector<float> a, b;
  ASSERT_EQ(simulate_reduce_scatter("dynamiq:5", s, d.rows, recv, opt, &a, &one), Status::kOk);
  opt.block_elems = 16384;
  ASSERT_EQ(simulate_reduce_scatter("dynamiq:5", s, d.rows, recv, opt, &b, &four), Status::kOk);
  EXPECT_NE(a, b);
  EXPECT_GE(four.vnmse, 0.5 * one.vnmse);
  EXPECT_LE(four.vnmse, 2.0 * one.vnmse);
  EXPECT_LE(four.bits_per_coord, 5.0);
  EXPECT_TRUE(four.chunks_large_enough);
  // Blocks below 64 super-groups per chunk message are flagged, as the engine passes them through.
  opt.block_elems = 8192;
  ASSERT_EQ(simulate_reduce_scatter("dynamiq:5", s, d.rows, recv, opt, &b, &four), Status::kOk);
  EXPECT_FALSE(four.chunks_large_enough);
}

}  // namespace
}  // namespace dq::sim
