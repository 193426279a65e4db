// The subcommands of `zoffload` (tools/cmd_<name>.cpp) and `zoffload-bench` (tools/bench_<name>.cpp).
// Each adds itself to a CLI11 app; its callback runs the command and stores the process exit code
// (0 ok, 1 runtime failure, 2 bad usage or bad config) in `*exit_code`, which must outlive parsing.
#pragma once

namespace CLI {
class App;
}

namespace zo::tools {

// zoffload
void register_config_command(CLI::App& app, int* exit_code);
void register_info_command(CLI::App& app, int* exit_code);
void register_train_command(CLI::App& app, int* exit_code);
void register_ckpt_command(CLI::App& app, int* exit_code);
void register_export_command(CLI::App& app, int* exit_code);
void register_plan_command(CLI::App& app, int* exit_code);

// zoffload-bench
void register_bench_io(CLI::App& app, int* exit_code);
void register_bench_adam(CLI::App& app, int* exit_code);
void register_bench_grad(CLI::App& app, int* exit_code);
void register_bench_pipeline(CLI::App& app, int* exit_code);
void register_bench_ckpt(CLI::App& app, int* exit_code);
void register_bench_pcie(CLI::App& app, int* exit_code);

// Parses the command line and runs the chosen subcommand; returns the process exit code: the
// command's `exit_code`, 0 for --help/--version, 2 for a command line CLI11 rejects.
int run_app(CLI::App& app, int argc, char** argv, const int& exit_code);

}  // namespace zo::tools
