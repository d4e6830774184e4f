// The CPU NCCL with CUDA device buffers (config/cuda_staging.h): N forked rank
// processes, each with its own device buffers, through libnccl.so.2 over the net plugin.
//
//   cpu_nccl_device_buffers fake|cuda NRANKS [shim]
//
// shim: libdynamiq.so is preloaded with compression on (the test's environment); the calls are
//       compressed by the shim's host engine on host copies of the device buffers (see
//       shim_checks below) instead of passing through exact.
//
// fake: the device is tests/nccl/fake_cuda_driver.cc, named by DYNAMIQ_CPU_NCCL_CUDA_DRIVER
//       (the CPU NCCL loads it as its driver; this program dlopens the same file to allocate
//       and write "device" memory). Runs anywhere: its device memory is PROT_NONE to the host,
//       and its streams run their work only when synchronised, so a missed staging or a missed
//       synchronisation fails the test.
// cuda: the real driver (libcuda.so.1, dlopen'ed here too, so this builds without CUDA): all
//       ranks on device 0, buffers from cuMemAlloc in the primary context (what cudaMalloc
//       allocates), each write landing through a device-to-device copy enqueued behind a 64 MiB
//       memset on a non-blocking stream, so the CPU NCCL must wait for the stream to see it.
//       Exit 77, with the reason, where there is no driver or no device (asked in a forked
//       child: this process must not initialise CUDA before it forks its ranks).
//
// Every rank checks, with integer-valued data (exact in FP32 and BF16 for these sums):
// ncclAllReduce FP32 SUM (out of place, and identical bytes to the same call on host buffers),
// ncclAllReduce BF16 SUM in place, ncclReduceScatter FP32 SUM, ncclAllGather in place, a ring of
// ncclSend/ncclRecv in a group, a group of an all-reduce followed by a broadcast of its result
// (staged in issue order), and an all-reduce from a host buffer into a device buffer.
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common/fnv1a.h"
#include "common/nccl_api.h"
#include "tests/common/rank_harness.h"
#include "tests/common/test_data.h"

namespace {

int g_rank = -1;

#define CHECK(cond, ...)                                                     \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "[rank %d] %s:%d: ", g_rank, __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                                     \
      std::fprintf(stderr, "\n");                                            \
      return 1;                                                              \
    }                                                                        \
  } while (0)

#define NCCL_OK(call)                                                      \
  do {                                                                     \
    ncclResult_t r_ = (call);                                              \
    CHECK(r_ == ncclSuccess, "%s -> %d (%s)", #call, static_cast<int>(r_), \
          ncclGetLastError(nullptr));                                      \
  } while (0)

// The device as the test sees it.
struct Device {
  std::function<void*(size_t)> alloc;
  // Writes host bytes to device memory, ordered on `stream` after its earlier work.
  std::function<bool(void* dst, const void* src, size_t bytes)> write;
  // Reads device memory now (the test never synchronises the stream itself).
  std::function<bool(void* dst, const void* src, size_t bytes)> read;
  void* stream = nullptr;
  std::function<std::string()> counts;  // what the device saw, for the log
};

template <class F>
F sym(void* h, const char* name) {
  return reinterpret_cast<F>(dlsym(h, name));
}

bool fake_device(Device* d, std::string* why) {
  const char* path = std::getenv("DYNAMIQ_CPU_NCCL_CUDA_DRIVER");
  void* h = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : nullptr;
  if (h == nullptr) {
    *why = "fake mode needs DYNAMIQ_CPU_NCCL_CUDA_DRIVER naming the fake driver";
    return false;
  }
  sym<void (*)()>(h, "fakeCudaInit")();
  auto malloc_fn = sym<void* (*)(size_t)>(h, "fakeCudaMalloc");
  auto write_fn = sym<int (*)(void*, const void*, size_t, void*)>(h, "fakeCudaWriteAsync");
  auto read_fn = sym<int (*)(void*, const void*, size_t)>(h, "fakeCudaReadNow");
  auto counts_fn = sym<void (*)(unsigned long long*)>(h, "fakeCudaCounts");
  d->stream = sym<void* (*)()>(h, "fakeCudaStreamCreate")();
  d->alloc = [=](size_t n) { return malloc_fn(n); };
  d->write = [=](void* dst, const void* src, size_t n) {
    return write_fn(dst, src, n, d->stream) == 0;
  };
  d->read = [=](void* dst, const void* src, size_t n) { return read_fn(dst, src, n) == 0; };
  d->counts = [=] {
    unsigned long long c[4];
    counts_fn(c);
    return "fake driver: " + std::to_string(c[0]) + " device-to-host copies, " +
           std::to_string(c[1]) + " host-to-device, " + std::to_string(c[2]) +
           " stream synchronisations, " + std::to_string(c[3]) + " pointer queries";
  };
  return true;
}

