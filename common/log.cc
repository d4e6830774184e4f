#include "common/log.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unistd.h>

#include "common/status.h"

namespace dq {
namespace {

std::atomic<int> g_level{-1};         // -1: not read from the environment yet
std::atomic<unsigned> g_subsys_mask{~0u};
std::mutex g_write_mutex;             // one line at a time on stderr

struct SubsysName {
  Subsys id;
  const char* name;
};
constexpr SubsysName kSubsysNames[] = {{Subsys::kCore, "CORE"},     {Subsys::kShim, "SHIM"},
                                       {Subsys::kEngine, "ENGINE"}, {Subsys::kKernel, "KERNEL"},
                                       {Subsys::kNet, "NET"},       {Subsys::kEnv, "ENV"}};

const char* subsys_name(Subsys s) {
  for (const auto& n : kSubsysNames)
    if (n.id == s) return n.name;
  return "?";
}

void read_env() {
  int level = static_cast<int>(LogLevel::kWarn);
  if (const char* v = std::getenv("DYNAMIQ_DEBUG")) {
    if (!strcasecmp(v, "NONE")) level = static_cast<int>(LogLevel::kNone);
    else if (!strcasecmp(v, "INFO")) level = static_cast<int>(LogLevel::kInfo);
    else if (!strcasecmp(v, "TRACE")) level = static_cast<int>(LogLevel::kTrace);
  }
  unsigned mask = ~0u;
  if (const char* v = std::getenv("DYNAMIQ_DEBUG_SUBSYS"); v && *v) {
    mask = static_cast<unsigned>(Subsys::kCore);  // CORE warnings are never filtered out
    for (const auto& n : kSubsysNames)
      if (strcasestr(v, n.name)) mask |= static_cast<unsigned>(n.id);
  }
  g_subsys_mask.store(mask, std::memory_order_relaxed);
  g_level.store(level, std::memory_order_release);
}

}  // namespace

void log_reload_from_env() { read_env(); }

bool log_enabled(LogLevel level, Subsys subsys) {
  int current = g_level.load(std::memory_order_acquire);
  if (current < 0) {
    read_env();
    current = g_level.load(std::memory_order_acquire);
  }
  if (static_cast<int>(level) > current) return false;
  if (level == LogLevel::kWarn) return true;
  return (g_subsys_mask.load(std::memory_order_relaxed) & static_cast<unsigned>(subsys)) != 0;
}

void log_message(LogLevel level, Subsys subsys, const char* file, int line, const char* fmt, ...) {
  if (!log_enabled(level, subsys)) return;
  char body[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(body, sizeof body, fmt, ap);
  va_end(ap);
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  std::lock_guard<std::mutex> lock(g_write_mutex);
  if (level == LogLevel::kWarn)
    std::fprintf(stderr, "dynamiq %d WARN %s %s:%d %s\n", static_cast<int>(getpid()),
                 subsys_name(subsys), base, line, body);
  else
    std::fprintf(stderr, "dynamiq %d %s %s %s\n", static_cast<int>(getpid()),
                 level == LogLevel::kInfo ? "INFO" : "TRACE", subsys_name(subsys), body);
}

const char* status_name(Status s) {
  switch (s) {
    case Status::kOk: return "ok";
    case Status::kInvalidArgument: return "invalid argument";
    case Status::kMalformedPayload: return "malformed payload";
    case Status::kOutOfMemory: return "out of memory";
    case Status::kSystemError: return "system error";
    case Status::kTimeout: return "timeout";
    case Status::kInternal: return "internal error";
    case Status::kUnsupported: return "unsupported";
  }
  return "unknown status";
}

}  // namespace dq
