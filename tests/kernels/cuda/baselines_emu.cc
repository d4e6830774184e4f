// kernels/cuda/baselines.cu compiled by the host compiler against the emulator.
#include "kernels/cuda/baselines.cu"
