// The settings table as a whole (config/settings.def: every variable, one loader, one size syntax,
// the struct's defaults) and the NCCL-style log (common/log.h). Log behaviour depends on a
// process's first use, so those tests run this binary again as a child (--child NAME) with a
// given environment and read what it wrote.
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "common/fnv1a.h"
#include "common/log.h"
#include "config/bytes.h"
#include "config/settings.h"
#include "plugin/net_abi.h"
#include "tests/common/text_file.h"

namespace dq {
namespace {

using Map = std::map<std::string, std::string>;
using test::read_file;
const char* g_plugin_path = nullptr;  // argv[1]: libnccl-net-dynamiq.so

const char* lookup(const char* key, void* ctx) {
  auto* m = static_cast<Map*>(ctx);
  auto it = m->find(key);
  return it == m->end() ? nullptr : it->second.c_str();
}

// Every variable of `env` is also named as set, as the environment's scan names them.
Status load(Map env, config::Settings* s, std::string* error,
            std::vector<config::Problem>* problems = nullptr) {
  std::vector<std::string> names;
  for (const auto& [key, value] : env) names.push_back(key);
  return config::load(lookup, &env, s, error, problems, &names);
}

// ---- one size syntax ------------------------------------------------------------------------

// The size syntax itself (config::parse_bytes against dynamiq-perf's parse_size, case by case)
// is tested in tests/tools/options_test.cc, which links the tools; here, the settings use it.
// The published FNV-1a test vectors: the host hash (ENGINE.md, "FNV-1a 64 of NCCL_HOSTID") and
// the settings' agreement hashes are what anyone recomputing them from the docs gets.
TEST(Fnv1a, PublishedVectors) {
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171f73967e8ull);
  EXPECT_EQ(fnv1a32("a"), 0xe40c292cu);
  EXPECT_EQ(fnv1a32("foobar"), 0xbf9cf968u);
  EXPECT_EQ(fnv1a64("bar", 3, fnv1a64("foo")), fnv1a64("foobar"));  // a hash continues
}

TEST(Bytes, SettingsUseTheOneSizeSyntax) {
  // The same syntax in the settings: 1MiB was rejected, 1MB accepted.
  config::Settings s;
  std::string error;
  for (const char* text : {"1MiB", "1MB", "1M", "1048576"}) {
    ASSERT_EQ(load({{"DYNAMIQ_MIN_BYTES", text}}, &s, &error), Status::kOk) << text << error;
    EXPECT_EQ(s.min_bytes, 1 << 20) << text;
  }
  ASSERT_EQ(load({{"DYNAMIQ_CPU_NCCL_CHUNK_BYTES", "64KiB"}}, &s, &error), Status::kOk) << error;
  EXPECT_EQ(s.cpu_nccl_chunk_bytes, 64 << 10);
}

// ---- one table ------------------------------------------------------------------------------

TEST(Table, StructDefaultsAreTheLoadedDefaults) {
  config::Settings loaded;
  std::string error;
  ASSERT_EQ(load({}, &loaded, &error), Status::kOk) << error;
  const config::Settings plain{};
  EXPECT_TRUE(plain == loaded) << "Settings{}:\n"
                               << config::describe(plain) << "codec_spec=" << plain.codec_spec
                               << "\nloaded:\n"
                               << config::describe(loaded) << "codec_spec=" << loaded.codec_spec;
  EXPECT_EQ(plain.codec, "dynamiq");
  EXPECT_EQ(plain.min_bytes, 1 << 20);
  EXPECT_EQ(plain.block_bytes, 16 << 20);
  EXPECT_EQ(plain.timeout_ms, 1800000);
  EXPECT_EQ(plain.seed, 24301);
  EXPECT_DOUBLE_EQ(plain.metrics_interval_s, 10);
  EXPECT_EQ(plain.net_nsocks, 2);
  EXPECT_EQ(plain.net_timeout_ms, 30000);
  EXPECT_EQ(plain.cpu_nccl_chunk_bytes, 1 << 20);
  EXPECT_EQ(plain.log_level, LogLevel::kWarn);
  EXPECT_EQ(plain.log_subsys, kAllSubsys);
}

TEST(Table, HoldsTheLogNetAndCpuNcclVariables) {
  const std::string text = config::describe(config::Settings{});
  for (const char* key : {"DYNAMIQ_DEBUG=WARN", "DYNAMIQ_DEBUG_SUBSYS=ALL",
                          "DYNAMIQ_DEBUG_FILE=", "DYNAMIQ_NET_IFNAME=", "DYNAMIQ_NET_NSOCKS=2",
                          "DYNAMIQ_NET_TIMEOUT_MS=30000", "DYNAMIQ_NET_BACKEND=socket",
                          "DYNAMIQ_CPU_NCCL_TIMEOUT_MS=60000",
                          "DYNAMIQ_CPU_NCCL_CHUNK_BYTES=1048576", "DYNAMIQ_CPU_NCCL_NET_PLUGIN="})
    EXPECT_NE(text.find(std::string("  ") + key + "  "), std::string::npos) << key << "\n" << text;
}

// Invalid log, plugin and CPU NCCL values keep their default, are named with what happens, and
// leave compression alone; invalid shim values turn it off.
TEST(Table, InvalidValuesSayWhatHappens) {
  struct Case {
    const char* key;
    const char* value;
    const char* says;
    bool disables;
  } cases[] = {
      {"DYNAMIQ_NET_NSOCKS", "99",
       "DYNAMIQ_NET_NSOCKS=99 is not valid; accepted: 1..8; the net plugin uses the default 2",
       false},
      {"DYNAMIQ_NET_TIMEOUT_MS", "5s", "DYNAMIQ_NET_TIMEOUT_MS=5s is not valid", false},
      {"DYNAMIQ_NET_BACKEND", "verbs",
       "DYNAMIQ_NET_BACKEND=verbs is not valid; accepted: socket|ib|auto; the net plugin uses the "
       "default socket",
       false},
      {"DYNAMIQ_NET_IB_GID_INDEX", "256",
       "DYNAMIQ_NET_IB_GID_INDEX=256 is not valid; accepted: -1|0..255; the net plugin uses the "
       "default -1",
       false},
      {"DYNAMIQ_CPU_NCCL_TIMEOUT_MS", "0",
       "DYNAMIQ_CPU_NCCL_TIMEOUT_MS=0 is not valid; accepted: 1..86400000; the CPU NCCL uses the "
       "default 60000",
       false},
      {"DYNAMIQ_CPU_NCCL_CHUNK_BYTES", "32", "DYNAMIQ_CPU_NCCL_CHUNK_BYTES=32 is not valid", false},
      {"DYNAMIQ_DEBUG", "verbose",
       "DYNAMIQ_DEBUG=verbose is not valid; accepted: NONE|VERSION|WARN|INFO|TRACE; the log uses "
       "the default WARN",
       false},
      {"DYNAMIQ_DEBUG_SUBSYS", "SHIM,BOGUS", "DYNAMIQ_DEBUG_SUBSYS=SHIM,BOGUS is not valid", false},
      {"DYNAMIQ_BITS", "2",
       "DYNAMIQ_BITS=2 is not valid; accepted: 3..16 or auto; compression is OFF: every call "
       "passes "
       "through to NCCL",
       true},
      {"DYNAMIQ_TOPO", "torus", "DYNAMIQ_TOPO=torus is not a topology", true},
  };
  const config::Settings defaults{};
  for (const Case& c : cases) {
    config::Settings s;
    std::string error;
    std::vector<config::Problem> problems;
    Map env{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_NET_NSOCKS", "4"}};
    env[c.key] = c.value;
    EXPECT_EQ(load(env, &s, &error, &problems), Status::kInvalidArgument) << c.key;
    ASSERT_EQ(problems.size(), 1u) << error;
    EXPECT_NE(problems[0].message.find(c.says), std::string::npos) << problems[0].message;
    EXPECT_EQ(error, problems[0].message);
    EXPECT_EQ(s.enable, !c.disables) << c.key;
    // The invalid setting is back at its default; a valid neighbour keeps its value.
    config::Settings expect = defaults;
    expect.enable = s.enable;
    expect.net_nsocks = std::string(c.key) == "DYNAMIQ_NET_NSOCKS" ? 2 : 4;
    EXPECT_TRUE(s == expect) << c.key << "\n" << config::describe(s);
  }
}

// A DYNAMIQ_ variable that is no setting (a misspelling, another release's name) turns
// compression off and says so, with the setting it is nearest to; the project's own scripts'
// variables and non-DYNAMIQ_ names are not settings and pass.
TEST(Table, UnknownNamesTurnCompressionOff) {
  config::Settings s;
  std::string error;
  std::vector<config::Problem> problems;
  EXPECT_EQ(load({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_CODECS", "mxfp8"}}, &s, &error, &problems),
            Status::kInvalidArgument);
  EXPECT_FALSE(s.enable);
  EXPECT_EQ(s.codec, "dynamiq");
  ASSERT_EQ(problems.size(), 1u) << error;
  EXPECT_NE(error.find("DYNAMIQ_CODECS is set but is not a dynamiq setting (did you mean "
                       "DYNAMIQ_CODEC?); compression is OFF"),
            std::string::npos)
      << error;
  EXPECT_EQ(load({{"DYNAMIQ_ENABLED", "1"}}, &s, &error), Status::kInvalidArgument);
  EXPECT_NE(error.find("(did you mean DYNAMIQ_ENABLE?)"), std::string::npos) << error;
  EXPECT_FALSE(s.enable);
  EXPECT_EQ(load({{"DYNAMIQ_SOMETHING_ELSE_ENTIRELY", "1"}}, &s, &error), Status::kInvalidArgument);
  EXPECT_NE(error.find("DYNAMIQ_SOMETHING_ELSE_ENTIRELY is set but is not a dynamiq setting "
                       "(the README's Settings table lists them)"),
            std::string::npos)
      << error;
  EXPECT_EQ(load({{"DYNAMIQ_ENABLE", "1"},
                  {"DYNAMIQ_CI_LEGS", "0"},
                  {"DYNAMIQ_VM_KEEP", "1"},
                  {"DYNAMIQ_VM", "1"},
                  {"DYNAMIQ_PERFTEST_DEV", "rxe0"},
                  {"DYNAMIQ_VENV", "/opt/venv"},
                  {"DYNAMIQ_REAL_NCCL", "/usr/lib/libnccl.so.2"},
                  {"DYNAMIQ_NET_PLUGIN_PATH", "/opt/plugin.so"},
                  {"DYNAMIQ_CODEC", "mxfp8"},
                  {"NCCL_DEBUG", "WARN"},
                  {"DYNAMIQ", "1"}},
                 &s, &error),
            Status::kOk)
      << error;
  EXPECT_TRUE(s.enable);
  EXPECT_EQ(s.codec, "mxfp8");
}

TEST(Table, TimeoutAndInterfaceFallbacks) {
  config::Settings s;
  std::string error;
  ASSERT_EQ(load({{"DYNAMIQ_TIMEOUT_MS", "5000"}}, &s, &error), Status::kOk) << error;
  EXPECT_EQ(s.net_timeout_ms, 5000);
  EXPECT_EQ(s.cpu_nccl_timeout_ms, 5000);
  ASSERT_EQ(load({{"DYNAMIQ_TIMEOUT_MS", "5000"},
                  {"DYNAMIQ_NET_TIMEOUT_MS", "700"},
                  {"DYNAMIQ_CPU_NCCL_TIMEOUT_MS", "800"}},
                 &s, &error),
            Status::kOk);
  EXPECT_EQ(s.net_timeout_ms, 700);
  EXPECT_EQ(s.cpu_nccl_timeout_ms, 800);
  ASSERT_EQ(load({{"NCCL_SOCKET_IFNAME", "eth"}}, &s, &error), Status::kOk);
  EXPECT_EQ(s.net_ifname, "eth");
  ASSERT_EQ(load({{"NCCL_SOCKET_IFNAME", "eth"}, {"DYNAMIQ_NET_IFNAME", "lo"}}, &s, &error),
            Status::kOk);
  EXPECT_EQ(s.net_ifname, "lo");
}

// A job's NCCL_IB_* settings hold for the verbs backend that replaces NCCL's IB transport: each
// is taken while dynamiq's own variable is unset, checked as that one would be, and dynamiq's
// wins where both are set.
TEST(Table, NcclIbSettingsCarryOverToTheVerbsBackend) {
  config::Settings s;
  std::string error;
  ASSERT_EQ(load({{"DYNAMIQ_ENABLE", "1"},
                  {"NCCL_IB_HCA", "=mlx5_0:1,mlx5_3"},
                  {"NCCL_IB_GID_INDEX", "3"},
                  {"NCCL_IB_TC", "106"},
                  {"NCCL_IB_SL", "5"},
                  {"NCCL_IB_TIMEOUT", "22"},
                  {"NCCL_IB_RETRY_CNT", "4"},
                  {"NCCL_IB_QPS_PER_CONNECTION", "2"},
                  {"NCCL_IB_PCI_RELAXED_ORDERING", "0"},
                  {"NCCL_IB_DISABLE", "1"}},
                 &s, &error),
            Status::kOk)
      << error;
  EXPECT_EQ(s.net_ib_hca, "=mlx5_0:1,mlx5_3");
  EXPECT_EQ(s.net_ib_gid_index, "3");
  EXPECT_EQ(s.net_ib_tc, 106);
  EXPECT_EQ(s.net_ib_sl, 5);
  EXPECT_EQ(s.net_ib_timeout, 22);
  EXPECT_EQ(s.net_ib_retry_cnt, 4);
  EXPECT_EQ(s.net_ib_qps, 2);
  EXPECT_EQ(s.net_ib_pci_relaxed_ordering, 0);
  EXPECT_TRUE(s.net_ib_disable);
  EXPECT_TRUE(s.enable);
  ASSERT_EQ(load({{"NCCL_IB_TC", "106"},
                  {"DYNAMIQ_NET_IB_TC", "0"},
                  {"NCCL_IB_HCA", "mlx5_0"},
                  {"DYNAMIQ_NET_IB_HCA", "mlx5_1"}},
                 &s, &error),
            Status::kOk);
  EXPECT_EQ(s.net_ib_tc, 0);
  EXPECT_EQ(s.net_ib_hca, "mlx5_1");
  // Unset, and NCCL's unset too: the table's defaults (NCCL's own defaults for the queue pairs).
  ASSERT_EQ(load({}, &s, &error), Status::kOk);
  EXPECT_EQ(s.net_ib_tc, 0);
  EXPECT_EQ(s.net_ib_sl, 0);
  EXPECT_EQ(s.net_ib_timeout, 18);
  EXPECT_EQ(s.net_ib_retry_cnt, 7);
  EXPECT_EQ(s.net_ib_pci_relaxed_ordering, 2);
  // An invalid NCCL value is named as such, the default stays, and compression is not affected
  // (a net plugin setting).
  std::vector<config::Problem> problems;
  EXPECT_EQ(load({{"DYNAMIQ_ENABLE", "1"}, {"NCCL_IB_TC", "256"}, {"NCCL_IB_TIMEOUT", "0"}}, &s,
                 &error, &problems),
            Status::kInvalidArgument);
  EXPECT_EQ(s.net_ib_tc, 0);
  EXPECT_EQ(s.net_ib_timeout, 18);
  EXPECT_TRUE(s.enable);
  ASSERT_EQ(problems.size(), 2u) << error;
  EXPECT_NE(problems[0].message.find("NCCL_IB_TC=256 (read for DYNAMIQ_NET_IB_TC, which is unset) "
                                     "is not valid; accepted: 0..255"),
            std::string::npos)
      << problems[0].message;
  EXPECT_NE(problems[1].message.find("NCCL_IB_TIMEOUT=0"), std::string::npos)
      << problems[1].message;
  // NCCL's own syntax for its variables (strtoll, base 0): a leading 0 is octal, and what NCCL's
  // IB transport takes for 96 the verbs backend takes for 96, not 140; dynamiq's own variables
  // stay decimal.
  ASSERT_EQ(
      load({{"NCCL_IB_TC", "0140"}, {"NCCL_IB_TIMEOUT", "010"}, {"NCCL_IB_SL", "0x3"}}, &s, &error),
      Status::kOk)
      << error;
  EXPECT_EQ(s.net_ib_tc, 96);
  EXPECT_EQ(s.net_ib_timeout, 8);
  EXPECT_EQ(s.net_ib_sl, 3);
  ASSERT_EQ(load({{"DYNAMIQ_NET_IB_TC", "0140"}}, &s, &error), Status::kOk) << error;
  EXPECT_EQ(s.net_ib_tc, 140);
  // NCCL takes the longest number the text begins with, and refuses nothing else: "08" is 0
  // (octal, ended by the 8), "96 " is 96. NCCL_IB_GID_INDEX too, though the setting is text.
  ASSERT_EQ(load({{"NCCL_IB_RETRY_CNT", "08"},
                  {"NCCL_IB_TC", "96 "},
                  {"NCCL_IB_SL", " +5"},
                  {"NCCL_IB_GID_INDEX", "010"}},
                 &s, &error),
            Status::kOk)
      << error;
  EXPECT_EQ(s.net_ib_retry_cnt, 0);
  EXPECT_EQ(s.net_ib_tc, 96);
  EXPECT_EQ(s.net_ib_sl, 5);
  EXPECT_EQ(s.net_ib_gid_index, "8");
  ASSERT_EQ(load({{"NCCL_IB_GID_INDEX", "0x3"}}, &s, &error), Status::kOk) << error;
  EXPECT_EQ(s.net_ib_gid_index, "3");
  ASSERT_EQ(load({{"NCCL_IB_GID_INDEX", "-1"}}, &s, &error), Status::kOk) << error;
  EXPECT_EQ(s.net_ib_gid_index, "-1");
  // NCCL_IB_DISABLE is an integer to NCCL too: any value but 0 turns its IB transport off.
  for (const char* off : {"2", "01", "1 "}) {
    ASSERT_EQ(load({{"NCCL_IB_DISABLE", off}}, &s, &error), Status::kOk) << off << ": " << error;
    EXPECT_TRUE(s.net_ib_disable) << off;
  }
  ASSERT_EQ(load({{"NCCL_IB_DISABLE", "0x0"}}, &s, &error), Status::kOk) << error;
  EXPECT_FALSE(s.net_ib_disable);
  // Its own variable stays decimal, and a number NCCL reads outside the range is refused.
  ASSERT_EQ(load({{"DYNAMIQ_NET_IB_GID_INDEX", "010"}}, &s, &error), Status::kOk) << error;
  EXPECT_EQ(s.net_ib_gid_index, "010");
  problems.clear();
  EXPECT_EQ(load({{"NCCL_IB_GID_INDEX", "0400"}}, &s, &error, &problems),
            Status::kInvalidArgument);  // 256
  EXPECT_EQ(s.net_ib_gid_index, "-1");
  ASSERT_EQ(problems.size(), 1u) << error;
  EXPECT_NE(problems[0].message.find("NCCL_IB_GID_INDEX=0400"), std::string::npos)
      << problems[0].message;
  // NCCL's socket counts read the same way ("08" is 0, below the range: the default kept).
  problems.clear();
  EXPECT_EQ(load({{"NCCL_NSOCKS_PERTHREAD", "08"}}, &s, &error, &problems),
            Status::kInvalidArgument);
  EXPECT_EQ(s.net_nsocks, 2);
  ASSERT_EQ(load({{"NCCL_NSOCKS_PERTHREAD", "03"}}, &s, &error), Status::kOk) << error;
  EXPECT_EQ(s.net_nsocks, 3);
}

// NCCL_DEBUG raises dynamiq's log level while DYNAMIQ_DEBUG is unset (a job debugged with
// NCCL_DEBUG=INFO sees dynamiq's lines too), and never lowers it: the warning that says why
// compression is off stays visible under NCCL_DEBUG=VERSION or a word NCCL ignores.
TEST(Table, NcclDebugRaisesTheLogLevelOnly) {
  struct Case {
    const char* nccl;
    LogLevel expect;
  };
  const Case cases[] = {
      {"INFO", LogLevel::kInfo},   {"info", LogLevel::kInfo},    {"ABORT", LogLevel::kInfo},
      {"TRACE", LogLevel::kTrace}, {"WARN", LogLevel::kWarn},    {"VERSION", LogLevel::kWarn},
      {"NONE", LogLevel::kWarn},   {"verbose", LogLevel::kWarn}, {"", LogLevel::kWarn}};
  for (const Case& c : cases) {
    config::Settings s;
    std::string error;
    ASSERT_EQ(load({{"NCCL_DEBUG", c.nccl}}, &s, &error), Status::kOk) << c.nccl << ": " << error;
    EXPECT_EQ(s.log_level, c.expect) << "NCCL_DEBUG=" << c.nccl;
  }
  // dynamiq's own variable wins either way.
  config::Settings s;
  std::string error;
  ASSERT_EQ(load({{"NCCL_DEBUG", "INFO"}, {"DYNAMIQ_DEBUG", "VERSION"}}, &s, &error), Status::kOk);
  EXPECT_EQ(s.log_level, LogLevel::kVersion);
  ASSERT_EQ(load({{"NCCL_DEBUG", "VERSION"}, {"DYNAMIQ_DEBUG", "TRACE"}}, &s, &error), Status::kOk);
  EXPECT_EQ(s.log_level, LogLevel::kTrace);
  // The subsystems are not NCCL's (INIT, COLL, ...): NCCL_DEBUG_SUBSYS does not filter them.
  ASSERT_EQ(load({{"NCCL_DEBUG", "INFO"}, {"NCCL_DEBUG_SUBSYS", "COLL"}}, &s, &error), Status::kOk);
  EXPECT_EQ(s.log_subsys, config::Settings{}.log_subsys);
}

// Where NCCL_DEBUG raised the level and NCCL's log goes to a file, dynamiq's goes beside it, not
// onto the terminal; its own DYNAMIQ_DEBUG or DYNAMIQ_DEBUG_FILE keep their meaning.
TEST(Table, NcclDebugFileTakesDynamiqsLinesBesideIt) {
  config::Settings s;
  std::string error;
  ASSERT_EQ(load({{"NCCL_DEBUG", "INFO"}, {"NCCL_DEBUG_FILE", "/logs/nccl.%h.%p"}}, &s, &error),
            Status::kOk);
  EXPECT_EQ(s.debug_file, "/logs/nccl.%h.%p.dynamiq");
  ASSERT_EQ(load({{"NCCL_DEBUG", "INFO"},
                  {"NCCL_DEBUG_FILE", "/logs/nccl.%h.%p"},
                  {"DYNAMIQ_DEBUG_FILE", "/mine/dq.%p"}},
                 &s, &error),
            Status::kOk);
  EXPECT_EQ(s.debug_file, "/mine/dq.%p");
  // The level is dynamiq's own, or NCCL's did not raise it: the file is NCCL's business only.
  ASSERT_EQ(load({{"DYNAMIQ_DEBUG", "INFO"},
                  {"NCCL_DEBUG", "INFO"},
                  {"NCCL_DEBUG_FILE", "/logs/nccl.%h.%p"}},
                 &s, &error),
            Status::kOk);
  EXPECT_EQ(s.debug_file, "");
  ASSERT_EQ(load({{"NCCL_DEBUG", "WARN"}, {"NCCL_DEBUG_FILE", "/logs/nccl.%h.%p"}}, &s, &error),
            Status::kOk);
  EXPECT_EQ(s.debug_file, "");
}

// The plugin replaces NCCL's socket transport, whose sockets per connection are
// NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD: their product holds while DYNAMIQ_NET_NSOCKS is
// unset, capped at the plugin's 8; an invalid one is named and the default stays.
TEST(Table, NcclSocketCountsCarryOverToThePlugin) {
  struct Case {
    std::map<std::string, std::string> env;
    int expect;
  };
  const Case cases[] = {
      {{}, 2},
      {{{"NCCL_SOCKET_NTHREADS", "2"}, {"NCCL_NSOCKS_PERTHREAD", "2"}}, 4},
      {{{"NCCL_NSOCKS_PERTHREAD", "3"}}, 3},
      {{{"NCCL_SOCKET_NTHREADS", "1"}}, 1},
      {{{"NCCL_SOCKET_NTHREADS", "4"}, {"NCCL_NSOCKS_PERTHREAD", "4"}}, 8},
      {{{"NCCL_SOCKET_NTHREADS", "4"}, {"DYNAMIQ_NET_NSOCKS", "3"}}, 3},
  };
  for (const Case& c : cases) {
    config::Settings s;
    std::string error;
    ASSERT_EQ(load(c.env, &s, &error), Status::kOk) << error;
    EXPECT_EQ(s.net_nsocks, c.expect) << c.expect;
  }
  config::Settings s;
  std::string error;
  std::vector<config::Problem> problems;
  EXPECT_EQ(
      load(
          {{"DYNAMIQ_ENABLE", "1"}, {"NCCL_SOCKET_NTHREADS", "17"}, {"NCCL_NSOCKS_PERTHREAD", "4"}},
          &s, &error, &problems),
      Status::kInvalidArgument);
  EXPECT_EQ(s.net_nsocks, 2);
  EXPECT_TRUE(s.enable);
  ASSERT_EQ(problems.size(), 1u) << error;
  EXPECT_NE(problems[0].message.find("NCCL_SOCKET_NTHREADS=17 (read for DYNAMIQ_NET_NSOCKS, which "
                                     "is unset) is not valid; accepted: 1..16"),
            std::string::npos)
      << problems[0].message;
}

// ---- the log's parsers ----------------------------------------------------------------------

TEST(Log, SubsystemsAsNcclDefinesThem) {
  const unsigned net = static_cast<unsigned>(Subsys::kNet);
  const unsigned env = static_cast<unsigned>(Subsys::kEnv);
  struct Case {
    const char* text;
    unsigned mask;
  } cases[] = {{"ALL", kAllSubsys},
               {"all", kAllSubsys},
               {"NET", net},
               {"net,ENV", net | env},
               {"^NET", kAllSubsys & ~net},
               {"^NET,ENV", kAllSubsys & ~(net | env)},
               {"^ALL", 0},
               {"NET,,ENV", net | env}};
  for (const Case& c : cases) {
    unsigned mask = 12345;
    EXPECT_TRUE(log_parse_subsys(c.text, &mask)) << c.text;
    EXPECT_EQ(mask, c.mask) << c.text;
  }
  unsigned mask = 0;
  EXPECT_FALSE(log_parse_subsys("NETS", &mask));
  EXPECT_FALSE(log_parse_subsys("NET,^ENV", &mask));
  LogLevel level;
  EXPECT_TRUE(log_parse_level("info", &level));
  EXPECT_EQ(level, LogLevel::kInfo);
  EXPECT_FALSE(log_parse_level("verbose", &level));
}

TEST(Log, FileNameSubstitution) {
  EXPECT_EQ(log_expand_path("/tmp/dq.%h.%p.%r.log", "node7", 4242, "3"),
            "/tmp/dq.node7.4242.3.log");
  EXPECT_EQ(log_expand_path("%r-%%-%x-%", "h", 9, "-"), "9-%-%x-%");  // no rank: the pid
}

// ---- the log, in a child process --------------------------------------------------------------

struct Child {
  int status = -1;
  std::string err;  // its stderr
};

std::string g_self;

// Runs this binary with --child NAME and the given variables set (every DYNAMIQ_* and rank
// variable of ours unset first).
Child run_child(const std::string& name, const Map& env) {
  char tmpl[] = "/tmp/dq-config-test-XXXXXX";
  const int fd = mkstemp(tmpl);
  Child out;
  const pid_t pid = fork();
  if (pid == 0) {
    for (const char* key :
         {"DYNAMIQ_DEBUG", "DYNAMIQ_DEBUG_SUBSYS", "DYNAMIQ_DEBUG_FILE", "DYNAMIQ_NET_NSOCKS",
          "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"})
      unsetenv(key);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    dup2(fd, STDERR_FILENO);
    execl(g_self.c_str(), g_self.c_str(), "--child", name.c_str(),
          g_plugin_path ? g_plugin_path : "", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fd);
  waitpid(pid, &out.status, 0);
  out.err = read_file(tmpl);
  unlink(tmpl);
  return out;
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream s(text);
  for (std::string line; std::getline(s, line);) out.push_back(line);
  return out;
}

std::string short_host() {
  char buf[256] = {};
  gethostname(buf, sizeof buf - 1);
  std::string h(buf);
  return h.substr(0, h.find('.'));
}

// Child scenario "lines": a warning, an INFO line, the device set by the shim, a filtered line.
int child_lines() {
  DQ_WARN(Subsys::kShim, "hello %d", 1);
  DQ_INFO(Subsys::kNet, "net info");
  DQ_INFO(Subsys::kEngine, "engine info");
  log_set_device(7);
  DQ_INFO(Subsys::kNet, "after device");
  {
    const LogDeviceScope scope(3);  // a call on a communicator of device 3
    DQ_INFO(Subsys::kNet, "in scope");
  }
  DQ_INFO(Subsys::kNet, "after scope");
  return 0;
}

// Child scenario "ranked": the shim's first communicator (DQ_TEST_COMM_RANK of
// DQ_TEST_COMM_SIZE) named before the first line, which opens the debug file.
int child_ranked() {
  const char* rank = std::getenv("DQ_TEST_COMM_RANK");
  const char* size = std::getenv("DQ_TEST_COMM_SIZE");
  if (rank != nullptr && size != nullptr) log_set_rank(std::atoi(rank), std::atoi(size));
  DQ_WARN(Subsys::kShim, "ranked line");
  return 0;
}

// NCCL's field order: "host:pid:tid [dev] NCCL INFO msg", "host:pid:tid [dev] file:line NCCL WARN
// msg" (a timestamp first on warnings, as NCCL 2.23 and later print it); no subsystem token.
TEST(Log, LinesLookLikeNccl) {
  const Child c = run_child(
      "lines", {{"DYNAMIQ_DEBUG", "INFO"}, {"DYNAMIQ_DEBUG_SUBSYS", "^ENGINE,ENV"}, {"RANK", "5"}});
  ASSERT_TRUE(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) << c.err;
  const std::string id = short_host() + ":[0-9]+:[0-9]+ ";
  const std::vector<std::string> lines = lines_of(c.err);
  ASSERT_EQ(lines.size(), 6u) << c.err;
  // First use at INFO: the banner (version, git revision, the NCCL and CUDA it runs on), once.
  EXPECT_TRUE(std::regex_match(
      lines[0], std::regex(id + "\\[-\\] dynamiq INFO dynamiq [0-9]+\\.[0-9]+\\.[0-9]+ \\(git "
                                ".+\\), NCCL [^,]+, CUDA runtime [^,]+, CUDA driver .+")))
      << lines[0];
  EXPECT_TRUE(std::regex_match(
      lines[1], std::regex("\\[[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}\\] " + id +
                           "\\[-\\] config_test\\.cc:[0-9]+ dynamiq WARN hello 1")))
      << lines[1];
  EXPECT_TRUE(std::regex_match(lines[2], std::regex(id + "\\[-\\] dynamiq INFO net info")))
      << lines[2];
  // ^ENGINE,ENV: the ENGINE line (and the settings) left out; the launcher's RANK is not the
  // device: log_set_device() and a LogDeviceScope are.
  EXPECT_TRUE(std::regex_match(lines[3], std::regex(id + "\\[7\\] dynamiq INFO after device")))
      << lines[3];
  EXPECT_TRUE(std::regex_match(lines[4], std::regex(id + "\\[3\\] dynamiq INFO in scope")))
      << lines[4];
  EXPECT_TRUE(std::regex_match(lines[5], std::regex(id + "\\[7\\] dynamiq INFO after scope")))
      << lines[5];
  // The pid and thread id are this child's.
  EXPECT_EQ(lines[2].substr(0, lines[2].find(' ')), lines[3].substr(0, lines[3].find(' ')));
}

// DYNAMIQ_DEBUG=VERSION (NCCL_DEBUG=VERSION): the banner alone, no warning.
TEST(Log, VersionLevelPrintsTheBannerAlone) {
  const Child c = run_child("lines", {{"DYNAMIQ_DEBUG", "VERSION"}});
  ASSERT_TRUE(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) << c.err;
  const std::vector<std::string> lines = lines_of(c.err);
  ASSERT_EQ(lines.size(), 1u) << c.err;
  EXPECT_TRUE(std::regex_match(lines[0],
                               std::regex(short_host() + ":[0-9]+:[0-9]+ \\[-\\] dynamiq VERSION "
                                                         "dynamiq [0-9.]+ \\(git .+\\), NCCL .+")))
      << lines[0];
  // At WARN, the default: no banner.
  const Child quiet = run_child("lines", {});
  EXPECT_EQ(count(quiet.err, "(git "), 0) << quiet.err;
  EXPECT_EQ(count(quiet.err, "hello 1"), 1) << quiet.err;
}

TEST(Log, NcclVersionCodesAsText) {
  EXPECT_EQ(log_nccl_version_text(22809), "2.28.9");
  EXPECT_EQ(log_nccl_version_text(21805), "2.18.5");
  EXPECT_EQ(log_nccl_version_text(2708), "2.7.8");  // before 2.9: major*1000 + minor*100 + patch
  EXPECT_EQ(log_nccl_version_text(-1), "unknown");
}

TEST(Log, AllSelectsEverySubsystemAndNoDeviceShowsADash) {
  const Child c = run_child("lines", {{"DYNAMIQ_DEBUG", "INFO"}, {"DYNAMIQ_DEBUG_SUBSYS", "ALL"}});
  ASSERT_TRUE(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) << c.err;
  EXPECT_EQ(count(c.err, "[-] dynamiq INFO net info"), 1) << c.err;
  EXPECT_EQ(count(c.err, "[-] dynamiq INFO engine info"), 1) << c.err;
  const Child only =
      run_child("lines", {{"DYNAMIQ_DEBUG", "INFO"}, {"DYNAMIQ_DEBUG_SUBSYS", "NET"}});
  EXPECT_EQ(count(only.err, "net info"), 1) << only.err;
  EXPECT_EQ(count(only.err, "engine info"), 0) << only.err;
}

TEST(Log, DebugFileWithHostPidAndRank) {
  char dir[] = "/tmp/dq-config-test-dir-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string pattern = std::string(dir) + "/dq.%h.%p.%r.log";
  // The process's first line truncates what an earlier process left under that name.
  const Child c = run_child(
      "lines", {{"DYNAMIQ_DEBUG", "INFO"}, {"DYNAMIQ_DEBUG_FILE", pattern}, {"RANK", "2"}});
  ASSERT_TRUE(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) << c.err;
  EXPECT_EQ(c.err, "");
  std::vector<std::string> names;
  std::string listing;
  if (DIR* d = opendir(dir)) {
    while (const dirent* e = readdir(d))
      if (e->d_name[0] != '.') names.push_back(e->d_name), listing += std::string(e->d_name) + "\n";
    closedir(d);
  }
  ASSERT_EQ(names.size(), 1u) << listing;
  EXPECT_TRUE(
      std::regex_match(names[0], std::regex("dq\\." + short_host() + "\\.[0-9]+\\.2\\.log")))
      << names[0];
  const std::string path = std::string(dir) + "/" + names[0];
  const std::string text = read_file(path);
  EXPECT_EQ(count(text, "dynamiq WARN hello 1"), 1) << text;
  EXPECT_EQ(count(text, "net info"), 1) << text;
  // Again under the same name: truncated, not appended.
  const std::string fixed = std::string(dir) + "/fixed.log";
  {
    std::ofstream junk(fixed);
    junk << "left by an earlier process\n";
  }
  const Child again = run_child("lines", {{"DYNAMIQ_DEBUG_FILE", fixed}});
  ASSERT_TRUE(WIFEXITED(again.status) && WEXITSTATUS(again.status) == 0) << again.err;
  const std::string fresh = read_file(fixed);
  EXPECT_EQ(count(fresh, "earlier process"), 0) << fresh;
  EXPECT_EQ(count(fresh, "hello 1"), 1) << fresh;
  unlink(fixed.c_str());
  unlink(path.c_str());
  rmdir(dir);
}

// The debug file's %r, as the metrics file's: the launcher's rank while its job covers the
// shim's communicator (a data-parallel group's rank is shared by the processes of a node under
// tensor parallelism, and each would truncate the other's file), the communicator's rank where
// the processes were started below the launcher (one task a node, a worker a GPU), the pid
// without either.
TEST(Log, DebugFileRankFollowsTheLauncherWhileItCoversTheJob) {
  char dir[] = "/tmp/dq-config-test-dir-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string pattern = std::string(dir) + "/dq.%r.log";
  struct Case {
    Map env;
    std::string name;
  };
  const Case cases[] = {
      {{{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"DQ_TEST_COMM_RANK", "1"}, {"DQ_TEST_COMM_SIZE", "4"}},
       "dq.5.log"},
      {{{"SLURM_PROCID", "1"},
        {"SLURM_NTASKS", "2"},
        {"DQ_TEST_COMM_RANK", "6"},
        {"DQ_TEST_COMM_SIZE", "8"}},
       "dq.6.log"},
      {{{"DQ_TEST_COMM_RANK", "3"}, {"DQ_TEST_COMM_SIZE", "4"}}, "dq.3.log"},
      {{{"RANK", "2"}}, "dq.2.log"},
  };
  for (const Case& k : cases) {
    Map env = k.env;
    env["DYNAMIQ_DEBUG_FILE"] = pattern;
    const Child c = run_child("ranked", env);
    ASSERT_TRUE(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) << c.err;
    const std::string path = std::string(dir) + "/" + k.name;
    EXPECT_EQ(count(read_file(path), "ranked line"), 1) << k.name;
    unlink(path.c_str());
  }
  rmdir(dir);
}

// Child scenario "settings": the table loaded by the shim's way and the plugin's way, again and
// again, then the net plugin library (its own copy of the core library) loaded and initialised.
int child_settings(const char* plugin) {
  for (int i = 0; i < 3; ++i) {
    config::global();
    config::current();
  }
  if (plugin == nullptr || *plugin == '\0') return 0;
  void* lib = dlopen(plugin, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 3;
  }
  const auto* net = static_cast<const dqNetV8*>(dlsym(lib, "ncclNetPlugin_v8"));
  if (net == nullptr) return 4;
  // Without NCCL's logger the plugin logs through its own copy of common/log.
  if (net->init(nullptr) != dqNetSuccess) return 5;
  int ndev = 0;
  net->devices(&ndev);
  DQ_WARN(Subsys::kCore, "child done");
  return 0;
}

TEST(Log, EachProblemOncePerProcessAcrossLibraryCopies) {
  const Child c = run_child(
      "settings",
      {{"DYNAMIQ_DEBUG", "verbose"}, {"DYNAMIQ_NET_NSOCKS", "99"}, {"DYNAMIQ_NET_IFNAME", "lo"}});
  ASSERT_TRUE(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) << c.err;
  EXPECT_EQ(count(c.err, "DYNAMIQ_DEBUG=verbose is not valid"), 1) << c.err;
  EXPECT_EQ(count(c.err, "DYNAMIQ_NET_NSOCKS=99 is not valid"), 1) << c.err;
  EXPECT_EQ(count(c.err, "child done"), 1) << c.err;
  EXPECT_EQ(count(c.err, " WARN "), 3) << c.err;
}

// At INFO the settings that differ from their defaults, once per process; every one at TRACE.
TEST(Log, SettingsThatDifferAtInfoEveryOneAtTrace) {
  const Child c = run_child(
      "settings",
      {{"DYNAMIQ_DEBUG", "INFO"}, {"DYNAMIQ_DEBUG_SUBSYS", "ENV"}, {"DYNAMIQ_NET_IFNAME", "lo"}});
  ASSERT_TRUE(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) << c.err;
  EXPECT_EQ(count(c.err, "dynamiq setting DYNAMIQ_NET_IFNAME=lo  (default \"\")\n"), 1) << c.err;
  EXPECT_EQ(count(c.err, "dynamiq setting DYNAMIQ_DEBUG=INFO"), 1) << c.err;
  EXPECT_EQ(count(c.err, "dynamiq setting DYNAMIQ_ENABLE="), 0) << c.err;
  EXPECT_EQ(count(c.err, "dynamiq setting "), 3) << c.err;
  EXPECT_EQ(count(c.err, "dynamiq settings: 3 of "), 1) << c.err;
  EXPECT_EQ(count(c.err, "dynamiq INFO dynamiq " + std::string(config::build_version())), 1)
      << c.err;
  const Child t = run_child(
      "settings",
      {{"DYNAMIQ_DEBUG", "TRACE"}, {"DYNAMIQ_DEBUG_SUBSYS", "ENV"}, {"DYNAMIQ_NET_IFNAME", "lo"}});
  ASSERT_TRUE(WIFEXITED(t.status) && WEXITSTATUS(t.status) == 0) << t.err;
  EXPECT_EQ(count(t.err, "dynamiq setting DYNAMIQ_ENABLE=0"), 1) << t.err;
  EXPECT_EQ(count(t.err, "dynamiq setting "), count(config::describe(config::Settings{}), "\n"))
      << t.err;
}

// A setting that took NCCL's variable says so on its INFO line: a job's NCCL_* settings now
// change dynamiq's, and the log must show which did.
TEST(Log, SettingsTakenFromNcclNameTheirSource) {
  const Child c = run_child("settings", {{"NCCL_DEBUG", "INFO"},
                                         {"DYNAMIQ_DEBUG_SUBSYS", "ENV"},
                                         {"NCCL_IB_TC", "106"},
                                         {"NCCL_NSOCKS_PERTHREAD", "4"}});
  ASSERT_TRUE(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) << c.err;
  EXPECT_EQ(count(c.err, "dynamiq setting DYNAMIQ_DEBUG=INFO  (default WARN)  from NCCL_DEBUG\n"),
            1)
      << c.err;
  EXPECT_EQ(count(c.err, "dynamiq setting DYNAMIQ_NET_IB_TC=106  (default 0)  from NCCL_IB_TC\n"),
            1)
      << c.err;
  EXPECT_EQ(count(c.err,
                  "dynamiq setting DYNAMIQ_NET_NSOCKS=4  (default 2)  from "
                  "NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD\n"),
            1)
      << c.err;
  // dynamiq's own (DYNAMIQ_DEBUG_SUBSYS, and DYNAMIQ_NET_IFNAME from the test's environment)
  // name no source.
  EXPECT_EQ(count(c.err, "dynamiq setting DYNAMIQ_DEBUG_SUBSYS=ENV  (default ALL)\n"), 1) << c.err;
  EXPECT_EQ(count(c.err, "  from "), 3) << c.err;
}

// A bad metrics setting turns the metrics file off, never compression.
TEST(Table, BadMetricsSettingDisablesMetricsNotCompression) {
  config::Settings s;
  std::string error;
  std::vector<config::Problem> problems;
  Map env{{"DYNAMIQ_ENABLE", "1"},
          {"DYNAMIQ_METRICS_FILE", "/tmp/m.prom"},
          {"DYNAMIQ_METRICS_INTERVAL_S", "0"}};
  EXPECT_EQ(load(env, &s, &error, &problems), Status::kInvalidArgument);
  ASSERT_EQ(problems.size(), 1u) << error;
  EXPECT_EQ(problems[0].scope, config::Scope::Metrics);
  EXPECT_NE(error.find("the metrics file is off (compression is not affected)"), std::string::npos)
      << error;
  EXPECT_TRUE(s.enable);
  EXPECT_EQ(s.metrics_file, "");
}

TEST(Log, FirstInProcessOncePerKeyAndAgainInAForkedChild) {
  EXPECT_TRUE(log_first_in_process("config_test key"));
  EXPECT_FALSE(log_first_in_process("config_test key"));
  EXPECT_TRUE(log_first_in_process("config_test other key"));
  const pid_t pid = fork();
  if (pid == 0) _exit(log_first_in_process("config_test key") ? 0 : 1);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

}  // namespace
}  // namespace dq

int main(int argc, char** argv) {
  dq::g_self = argv[0];
  if (argc >= 3 && std::string(argv[1]) == "--child") {
    const std::string name = argv[2];
    if (name == "lines") return dq::child_lines();
    if (name == "ranked") return dq::child_ranked();
    if (name == "settings") return dq::child_settings(argc > 3 ? argv[3] : nullptr);
    return 2;
  }
  ::testing::InitGoogleTest(&argc, argv);
  if (argc > 1) dq::g_plugin_path = argv[1];
  return RUN_ALL_TESTS();
}
