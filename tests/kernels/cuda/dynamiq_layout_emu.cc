// kernels/cuda/dynamiq_layout.cu compiled by the host compiler against the emulator.
#include "kernels/cuda/dynamiq_layout.cu"
