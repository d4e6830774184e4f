// An emulation of CUDA's execution model on the CPU, so that kernel source written for nvcc runs
// unchanged under g++ in CI (kernels/cuda/EMULATION.md). Kernel files never include this header
// directly: they include kernels/cuda/cuda_compat.h, which picks the CUDA runtime under nvcc and
// this header otherwise.
//
// Model: every CUDA thread is a fiber; the blocks of a grid run one after another on the calling
// OS thread (in blockIdx order unless set_block_order or DQ_EMU_BLOCK_ORDER picks another); a
// fiber gives up the CPU only at __syncthreads and at warp collectives, so plain memory operations
// (atomics included) between two of those are never interleaved. Launches are synchronous. What the
// scheduler checks (divergent barriers, deadlocks, warp masks) ends the launch with
// cudaErrorLaunchFailure and a report (dq::emu::last_report()).
#pragma once
#if defined(__CUDACC__)
#error "kernels/cuda/emu/emu.h is the host emulation; under nvcc include cuda_runtime.h"
#endif
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---- qualifiers --------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Static shared memory: one static object per kernel, in a section the emulator fills with 0xFF
// before every block. Only in non-template, non-inline kernels (EMULATION.md, rules).
#define __shared__ static __attribute__((section("dq_emu_shared")))

// A kernel built with ThreadSanitizer (the TSan build's kernels and tests; the emulator itself is
// built without it and says so with DQ_EMU_TSAN): its atomics and fences tell the emulator what
// they order (EMULATION.md, "ThreadSanitizer").
#if defined(__SANITIZE_THREAD__)
#define DQ_EMU_TSAN_KERNELS 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DQ_EMU_TSAN_KERNELS 1
#endif
#endif
#ifndef DQ_EMU_TSAN_KERNELS
#define DQ_EMU_TSAN_KERNELS 0
#endif
#if DQ_EMU_TSAN_KERNELS
#define DQ_EMU_NOTE_ATOMIC_READ(p) ::dq::emu::detail::note_atomic_read(p)
#define DQ_EMU_NOTE_ATOMIC_WRITE(p) ::dq::emu::detail::note_atomic_write(p)
#else
#define DQ_EMU_NOTE_ATOMIC_READ(p) (void)0
#define DQ_EMU_NOTE_ATOMIC_WRITE(p) (void)0
#endif

// ---- built-in types and variables ---------------------------------------------------------------
struct uint3 {
  unsigned int x, y, z;
};
// CUDA's 16-byte vector type (the accessors' widest load).
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

namespace dq::emu::detail {
// The running thread's coordinates, set by the scheduler before it resumes a fiber.
inline uint3 g_thread_idx{0, 0, 0};
inline uint3 g_block_idx{0, 0, 0};
inline dim3 g_block_dim{1, 1, 1};
inline dim3 g_grid_dim{1, 1, 1};
}  // namespace dq::emu::detail

inline const uint3& threadIdx = dq::emu::detail::g_thread_idx;
inline const uint3& blockIdx = dq::emu::detail::g_block_idx;
inline const dim3& blockDim = dq::emu::detail::g_block_dim;
inline const dim3& gridDim = dq::emu::detail::g_grid_dim;
constexpr int warpSize = 32;

// ---- the runtime subset the kernels' launchers use ---------------------------------------------
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
using cudaError = cudaError_t;
struct CUstream_st;
using cudaStream_t = CUstream_st*;

cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
// A kernel's attributes. The emulation has none to report (zeros); what it keeps is the call
// itself: CUDA loads a kernel's module when its attributes are asked for (lazy loading otherwise
// loads it at the first launch, which can wait for the device to go idle), so a device asks for
// every kernel's attributes at set-up, and the emulation remembers which kernels were loaded
// (dq::emu::require_loaded).
struct cudaFuncAttributes {
  size_t sharedSizeBytes = 0, constSizeBytes = 0, localSizeBytes = 0;
  int maxThreadsPerBlock = 1024, numRegs = 0, ptxVersion = 0, binaryVersion = 0;
};
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* kernel);
template <class... P>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, void (*kernel)(P...)) {
  return cudaFuncGetAttributes(attr, reinterpret_cast<const void*>(kernel));
}
const char* cudaGetErrorString(cudaError_t error);
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
namespace dq::emu::detail {
inline std::atomic<int> g_multiprocessors{132};
}  // namespace dq::emu::detail
// One emulated device, 0, whose SM count (for launchers that size grids by it) is 132 (an H100's
// or H200's) unless a test sets another (dq::emu::set_multiprocessors).
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (attr != cudaDevAttrMultiProcessorCount || device != 0) return cudaErrorInvalidValue;
  *value = dq::emu::detail::g_multiprocessors.load();
  return cudaSuccess;
}

