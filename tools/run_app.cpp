#include <CLI/CLI.hpp>

#include <filesystem>
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
