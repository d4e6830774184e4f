// What the single-process GPU benchmarks (hop_bandwidth.cu, call_kernels.cu) share: a CUDA error
// check that ends the program, synthetic gradient-like values, and a CUDA-event timer.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define DQ_BENCH_CHECK(call)                                                     \
  do {                                                                           \
    const cudaError_t e_ = (call);                                               \
    if (e_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "FAIL: %s at %s:%d: %s\n", #call, __FILE__, __LINE__, \
                   cudaGetErrorString(e_));                                      \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

namespace dq::gpubench {

// Exit 77 (a skip, with the reason) where the process sees no CUDA device; else prints it.
inline void require_device() {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device: %s\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount returned 0");
    std::exit(77);
  }
  cudaDeviceProp prop{};
  DQ_BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (compute capability %d.%d, %d SMs)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
}

// Roughly normal values, one scale per super-group over 2^-20..2^20 (every width occurs).
inline std::vector<float> make_values(size_t count, uint64_t seed) {
  std::vector<float> x(count);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&s] {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  };
  for (size_t base = 0; base < count; base += 256) {
    const float scale = std::ldexp(1.0f, static_cast<int>(next() % 40) - 20);
    for (size_t i = base; i < count && i < base + 256; ++i) {
      const uint64_t r = next();
      const float u = static_cast<float>(r & 0xffff) + static_cast<float>((r >> 16) & 0xffff) +
                      static_cast<float>((r >> 32) & 0xffff) +
                      static_cast<float>((r >> 48) & 0xffff);
      x[i] = (u / 65536.0f - 2.0f) * 1.7320508f * scale;
    }
  }
  return x;
}

// Seconds per round of `round` (work enqueued on the legacy stream), timed with CUDA events over
// `iterations` rounds after one warm-up round.
struct Timer {
  cudaEvent_t start, stop;
  Timer() {
    DQ_BENCH_CHECK(cudaEventCreate(&start));
    DQ_BENCH_CHECK(cudaEventCreate(&stop));
  }
  ~Timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  template <class F>
  double seconds_per_round(F round, int iterations) {
    round();  // warm-up
    DQ_BENCH_CHECK(cudaDeviceSynchronize());
    DQ_BENCH_CHECK(cudaEventRecord(start));
    for (int i = 0; i < iterations; ++i) round();
    DQ_BENCH_CHECK(cudaEventRecord(stop));
    DQ_BENCH_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    DQ_BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms / 1e3 / iterations;
  }
};

}  // namespace dq::gpubench