namespace dq::emu {

// What ended a launch early.
enum class Fault : uint8_t {
  kNone = 0,
  kBadConfig,          // grid / block / shared-memory size CUDA would refuse
  kNestedLaunch,       // a launch from inside an emulated kernel
  kDeadlock,           // nothing runnable while threads remain (a barrier or collective never met)
  kBarrierDivergence,  // threads of one barrier round at different __syncthreads call sites
  kWarpMismatch,       // lanes of one mask at different intrinsics, masks, widths or call sites
  kBadMask,            // the calling lane is not in its mask, or the mask names absent lanes
  kLaneOutsideMask,    // a shuffle reads a lane outside the mask
  kBadWidth,           // shuffle width not a power of two in 1..32
  kSharedUnderrun,     // bytes before the dynamic shared buffer were written
  kException,          // a C++ exception left the kernel
  kNotLoaded,          // require_loaded() is on and the kernel was never loaded
  kMisaligned,         // a global-memory access of T at an address not a multiple of alignof(T)
  kTsanLimit,          // TSan build: over kMaxAtomicReads words read atomically between fences
};
const char* fault_name(Fault f);

struct Report {
  Fault fault = Fault::kNone;
  std::string message;  // empty when the launch succeeded
};
// The report of the latest launch on this process (kept until the next launch).
const Report& last_report();

// Counters of the latest launch: barrier arrivals (thread-barriers), warp-collective arrivals,
// threads run, blocks run.
// global_read / global_written: bytes of global memory the kernel read and wrote through the
// accessors of kernels/cuda/cuda_compat.h (load_global, store_global; bytes as each thread asks
// for them, so a value two threads read counts twice).
struct Counters {
  uint64_t barriers = 0, collectives = 0, threads = 0, blocks = 0;
  uint64_t global_read = 0, global_written = 0;
};
const Counters& last_counters();

// Launches started on this process (refused ones included): a test counts a call's launches as
// the difference.
uint64_t launches();
// The SM count cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount) reports.
inline void set_multiprocessors(int n) {
  detail::g_multiprocessors.store(n);
}
// While on, a launch of a kernel whose attributes were never asked for (cudaFuncGetAttributes)
// fails with Fault::kNotLoaded: on a GPU its module would load mid-call.
void require_loaded(bool on);

// The order in which a launch runs its blocks, one at a time either way (EMULATION.md, "Block
// order"). A GPU runs a grid's blocks in any order, so kernels that hand work between blocks must
// not depend on it; kIndex (blockIdx order, x fastest) is the default.
enum class BlockOrder : uint8_t {
  kIndex,    // blockIdx order, x fastest
  kReverse,  // the last block first
  kShuffle,  // a pseudo-random permutation from the seed and the launch's number (block_sequence)
};
struct BlockOrdering {
  BlockOrder order = BlockOrder::kIndex;
  uint64_t seed = 0;  // kShuffle only
};
// Reads the syntax of DQ_EMU_BLOCK_ORDER: "index", "reverse" or "shuffle:SEED" (SEED decimal, 0 to
// 2^64 - 1). False, with a message naming `text` in *error, for anything else.
bool parse_block_order(const char* text, BlockOrdering* out, std::string* error);
// The order of this process's later launches, overriding DQ_EMU_BLOCK_ORDER (read at the first
// launch otherwise); it restarts every thread's launch numbering for kShuffle at 0.
void set_block_order(const BlockOrdering& ordering);
// The DQ_EMU_BLOCK_ORDER text of an order ("index", "reverse", "shuffle:SEED").
std::string block_order_name(const BlockOrdering& ordering);
// The order launches use now (the environment's, once a launch has read it).
BlockOrdering block_order();
// The blocks' linear numbers (x fastest: x + grid.x (y + grid.y z)) in the order a launch runs
// them: launch `launch` of `blocks` blocks under `ordering`. kShuffle: a Fisher-Yates shuffle
// driven by SplitMix64 (EMULATION.md gives the exact steps, so a failure reproduces from its seed).
std::vector<uint64_t> block_sequence(const BlockOrdering& ordering, uint64_t blocks,
                                     uint64_t launch);

// The order in which the threads a barrier or a warp collective releases run, until each next
// yields (EMULATION.md, "Thread order"): kIndex (the default) runs them in thread order, the
// releasing thread first; kReverse the highest thread first; kShuffle a pseudo-random order each
// release, from the seed and the launch's number. A GPU runs them concurrently, so a kernel that
// reads what another thread writes without a barrier between gets what the order gives; running
// its tests in the three orders shows such a race as a changed result. The same syntax as the
// block order (parse_block_order), read from DQ_EMU_THREAD_ORDER.
bool parse_thread_order(const char* text, BlockOrdering* out, std::string* error);
void set_thread_order(const BlockOrdering& ordering);
BlockOrdering thread_order();

// Bytes of each fiber's stack (a kernel's locals live there); one guard page below it.
inline constexpr size_t kFiberStackBytes = 64 * 1024;

namespace detail {
// Global-memory bytes counted by the accessors since the process started; a launch reports the
// difference (atomics: blocks may one day run on several OS threads).
inline std::atomic<uint64_t> g_global_read{0};
inline std::atomic<uint64_t> g_global_written{0};
}  // namespace detail
inline void count_global_read(size_t bytes) {
  detail::g_global_read.fetch_add(bytes, std::memory_order_relaxed);
}
inline void count_global_written(size_t bytes) {
  detail::g_global_written.fetch_add(bytes, std::memory_order_relaxed);
}
namespace detail {
[[noreturn]] void misaligned_global(const void* p, size_t align);
}  // namespace detail
// A global access of a type aligned to `align` bytes (16 for uint4) at p, which CUDA refuses
// unless p is a multiple of align (the kernel fails with cudaErrorMisalignedAddress; x86 lets it
// pass).
inline void check_global_alignment(const void* p, size_t align) {
  if (reinterpret_cast<uintptr_t>(p) % align != 0) detail::misaligned_global(p, align);
}
// The bytes counted since the process started, read plus written: a test takes the difference
// over a call of several launches.
inline uint64_t global_bytes_so_far() {
  return detail::g_global_read.load() + detail::g_global_written.load();
}

namespace detail {

enum class Op : uint8_t { kIdx, kUp, kDown, kXor, kBallot, kAny, kAll, kSyncWarp };

struct LaunchSite {
  const char* kernel;
  const char* file;
  int line;
};

cudaError_t run_grid(dim3 grid, dim3 block, size_t dynamic_shared, void (*body)(void*),
                     void* context, const LaunchSite& site, const void* kernel);
// The order for the next launch on this thread and its number there (since the order was last
// set); false, with the reason, when DQ_EMU_BLOCK_ORDER holds no order.
bool launch_block_order(BlockOrdering* ordering, uint64_t* launch, std::string* error);
// The thread order for the next launch; false, with the reason, when DQ_EMU_THREAD_ORDER holds no
// order.
bool launch_thread_order(BlockOrdering* ordering, std::string* error);
// The CUDA name of a warp collective ("__shfl_xor_sync").
const char* collective_name(Op op);
// "0-199, 256" from a sorted list of thread numbers (the emulator's fault messages).
std::string thread_ranges(const std::vector<int>& ids);
// The running thread polled a word that is not ready: a fault (dq::cuda::poll_missed()).
[[noreturn]] void poll_missed(const std::source_location& loc);
void barrier(const std::source_location& loc);
uint64_t warp_op(Op op, unsigned mask, uint64_t value, int param, int width,
                 const std::source_location& loc);
void* dynamic_shared();
// The TSan build's memory order between blocks (EMULATION.md, "ThreadSanitizer"): a thread's
// atomic read of p (acquired at its next __threadfence), its atomic write of p (a release when it
// has fenced before; called right after the store, which a release before it would not cover in
// TSan's clocks), and its __threadfence. Called from the kernels in that build only.
void note_atomic_read(const void* p);
void note_atomic_write(void* p);
void thread_fence();

template <class T>
uint64_t to_bits(T v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8,
                "shuffle of a type over 8 bytes");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
T from_bits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

template <class... P, class... A>
cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t dynamic_shared_bytes,
                   cudaStream_t, const LaunchSite& site, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "DQ_LAUNCH: wrong number of kernel arguments");
  // Arguments are converted to the parameter types once; every thread gets its own copy.
  using Params = std::tuple<std::decay_t<P>...>;
  struct Context {
    void (*kernel)(P...);
    Params params;
  };
  Context context{kernel, Params(static_cast<std::decay_t<P>>(std::forward<A>(args))...)};
  auto body = [](void* c) {
    auto* ctx = static_cast<Context*>(c);
    Params mine = ctx->params;
    std::apply(ctx->kernel, mine);
  };
  return run_grid(grid, block, dynamic_shared_bytes, body, &context, site,
                  reinterpret_cast<const void*>(kernel));
}

}  // namespace detail
}  // namespace dq::emu

