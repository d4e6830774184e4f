// Plugin logging: through NCCL's logger when init() gave us one, else through DQ_WARN/DQ_INFO.
#pragma once

#include "common/log.h"
#include "plugin/net_abi.h"

namespace dq::net {

// Remembers the logger of the latest init() that passed one (NULL clears it).
void set_net_logger(dqNetLogger logger);
dqNetLogger get_net_logger();

void net_log(LogLevel level, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));

}  // namespace dq::net

#define NET_WARN(...) ::dq::net::net_log(::dq::LogLevel::kWarn, __FILE__, __LINE__, __VA_ARGS__)
#define NET_INFO(...) ::dq::net::net_log(::dq::LogLevel::kInfo, __FILE__, __LINE__, __VA_ARGS__)
