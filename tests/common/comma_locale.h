// Locales whose text rules differ from C's, for tests of text that must keep C's rules whatever
// the application's locale (common/c_locale.h): de_DE writes a decimal comma ("4,5"), tr_TR
// lowercases without touching 'I'. Each is compiled once per process with localedef into a folder
// of its own, found through LOCPATH, so nothing on the machine changes; (locale_t)0 where
// localedef or the locale's source (Debian: `locales`) is missing, and the test skips.
#pragma once
#include <locale.h>
#include <stdlib.h>
#include <unistd.h>

#include <map>
#include <string>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

namespace dq::test {

// The locale `source`.UTF-8 ("de_DE", "tr_TR"), or (locale_t)0. The locales are kept for the
// process's life (a map never destroyed, so LeakSanitizer sees them reachable at exit).
inline locale_t compiled_locale(const std::string& source) {
  static auto* made = new std::map<std::string, locale_t>;
  static auto* dir = new std::string;
  if (auto it = made->find(source); it != made->end()) return it->second;
  locale_t& l = (*made)[source];
  l = static_cast<locale_t>(nullptr);
  if (dir->empty()) {
    char tmpl[] = "/tmp/dq-test-locales-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return l;
    *dir = tmpl;
    setenv("LOCPATH", dir->c_str(), 1);
  }
  const std::string name = source + ".UTF-8";
  const std::string command =
      "localedef -i " + source + " -f UTF-8 " + *dir + "/" + name + " >/dev/null 2>&1";
  if (std::system(command.c_str()) != 0) return l;
#if defined(__SANITIZE_ADDRESS__)
  __lsan_disable();  // glibc's newlocale does not free the LOCPATH list it builds (44 bytes)
#endif
  l = newlocale(LC_ALL_MASK, name.c_str(), static_cast<locale_t>(nullptr));
#if defined(__SANITIZE_ADDRESS__)
  __lsan_enable();
#endif
  return l;
}

inline locale_t comma_locale() {
  return compiled_locale("de_DE");
}

// While it lives, the calling thread uses `l` (which must not be null).
class InLocale {
 public:
  explicit InLocale(locale_t l) : previous_(uselocale(l)) {}
  ~InLocale() { uselocale(previous_); }
  InLocale(const InLocale&) = delete;
  InLocale& operator=(const InLocale&) = delete;

 private:
  locale_t previous_;
};

}  // namespace dq::test
