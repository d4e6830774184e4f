// Opens the region of a translation unit compiled for AVX-512 (F, VL, BW, DQ) with 256-bit vectors
// preferred, closed by kernels/host_avx2_end.h (which pops whichever region is open). The hot
// loops are the AVX2 path's own source: what the wider target adds is 32 vector registers,
// masked operations and three-input logic, not wider vectors (512-bit ones measured no faster on
// the development machine's Zen 4, which splits them in two; docs/results/host-isa.md). GCC's
// AVX-512F implies FMA, so, unlike the AVX2 region, nothing in the target keeps a multiply and an
// add apart: -ffp-contract=off (meson.build's host_args) does, and the test
// kernels_no_multiply_add checks the machine code for it (the byte tests do not see it). Clang
// gets the target alone (vectors of its own default width: the same bytes). Include it after
// every header shared with the baseline path. No include guard: each include opens one region.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,avx512f,avx512vl,avx512bw,avx512dq"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,avx512f,avx512vl,avx512bw,avx512dq,prefer-vector-width=256")
#endif
