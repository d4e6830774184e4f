// The CUDA execution-model emulator's scheduler (kernels/cuda/EMULATION.md): fibers on
// Boost.Context's fcontext, one block at a time, barrier and warp-collective bookkeeping, the
// checks, shared-memory poisoning and guard pages, and the reports.
#include "kernels/cuda/emu/emu.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#include <boost/context/detail/fcontext.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "common/splitmix.h"
#include "kernels/cuda/emu/quiet_lock.h"

// Static __shared__ objects live in this section; the linker defines its bounds. Weak: a program
// whose kernels declare no static shared memory has no such section.
extern "C" char __start_dq_emu_shared[] __attribute__((weak));
extern "C" char __stop_dq_emu_shared[] __attribute__((weak));
// UBSan / ASan call this back just before they end the process (a shared array index out of
// bounds under -fsanitize=bounds-strict): the emulator adds which thread was running.
extern "C" void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));
// AddressSanitizer's fiber annotations (weak: absent without ASan). Without them ASan takes a
// fiber's stack for a corrupt main stack and reports false stack-buffer errors.
extern "C" void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom,
                                               size_t size) __attribute__((weak));
extern "C" void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                                size_t* size_old) __attribute__((weak));

// ThreadSanitizer (the TSan build): every emulated thread is a TSan fiber, switched without
// synchronisation, and only what orders memory on a GPU orders it here (ThreadSanitizer in
// EMULATION.md). This file itself is not instrumented (its meson.build): the scheduler's own state
// passes between fibers that TSan would otherwise see as unordered threads, so the build says so
// (-DDQ_EMU_TSAN=1: without -fsanitize=thread here the compiler cannot tell).
#ifndef DQ_EMU_TSAN
#if defined(__SANITIZE_THREAD__)
#define DQ_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DQ_EMU_TSAN 1
#endif
#endif
#ifndef DQ_EMU_TSAN
#define DQ_EMU_TSAN 0
#endif
#endif
#if DQ_EMU_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace dq::emu {
namespace {

namespace fc = boost::context::detail;

constexpr size_t kPage = 4096;
constexpr int kMaxThreads = 1024;
// TSan build: the distinct words a thread may read atomically between two fences (its next fence
// acquires each); more is a fault, not a silently missed ordering.
constexpr int kMaxAtomicReads = 256;
constexpr size_t kMaxDynamicShared = 227 * 1024;  // sm_90's opt-in limit per block
constexpr unsigned char kPoison = 0xFF;
constexpr unsigned char kCanary = 0xA5;  // the bytes before the dynamic shared buffer
// A shuffled launch holds its order (8 bytes a block); an emulated grid is far smaller.
constexpr uint64_t kMaxShuffledBlocks = uint64_t{1} << 24;

struct Cancelled {};  // thrown inside a fiber to unwind it; caught at the fiber's entry

// Tells ASan (when present) about every stack switch: the scheduler's stack is learnt the first
// time a fiber starts, each fiber's from its mmap.
struct AsanStacks {
  const void* scheduler_bottom = nullptr;
  size_t scheduler_size = 0;
  void* scheduler_fake = nullptr;  // the scheduler's fake stack while a fiber runs
};
AsanStacks g_asan;
void asan_leave(void** fake_save, const void* bottom, size_t size) {
  if (__sanitizer_start_switch_fiber) __sanitizer_start_switch_fiber(fake_save, bottom, size);
}
void asan_arrive(void* fake_save, const void** bottom_old, size_t* size_old) {
  if (__sanitizer_finish_switch_fiber)
    __sanitizer_finish_switch_fiber(fake_save, bottom_old, size_old);
}

// TSan's view (no-ops in other builds). A switch carries no ordering (no_sync): an emulated
// thread gives up the CPU only at a barrier or a warp collective, and switching with
// synchronisation would order every access before a switch before every access after it, hiding
// every race. The orderings are given explicitly, each a release by the threads before and an
// acquire by those after, on a byte that names it: the launch's start (the caller's buffers, and
// each block's fresh shared memory), every __syncthreads among a block's threads and every
// __syncwarp among its mask's lanes, a __threadfence with the atomics around it (below), and the
// launch's end, where the caller acquires every thread's exit.
//
// Between blocks, and between launches from different host threads (the emulated device's
// streams), nothing else orders memory, as on a GPU, so a race between two blocks or two streams'
// kernels shows:
// - The fibers come in kTsanFiberSets sets, one slot a thread in each, created once for each host
//   thread that launches (as the stacks); the k-th block a launch runs uses set k mod
//   kTsanFiberSets, so blocks run one after another are different TSan threads. A fiber's program
//   order still orders the blocks that share its set, kTsanFiberSets apart in the run, and the
//   launches of one host thread (one stream's, ordered on a GPU too).
// - A launch's start and end bytes are its own, and the lock that runs one launch at a time is
//   hidden from TSan: a launch is ordered after another thread's only by what the threads order.
// - A block's barrier and warp bytes are a fresh allocation (freeing it frees TSan's clocks on
//   them), so no block acquires another's barrier rounds.
// - Shared memory is new to each block: TSan forgets the static section's accesses through its
//   Java heap interface (the section is that "heap", allocated afresh before every block; the
//   interface resets shadow memory and nothing else), and the dynamic region's through a fresh
//   mapping of its pages (TSan's mmap interceptor resets them). A race report on shared memory
//   then names the region a "heap block" allocated in the emulator's run_block().
constexpr int kTsanFiberSets = 2;
#if DQ_EMU_TSAN
extern "C" void __tsan_java_init(unsigned long heap_begin, unsigned long heap_size);
extern "C" void __tsan_java_alloc(unsigned long ptr, unsigned long size);
extern "C" void __tsan_java_free(unsigned long ptr, unsigned long size);
// One host thread's fibers, destroyed when it exits (their TSan threads end with them).
struct TsanFibers {
  std::vector<void*> sets[kTsanFiberSets];
  int set = 0;                // the running block's
  void* scheduler = nullptr;  // the launching OS thread's own, while a launch runs
  void* of(int t) {
    std::vector<void*>& fibers = sets[set];
    while (static_cast<int>(fibers.size()) <= t) fibers.push_back(__tsan_create_fiber(0));
    return fibers[t];
  }
  ~TsanFibers() {
    for (std::vector<void*>& fibers : sets)
      for (void* f : fibers) __tsan_destroy_fiber(f);
  }
};
thread_local TsanFibers g_tsan;
bool g_java_heap = false;  // the static shared section registered as TSan's Java heap (launch lock)
void tsan_enter_launch() {
  g_tsan.scheduler = __tsan_get_current_fiber();
}
void tsan_enter_block(uint64_t position) {
  g_tsan.set = static_cast<int>(position % kTsanFiberSets);
}
// Thread t's stack: one a fiber, since TSan sees a fiber's stack accesses too.
int stack_slot(int t) {
  return t * kTsanFiberSets + g_tsan.set;
}
void tsan_to_thread(int t) {
  __tsan_switch_to_fiber(g_tsan.of(t), __tsan_switch_to_fiber_no_sync);
}
void tsan_to_scheduler() {
  __tsan_switch_to_fiber(g_tsan.scheduler, __tsan_switch_to_fiber_no_sync);
}
void tsan_release(void* a) {
  __tsan_release(a);
}
void tsan_acquire(void* a) {
  __tsan_acquire(a);
}
// [begin, end) rounded out to TSan's 8-byte shadow cells.
void tsan_forget_static_shared(char* begin, char* end) {
  const unsigned long b = reinterpret_cast<unsigned long>(begin) & ~7ul;
  const unsigned long e = (reinterpret_cast<unsigned long>(end) + 7) & ~7ul;
  if (!g_java_heap) {
    __tsan_java_init(b, e - b);
    g_java_heap = true;
  } else {
    __tsan_java_free(b, e - b);
  }
  __tsan_java_alloc(b, e - b);
}
#else
void tsan_enter_launch() {}
void tsan_enter_block(uint64_t) {}
int stack_slot(int t) {
  return t;
}
void tsan_to_thread(int) {}
void tsan_to_scheduler() {}
void tsan_release(void*) {}
void tsan_acquire(void*) {}
void tsan_forget_static_shared(char*, char*) {}
#endif

enum class State : uint8_t { kReady, kBarrier, kWarp, kExited };

struct Thread {
  fc::fcontext_t context = nullptr;
  void* asan_fake = nullptr;  // this fiber's fake stack while it is parked (ASan)
  State state = State::kReady;
  bool started = false;
  uint3 idx{0, 0, 0};
  std::source_location site;  // where it waits
  // Its slot in the warp's collective exchange.
  detail::Op op = detail::Op::kIdx;
  unsigned mask = 0;
  int param = 0, width = 32;
  uint64_t value = 0, result = 0;
  // TSan, a __threadfence with the atomics around it: the words this thread read atomically since
  // its last fence (acquired at the next), and whether it has fenced (its atomic writes release).
  // A fixed array: emu.cc is not instrumented, and a std::vector's member functions could be the
  // instrumented copies the kernels' files also instantiate.
#if DQ_EMU_TSAN
  const void* atomic_reads[kMaxAtomicReads] = {};
#endif
  int n_atomic_reads = 0;
  bool fenced = false;
};

struct Warp {
  unsigned exists = 0;     // lanes present in the block
  unsigned parked = 0;     // lanes waiting in a collective
  unsigned claimed = 0;    // lanes named by the mask of a pending collective
  uint8_t owner[32] = {};  // per claimed lane: a parked lane of the group that claimed it
};

struct Launch {
  dim3 grid, block;
  size_t dynamic_bytes = 0;
  void (*body)(void*) = nullptr;
  void* context = nullptr;
  detail::LaunchSite site{};
  int n = 0;  // threads per block
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  std::vector<int> ring;  // ready queue (each thread at most once)
  size_t head = 0, count = 0;
  int current = -1;
  int live = 0;
  fc::fcontext_t scheduler = nullptr;
  int arrived = 0;  // barrier arrivals in the current round
  uint64_t barrier_round = 0;
  // TSan, this launch's own: [0] its start (released by the scheduler before each block, acquired
  // by each thread), [1] its end (released by each thread, acquired by the caller).
  std::unique_ptr<char[]> launch_sync{new char[2]()};
  // TSan, fresh for each block: [0, 2) __syncthreads rounds alternate between the two; [2, 2 + n)
  // a __syncwarp whose group lane t claimed orders memory on byte 2 + t.
  std::unique_ptr<char[]> block_sync;
  std::source_location barrier_site;
  int barrier_first = -1;
  bool cancelling = false;
  Fault fault = Fault::kNone;
  std::string message;
  char* dynamic = nullptr;  // this launch's dynamic shared buffer
  Counters counters;
  BlockOrdering thread_ordering;  // the order released threads run in (release())
  uint64_t thread_shuffle = 0;    // kShuffle: the generator's state, stepped each swap
  std::vector<int> released;      // the threads a barrier or collective releases, in index order
};

Launch* g_launch = nullptr;
// This thread's launch in progress: one from here is nested (another thread's launch is not).
thread_local Launch* t_running = nullptr;
std::mutex g_launch_mutex;  // one launch at a time (taken through QuietLock)
Report g_report;
Counters g_counters;
cudaError_t g_last_error = cudaSuccess;
std::atomic<uint64_t> g_launches{0};
std::atomic<bool> g_require_loaded{false};
std::mutex g_loaded_mutex;
std::set<const void*> g_loaded;  // kernels whose attributes were asked for

// ---- memory: fiber stacks and the dynamic shared region, each with guard pages -----------------
struct Stacks {
  std::vector<char*> bases;  // lowest address: a guard page, then kFiberStackBytes
  char* top(int i) {
    while (static_cast<int>(bases.size()) <= i) {
      void* p = mmap(nullptr, kFiberStackBytes + kPage, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) {
        std::perror("dq-emu: fiber stack mmap");
        std::abort();
      }
      mprotect(p, kPage, PROT_NONE);
      bases.push_back(static_cast<char*>(p));
    }
    return bases[i] + kPage + kFiberStackBytes;
  }
#if DQ_EMU_TSAN
  ~Stacks() {  // a host thread's, at its exit
    for (char* b : bases) munmap(b, kFiberStackBytes + kPage);
  }
#endif
  bool is_guard(uintptr_t a) const {
    for (char* b : bases)
      if (a >= reinterpret_cast<uintptr_t>(b) && a < reinterpret_cast<uintptr_t>(b) + kPage)
        return true;
    return false;
  }
};
#if DQ_EMU_TSAN
thread_local Stacks g_stacks;  // each host thread's fibers their own stacks (TSan sees them)
#else
Stacks g_stacks;
#endif

// [guard page][data pages][guard page]; the buffer ends where the second guard starts.
struct SharedRegion {
  char* base = nullptr;
  size_t data_pages = 0;
  char* data() const { return base + kPage; }
  char* end() const { return data() + data_pages * kPage; }
  char* prepare(size_t bytes) {
    const size_t pages = (bytes + kPage - 1) / kPage + 1;
    if (pages > data_pages) {
      if (base) munmap(base, (data_pages + 2) * kPage);
      void* p = mmap(nullptr, (pages + 2) * kPage, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) {
        std::perror("dq-emu: shared memory mmap");
        std::abort();
      }
      base = static_cast<char*>(p);
      data_pages = pages;
      mprotect(base, kPage, PROT_NONE);
      mprotect(end(), kPage, PROT_NONE);
    }
    return end() - ((bytes + 15) / 16) * 16;
  }
  // The data pages mapped afresh (zeros): the TSan build's way to make ThreadSanitizer forget the
  // previous block's accesses to them.
  void renew() {
    if (mmap(data(), data_pages * kPage, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) {
      std::perror("dq-emu: shared memory mmap");
      std::abort();
    }
  }
  bool is_guard(uintptr_t a) const {
    if (!base) return false;
    auto in = [a](const char* p) {
      return a >= reinterpret_cast<uintptr_t>(p) && a < reinterpret_cast<uintptr_t>(p) + kPage;
    };
    return in(base) || in(end());
  }
};
SharedRegion g_shared;

// ---- reporting
// -----------------------------------------------------------------------------------
std::string where(const std::source_location& l) {
  char buf[512];
  std::snprintf(buf, sizeof buf, "%s:%u:%u", l.file_name(), static_cast<unsigned>(l.line()),
                static_cast<unsigned>(l.column()));
  return buf;
}

bool same_site(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && a.column() == b.column() &&
         (a.file_name() == b.file_name() || std::strcmp(a.file_name(), b.file_name()) == 0);
}

std::string who(const Launch& L, int t) {
  const uint3& i = L.threads[t].idx;
  char buf[200];
  std::snprintf(buf, sizeof buf,
                "thread %d (threadIdx %u,%u,%u; warp %d lane %d) of block (%u,%u,%u)", t, i.x, i.y,
                i.z, t / 32, t % 32, detail::g_block_idx.x, detail::g_block_idx.y,
                detail::g_block_idx.z);
  return buf;
}

std::string collective(const Thread& t) {
  char buf[100];
  if (t.op <= detail::Op::kXor)
    std::snprintf(buf, sizeof buf, "%s(mask 0x%08x, width %d)", collective_name(t.op), t.mask,
                  t.width);
  else
    std::snprintf(buf, sizeof buf, "%s(mask 0x%08x)", collective_name(t.op), t.mask);
  return std::string(buf) + " at " + where(t.site);
}

std::string header(const Launch& L) {
  char buf[600];
  std::snprintf(buf, sizeof buf,
                "kernel %s (launched at %s:%d), block (%u,%u,%u) of grid (%u,%u,%u), %d threads: ",
                L.site.kernel, L.site.file, L.site.line, detail::g_block_idx.x,
                detail::g_block_idx.y, detail::g_block_idx.z, L.grid.x, L.grid.y, L.grid.z, L.n);
  return buf;
}

void record(Launch& L, Fault f, const std::string& what) {
  if (L.fault != Fault::kNone) return;  // the first fault wins
  L.fault = f;
  L.message = std::string("dq-emu: ") + fault_name(f) + " in " + header(L) + what;
  std::fprintf(stderr, "%s\n", L.message.c_str());
}

[[noreturn]] void fail_in_fiber(Fault f, const std::string& what) {
  record(*g_launch, f, what);
  throw Cancelled{};
}

// ---- fibers
// ---------------------------------------------------------------------------------------
void push_ready(Launch& L, int t) {
  L.ring[(L.head + L.count) % L.n] = t;
  ++L.count;
}

// L.released, made ready in the launch's thread order: as listed (index), reversed, or shuffled
// by Fisher-Yates on SplitMix64 (EMULATION.md, "Thread order").
void release(Launch& L) {
  std::vector<int>& r = L.released;
  if (L.thread_ordering.order == BlockOrder::kReverse) {
    std::reverse(r.begin(), r.end());
  } else if (L.thread_ordering.order == BlockOrder::kShuffle) {
    for (size_t i = r.size(); i-- > 1;) {
      L.thread_shuffle += kSplitMix64Step;
      std::swap(r[i], r[splitmix64_finalise(L.thread_shuffle) % (i + 1)]);
    }
  }
  for (int t : r) {
    L.threads[t].state = State::kReady;
    push_ready(L, t);
  }
  r.clear();
}

// Back to the scheduler; returns when this fiber is resumed (or unwinds it when the launch is
// being cancelled).
void park() {
  Launch& L = *g_launch;
  Thread& me = L.threads[L.current];
  asan_leave(&me.asan_fake, g_asan.scheduler_bottom, g_asan.scheduler_size);
  tsan_to_scheduler();
  fc::transfer_t back = fc::jump_fcontext(L.scheduler, nullptr);
  asan_arrive(L.threads[L.current].asan_fake, &g_asan.scheduler_bottom, &g_asan.scheduler_size);
  L.scheduler = back.fctx;
  if (L.cancelling) throw Cancelled{};
}

void fiber_entry(fc::transfer_t from) {
  asan_arrive(nullptr, &g_asan.scheduler_bottom, &g_asan.scheduler_size);
  Launch& L = *g_launch;
  L.scheduler = from.fctx;
  tsan_acquire(&L.launch_sync[0]);
  try {
    L.body(L.context);
  } catch (const Cancelled&) {
  } catch (const std::exception& e) {
    record(L, Fault::kException, who(L, L.current) + " threw: " + e.what());
  } catch (...) {
    record(L, Fault::kException, who(L, L.current) + " threw an exception");
  }
  L.threads[L.current].state = State::kExited;
  --L.live;
  tsan_release(&L.launch_sync[1]);
  asan_leave(nullptr, g_asan.scheduler_bottom, g_asan.scheduler_size);  // this fiber is done
  tsan_to_scheduler();
  fc::jump_fcontext(L.scheduler, nullptr);
  std::abort();  // an exited fiber is never resumed
}

void resume(Launch& L, int t) {
  Thread& th = L.threads[t];
  L.current = t;
  detail::g_thread_idx = th.idx;
  th.started = true;
  asan_leave(&g_asan.scheduler_fake, g_stacks.top(stack_slot(t)) - kFiberStackBytes,
             kFiberStackBytes);
  tsan_to_thread(t);
  fc::transfer_t back = fc::jump_fcontext(th.context, nullptr);
  asan_arrive(g_asan.scheduler_fake, nullptr, nullptr);
  th.context = back.fctx;
}

void report_deadlock(Launch& L) {
  // Group the waiting threads by what they wait at.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  std::vector<int> exited;
  for (int t = 0; t < L.n; ++t) {
    const Thread& th = L.threads[t];
    if (th.state == State::kExited) {
      exited.push_back(t);
      continue;
    }
    std::string key =
        th.state == State::kBarrier ? "__syncthreads() at " + where(th.site) : collective(th);
    auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == key; });
    if (it == groups.end())
      groups.push_back({key, {t}});
    else
      it->second.push_back(t);
  }
  std::string what = "no thread can run.";
  for (auto& [key, ids] : groups) {
    what += ' ';
    what += std::to_string(ids.size());
    what += " wait at ";
    what += key;
    what += " [threads ";
    what += detail::thread_ranges(ids);
    what += "];";
  }
  if (!exited.empty()) {
    what += ' ';
    what += std::to_string(exited.size());
    what += " exited [threads ";
    what += detail::thread_ranges(exited);
    what += ']';
  } else
    what += " none exited";
  record(L, Fault::kDeadlock, what);
}

