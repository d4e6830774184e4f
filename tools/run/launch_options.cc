#include "tools/run/launch_options.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace dq::run {
namespace {

bool parse_int(const char* text, long lo, long hi, int* out) {
  if (text == nullptr || *text == '\0') return false;
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  *out = static_cast<int>(v);
  return true;
}

bool parse_seconds(const char* text, double* out) {
  if (text == nullptr || *text == '\0') return false;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(text, &end);
  // One day is far beyond any job this launcher is meant for; it also keeps ms arithmetic exact.
  if (errno != 0 || *end != '\0' || !std::isfinite(v) || v <= 0 || v > 86400) return false;
  *out = v;
  return true;
}

// Splits "--name=value" into name and value; returns the plain argument otherwise.
struct SplitArg {
  std::string name;
  const char* inline_value = nullptr;
};

SplitArg split_arg(const char* arg) {
  SplitArg s;
  const char* eq = (std::strncmp(arg, "--", 2) == 0) ? std::strchr(arg, '=') : nullptr;
  if (eq != nullptr) {
    s.name.assign(arg, eq - arg);
    s.inline_value = eq + 1;
  } else {
    s.name = arg;
  }
  return s;
}

}  // namespace

const char* launch_usage() {
  return "usage: dynamiq-run -n N [--cpu-nccl] [--timeout S] [--grace S] -- PROGRAM [ARGS...]\n"
         "  -n, --nproc N   number of local ranks to start (1..1024)\n"
         "  --cpu-nccl      run on the CPU NCCL and the dynamiq net plugin of this build\n"
         "  --timeout S     stop every rank and exit 124 after S seconds\n"
         "  --grace S       seconds between SIGTERM and SIGKILL when stopping ranks (default 5)\n"
         "  -h, --help      print this help\n";
}

Status parse_launch_options(int argc, const char* const* argv, LaunchOptions* out,
                            std::string* error) {
  *out = LaunchOptions{};
  bool have_ranks = false;
  int i = 1;
  for (; i < argc; ++i) {
    const char* arg = argv[i];
    if (std::strcmp(arg, "--") == 0) {
      ++i;
      break;
    }
    if (arg[0] != '-' || arg[1] == '\0') break;  // first non-option: PROGRAM
    SplitArg split = split_arg(arg);
    // Options that take a value accept "--opt V", "--opt=V" and, for -n, "-nV".
    auto take_value = [&](const char** value) {
      if (split.inline_value != nullptr) {
        *value = split.inline_value;
        return true;
      }
      if (i + 1 >= argc) return false;
      *value = argv[++i];
      return true;
    };
    const char* value = nullptr;
    if (split.name == "-h" || split.name == "--help") {
      out->show_help = true;
      return Status::kOk;
    } else if (split.name == "--cpu-nccl") {
      if (split.inline_value != nullptr) {
        *error = "--cpu-nccl takes no value";
        return Status::kInvalidArgument;
      }
      out->cpu_nccl = true;
    } else if (split.name == "-n" || split.name == "--nproc" ||
               (std::strncmp(arg, "-n", 2) == 0 && arg[2] != '-')) {
      if (split.name != "-n" && split.name != "--nproc") {
        value = arg + 2;  // -n4
      } else if (!take_value(&value)) {
        *error = split.name + " needs a number of ranks";
        return Status::kInvalidArgument;
      }
      if (!parse_int(value, 1, kMaxRanks, &out->num_ranks)) {
        *error = std::string("bad number of ranks '") + value + "' (expected 1.." +
                 std::to_string(kMaxRanks) + ")";
        return Status::kInvalidArgument;
      }
      have_ranks = true;
    } else if (split.name == "--timeout" || split.name == "--grace") {
      if (!take_value(&value)) {
        *error = split.name + " needs a number of seconds";
        return Status::kInvalidArgument;
      }
      double* target = split.name == "--timeout" ? &out->timeout_s : &out->grace_s;
      if (!parse_seconds(value, target)) {
        *error = std::string("bad ") + split.name + " value '" + value +
                 "' (expected seconds > 0, at most 86400)";
        return Status::kInvalidArgument;
      }
    } else {
      *error = std::string("unknown option '") + arg + "'";
      return Status::kInvalidArgument;
    }
  }
  if (!have_ranks) {
    *error = "missing -n N (number of ranks)";
    return Status::kInvalidArgument;
  }
  if (i >= argc) {
    *error = "missing PROGRAM after the options (use: -- PROGRAM ARGS...)";
    return Status::kInvalidArgument;
  }
  out->command.assign(argv + i, argv + argc);
  if (out->command[0].empty()) {
    *error = "PROGRAM is an empty string";
    return Status::kInvalidArgument;
  }
  return Status::kOk;
}

}  // namespace dq::run
