// The host device: host memory and the CPU NCCL, with streams and events of its own, so the host
// path runs the engine under the same ordering rules a GPU imposes. Each stream the device
// creates is an ordered work queue served by one worker thread; an event is a record
// counter and a completion counter. Any stream handle the device did not create (a caller's) is
// the calling thread: work on it runs at once, and waiting on it blocks the caller.
//
// The audited variant (tests) holds queued work back until the host blocks in a wait, and keeps
// all of its memory PROT_NONE meanwhile: a host read or write of device memory between an enqueue
// and the next blocking wait faults, the SIGSEGV handler counts it, unprotects the region and the
// access completes.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/c_locale.h"
#include "common/float_env.h"
#include "kernels/budget_model.h"
#include "shim/engine/device.h"

namespace dq::engine {
namespace {

// ---- audit: the protected regions and the fault handler -----------------------------------
// Fixed-size and lock-free, because the SIGSEGV handler reads it.
constexpr int kMaxAuditRegions = 4096;
struct AuditRegion {
  std::atomic<uintptr_t> begin{0};
  std::atomic<size_t> bytes{0};
};
AuditRegion g_regions[kMaxAuditRegions];
std::atomic<uint64_t> g_audit_accesses{0};
struct sigaction g_previous_segv;
std::once_flag g_handler_once;

void on_segv(int sig, siginfo_t* info, void* context) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  for (AuditRegion& r : g_regions) {
    const uintptr_t b = r.begin.load(std::memory_order_acquire);
    const size_t n = r.bytes.load(std::memory_order_acquire);
    if (b != 0 && a >= b && a < b + n) {
      g_audit_accesses.fetch_add(1, std::memory_order_relaxed);
      mprotect(reinterpret_cast<void*>(b), n, PROT_READ | PROT_WRITE);
      return;  // the access is retried and succeeds
    }
  }
  // Not ours: hand over to whoever was there before (or the default action).
  if (g_previous_segv.sa_flags & SA_SIGINFO) {
    if (g_previous_segv.sa_sigaction) return g_previous_segv.sa_sigaction(sig, info, context);
  } else if (g_previous_segv.sa_handler != SIG_DFL && g_previous_segv.sa_handler != SIG_IGN) {
    return g_previous_segv.sa_handler(sig);
  }
  signal(SIGSEGV, SIG_DFL);  // the faulting instruction runs again and kills the process
}

// Buffers of at least this many bytes are mapped, not malloc'd (see HostDevice::alloc).
constexpr size_t kMapAtLeastBytes = 256 * 1024;

size_t page_round(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (std::max<size_t>(bytes, 1) + page - 1) / page * page;
}

struct HostEvent {
  std::mutex m;
  std::condition_variable cv;
  uint64_t recorded = 0;   // records enqueued (host side)
  uint64_t completed = 0;  // records the stream has reached

  // Notifies with the lock held: a waiter that sees `completed` reach its target may return and
  // destroy the event (destroy_event() after a wait) at once, so nothing here may touch it after
  // the unlock. A notify after the unlock used a condition variable that was already freed.
  void complete(uint64_t target) {
    std::lock_guard<std::mutex> lock(m);
    if (target > completed) completed = target;
    cv.notify_all();
  }
  void wait_for(uint64_t target) {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return completed >= target; });
  }
  // False when `target` was not reached by `deadline`.
  bool wait_until(uint64_t target, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(m);
    return cv.wait_until(lock, deadline, [&] { return completed >= target; });
  }
};

// Test only: host streams whose threads start before the next one fails to (-1: none fails).
std::atomic<int> g_stream_starts_before_failure{-1};

class HostStream {
 public:
  HostStream() : worker_(start()) {}
  ~HostStream() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
      held_ = false;
    }
    cv_.notify_all();
    worker_.join();
  }
  void push(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(m_);
      queue_.push_back(std::move(fn));
    }
    cv_.notify_all();
  }
  void set_held(bool held) {
    {
      std::lock_guard<std::mutex> lock(m_);
      held_ = held;
    }
    cv_.notify_all();
  }
  void drain() {
    std::unique_lock<std::mutex> lock(m_);
    idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  }

 private:
  void serve() {
    // The steps' codec and budget arithmetic under the format's floating-point environment,
    // whatever this thread inherited from the one that made the stream.
    const DefaultFloatEnvironment float_env;
    const CNumericLocale c_numbers;  // its logs' and the budget's numbers (common/c_locale.h)
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return (stop_ && queue_.empty()) || (!queue_.empty() && !held_); });
        if (queue_.empty()) return;  // stopping, nothing left
        fn = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      fn();
      {
        std::lock_guard<std::mutex> lock(m_);
        busy_ = false;
      }
      idle_cv_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false, busy_ = false, held_ = false;
  std::thread worker_;  // last: started once the state above exists

  // The worker, or what std::thread throws when it cannot start one (std::system_error at a
  // thread limit), thrown before worker_ exists so that the members above are released.
  std::thread start() {
    int left = g_stream_starts_before_failure.load(std::memory_order_relaxed);
    while (left > 0 && !g_stream_starts_before_failure.compare_exchange_weak(
                           left, left - 1, std::memory_order_relaxed)) {
    }
    if (left == 0)  // and every later one, until the fault is reset
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                              "a host stream's thread (test fault)");
    return std::thread([this] { serve(); });
  }
};

