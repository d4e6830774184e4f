// The guard at every extern "C" boundary (common/abi_guard.h): what is thrown becomes the result
// the caller gets, and a thread cancelled inside a guarded call still unwinds.
#include "common/abi_guard.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include <new>
#include <stdexcept>
#include <string>

namespace dq {
namespace {

TEST(AbiGuard, WhatIsThrownBecomesAResult) {
  AbiFault seen = AbiFault::kUnknown;
  std::string what;
  auto on_fault = [&](AbiFault f, const char* w) {
    seen = f;
    what = w;
    return -1;
  };
  EXPECT_EQ(abi_guard([] { return 7; }, on_fault), 7);
  EXPECT_EQ(abi_guard([]() -> int { throw std::bad_alloc(); }, on_fault), -1);
  EXPECT_EQ(seen, AbiFault::kOutOfMemory);
  EXPECT_EQ(abi_guard([]() -> int { throw std::runtime_error("bad peer"); }, on_fault), -1);
  EXPECT_EQ(seen, AbiFault::kException);
  EXPECT_EQ(what, "bad peer");
  EXPECT_EQ(abi_guard([]() -> int { throw 3; }, on_fault), -1);
  EXPECT_EQ(seen, AbiFault::kUnknown);
  EXPECT_EQ(abi_guard([]() -> int { throw 3; }, 5), 5);  // a plain error value
}

// pthread_cancel of a thread blocked in a guarded call (a wait on a peer in the shim or the
// plugin) unwinds it with a forced unwind, which must pass through the guard: one caught and not
// rethrown aborts the process. In a child, so that an abort fails this test only.
TEST(AbiGuard, ACancelledThreadUnwindsThroughIt) {
  const pid_t child = fork();
  if (child == 0) {
    pthread_t t;
    auto body = [](void*) -> void* {
      const int r = abi_guard(
          [] {
            for (int i = 0; i < 1000; ++i) usleep(10000);  // a cancellation point, at most 10 s
            return 0;
          },
          -1);
      return reinterpret_cast<void*>(static_cast<intptr_t>(r));
    };
    if (pthread_create(&t, nullptr, body, nullptr) != 0) _exit(2);
    usleep(50000);
    pthread_cancel(t);
    void* result = nullptr;
    pthread_join(t, &result);
    _exit(result == PTHREAD_CANCELED ? 0 : 3);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

}  // namespace
}  // namespace dq