// Runs one block to completion (or to its first fault); returns false on a fault.
bool run_block(Launch& L) {
  tsan_enter_block(L.counters.blocks);  // its fibers and their stacks
  char* const shared_begin = __start_dq_emu_shared;
  char* const shared_end = __stop_dq_emu_shared;
  if (shared_begin && shared_end > shared_begin) {
    tsan_forget_static_shared(shared_begin, shared_end);  // before the poison, which TSan sees
    std::memset(shared_begin, kPoison, static_cast<size_t>(shared_end - shared_begin));
  }
  if (L.dynamic) {
    if (DQ_EMU_TSAN) g_shared.renew();
    std::memset(g_shared.data(), kCanary, L.dynamic - g_shared.data());
    std::memset(L.dynamic, kPoison, g_shared.end() - L.dynamic);
  }
  L.head = 0;
  L.count = 0;
  L.released.clear();
  for (int t = 0; t < L.n; ++t) {
    Thread& th = L.threads[t];
    th.context = fc::make_fcontext(g_stacks.top(stack_slot(t)), kFiberStackBytes, &fiber_entry);
    th.started = false;
    th.n_atomic_reads = 0;
    th.fenced = false;
    L.released.push_back(t);
  }
  release(L);  // every thread ready, in the thread order
  for (Warp& w : L.warps) w.parked = w.claimed = 0;
  L.block_sync.reset(new char[2 + L.n]());
  // What the caller wrote before the launch, and this block's fresh shared memory. The scheduler
  // acquires nothing from a block before the launch ends, so this orders no block after another.
  tsan_release(&L.launch_sync[0]);
  L.live = L.n;
  L.arrived = 0;
  L.cancelling = false;
  while (L.count > 0 && L.fault == Fault::kNone) {
    const int t = L.ring[L.head];
    L.head = (L.head + 1) % L.n;
    --L.count;
    resume(L, t);
  }
  if (L.fault == Fault::kNone && L.live > 0) report_deadlock(L);
  if (L.fault != Fault::kNone) {
    // Unwind every fiber that is parked inside the kernel, so its destructors run.
    L.cancelling = true;
    for (int t = 0; t < L.n; ++t)
      if (L.threads[t].started && L.threads[t].state != State::kExited) resume(L, t);
  }
  L.block_sync.reset();  // TSan forgets the block's barrier clocks with the bytes
  if (L.fault != Fault::kNone) return false;
  if (L.dynamic) {
    for (const char* p = g_shared.data(); p < L.dynamic; ++p)
      if (static_cast<unsigned char>(*p) != kCanary) {
        record(L, Fault::kSharedUnderrun,
               "a byte " + std::to_string(L.dynamic - p) +
                   " before the start of the dynamic shared memory was written");
        return false;
      }
  }
  return true;
}

