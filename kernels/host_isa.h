// Which instruction set the host codec's hot loops run on. One portable binary carries each
// path (kernels/dynamiq_host_scalar.cc, kernels/dynamiq_host_avx2.cc,
// kernels/dynamiq_host_avx512.cc: the same source, compiled for baseline x86-64, for AVX2 without
// FMA, and for AVX-512 F/VL/BW/DQ at 256 bits) and picks one per process: the best the CPU
// supports unless a caller forces one (DYNAMIQ_HOST_ISA, tests, benchmarks). Every path gives
// the same bytes, and a vector path is used only after a start-up check shows it does on this
// CPU. Codecs take the path selected when they are made.
#pragma once
#include <cstdint>

namespace dq {

enum class HostIsa { kAuto, kScalar, kAvx2, kAvx512 };

// Whether this CPU has the instructions `isa` needs (and this build carries it); kAuto and
// kScalar always do.
bool host_isa_cpu_has(HostIsa isa);

// Whether `isa` may be used: the CPU has it and, for a vector path, the path passed its start-up
// check (kernels/host_path_check.h: its codecs give the scalar path's bytes on this CPU). The
// check runs once per path per process, on first need; a failure is logged once (WARN) and the
// path is never taken.
bool host_isa_supported(HostIsa isa);

// Whether `isa` (a vector path) failed its start-up check, so that it is never used. Runs no
// check: a path never needed (AVX2 where AVX-512 passed) was never checked and is not refused.
bool host_isa_refused(HostIsa isa);

// Selects the path for codecs made from now on: kAuto picks the best supported one. False, and
// nothing changes, when `isa` is not supported here.
bool select_host_isa(HostIsa isa);

// While it lives, codecs made on the calling thread take `isa` (kAuto: the process's selection
// again), without changing what other threads get: the start-up check's codecs, one per path.
class ThreadHostIsa {
 public:
  explicit ThreadHostIsa(HostIsa isa);
  ~ThreadHostIsa();
  ThreadHostIsa(const ThreadHostIsa&) = delete;
  ThreadHostIsa& operator=(const ThreadHostIsa&) = delete;

 private:
  HostIsa previous_;
};

// The path codecs made now on this thread take (never kAuto), and its name: "scalar", "avx2" or
// "avx512".
HostIsa host_isa();
const char* host_isa_name(HostIsa isa);
inline const char* host_isa_name() {
  return host_isa_name(host_isa());
}

// "scalar" / "avx2" / "avx512" / "auto" -> the enum; false for anything else.
bool parse_host_isa(const char* text, HostIsa* isa);

// Applies the DYNAMIQ_HOST_ISA setting (its text, validated by config/settings.cc) and logs the
// path taken (INFO, subsystem KERNEL, once per change of path); a forced path this CPU lacks
// warns and takes auto's. Each engine calls it when it is made, before it makes a codec.
void apply_host_isa_setting(const char* value);

// Tests: the AVX2 eight-lane Philox (philox_draw() for blocks block .. block + 7, words[w][i] =
// word w of block + i). False, writing nothing, where AVX2 is not supported.
bool philox_draw_x8_avx2(uint64_t seed, uint64_t call, uint32_t hop, uint32_t stream,
                         uint32_t block, uint32_t words[4][8]);

// Tests: the AVX2 swap-or-not shuffle of 16 keys (positions[i] = shuffle_position(keys[i], member,
// strata)). False, writing nothing, where AVX2 is not supported or strata is 0.
bool shuffle_positions_x16_avx2(const uint32_t keys[16], uint32_t member, uint32_t strata,
                                uint32_t positions[16]);

// Of one value per compiled path (a factory, typically), the one of the path host_isa() names
// now: how each codec family picks its path when it is made.
template <class T>
T for_host_isa(T scalar, T avx2, T avx512) {
  switch (host_isa()) {
    case HostIsa::kAvx512:
      return avx512;
    case HostIsa::kAvx2:
      return avx2;
    case HostIsa::kScalar:
    case HostIsa::kAuto:
      break;
  }
  return scalar;
}

}  // namespace dq
