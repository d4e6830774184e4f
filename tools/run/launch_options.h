// Command line of dynamiq-run: `dynamiq-run -n N [--cpu-nccl] [--timeout S] -- PROGRAM ARGS...`.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace dq::run {

struct LaunchOptions {
  int num_ranks = 0;
  bool cpu_nccl = false;
  bool show_help = false;
  double timeout_s = 0;              // wall-clock limit of the whole job in seconds; 0 = none
  double grace_s = 5;                // seconds between SIGTERM and SIGKILL when the job is stopped
  std::vector<std::string> command;  // PROGRAM followed by its arguments
};

inline constexpr int kMaxRanks = 1024;

// Parses argv (argv[0] is the launcher). On kInvalidArgument, *error says what was wrong.
Status parse_launch_options(int argc, const char* const* argv, LaunchOptions* out,
                            std::string* error);

const char* launch_usage();

}  // namespace dq::run