// ---- signals: guard pages and sanitizer deaths name the emulated thread ----------------------
void write_context(const char* what) {
  char buf[1024];
  int len;
  if (g_launch && g_launch->current >= 0) {
    const Launch& L = *g_launch;
    const uint3& i = detail::g_thread_idx;
    len = std::snprintf(
        buf, sizeof buf,
        "dq-emu: %s in kernel %s (launched at %s:%d), thread %d (threadIdx %u,%u,%u; "
        "warp %d lane %d) of block (%u,%u,%u)\n",
        what, L.site.kernel, L.site.file, L.site.line, L.current, i.x, i.y, i.z, L.current / 32,
        L.current % 32, detail::g_block_idx.x, detail::g_block_idx.y, detail::g_block_idx.z);
  } else {
    len = std::snprintf(buf, sizeof buf, "dq-emu: %s outside an emulated kernel\n", what);
  }
  if (len > 0) {
    ssize_t ignored = write(2, buf, std::min<size_t>(len, sizeof buf - 1));
    (void)ignored;
  }
}

void on_sanitizer_death() {
  write_context("sanitizer error");
}

void on_segv(int sig, siginfo_t* info, void*) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  if (g_shared.is_guard(a)) {
    char what[200];
    const long off =
        static_cast<long>(a - reinterpret_cast<uintptr_t>(g_launch ? g_launch->dynamic : nullptr));
    std::snprintf(
        what, sizeof what,
        "shared memory out of bounds: dynamic shared memory of %zu bytes accessed at offset %ld",
        g_launch ? g_launch->dynamic_bytes : 0, off);
    write_context(what);
  } else if (g_stacks.is_guard(a)) {
    write_context("fiber stack overflow (kFiberStackBytes per thread)");
  } else {
    write_context(sig == SIGBUS ? "bus error" : "segmentation fault");
  }
  signal(sig, SIG_DFL);
  std::abort();
}

