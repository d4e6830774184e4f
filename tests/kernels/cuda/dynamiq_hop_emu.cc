// kernels/cuda/dynamiq_hop.cu compiled by the host compiler against the emulator.
#include "kernels/cuda/dynamiq_hop.cu"
