// FNV-1a over bytes: the fingerprint the project compares and names things by (a host's identity,
// a setting's canonical text, a result compared across ranks, a socket name). Not a format's
// digest: the codecs' layout digests are word-wise and live with their codecs (kernels/).
// Not cryptographic.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace dq {

// The published FNV-1a parameters: offset basis and prime, 64 and 32 bits.
constexpr uint64_t kFnv1a64Basis = 14695981039346656037ull;  // 0xcbf29ce484222325
constexpr uint64_t kFnv1a64Prime = 1099511628211ull;         // 2^40 + 2^8 + 0xb3
constexpr uint32_t kFnv1a32Basis = 2166136261u;              // 0x811c9dc5
constexpr uint32_t kFnv1a32Prime = 16777619u;                // 2^24 + 2^8 + 0x93

// `h` continues a hash: fnv1a64(a + b) == fnv1a64(b, fnv1a64(a)).
inline uint64_t fnv1a64(const void* data, size_t bytes, uint64_t h = kFnv1a64Basis) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * kFnv1a64Prime;
  return h;
}
inline uint64_t fnv1a64(std::string_view text) {
  return fnv1a64(text.data(), text.size());
}

inline uint32_t fnv1a32(std::string_view text) {
  uint32_t h = kFnv1a32Basis;
  for (unsigned char c : text) h = (h ^ c) * kFnv1a32Prime;
  return h;
}

}  // namespace dq
