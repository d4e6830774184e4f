// Command-line pieces dynamiq-sim and dynamiq-predict share: comma lists and the usage error.
#pragma once
#include <cstdio>
#include <string>
#include <vector>

namespace dq::sim {

// "a,b,,c" -> {"a", "b", "c"}: empty items are dropped.
inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> items;
  size_t from = 0;
  while (from <= s.size()) {
    size_t comma = s.find(',', from);
    if (comma == std::string::npos) comma = s.size();
    if (comma > from) items.push_back(s.substr(from, comma - from));
    from = comma + 1;
  }
  return items;
}

// Prints "<tool>: <what>" and the usage text on stderr; returns 2, the tools' usage exit code.
inline int usage_error(const char* tool, const std::string& what, const char* usage) {
  std::fprintf(stderr, "%s: %s\n%s", tool, what.c_str(), usage);
  return 2;
}

}  // namespace dq::sim