struct SignalScope {
  struct sigaction old_segv {
  }, old_bus{};
  SignalScope() {
    static char* alt = [] {
      const size_t bytes = 64 * 1024;
      // mmap, not malloc: kept for the process's life, and LeakSanitizer does not count it.
      char* p = static_cast<char*>(
          mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
      stack_t ss{};
      ss.ss_sp = p;
      ss.ss_size = bytes;
      sigaltstack(&ss, nullptr);
      if (__sanitizer_set_death_callback) __sanitizer_set_death_callback(&on_sanitizer_death);
      return p;
    }();
    (void)alt;
    struct sigaction sa {};
    sa.sa_sigaction = &on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &old_segv);
    sigaction(SIGBUS, &sa, &old_bus);
  }
  ~SignalScope() {
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
  }
};

cudaError_t finish(Fault f, const std::string& message, cudaError_t code) {
  g_report.fault = f;
  g_report.message = message;
  g_last_error = code;
  return code;
}

}  // namespace

const Report& last_report() {
  return g_report;
}
const Counters& last_counters() {
  return g_counters;
}
uint64_t launches() {
  return g_launches.load();
}
void require_loaded(bool on) {
  g_require_loaded.store(on);
}

namespace detail {
namespace {

// Runs the launch's blocks one at a time, in the order `ordering` gives launch number `launch`;
// false at the first block that faults (its counters included, as in every order).
bool run_blocks(Launch& L, const BlockOrdering& ordering, uint64_t launch) {
  const dim3 g = L.grid;
  const uint64_t blocks = uint64_t{g.x} * g.y * g.z;
  std::vector<uint64_t> shuffled;
  if (ordering.order == BlockOrder::kShuffle) shuffled = block_sequence(ordering, blocks, launch);
  for (uint64_t i = 0; i < blocks; ++i) {
    const uint64_t b = ordering.order == BlockOrder::kIndex     ? i
                       : ordering.order == BlockOrder::kReverse ? blocks - 1 - i
                                                                : shuffled[i];
    g_block_idx = uint3{static_cast<unsigned>(b % g.x), static_cast<unsigned>(b / g.x % g.y),
                        static_cast<unsigned>(b / (uint64_t{g.x} * g.y))};
    const bool ok = run_block(L);
    ++L.counters.blocks;
    L.counters.threads += L.n;
    if (!ok) return false;
  }
  return true;
}

}  // namespace

cudaError_t run_grid(dim3 grid, dim3 block, size_t dynamic_bytes, void (*body)(void*),
                     void* context, const LaunchSite& site, const void* kernel) {
  g_launches.fetch_add(1);
  if (t_running != nullptr) {
    record(*t_running, Fault::kNestedLaunch,
           who(*t_running, t_running->current) + " launched " + site.kernel);
    throw Cancelled{};
  }
  detail::QuietLock lock(g_launch_mutex);
  g_counters = Counters{};
  const uint64_t read0 = g_global_read.load(), written0 = g_global_written.load();
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  char bad[300] = "";
  if (threads == 0 || threads > kMaxThreads || block.x > 1024 || block.y > 1024 || block.z > 64)
    std::snprintf(bad, sizeof bad, "block (%u,%u,%u)", block.x, block.y, block.z);
  else if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
           grid.z > 65535)
    std::snprintf(bad, sizeof bad, "grid (%u,%u,%u)", grid.x, grid.y, grid.z);
  else if (dynamic_bytes > kMaxDynamicShared)
    std::snprintf(bad, sizeof bad, "%zu bytes of dynamic shared memory", dynamic_bytes);
  if (g_require_loaded.load()) {
    std::lock_guard<std::mutex> loaded(g_loaded_mutex);
    if (g_loaded.count(kernel) == 0) {
      const std::string m = std::string("dq-emu: ") + fault_name(Fault::kNotLoaded) + ": kernel " +
                            site.kernel + " at " + site.file + ":" + std::to_string(site.line);
      std::fprintf(stderr, "%s\n", m.c_str());
      return finish(Fault::kNotLoaded, m, cudaErrorLaunchFailure);
    }
  }
  BlockOrdering ordering, thread_ordering;
  uint64_t order_launch = 0;
  std::string order_error;
  if (!bad[0] && launch_block_order(&ordering, &order_launch, &order_error) &&
      launch_thread_order(&thread_ordering, &order_error) &&
      ordering.order == BlockOrder::kShuffle &&
      uint64_t{grid.x} * grid.y * grid.z > kMaxShuffledBlocks)
    order_error = "a shuffled block order takes at most 2^24 blocks";
  if (bad[0] || !order_error.empty()) {
    std::string m = std::string("dq-emu: ") + fault_name(Fault::kBadConfig) + ": kernel " +
                    site.kernel + " launched at " + site.file + ":" + std::to_string(site.line) +
                    (bad[0] ? std::string(" with ") + bad : ": " + order_error);
    std::fprintf(stderr, "%s\n", m.c_str());
    return finish(Fault::kBadConfig, m, cudaErrorInvalidConfiguration);
  }
  Launch L;
  L.grid = grid;
  L.block = block;
  L.dynamic_bytes = dynamic_bytes;
  L.body = body;
  L.context = context;
  L.site = site;
  L.n = static_cast<int>(threads);
  L.threads.resize(L.n);
  L.ring.resize(L.n);
  L.released.reserve(L.n);
  L.thread_ordering = thread_ordering;
  L.thread_shuffle = thread_ordering.seed ^ splitmix64_finalise(order_launch);
  L.warps.resize((L.n + 31) / 32);
  for (int t = 0; t < L.n; ++t) {
    L.threads[t].idx = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
    L.warps[t / 32].exists |= 1u << (t % 32);
  }
  L.dynamic = g_shared.prepare(dynamic_bytes);
  SignalScope signals;
  g_launch = &L;
  t_running = &L;
  tsan_enter_launch();
  g_block_dim = block;
  g_grid_dim = grid;
  const bool ok = run_blocks(L, ordering, order_launch);
  tsan_acquire(&L.launch_sync[1]);  // the caller: after every thread of every block
  g_launch = nullptr;
  t_running = nullptr;
  L.current = -1;
  L.counters.global_read = g_global_read.load() - read0;
  L.counters.global_written = g_global_written.load() - written0;
  g_counters = L.counters;
  if (!ok) return finish(L.fault, L.message, cudaErrorLaunchFailure);
  return finish(Fault::kNone, "", cudaSuccess);
}

