// Command line of dynamiq-perf, with nccl-tests' flags and defaults (all_reduce_perf,
// reduce_scatter_perf and reduce_perf in one program: -c picks the collective).
// Independent of NCCL so that it can be unit-tested on its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/nccl_types.h"
#include "common/status.h"

namespace dq::perf {

// Element types kInt8 .. kBfloat16 and operations kSum .. kAvg of common/nccl_types.h.
using DType = ::dq::DType;
using RedOp = ::dq::RedOp;
enum class Memory { kAuto, kHost, kDevice };
using Collective = ::dq::Collective;
// How the per-rank times are combined into the printed one (nccl-tests -a).
enum class TimeAverage { kRank0 = 0, kMean = 1, kMin = 2, kMax = 3 };

size_t dtype_bytes(DType t);
const char* dtype_name(DType t);  // nccl-tests spelling: "float", "half", "bfloat16", "int8"...
const char* redop_name(RedOp op);
bool is_floating(DType t);
const char* collective_name(Collective c);  // "allreduce", "reducescatter", "reduce"
// nccl-tests' name of the matching program's collective: "all_reduce", "reduce_scatter", "reduce".
const char* nccl_tests_name(Collective c);

// Element counts of one operation as nccl-tests sizes it from a message of `bytes`
// (GetCollByteCount): all-reduce and reduce use every whole element; a reduce-scatter gives each
// rank recv = (bytes / element / n) rounded down to a multiple of 16 bytes' worth of elements and
// sends n * recv.
struct CollCounts {
  size_t send = 0;   // elements of the send buffer
  size_t recv = 0;   // elements of the receive buffer (a reduce-scatter: one rank's block)
  size_t param = 0;  // the count passed to NCCL (and printed)
};
CollCounts coll_counts(Collective c, size_t bytes, size_t element_bytes, int num_ranks);

// nccl-tests' bandwidths for `seconds` per operation: algbw = bytes / time, over the send buffer
// for all-reduce and reduce-scatter (n * recv) and the message for reduce; busbw = algbw x
// 2(n-1)/n (all-reduce), (n-1)/n (reduce-scatter), 1 (reduce). GB/s (1e9 bytes).
double alg_bandwidth(Collective c, const CollCounts& counts, size_t element_bytes, double seconds);
double bus_factor(Collective c, int num_ranks);

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
  std::vector<DType> dtypes = {DType::kFloat32};
  std::vector<RedOp> ops = {RedOp::kSum};
  Memory memory = Memory::kAuto;
  bool lossy = false;  // validate finiteness and cross-rank identity instead of exact values
  Collective collective = Collective::kAllReduce;
  int root = 0;  // ncclReduce's root (-r); -1: every root in turn, as nccl-tests
  bool show_help = false;
  bool show_version = false;  // --version
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
