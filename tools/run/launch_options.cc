#include "tools/run/launch_options.h"

#include <cctype>
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

// Variables the launcher itself gives every rank; --rank-env may not replace them.
constexpr const char* kLauncherOwned[] = {
    "RANK",        "WORLD_SIZE",      "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "DYNAMIQ_RUN_DIR", "GROUP_RANK", "NODE_RANK"};

bool valid_env_name(const std::string& name) {
  if (name.empty() || std::isdigit(static_cast<unsigned char>(name[0]))) return false;
  for (char c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  return true;
}

// A host name or address: no spaces, no control characters, not empty, at most 253 bytes.
bool valid_host(const char* text) {
  size_t n = std::strlen(text);
  if (n == 0 || n > 253) return false;
  for (size_t i = 0; i < n; ++i)
    if (std::isspace(static_cast<unsigned char>(text[i])) ||
        std::iscntrl(static_cast<unsigned char>(text[i])))
      return false;
  return true;
}

}  // namespace

std::string expand_rank(const std::string& pattern, int rank) {
  static const std::string kToken = "{rank}";
  const std::string value = std::to_string(rank);
  std::string out;
  size_t start = 0;
  for (size_t guard = 0; guard <= pattern.size(); ++guard) {
    size_t at = pattern.find(kToken, start);
    if (at == std::string::npos) break;
    out.append(pattern, start, at - start);
    out += value;
    start = at + kToken.size();
  }
  out.append(pattern, start, std::string::npos);
  return out;
}

std::string rank_netns_path(const std::string& pattern, int rank) {
  std::string name = expand_rank(pattern, rank);
  if (name.find('/') != std::string::npos) return name;
  return "/run/netns/" + name;
}

const char* launch_usage() {
  return "usage: dynamiq-run -n N [--cpu-nccl] [--timeout S] [--grace S] [--master-addr A]\n"
         "                   [--rank-netns PATTERN] [--rank-env NAME=VALUE]... "
         "-- PROGRAM [ARGS...]\n"
         "  -n, --nproc N   number of local ranks to start (1..1024)\n"
         "  --cpu-nccl      run on the CPU NCCL and the dynamiq net plugin of this build\n"
         "  --timeout S     stop every rank and exit 124 after S seconds\n"
         "  --grace S       seconds between SIGTERM and SIGKILL when stopping ranks (default 5)\n"
         "  --master-addr A MASTER_ADDR of every rank (default 127.0.0.1)\n"
         "  --rank-netns P  start rank r in network namespace P with {rank} replaced by r\n"
         "                  (an `ip netns` name, or a path such as /proc/PID/ns/net)\n"
         "  --rank-env NAME=VALUE  set NAME in each rank, {rank} in VALUE replaced by the\n"
         "                  rank (repeatable; the last one for a NAME wins)\n"
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
    } else if (split.name == "--master-addr") {
      if (!take_value(&value) || !valid_host(value)) {
        *error = "--master-addr needs a host name or address (no spaces)";
        return Status::kInvalidArgument;
      }
      out->master_addr = value;
    } else if (split.name == "--rank-netns") {
      if (!take_value(&value) || *value == '\0') {
        *error = "--rank-netns needs a namespace name or path pattern, e.g. 'bench-{rank}'";
        return Status::kInvalidArgument;
      }
      out->rank_netns = value;
    } else if (split.name == "--rank-env") {
      if (!take_value(&value)) {
        *error = "--rank-env needs NAME=VALUE";
        return Status::kInvalidArgument;
      }
      const char* eq = std::strchr(value, '=');
      std::string name = eq ? std::string(value, eq - value) : std::string(value);
      if (eq == nullptr || !valid_env_name(name)) {
        *error = std::string("bad --rank-env '") + value +
                 "' (expected NAME=VALUE, NAME of letters, digits and _)";
        return Status::kInvalidArgument;
      }
      for (const char* owned : kLauncherOwned) {
        if (name == owned) {
          *error = "--rank-env cannot set " + name + ": the launcher sets it" +
                   (name == "MASTER_ADDR" ? " (use --master-addr)" : "");
          return Status::kInvalidArgument;
        }
      }
      out->rank_env.emplace_back(value);
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
