// tests/kernels/cuda/layout_batch_test.cc compiled by nvcc, against the layout batch's kernels on
// a real device.
#include "tests/kernels/cuda/layout_batch_test.cc"
