// Test harness: loads libnccl-net-dynamiq.so the way NCCL does (dlopen + dlsym) and offers
// helpers to connect a pair of comms and to drive requests to completion with a deadline.
#pragma once

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "plugin/net_abi.h"

namespace dq::net::testing {

using Clock = std::chrono::steady_clock;

struct PluginLib {
  void* lib = nullptr;
  const dqNetV11* v11 = nullptr;
  const dqNetV10* v10 = nullptr;
  const dqNetV9* v9 = nullptr;
  const dqNetV8* v8 = nullptr;
  std::string error;

  static PluginLib& get() {
    static PluginLib* p = [] {
      auto* pl = new PluginLib;
      const char* path = std::getenv("DYNAMIQ_NET_PLUGIN_PATH");
      pl->lib = dlopen(path != nullptr ? path : "libnccl-net-dynamiq.so", RTLD_NOW | RTLD_LOCAL);
      if (pl->lib == nullptr) {
        pl->error = dlerror();
        return pl;
      }
      pl->v11 = static_cast<const dqNetV11*>(dlsym(pl->lib, "ncclNetPlugin_v11"));
      pl->v10 = static_cast<const dqNetV10*>(dlsym(pl->lib, "ncclNetPlugin_v10"));
      pl->v9 = static_cast<const dqNetV9*>(dlsym(pl->lib, "ncclNetPlugin_v9"));
      pl->v8 = static_cast<const dqNetV8*>(dlsym(pl->lib, "ncclNetPlugin_v8"));
      return pl;
    }();
    return *p;
  }
};

// Captures what the plugin sends through NCCL's logger.
struct LogCapture {
  static std::mutex& mu() {
    static std::mutex mu;
    return mu;
  }
  static std::vector<std::string>& warnings() {
    static std::vector<std::string> w;
    return w;
  }
  static void logger(dqNetLogLevel level, unsigned long /*flags*/, const char* /*file*/,
                     int /*line*/, const char* fmt, ...) {
    char buf[2048];
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    std::lock_guard<std::mutex> lock(mu());
    if (level == dqNetLogWarn) warnings().push_back(buf);
    if (level == dqNetLogInfo) infos().push_back(buf);
  }
  static std::vector<std::string>& infos() {
    static std::vector<std::string> i;
    return i;
  }
  // INFO lines containing a, and b ("" matches any).
  static int count_info(const std::string& a, const std::string& b) {
    std::lock_guard<std::mutex> lock(mu());
    int n = 0;
    for (const auto& i : infos()) {
      n += i.find(a) != std::string::npos && i.find(b) != std::string::npos;
    }
    return n;
  }
  static bool contains(const std::string& a, const std::string& b) {
    std::lock_guard<std::mutex> lock(mu());
    for (const auto& w : warnings()) {
      if (w.find(a) != std::string::npos && w.find(b) != std::string::npos) return true;
    }
    return false;
  }
  static void clear() {
    std::lock_guard<std::mutex> lock(mu());
    warnings().clear();
    infos().clear();
  }
};

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Drives connect/accept until both comms exist (NCCL's non-blocking contract).
inline bool connect_pair(const dqNetV11* net, void* ctx, void* listen_comm, char* handle,
                         void** send_comm, void** recv_comm, double limit_s = 10) {
  *send_comm = nullptr;
  *recv_comm = nullptr;
  Clock::time_point start = Clock::now();
  while ((*send_comm == nullptr || *recv_comm == nullptr) && seconds_since(start) < limit_s) {
    dqNetDeviceHandle* dh = nullptr;
    if (*send_comm == nullptr && net->connect(ctx, 0, handle, send_comm, &dh) != dqNetSuccess) {
      return false;
    }
    if (*recv_comm == nullptr && net->accept(listen_comm, recv_comm, &dh) != dqNetSuccess) {
      return false;
    }
    if (*send_comm == nullptr || *recv_comm == nullptr) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  return *send_comm != nullptr && *recv_comm != nullptr;
}

// Polls accept() until a receive comm exists (NCCL's non-blocking contract); nullptr when
// accept fails or limit_s passes first.
inline void* accept_within(const dqNetV11* net, void* listen_comm, double limit_s = 10) {
  void* recv_comm = nullptr;
  Clock::time_point start = Clock::now();
  while (recv_comm == nullptr && seconds_since(start) < limit_s) {
    if (net->accept(listen_comm, &recv_comm, nullptr) != dqNetSuccess) return nullptr;
    if (recv_comm == nullptr) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return recv_comm;
}

// Polls test() until done or error; returns the result; *done tells which.
inline dqNetResult wait_request(const dqNetV11* net, void* request, int* sizes, int* done,
                                double limit_s = 60) {
  Clock::time_point start = Clock::now();
  *done = 0;
  while (seconds_since(start) < limit_s) {
    dqNetResult r = net->test(request, done, sizes);
    if (r != dqNetSuccess || *done) return r;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return dqNetSuccess;  // *done == 0: timed out
}

// memcmp that accepts empty (possibly NULL) ranges.
inline bool same_bytes(const void* a, const void* b, size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}

// Byte pattern that depends on a seed and the position (catches swaps and shifts).
inline void fill(std::vector<char>& buf, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < buf.size(); ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    buf[i] = static_cast<char>(x);
  }
}

}  // namespace dq::net::testing
