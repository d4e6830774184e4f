// The settings table as a whole and what it shares with the tools: one size syntax
// (config/bytes.h) for the settings and every tool's size options.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "config/bytes.h"
#include "config/settings.h"
#include "tools/perf/perf_options.h"

namespace dq {
namespace {

using Map = std::map<std::string, std::string>;

const char* lookup(const char* key, void* ctx) {
  auto* m = static_cast<Map*>(ctx);
  auto it = m->find(key);
  return it == m->end() ? nullptr : it->second.c_str();
}

Status load(Map env, config::Settings* s, std::string* error) {
  return config::load(lookup, &env, s, error);
}

// ---- one size syntax ------------------------------------------------------------------------

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
  // The same syntax in the settings: 1MiB was rejected, 1MB accepted.
  config::Settings s;
  std::string error;
  for (const char* text : {"1MiB", "1MB", "1M", "1048576"}) {
    ASSERT_EQ(load({{"DYNAMIQ_MIN_BYTES", text}}, &s, &error), Status::kOk) << text << error;
    EXPECT_EQ(s.min_bytes, 1 << 20) << text;
  }
}

}  // namespace
}  // namespace dq
