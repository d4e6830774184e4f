// Command lines of dynamiq-run and dynamiq-perf.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "config/bytes.h"
#include "tools/perf/perf_options.h"
#include "tools/run/launch_options.h"

namespace dq {
namespace {

struct Argv {
  explicit Argv(std::vector<std::string> a) : args(std::move(a)) {
    for (auto& s : args) ptrs.push_back(s.c_str());
  }
  int argc() const { return static_cast<int>(ptrs.size()); }
  const char* const* argv() const { return ptrs.data(); }
  std::vector<std::string> args;
  std::vector<const char*> ptrs;
};

Status parse_run(std::vector<std::string> args, run::LaunchOptions* o, std::string* error) {
  Argv a(std::move(args));
  return run::parse_launch_options(a.argc(), a.argv(), o, error);
}

Status parse_perf(std::vector<std::string> args, perf::PerfOptions* o, std::string* error) {
  Argv a(std::move(args));
  return perf::parse_perf_options(a.argc(), a.argv(), o, error);
}

TEST(LaunchOptions, ParsesRanksFlagsAndCommand) {
  run::LaunchOptions o;
  std::string error;
  ASSERT_EQ(parse_run({"dynamiq-run", "-n", "4", "--cpu-nccl", "--timeout", "2.5", "--", "prog",
                       "-n", "7", "--timeout"},
                      &o, &error),
            Status::kOk)
      << error;
  EXPECT_EQ(o.num_ranks, 4);
  EXPECT_TRUE(o.cpu_nccl);
  EXPECT_DOUBLE_EQ(o.timeout_s, 2.5);
  // Everything after "--" belongs to the program, even when it looks like our options.
  EXPECT_EQ(o.command, (std::vector<std::string>{"prog", "-n", "7", "--timeout"}));
}

TEST(LaunchOptions, AcceptsAttachedAndEqualsForms) {
  run::LaunchOptions o;
  std::string error;
  ASSERT_EQ(parse_run({"dynamiq-run", "-n8", "--timeout=3", "--grace=0.5", "prog"}, &o, &error),
            Status::kOk)
      << error;
  EXPECT_EQ(o.num_ranks, 8);
  EXPECT_DOUBLE_EQ(o.timeout_s, 3);
  EXPECT_DOUBLE_EQ(o.grace_s, 0.5);
  EXPECT_FALSE(o.cpu_nccl);
  EXPECT_EQ(o.command, std::vector<std::string>{"prog"});
  ASSERT_EQ(parse_run({"dynamiq-run", "--nproc", "2", "--", "p"}, &o, &error), Status::kOk);
  EXPECT_EQ(o.num_ranks, 2);
}

TEST(LaunchOptions, RejectsBadUsageWithAReason) {
  const std::vector<std::vector<std::string>> bad = {
      {"dynamiq-run"},                                     // nothing
      {"dynamiq-run", "--", "prog"},                       // no -n
      {"dynamiq-run", "-n", "4"},                          // no program
      {"dynamiq-run", "-n", "4", "--"},                    // no program after --
      {"dynamiq-run", "-n", "0", "prog"},                  // zero ranks
      {"dynamiq-run", "-n", "1025", "prog"},               // too many
      {"dynamiq-run", "-n", "4x", "prog"},                 // not a number
      {"dynamiq-run", "-n"},                               // missing value
      {"dynamiq-run", "-n", "2", "--timeout", "-1", "p"},  // negative timeout
      {"dynamiq-run", "-n", "2", "--timeout", "abc", "p"},
      {"dynamiq-run", "-n", "2", "--bogus", "p"},
      {"dynamiq-run", "-n", "2", "--cpu-nccl=1", "p"},
  };
  for (const auto& args : bad) {
    run::LaunchOptions o;
    std::string error;
    EXPECT_EQ(parse_run(args, &o, &error), Status::kInvalidArgument) << args.size();
    EXPECT_FALSE(error.empty());
  }
}

// dynamiq's one size syntax (config/bytes.h): the settings and dynamiq-perf's -b/-e/-i accept
// and reject the same texts, with the same values.
TEST(Bytes, OneSyntaxForSettingsAndTools) {
  struct Case {
    const char* text;
    uint64_t bytes;
  } good[] = {{"0", 0},
              {"512", 512},
              {"512B", 512},
              {"64K", 64 << 10},
              {"64k", 64 << 10},
              {"64KB", 64 << 10},
              {"64KiB", 64 << 10},
              {"1M", 1 << 20},
              {"1MB", 1 << 20},
              {"1MiB", 1 << 20},
              {"1mib", 1 << 20},
              {"2G", 2ull << 30},
              {"2GiB", 2ull << 30},
              {"1T", 1ull << 40},
              {"1TiB", 1ull << 40},
              {"16777215T", 16777215ull << 40}};
  for (const Case& c : good) {
    uint64_t v = 1;
    EXPECT_TRUE(config::parse_bytes(c.text, &v)) << c.text;
    EXPECT_EQ(v, c.bytes) << c.text;
    size_t perf = 0;  // dynamiq-perf's -b/-e/-i
    EXPECT_TRUE(perf::parse_size(c.text, &perf)) << c.text;
    EXPECT_EQ(perf, c.bytes) << c.text;
  }
  for (const char* bad : {"", "-1", "+1", " 1", "1 ", "1.5M", "0x10", "1Q", "1MiBs", "1iB", "1Mi",
                          "1BB", "K", "MiB", "18446744073709551616", "16777216T"}) {
    uint64_t v = 0;
    EXPECT_FALSE(config::parse_bytes(bad, &v)) << bad;
    size_t perf = 0;
    EXPECT_FALSE(perf::parse_size(bad, &perf)) << bad;
  }
}

TEST(PerfOptions, ParsesSizesWithSuffixes) {
  size_t v = 0;
  ASSERT_TRUE(perf::parse_size("0", &v));
  EXPECT_EQ(v, 0u);
  ASSERT_TRUE(perf::parse_size("1000", &v));
  EXPECT_EQ(v, 1000u);
  ASSERT_TRUE(perf::parse_size("1K", &v));
  EXPECT_EQ(v, 1024u);
  ASSERT_TRUE(perf::parse_size("3k", &v));
  EXPECT_EQ(v, 3072u);
  ASSERT_TRUE(perf::parse_size("64M", &v));
  EXPECT_EQ(v, size_t{64} << 20);
  ASSERT_TRUE(perf::parse_size("2G", &v));
  EXPECT_EQ(v, size_t{2} << 30);
  // dynamiq's one size syntax (config/bytes.h): every unit a power of 1024, whatever its spelling.
  ASSERT_TRUE(perf::parse_size("1KB", &v));
  EXPECT_EQ(v, 1024u);
  ASSERT_TRUE(perf::parse_size("1MiB", &v));
  EXPECT_EQ(v, size_t{1} << 20);
  ASSERT_TRUE(perf::parse_size("1T", &v));
  EXPECT_EQ(v, size_t{1} << 40);
  for (const char* bad :
       {"", "K", "-1", "1.5M", "1Q", " 1", "1 ", "99999999999999999999", "17179869184G"})
    EXPECT_FALSE(perf::parse_size(bad, &v)) << bad;
}

TEST(PerfOptions, NcclTestsDefaults) {
  perf::PerfOptions o;
  std::string error;
  ASSERT_EQ(parse_perf({"dynamiq-perf"}, &o, &error), Status::kOk);
  EXPECT_EQ(o.min_bytes, size_t{32} << 20);
  EXPECT_EQ(o.max_bytes, size_t{32} << 20);
  EXPECT_EQ(o.iters, 20);
  EXPECT_EQ(o.warmup_iters, 5);
  EXPECT_EQ(o.check_iters, 1);
  EXPECT_EQ(o.dtypes, std::vector<perf::DType>{perf::DType::kFloat32});
  EXPECT_EQ(o.ops, std::vector<perf::RedOp>{perf::RedOp::kSum});
  EXPECT_FALSE(o.lossy);
}

TEST(PerfOptions, ParsesTheAcceptanceCommand) {
  perf::PerfOptions o;
  std::string error;
  ASSERT_EQ(parse_perf({"dynamiq-perf", "-b", "1K", "-e", "1M", "-f", "4", "-d", "all", "-o", "all",
                        "-c", "1", "-n5", "--warmup_iters=2", "--lossy", "--memory", "host"},
                       &o, &error),
            Status::kOk)
      << error;
  EXPECT_EQ(perf::sweep_sizes(o), (std::vector<size_t>{1024, 4096, 16384, 65536, 262144, 1048576}));
  EXPECT_EQ(o.dtypes.size(), 10u);
  EXPECT_EQ(o.ops.size(), 5u);
  EXPECT_EQ(o.iters, 5);
  EXPECT_EQ(o.warmup_iters, 2);
  EXPECT_TRUE(o.lossy);
  EXPECT_EQ(o.memory, perf::Memory::kHost);
}

TEST(PerfOptions, IncrementSweepAndSingleChoices) {
  perf::PerfOptions o;
  std::string error;
  ASSERT_EQ(parse_perf({"dynamiq-perf", "-b", "1K", "-e", "3500", "-i", "1K", "-d", "bfloat16",
                        "-o", "min"},
                       &o, &error),
            Status::kOk)
      << error;
  EXPECT_EQ(perf::sweep_sizes(o), (std::vector<size_t>{1024, 2048, 3072}));
  EXPECT_EQ(o.dtypes, std::vector<perf::DType>{perf::DType::kBfloat16});
  EXPECT_EQ(o.ops, std::vector<perf::RedOp>{perf::RedOp::kMin});
}

// -c: a number is nccl-tests' validation count, a name picks the collective; -r is
// ncclReduce's root, -1 for every root in turn.
TEST(PerfOptions, CollectiveAndRoot) {
  perf::PerfOptions o;
  std::string error;
  ASSERT_EQ(parse_perf({"dynamiq-perf"}, &o, &error), Status::kOk);
  EXPECT_EQ(o.collective, perf::Collective::kAllReduce);
  EXPECT_EQ(o.root, 0);
  ASSERT_EQ(parse_perf({"dynamiq-perf", "-c", "reducescatter", "-c", "3"}, &o, &error), Status::kOk)
      << error;
  EXPECT_EQ(o.collective, perf::Collective::kReduceScatter);
  EXPECT_EQ(o.check_iters, 3);
  ASSERT_EQ(parse_perf({"dynamiq-perf", "-creduce", "-r", "2"}, &o, &error), Status::kOk) << error;
  EXPECT_EQ(o.collective, perf::Collective::kReduce);
  EXPECT_EQ(o.check_iters, 1);
  EXPECT_EQ(o.root, 2);
  ASSERT_EQ(parse_perf({"dynamiq-perf", "--collective=reduce_scatter", "--root", "-1"}, &o, &error),
            Status::kOk)
      << error;
  EXPECT_EQ(o.collective, perf::Collective::kReduceScatter);
  EXPECT_EQ(o.root, -1);
  ASSERT_EQ(parse_perf({"dynamiq-perf", "--check", "allreduce", "-c", "0"}, &o, &error),
            Status::kOk);
  EXPECT_EQ(o.collective, perf::Collective::kAllReduce);
  EXPECT_EQ(o.check_iters, 0);
  for (const auto& args :
       std::vector<std::vector<std::string>>{{"dynamiq-perf", "-c", "allgather"},
                                             {"dynamiq-perf", "-c", "-1"},
                                             {"dynamiq-perf", "--collective", "3"},
                                             {"dynamiq-perf", "-r", "-2"},
                                             {"dynamiq-perf", "-r", "x"}}) {
    EXPECT_EQ(parse_perf(args, &o, &error), Status::kInvalidArgument) << args.back();
    EXPECT_NE(error.find(args.back()), std::string::npos) << error;
  }
  EXPECT_STREQ(perf::collective_name(perf::Collective::kReduceScatter), "reducescatter");
  EXPECT_STREQ(perf::nccl_tests_name(perf::Collective::kReduceScatter), "reduce_scatter");
}

TEST(PerfOptions, RejectsBadFlagsWithAReason) {
  const std::vector<std::vector<std::string>> bad = {
      {"dynamiq-perf", "-x"},
      {"dynamiq-perf", "--bogus"},
      {"dynamiq-perf", "-b"},
      {"dynamiq-perf", "-b", "2Q"},
      {"dynamiq-perf", "-b", "1M", "-e", "1K"},
      {"dynamiq-perf", "-f", "0"},
      {"dynamiq-perf", "-n", "0"},
      {"dynamiq-perf", "-d", "float8"},
      {"dynamiq-perf", "-o", "xor"},
      {"dynamiq-perf", "-g", "2"},
      {"dynamiq-perf", "-a", "4"},
      {"dynamiq-perf", "-G", "1"},
      {"dynamiq-perf", "--memory", "gpu"},
      {"dynamiq-perf", "--lossy=1"},
      {"dynamiq-perf", "-b", "0", "-e", "1K", "-f", "2"},
      {"dynamiq-perf", "-b", "0", "-e", "1G", "-i", "1"},  // 2^30 sizes
  };
  for (const auto& args : bad) {
    perf::PerfOptions o;
    std::string error;
    EXPECT_EQ(parse_perf(args, &o, &error), Status::kInvalidArgument) << args.back();
    EXPECT_FALSE(error.empty());
  }
}

}  // namespace
}  // namespace dq
