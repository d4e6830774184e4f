#include "common/log.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <initializer_list>
#include <mutex>
#include <set>
#include <vector>

#include "common/fnv1a.h"
#include "common/launcher_env.h"
#include "common/safe_file.h"
#include "common/status.h"

namespace dq {
namespace {

// ---- configuration (log_configure) ------------------------------------------------------------

std::atomic<int> g_level{-1};  // -1: not configured yet
std::atomic<unsigned> g_subsys_mask{kAllSubsys};
std::atomic<int> g_rank{-1};                      // log_set_rank()
std::atomic<int> g_rank_size{-1};                 // log_set_rank()
std::atomic<int> g_env_rank{-1};                  // the launcher's, read when configured
std::atomic<int> g_env_size{-1};                  // the launcher's job size, read with it
std::atomic<int> g_device{-1};                    // log_set_device()
thread_local char t_last_warning[1024] = "";      // log_last_warning()
thread_local int t_device = -1;                   // LogDeviceScope; < 0: g_device
std::atomic<void (*)()> g_configurator{nullptr};  // log_set_configurator()

// The output: stderr, or the debug file opened at the first line (g_fd < 0: not open yet).
// Objects with destructors are never destroyed: destructors of other statics may still log.
std::mutex g_out_mutex;
std::string& file_pattern() {  // guarded by g_out_mutex
  static std::string& pattern = *new std::string;
  return pattern;
}
int g_fd = -1;
pid_t g_fd_pid = 0;

struct SubsysName {
  Subsys id;
  const char* name;
};
constexpr SubsysName kSubsysNames[] = {{Subsys::kCore, "CORE"},     {Subsys::kShim, "SHIM"},
                                       {Subsys::kEngine, "ENGINE"}, {Subsys::kKernel, "KERNEL"},
                                       {Subsys::kNet, "NET"},       {Subsys::kEnv, "ENV"}};

// ASCII only: strncasecmp follows the thread's locale, where Turkish's 'I' is not 'i' (a copy of
// this code outside the shim's C-locale guard, in the plugin or the CPU NCCL, read "info" wrong).
bool equal_nocase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

// A launcher's variable: a decimal in [0, 2^30), else -1.
int launcher_number(const char* key) {
  const char* v = std::getenv(key);
  if (v == nullptr || *v < '0' || *v > '9') return -1;
  char* end = nullptr;
  const long r = std::strtol(v, &end, 10);
  return *end == '\0' && r >= 0 && r < (1L << 30) ? static_cast<int>(r) : -1;
}

// The first launcher family whose rank is set: its rank, and its size (-1 where unset).
int rank_from_launcher(int* size = nullptr) {
  for (const LauncherVariables& family : kLauncherVariables) {
    const int r = launcher_number(family.rank);
    if (r < 0) continue;
    if (size != nullptr) *size = launcher_number(family.size);
    return r;
  }
  if (size != nullptr) *size = -1;
  return -1;
}

std::string device_text() {
  int d = t_device;
  if (d < 0) d = g_device.load(std::memory_order_relaxed);
  return d < 0 ? std::string("-") : std::to_string(d);
}

// The debug file's %r, by the metrics file's rule (file_name_rank) over the communicator the shim
// named; "-" (the pid) without a rank.
std::string file_rank_text() {
  const int r = file_name_rank(
      g_env_rank.load(std::memory_order_relaxed), g_env_size.load(std::memory_order_relaxed),
      g_rank.load(std::memory_order_relaxed), g_rank_size.load(std::memory_order_relaxed));
  return r < 0 ? std::string("-") : std::to_string(r);
}

const std::string& host_name() {  // up to the first dot, as NCCL prints it
  static const std::string& name = *new std::string([] {
    char buf[256] = {};
    if (gethostname(buf, sizeof buf - 1) != 0) return std::string("unknown");
    std::string h(buf);
    const size_t dot = h.find('.');
    return dot == std::string::npos ? h : h.substr(0, dot);
  }());
  return name;
}

void apply(const LogConfig& config) {
  {
    std::lock_guard<std::mutex> out(g_out_mutex);
    if (g_fd > 2) close(g_fd);
    g_fd = -1;
    file_pattern() = config.file_pattern;
  }
  int env_size = -1;
  g_env_rank.store(rank_from_launcher(&env_size), std::memory_order_relaxed);
  g_env_size.store(env_size, std::memory_order_relaxed);
  g_subsys_mask.store(config.subsys_mask, std::memory_order_relaxed);
  g_level.store(static_cast<int>(config.level), std::memory_order_release);
}

// ---- output -----------------------------------------------------------------------------------

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    data += n;
    size -= static_cast<size_t>(n);
  }
}