// The real driver, through dlopen (this program links no CUDA library).
struct Cu {
  using R = int;
  R (*init)(unsigned);
  R (*device_get_count)(int*);
  R (*device_get)(int*, int);
  R (*primary_retain)(void**, int);
  R (*ctx_set_current)(void*);
  R (*stream_create)(void**, unsigned);
  R (*mem_alloc)(unsigned long long*, size_t);
  R (*htod)(unsigned long long, const void*, size_t);
  R (*dtoh)(void*, unsigned long long, size_t);
  R (*dtod_async)(unsigned long long, unsigned long long, size_t, void*);
  R (*memset_async)(unsigned long long, unsigned, size_t, void*);
};

bool load_cu(Cu* cu, std::string* why) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* e = dlerror();
    *why = std::string("no CUDA driver: libcuda.so.1 cannot be loaded (") + (e ? e : "?") + ")";
    return false;
  }
  cu->init = sym<decltype(cu->init)>(h, "cuInit");
  cu->device_get_count = sym<decltype(cu->device_get_count)>(h, "cuDeviceGetCount");
  cu->device_get = sym<decltype(cu->device_get)>(h, "cuDeviceGet");
  cu->primary_retain = sym<decltype(cu->primary_retain)>(h, "cuDevicePrimaryCtxRetain");
  cu->ctx_set_current = sym<decltype(cu->ctx_set_current)>(h, "cuCtxSetCurrent");
  cu->stream_create = sym<decltype(cu->stream_create)>(h, "cuStreamCreate");
  cu->mem_alloc = sym<decltype(cu->mem_alloc)>(h, "cuMemAlloc_v2");
  cu->htod = sym<decltype(cu->htod)>(h, "cuMemcpyHtoD_v2");
  cu->dtoh = sym<decltype(cu->dtoh)>(h, "cuMemcpyDtoH_v2");
  cu->dtod_async = sym<decltype(cu->dtod_async)>(h, "cuMemcpyDtoDAsync_v2");
  cu->memset_async = sym<decltype(cu->memset_async)>(h, "cuMemsetD32Async");
  if (!cu->init || !cu->device_get_count || !cu->device_get || !cu->primary_retain ||
      !cu->ctx_set_current || !cu->stream_create || !cu->mem_alloc || !cu->htod || !cu->dtoh ||
      !cu->dtod_async || !cu->memset_async) {
    *why = "libcuda.so.1 lacks a driver function this test uses";
    return false;
  }
  int r = cu->init(0), n = 0;
  if (r != 0) {
    *why = "cuInit failed with CUDA error " + std::to_string(r) + " (no usable CUDA device)";
    return false;
  }
  if ((r = cu->device_get_count(&n)) != 0 || n < 1) {
    *why = "no CUDA device (cuDeviceGetCount: error " + std::to_string(r) + ", " +
           std::to_string(n) + " devices)";
    return false;
  }
  return true;
}

bool cuda_device(Device* d, std::string* why) {
  static Cu cu;
  if (!load_cu(&cu, why)) return false;
  int dev = 0;
  void* ctx = nullptr;
  if (cu.device_get(&dev, 0) != 0 || cu.primary_retain(&ctx, dev) != 0 ||
      cu.ctx_set_current(ctx) != 0 || cu.stream_create(&d->stream, 1 /* non-blocking */) != 0) {
    *why = "cannot set up device 0's primary context and a stream";
    return false;
  }
  constexpr size_t kFiller = size_t{64} << 20;
  unsigned long long filler = 0;
  if (cu.mem_alloc(&filler, kFiller) != 0) {
    *why = "cuMemAlloc of the filler failed";
    return false;
  }
  d->alloc = [](size_t n) -> void* {
    unsigned long long p = 0;
    return cu.mem_alloc(&p, n ? n : 1) == 0 ? reinterpret_cast<void*>(p) : nullptr;
  };
  d->write = [d, filler](void* dst, const void* src, size_t n) {
    // Into a scratch buffer now; onto dst only behind a 64 MiB memset on the stream.
    unsigned long long scratch = 0;
    if (cu.mem_alloc(&scratch, n) != 0 || cu.htod(scratch, src, n) != 0) return false;
    for (int k = 0; k < 4; ++k)
      if (cu.memset_async(filler, 0x3f800000u + k, kFiller / 4, d->stream) != 0) return false;
    return cu.dtod_async(reinterpret_cast<unsigned long long>(dst), scratch, n, d->stream) == 0;
  };
  d->read = [](void* dst, const void* src, size_t n) {
    return cu.dtoh(dst, reinterpret_cast<unsigned long long>(src), n) == 0;
  };
  d->counts = [] { return std::string("real CUDA device 0"); };
  return true;
}

