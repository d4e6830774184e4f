// Preloaded after libdynamiq.so by the nccl_range test: an ncclGetVersion that reports NCCL
// 2.99.0, a version outside the range the shim supports. Everything else comes from the NCCL
// behind it (the CPU NCCL).
extern "C" __attribute__((visibility("default"))) int ncclGetVersion(int* version) {
  *version = 29900;  // major*10000 + minor*100 + patch
  return 0;          // ncclSuccess
}
