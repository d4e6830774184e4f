// ScopedContext (shim/engine/scoped_context.h), which the real CUDA device runs every call under:
// the thread's own context comes back exactly, including none, and a thread is never left on a
// context it did not have. On a fake driver that records each thread's current context.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shim/engine/scoped_context.h"

namespace dq::engine {
namespace {

// The driver's per-thread current context (0: none), and every call made.
struct FakeDriver {
  int current = 0;
  bool fail_get = false, fail_set = false;
  std::vector<std::string> calls;
};
FakeDriver* g_driver = nullptr;

struct FakeOps {
  using Context = int;
  bool current(Context* out) const {
    g_driver->calls.push_back("get");
    if (g_driver->fail_get) return false;
    *out = g_driver->current;
    return true;
  }
  bool set_current(Context c) const {
    g_driver->calls.push_back("set " + std::to_string(c));
    if (g_driver->fail_set) return false;
    g_driver->current = c;
    return true;
  }
};
using Scope = ScopedContext<FakeOps>;

class ScopedContextTest : public ::testing::Test {
 protected:
  void SetUp() override { g_driver = &driver; }
  void TearDown() override { g_driver = nullptr; }
  FakeDriver driver;
};

TEST_F(ScopedContextTest, AThreadWithNoContextGetsNoneBack) {
  {
    Scope on(7);
    EXPECT_EQ(driver.current, 7);
  }
  // Not device 0's context, nor the target's: the thread had none.
  EXPECT_EQ(driver.current, 0);
  EXPECT_EQ(driver.calls, (std::vector<std::string>{"get", "set 7", "set 0"}));
}

TEST_F(ScopedContextTest, AnotherContextComesBackExactly) {
  driver.current = 3;
  {
    Scope on(7);
    EXPECT_EQ(driver.current, 7);
    {
      Scope nested(7);  // already current: no calls beyond the query
      EXPECT_EQ(driver.current, 7);
    }
    EXPECT_EQ(driver.current, 7);
  }
  EXPECT_EQ(driver.current, 3);
  EXPECT_EQ(driver.calls, (std::vector<std::string>{"get", "set 7", "get", "set 3"}));
}

TEST_F(ScopedContextTest, TheTargetAlreadyCurrentIsLeftAlone) {
  driver.current = 7;
  { Scope on(7); }
  EXPECT_EQ(driver.current, 7);
  EXPECT_EQ(driver.calls, (std::vector<std::string>{"get"}));
}

TEST_F(ScopedContextTest, FailedCallsChangeNothing) {
  driver.current = 3;
  driver.fail_get = true;
  { Scope on(7); }  // the thread's context unknown: not switched, so nothing to restore
  EXPECT_EQ(driver.current, 3);
  driver.fail_get = false;
  driver.fail_set = true;
  { Scope on(7); }  // the switch failed: no restore either
  EXPECT_EQ(driver.current, 3);
  EXPECT_EQ(driver.calls, (std::vector<std::string>{"get", "get", "set 7"}));
  driver.calls.clear();
  driver.fail_set = false;
  { Scope on(0); }  // no target (the device has no primary context): nothing at all
  EXPECT_TRUE(driver.calls.empty());
}

}  // namespace
}  // namespace dq::engine