class HostDevice final : public Device {
 public:
  explicit HostDevice(bool audit) : audit_(audit) {
    if (audit_)
      std::call_once(g_handler_once, [] {
        struct sigaction sa;
        std::memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_segv;
        sa.sa_flags = SA_SIGINFO | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &g_previous_segv);
      });
  }
  const char* name() const override { return audit_ ? "host (audited)" : "host"; }

  Status alloc(size_t bytes, void** out) override {
    if (!audit_ && bytes >= kMapAtLeastBytes) {
      // Payload arenas: straight from the kernel, so a retired plan's pages go back at once.
      // Through malloc they would stay in the caller's heap (glibc raises its mmap threshold to
      // the largest block freed), and the process's RSS would keep the high-water mark of
      // every plan set it ever held. Populated now (MAP_POPULATE): a call never faults a page
      // in mid-hop, and what the plans hold (the held_bytes metric) is what is resident; left
      // to fault in, a plan's untouched slack made RSS less held_bytes swing by 10+ MiB with
      // the mix of cached plans (docs/results/robustness.md, soak).
      const size_t n = page_round(bytes);
      void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                     -1, 0);
      if (p == MAP_FAILED)
        DQ_FAIL(Status::kOutOfMemory, "host device: cannot map %zu bytes", bytes);
      std::lock_guard<std::mutex> lock(mapped_m_);
      mapped_[p] = n;
      *out = p;
      return Status::kOk;
    }
    if (!audit_) {
      // 64-byte alignment: whole cache lines for the codec's vector loads.
      *out = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
      if (*out == nullptr)
        DQ_FAIL(Status::kOutOfMemory, "host device: cannot allocate %zu bytes", bytes);
      return Status::kOk;
    }
    const size_t n = page_round(bytes);
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) DQ_FAIL(Status::kOutOfMemory, "host device: cannot map %zu bytes", bytes);
    std::lock_guard<std::mutex> lock(audit_m_);
    for (AuditRegion& r : g_regions)
      if (r.begin.load() == 0) {
        r.bytes.store(n, std::memory_order_release);
        r.begin.store(reinterpret_cast<uintptr_t>(p), std::memory_order_release);
        if (armed_) mprotect(p, n, PROT_NONE);
        *out = p;
        return Status::kOk;
      }
    munmap(p, n);
    DQ_FAIL(Status::kOutOfMemory, "host device: more than %d audited regions", kMaxAuditRegions);
  }
  // Host memory is already visible to both sides.
  Status alloc_mapped(size_t bytes, void** out) override { return alloc(bytes, out); }

  void release(void* p, StreamHandle stream) override {
    if (p == nullptr) return;
    if (HostStream* s = ours(stream)) {
      hold_back_if_audited();
      s->push([this, p] { free_now(p); });
    } else {
      free_now(p);
    }
  }

  Status create_stream(StreamHandle* out) override {
    HostStream* s = nullptr;
    try {
      s = new HostStream;
    } catch (const std::exception& e) {
      // No thread to start (a process's thread or pid limit), or no memory: the engine's set-up
      // fails as for any device, and every rank passes through; thrown on, it left the engine
      // half made on this rank while its peers waited in the handshake.
      DQ_WARN(Subsys::kEngine, "dynamiq: the host device could not make a stream: %s", e.what());
      return Status::kSystemError;
    }
    if (audit_) s->set_held(armed_);
    std::lock_guard<std::mutex> lock(streams_m_);
    streams_.insert(s);
    *out = s;
    return Status::kOk;
  }
  void destroy_stream(StreamHandle handle) override {
    HostStream* s = ours(handle);
    if (s == nullptr) return;
    release_hold();
    s->drain();
    {
      std::lock_guard<std::mutex> lock(streams_m_);
      streams_.erase(s);
    }
    delete s;
  }
  Status create_event(EventHandle* out) override {
    *out = new HostEvent;
    return Status::kOk;
  }
  void destroy_event(EventHandle e) override { delete static_cast<HostEvent*>(e); }

  Status record(EventHandle handle, StreamHandle stream) override {
    auto* e = static_cast<HostEvent*>(handle);
    uint64_t target;
    {
      std::lock_guard<std::mutex> lock(e->m);
      target = ++e->recorded;
    }
    if (HostStream* s = ours(stream)) {
      hold_back_if_audited();
      s->push([e, target] { e->complete(target); });
    } else {
      e->complete(target);  // the calling thread has done everything before this point
    }
    return Status::kOk;
  }
  Status wait(StreamHandle stream, EventHandle handle) override {
    auto* e = static_cast<HostEvent*>(handle);
    uint64_t target;
    {
      std::lock_guard<std::mutex> lock(e->m);
      target = e->recorded;
    }
    if (HostStream* s = ours(stream)) {
      hold_back_if_audited();
      s->push([e, target] { e->wait_for(target); });
    } else {
      // Bounded by the queued work itself: every NCCL call in it has the CPU NCCL's timeout.
      release_hold();
      e->wait_for(target);
    }
    return Status::kOk;
  }
  Status synchronize(EventHandle handle) override {
    auto* e = static_cast<HostEvent*>(handle);
    uint64_t target;
    {
      std::lock_guard<std::mutex> lock(e->m);
      target = e->recorded;
    }
    release_hold();
    e->wait_for(target);
    return Status::kOk;
  }
  // Bounded as on a GPU: a peer that stalls past DYNAMIQ_TIMEOUT_MS fails the engine's wait even
  // when the CPU NCCL's own timeout (DYNAMIQ_CPU_NCCL_TIMEOUT_MS) is longer. The queued work
  // stays queued; the engine reads nothing of it and its teardown waits for it.
  Status synchronize_for(EventHandle handle, int64_t timeout_ms) override {
    if (timeout_ms <= 0) return synchronize(handle);
    auto* e = static_cast<HostEvent*>(handle);
    uint64_t target;
    {
      std::lock_guard<std::mutex> lock(e->m);
      target = e->recorded;
    }
    release_hold();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    return e->wait_until(target, deadline) ? Status::kOk : Status::kTimeout;
  }
  bool query(EventHandle handle) override {
    auto* e = static_cast<HostEvent*>(handle);
    std::lock_guard<std::mutex> lock(e->m);
    return e->completed >= e->recorded;
  }
  bool capturing(StreamHandle) const override { return false; }

  // The steps run the host codec itself: nothing was prepared beyond it.
  Status local_stats(const PreparedCodec& prepared, const ConstTensor& x, uint16_t* stats,
                     Lane lane) override {
    const Codec& codec = prepared.codec();
    return run(lane, [&codec, x, stats] { return codec.local_stats(x, stats); });
  }
  Status build_layout(const PreparedCodec& prepared, const uint16_t* reduced, uint64_t call,
                      void* layout, Lane lane) override {
    const Codec& codec = prepared.codec();
    return run(lane, [&codec, reduced, call, layout] {
      return codec.build_layout(reduced, call, layout);
    });
  }
  Status hop(const PreparedCodec& prepared, const void* layout, int chunk, const ConstTensor& own,
             const ByteView* in, int n_in, uint8_t* out, const RoundingKey& key,
             Lane lane) override {
    const Codec& codec = prepared.codec();
    std::vector<ByteView> inputs(in, in + n_in);  // the caller reuses its array
    return run(lane, [&codec, layout, chunk, own, inputs = std::move(inputs), out, key] {
      return codec.fused_hop(layout, chunk, own, inputs.data(), static_cast<int>(inputs.size()),
                             out, key);
    });
  }
  Status finish(const PreparedCodec& prepared, const void* layout, int chunk, ByteView in,
                void* out, DType dtype, ReduceOp op, int n_contrib, Lane lane) override {
    const Codec& codec = prepared.codec();
    return run(lane, [&codec, layout, chunk, in, out, dtype, op, n_contrib] {
      return codec.decode_finish(layout, chunk, in, out, dtype, op, n_contrib);
    });
  }
  Status copy(void* dst, const void* src, size_t bytes, Lane lane) override {
    return run(lane, [dst, src, bytes] {
      if (bytes) std::memcpy(dst, src, bytes);
      return Status::kOk;
    });
  }
  Status predict_budget(const BudgetJob* job, const uint16_t* reduced, void*, size_t,
                        BudgetResult* out, Lane lane) override {
    return run(lane, [job, reduced, out] {
      run_budget_job(*job, reduced, out);
      return Status::kOk;
    });
  }
  Status nccl(Lane lane, std::function<ncclResult_t()> calls) override {
    auto step = [calls = std::move(calls), error = lane.error]() {
      if (error_set(error)) return;
      const ncclResult_t r = calls();
      if (r != ncclSuccess && error) set_error(error, error_word(ErrorSource::kNccl, r));
    };
    if (HostStream* s = ours(lane.stream)) {
      hold_back_if_audited();
      s->push(std::move(step));
      return Status::kOk;
    }
    step();
    return error_set(lane.error) ? Status::kSystemError : Status::kOk;
  }

  uint64_t accesses() const { return g_audit_accesses.load(); }

 private:
  HostStream* ours(StreamHandle handle) {
    std::lock_guard<std::mutex> lock(streams_m_);
    auto it = streams_.find(static_cast<HostStream*>(handle));
    return it == streams_.end() ? nullptr : *it;
  }

  // A codec step: queued on the device's own streams (skipped once the lane's error is set; a
  // failure sets it), or run at once on the caller's.
  template <class F>
  Status run(Lane lane, F&& body) {
    auto step = [body = std::forward<F>(body), error = lane.error]() -> Status {
      if (error_set(error)) return Status::kOk;
      const Status s = body();
      if (s != Status::kOk && error)
        set_error(error, error_word(ErrorSource::kCodec, static_cast<int>(s)));
      return s;
    };
    if (HostStream* s = ours(lane.stream)) {
      hold_back_if_audited();
      s->push([step = std::move(step)]() mutable { step(); });
      return Status::kOk;
    }
    return step();
  }

  void free_now(void* p) {
    if (!audit_) {
      {
        std::lock_guard<std::mutex> lock(mapped_m_);
        auto it = mapped_.find(p);
        if (it != mapped_.end()) {
          munmap(p, it->second);
          mapped_.erase(it);
          return;
        }
      }
      return std::free(p);
    }
    std::lock_guard<std::mutex> lock(audit_m_);
    for (AuditRegion& r : g_regions)
      if (r.begin.load() == reinterpret_cast<uintptr_t>(p)) {
        const size_t n = r.bytes.load();
        r.begin.store(0, std::memory_order_release);
        r.bytes.store(0, std::memory_order_release);
        munmap(p, n);
        return;
      }
  }

  std::vector<HostStream*> all_streams() {
    std::lock_guard<std::mutex> lock(streams_m_);
    return std::vector<HostStream*>(streams_.begin(), streams_.end());
  }

  // Audit: the first enqueue after a blocking wait holds every stream back and protects the
  // memory, once the streams have finished what they had.
  void hold_back_if_audited() {
    if (!audit_ || armed_.load()) return;  // only the host thread arms and disarms
    for (HostStream* s : all_streams()) s->drain();
    for (HostStream* s : all_streams()) s->set_held(true);
    std::lock_guard<std::mutex> lock(audit_m_);
    for (AuditRegion& r : g_regions) {
      const uintptr_t b = r.begin.load();
      if (b) mprotect(reinterpret_cast<void*>(b), r.bytes.load(), PROT_NONE);
    }
    armed_ = true;
  }
  // Audit: a blocking wait lets the held work run on readable memory.
  void release_hold() {
    if (!audit_ || !armed_.load()) return;
    {
      std::lock_guard<std::mutex> lock(audit_m_);
      for (AuditRegion& r : g_regions) {
        const uintptr_t b = r.begin.load();
        if (b) mprotect(reinterpret_cast<void*>(b), r.bytes.load(), PROT_READ | PROT_WRITE);
      }
      armed_ = false;
    }
    for (HostStream* s : all_streams()) s->set_held(false);
  }

  const bool audit_;
  std::mutex streams_m_;
  std::unordered_set<HostStream*> streams_;
  std::mutex audit_m_;
  std::atomic<bool> armed_{false};
  std::mutex mapped_m_;
  std::unordered_map<void*, size_t> mapped_;  // buffers from mmap: address -> mapped bytes
};

}  // namespace

void host_stream_starts_before_failure(int starts) {
  g_stream_starts_before_failure.store(starts, std::memory_order_relaxed);
}

Device* host_device() {
  static HostDevice* device = new HostDevice(false);  // never destroyed: used from atexit paths
  return device;
}

std::unique_ptr<Device> make_audited_host_device() {
  return std::make_unique<HostDevice>(true);
}

uint64_t audited_host_accesses(const Device* device) {
  const auto* d = dynamic_cast<const HostDevice*>(device);
  return d ? d->accesses() : 0;
}

}  // namespace dq::engine
