#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <iostream>
#include <new>
#include <string>
#include <system_error>

#include "tools/commands.h"

namespace zo::tools {

int run_app(CLI::App& app, int argc, char** argv, const int& exit_code) {
  // Bad usage reads like every other error of the tool: "zoffload: error: --lr: inf is not ...",
  // then where to look.
  const std::string tool = argc > 0 ? std::filesystem::path(argv[0]).filename().string() : app.get_name();
  app.failure_message([tool](const CLI::App*, const CLI::Error& e) {
    return tool + ": error: " + e.what() + "\nRun with --help for more information.\n";
  });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // app.exit prints the help, version or error; only a real parse error is bad usage.
    return app.exit(e) == 0 ? 0 : 2;
  } catch (const std::bad_alloc&) {
    // Note [Out of resources]: under `ulimit -v`, or on a host out of memory, an allocation or a
    // thread start at start-up is one line and exit 1, not an abort with a core dump.
    std::cerr << tool << ": error: out of memory: an allocation failed (the address space limit, ulimit -v, or the "
              << "host's memory; `zoffload plan` shows what the run needs)\n";
    return 1;
  } catch (const std::system_error& e) {
    std::cerr << tool << ": error: "
              << (e.code() == std::errc::resource_unavailable_try_again
                      ? "could not start a thread (" + std::string(e.what()) +
                            "): the process is out of memory or threads (ulimit -v, ulimit -u)"
                      : std::string(e.what()))
              << "\n";
    return 1;
  }
  return exit_code;
}

CLI::Validator whole_number(uint64_t min, uint64_t max) {
  const std::string range = "[" + std::to_string(min) + ", " + std::to_string(max) + "]";
  return CLI::Validator(
      [min, max, range](std::string& text) -> std::string {
        uint64_t v = 0;
        const char* end = text.data() + text.size();
        const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
        const auto [p, ec] = std::from_chars(text.data(), end, v);
        if (digits && ec == std::errc() && p == end && v >= min && v <= max) return "";
        return text + " is not a whole number in " + range;
      },
      "INT in " + range);
}

CLI::Validator finite_number(bool positive, double max) {
  return CLI::Validator(
      [positive, max](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        const bool number = end != text.c_str() && *end == '\0';
        if (number && std::isfinite(v) && (positive ? v > 0 : v >= 0) && v <= max) return "";
        char bound[32] = "";
        if (max < std::numeric_limits<double>::max()) std::snprintf(bound, sizeof bound, " and at most %g", max);
        return text + " is not a finite number " + (positive ? "> 0" : "≥ 0") + bound;
      },
      positive ? "NUMBER > 0" : "NUMBER ≥ 0");
}

int exit_code_of(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kAlreadyExists: return 2;
    default: return 1;
  }
}

int command_error(const std::string& command, const std::string& what, int code) {
  std::cerr << command << ": error: " << what << "\n";
  return code;
}

int command_error(const std::string& command, const Status& s) {
  return command_error(command, s.to_string(), exit_code_of(s));
}

}  // namespace zo::tools
