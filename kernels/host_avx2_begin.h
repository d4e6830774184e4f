// Opens the region of a translation unit compiled for AVX2 (no FMA: -ffp-contract=off holds, and
// the target names no FMA), closed by kernels/host_avx2_end.h. Include it after every header
// shared with the baseline path, so that no inline function other files also use is compiled for
// AVX2 and then picked by the linker for them. No include guard: each include opens one region.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#endif
