// Command line of dynamiq-perf, with nccl-tests all_reduce_perf's flags and defaults.
// Independent of NCCL so that it can be unit-tested on its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace dq::perf {

enum class DType {
  kInt8,
  kUint8,
  kInt32,
  kUint32,
  kInt64,
  kUint64,
  kHalf,
  kFloat,
  kDouble,
  kBfloat16
};
enum class RedOp { kSum, kProd, kMax, kMin, kAvg };
enum class Memory { kAuto, kHost, kDevice };
// How the per-rank times are combined into the printed one (nccl-tests -a).
enum class TimeAverage { kRank0 = 0, kMean = 1, kMin = 2, kMax = 3 };

size_t dtype_bytes(DType t);
const char* dtype_name(DType t);  // nccl-tests spelling: "float", "half", "bfloat16", "int8"...
const char* redop_name(RedOp op);
bool is_floating(DType t);

struct PerfOptions {
  size_t min_bytes = 32u << 20;
  size_t max_bytes = 32u << 20;
  size_t step_bytes = 1u << 20;  // used when step_factor <= 1
  uint64_t step_factor = 1;      // multiply the size by this when > 1
  int iters = 20;
  int warmup_iters = 5;
  int agg_iters = 1;    // operations per timed group
  int check_iters = 1;  // 0: no validation
  TimeAverage average = TimeAverage::kMean;
  std::vector<DType> dtypes = {DType::kFloat};
  std::vector<RedOp> ops = {RedOp::kSum};
  Memory memory = Memory::kAuto;
  bool lossy = false;  // validate finiteness and cross-rank identity instead of exact values
  bool show_help = false;
};

// Parses "1024", "1K", "64M", "2G" (powers of 1024, either case). False on anything else.
bool parse_size(const char* text, size_t* out);

// Parses argv (argv[0] is the program). On kInvalidArgument *error says what was wrong.
Status parse_perf_options(int argc, const char* const* argv, PerfOptions* out, std::string* error);

// The message sizes of the sweep in bytes, before rounding down to whole elements.
std::vector<size_t> sweep_sizes(const PerfOptions& options);

inline constexpr size_t kMaxSweepSizes = 4096;

const char* perf_usage();

}  // namespace dq::perf
