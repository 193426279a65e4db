#include "tools/auto_flags.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>

#include <CLI/CLI.hpp>

#include "common/string_util.h"
#include "tools/commands.h"

namespace zo::tools {

void add_auto_flags(CLI::App* command, AutoFlags* flags) {
  const char* group = "Values for \"auto\" (or absent) config keys; a config value that differs is an error";
  command->add_option("--micro-batch", flags->micro_batch, "train_micro_batch_size_per_gpu")
      ->check(whole_number(1))
      ->group(group);
  command->add_option("--grad-accum", flags->grad_accum, "gradient_accumulation_steps (default 1)")
      ->check(whole_number(1))
      ->group(group);
  command->add_option("--lr", flags->lr, "optimizer.params.lr and scheduler warmup_max_lr (default: the optimizer's)")
      ->check(finite_number(true, std::numeric_limits<float>::max()))
      ->group(group);
  command->add_option("--weight-decay", flags->weight_decay, "optimizer.params.weight_decay (default: the optimizer's)")
      ->check(finite_number(false, std::numeric_limits<float>::max()))
      ->group(group);
  command->add_option("--max-grad-norm", flags->max_grad_norm, "gradient_clipping (default 1.0; 0 disables)")
      ->check(finite_number(false))
      ->group(group);
  command->add_option("--warmup-steps", flags->warmup_steps, "scheduler warmup_num_steps (default 0)")
      ->check(whole_number(0, INT64_MAX))
      ->group(group);
  command->add_option("--precision", flags->precision, "bf16 | fp16 | fp32: fp16.enabled / bf16.enabled (default fp32)")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}))
      ->group(group);
}

void apply_auto_flags(const AutoFlags& flags, engine::ResolveContext* ctx) {
  if (flags.micro_batch > 0) ctx->micro_batch_size = flags.micro_batch;
  if (flags.grad_accum > 0) ctx->gradient_accumulation_steps = flags.grad_accum;
  if (flags.lr > 0) ctx->lr = flags.lr;
  if (flags.weight_decay >= 0) ctx->weight_decay = flags.weight_decay;
  if (flags.max_grad_norm >= 0) ctx->max_grad_norm = flags.max_grad_norm;
  if (flags.warmup_steps >= 0) ctx->warmup_steps = static_cast<uint64_t>(flags.warmup_steps);
  if (flags.precision == "bf16") ctx->mixed_precision = engine::DType::kBF16;
  else if (flags.precision == "fp16") ctx->mixed_precision = engine::DType::kF16;
  else if (flags.precision == "fp32") ctx->mixed_precision = engine::DType::kF32;
}

std::optional<engine::Config> load_config_with_flags(const std::string& path, uint64_t hidden_size, uint64_t steps,
                                                     const AutoFlags& flags, uint64_t world_size) {
  engine::ResolveContext ctx;
  ctx.hidden_size = hidden_size;
  ctx.world_size = world_size;
  if (steps) ctx.total_steps = steps;
  apply_auto_flags(flags, &ctx);
  engine::ConfigDiagnostics diag;
  std::optional<engine::Config> config = engine::load_config_file(path, ctx, &diag);
  // A path of many KB is shown as an excerpt, not once per line.
  const std::string shown = bounded_name(path);
  for (const engine::ConfigIssue& w : diag.warnings) std::cerr << shown << ": warning: " << w.to_string() << "\n";
  if (!config) {
    for (const engine::ConfigIssue& e : diag.errors) std::cerr << shown << ": error: " << e.to_string() << "\n";
  }
  return config;
}

}  // namespace zo::tools
