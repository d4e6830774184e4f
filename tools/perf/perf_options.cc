#include "tools/perf/perf_options.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <functional>
#include <map>
#include <type_traits>

#include "config/bytes.h"
#include "tools/cli/cli.h"

namespace dq::perf {
namespace {

struct NamedDType {
  DType type;
  const char* name;
  size_t bytes;
};
constexpr NamedDType kDTypes[] = {
    {DType::kInt8, "int8", 1},        {DType::kUint8, "uint8", 1},   {DType::kInt32, "int32", 4},
    {DType::kUint32, "uint32", 4},    {DType::kInt64, "int64", 8},   {DType::kUint64, "uint64", 8},
    {DType::kFloat16, "half", 2},     {DType::kFloat32, "float", 4}, {DType::kFloat64, "double", 8},
    {DType::kBfloat16, "bfloat16", 2}};

struct NamedOp {
  RedOp op;
  const char* name;
};
constexpr NamedOp kOps[] = {{RedOp::kSum, "sum"},
                            {RedOp::kProd, "prod"},
                            {RedOp::kMax, "max"},
                            {RedOp::kMin, "min"},
                            {RedOp::kAvg, "avg"}};

bool parse_int(const char* text, long lo, long hi, int* out) {
  if (text == nullptr || *text == '\0') return false;
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  *out = static_cast<int>(v);
  return true;
}

bool parse_dtypes(const char* text, std::vector<DType>* out) {
  out->clear();
  if (std::strcmp(text, "all") == 0) {
    for (const auto& d : kDTypes) out->push_back(d.type);
    return true;
  }
  // Aliases nccl-tests accepts besides the canonical names.
  static const struct {
    const char* alias;
    DType type;
  } kAliases[] = {
      {"char", DType::kInt8},       {"int", DType::kInt32},       {"fp16", DType::kFloat16},
      {"float16", DType::kFloat16}, {"fp32", DType::kFloat32},    {"float32", DType::kFloat32},
      {"fp64", DType::kFloat64},    {"float64", DType::kFloat64}, {"bf16", DType::kBfloat16}};
  for (const auto& d : kDTypes)
    if (std::strcmp(text, d.name) == 0) out->push_back(d.type);
  for (const auto& a : kAliases)
    if (std::strcmp(text, a.alias) == 0) out->push_back(a.type);
  return !out->empty();
}

bool parse_ops(const char* text, std::vector<RedOp>* out) {
  out->clear();
  for (const auto& o : kOps)
    if (std::strcmp(text, "all") == 0 || std::strcmp(text, o.name) == 0) out->push_back(o.op);
  return !out->empty();
}

bool parse_collective(const char* text, Collective* out) {
  static const struct {
    const char* name;
    Collective c;
  } kNames[] = {{"allreduce", Collective::kAllReduce},
                {"all_reduce", Collective::kAllReduce},
                {"reducescatter", Collective::kReduceScatter},
                {"reduce_scatter", Collective::kReduceScatter},
                {"reduce", Collective::kReduce}};
  for (const auto& n : kNames)
    if (std::strcmp(text, n.name) == 0) {
      *out = n.c;
      return true;
    }
  return false;
}

}  // namespace

size_t dtype_bytes(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.bytes;
  return 0;
}

const char* dtype_name(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.name;
  return "?";
}

const char* redop_name(RedOp op) {
  for (const auto& o : kOps)
    if (o.op == op) return o.name;
  return "?";
}

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce:
      return "allreduce";
    case Collective::kReduceScatter:
      return "reducescatter";
    case Collective::kReduce:
      return "reduce";
  }
  return "?";
}

const char* nccl_tests_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce:
      return "all_reduce";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kReduce:
      return "reduce";
  }
  return "?";
}

CollCounts coll_counts(Collective c, size_t bytes, size_t element_bytes, int num_ranks) {
  CollCounts out;
  if (element_bytes == 0 || num_ranks < 1) return out;
  const size_t count = bytes / element_bytes;
  if (c != Collective::kReduceScatter) {
    out.send = out.recv = out.param = count;
    return out;
  }
  // nccl-tests reduce_scatter.cu: base = (count / nranks) & -(16 / eltSize).
  const size_t align = element_bytes < 16 ? 16 / element_bytes : 1;
  out.recv = out.param = count / static_cast<size_t>(num_ranks) / align * align;
  out.send = out.recv * static_cast<size_t>(num_ranks);
  return out;
}

double alg_bandwidth(Collective c, const CollCounts& counts, size_t element_bytes, double seconds) {
  if (seconds <= 0) return 0;
  const size_t elements = c == Collective::kReduce ? counts.param : counts.send;
  return static_cast<double>(elements * element_bytes) / seconds / 1e9;
}

double bus_factor(Collective c, int num_ranks) {
  const double n = num_ranks;
  switch (c) {
    case Collective::kAllReduce:
      return 2 * (n - 1) / n;
    case Collective::kReduceScatter:
      return (n - 1) / n;
    case Collective::kReduce:
      return 1;
  }
  return 1;
}

