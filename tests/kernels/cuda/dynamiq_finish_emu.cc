// kernels/cuda/dynamiq_finish.cu compiled by the host compiler against the emulator.
#include "kernels/cuda/dynamiq_finish.cu"
