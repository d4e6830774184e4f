#include "shim/engine/control_file.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/c_locale.h"
#include "common/log.h"

namespace dq::engine {

bool parse_switch(const char* text, bool* on) {
  std::string t(text);
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  size_t b = 0;
  while (b < t.size() && t[b] == ' ') ++b;
  t = lower_ascii(t.substr(b));
  if (t.empty() || t == "1" || t == "on" || t == "true") return *on = true, true;
  if (t == "0" || t == "off" || t == "false") return *on = false, true;
  return false;
}

bool SwitchFile::read() {
  if (path_.empty()) return true;
  struct stat st;
  if (::stat(path_.c_str(), &st) != 0) {
    // Only a file that is not there means on. Any other failure (a folder on the path the job
    // cannot search, NFS's ESTALE or EIO) says nothing of the switch, which keeps its state, as
    // for a file that cannot be read: an "off" arm of an A/B test must not compress because
    // its file server stalled.
    if (errno != ENOENT && errno != ENOTDIR) {
      const int error = errno;
      if (error != stat_error_)
        DQ_WARN(Subsys::kEngine,
                "dynamiq: DYNAMIQ_CONTROL_FILE %s cannot be examined (%s). Keeping compression "
                "%s.",
                path_.c_str(), std::strerror(error), on_ ? "on" : "off");
      stat_error_ = error;
      stamp_ = Stamp{};  // read again once it can be examined
      return on_;
    }
    stat_error_ = 0;
    stamp_ = Stamp{};
    on_ = true;  // a missing file means on
    return on_;
  }
  stat_error_ = 0;
  const Stamp now{static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                  static_cast<int64_t>(st.st_size), static_cast<uint64_t>(st.st_ino),
                  static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec};
  if (now == stamp_) return on_;
  stamp_ = now;
  char text[64] = {0};
  // A file that is there but cannot be read (its mode, a folder at the path) says nothing: the
  // switch keeps its state, as for a value it cannot parse, rather than read as empty (on).
  bool readable = false;
  if (std::FILE* f = std::fopen(path_.c_str(), "r")) {
    const size_t n = std::fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    readable = std::ferror(f) == 0;
    std::fclose(f);
  }
  if (!readable) {
    DQ_WARN(Subsys::kEngine,
            "dynamiq: DYNAMIQ_CONTROL_FILE %s exists but cannot be read (%s). Keeping "
            "compression %s.",
            path_.c_str(), std::strerror(errno), on_ ? "on" : "off");
    return on_;
  }
  bool on = on_;
  if (!parse_switch(text, &on)) {
    DQ_WARN(Subsys::kEngine,
            "dynamiq: DYNAMIQ_CONTROL_FILE %s holds '%s'; expected 1/on/true or 0/off/false. "
            "Keeping compression %s.",
            path_.c_str(), text, on_ ? "on" : "off");
    return on_;
  }
  if (on != on_)
    DQ_INFO(Subsys::kEngine, "dynamiq: control file switches compression %s", on ? "on" : "off");
  on_ = on;
  return on_;
}

}  // namespace dq::engine
