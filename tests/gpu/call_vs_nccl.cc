// One whole compressed all-reduce through the preloaded shim against NCCL's BF16 all-reduce of the
// same tensor (a 256 MiB FP32 tensor by default, so 128 MiB of BF16), 2 ranks on the one GPU as
// two fake hosts over NVIDIA's NCCL (tests/gpu/two_ranks.h). Not a test: it prints the times and
// fails only when a call fails, the shim did not do what the run needs (FP32 compressed, BF16
// passed through: its counters), or the compressed result is far from the exact sum.
//
//   call_vs_nccl [count (default 2^26)] [iterations (default 10)] [warm-up calls (default 3)]
//
// The caller preloads the shim and puts the net plugin's folder on the library path (check.sh);
// the program sets DYNAMIQ_ENABLE=1, DYNAMIQ_DTYPES=float32 (so BF16 passes through) and
// DYNAMIQ_MIN_BYTES=1M for its ranks. Each rank times `iterations` calls back to back with CUDA
// events on its stream after the warm-up and a barrier (a small all-reduce): BF16 first, then
// FP32. Both ranks share the GPU and the link is loopback through the net transport, so the
// times say how the compressed path compares on this machine, not at 100 Gbit/s (call_kernels
// computes that). Exit 77 without NCCL or a CUDA device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/gpu/gpu_bench.h"
#include "tests/gpu/two_ranks.h"

namespace {

using namespace dq::gputest;

struct Options {
  size_t count = size_t{1} << 26;
  int iterations = 10, warmup = 3;
};

struct Rank {
  int rank = 0;
  Nccl nccl;
  void* comm = nullptr;
  cudaStream_t stream = nullptr;
  float *f32_send = nullptr, *f32_recv = nullptr, *one = nullptr;
  uint16_t *bf16_send = nullptr, *bf16_recv = nullptr;
};

#define RANK_CHECK(cond, code, ...) DQ_RANK_CHECK(r.rank, cond, code, __VA_ARGS__)

std::vector<float> input_of(int rank, size_t count) {
  return dq::gpubench::make_values(count, 21 + static_cast<uint64_t>(rank));
}

int set_up(Rank& r, const Options& o) {
  std::string why;
  RANK_CHECK(load_nccl(&r.nccl, &why), 10, "%s", why.c_str());
  RANK_CHECK(r.nccl.counters != nullptr && r.nccl.bytes != nullptr, 11,
             "libdynamiq.so is not preloaded (LD_PRELOAD)");
  NcclId id{};
  RANK_CHECK(my_nccl_id(&id), 12, "no NCCL id from the parent");
  int devices = 0;
  RANK_CHECK(cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0, 13, "no device");
  RANK_CHECK(cudaSetDevice(r.rank % devices) == cudaSuccess, 13, "cudaSetDevice");
  RANK_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking) == cudaSuccess, 14,
             "cudaStreamCreateWithFlags");
  const size_t n = o.count;
  RANK_CHECK(cudaMalloc(&r.f32_send, n * 4) == cudaSuccess &&
                 cudaMalloc(&r.f32_recv, n * 4) == cudaSuccess &&
                 cudaMalloc(&r.bf16_send, n * 2) == cudaSuccess &&
                 cudaMalloc(&r.bf16_recv, n * 2) == cudaSuccess &&
                 cudaMalloc(&r.one, 4) == cudaSuccess,
             15, "cudaMalloc");
  const std::vector<float> x = input_of(r.rank, n);
  std::vector<uint16_t> x16(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    x16[i] = static_cast<uint16_t>(u >> 16);  // BF16 by truncation: any finite values serve
  }
  RANK_CHECK(
      cudaMemcpy(r.f32_send, x.data(), n * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
          cudaMemcpy(r.bf16_send, x16.data(), n * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
          cudaMemset(r.one, 0, 4) == cudaSuccess,
      16, "input copies");
  RANK_CHECK(r.nccl.comm_init_rank(&r.comm, kRanks, id, r.rank) == kNcclSuccess, 17,
             "ncclCommInitRank");
  return 0;
}

// Milliseconds per call of `iterations` calls of dtype (BF16 or FP32), after the warm-up and a
// barrier; the shim's counters must move by `iterations` compressed (or passed through) calls.
int time_calls(Rank& r, const Options& o, int dtype, bool compressed, double* ms,
               unsigned long long* wire) {
  const bool f32 = dtype == kNcclFloat32;
  const void* send = f32 ? static_cast<const void*>(r.f32_send) : r.bf16_send;
  void* recv = f32 ? static_cast<void*>(r.f32_recv) : r.bf16_recv;
  auto call = [&] {
    return r.nccl.all_reduce(send, recv, o.count, dtype, kNcclSum, r.comm, r.stream);
  };
  for (int i = 0; i < o.warmup; ++i) RANK_CHECK(call() == kNcclSuccess, 20, "warm-up call");
  // The barrier: below DYNAMIQ_MIN_BYTES, passed through; both ranks start the timed calls after.
  RANK_CHECK(r.nccl.all_reduce(r.one, r.one, 1, kNcclFloat32, kNcclSum, r.comm, r.stream) ==
                     kNcclSuccess &&
                 cudaStreamSynchronize(r.stream) == cudaSuccess,
             21, "barrier");
  unsigned long long c0[2], c1[2], b0[2], b1[2];
  r.nccl.counters(r.comm, &c0[0], &c0[1]);
  r.nccl.bytes(r.comm, &b0[0], &b0[1]);
  cudaEvent_t start, stop;
  RANK_CHECK(cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess, 22,
             "cudaEventCreate");
  cudaEventRecord(start, r.stream);
  for (int i = 0; i < o.iterations; ++i) RANK_CHECK(call() == kNcclSuccess, 23, "timed call");
  cudaEventRecord(stop, r.stream);
  RANK_CHECK(cudaEventSynchronize(stop) == cudaSuccess, 24, "the timed calls did not complete");
  float elapsed = 0;
  cudaEventElapsedTime(&elapsed, start, stop);
  *ms = elapsed / o.iterations;
  r.nccl.counters(r.comm, &c1[0], &c1[1]);
  r.nccl.bytes(r.comm, &b1[0], &b1[1]);
  *wire = (b1[1] - b0[1]) / static_cast<unsigned long long>(o.iterations);
  const unsigned long long n = static_cast<unsigned long long>(o.iterations);
  const unsigned long long want_r = compressed ? n : 0, want_p = compressed ? 0 : n;
  RANK_CHECK(c1[0] - c0[0] == want_r && c1[1] - c0[1] == want_p, 25,
             "%s calls: %llu compressed, %llu passed through (expected %llu, %llu)",
             f32 ? "FP32" : "BF16", c1[0] - c0[0], c1[1] - c0[1], want_r, want_p);
  return 0;
}

// vNMSE of the last FP32 result against the exact sum of both ranks' inputs.
double fp32_vnmse(const Rank& r, const Options& o) {
  std::vector<float> got(o.count);
  if (cudaMemcpy(got.data(), r.f32_recv, o.count * 4, cudaMemcpyDeviceToHost) != cudaSuccess)
    return -1;
  const std::vector<float> a = input_of(0, o.count), b = input_of(1, o.count);
  double err = 0, norm = 0;
  for (size_t i = 0; i < o.count; ++i) {
    const double exact = static_cast<double>(a[i]) + b[i];
    if (!std::isfinite(got[i])) return -1;
    err += (got[i] - exact) * (got[i] - exact);
    norm += exact * exact;
  }
  return norm > 0 ? err / norm : 0;
}

int run_rank(int rank, const Options& o) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  Rank r;
  r.rank = rank;
  if (int c = set_up(r, o)) return c;
  double bf16_ms = 0, f32_ms = 0;
  unsigned long long bf16_wire = 0, f32_wire = 0;
  if (int c = time_calls(r, o, kNcclBfloat16, false, &bf16_ms, &bf16_wire)) return c;
  if (int c = time_calls(r, o, kNcclFloat32, true, &f32_ms, &f32_wire)) return c;
  const double v = fp32_vnmse(r, o);
  std::printf(
      "rank %d: NCCL BF16 %.3f ms/call; compressed FP32 %.3f ms/call, %llu bytes sent per "
      "call; vNMSE %.3e\n",
      rank, bf16_ms, f32_ms, f32_wire, v);
  // DynamiQ at 5 bits: about 1e-4 on these values; a broken call is far above.
  RANK_CHECK(v >= 0 && v <= 1e-2, 30, "the compressed result is far from the exact sum");
  char line[160];
  std::snprintf(line, sizeof line, "%.6f %.6f %llu", bf16_ms, f32_ms, f32_wire);
  write_result("times" + std::to_string(rank), line);
  r.nccl.comm_destroy(r.comm);
  return 0;
}

