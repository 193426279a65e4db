// zoffload: out-of-core training with DeepSpeed-compatible offload configs.
#include <CLI/CLI.hpp>

#include <csignal>

#include "tools/commands.h"
#include "zo_build_config.h"

int main(int argc, char** argv) {
  // Under `ulimit -f` a write past the limit raises SIGXFSZ, which kills without a word; ignored,
  // the write fails with EFBIG and is reported like any other write error, with its path.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"zoffload " ZO_VERSION
               ": fine-tune models larger than GPU memory by offloading parameters and optimizer\n"
               "state to pinned CPU memory and NVMe. Reads DeepSpeed JSON configs (see docs/config.md)."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "zoffload " ZO_VERSION);
  int exit_code = 0;
  zo::tools::register_config_command(app, &exit_code);
  zo::tools::register_info_command(app, &exit_code);
  zo::tools::register_train_command(app, &exit_code);
  zo::tools::register_ckpt_command(app, &exit_code);
  zo::tools::register_export_command(app, &exit_code);
  zo::tools::register_plan_command(app, &exit_code);
  return zo::tools::run_app(app, argc, argv, exit_code);
}
