// tests/kernels/cuda/grid_kernels_test.cc compiled by nvcc, against the layout and budget kernels
// spread over several blocks on a real device.
#include "tests/kernels/cuda/grid_kernels_test.cc"
