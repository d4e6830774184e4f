// The floating-point environment the format's arithmetic is defined in (docs/FORMAT.md): IEEE
// round to nearest even, subnormals kept (no flush-to-zero, no denormals-are-zero), every
// exception masked. A thread's environment is the application's to change, and threads inherit
// it from the thread that creates them: torch.set_flush_denormal(True) sets flush-to-zero and
// denormals-are-zero, a library built with -Ofast sets them when it is loaded, fesetround()
// changes the rounding, feenableexcept() unmasks traps. Under any of these the codecs would write
// other bytes than the format's, ranks with different environments would decode the same message
// differently, and an unmasked trap would crash the job on a NaN gradient. So dynamiq's code runs
// under this environment, set where it is entered (the shim's C boundary, each codec task, each
// worker thread), and the application's is restored when it returns.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <cstdint>
#else
#include <cfenv>
#endif

namespace dq {

// While it lives, the calling thread runs under the default environment above; its destructor
// restores the environment it found, so flags our code raised do not reach the application.
// Out of line (float_env.cc): a call the compiler cannot move floating-point work across.
class DefaultFloatEnvironment {
 public:
  DefaultFloatEnvironment();
  ~DefaultFloatEnvironment();
  DefaultFloatEnvironment(const DefaultFloatEnvironment&) = delete;
  DefaultFloatEnvironment& operator=(const DefaultFloatEnvironment&) = delete;

 private:
#if defined(__x86_64__) || defined(__i386__)
  uint32_t saved_;  // MXCSR
#else
  std::fenv_t saved_;
#endif
};

// Whether the calling thread runs under the default environment now (tests).
bool float_environment_is_default();

}  // namespace dq