// Integer values in [-16, 16]: every sum over up to 8 ranks is exact in FP32 and BF16.
float value(int rank, size_t i, int salt) {
  return static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(rank) * 13 + salt) % 33) -
                            16);
}

uint16_t bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);  // exact: small integers have no bits below
}

float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The CPU NCCL alone, exact results: the reductions of one odd-sized vector.
int exact_reductions(int rank, int n, Device& dev, ncclComm_t comm) {
  const cudaStream_t stream = static_cast<cudaStream_t>(dev.stream);
  const size_t count = 262147;  // odd, over one pipeline chunk per segment
  const size_t fbytes = count * sizeof(float);

  // 1. ncclAllReduce FP32 SUM, out of place, against the same call on host buffers.
  {
    std::vector<float> mine(count), got(count), host_out(count);
    for (size_t i = 0; i < count; ++i) mine[i] = value(rank, i, 0);
    void* send = dev.alloc(fbytes);
    void* recv = dev.alloc(fbytes);
    CHECK(send && recv && dev.write(send, mine.data(), fbytes), "device alloc/write");
    NCCL_OK(ncclAllReduce(send, recv, count, ncclFloat32, ncclSum, comm, stream));
    CHECK(dev.read(got.data(), recv, fbytes), "device read");
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += value(r, i, 0);
      CHECK(got[i] == want, "all-reduce fp32: element %zu is %g, want %g", i, got[i], want);
    }
    NCCL_OK(ncclAllReduce(mine.data(), host_out.data(), count, ncclFloat32, ncclSum, comm, stream));
    CHECK(std::memcmp(host_out.data(), got.data(), fbytes) == 0,
          "all-reduce fp32: device result differs from the host buffers' result");
  }
  // 2. ncclAllReduce BF16 SUM in place.
  {
    std::vector<uint16_t> mine(count), got(count);
    for (size_t i = 0; i < count; ++i) mine[i] = bf16(value(rank, i, 5));
    void* buf = dev.alloc(count * 2);
    CHECK(buf && dev.write(buf, mine.data(), count * 2), "device alloc/write");
    NCCL_OK(ncclAllReduce(buf, buf, count, ncclBfloat16, ncclSum, comm, stream));
    CHECK(dev.read(got.data(), buf, count * 2), "device read");
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += value(r, i, 5);
      CHECK(from_bf16(got[i]) == want, "all-reduce bf16 in place: element %zu is %g, want %g", i,
            from_bf16(got[i]), want);
    }
  }
  // 3. ncclReduceScatter FP32 SUM.
  {
    const size_t all = count * static_cast<size_t>(n);
    std::vector<float> mine(all), got(count);
    for (size_t i = 0; i < all; ++i) mine[i] = value(rank, i, 11);
    void* send = dev.alloc(all * 4);
    void* recv = dev.alloc(fbytes);
    CHECK(send && recv && dev.write(send, mine.data(), all * 4), "device alloc/write");
    NCCL_OK(ncclReduceScatter(send, recv, count, ncclFloat32, ncclSum, comm, stream));
    CHECK(dev.read(got.data(), recv, fbytes), "device read");
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += value(r, static_cast<size_t>(rank) * count + i, 11);
      CHECK(got[i] == want, "reduce-scatter: element %zu is %g, want %g", i, got[i], want);
    }
  }
  return 0;
}

