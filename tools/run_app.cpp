#include <CLI/CLI.hpp>

#include <filesystem>
#include <string>

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
  }
  return exit_code;
}

}  // namespace zo::tools
