// `zoffload ckpt verify|inspect PATH`: re-check every checksum of a checkpoint, or summarise it.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/timer.h"
#include "engine/ckpt/checkpoint.h"
#include "io/io_engine.h"
#include "tools/commands.h"

namespace zo::tools {
namespace {

struct CkptArgs {
  std::string path;
  std::string staging = "64MiB";
  bool json = false;
  bool quiet = false;
};

Result<engine::CheckpointInfo> open_named(const std::string& path) {
  ZO_ASSIGN_OR_RETURN(std::string dir, engine::resolve_checkpoint(path, io::Env::posix()));
  return engine::open_checkpoint(dir, io::Env::posix());
}

int run_verify(const CkptArgs& a) {
  auto staging_bytes = parse_size_bytes(a.staging);
  if (!staging_bytes.is_ok())
    return command_error("zoffload ckpt verify", invalid_argument("--staging: " + staging_bytes.status().message()));
  if (Status st = engine::check_staging_bytes(*staging_bytes, "--staging " + a.staging); !st.is_ok())
    return command_error("zoffload ckpt verify", st);
  auto info = open_named(a.path);
  if (!info.is_ok() && a.json) {
    std::cout << nlohmann::json({{"path", a.path}, {"ok", false}, {"error", info.status().to_string()}}).dump(2)
              << "\n";
    return exit_code_of(info.status());
  }
  if (!info.is_ok()) return command_error("zoffload ckpt verify", info.status());
  auto io = io::IoEngine::create(io::IoOptions{});
  if (!io.is_ok()) return command_error("zoffload ckpt verify", io.status());
  auto staging = AlignedBuffer::allocate(*staging_bytes);
  if (!staging.is_ok()) return command_error("zoffload ckpt verify", staging.status());
  const bool tty = isatty(fileno(stderr)) != 0 && !a.quiet && !a.json;
  const Stopwatch watch;
  uint64_t bytes = 0;
  Status s =
      engine::verify_checkpoint(*info, **io, staging->bytes(), io::Env::posix(), [&](uint64_t done, uint64_t total) {
        bytes = total;
        if (tty)
          std::fprintf(stderr, "\r\033[Kverifying: %s of %s", format_bytes(done).c_str(), format_bytes(total).c_str());
      });
  if (tty) std::fputs("\r\033[K", stderr);
  const double secs = watch.elapsed_s();
  if (a.json) {
    nlohmann::json j = {{"path", info->path},
                        {"ok", s.is_ok()},
                        {"bytes", bytes},
                        {"seconds", secs},
                        {"files", info->manifest.files.size()}};
    if (!s.is_ok()) j["error"] = s.to_string();
    std::cout << j.dump(2) << "\n";
    return s.is_ok() ? 0 : 1;
  }
  if (!s.is_ok()) return command_error("zoffload ckpt verify", s);
  if (!a.quiet) {
    std::printf("%s: OK — %zu files, %s, every CRC-32C matches (%.1f s, %.2f GB/s)\n", info->path.c_str(),
                info->manifest.files.size(), format_bytes(bytes).c_str(), secs, secs > 0 ? bytes / secs / 1e9 : 0.0);
  }
  return 0;
}

int run_inspect(const CkptArgs& a) {
  auto info = open_named(a.path);
  if (!info.is_ok()) return command_error("zoffload ckpt inspect", info.status());
  const nlohmann::json d = engine::describe_checkpoint(*info);
  if (a.json) {
    std::cout << d.dump(2) << "\n";
    return 0;
  }
  std::printf("checkpoint %s (format %d)\n", info->path.c_str(), info->manifest.format_version);
  std::printf("  step %llu (%llu optimizer steps, %llu skipped on overflow), loss scale %g\n",
              static_cast<unsigned long long>(info->state.steps_done),
              static_cast<unsigned long long>(info->state.optimizer_steps),
              static_cast<unsigned long long>(info->state.steps_done - info->state.optimizer_steps),
              info->state.loss_scaler.cur_scale);
  std::printf("  model %s: %zu tensors, %llu parameters%s\n", info->state.model.c_str(),
              info->manifest.tensors.size() + info->manifest.frozen.size(),
              static_cast<unsigned long long>(d["parameters"].get<uint64_t>()),
              info->manifest.frozen.empty() ? ""
                                            : (" (" + std::to_string(d["frozen_parameters"].get<uint64_t>()) +
                                               " frozen, zoffload.freeze: their weights in frozen.safetensors)")
                                                  .c_str());
  if (const uint64_t packed = d["packed_base_tensors"].get<uint64_t>(); packed > 0)
    std::printf(
        "  and %llu frozen weight tensors packed (a 4-bit or 8-bit base under LoRA), %s in frozen.safetensors\n",
        static_cast<unsigned long long>(packed), format_bytes(d["packed_base_bytes"].get<uint64_t>()).c_str());
  std::printf("  Adam moments %s\n", info->manifest.moments == engine::MomentDtype::k8bit
                                         ? "8-bit blockwise (codes + absmax per 256, fp32 under 4096 elements)"
                                     : info->manifest.moments == engine::MomentDtype::kBF16 ? "bf16"
                                                                                            : "fp32");
  std::printf("  data %s, seq_len %llu, seed %llu, position epoch %llu batch %llu\n", info->state.data.c_str(),
              static_cast<unsigned long long>(info->state.seq_len), static_cast<unsigned long long>(info->state.seed),
              static_cast<unsigned long long>(info->state.data_position.epoch),
              static_cast<unsigned long long>(info->state.data_position.index));
  for (const engine::FileDigest& f : info->manifest.files) {
    std::printf("  %-24s %12s  %zu chunk%s\n", f.name.c_str(), format_bytes(f.size_bytes).c_str(),
                f.chunk_crc32c.size(), f.chunk_crc32c.size() == 1 ? "" : "s");
  }
  std::printf("  total %s (checksums not read: `zoffload ckpt verify` checks them)\n",
              format_bytes(d["bytes"].get<uint64_t>()).c_str());
  return 0;
}

}  // namespace

void register_ckpt_command(CLI::App& app, int* exit_code) {
  CLI::App* ckpt = app.add_subcommand(
      "ckpt",
      "Check and describe checkpoints written by `zoffload train` (format: docs/checkpoint_format.md).\n"
      "PATH is a step-N directory or a checkpoint directory whose `latest` names one.");
  ckpt->require_subcommand(1);

  auto va = std::make_shared<CkptArgs>();
  CLI::App* verify = ckpt->add_subcommand(
      "verify",
      "Re-read every file of a checkpoint and check every CRC-32C chunk against the manifest; exit 0 only "
      "when all match (1 on corruption or I/O errors, 2 when PATH is not a checkpoint)");
  verify->add_option("PATH", va->path, "Checkpoint (step-N directory or checkpoint directory)")->required();
  verify->add_option("--staging", va->staging, "Read buffer (default 64MiB; at least 1MiB, a multiple of 4096)");
  verify->add_flag("--json", va->json, "Print one JSON object (path, ok, bytes, seconds, error)");
  verify->add_flag("-q,--quiet", va->quiet, "Print nothing but errors");
  verify->callback([va, exit_code] { *exit_code = run_verify(*va); });

  auto ia = std::make_shared<CkptArgs>();
  CLI::App* inspect =
      ckpt->add_subcommand("inspect",
                           "Summarise a checkpoint: step, counters, loss scale, data position, model, files and sizes "
                           "(reads the manifest and the small files only)");
  inspect->add_option("PATH", ia->path, "Checkpoint (step-N directory or checkpoint directory)")->required();
  inspect->add_flag("--json", ia->json, "Print one JSON object (with the config highlights)");
  inspect->callback([ia, exit_code] { *exit_code = run_inspect(*ia); });
}

}  // namespace zo::tools