// The CPU NCCL alone, exact results: an in-place gather, point-to-point, a group and a host
// send buffer.
int exact_gather_p2p_host(int rank, int n, Device& dev, ncclComm_t comm) {
  const cudaStream_t stream = static_cast<cudaStream_t>(dev.stream);

  // 4. ncclAllGather in place: the send buffer is this rank's slice of the receive buffer.
  {
    const size_t per = 1001, all = per * static_cast<size_t>(n);
    std::vector<int32_t> mine(per), got(all);
    for (size_t i = 0; i < per; ++i) mine[i] = rank * 100000 + static_cast<int32_t>(i);
    auto* buf = static_cast<char*>(dev.alloc(all * 4));
    CHECK(buf && dev.write(buf + static_cast<size_t>(rank) * per * 4, mine.data(), per * 4),
          "device alloc/write");
    NCCL_OK(ncclAllGather(buf + static_cast<size_t>(rank) * per * 4, buf, per, ncclInt32, comm,
                          stream));
    CHECK(dev.read(got.data(), buf, all * 4), "device read");
    for (size_t i = 0; i < all; ++i) {
      const int32_t want = static_cast<int32_t>(i / per) * 100000 + static_cast<int32_t>(i % per);
      CHECK(got[i] == want, "all-gather in place: element %zu is %d, want %d", i, got[i], want);
    }
  }
  // 5. A ring of ncclSend/ncclRecv in one group.
  {
    const size_t m = 300007;
    std::vector<int32_t> mine(m), got(m);
    for (size_t i = 0; i < m; ++i) mine[i] = rank * 7 + static_cast<int32_t>(i);
    void* send = dev.alloc(m * 4);
    void* recv = dev.alloc(m * 4);
    CHECK(send && recv && dev.write(send, mine.data(), m * 4), "device alloc/write");
    const int to = (rank + 1) % n, from = (rank + n - 1) % n;
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclSend(send, m, ncclInt32, to, comm, stream));
    NCCL_OK(ncclRecv(recv, m, ncclInt32, from, comm, stream));
    NCCL_OK(ncclGroupEnd());
    CHECK(dev.read(got.data(), recv, m * 4), "device read");
    for (size_t i = 0; i < m; ++i)
      CHECK(got[i] == from * 7 + static_cast<int32_t>(i), "send/recv: element %zu is %d, want %d",
            i, got[i], from * 7 + static_cast<int32_t>(i));
  }
  // 6. A group: an all-reduce, then a broadcast of its result from rank 0's buffer (the second
  //    reads what the first wrote: staged in issue order).
  {
    const size_t m = 4099;
    std::vector<float> mine(m), got(m);
    for (size_t i = 0; i < m; ++i) mine[i] = value(rank, i, 3);
    void* buf = dev.alloc(m * 4);
    void* out = dev.alloc(m * 4);
    CHECK(buf && out && dev.write(buf, mine.data(), m * 4), "device alloc/write");
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclAllReduce(buf, buf, m, ncclFloat32, ncclSum, comm, stream));
    NCCL_OK(ncclBroadcast(buf, out, m, ncclFloat32, 0, comm, stream));
    NCCL_OK(ncclGroupEnd());
    CHECK(dev.read(got.data(), out, m * 4), "device read");
    for (size_t i = 0; i < m; ++i) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += value(r, i, 3);
      CHECK(got[i] == want, "group all-reduce + broadcast: element %zu is %g, want %g", i, got[i],
            want);
    }
  }
  // 7. From a host buffer into a device buffer.
  {
    const size_t m = 777;
    std::vector<float> mine(m), got(m);
    for (size_t i = 0; i < m; ++i) mine[i] = value(rank, i, 9);
    void* recv = dev.alloc(m * 4);
    CHECK(recv != nullptr, "device alloc");
    NCCL_OK(ncclAllReduce(mine.data(), recv, m, ncclFloat32, ncclSum, comm, stream));
    CHECK(dev.read(got.data(), recv, m * 4), "device read");
    for (size_t i = 0; i < m; ++i) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += value(r, i, 9);
      CHECK(got[i] == want, "host to device all-reduce: element %zu is %g, want %g", i, got[i],
            want);
    }
  }
  return 0;
}

// The CPU NCCL alone: exact results.
int exact_checks(int rank, int n, Device& dev, ncclComm_t comm) {
  const int rc = exact_reductions(rank, n, dev, comm);
  return rc != 0 ? rc : exact_gather_p2p_host(rank, n, dev, comm);
}

