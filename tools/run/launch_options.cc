#include "tools/run/launch_options.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "tools/cli/cli.h"

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
         "  -h, --help      print this help\n"
         "  --version       print the version and exit\n"
         "Options take their value as --opt V or --opt=V (-n also as -nV).\n";
}

Status parse_launch_options(int argc, const char* const* argv, LaunchOptions* out,
                            std::string* error) {
  *out = LaunchOptions{};
  // Options take "--opt V", "--opt=V" and, for -n, "-nV". Parsing stops at "--" or at the first
  // argument that is not an option: PROGRAM, whose own arguments are never read as ours.
  CLI::App app;
  cli::configure(&app, "dynamiq-run");
  app.prefix_command();
  CLI::Option* o_ranks = cli::add_value(&app, "-n,--nproc");
  CLI::Option* o_cpu_nccl = cli::add_switch(&app, "--cpu-nccl");
  CLI::Option* o_timeout = cli::add_value(&app, "--timeout");
  CLI::Option* o_grace = cli::add_value(&app, "--grace");
  CLI::Option* o_master = cli::add_value(&app, "--master-addr");
  CLI::Option* o_netns = cli::add_value(&app, "--rank-netns");
  CLI::Option* o_rank_env = cli::add_value(&app, "--rank-env");
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
  // What CLI11 left is the tail of argv: "--" (CLI11 keeps it) and PROGRAM with its arguments,
  // or an option CLI11 does not know, which stopped it.
  std::vector<std::string> rest = app.remaining();
  const int first = argc - static_cast<int>(rest.size());
  bool after_separator = first > 1 && std::strcmp(argv[first - 1], "--") == 0;
  if (!after_separator && !rest.empty() && rest[0] == "--") {
    rest.erase(rest.begin());
    after_separator = true;
  }
  if (!after_separator && !rest.empty() && rest[0].size() > 1 && rest[0][0] == '-') {
    *error = "unknown option '" + rest[0] + "'";
    return Status::kInvalidArgument;
  }
  bool have_ranks = false;
  for (const auto& [option, text] : cli::in_order(app)) {
    const char* value = text.c_str();
    if (option == o_cpu_nccl) {
      out->cpu_nccl = true;
    } else if (option == o_ranks) {
      if (!parse_int(value, 1, kMaxRanks, &out->num_ranks)) {
        *error = std::string("bad number of ranks '") + value + "' (expected 1.." +
                 std::to_string(kMaxRanks) + ")";
        return Status::kInvalidArgument;
      }
      have_ranks = true;
    } else if (option == o_timeout || option == o_grace) {
      const char* name = option == o_timeout ? "--timeout" : "--grace";
      double* target = option == o_timeout ? &out->timeout_s : &out->grace_s;
      if (!parse_seconds(value, target)) {
        *error = std::string("bad ") + name + " value '" + value +
                 "' (expected seconds > 0, at most 86400)";
        return Status::kInvalidArgument;
      }
    } else if (option == o_master) {
      if (!valid_host(value)) {
        *error = "--master-addr needs a host name or address (no spaces)";
        return Status::kInvalidArgument;
      }
      out->master_addr = text;
    } else if (option == o_netns) {
      if (*value == '\0') {
        *error = "--rank-netns needs a namespace name or path pattern, e.g. 'bench-{rank}'";
        return Status::kInvalidArgument;
      }
      out->rank_netns = text;
    } else if (option == o_rank_env) {
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
      out->rank_env.push_back(text);
    }
  }
  if (!have_ranks) {
    *error = "missing -n N (number of ranks)";
    return Status::kInvalidArgument;
  }
  if (rest.empty()) {
    *error = "missing PROGRAM after the options (use: -- PROGRAM ARGS...)";
    return Status::kInvalidArgument;
  }
  out->command = rest;
  if (out->command[0].empty()) {
    *error = "PROGRAM is an empty string";
    return Status::kInvalidArgument;
  }
  return Status::kOk;
}

}  // namespace dq::run
