#include "tools/cli/cli.h"

#include <cmath>
#include <map>

#include "tools/cli/version.h"

namespace dq::cli {

std::string version_line(const std::string& program) {
  return program + " " DYNAMIQ_VERSION " (git " DYNAMIQ_GIT_REVISION ")";
}

void configure(CLI::App* app, const std::string& program) {
  app->name(program);
  app->set_help_flag("-h,--help", "print this help");
  app->set_version_flag("--version", version_line(program), "print the version and exit");
  app->allow_windows_style_options(false);
  // Every occurrence of an option is kept (see in_order()).
  app->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

CLI::Option* add_value(CLI::App* app, const std::string& names, const std::string& help) {
  return app->add_option(names, help)->allow_extra_args(false);
}

CLI::Option* add_switch(CLI::App* app, const std::string& names, const std::string& help) {
  return app->add_flag(names, help)->disable_flag_override();
}

namespace {

// CLI11 says "--root: 1 required  missing"; say "--root needs a value".
std::string reword(const std::string& what) {
  const size_t at = what.find(": 1 required ");
  const std::string tail = " missing";
  if (at != std::string::npos && what.size() >= tail.size() &&
      what.compare(what.size() - tail.size(), tail.size(), tail) == 0)
    return what.substr(0, at) + " needs a value";
  const std::string override_ = " was given a disallowed flag override";
  const size_t ov = what.find(override_);
  if (ov != std::string::npos) {
    std::string name = what.substr(0, ov);
    return (name.size() == 1 ? "-" : "--") + name + " takes no value";
  }
  return what;
}

}  // namespace

Parsed parse(CLI::App* app, int argc, const char* const* argv, std::string* error) {
  try {
    // CLI11 takes a non-const char**; it does not write through it.
    app->parse(argc, const_cast<char**>(argv));
  } catch (const CLI::CallForHelp&) {
    return Parsed::kHelp;
  } catch (const CLI::CallForAllHelp&) {
    return Parsed::kHelp;
  } catch (const CLI::CallForVersion&) {
    return Parsed::kVersion;
  } catch (const CLI::ExtrasError&) {
    const std::vector<std::string> extra = app->remaining();
    const std::string first = extra.empty() ? std::string("?") : extra.front();
    if (first.size() > 1 && first[0] == '-')
      *error = "unknown option '" + first + "'";
    else
      *error = "unexpected argument '" + first + "'";
    return Parsed::kError;
  } catch (const CLI::ParseError& e) {
    *error = reword(e.what());
    return Parsed::kError;
  }
  return Parsed::kRun;
}

std::vector<Occurrence> in_order(const CLI::App& app) {
  std::vector<Occurrence> out;
  std::map<const CLI::Option*, size_t> next;
  for (const CLI::Option* o : app.parse_order()) {
    size_t& k = next[o];
    std::string value;
    if (o->get_expected_min() > 0 && k < o->results().size()) value = o->results()[k];
    ++k;
    out.push_back({o, value});
  }
  return out;
}

nlohmann::ordered_json json_number(double v) {
  return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr);
}

void put_number(nlohmann::ordered_json* row, const std::string& key, double v, bool always_flag) {
  (*row)[key] = json_number(v);
  if (always_flag || !std::isfinite(v))
    (*row)[key + "_finite"] = static_cast<bool>(std::isfinite(v));
}

void put_numbers(nlohmann::ordered_json* row, const std::string& key, const std::vector<double>& v,
                 bool always_flag) {
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  bool finite = true;
  for (double x : v) {
    list.push_back(json_number(x));
    finite = finite && std::isfinite(x);
  }
  (*row)[key] = std::move(list);
  if (always_flag || !finite) (*row)[key + "_finite"] = finite;
}

}  // namespace dq::cli
