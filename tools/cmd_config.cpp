// `zoffload config check FILE`: validate a config and print it fully resolved.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "engine/config/config.h"
#include "tools/auto_flags.h"
#include "tools/commands.h"

namespace zo::tools {
namespace {

struct ConfigCheckArgs {
  std::string file;
  bool demo = false;
  uint64_t hidden_size = 0;
  uint64_t world_size = 1;
  uint64_t steps = 0;
  AutoFlags flags;
  bool quiet = false;
};

int run_config_check(const ConfigCheckArgs& a) {
  engine::ResolveContext ctx;
  if (a.hidden_size) ctx.hidden_size = a.hidden_size;
  ctx.world_size = a.world_size;
  if (a.steps) ctx.total_steps = a.steps;
  apply_auto_flags(a.flags, &ctx);

  const std::string source = a.demo ? "<embedded demo config>" : a.file;
  engine::ConfigDiagnostics diag;
  std::optional<engine::Config> config = a.demo ? engine::parse_config(engine::embedded_demo_config(), ctx, &diag)
                                                 : engine::load_config_file(a.file, ctx, &diag);
  for (const engine::ConfigIssue& w : diag.warnings) std::cerr << source << ": warning: " << w.to_string() << "\n";
  if (!config) {
    for (const engine::ConfigIssue& e : diag.errors) std::cerr << source << ": error: " << e.to_string() << "\n";
    std::cerr << source << ": " << diag.errors.size() << (diag.errors.size() == 1 ? " error" : " errors") << "\n";
    return 2;
  }
  if (!a.quiet) std::cout << engine::to_json(*config).dump(2) << "\n";
  return 0;
}

}  // namespace

void register_config_command(CLI::App& app, int* exit_code) {
  CLI::App* config = app.add_subcommand("config", "Work with JSON configs");
  config->require_subcommand(1);
  auto args = std::make_shared<ConfigCheckArgs>();
  CLI::App* check = config->add_subcommand(
      "check",
      "Validate a DeepSpeed/zoffload JSON config and print it fully resolved (every default filled in,\n"
      "\"auto\" resolved) as JSON on stdout. Exit 0 if valid; otherwise print one line per error\n"
      "(\"FILE: error: key.path: what is wrong\") on stderr and exit 2. Warnings go to stderr.\n"
      "The flags supply what \"auto\" values resolve from, as Hugging Face Accelerate does; they are\n"
      "the same flags `zoffload train` takes, so a config that checks with them trains with them.");
  auto* file_opt = check->add_option("file", args->file, "The config file (JSON)");
  auto* demo_opt = check->add_flag("--demo", args->demo, "Check the demo config built into zoffload instead of a file");
  file_opt->excludes(demo_opt);
  check->add_option("--hidden-size", args->hidden_size,
                    "Model hidden size: resolves reduce_bucket_size (h·h), stage3_prefetch_bucket_size (0.9·h·h) "
                    "and stage3_param_persistence_threshold (10·h)");
  check->add_option("--world-size", args->world_size, "Number of ranks, for train_batch_size")->check(CLI::PositiveNumber);
  check->add_option("--steps", args->steps, "Training steps: resolves scheduler total_num_steps")->check(CLI::PositiveNumber);
  add_auto_flags(check, &args->flags);
  check->add_flag("-q,--quiet", args->quiet, "Print nothing on success");
  check->callback([args, exit_code, check] {
    if (args->file.empty() && !args->demo) {
      std::cerr << "zoffload config check: give a config FILE or --demo\n" << check->help();
      *exit_code = 2;
      return;
    }
    *exit_code = run_config_check(*args);
  });
}

}  // namespace zo::tools
