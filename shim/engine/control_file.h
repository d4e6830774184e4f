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
  // only when it changed (its modification time, size or inode). A file that does not parse keeps
  // the previous state (one warning per change).
  bool read();

 private:
  // What says the file changed. The modification time alone misses a write within the clock
  // tick of its truncation (`echo 0 > file` truncates, then writes; on a kernel with coarse file
  // timestamps both may carry one time): read between the two, the empty text meant on and the
  // write was never read. The size tells them apart, the inode a file replaced by a rename.
  struct Stamp {
    int64_t mtime_ns = -1;  // ns since the epoch; -1: no file
    int64_t size = -1;      // bytes
    uint64_t inode = 0;
    int64_t ctime_ns = -1;  // status change (a chmod too), ns since the epoch
    bool operator==(const Stamp&) const = default;
  };
  std::string path_;
  Stamp stamp_;         // of the text last read
  int stat_error_ = 0;  // the errno of a stat(2) failure said once (0: none)
  bool on_ = true;
};

}  // namespace dq::engine
