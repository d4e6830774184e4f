// dq::parallel_for: tbb::parallel_for, plus, under ThreadSanitizer, the fork-join order that TBB
// guarantees and TSan cannot see inside an uninstrumented libtbb (Debian's is not built with
// -fsanitize=thread): the caller's writes before the loop happen before every task, and every
// task's writes happen before the loop returns. Without it TSan reports each codec loop's output,
// written by a worker and read by the caller after the loop, as a race. Nothing else is
// annotated, so a race between two tasks of the same loop is still reported. Outside TSan builds
// this is tbb::parallel_for itself. Every task runs under the format's floating-point environment
// (common/float_env.h): TBB's workers take the settings their arena captured from the thread that
// first used it, which may be the application's (flush-to-zero, another rounding).
#ifndef DYNAMIQ_KERNELS_PARALLEL_H_
#define DYNAMIQ_KERNELS_PARALLEL_H_

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "common/float_env.h"

#if defined(__SANITIZE_THREAD__)
#define DQ_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DQ_TSAN 1
#endif
#endif

#ifdef DQ_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace dq {

template <class Range, class Body>
void parallel_for(const Range& range, const Body& body) {
#ifdef DQ_TSAN
  char fork = 0, join = 0;
  __tsan_release(&fork);
  tbb::parallel_for(range, [&](const Range& r) {
    __tsan_acquire(&fork);
    const DefaultFloatEnvironment float_env;
    body(r);
    __tsan_release(&join);
  });
  __tsan_acquire(&join);
#else
  tbb::parallel_for(range, [&](const Range& r) {
    const DefaultFloatEnvironment float_env;
    body(r);
  });
#endif
}

}  // namespace dq

#endif  // DYNAMIQ_KERNELS_PARALLEL_H_
