// kernels/cuda/budget.cu compiled by the host compiler against the emulator.
#include "kernels/cuda/budget.cu"