// The parent's summary: the slower rank's times.
int summarise(const std::vector<int>& codes, const std::string& dir, const Options& o) {
  double bf16 = 0, f32 = 0;
  unsigned long long wire = 0;
  for (int r = 0; r < kRanks; ++r) {
    std::printf("rank %d: exit %d\n", r, codes[r]);
    double a = 0, b = 0;
    unsigned long long w = 0;
    if (codes[r] != 0 || std::sscanf(read_result(dir, "times" + std::to_string(r)).c_str(),
                                     "%lf %lf %llu", &a, &b, &w) != 3)
      return 1;
    bf16 = std::max(bf16, a);
    f32 = std::max(f32, b);
    wire = std::max(wire, w);
  }
  const double bf16_bytes = 2.0 * (kRanks - 1) / kRanks * static_cast<double>(o.count) * 2;
  std::printf(
      "RESULT compressed_call_ms=%.3f nccl_bf16_ms=%.3f nccl_bf16_over_compressed=%.3f "
      "compressed_bytes_per_call=%llu nccl_bf16_bytes_per_call=%.0f (count %zu, 2 ranks on one "
      "GPU, loopback)\n",
      f32, bf16, bf16 / f32, wire, bf16_bytes, o.count);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (argc > 1) o.count = std::strtoull(argv[1], nullptr, 10);
  if (argc > 2) o.iterations = std::atoi(argv[2]);
  if (argc > 3) o.warmup = std::atoi(argv[3]);
  if (o.count < 4096 || o.iterations < 1 || o.warmup < 0) {
    std::fprintf(stderr, "usage: %s [count >= 4096] [iterations >= 1] [warm-up >= 0]\n", argv[0]);
    return 2;
  }
  if (const int rank = my_rank(); rank >= 0) return run_rank(rank, o);
  Nccl nccl;
  if (!device_and_nccl(&nccl)) return kSkip;
  setenv("DYNAMIQ_ENABLE", "1", 1);
  setenv("DYNAMIQ_DTYPES", "float32", 1);
  setenv("DYNAMIQ_MIN_BYTES", "1M", 1);
  std::string dir;
  const std::vector<int> codes = run_ranks(argv, nccl, 100, &dir);
  const int rc = summarise(codes, dir, o);
  if (!dir.empty()) std::filesystem::remove_all(dir);
  std::printf(rc == 0 ? "PASS\n" : "FAIL\n");
  return rc;
}
