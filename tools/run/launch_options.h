// Command line of dynamiq-run:
//   dynamiq-run -n N [--cpu-nccl] [--timeout S] [--grace S] [--master-addr A]
//               [--rank-netns PATTERN] [--rank-env NAME=VALUE]... -- PROGRAM ARGS...
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace dq::run {

struct LaunchOptions {
  int num_ranks = 0;
  bool cpu_nccl = false;
  bool show_help = false;
  bool show_version = false;  // --version
  double timeout_s = 0;       // wall-clock limit of the whole job in seconds; 0 = none
  double grace_s = 5;         // seconds between SIGTERM and SIGKILL when the job is stopped
  std::string master_addr = "127.0.0.1";  // MASTER_ADDR given to every rank
  // Network namespace of each rank: "{rank}" replaced by the rank; a name without '/' is an
  // `ip netns` name (/run/netns/NAME), else a path such as /proc/PID/ns/net. Empty: stay here.
  std::string rank_netns;
  // NAME=VALUE entries set in each rank's environment after everything else, "{rank}" in VALUE
  // replaced by the rank (e.g. DYNAMIQ_NET_IFNAME=veth{rank}).
  std::vector<std::string> rank_env;
  std::vector<std::string> command;  // PROGRAM followed by its arguments
};

inline constexpr int kMaxRanks = 1024;

// Parses argv (argv[0] is the launcher). On kInvalidArgument, *error says what was wrong.
Status parse_launch_options(int argc, const char* const* argv, LaunchOptions* out,
                            std::string* error);

const char* launch_usage();

// `pattern` with every "{rank}" replaced by the decimal rank.
std::string expand_rank(const std::string& pattern, int rank);

// The network namespace file of `rank` for a --rank-netns pattern (see LaunchOptions).
std::string rank_netns_path(const std::string& pattern, int rank);

}  // namespace dq::run
