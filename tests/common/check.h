// The multirank tests' one failure macro: their rank bodies return an exit code, never throw.
#pragma once

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
