#include "common/float_env.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace dq {

#if defined(__x86_64__) || defined(__i386__)
namespace {
// MXCSR at reset: the six exception masks (bits 7-12) set; flags, DAZ (bit 6), rounding control
// (bits 13-14: 00, to nearest even) and FZ (bit 15) clear.
constexpr uint32_t kDefaultMxcsr = 0x1F80u;
// The bits that decide results or traps: DAZ, the masks, rounding control and FZ (the six flag
// bits 0-5 only record what happened).
constexpr uint32_t kControlBits = 0xFFC0u;
}  // namespace

DefaultFloatEnvironment::DefaultFloatEnvironment() : saved_(_mm_getcsr()) {
  _mm_setcsr(kDefaultMxcsr);
}

DefaultFloatEnvironment::~DefaultFloatEnvironment() {
  _mm_setcsr(saved_);
}

bool float_environment_is_default() {
  return (_mm_getcsr() & kControlBits) == kDefaultMxcsr;
}
#else
DefaultFloatEnvironment::DefaultFloatEnvironment() {
  std::fegetenv(&saved_);
  std::fesetenv(FE_DFL_ENV);
}

DefaultFloatEnvironment::~DefaultFloatEnvironment() {
  std::fesetenv(&saved_);
}

// Elsewhere (the build targets x86-64; this keeps other hosts compiling) only the rounding is
// read back: FE_DFL_ENV's other controls have no portable query.
bool float_environment_is_default() {
  return std::fegetround() == FE_TONEAREST;
}
#endif

}  // namespace dq
