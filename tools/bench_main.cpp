// zoffload-bench: measures the parts of zoffload against their baselines in the same run.
#include <CLI/CLI.hpp>

#include <csignal>

#include "tools/commands.h"
#include "zo_build_config.h"

int main(int argc, char** argv) {
  std::signal(SIGXFSZ, SIG_IGN);  // as in zoffload: a write past `ulimit -f` fails with EFBIG, reported
  CLI::App app{"zoffload-bench " ZO_VERSION
               ": benchmarks for zoffload's I/O, CPU optimizer, swap pipeline, host step, PCIe paths and LoRA merge.\n"
               "Each benchmark checks its results first, measures its baseline in the same run and\n"
               "prints the ratio; --json prints machine-readable results."};
  app.require_subcommand(1);
  int exit_code = 0;
  zo::tools::register_bench_io(app, &exit_code);
  zo::tools::register_bench_adam(app, &exit_code);
  zo::tools::register_bench_grad(app, &exit_code);
  zo::tools::register_bench_pipeline(app, &exit_code);
  zo::tools::register_bench_host(app, &exit_code);
  zo::tools::register_bench_ckpt(app, &exit_code);
  zo::tools::register_bench_pcie(app, &exit_code);
  zo::tools::register_bench_merge(app, &exit_code);
  return zo::tools::run_app(app, argc, argv, exit_code);
}
