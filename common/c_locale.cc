#include "common/c_locale.h"

#include <cstdio>
#include <cstdlib>

namespace dq {
namespace {

// The C locale, made once and kept for the process's life (threads may use it until exit).
locale_t c_locale() {
  static const locale_t c = newlocale(LC_ALL_MASK, "C", static_cast<locale_t>(nullptr));
  return c;
}

}  // namespace

CNumericLocale::CNumericLocale()
    : previous_(c_locale() != static_cast<locale_t>(nullptr) ? uselocale(c_locale())
                                                             : static_cast<locale_t>(nullptr)) {}

CNumericLocale::~CNumericLocale() {
  if (previous_ != static_cast<locale_t>(nullptr)) uselocale(previous_);
}

std::string number_text(double x, int significant) {
  const CNumericLocale c_numbers;
  char text[64];
  std::snprintf(text, sizeof text, "%.*g", significant, x);
  return text;
}

double strtod_c(const char* text, char** end) {
  const locale_t c = c_locale();
  return c != static_cast<locale_t>(nullptr) ? strtod_l(text, end, c) : std::strtod(text, end);
}

}  // namespace dq