bool is_floating(DType t) {
  return t == DType::kFloat16 || t == DType::kFloat32 || t == DType::kFloat64 ||
         t == DType::kBfloat16;
}

bool parse_size(const char* text, size_t* out) {
  uint64_t v = 0;  // the one size syntax of dynamiq (config/bytes.h): 8, 1K, 1MB, 1MiB, ...
  if (text == nullptr || !config::parse_bytes(text, &v) || v > std::numeric_limits<size_t>::max())
    return false;
  *out = static_cast<size_t>(v);
  return true;
}

const char* perf_usage() {
  return "usage: dynamiq-perf [options]   (nccl-tests all_reduce_perf, reduce_scatter_perf and\n"
         "                                  reduce_perf flags; -c picks the collective)\n"
         "  -b, --minbytes N      smallest message, e.g. 8, 1K, 64M, 1G (default 32M)\n"
         "  -e, --maxbytes N      largest message (default 32M)\n"
         "  -i, --stepbytes N     size increment when -f is 1 (default 1M)\n"
         "  -f, --stepfactor F    size multiplier (default 1: use -i)\n"
         "  -n, --iters N         timed iterations (default 20)\n"
         "  -w, --warmup_iters N  warm-up iterations (default 5)\n"
         "  -m, --agg_iters N     operations aggregated per group (default 1)\n"
         "  -c, --check N         validation iterations, 0 to skip (default 1)\n"
         "  -c, --collective C    allreduce (default), reducescatter or reduce: -c takes a\n"
         "                        number (validation) or a collective name\n"
         "  -r, --root R          ncclReduce's root (default 0; -1: every root in turn)\n"
         "  -d, --datatype T      int8 uint8 int32 uint32 int64 uint64 half float double\n"
         "                        bfloat16 or all (default float)\n"
         "  -o, --op OP           sum prod max min avg or all (default sum)\n"
         "  -a, --average A       time shown: 0 rank 0, 1 mean, 2 min, 3 max (default 1)\n"
         "  -t, -g                threads / GPUs per process: only 1 is supported\n"
         "  -z, -G                accepted for compatibility (blocking, graph: 0 only)\n"
         "  --lossy               #wrong counts non-finite results and cross-rank mismatches\n"
         "                        instead of differences from the exact result\n"
         "  --memory M            auto (default), host or device buffers\n"
         "  -h, --help            print this help\n"
         "  --version             print the version and exit\n"
         "Every option takes its value as -x V, -xV, --name V or --name=V.\n";
}

