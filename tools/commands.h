// The subcommands of `zoffload` (tools/cmd_<name>.cpp) and `zoffload-bench` (tools/bench_<name>.cpp).
// Each adds itself to a CLI11 app; its callback runs the command and stores the process exit code
// (0 ok, 1 runtime failure, 2 bad usage or bad config) in `*exit_code`, which must outlive parsing.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace CLI {
class App;
class Validator;
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
void register_bench_host(CLI::App& app, int* exit_code);
void register_bench_ckpt(CLI::App& app, int* exit_code);
void register_bench_pcie(CLI::App& app, int* exit_code);
void register_bench_merge(CLI::App& app, int* exit_code);

// Option checks with messages that say what is wanted ("--seed: -1 is not a whole number in [0,
// 18446744073709551615]"). CLI11 reads "-1" into an unsigned option as 2^64 - 1 and prints its own
// ranges with 309 digits, so every numeric option of the tools takes one of these.
// whole_number: decimal digits only (no sign, point or exponent), in [min, max].
CLI::Validator whole_number(uint64_t min, uint64_t max = UINT64_MAX);
// finite_number: a finite decimal number > 0 (positive) or ≥ 0, at most `max` (nan and inf refused).
CLI::Validator finite_number(bool positive, double max = 1.7976931348623157e308);

// Parses the command line and runs the chosen subcommand; returns the process exit code: the
// command's `exit_code`, 0 for --help/--version, 2 for a command line CLI11 rejects.
int run_app(CLI::App& app, int argc, char** argv, const int& exit_code);

// The exit code for a failed status: bad input (a path that is not there, a bad option, an output
// that already exists) is 2; a failure while running (corruption, I/O) is 1.
int exit_code_of(const Status& s);

// Prints "<command>: error: <what>" on stderr and returns `code`: a command's early return, e.g.
// `return command_error("zoffload export", "--shard-size must be more than 0 bytes", 2);`.
int command_error(const std::string& command, const std::string& what, int code);
// The same for a failed status, with its exit code (exit_code_of).
int command_error(const std::string& command, const Status& s);

}  // namespace zo::tools
