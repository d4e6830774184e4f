// Logging, configured from the settings table (config/settings.def) at the first use:
//   DYNAMIQ_DEBUG         NONE | WARN (default) | INFO | TRACE
//   DYNAMIQ_DEBUG_SUBSYS  ALL (default), or a comma list of CORE,SHIM,ENGINE,KERNEL,NET,ENV;
//                         a leading ^ selects every subsystem but those listed (NCCL_DEBUG_SUBSYS).
//                         Filters INFO and TRACE lines; warnings always print, with file:line.
#pragma once

#include <string>
#include <string_view>

namespace dq {

enum class LogLevel : int { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };
enum class Subsys : unsigned {
  kCore = 1,
  kShim = 2,
  kEngine = 4,
  kKernel = 8,
  kNet = 16,
  kEnv = 32
};
constexpr unsigned kAllSubsys = 63;

bool log_enabled(LogLevel level, Subsys subsys);
void log_message(LogLevel level, Subsys subsys, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));

// Re-reads DYNAMIQ_DEBUG and DYNAMIQ_DEBUG_SUBSYS from the environment (tests change them at
// run time).
void log_reload_from_env();

// True the first time this process asks with this key, false afterwards: for reports that must
// appear once per process although the shim, the net plugin and the CPU NCCL each hold a copy of
// this code. The copies agree through the kernel: the first one to bind the abstract Unix socket
// named after the process (pid namespace, pid, start time) and the key wins, and keeps it bound
// until the process ends; a forked child is a new process. Where no such socket can be made
// (a sandbox), each copy answers for itself (then once per library instead of once per process).
bool log_first_in_process(std::string_view key);

// Parsers of the settings table's logging entries (config/settings.cc validates with them).
bool log_parse_level(std::string_view text, LogLevel* out);
bool log_parse_subsys(std::string_view text, unsigned* mask);

// While one exists on a thread, that thread logs nothing (the settings loader: its problems are
// reported once the log is configured, and logging from inside it would recurse).
class LogQuietScope {
 public:
  LogQuietScope();
  ~LogQuietScope();
  LogQuietScope(const LogQuietScope&) = delete;
  LogQuietScope& operator=(const LogQuietScope&) = delete;

 private:
  bool was_;
};

}  // namespace dq

#define DQ_WARN(subsys, ...) \
  ::dq::log_message(::dq::LogLevel::kWarn, subsys, __FILE__, __LINE__, __VA_ARGS__)
#define DQ_INFO(subsys, ...)                                                             \
  do {                                                                                   \
    if (::dq::log_enabled(::dq::LogLevel::kInfo, subsys))                                \
      ::dq::log_message(::dq::LogLevel::kInfo, subsys, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
#define DQ_TRACE(subsys, ...)                                                             \
  do {                                                                                    \
    if (::dq::log_enabled(::dq::LogLevel::kTrace, subsys))                                \
      ::dq::log_message(::dq::LogLevel::kTrace, subsys, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
