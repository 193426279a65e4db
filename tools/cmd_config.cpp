// `zoffload config check FILE`: validate a config and print it fully resolved.
// `zoffload config keys`: every key the config reads, with its type and default.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/string_util.h"
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

  // Each line names the file; a path that is megabytes long is named by an excerpt (issue 40).
  const std::string source = a.demo ? "<embedded demo config>" : bounded_name(a.file);
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

int run_config_keys(bool as_json) {
  const engine::ConfigKeyList list = engine::config_keys();
  if (as_json) {
    nlohmann::json out = {{"keys", nlohmann::json::array()},
                          {"aliases", nlohmann::json::array()},
                          {"no_effect", nlohmann::json::array()}};
    for (const engine::ConfigKey& k : list.keys)
      out["keys"].push_back({{"path", k.path},
                             {"type", k.type},
                             {"default", nlohmann::json::parse(k.default_json)},
                             {"auto", k.auto_ok}});
    for (const engine::ConfigAlias& a : list.aliases)
      out["aliases"].push_back({{"path", a.path}, {"reads_as", a.reads_as}, {"deprecated", a.deprecated}});
    for (const engine::ConfigNoEffect& n : list.no_effect)
      out["no_effect"].push_back({{"path", n.path}, {"why", n.why}});
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  // Columns count characters, not bytes: the types hold "≥" and "–".
  auto width_of = [](const std::string& s) {
    return static_cast<size_t>(std::count_if(s.begin(), s.end(), [](char c) { return (c & 0xC0) != 0x80; }));
  };
  size_t path_width = 0, type_width = 0;
  for (const engine::ConfigKey& k : list.keys) {
    path_width = std::max(path_width, width_of(k.path));
    type_width = std::max(type_width, width_of(k.type));
  }
  auto pad = [&](const std::string& s, size_t width) {
    return s + std::string(width > width_of(s) ? width - width_of(s) : 0, ' ');
  };
  std::cout << pad("KEY", path_width) << "  " << pad("TYPE", type_width) << "  DEFAULT\n";
  for (const engine::ConfigKey& k : list.keys) {
    // The optimizer's default is a whole object (AdamW and its params, listed per type in
    // docs/config.md); no scheduler block means a constant lr.
    const std::string shown = k.path == "optimizer"   ? "AdamW (params per type: docs/config.md)"
                              : k.path == "scheduler" ? "none: a constant lr (params per type: docs/config.md)"
                                                      : k.default_json;
    std::cout << pad(k.path, path_width) << "  " << pad(k.type, type_width) << "  " << shown
              << (k.auto_ok ? "  (\"auto\" accepted)" : "") << "\n";
  }
  std::cout << "\nOther names (read as the key after the arrow):\n";
  for (const engine::ConfigAlias& a : list.aliases)
    std::cout << "  " << a.path << " -> " << a.reads_as << (a.deprecated ? "  (deprecated: warns)" : "") << "\n";
  std::cout << "\nDeepSpeed keys accepted with a warning, no effect in zoffload:\n";
  for (const engine::ConfigNoEffect& n : list.no_effect) std::cout << "  " << n.path << ": " << n.why << "\n";
  std::cout << "\nMeanings, units and the rules between keys: docs/config.md.\n";
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
                    "and stage3_param_persistence_threshold (10·h)")
      ->check(whole_number(1));
  check->add_option("--world-size", args->world_size, "Number of ranks, for train_batch_size")
      ->check(whole_number(1));
  check->add_option("--steps", args->steps, "Training steps: resolves scheduler total_num_steps")
      ->check(whole_number(1));
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

  auto keys_json = std::make_shared<bool>(false);
  CLI::App* keys = config->add_subcommand(
      "keys",
      "List every key a config may hold: its path, type and range, default (before \"auto\" and the\n"
      "rules between keys are resolved: `config check` shows those), and whether \"auto\" is accepted;\n"
      "then the other names keys may be given under, and the DeepSpeed keys accepted with no effect.\n"
      "The list comes from the table the config reader itself uses.");
  keys->add_flag("--json", *keys_json, "Print {keys, aliases, no_effect} as JSON");
  keys->callback([keys_json, exit_code] { *exit_code = run_config_keys(*keys_json); });
}

}  // namespace zo::tools
