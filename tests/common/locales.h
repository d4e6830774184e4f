// Locales whose text rules differ from C's, for tests of text that must keep C's rules whatever
// the application's locale (common/c_locale.h): de_DE writes a decimal comma ("4,5"), tr_TR
// lowercases without touching 'I'. They are compiled with localedef from Debian's `locales`
// sources into a folder of the test's own, so nothing on the machine changes; where localedef or
// the source is missing the test skips.
#pragma once
#include <locale.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <map>
#include <string>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

namespace dq::test {

// Compiles `source`.UTF-8 ("de_DE", "tr_TR") into `dir` (made when missing), where a process
// with LOCPATH=dir finds it; false when localedef or the locale's source is missing.
inline bool compile_locale(const std::string& source, const std::string& dir) {
  mkdir(dir.c_str(), 0700);  // may exist already
  const std::string command =
      "localedef -i " + source + " -f UTF-8 " + dir + "/" + source + ".UTF-8 >/dev/null 2>&1";
  return std::system(command.c_str()) == 0;
}

// The locale `source`.UTF-8 loaded in this process, or (locale_t)0. Each is compiled once, into a
// temporary folder removed once loaded (the loaded locale needs its files no more), with LOCPATH
// set only around the load. The locales are kept for the process's life (a map never destroyed,
// so LeakSanitizer sees them reachable at exit).
inline locale_t compiled_locale(const std::string& source) {
  static auto* made = new std::map<std::string, locale_t>;
  if (auto it = made->find(source); it != made->end()) return it->second;
  locale_t& l = (*made)[source];
  l = static_cast<locale_t>(nullptr);
  char tmpl[] = "/tmp/dq-test-locale-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return l;
  const std::string dir = tmpl;
  if (compile_locale(source, dir)) {
    const char* before = getenv("LOCPATH");
    const std::string previous = before != nullptr ? before : "";
    setenv("LOCPATH", dir.c_str(), 1);
#if defined(__SANITIZE_ADDRESS__)
    __lsan_disable();  // glibc's newlocale does not free the LOCPATH list it builds (44 bytes)
#endif
    l = newlocale(LC_ALL_MASK, (source + ".UTF-8").c_str(), static_cast<locale_t>(nullptr));
#if defined(__SANITIZE_ADDRESS__)
    __lsan_enable();
#endif
    if (before != nullptr)
      setenv("LOCPATH", previous.c_str(), 1);
    else
      unsetenv("LOCPATH");
  }
  std::system(("rm -rf " + dir).c_str());
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
