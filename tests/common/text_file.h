// Whole files for the tests: read at once, written at once, and how often a string occurs in a
// text (a log line, a metrics field).
#pragma once

#include <fstream>
#include <sstream>
#include <string>

namespace dq::test {

// The file's bytes; empty when it cannot be opened.
inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Replaces the file's content with `text`.
inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Occurrences of `what` in `text`, overlapping ones included.
inline int count_occurrences(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

}  // namespace dq::test