// ---- shim mode: libdynamiq.so preloaded, compression on -----------------------------------
// The shim's host engine serves CPU NCCL communicators; given device buffers it must compute on
// host copies (shim/engine/interceptor.cc, run_host_staged): touching them directly is a SIGSEGV
// with the fake driver, as with real device memory. Compressed results are not exact: each call
// must be compressed (the shim's own counter), rank-identical (a hash of the result bytes
// gathered from every rank), and within a vNMSE bound of the exact sum.

using CountersFn = int (*)(void*, unsigned long long*, unsigned long long*);

// Reproducible values of mixed signs and magnitudes (not integers: compression is visible).
float shim_value(int rank, size_t i, int salt) {
  const uint64_t z = dq::test::splitmix((static_cast<uint64_t>(rank) << 40) ^
                                        (static_cast<uint64_t>(salt) << 56) ^ i);
  const double u = static_cast<double>(z >> 11) / 9007199254740992.0;  // [0, 1)
  return static_cast<float>((u - 0.5) * (1.0 + static_cast<double>(i % 7)));
}

// Whether every rank's `h` is the same (an all-gather of host words: not intercepted).
bool same_on_every_rank(uint64_t h, int n, ncclComm_t comm, cudaStream_t stream) {
  std::vector<uint64_t> all(static_cast<size_t>(n));
  if (ncclAllGather(&h, all.data(), 1, ncclUint64, comm, stream) != ncclSuccess) return false;
  for (uint64_t x : all)
    if (x != h) return false;
  return true;
}

double vnmse(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return norm > 0 ? err / norm : 1;
}

constexpr double kMaxVnmse = 0.05;  // DynamiQ at its 5-bit default measures ~1e-2 and below

