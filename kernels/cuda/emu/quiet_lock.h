// A lock_guard whose lock and unlock ThreadSanitizer is not shown as an ordering (the TSan build,
// DQ_EMU_TSAN=1), for the emulator's own locks that every launch takes: they run one launch at a
// time and guard the emulator's state, an artefact of the emulation (on a GPU two streams'
// kernels run at once), so they must not order one host thread's kernels after another's
// (EMULATION.md, "ThreadSanitizer"). In other builds a plain lock_guard.
#pragma once
#include <mutex>

#if defined(DQ_EMU_TSAN) && DQ_EMU_TSAN
extern "C" void AnnotateIgnoreSyncBegin(const char* file, int line);
extern "C" void AnnotateIgnoreSyncEnd(const char* file, int line);
#endif

namespace dq::emu::detail {

class QuietLock {
 public:
  explicit QuietLock(std::mutex& m) : m_(m) {
    quietly([this] { m_.lock(); });
  }
  ~QuietLock() {
    quietly([this] { m_.unlock(); });
  }
  QuietLock(const QuietLock&) = delete;
  QuietLock& operator=(const QuietLock&) = delete;

 private:
  template <class F>
  static void quietly(F f) {
#if defined(DQ_EMU_TSAN) && DQ_EMU_TSAN
    AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
    f();
    AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
#else
    f();
#endif
  }
  std::mutex& m_;
};

}  // namespace dq::emu::detail
