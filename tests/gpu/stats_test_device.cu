// tests/kernels/cuda/stats_test.cc compiled by nvcc, against kernels/cuda/stats.cu on a real
// device.
#include "tests/kernels/cuda/stats_test.cc"
