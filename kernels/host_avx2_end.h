// Closes the region kernels/host_avx2_begin.h or kernels/host_avx512_begin.h opened. No include
// guard: each include closes one region.
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
