// Compiles the shared __host__ __device__ codec arithmetic with nvcc (sm_80/sm_90) and runs it
// per element on the GPU, so tests/kernels/gpu_math_test can compare the device's bits with the
// host reference byte for byte. The fused-hop kernels build on these same headers.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/baselines/mx_element.h"
#include "kernels/bf16.h"
#include "kernels/cuda/device_math_check.h"
#include "kernels/dynamiq_math.h"
#include "kernels/philox.h"

namespace dq::cuda {

__global__ void probe_kernel(const float* values, const LevelTable* table, uint64_t seed,
                             uint64_t call, uint32_t strata, int n, MathProbe* out) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e < n)
    out[e] = compute_probe(values[e], static_cast<uint32_t>(e), *table, seed, call, strata);
}

bool run_math_probe(const std::vector<float>& values, const LevelTable& table, uint64_t seed,
                    uint64_t call, uint32_t strata, std::vector<MathProbe>* out) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return false;
  const int n = static_cast<int>(values.size());
  float* d_values = nullptr;
  LevelTable* d_table = nullptr;
  MathProbe* d_out = nullptr;
  bool ok = cudaMalloc(&d_values, n * sizeof(float)) == cudaSuccess &&
            cudaMalloc(&d_table, sizeof(LevelTable)) == cudaSuccess &&
            cudaMalloc(&d_out, n * sizeof(MathProbe)) == cudaSuccess &&
            cudaMemcpy(d_values, values.data(), n * sizeof(float), cudaMemcpyHostToDevice) ==
                cudaSuccess &&
            cudaMemcpy(d_table, &table, sizeof(LevelTable), cudaMemcpyHostToDevice) == cudaSuccess;
  if (ok) {
    probe_kernel<<<(n + 255) / 256, 256>>>(d_values, d_table, seed, call, strata, n, d_out);
    out->resize(n);
    ok = cudaDeviceSynchronize() == cudaSuccess &&
         cudaMemcpy(out->data(), d_out, n * sizeof(MathProbe), cudaMemcpyDeviceToHost) ==
             cudaSuccess;
  }
  cudaFree(d_values);
  cudaFree(d_table);
  cudaFree(d_out);
  if (!ok) out->clear();
  return ok;
}

}  // namespace dq::cuda
