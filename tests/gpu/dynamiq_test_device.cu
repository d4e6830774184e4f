// tests/kernels/cuda/dynamiq_test.cc compiled by nvcc, against the DynamiQ kernels on a real
// device.
#include "tests/kernels/cuda/dynamiq_test.cc"
