// A thread's current context switched for a scope and restored exactly after, whatever it was:
// another context, or none. `Ops` makes the calls (shim/engine/cuda_context.h on a GPU, a fake in
// tests):
//   using Context = ...;                 a handle; Context{} is "none"
//   bool current(Context* out) const;    the calling thread's current context
//   bool set_current(Context c) const;   makes `c` current (Context{}: none)
// Restoring by device number instead (cudaSetDevice(previous)) is what this avoids: on a thread
// that had no context, the runtime's previous device reads as 0, and setting it creates device 0's
// primary context there.
#pragma once

namespace dq::engine {

template <class Ops>
class ScopedContext {
 public:
  using Context = typename Ops::Context;
  explicit ScopedContext(Context target, Ops ops = Ops{}) : ops_(ops) {
    Context previous{};
    if (target == Context{} || !ops_.current(&previous) || previous == target) return;
    if (ops_.set_current(target)) {
      previous_ = previous;
      restore_ = true;
    }
  }
  ~ScopedContext() {
    if (restore_) ops_.set_current(previous_);
  }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  Ops ops_;
  Context previous_{};
  bool restore_ = false;
};

}  // namespace dq::engine
