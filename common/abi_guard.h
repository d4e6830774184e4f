// The guard at every extern "C" boundary (the shim, the net plugin, the CPU NCCL, the C APIs):
// no C++ exception crosses into a caller that cannot catch it; it becomes a result code.
#pragma once
#include <cxxabi.h>

#include <exception>
#include <new>
#include <type_traits>

namespace dq {

// What escaped the guarded call.
enum class AbiFault {
  kOutOfMemory,  // std::bad_alloc
  kException,    // another std::exception
  kUnknown,      // anything else thrown
};

// Returns body(), or, when it throws, on_fault: either the error value to return, or a callable
// (AbiFault fault, const char* what) returning it (what: the exception's what(), "" if unknown)
// that may also report the fault.
// Not under UBSan: the forced unwind is a foreign exception with no C++ object, so its handler
// binds a reference to null, which UBSan's null check reports in the documented idiom.
#if defined(__clang__)
#define DQ_ABI_GUARD_NO_UBSAN __attribute__((no_sanitize("undefined")))
#else
#define DQ_ABI_GUARD_NO_UBSAN __attribute__((no_sanitize_undefined))
#endif
template <class Body, class OnFault>
DQ_ABI_GUARD_NO_UBSAN auto abi_guard(Body&& body, OnFault&& on_fault) -> decltype(body()) {
  using Result = decltype(body());
  const auto fail = [&](AbiFault fault, const char* what) -> Result {
    if constexpr (std::is_invocable_v<OnFault&, AbiFault, const char*>)
      return on_fault(fault, what);
    else
      return on_fault;
  };
  try {
    return body();
  } catch (abi::__forced_unwind&) {
    // pthread_cancel or pthread_exit unwinding the thread through us: not an error to turn into
    // a result code, and one not rethrown aborts the process.
    throw;
  } catch (const std::bad_alloc& e) {
    return fail(AbiFault::kOutOfMemory, e.what());
  } catch (const std::exception& e) {
    return fail(AbiFault::kException, e.what());
  } catch (...) {
    return fail(AbiFault::kUnknown, "");
  }
}

}  // namespace dq