void* dynamic_shared() {
  return g_launch ? g_launch->dynamic : nullptr;
}

// The TSan build's __threadfence() with the atomics around it (emu.h). The running thread's
// state; nothing outside a launch.
namespace {
Thread* running_thread() {
  Launch* L = t_running;
  return L != nullptr && L->current >= 0 ? &L->threads[L->current] : nullptr;
}
}  // namespace
void note_atomic_read(const void* p) {
#if DQ_EMU_TSAN
  Thread* me = running_thread();
  if (me == nullptr) return;
  const void** const reads = me->atomic_reads;
  if (std::find(reads, reads + me->n_atomic_reads, p) != reads + me->n_atomic_reads) return;
  if (me->n_atomic_reads == kMaxAtomicReads)
    fail_in_fiber(Fault::kTsanLimit, who(*t_running, t_running->current) + " read over " +
                                         std::to_string(kMaxAtomicReads) +
                                         " words atomically between two __threadfence() calls");
  reads[me->n_atomic_reads++] = p;
#else
  (void)p;
#endif
}
void note_atomic_write(void* p) {
  Thread* me = running_thread();
  if (me != nullptr && me->fenced) tsan_release(p);
}
void thread_fence() {
  Thread* me = running_thread();
  if (me == nullptr) return;
#if DQ_EMU_TSAN
  for (int i = 0; i < me->n_atomic_reads; ++i) tsan_acquire(const_cast<void*>(me->atomic_reads[i]));
#endif
  me->n_atomic_reads = 0;
  me->fenced = true;
}