std::string format_line(LogLevel level, Subsys subsys, const char* file, int line,
                        const char* body);

// The descriptor lines go to; g_out_mutex held. Opens the debug file on the first line (and again
// in a forked child when the name holds %p): truncated by the first opener in the process, the
// other library copies append. A file that cannot be opened: one warning, then stderr.
int output_fd() {
  if (file_pattern().empty()) return STDERR_FILENO;
  const pid_t pid = getpid();
  if (g_fd >= 0 && (g_fd_pid == pid || file_pattern().find("%p") == std::string::npos)) return g_fd;
  if (g_fd > 2) close(g_fd);
  const std::string path = log_expand_path(file_pattern(), host_name(), pid, file_rank_text());
  // Never through a symbolic link placed at the name (a shared /tmp): common/safe_file.h.
  const bool trunc = log_first_in_process("debug-file:" + path);
  std::string failure;
  g_fd = open_output_nofollow(path, trunc, /*append=*/true, &failure);
  g_fd_pid = pid;
  if (g_fd < 0) {
    const std::string why = "cannot open the debug file " + path +
                            " (DYNAMIQ_DEBUG_FILE, or NCCL_DEBUG_FILE's name " +
                            "and .dynamiq): " + failure + "; logging to stderr";
    const std::string msg =
        format_line(LogLevel::kWarn, Subsys::kEnv, __FILE__, __LINE__, why.c_str());
    write_all(STDERR_FILENO, msg.data(), msg.size());
    file_pattern().clear();
    return STDERR_FILENO;
  }
  return g_fd;
}

std::string format_line(LogLevel level, Subsys, const char* file, int line, const char* body) {
  char prefix[256];
  size_t n = 0;
  if (level == LogLevel::kWarn) {
    const time_t now = time(nullptr);
    struct tm tm_now;
    localtime_r(&now, &tm_now);
    n = strftime(prefix, sizeof prefix, "[%Y-%m-%d %H:%M:%S] ", &tm_now);
  }
  const char* level_name = level == LogLevel::kWarn      ? "WARN"
                           : level == LogLevel::kInfo    ? "INFO"
                           : level == LogLevel::kVersion ? "VERSION"
                                                         : "TRACE";
  // NCCL's order: host:pid:tid [dev], then file:line on a warning, then the library and level.
  std::string where;
  if (level == LogLevel::kWarn) {
    const char* base = std::strrchr(file, '/');
    where = std::string(base ? base + 1 : file) + ":" + std::to_string(line) + " ";
  }
  const int more =
      std::snprintf(prefix + n, sizeof prefix - n, "%s:%d:%d [%s] %sdynamiq %s ",
                    host_name().c_str(), static_cast<int>(getpid()), static_cast<int>(gettid()),
                    device_text().c_str(), where.c_str(), level_name);
  n = std::min(n + static_cast<size_t>(std::max(more, 0)), sizeof prefix - 1);
  std::string text(prefix, n);
  text += body;
  text += '\n';
  return text;
}

void emit(LogLevel level, Subsys subsys, const char* file, int line, const char* body) {
  const std::string text = format_line(level, subsys, file, line, body);
  std::lock_guard<std::mutex> lock(g_out_mutex);
  write_all(output_fd(), text.data(), text.size());
}

// A line before any log_configure(): the installed configurator configures the log (and may
// report through it), else the defaults apply.
void ensure_configured() {
  if (void (*configure)() = g_configurator.load(std::memory_order_acquire)) configure();
  if (g_level.load(std::memory_order_acquire) < 0) apply(LogConfig{});
}

// ---- once per process -------------------------------------------------------------------------

// "pidns.pid.starttime": names this process among every process the kernel runs, whichever
// pid namespace it is in, even after its pid is reused.
std::string process_identity() {
  struct stat ns {};
  const unsigned long long pidns = stat("/proc/self/ns/pid", &ns) == 0 ? ns.st_ino : 0;
  unsigned long long start = 0;
  if (FILE* f = std::fopen("/proc/self/stat", "r")) {
    char buf[1024];
    const size_t got = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    buf[got] = '\0';
    // After the command name's closing parenthesis: field 3 (state) onwards; 22 is starttime.
    if (const char* p = std::strrchr(buf, ')')) {
      ++p;
      for (int field = 3; field < 22 && *p; ++field) {
        while (*p == ' ') ++p;
        while (*p && *p != ' ') ++p;
      }
      start = std::strtoull(p, nullptr, 10);
    }
  }
  return std::to_string(pidns) + "." + std::to_string(getpid()) + "." + std::to_string(start);
}

