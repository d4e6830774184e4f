// Logging: WARN always carries file:line; INFO/TRACE are filtered by subsystem.
// DYNAMIQ_DEBUG=WARN|INFO|TRACE (default WARN), DYNAMIQ_DEBUG_SUBSYS=SHIM,ENGINE,... (default all).
#pragma once

namespace dq {

enum class LogLevel : int { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };
enum class Subsys : unsigned { kCore = 1, kShim = 2, kEngine = 4, kKernel = 8, kNet = 16, kEnv = 32 };

bool log_enabled(LogLevel level, Subsys subsys);
void log_message(LogLevel level, Subsys subsys, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));
// Re-read DYNAMIQ_DEBUG / DYNAMIQ_DEBUG_SUBSYS (tests change them at run time).
void log_reload_from_env();

}  // namespace dq

#define DQ_WARN(subsys, ...) \
  ::dq::log_message(::dq::LogLevel::kWarn, subsys, __FILE__, __LINE__, __VA_ARGS__)
#define DQ_INFO(subsys, ...)                                               \
  do {                                                                     \
    if (::dq::log_enabled(::dq::LogLevel::kInfo, subsys))                  \
      ::dq::log_message(::dq::LogLevel::kInfo, subsys, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
#define DQ_TRACE(subsys, ...)                                              \
  do {                                                                     \
    if (::dq::log_enabled(::dq::LogLevel::kTrace, subsys))                 \
      ::dq::log_message(::dq::LogLevel::kTrace, subsys, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
