// Logging, NCCL-style. Configured through log_configure() by the settings layer
// (config::configure_log, from the settings table config/settings.def), which the entry points
// call before their first line; until then WARN to stderr, every subsystem:
//   DYNAMIQ_DEBUG         NONE | WARN (default) | INFO | TRACE
//   DYNAMIQ_DEBUG_SUBSYS  ALL (default), or a comma list of CORE,SHIM,ENGINE,KERNEL,NET,ENV;
//                         a leading ^ selects every subsystem but those listed (NCCL_DEBUG_SUBSYS).
//                         Filters INFO and TRACE lines; warnings are always printed.
//   DYNAMIQ_DEBUG_FILE    a file instead of stderr; %h host, %p pid, %r rank, %% a percent sign.
// Lines:
//   [2026-05-05 06:16:47] host:pid:tid [rank] dynamiq WARN SUBSYS file.cc:123 message
//   host:pid:tid [rank] dynamiq INFO SUBSYS message
// host is the host name up to its first dot, tid the kernel's thread id, rank the one given to
// log_set_rank(), else the launcher's RANK / OMPI_COMM_WORLD_RANK / PMI_RANK / SLURM_PROCID,
// else '-'. With DYNAMIQ_DEBUG=INFO the first line of a process gives dynamiq's version and git
// revision: "... dynamiq INFO CORE version 0.1.0 (git 0a62516)", whatever the subsystems (written
// by config::configure_log). Each
// line is one write(2): lines of several threads, processes or library copies never interleave
// within a line.
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

// The rank shown in every later line of this library's log ([rank]) and, if the debug file is
// not open yet, in its name (%r). The shim's engine calls it with the process's rank in the first
// communicator it serves; a process with several communicators keeps that one. Per library copy:
// the net plugin and the CPU NCCL show the launcher's rank (RANK, ...) or '-'. rank < 0: unknown.
void log_set_rank(int rank);

// What the log prints and where: DYNAMIQ_DEBUG, DYNAMIQ_DEBUG_SUBSYS and DYNAMIQ_DEBUG_FILE
// once parsed (the defaults are theirs).
struct LogConfig {
  LogLevel level = LogLevel::kWarn;
  unsigned subsys_mask = kAllSubsys;  // Subsys bits whose INFO and TRACE lines are printed
  std::string file_pattern;           // empty: stderr; else expanded by log_expand_path
};

// Applies `config` to every later line of this library copy; the debug file is (re)opened on the
// next line and the launcher's rank is read again. Callable any number of times (tests change
// the environment at run time: config::reload_log_from_env).
void log_configure(const LogConfig& config);

// The function that configures the log when a line comes before any log_configure() (the
// settings layer installs config::configure_log when its library is loaded, so a line logged
// before an entry point configured the log still follows DYNAMIQ_DEBUG*). Called without any
// lock of the log held; it must call log_configure() and may log. Null: the defaults.
void log_set_configurator(void (*configure)());

// True the first time this process asks with this key, false afterwards: for reports that must
// appear once per process although the shim, the net plugin and the CPU NCCL each hold a copy of
// this code. The copies agree through the kernel: the first one to bind the abstract Unix socket
// named after the process (pid namespace, pid, start time) and the key wins, and keeps it bound
// until the process ends; a forked child is a new process. Where no such socket can be made
// (a sandbox), each copy answers for itself (then once per library instead of once per process).
bool log_first_in_process(std::string_view key);

// With the level at INFO or TRACE, the first call in the process writes
// "version <version> (git <git_revision>)" at INFO, subsystem CORE, whatever the subsystems
// selected (config::configure_log passes config/version.h's values).
void log_version_once(const char* version, const char* git_revision);

// Parsers of the settings table's logging entries (config/settings.cc validates with them).
bool log_parse_level(std::string_view text, LogLevel* out);
bool log_parse_subsys(std::string_view text, unsigned* mask);
// DYNAMIQ_DEBUG_FILE's pattern with %h, %p, %r and %% replaced; other % sequences stay.
std::string log_expand_path(std::string_view pattern, std::string_view host, long pid,
                            std::string_view rank);

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
