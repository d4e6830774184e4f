#include "plugin/net_log.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>

namespace dq::net {
namespace {
std::atomic<dqNetLogger> g_logger{nullptr};
}  // namespace

void set_net_logger(dqNetLogger logger) {
  g_logger.store(logger);
}
dqNetLogger get_net_logger() {
  return g_logger.load();
}

void net_log(LogLevel level, const char* file, int line, const char* fmt, ...) {
  dqNetLogger logger = g_logger.load();
  if (level != LogLevel::kWarn && logger == nullptr && !log_enabled(level, Subsys::kNet)) return;
  char text[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(text, sizeof(text), fmt, args);
  va_end(args);
  if (logger != nullptr) {
    dqNetLogLevel nccl_level = level == LogLevel::kWarn   ? dqNetLogWarn
                               : level == LogLevel::kInfo ? dqNetLogInfo
                                                          : dqNetLogTrace;
    logger(nccl_level, DQNET_LOGSUB_NET, file, line, "NET/dynamiq : %s", text);
    return;
  }
  log_message(level, Subsys::kNet, file, line, "%s", text);
}

}  // namespace dq::net