void poll_missed(const std::source_location& loc) {
  fail_in_fiber(Fault::kDeadlock,
                who(*g_launch, g_launch->current) + " polled at " + where(loc) +
                    " for a word nothing can write while it polls (one block at a time, a thread "
                    "until it yields): it waits for a block that has not run (block order " +
                    block_order_name(block_order()) + ")");
}

void misaligned_global(const void* p, size_t align) {
  char address[32];
  std::snprintf(address, sizeof address, "%p", p);
  fail_in_fiber(Fault::kMisaligned, who(*g_launch, g_launch->current) +
                                        " accessed global memory at " + address +
                                        ", not a multiple of its type's alignment, " +
                                        std::to_string(align) + " bytes");
}

void barrier(const std::source_location& loc) {
  Launch& L = *g_launch;
  ++L.counters.barriers;
  if (L.arrived == 0) {
    L.barrier_site = loc;
    L.barrier_first = L.current;
  } else if (!same_site(loc, L.barrier_site)) {
    fail_in_fiber(Fault::kBarrierDivergence, who(L, L.current) + " reached __syncthreads() at " +
                                                 where(loc) + " while " + who(L, L.barrier_first) +
                                                 " waits at __syncthreads() at " +
                                                 where(L.barrier_site));
  }
  Thread& me = L.threads[L.current];
  // A round's threads release into its byte and acquire it when the round completes; the next
  // round's releases go into the other byte, so no thread acquires a later round's.
  char* const round_sync = &L.block_sync[L.barrier_round & 1];
  tsan_release(round_sync);
  if (++L.arrived == L.n) {  // the round is complete: release the others
    L.arrived = 0;
    ++L.barrier_round;
    // Index order: this thread carries on at once, the others after it by index. Otherwise it
    // takes its turn among them.
    const bool index = L.thread_ordering.order == BlockOrder::kIndex;
    for (int t = 0; t < L.n; ++t)
      if (L.threads[t].state == State::kBarrier || (t == L.current && !index))
        L.released.push_back(t);
    release(L);
    if (!index) park();
    tsan_acquire(round_sync);
    return;
  }
  me.state = State::kBarrier;
  me.site = loc;
  park();
  tsan_acquire(round_sync);
}