// Binds the abstract socket "dynamiq.<process identity>.<hash of key>". true: bound (first in
// the process; the descriptor stays open until the process ends) or no socket can be made
// here; false: another copy bound it first.
bool claim(std::string_view key) {
  const uint64_t h = fnv1a64(key);
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(h));
  const std::string name = "dynamiq." + process_identity() + "." + hash;
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const size_t len = std::min(name.size(), sizeof addr.sun_path - 1);
  std::memcpy(addr.sun_path + 1, name.data(), len);  // sun_path[0] = 0: abstract, no file
  const auto addr_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + len);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), addr_len) == 0) return true;
  const int err = errno;
  close(fd);
  return err != EADDRINUSE;
}

}  // namespace

int launcher_rank(int* size) {
  return rank_from_launcher(size);
}

bool log_first_in_process(std::string_view key) {
  static std::mutex mutex;
  static auto& seen = *new std::set<std::string, std::less<>>;  // this copy's keys, this pid
  static pid_t seen_pid = 0;
  static int sockets = 0;
  std::lock_guard<std::mutex> lock(mutex);
  const pid_t pid = getpid();
  if (pid != seen_pid) {  // a forked child starts afresh
    seen.clear();
    seen_pid = pid;
    sockets = 0;
  }
  if (!seen.emplace(key).second) return false;
  // Bounded: past 64 keys (tests that change the environment again and again) this copy
  // answers for itself.
  if (++sockets > 64) return true;
  return claim(key);
}

bool log_parse_level(std::string_view text, LogLevel* out) {
  static constexpr std::pair<const char*, LogLevel> kLevels[] = {{"NONE", LogLevel::kNone},
                                                                 {"VERSION", LogLevel::kVersion},
                                                                 {"WARN", LogLevel::kWarn},
                                                                 {"INFO", LogLevel::kInfo},
                                                                 {"TRACE", LogLevel::kTrace}};
  for (const auto& [name, level] : kLevels)
    if (equal_nocase(text, name)) return *out = level, true;
  return false;
}

bool log_parse_subsys(std::string_view text, unsigned* mask) {
  const bool invert = !text.empty() && text.front() == '^';
  if (invert) text.remove_prefix(1);
  unsigned listed = 0;
  while (true) {  // one term per comma
    const size_t comma = text.find(',');
    const std::string_view term = text.substr(0, comma);
    if (equal_nocase(term, "ALL")) {
      listed = kAllSubsys;
    } else if (!term.empty()) {
      bool known = false;
      for (const auto& n : kSubsysNames)
        if (equal_nocase(term, n.name)) listed |= static_cast<unsigned>(n.id), known = true;
      if (!known) return false;
    }
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  *mask = invert ? kAllSubsys & ~listed : listed;
  return true;
}

std::string log_expand_path(std::string_view pattern, std::string_view host, long pid,
                            std::string_view rank) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '%' || i + 1 == pattern.size()) {
      out += pattern[i];
      continue;
    }
    switch (pattern[i + 1]) {
      case 'h':
        out += host;
        break;
      case 'p':
        out += std::to_string(pid);
        break;
      case 'r':
        out += rank == "-" ? std::to_string(pid) : std::string(rank);
        break;
      case '%':
        out += '%';
        break;
      default:
        out += pattern[i];
        out += pattern[i + 1];
        break;
    }
    ++i;
  }
  return out;
}

void log_set_rank(int rank, int size) {
  g_rank_size.store(rank < 0 || size < 0 ? -1 : size, std::memory_order_relaxed);
  g_rank.store(rank < 0 ? -1 : rank, std::memory_order_relaxed);
}

void log_configure(const LogConfig& config) {
  apply(config);
}

void log_set_device(int device) {
  g_device.store(device < 0 ? -1 : device, std::memory_order_relaxed);
}

LogDeviceScope::LogDeviceScope(int device) : previous_(t_device) {
  if (device >= 0) t_device = device;
}

LogDeviceScope::~LogDeviceScope() {
  t_device = previous_;
}

namespace {

// A function of a library this process already loaded: the global scope first, then the
// libraries named (RTLD_NOLOAD: found only when loaded, even privately by a Python extension).
void* loaded_symbol(const char* name, std::initializer_list<const char*> libraries) {
  if (void* f = dlsym(RTLD_DEFAULT, name)) return f;
  for (const char* lib : libraries) {
    void* handle = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD);
    if (handle == nullptr) continue;
    void* f = dlsym(handle, name);
    dlclose(handle);  // drops the reference NOLOAD took; the library stays loaded
    if (f != nullptr) return f;
  }
  return nullptr;
}

