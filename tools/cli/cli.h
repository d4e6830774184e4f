// The command lines of every dynamiq tool go through CLI11 (Debian libcli11-dev) and this helper,
// so they behave alike: "--opt value" and "--opt=value" (and "-xVALUE" for one-letter options),
// -h/--help prints the tool's usage, --version prints "PROGRAM VERSION (git REVISION)", and an
// option the tool does not know is refused by name ("unknown option '--bogus'").
// JSON written by the tools goes through nlohmann-json; see json_number below for non-finite
// values.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace dq::cli {

// "PROGRAM 0.1.0 (git 0a62516)": the project's version and the git revision of the build, what
// --version prints.
std::string version_line(const std::string& program);

// An App with -h/--help and --version and nothing else; add the tool's options to it.
void configure(CLI::App* app, const std::string& program);

// An option taking one value per occurrence ("-b 1K", "-b1K", "--minbytes 1K",
// "--minbytes=1K"; a value may start with '-', e.g. "-r -1"), repeatable. Values stay strings:
// each tool validates them after parse() (walking in_order()) and keeps its own messages.
CLI::Option* add_value(CLI::App* app, const std::string& names, const std::string& help = "");
// A flag without a value: "--lossy=1" is refused ("--lossy takes no value").
CLI::Option* add_switch(CLI::App* app, const std::string& names, const std::string& help = "");

enum class Parsed {
  kRun,      // go on
  kHelp,     // -h/--help was given: print the usage on stdout, exit 0
  kVersion,  // --version was given: print version_line(program) on stdout, exit 0
  kError,    // *error says what was wrong (naming the option); exit 2 with the usage on stderr
};
// Parses argv[1..argc-1] with `app`. Help wins over --version and over every error except an
// unknown option found before it.
Parsed parse(CLI::App* app, int argc, const char* const* argv, std::string* error);

// Every occurrence of an option, in command-line order, with its value ("" for a flag): the
// tools apply repeated and overlapping options in the order given, as their hand-written parsers
// did.
struct Occurrence {
  const CLI::Option* option;
  std::string value;
};
std::vector<Occurrence> in_order(const CLI::App& app);

// A number for JSON: the value itself when finite, else null (JSON has no NaN or Infinity).
nlohmann::ordered_json json_number(double v);
// Sets row[key] = json_number(v) and row[key + "_finite"] = isfinite(v) when `always_flag` or v
// is not finite: a reader tells "no value" from a NaN or an infinity by the flag.
void put_number(nlohmann::ordered_json* row, const std::string& key, double v,
                bool always_flag = false);
// The same for a list: non-finite elements are null, row[key + "_finite"] is false when any is.
void put_numbers(nlohmann::ordered_json* row, const std::string& key, const std::vector<double>& v,
                 bool always_flag = false);

}  // namespace dq::cli
