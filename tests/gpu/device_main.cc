// main() of the kernel-vs-host tests built by nvcc for a real device (tests/gpu/meson.build):
// exits 77 (skipped, with the reason) where the process sees no CUDA device, else names the
// device and runs the tests.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess) {
    std::printf("SKIP: no CUDA device: cudaGetDeviceCount failed: %s (%s)\n", cudaGetErrorName(e),
                cudaGetErrorString(e));
    return 77;
  }
  if (devices == 0) {
    std::printf("SKIP: no CUDA device: cudaGetDeviceCount returned 0\n");
    return 77;
  }
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaGetDeviceProperties(&prop, device) == cudaSuccess)
    std::printf("CUDA device %d of %d: %s, compute capability %d.%d, %d SMs\n", device, devices,
                prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
