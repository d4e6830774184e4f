// A stand-in for libcuda.so.1, for testing the CPU NCCL's staging of device buffers
// (config/cuda_staging.h) on machines without a GPU. It implements the few driver
// functions the staging uses, strictly:
// - "device memory" is a PROT_NONE mapping: the CPU NCCL touching it directly instead of
//   through the copies crashes (SIGSEGV), as it would with real device memory;
// - every copy and write on a stream is deferred until cuStreamSynchronize of that stream (or
//   the next operation on it), so a host copy read before synchronising holds stale bytes and
//   a result copied back without synchronising is not there when the call returns;
// - the copies fail with CUDA_ERROR_INVALID_CONTEXT unless the fake context is current on the
//   calling thread (the CPU NCCL may run an operation on a thread of its own);
// - cuPointerGetAttribute answers CUDA_ERROR_NOT_INITIALIZED until fakeCudaInit (as the driver
//   does before anything called cuInit);
// - graph capture (fakeCudaBeginCapture / fakeCudaEndCapture, one stream at a time, global mode):
//   cuStreamIsCapturing reports it; a synchronisation of the capturing stream or of the legacy
//   stream fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture, as CUDA
//   does; copies enqueued on the capturing stream are captured, not run. The end reports
//   CUDA_ERROR_STREAM_CAPTURE_INVALIDATED when anything invalidated it.
// The test drives it through the fakeCuda* functions (dlopen of the same path).
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace {

constexpr int kSuccess = 0, kInvalidValue = 1, kNotInitialized = 3, kInvalidContext = 201;
constexpr int kCaptureUnsupported = 900, kCaptureInvalidated = 901, kStreamCaptureImplicit = 906;
constexpr size_t kArenaBytes = size_t{1} << 30;  // reserved, not committed

struct Stream {
  std::deque<std::function<void()>> pending;
};

std::mutex g_mutex;
bool g_init = false;
char* g_arena = nullptr;
size_t g_used = 0;
int g_fake_context = 0;  // its address is the context
Stream g_default_stream;
thread_local int t_context_depth = 0;
Stream* g_capturing = nullptr;  // the stream being captured, if any
bool g_capture_invalidated = false;
unsigned long long g_counts[4] = {};  // dtoh, htod, syncs, attribute queries

bool in_arena(const void* p) {
  const char* c = static_cast<const char*>(p);
  return g_arena != nullptr && c >= g_arena && c < g_arena + g_used;
}

Stream* stream_of(void* s) {
  // 0, CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2): the one default stream.
  if (reinterpret_cast<uintptr_t>(s) <= 2) return &g_default_stream;
  return static_cast<Stream*>(s);
}

// Device memory is readable and writable only inside these calls (under the mutex).
void open_arena(bool open) {
  if (g_arena != nullptr && g_used > 0)
    mprotect(g_arena, (g_used + 4095) & ~size_t{4095}, open ? PROT_READ | PROT_WRITE : PROT_NONE);
}

void run_pending(Stream* s) {
  open_arena(true);
  while (!s->pending.empty()) {
    s->pending.front()();
    s->pending.pop_front();
  }
  open_arena(false);
}

}  // namespace

// The project builds with -fvisibility=hidden: these are the library's interface.
#pragma GCC visibility push(default)
extern "C" {

// ---- the driver API subset ----
int cuPointerGetAttribute(void* data, int attribute, unsigned long long ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  ++g_counts[3];
  if (!g_init) return kNotInitialized;
  const void* p = reinterpret_cast<const void*>(ptr);
  if (!in_arena(p)) return kInvalidValue;
  switch (attribute) {
    case 1:
      *static_cast<void**>(data) = &g_fake_context;
      return kSuccess;  // CONTEXT
    case 2:
      *static_cast<unsigned*>(data) = 2;
      return kSuccess;  // MEMORY_TYPE
    case 9:
      *static_cast<int*>(data) = 0;
      return kSuccess;  // DEVICE_ORDINAL
    default:
      return kInvalidValue;
  }
}

int cuCtxPushCurrent_v2(void* ctx) {
  if (ctx != &g_fake_context) return kInvalidContext;
  ++t_context_depth;
  return kSuccess;
}

int cuCtxPopCurrent_v2(void** ctx) {
  if (t_context_depth == 0) return kInvalidContext;
  --t_context_depth;
  if (ctx) *ctx = &g_fake_context;
  return kSuccess;
}

int cuMemcpyDtoHAsync_v2(void* dst, unsigned long long src, size_t bytes, void* stream) {
  if (t_context_depth == 0) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  const char* s = reinterpret_cast<const char*>(src);
  if (!in_arena(s) || !in_arena(s + bytes - 1)) return kInvalidValue;
  ++g_counts[0];
  if (stream_of(stream) == g_capturing) return kSuccess;  // captured into the graph, not run
  stream_of(stream)->pending.push_back([=] { std::memcpy(dst, s, bytes); });
  return kSuccess;
}

int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, size_t bytes, void* stream) {
  if (t_context_depth == 0) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  char* d = reinterpret_cast<char*>(dst);
  if (!in_arena(d) || !in_arena(d + bytes - 1)) return kInvalidValue;
  ++g_counts[1];
  if (stream_of(stream) == g_capturing) return kSuccess;  // captured into the graph, not run
  stream_of(stream)->pending.push_back([=] { std::memcpy(d, src, bytes); });
  return kSuccess;
}

