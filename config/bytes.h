// The one size syntax of dynamiq, shared by the settings table (Bytes entries) and every tool's
// size options: a decimal integer with an optional unit, every unit a power of 1024 whatever its
// spelling, letters in any case:
//   B (bytes), K KB KiB, M MB MiB, G GB GiB, T TB TiB      e.g. 512, 64K, 1MB, 1MiB, 16m, 1GiB
// No sign, blanks, fraction or hex; false on anything else and on values beyond 2^64 - 1.
// constexpr, so that the settings table's defaults are checked at compile time.
#pragma once

#include <cstdint>
#include <string_view>

namespace dq::config {

constexpr char ascii_lower(char c) {
  return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
}

constexpr bool parse_bytes(std::string_view text, uint64_t* out) {
  size_t i = 0;
  uint64_t value = 0;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
    const uint64_t digit = static_cast<uint64_t>(text[i] - '0');
    if (value > (UINT64_MAX - digit) / 10) return false;
    value = value * 10 + digit;
  }
  if (i == 0) return false;  // no digits: empty, signed, blank or a bare unit
  std::string_view unit = text.substr(i);
  unsigned shift = 0;
  if (!unit.empty()) {
    switch (ascii_lower(unit[0])) {
      case 'b':
        return unit.size() == 1 ? (*out = value, true) : false;
      case 'k':
        shift = 10;
        break;
      case 'm':
        shift = 20;
        break;
      case 'g':
        shift = 30;
        break;
      case 't':
        shift = 40;
        break;
      default:
        return false;
    }
    unit.remove_prefix(1);
    // What may follow the prefix letter: nothing, "B" or "iB".
    if (unit.size() == 2 && ascii_lower(unit[0]) == 'i' && ascii_lower(unit[1]) == 'b') {
      unit.remove_prefix(2);
    } else if (unit.size() == 1 && ascii_lower(unit[0]) == 'b') {
      unit.remove_prefix(1);
    }
    if (!unit.empty()) return false;
  }
  if (value > (UINT64_MAX >> shift)) return false;
  *out = value << shift;
  return true;
}

}  // namespace dq::config