// `more` holds two more communicators of the same ranks: `mixed` (rank 0 gives host buffers,
// the others device buffers) and `host` (every rank host buffers: the host engine's reference).
int shim_checks(int rank, int n, Device& dev, ncclComm_t comm, ncclComm_t mixed, ncclComm_t host) {
  const auto counters = reinterpret_cast<CountersFn>(dlsym(RTLD_DEFAULT, "dynamiqCommCounters"));
  CHECK(counters != nullptr, "shim mode needs libdynamiq.so preloaded (no dynamiqCommCounters)");
  const cudaStream_t stream = static_cast<cudaStream_t>(dev.stream);
  const size_t count = 262147;
  // The calls the shim compressed on communicator `c` so far (its own counter).
  auto compressed = [&](ncclComm_t c) {
    unsigned long long rerouted = 0, passed = 0;
    return counters(c, &rerouted, &passed) == 0 ? rerouted : ~0ull;
  };

  // 1. FP32 SUM out of place, the first compressed call of each of the three communicators, on
  //    the same data: device buffers everywhere (on a GPU the CUDA device serves them), rank 0 on
  //    host buffers and its peers on device buffers, and host buffers everywhere (the host
  //    engine). Same settings, same call number, so the same rounding: the three results must
  //    be the same bytes, on every rank.
  std::vector<float> mine(count), reference(count);
  std::vector<double> want(count, 0.0);
  for (size_t i = 0; i < count; ++i) {
    mine[i] = shim_value(rank, i, 0);
    for (int r = 0; r < n; ++r) want[i] += shim_value(r, i, 0);
  }
  NCCL_OK(ncclAllReduce(mine.data(), reference.data(), count, ncclFloat32, ncclSum, host, stream));
  CHECK(compressed(host) == 1, "fp32 all-reduce on host buffers: not compressed");
  const double e_host = vnmse(reference, want);
  CHECK(e_host < kMaxVnmse, "fp32 all-reduce on host buffers: vNMSE %.3g over %.3g", e_host,
        kMaxVnmse);
  CHECK(same_on_every_rank(dq::fnv1a64(reference.data(), count * 4), n, host, stream),
        "fp32 all-reduce on host buffers: results differ between ranks");
  for (ncclComm_t c : {comm, mixed}) {
    const bool on_host = c == mixed && rank == 0;
    const char* what = c == mixed ? "fp32 all-reduce, rank 0 on host buffers" : "fp32 all-reduce";
    std::vector<float> got(count);
    if (on_host) {
      NCCL_OK(ncclAllReduce(mine.data(), got.data(), count, ncclFloat32, ncclSum, c, stream));
    } else {
      void* send = dev.alloc(count * 4);
      void* recv = dev.alloc(count * 4);
      CHECK(send && recv && dev.write(send, mine.data(), count * 4), "device alloc/write");
      NCCL_OK(ncclAllReduce(send, recv, count, ncclFloat32, ncclSum, c, stream));
      CHECK(dev.read(got.data(), recv, count * 4), "device read");
    }
    CHECK(compressed(c) == 1, "%s: not compressed", what);
    CHECK(std::memcmp(got.data(), reference.data(), count * 4) == 0,
          "%s: the result differs from the host engine's on host buffers", what);
  }
  // 2. BF16 SUM in place.
  {
    std::vector<uint16_t> mine(count), got_bits(count);
    std::vector<float> got(count);
    std::vector<double> want(count, 0.0);
    for (size_t i = 0; i < count; ++i) {
      uint32_t u;
      const float f = shim_value(rank, i, 2);
      std::memcpy(&u, &f, 4);
      mine[i] = static_cast<uint16_t>(u >> 16);  // truncation: the sum below uses these values
      for (int r = 0; r < n; ++r) {
        const float fr = shim_value(r, i, 2);
        std::memcpy(&u, &fr, 4);
        want[i] += from_bf16(static_cast<uint16_t>(u >> 16));
      }
    }
    void* buf = dev.alloc(count * 2);
    CHECK(buf && dev.write(buf, mine.data(), count * 2), "device alloc/write");
    NCCL_OK(ncclAllReduce(buf, buf, count, ncclBfloat16, ncclSum, comm, stream));
    CHECK(dev.read(got_bits.data(), buf, count * 2), "device read");
    for (size_t i = 0; i < count; ++i) got[i] = from_bf16(got_bits[i]);
    CHECK(compressed(comm) == 2, "bf16 all-reduce in place: not compressed");
    const double e = vnmse(got, want);
    CHECK(e < kMaxVnmse, "bf16 all-reduce in place: vNMSE %.3g over %.3g", e, kMaxVnmse);
    CHECK(same_on_every_rank(dq::fnv1a64(got_bits.data(), count * 2), n, comm, stream),
          "bf16 all-reduce in place: results differ between ranks");
  }
  // 3. FP32 SUM reduce-scatter: this rank's slice.
  {
    const size_t all = count * static_cast<size_t>(n);
    std::vector<float> mine(all), got(count);
    std::vector<double> want(count, 0.0);
    for (size_t i = 0; i < all; ++i) mine[i] = shim_value(rank, i, 3);
    for (size_t i = 0; i < count; ++i)
      for (int r = 0; r < n; ++r)
        want[i] += shim_value(r, static_cast<size_t>(rank) * count + i, 3);
    void* send = dev.alloc(all * 4);
    void* recv = dev.alloc(count * 4);
    CHECK(send && recv && dev.write(send, mine.data(), all * 4), "device alloc/write");
    NCCL_OK(ncclReduceScatter(send, recv, count, ncclFloat32, ncclSum, comm, stream));
    CHECK(dev.read(got.data(), recv, count * 4), "device read");
    CHECK(compressed(comm) == 3, "reduce-scatter: not compressed");
    const double e = vnmse(got, want);
    CHECK(e < kMaxVnmse, "reduce-scatter: vNMSE %.3g over %.3g", e, kMaxVnmse);
  }
  // 5. FP32 SUM reduce to rank 1: every other rank's receive buffer keeps its bytes.
  {
    const int root = 1 % n;
    std::vector<float> mine(count), got(count), sentinel(count, -7.25f);
    std::vector<double> want(count, 0.0);
    for (size_t i = 0; i < count; ++i) {
      mine[i] = shim_value(rank, i, 5);
      for (int r = 0; r < n; ++r) want[i] += shim_value(r, i, 5);
    }
    void* send = dev.alloc(count * 4);
    void* recv = dev.alloc(count * 4);
    CHECK(send && recv && dev.write(send, mine.data(), count * 4) &&
              dev.write(recv, sentinel.data(), count * 4),
          "device alloc/write");
    NCCL_OK(ncclReduce(send, recv, count, ncclFloat32, ncclSum, root, comm, stream));
    CHECK(dev.read(got.data(), recv, count * 4), "device read");
    CHECK(compressed(comm) == 4, "reduce: not compressed");
    if (rank == root) {
      const double e = vnmse(got, want);
      CHECK(e < kMaxVnmse, "reduce: vNMSE %.3g at the root, over %.3g", e, kMaxVnmse);
    } else {
      CHECK(std::memcmp(got.data(), sentinel.data(), count * 4) == 0,
            "reduce: the receive buffer of non-root rank %d changed", rank);
    }
  }
  return 0;
}