int cuStreamSynchronize(void* stream) {
  if (t_context_depth == 0) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mutex);
  ++g_counts[2];
  Stream* s = stream_of(stream);
  if (g_capturing != nullptr && (s == g_capturing || s == &g_default_stream)) {
    g_capture_invalidated = true;
    return kCaptureUnsupported;
  }
  run_pending(s);
  return kSuccess;
}

// CU_STREAM_CAPTURE_STATUS_NONE (0) or _ACTIVE (1), or _INVALIDATED (2) once a call broke it. The
// legacy stream (0 or CU_STREAM_LEGACY) asked while another stream captures (a blocking one, as
// this driver's are): CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, the capture kept, as CUDA answers.
int cuStreamIsCapturing(void* stream, int* status) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const bool legacy = reinterpret_cast<uintptr_t>(stream) <= 1;
  if (legacy && g_capturing != nullptr && g_capturing != &g_default_stream)
    return kStreamCaptureImplicit;
  *status = stream_of(stream) != g_capturing ? 0 : g_capture_invalidated ? 2 : 1;
  return kSuccess;
}

int cuDeviceGet(int* dev, int ordinal) {
  if (ordinal != 0) return kInvalidValue;
  *dev = 0;
  return kSuccess;
}

int cuDevicePrimaryCtxRetain(void** ctx, int dev) {
  if (dev != 0) return kInvalidValue;
  *ctx = &g_fake_context;
  return kSuccess;
}

int cuGetErrorName(int error, const char** name) {
  switch (error) {
    case kSuccess:
      *name = "CUDA_SUCCESS";
      return kSuccess;
    case kInvalidValue:
      *name = "CUDA_ERROR_INVALID_VALUE";
      return kSuccess;
    case kNotInitialized:
      *name = "CUDA_ERROR_NOT_INITIALIZED";
      return kSuccess;
    case kInvalidContext:
      *name = "CUDA_ERROR_INVALID_CONTEXT";
      return kSuccess;
    case kCaptureUnsupported:
      *name = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
      return kSuccess;
    case kCaptureInvalidated:
      *name = "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
      return kSuccess;
    default:
      *name = nullptr;
      return kInvalidValue;
  }
}

// ---- the test's side ----
void fakeCudaInit() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_init = true;
}

void* fakeCudaMalloc(size_t bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_arena == nullptr) {
    void* m =
        mmap(nullptr, kArenaBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return nullptr;
    g_arena = static_cast<char*>(m);
  }
  const size_t start = (g_used + 255) & ~size_t{255};
  if (start + bytes > kArenaBytes) return nullptr;
  g_used = start + (bytes ? bytes : 1);
  return g_arena + start;
}

void* fakeCudaStreamCreate() {
  // Owned by a registry for the process's life: a fake stream is never destroyed by its users,
  // and LeakSanitizer would count it.
  static std::vector<std::unique_ptr<Stream>> streams;
  std::lock_guard<std::mutex> lock(g_mutex);
  streams.push_back(std::make_unique<Stream>());
  return streams.back().get();
}

// Enqueues a write of host bytes (copied now) to device memory on `stream`: it lands only when
// the stream is synchronised.
int fakeCudaWriteAsync(void* dst, const void* src, size_t bytes, void* stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!in_arena(dst)) return kInvalidValue;
  std::vector<char> copy(static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
  char* d = static_cast<char*>(dst);
  stream_of(stream)->pending.push_back([=] { std::memcpy(d, copy.data(), copy.size()); });
  return kSuccess;
}

// Reads device memory as it is now: nothing pending on any stream is run.
int fakeCudaReadNow(void* dst, const void* src, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!in_arena(src)) return kInvalidValue;
  open_arena(true);
  std::memcpy(dst, src, bytes);
  open_arena(false);
  return kSuccess;
}

// Graph capture of `stream` (one at a time): kInvalidValue when one is running already.
int fakeCudaBeginCapture(void* stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_capturing != nullptr) return kInvalidValue;
  g_capturing = stream_of(stream);
  g_capture_invalidated = false;
  return kSuccess;
}

// Ends it: kSuccess when nothing invalidated it, else CUDA_ERROR_STREAM_CAPTURE_INVALIDATED.
int fakeCudaEndCapture() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_capturing == nullptr) return kInvalidValue;
  g_capturing = nullptr;
  return g_capture_invalidated ? kCaptureInvalidated : kSuccess;
}

// dtoh copies, htod copies, stream synchronisations, pointer attribute queries so far.
void fakeCudaCounts(unsigned long long out[4]) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::memcpy(out, g_counts, sizeof g_counts);
}

}  // extern "C"
#pragma GCC visibility pop
