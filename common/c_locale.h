// dynamiq's text by the C locale's rules, whatever the application's locale: numbers as "4.5",
// never "4,5", and words lowercased in ASCII. The C library's strtod, printf and tolower follow
// the calling thread's locale: a job whose script called setlocale(LC_ALL, "") on a host with a
// decimal comma (de_DE, fr_FR, ...) would have DYNAMIQ_BITS=4.5 refused, the start-up check's own
// codec specs fail to parse (every vector path refused as a faulty CPU), and its metrics written
// as "0,5", which Prometheus cannot read; on a Turkish one (tr_TR) "RING" would read "rIng".
#pragma once
#include <locale.h>

#include <string>
#include <string_view>

namespace dq {

// While it lives, the calling thread uses the C locale (uselocale); its own is restored after.
class CNumericLocale {
 public:
  CNumericLocale();
  ~CNumericLocale();
  CNumericLocale(const CNumericLocale&) = delete;
  CNumericLocale& operator=(const CNumericLocale&) = delete;

 private:
  locale_t previous_;
};

// std::strtod in the C locale, on any thread.
double strtod_c(const char* text, char** end);

// `x` as printf's "%.*g" with `significant` digits writes it in the C locale ("4.5"), on any
// thread: the one way dynamiq writes a number into a setting's, spec's or target's text.
std::string number_text(double x, int significant);

// `text` with A-Z made a-z and every other byte kept. std::tolower follows the locale: in
// tr_TR.UTF-8 it leaves 'I' as it is, so "RING" would read "rIng".
inline std::string lower_ascii(std::string_view text) {
  std::string s(text);
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

}  // namespace dq
