// The self-test kernels compiled by the host compiler against the emulator.
#include "tests/kernels/cuda/emu_kernels.cu"