// ---- launch and dynamic shared memory -----------------------------------------------------------
// The emulated launch runs the whole grid before it returns and evaluates to a cudaError_t (also
// left for cudaGetLastError()).
#define DQ_LAUNCH(kernel, grid, block, shmem, stream, ...)                              \
  ::dq::emu::detail::launch(kernel, grid, block, shmem, stream,                         \
                            ::dq::emu::detail::LaunchSite{#kernel, __FILE__, __LINE__}, \
                            ##__VA_ARGS__)
// The launch's dynamic shared memory (0xFF before every block; a guard page right after it).
#define DQ_DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(::dq::emu::detail::dynamic_shared())

// ---- synchronisation and warp collectives -------------------------------------------------------
inline void __syncthreads(std::source_location loc = std::source_location::current()) {
  dq::emu::detail::barrier(loc);
}
inline void __syncwarp(unsigned mask = 0xffffffffu,
                       std::source_location loc = std::source_location::current()) {
  dq::emu::detail::warp_op(dq::emu::detail::Op::kSyncWarp, mask, 0, 0, 32, loc);
}
// Only in the TSan build does a fence do anything here (blocks run one at a time): there it
// orders this thread's writes before its later atomic writes, and its earlier atomic reads before
// its later accesses, as CUDA's memory model has a fence with relaxed atomics around it.
inline void __threadfence() {
#if DQ_EMU_TSAN_KERNELS
  dq::emu::detail::thread_fence();
#endif
}
inline void __threadfence_block() {}

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32,
              std::source_location loc = std::source_location::current()) {
  using namespace dq::emu::detail;
  return from_bits<T>(warp_op(Op::kIdx, mask, to_bits(var), src_lane, width, loc));
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned int delta, int width = 32,
                 std::source_location loc = std::source_location::current()) {
  using namespace dq::emu::detail;
  return from_bits<T>(warp_op(Op::kUp, mask, to_bits(var), static_cast<int>(delta), width, loc));
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned int delta, int width = 32,
                   std::source_location loc = std::source_location::current()) {
  using namespace dq::emu::detail;
  return from_bits<T>(warp_op(Op::kDown, mask, to_bits(var), static_cast<int>(delta), width, loc));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                  std::source_location loc = std::source_location::current()) {
  using namespace dq::emu::detail;
  return from_bits<T>(warp_op(Op::kXor, mask, to_bits(var), lane_mask, width, loc));
}
inline unsigned __ballot_sync(unsigned mask, int predicate,
                              std::source_location loc = std::source_location::current()) {
  using namespace dq::emu::detail;
  return static_cast<unsigned>(warp_op(Op::kBallot, mask, predicate != 0, 0, 32, loc));
}
inline int __any_sync(unsigned mask, int predicate,
                      std::source_location loc = std::source_location::current()) {
  using namespace dq::emu::detail;
  return static_cast<int>(warp_op(Op::kAny, mask, predicate != 0, 0, 32, loc));
}
inline int __all_sync(unsigned mask, int predicate,
                      std::source_location loc = std::source_location::current()) {
  using namespace dq::emu::detail;
  return static_cast<int>(warp_op(Op::kAll, mask, predicate != 0, 0, 32, loc));
}

// ---- integer and bit intrinsics -----------------------------------------------------------------
inline int __popc(unsigned int x) {
  return __builtin_popcount(x);
}
inline int __popcll(unsigned long long x) {
  return __builtin_popcountll(x);
}
inline int __clz(int x) {
  return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x));
}
inline int __clzll(long long x) {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline int __ffs(int x) {
  return __builtin_ffs(x);
}
inline int __ffsll(long long x) {
  return __builtin_ffsll(x);
}
inline unsigned int __brev(unsigned int x) {
  unsigned int r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned int __float_as_uint(float f) {
  return dq::emu::detail::from_bits<unsigned>(dq::emu::detail::to_bits(f));
}
inline float __uint_as_float(unsigned int u) {
  return dq::emu::detail::from_bits<float>(u);
}
inline int __float_as_int(float f) {
  return dq::emu::detail::from_bits<int>(dq::emu::detail::to_bits(f));
}
inline float __int_as_float(int i) {
  return dq::emu::detail::from_bits<float>(static_cast<uint32_t>(i));
}
template <class T>
inline T __ldg(const T* p) {
  return *p;
}

// ---- atomics: the overloads CUDA has, as a read and a write with no fiber switch between --------
// Both are atomic accesses (relaxed, as CUDA's atomics): ThreadSanitizer then takes two threads'
// atomics on one word for what they are, not for a race, and still reports a plain access that
// no barrier orders against them.
#define DQ_EMU_ATOMIC(name, type, expr)               \
  inline type name(type* address, type val) {         \
    type old;                                         \
    DQ_EMU_NOTE_ATOMIC_READ(address);                 \
    __atomic_load(address, &old, __ATOMIC_RELAXED);   \
    type next = (expr);                               \
    __atomic_store(address, &next, __ATOMIC_RELAXED); \
    DQ_EMU_NOTE_ATOMIC_WRITE(address);                \
    return old;                                       \
  }
DQ_EMU_ATOMIC(atomicAdd, int, old + val)
DQ_EMU_ATOMIC(atomicAdd, unsigned int, old + val)
DQ_EMU_ATOMIC(atomicAdd, unsigned long long, old + val)
DQ_EMU_ATOMIC(atomicAdd, float, old + val)
DQ_EMU_ATOMIC(atomicAdd, double, old + val)
DQ_EMU_ATOMIC(atomicSub, int, old - val)
DQ_EMU_ATOMIC(atomicSub, unsigned int, old - val)
DQ_EMU_ATOMIC(atomicExch, int, val)
DQ_EMU_ATOMIC(atomicExch, unsigned int, val)
DQ_EMU_ATOMIC(atomicExch, unsigned long long, val)
DQ_EMU_ATOMIC(atomicExch, float, val)
DQ_EMU_ATOMIC(atomicMax, int, old > val ? old : val)
DQ_EMU_ATOMIC(atomicMax, unsigned int, old > val ? old : val)
DQ_EMU_ATOMIC(atomicMax, long long, old > val ? old : val)
DQ_EMU_ATOMIC(atomicMax, unsigned long long, old > val ? old : val)
DQ_EMU_ATOMIC(atomicMin, int, old < val ? old : val)
DQ_EMU_ATOMIC(atomicMin, unsigned int, old < val ? old : val)
DQ_EMU_ATOMIC(atomicMin, long long, old < val ? old : val)
DQ_EMU_ATOMIC(atomicMin, unsigned long long, old < val ? old : val)
DQ_EMU_ATOMIC(atomicOr, int, old | val)
DQ_EMU_ATOMIC(atomicOr, unsigned int, old | val)
DQ_EMU_ATOMIC(atomicOr, unsigned long long, old | val)
DQ_EMU_ATOMIC(atomicAnd, int, old& val)
DQ_EMU_ATOMIC(atomicAnd, unsigned int, old& val)
DQ_EMU_ATOMIC(atomicAnd, unsigned long long, old& val)
DQ_EMU_ATOMIC(atomicXor, int, old ^ val)
DQ_EMU_ATOMIC(atomicXor, unsigned int, old ^ val)
DQ_EMU_ATOMIC(atomicXor, unsigned long long, old ^ val)
#undef DQ_EMU_ATOMIC
#define DQ_EMU_ATOMIC_CAS(type)                                  \
  inline type atomicCAS(type* address, type compare, type val) { \
    type old;                                                    \
    DQ_EMU_NOTE_ATOMIC_READ(address);                            \
    __atomic_load(address, &old, __ATOMIC_RELAXED);              \
    if (old == compare) {                                        \
      __atomic_store(address, &val, __ATOMIC_RELAXED);           \
      DQ_EMU_NOTE_ATOMIC_WRITE(address);                         \
    }                                                            \
    return old;                                                  \
  }
DQ_EMU_ATOMIC_CAS(int)
DQ_EMU_ATOMIC_CAS(unsigned int)
DQ_EMU_ATOMIC_CAS(unsigned long long)
DQ_EMU_ATOMIC_CAS(unsigned short)
#undef DQ_EMU_ATOMIC_CAS