// `ids`: kIds unique ids (the shim checks use three communicators, the exact checks one).
constexpr int kIds = 3;

int rank_body(int rank, int n, const ncclUniqueId* ids, bool fake, bool shim) {
  g_rank = rank;
  Device dev;
  std::string why;
  CHECK(fake ? fake_device(&dev, &why) : cuda_device(&dev, &why), "device: %s", why.c_str());
  ncclComm_t comms[kIds] = {};
  for (int k = 0; k < (shim ? kIds : 1); ++k) NCCL_OK(ncclCommInitRank(&comms[k], n, ids[k], rank));
  const int rc = shim ? shim_checks(rank, n, dev, comms[0], comms[1], comms[2])
                      : exact_checks(rank, n, dev, comms[0]);
  if (rc != 0) return rc;
  for (ncclComm_t c : comms)
    if (c != nullptr) NCCL_OK(ncclCommDestroy(c));
  if (rank == 0) std::printf("rank 0: %s\n", dev.counts().c_str());
  return 0;
}

// Whether this machine has a CUDA device, asked in a child (CUDA must not be initialised in a
// process that forks ranks which use it). Empty: yes; else the reason.
std::string probe_cuda() {
  int p[2];
  if (pipe(p) != 0) return "pipe failed";
  const pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    Cu cu;
    std::string why;
    if (!load_cu(&cu, &why)) {
      (void)!write(p[1], why.data(), why.size());
      _exit(77);
    }
    _exit(0);
  }
  close(p[1]);
  std::string why;
  char buf[256];
  ssize_t k;
  while ((k = read(p[0], buf, sizeof buf)) > 0) why.append(buf, static_cast<size_t>(k));
  close(p[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  return why.empty() ? "the CUDA probe crashed" : why;
}

}  // namespace

int main(int argc, char** argv) {
  if ((argc != 3 && argc != 4) ||
      (std::strcmp(argv[1], "fake") != 0 && std::strcmp(argv[1], "cuda") != 0) ||
      (argc == 4 && std::strcmp(argv[3], "shim") != 0)) {
    std::fprintf(stderr, "usage: %s fake|cuda NRANKS [shim]\n", argv[0]);
    return 2;
  }
  const bool fake = std::strcmp(argv[1], "fake") == 0;
  const bool shim = argc == 4;
  const int n = std::atoi(argv[2]);
  if (!fake) {
    const std::string why = probe_cuda();
    if (!why.empty()) {
      std::printf("SKIP: %s\n", why.c_str());
      return 77;
    }
  }
  dq::test::RankOptions opt;
  opt.timeout_s = 240;
  const auto exits = dq::test::run_ranks<ncclUniqueId>(
      n, kIds, [](ncclUniqueId* id) { return ncclGetUniqueId(id); }, opt,
      [&](int rank, const ncclUniqueId* ids) { return rank_body(rank, n, ids, fake, shim); });
  int bad = 0;
  for (int r = 0; r < n; ++r) {
    if (exits[r].exited(0)) continue;
    std::fprintf(stderr, "rank %d: %s\n", r, exits[r].describe().c_str());
    ++bad;
  }
  if (bad) return 1;
  if (shim) {
    std::printf(
        "PASS: %d processes, %s device buffers through the shim on the CPU NCCL: all-reduce "
        "FP32 the same bytes as the host engine's (also with rank 0 on host buffers), BF16 in "
        "place, reduce-scatter, reduce: compressed, rank-identical, vNMSE under %.2g\n",
        n, fake ? "fake-driver" : "CUDA", kMaxVnmse);
    return 0;
  }
  std::printf(
      "PASS: %d processes, %s device buffers through the CPU NCCL: all-reduce FP32/BF16 "
      "SUM, reduce-scatter, all-gather in place, send/recv, grouped, host-to-device: "
      "exact\n",
      n, fake ? "fake-driver" : "CUDA");
  return 0;
}
