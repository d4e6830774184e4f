// The multirank tests' failure macros: their rank bodies return an exit code, never throw, and
// their scenario functions return false after one "FAIL: ..." line on stderr.
#pragma once

#include <cstdarg>
#include <cstdio>

// Returns `code` from the enclosing function, after printing "FAIL: <message>", unless `cond`.
#define CHECK_OR(code, cond, ...)                 \
  do {                                            \
    if (!(cond)) {                                \
      std::fprintf(stderr, "FAIL: " __VA_ARGS__); \
      std::fprintf(stderr, "\n");                 \
      return code;                                \
    }                                             \
  } while (0)

namespace dq::test {

// Prints "FAIL: <message>" and returns false, for `return fail(...)` in a scenario.
inline bool fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline bool fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "FAIL: ");
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
  return false;
}

}  // namespace dq::test

// Returns false from the enclosing scenario, after the message, unless `cond`.
#define EXPECT(cond, ...)                              \
  do {                                                 \
    if (!(cond)) return ::dq::test::fail(__VA_ARGS__); \
  } while (0)