// CUDA's version code 12040 as "12.4".
std::string cuda_version_text(int code) {
  return std::to_string(code / 1000) + "." + std::to_string(code % 1000 / 10);
}

}  // namespace

int log_nccl_version_code() {
  using GetVersion = int (*)(int*);  // ncclResult_t is an int-sized enum; 0 is ncclSuccess
  const auto get = reinterpret_cast<GetVersion>(loaded_symbol("ncclGetVersion", {"libnccl.so.2"}));
  int code = -1;
  if (get == nullptr || get(&code) != 0) return -1;
  return code;
}

std::string log_nccl_version_text(int code) {
  if (code < 0) return "unknown";
  // NCCL_VERSION_CODE: major*1000 + minor*100 + patch before 2.9, major*10000 + minor*100 + patch
  // from 2.9 on.
  const bool old = code < 20900;
  const int major = old ? code / 1000 : code / 10000;
  const int minor = old ? code % 1000 / 100 : code % 10000 / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

std::string log_runtime_versions() {
  const int nccl = log_nccl_version_code();
  std::string out = "NCCL " + (nccl < 0 ? std::string("not loaded") : log_nccl_version_text(nccl));
  using GetVersion = int (*)(int*);  // cudaError_t / CUresult: 0 is success
  const auto runtime = reinterpret_cast<GetVersion>(loaded_symbol(
      "cudaRuntimeGetVersion", {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"}));
  const auto driver =
      reinterpret_cast<GetVersion>(loaded_symbol("cuDriverGetVersion", {"libcuda.so.1"}));
  int code = 0;
  out += ", CUDA runtime ";
  out += runtime != nullptr && runtime(&code) == 0 ? cuda_version_text(code) : "not loaded";
  out += ", CUDA driver ";
  out += driver != nullptr && driver(&code) == 0 ? cuda_version_text(code) : "not loaded";
  return out;
}

void log_version_once(const char* version, const char* git_revision) {
  if (g_level.load(std::memory_order_acquire) < 0) ensure_configured();
  const int level = g_level.load(std::memory_order_acquire);
  if ((level != static_cast<int>(LogLevel::kVersion) &&
       level < static_cast<int>(LogLevel::kInfo)) ||
      !log_first_in_process("version"))
    return;
  const std::string text =
      std::string("dynamiq ") + version + " (git " + git_revision + "), " + log_runtime_versions();
  emit(level == static_cast<int>(LogLevel::kVersion) ? LogLevel::kVersion : LogLevel::kInfo,
       Subsys::kCore, __FILE__, __LINE__, text.c_str());
}

void log_set_configurator(void (*configure)()) {
  g_configurator.store(configure, std::memory_order_release);
}

bool log_enabled(LogLevel level, Subsys subsys) {
  int current = g_level.load(std::memory_order_acquire);
  if (current < 0) {
    ensure_configured();
    current = g_level.load(std::memory_order_acquire);
  }
  if (static_cast<int>(level) > current) return false;
  if (level == LogLevel::kWarn) return true;
  return (g_subsys_mask.load(std::memory_order_relaxed) & static_cast<unsigned>(subsys)) != 0;
}

void log_message(LogLevel level, Subsys subsys, const char* file, int line, const char* fmt, ...) {
  const bool warning = level == LogLevel::kWarn;
  if (!warning && !log_enabled(level, subsys)) return;
  char body[sizeof t_last_warning];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(body, sizeof body, fmt, ap);
  va_end(ap);
  if (warning) std::memcpy(t_last_warning, body, sizeof body);
  if (warning && !log_enabled(level, subsys)) return;
  emit(level, subsys, file, line, body);
}

std::string log_last_warning() {
  return t_last_warning;
}

void log_clear_last_warning() {
  t_last_warning[0] = '\0';
}

const char* status_name(Status s) {
  switch (s) {
    case Status::kOk:
      return "ok";
    case Status::kInvalidArgument:
      return "invalid argument";
    case Status::kMalformedPayload:
      return "malformed payload";
    case Status::kOutOfMemory:
      return "out of memory";
    case Status::kSystemError:
      return "system error";
    case Status::kTimeout:
      return "timeout";
    case Status::kInternal:
      return "internal error";
    case Status::kUnsupported:
      return "unsupported";
  }
  return "unknown status";
}

}  // namespace dq