uint64_t warp_op(Op op, unsigned mask, uint64_t value, int param, int width,
                 const std::source_location& loc) {
  Launch& L = *g_launch;
  ++L.counters.collectives;
  const int tid = L.current, lane = tid & 31;
  Warp& w = L.warps[tid >> 5];
  Thread& me = L.threads[tid];
  me.op = op;
  me.mask = mask;
  me.param = param;
  me.width = width;
  me.value = value;
  me.site = loc;
  const unsigned bit = 1u << lane;
  char hex[64];
  if (!(mask & bit))
    fail_in_fiber(Fault::kBadMask, who(L, tid) + " calls " + collective(me) +
                                       " with a mask that leaves out its own lane");
  if (mask & ~w.exists) {
    std::snprintf(hex, sizeof hex, "0x%08x", w.exists);
    fail_in_fiber(Fault::kBadMask, who(L, tid) + " calls " + collective(me) +
                                       " naming lanes absent from the block (present: " + hex +
                                       ")");
  }
  if (op <= Op::kXor && (width < 1 || width > 32 || (width & (width - 1)) != 0))
    fail_in_fiber(Fault::kBadWidth, who(L, tid) + " calls " + collective(me));
  auto matches = [&](const Thread& o) {
    return o.op == op && o.mask == mask && (op > Op::kXor || o.width == width) &&
           same_site(o.site, loc);
  };
  if (w.claimed & bit) {  // a pending collective names this lane: it must be the same one
    const Thread& o = L.threads[(tid & ~31) + w.owner[lane]];
    if (!matches(o))
      fail_in_fiber(Fault::kWarpMismatch, who(L, tid) + " calls " + collective(me) +
                                              " while lane " + std::to_string(w.owner[lane]) +
                                              " waits in " + collective(o));
  } else if (w.claimed & mask) {  // a new collective overlapping a pending one
    const int other = w.owner[__builtin_ctz(w.claimed & mask)];
    fail_in_fiber(Fault::kWarpMismatch, who(L, tid) + " calls " + collective(me) + " while lane " +
                                            std::to_string(other) + " waits in " +
                                            collective(L.threads[(tid & ~31) + other]));
  } else {
    w.claimed |= mask;
    for (unsigned m = mask; m; m &= m - 1) w.owner[__builtin_ctz(m)] = static_cast<uint8_t>(lane);
  }
  // TSan: a __syncwarp orders its lanes' memory, through the byte of the lane that claimed the
  // group; shuffles and votes exchange values but order no memory, as on a GPU.
  char* const warp_sync =
      op == Op::kSyncWarp ? &L.block_sync[2 + (tid & ~31) + w.owner[lane]] : nullptr;
  if (warp_sync) tsan_release(warp_sync);
  w.parked |= bit;
  if ((w.parked & mask) != mask) {
    me.state = State::kWarp;
    park();
    if (warp_sync) tsan_acquire(warp_sync);
    return me.result;
  }
  // Every lane of the mask is here: compute each lane's result by the PTX shfl/vote rules.
  const int base = tid & ~31;
  uint64_t ballot = 0;
  if (op == Op::kBallot || op == Op::kAny || op == Op::kAll)
    for (unsigned m = mask; m; m &= m - 1)
      if (L.threads[base + __builtin_ctz(m)].value) ballot |= 1u << __builtin_ctz(m);
  for (unsigned m = mask; m; m &= m - 1) {
    const int l = __builtin_ctz(m);
    Thread& t = L.threads[base + l];
    switch (op) {
      case Op::kBallot:
        t.result = ballot;
        break;
      case Op::kAny:
        t.result = ballot != 0;
        break;
      case Op::kAll:
        t.result = ballot == mask;
        break;
      case Op::kSyncWarp:
        t.result = 0;
        break;
      default: {
        const int seg = (32 - t.width) & 31;  // c[12:8]: the segment's lane bits
        const int min_lane = l & seg;
        const int max_lane = min_lane | (op == Op::kUp ? 0 : (31 & ~seg));
        const int b = t.param & 31;
        int j = 0;
        bool take = false;
        if (op == Op::kUp) {
          j = l - b;
          take = j >= max_lane;
        } else if (op == Op::kDown) {
          j = l + b;
          take = j <= max_lane;
        } else if (op == Op::kXor) {
          j = l ^ b;
          take = j <= max_lane;
        } else {
          j = min_lane | (b & ~seg);
          take = j <= max_lane;
        }
        if (!take) {
          t.result = t.value;
        } else if (!(mask & (1u << j))) {
          std::snprintf(hex, sizeof hex, "%d", j);
          fail_in_fiber(Fault::kLaneOutsideMask, who(L, base + l) + " in " + collective(t) +
                                                     " reads lane " + hex +
                                                     ", which is not in the mask");
        } else {
          t.result = L.threads[base + j].value;
        }
      }
    }
    // Index order: this lane carries on at once, the others after it; otherwise it takes its turn.
    if (l != lane || L.thread_ordering.order != BlockOrder::kIndex) L.released.push_back(base + l);
  }
  w.parked &= ~mask;
  w.claimed &= ~mask;
  release(L);
  if (L.thread_ordering.order != BlockOrder::kIndex) park();
  if (warp_sync) tsan_acquire(warp_sync);
  return me.result;
}

}  // namespace detail
}  // namespace dq::emu

// ---- the runtime subset
// ---------------------------------------------------------------------------
cudaError_t cudaGetLastError() {
  const cudaError_t e = dq::emu::g_last_error;
  dq::emu::g_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() {
  return dq::emu::g_last_error;
}
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* kernel) {
  if (attr == nullptr || kernel == nullptr) return cudaErrorInvalidValue;
  *attr = cudaFuncAttributes{};
  std::lock_guard<std::mutex> lock(dq::emu::g_loaded_mutex);
  dq::emu::g_loaded.insert(kernel);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  return cudaGetLastError();
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  return cudaGetLastError();
}
