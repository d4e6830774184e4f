// dynamiq-run's options for ranks in network namespaces: --rank-netns, --rank-env, --master-addr.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tools/run/launch_options.h"

namespace dq::run {
namespace {

Status parse(std::vector<std::string> args, LaunchOptions* o, std::string* error) {
  std::vector<const char*> argv;
  for (const auto& s : args) argv.push_back(s.c_str());
  return parse_launch_options(static_cast<int>(argv.size()), argv.data(), o, error);
}

TEST(LaunchNetnsOptions, DefaultsKeepEveryRankOnLoopbackHere) {
  LaunchOptions o;
  std::string error;
  ASSERT_EQ(parse({"dynamiq-run", "-n", "2", "prog"}, &o, &error), Status::kOk) << error;
  EXPECT_EQ(o.master_addr, "127.0.0.1");
  EXPECT_TRUE(o.rank_netns.empty());
  EXPECT_TRUE(o.rank_env.empty());
}

TEST(LaunchNetnsOptions, ParsesAllThreeInBothForms) {
  LaunchOptions o;
  std::string error;
  ASSERT_EQ(parse({"dynamiq-run", "-n", "4", "--rank-netns", "bench-{rank}",
                   "--master-addr=198.18.0.1", "--rank-env", "DYNAMIQ_NET_IFNAME==dqr{rank}",
                   "--rank-env=A_1=x", "--", "prog", "--rank-env", "B=1"},
                  &o, &error),
            Status::kOk)
      << error;
  EXPECT_EQ(o.rank_netns, "bench-{rank}");
  EXPECT_EQ(o.master_addr, "198.18.0.1");
  // The value keeps everything after the first '=' (NCCL_SOCKET_IFNAME's '=' exact-match form).
  EXPECT_EQ(o.rank_env, (std::vector<std::string>{"DYNAMIQ_NET_IFNAME==dqr{rank}", "A_1=x"}));
  // Options after PROGRAM belong to PROGRAM.
  EXPECT_EQ(o.command, (std::vector<std::string>{"prog", "--rank-env", "B=1"}));
}

TEST(LaunchNetnsOptions, ExpandsEveryRankToken) {
  EXPECT_EQ(expand_rank("ns-{rank}", 3), "ns-3");
  EXPECT_EQ(expand_rank("{rank}{rank}-{rank}", 12), "1212-12");
  EXPECT_EQ(expand_rank("no token", 5), "no token");
  EXPECT_EQ(expand_rank("{rank", 5), "{rank");
  EXPECT_EQ(expand_rank("", 5), "");
}

TEST(LaunchNetnsOptions, NamesAreIpNetnsNamesAndPathsStayPaths) {
  EXPECT_EQ(rank_netns_path("dq-bench-{rank}", 2), "/run/netns/dq-bench-2");
  EXPECT_EQ(rank_netns_path("/proc/{rank}/ns/net", 77), "/proc/77/ns/net");
  EXPECT_EQ(rank_netns_path("./rel/ns{rank}", 0), "./rel/ns0");
}

TEST(LaunchNetnsOptions, RejectsBadValuesWithAReason) {
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"dynamiq-run", "-n", "2", "--rank-env", "NOEQUALS", "p"}, "NAME=VALUE"},
      {{"dynamiq-run", "-n", "2", "--rank-env", "=x", "p"}, "NAME=VALUE"},
      {{"dynamiq-run", "-n", "2", "--rank-env", "1A=x", "p"}, "NAME=VALUE"},
      {{"dynamiq-run", "-n", "2", "--rank-env", "A-B=x", "p"}, "NAME=VALUE"},
      {{"dynamiq-run", "-n", "2", "--rank-env", "RANK=3", "p"}, "launcher sets it"},
      {{"dynamiq-run", "-n", "2", "--rank-env", "DYNAMIQ_RUN_DIR=/x", "p"}, "launcher sets it"},
      {{"dynamiq-run", "-n", "2", "--rank-env", "MASTER_ADDR=1.2.3.4", "p"}, "--master-addr"},
      {{"dynamiq-run", "-n", "2", "--rank-netns", "", "p"}, "--rank-netns"},
      {{"dynamiq-run", "-n", "2", "--rank-netns"}, "--rank-netns"},
      {{"dynamiq-run", "-n", "2", "--master-addr", "", "p"}, "--master-addr"},
      {{"dynamiq-run", "-n", "2", "--master-addr", "a b", "p"}, "--master-addr"},
      {{"dynamiq-run", "-n", "2", "--rank-env"}, "--rank-env"},
  };
  for (const auto& c : cases) {
    LaunchOptions o;
    std::string error;
    EXPECT_EQ(parse(c.args, &o, &error), Status::kInvalidArgument) << c.args[3];
    EXPECT_NE(error.find(c.says), std::string::npos)
        << "args " << c.args[3] << " '" << (c.args.size() > 4 ? c.args[4] : "") << "': " << error;
  }
}

TEST(LaunchNetnsOptions, UsageDocumentsTheNewOptions) {
  const std::string usage = launch_usage();
  for (const char* word : {"--rank-netns", "--rank-env", "--master-addr", "{rank}"})
    EXPECT_NE(usage.find(word), std::string::npos) << word;
}

}  // namespace
}  // namespace dq::run
