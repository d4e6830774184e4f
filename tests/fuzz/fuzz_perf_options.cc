// libFuzzer target: the perf client's command line (tools/perf/perf_options.h
// parse_perf_options). Input: arguments separated by NUL bytes (argv[0] is the program).
// Invariants: success gives a sweep that sweep_sizes() can list (bounded), failure says why.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tools/perf/perf_options.h"

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args{"dynamiq-perf"};
  std::string cur;
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      args.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(static_cast<char>(data[i]));
    }
  }
  if (!cur.empty()) args.push_back(cur);
  if (args.size() > 64) return 0;
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  argv.push_back(nullptr);
  dq::perf::PerfOptions o;
  std::string error;
  const dq::Status s =
      dq::perf::parse_perf_options(static_cast<int>(args.size()), argv.data(), &o, &error);
  if (s == dq::Status::kOk) {
    if (!o.show_help) {
      const auto sizes = dq::perf::sweep_sizes(o);
      check(sizes.size() <= dq::perf::kMaxSweepSizes);
    }
  } else {
    check(!error.empty());
  }
  size_t bytes = 0;
  (void)dq::perf::parse_size(cur.c_str(), &bytes);
  return 0;
}
