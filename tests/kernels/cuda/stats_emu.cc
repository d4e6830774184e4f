// kernels/cuda/stats.cu compiled by the host compiler against the emulator.
#include "kernels/cuda/stats.cu"
