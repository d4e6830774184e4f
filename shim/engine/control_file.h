// The A/B switch file (DYNAMIQ_CONTROL_FILE): rank 0 reads it at every eligible call, and every
// rank applies its state one eligible call later (docs/ENGINE.md section 3).
#pragma once
#include <cstdint>
#include <string>
#include <utility>

namespace dq::engine {

// Parses the file's text: 1/on/true (or empty) is on, 0/off/false is off, case-insensitive,
// surrounding spaces and line ends ignored. False when the text is none of those.
bool parse_switch(const char* text, bool* on);

class SwitchFile {
 public:
  explicit SwitchFile(std::string path) : path_(std::move(path)) {}
  // The switch now: on when no file is configured or the file is missing; the file is read again
  // only when its modification time changed. A file that does not parse keeps the previous state
  // (one warning per change).
  bool read();

 private:
  std::string path_;
  int64_t mtime_ns_ = -1;  // modification time of the text last read, ns since the epoch
  bool on_ = true;
};

}  // namespace dq::engine
