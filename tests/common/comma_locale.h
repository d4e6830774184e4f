// A locale whose numbers use a decimal comma (de_DE.UTF-8: "4,5"), for tests of text that must
// keep C's numbers whatever the application's locale (common/c_locale.h). Compiled once per
// process with localedef into a folder of its own, found through LOCPATH, so nothing on the
// machine changes; (locale_t)0 where localedef or the locale's source (Debian: `locales`) is
// missing, and the test skips.
#pragma once
#include <locale.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace dq::test {

inline locale_t comma_locale() {
  static const locale_t made = [] {
    char dir[] = "/tmp/dq-comma-locale-XXXXXX";
    if (mkdtemp(dir) == nullptr) return static_cast<locale_t>(nullptr);
    const std::string command =
        std::string("localedef -i de_DE -f UTF-8 ") + dir + "/de_DE.UTF-8 >/dev/null 2>&1";
    if (std::system(command.c_str()) != 0) return static_cast<locale_t>(nullptr);
    setenv("LOCPATH", dir, 1);
    return newlocale(LC_ALL_MASK, "de_DE.UTF-8", static_cast<locale_t>(nullptr));
  }();
  return made;
}

// While it lives, the calling thread uses comma_locale() (which must not be null).
class InCommaLocale {
 public:
  InCommaLocale() : previous_(uselocale(comma_locale())) {}
  ~InCommaLocale() { uselocale(previous_); }
  InCommaLocale(const InCommaLocale&) = delete;
  InCommaLocale& operator=(const InCommaLocale&) = delete;

 private:
  locale_t previous_;
};

}  // namespace dq::test