namespace {

// One of nccl-tests' flags with its long name: "-b 1K", "-b1K", "--minbytes 1K",
// "--minbytes=1K". The short letter identifies the option in apply_flag (0: long name only).
struct PerfFlag {
  char short_name;
  const char* long_name;
  bool takes_value;
};

constexpr PerfFlag kFlags[] = {
    {'t', "nthreads", true},  {'g', "ngpus", true},        {'b', "minbytes", true},
    {'e', "maxbytes", true},  {'i', "stepbytes", true},    {'f', "stepfactor", true},
    {'n', "iters", true},     {'w', "warmup_iters", true}, {'m', "agg_iters", true},
    {'c', "check", true},     {'o', "op", true},           {'d', "datatype", true},
    {'a', "average", true},   {'r', "root", true},         {'z', "blocking", true},
    {'G', "cudagraph", true}, {0, "lossy", false},         {0, "memory", true},
    {0, "collective", true}};

// The flags without a short letter: --lossy, --collective and --memory.
Status apply_long_flag(const PerfFlag& flag, const char* value, PerfOptions* out,
                       const std::function<Status(const char*)>& bad) {
  if (std::strcmp(flag.long_name, "lossy") == 0) {
    out->lossy = true;
  } else if (std::strcmp(flag.long_name, "collective") == 0) {
    if (!parse_collective(value, &out->collective))
      return bad("allreduce, reducescatter or reduce");
  } else if (std::strcmp(value, "auto") == 0) {
    out->memory = Memory::kAuto;
  } else if (std::strcmp(value, "host") == 0) {
    out->memory = Memory::kHost;
  } else if (std::strcmp(value, "device") == 0) {
    out->memory = Memory::kDevice;
  } else {
    return bad("auto, host or device");
  }
  return Status::kOk;
}

// Applies one occurrence of a flag; *error names the flag as given by its short letter (or
// its long name when it has none) and what it expects.
Status apply_flag(const PerfFlag& flag, const char* value, PerfOptions* out, std::string* error) {
  const std::string shown =
      flag.short_name ? std::string("-") + flag.short_name : std::string("--") + flag.long_name;
  const std::function<Status(const char*)> bad = [&](const char* expected) {
    *error = "bad value '" + std::string(value) + "' for " + shown + " (expected " + expected + ")";
    return Status::kInvalidArgument;
  };
  int number = 0;
  switch (flag.short_name) {
    case 't':
    case 'g':
      if (!parse_int(value, 1, 1, &number)) return bad("1: one thread and one GPU per process");
      break;
    case 'b':
      if (!parse_size(value, &out->min_bytes)) return bad("a size such as 8, 1K, 64M");
      break;
    case 'e':
      if (!parse_size(value, &out->max_bytes)) return bad("a size such as 8, 1K, 64M");
      break;
    case 'i':
      if (!parse_size(value, &out->step_bytes)) return bad("a size such as 8, 1K, 64M");
      break;
    case 'f':
      if (!parse_int(value, 1, 1 << 20, &number)) return bad("an integer factor >= 1");
      out->step_factor = static_cast<uint64_t>(number);
      break;
    case 'n':
      if (!parse_int(value, 1, 1 << 30, &out->iters)) return bad("an integer >= 1");
      break;
    case 'w':
      if (!parse_int(value, 0, 1 << 30, &out->warmup_iters)) return bad("an integer >= 0");
      break;
    case 'm':
      if (!parse_int(value, 1, 1 << 20, &out->agg_iters)) return bad("an integer >= 1");
      break;
    case 'c':
      // nccl-tests' -c is the validation count; a name picks the collective instead.
      if (!parse_int(value, 0, 1 << 20, &out->check_iters) &&
          !parse_collective(value, &out->collective))
        return bad("an integer >= 0 (validation iterations) or allreduce, reducescatter, reduce");
      break;
    case 'a':
      if (!parse_int(value, 0, 3, &number)) return bad("0, 1, 2 or 3");
      out->average = static_cast<TimeAverage>(number);
      break;
    case 'o':
      if (!parse_ops(value, &out->ops)) return bad("sum, prod, max, min, avg or all");
      break;
    case 'd':
      if (!parse_dtypes(value, &out->dtypes))
        return bad(
            "int8, uint8, int32, uint32, int64, uint64, half, float, double, bfloat16 or all");
      break;
    case 'r':
      if (!parse_int(value, -1, 1 << 24, &out->root)) return bad("a rank >= 0, or -1 for all");
      break;
    case 'z':
      if (!parse_int(value, 0, 1, &number)) return bad("0 or 1");
      break;
    case 'G':
      if (!parse_int(value, 0, 0, &number)) return bad("0: CUDA graphs are not supported");
      break;
    default:
      return apply_long_flag(flag, value, out, bad);
  }
  return Status::kOk;
}

// The size sweep must be ordered, grow, and stay under kMaxSweepSizes sizes.
Status check_sweep(const PerfOptions& o, std::string* error) {
  if (o.min_bytes > o.max_bytes) {
    *error = "-b (" + std::to_string(o.min_bytes) + " B) is larger than -e (" +
             std::to_string(o.max_bytes) + " B)";
    return Status::kInvalidArgument;
  }
  if (o.step_factor > 1 && o.min_bytes == 0 && o.max_bytes > 0) {
    *error = "-b 0 with -f > 1 never grows; give -b > 0";
    return Status::kInvalidArgument;
  }
  if (o.step_factor <= 1 && o.step_bytes == 0 && o.max_bytes > o.min_bytes) {
    *error = "-i 0 with -f 1 never grows; give -i > 0 or -f > 1";
    return Status::kInvalidArgument;
  }
  if (sweep_sizes(o).size() >= kMaxSweepSizes) {
    *error =
        "the size sweep has more than " + std::to_string(kMaxSweepSizes) + " sizes; raise -i or -f";
    return Status::kInvalidArgument;
  }
  return Status::kOk;
}

}  // namespace

Status parse_perf_options(int argc, const char* const* argv, PerfOptions* out, std::string* error) {
  *out = PerfOptions{};
  CLI::App app;
  cli::configure(&app, "dynamiq-perf");
  std::map<const CLI::Option*, const PerfFlag*> flag_of;
  for (const auto& f : kFlags) {
    std::string names = f.short_name ? std::string("-") + f.short_name + ",--" + f.long_name
                                     : std::string("--") + f.long_name;
    flag_of[f.takes_value ? cli::add_value(&app, names) : cli::add_switch(&app, names)] = &f;
  }
  switch (cli::parse(&app, argc, argv, error)) {
    case cli::Parsed::kHelp:
      out->show_help = true;
      return Status::kOk;
    case cli::Parsed::kVersion:
      out->show_version = true;
      return Status::kOk;
    case cli::Parsed::kError:
      return Status::kInvalidArgument;
    case cli::Parsed::kRun:
      break;
  }
  // In command-line order, as nccl-tests: a repeated option's last value wins.
  for (const auto& occurrence : cli::in_order(app)) {
    const Status s =
        apply_flag(*flag_of.at(occurrence.option), occurrence.value.c_str(), out, error);
    if (s != Status::kOk) return s;
  }
  return check_sweep(*out, error);
}

std::vector<size_t> sweep_sizes(const PerfOptions& o) {
  std::vector<size_t> sizes;
  size_t size = o.min_bytes;
  while (sizes.size() < kMaxSweepSizes && size <= o.max_bytes) {
    sizes.push_back(size);
    size_t next = o.step_factor > 1 ? size * o.step_factor : size + o.step_bytes;
    bool overflow = o.step_factor > 1 ? (size != 0 && next / o.step_factor != size) : next < size;
    if (overflow || next == size) break;
    size = next;
  }
  return sizes;
}

}  // namespace dq::perf
