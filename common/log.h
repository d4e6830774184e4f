// Logging, NCCL-style. Configured through log_configure() by the settings layer
// (config::configure_log, from the settings table config/settings.def), which the entry points
// call before their first line; until then WARN to stderr, every subsystem:
//   DYNAMIQ_DEBUG         NONE | VERSION | WARN (default) | INFO | TRACE (NCCL_DEBUG's levels;
//                         unset, NCCL_DEBUG=INFO or TRACE raises it, never lowers it)
//   DYNAMIQ_DEBUG_SUBSYS  ALL (default), or a comma list of CORE,SHIM,ENGINE,KERNEL,NET,ENV;
//                         a leading ^ selects every subsystem but those listed (NCCL_DEBUG_SUBSYS).
//                         Filters INFO and TRACE lines; warnings are always printed.
//   DYNAMIQ_DEBUG_FILE    a file instead of stderr; %h host, %p pid, %r rank, %% a percent sign
//                         (unset, where NCCL_DEBUG set the level: NCCL_DEBUG_FILE + ".dynamiq").
// Lines, in NCCL's field order (NCCL prints "NCCL" where these print "dynamiq"):
//   host:pid:tid [dev] dynamiq INFO message
//   [2026-05-05 06:16:47] host:pid:tid [dev] file.cc:123 dynamiq WARN message
//   host:pid:tid [dev] dynamiq VERSION message      (DYNAMIQ_DEBUG=VERSION: the banner alone)
// host is the host name up to its first dot, tid the kernel's thread id, dev the CUDA device the
// line concerns (log_set_device / LogDeviceScope), '-' where there is none (a host-memory job).
// The first line of a process at VERSION, INFO or TRACE is the banner: dynamiq's version and git
// revision and the NCCL and CUDA versions it runs on (written by config::configure_log). Each
// line is one write(2): lines of several threads, processes or library copies never interleave
// within a line.
#pragma once

#include <string>
#include <string_view>

namespace dq {

enum class LogLevel : int { kNone = 0, kVersion = 1, kWarn = 2, kInfo = 3, kTrace = 4 };
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

// The process's rank in the first communicator the shim serves, and that communicator's size:
// the rank of log lines. The debug file's name (%r), if it is not open yet, takes the launcher's
// rank (RANK, ...) while the launcher's job covers that communicator, as the metrics file's does
// (a larger communicator means processes started below the launcher, sharing its rank), else this
// rank, else the pid. Per library copy: the net plugin and the CPU NCCL never call it. rank < 0:
// unknown; size < 0: unknown.
void log_set_rank(int rank, int size = -1);

// The process's rank in its job as its launcher set it: RANK (torchrun), OMPI_COMM_WORLD_RANK,
// PMI_RANK or SLURM_PROCID, the first that is a decimal in [0, 2^30); -1 when none is. `size`:
// that launcher's job size (WORLD_SIZE, OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS), -1 unset.
int launcher_rank(int* size = nullptr);

// The CUDA device ([dev]) of this library copy's later lines: the shim sets it to the device of
// the first communicator a CUDA device serves. device < 0: none ('-').
void log_set_device(int device);
// The device of the calling thread's lines while it lives (the communicator a call is on), over
// log_set_device()'s; device < 0 leaves the process-wide one.
class LogDeviceScope {
 public:
  explicit LogDeviceScope(int device);
  ~LogDeviceScope();
  LogDeviceScope(const LogDeviceScope&) = delete;
  LogDeviceScope& operator=(const LogDeviceScope&) = delete;

 private:
  int previous_;
};

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

// With the level at VERSION, INFO or TRACE, the first call in the process writes the banner
// "dynamiq <version> (git <git_revision>), <log_runtime_versions()>" (level VERSION, or INFO at
// INFO and TRACE), whatever the subsystems selected (config::configure_log passes
// config/version.h's values).
void log_version_once(const char* version, const char* git_revision);

// "NCCL 2.28.9, CUDA runtime 12.4, CUDA driver 12.6": the versions this process runs on, from
// ncclGetVersion, cudaRuntimeGetVersion and cuDriverGetVersion of the libraries already loaded
// (none is loaded or initialised here); "not loaded" for a library the process has not loaded.
std::string log_runtime_versions();
// ncclGetVersion of the NCCL loaded in this process (code major*10000 + minor*100 + patch), or
// -1 when none is loaded.
int log_nccl_version_code();
// "2.28.9" for 22809 (and the pre-2.9 code 1000*major + 100*minor + patch).
std::string log_nccl_version_text(int code);

// This thread's last warning (its text, without the line's prefix; "" when none since the last
// clear), whether or not DYNAMIQ_DEBUG let it out: what the shim hands ncclGetLastError after a
// call that failed in dynamiq.
std::string log_last_warning();
void log_clear_last_warning();

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
