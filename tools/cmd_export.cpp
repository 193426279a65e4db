// `zoffload export`: a checkpoint's master weights as a Hugging Face model directory (safetensors in
// bf16, fp16 or fp32), streamed through a bounded staging buffer.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "common/bytes.h"
#include "common/dtype.h"
#include "common/host_info.h"
#include "common/timer.h"
#include "engine/ckpt/checkpoint.h"
#include "engine/ckpt/export.h"
#include "engine/model/model_config.h"
#include "engine/plan/lora.h"
#include "io/env.h"
#include "io/io_engine.h"
#include "tools/commands.h"

namespace zo::tools {
namespace {

struct ExportArgs {
  std::string checkpoint;
  std::string dtype;
  std::string out;
  std::string shard_size = "5GB";
  std::string staging = "256MiB";
  std::string tokenizer_from;  // empty: the checkpoint's --model directory, when it still exists
  bool merge = false;          // a LoRA run's checkpoint: the merged model instead of PEFT's adapter directory
  bool json = false;
  bool quiet = false;
};

// A LoRA run's checkpoint (zoffload.lora in its config): what the export needs to write its
// adapters or merge them (Note [Exporting LoRA adapters]); nullopt for any other checkpoint.
Result<std::optional<engine::LoraExport>> lora_export_of(const engine::CheckpointInfo& ckpt, bool merge) {
  const std::string state = ckpt.path + "/trainer_state.json";
  ZO_ASSIGN_OR_RETURN(const engine::LoraConfig lc, engine::checkpoint_lora_config(ckpt.state.config, state));
  ZO_ASSIGN_OR_RETURN(const engine::ModelConfig model,
                      engine::parse_hf_config(ckpt.model_config_json, ckpt.path + "/config.json"));
  ZO_ASSIGN_OR_RETURN(const engine::LoraSpec spec, engine::lora_spec(model, lc));
  // The tensors decide, not the state's word for them: an edited r never exports a model holding
  // adapters, nor adapters of another shape.
  std::vector<std::pair<std::string, std::vector<int64_t>>> tensors;
  for (const auto* list : {&ckpt.manifest.tensors, &ckpt.manifest.frozen})
    for (const engine::CheckpointTensor& t : *list) tensors.emplace_back(t.name, t.shape);
  ZO_RETURN_IF_ERROR(engine::check_lora_tensors(model, spec, tensors, ckpt.path));
  if (lc.r == 0) {
    if (merge) return invalid_argument("--merge: " + ckpt.path + " is not a LoRA run's checkpoint (no zoffload.lora)");
    return std::optional<engine::LoraExport>();
  }
  engine::LoraExport out;
  out.merged = merge;
  out.scaling = spec.scaling();
  out.adapter_config_json = engine::peft_adapter_config_json(spec, ckpt.state.model);
  return std::optional<engine::LoraExport>(std::move(out));
}

// "export 312 MiB/1.20 GiB [=====>      ] 26%" on stderr: redrawn in place on a terminal, a line
// per 10% otherwise.
class Progress {
 public:
  explicit Progress(bool enabled) : enabled_(enabled), tty_(isatty(fileno(stderr)) != 0) {}

  void update(uint64_t done, uint64_t total) {
    if (!enabled_ || total == 0) return;
    const int percent = static_cast<int>(100.0 * static_cast<double>(done) / static_cast<double>(total));
    const auto now = std::chrono::steady_clock::now();
    if (tty_) {
      if (done < total && now - last_ < std::chrono::milliseconds(100)) return;
      last_ = now;
      std::fprintf(stderr, "\r\033[K%s", line(done, total, percent).c_str());
      if (done == total) std::fputc('\n', stderr);
    } else {
      if (percent / 10 == last_decile_ && done < total) return;
      last_decile_ = percent / 10;
      std::fprintf(stderr, "%s\n", line(done, total, percent).c_str());
    }
    std::fflush(stderr);
  }
  // Ends a redrawn line before an error is printed.
  void abandon() {
    if (enabled_ && tty_ && last_ != std::chrono::steady_clock::time_point{}) std::fputc('\n', stderr);
  }

 private:
  static std::string line(uint64_t done, uint64_t total, int percent) {
    constexpr int kWidth = 24;
    const int filled = kWidth * percent / 100;
    std::string bar(static_cast<size_t>(filled), '=');
    if (filled < kWidth) bar += '>' + std::string(static_cast<size_t>(kWidth - filled - 1), ' ');
    return "export " + format_bytes(done) + "/" + format_bytes(total) + " [" + bar + "] " + std::to_string(percent) +
           "%";
  }

  bool enabled_;
  bool tty_;
  std::chrono::steady_clock::time_point last_{};
  int last_decile_ = -1;
};

int run_export(const ExportArgs& a) {
  auto dtype = parse_dtype(a.dtype);
  if (!dtype.is_ok()) return command_error("zoffload export", "--dtype " + a.dtype + ": give bf16, fp16 or fp32", 2);
  auto shard_bytes = parse_size_bytes(a.shard_size);
  if (!shard_bytes.is_ok())
    return command_error("zoffload export", "--shard-size: " + shard_bytes.status().message(), 2);
  if (*shard_bytes == 0) return command_error("zoffload export", "--shard-size must be more than 0 bytes", 2);
  auto staging = parse_size_bytes(a.staging);
  if (!staging.is_ok()) return command_error("zoffload export", "--staging: " + staging.status().message(), 2);
  if (Status st = engine::check_staging_bytes(*staging, "--staging " + a.staging); !st.is_ok())
    return command_error("zoffload export", st.message(), 2);

  auto path = engine::resolve_checkpoint(a.checkpoint, io::Env::posix());
  if (!path.is_ok()) return command_error("zoffload export", path.status());
  auto ckpt = engine::open_checkpoint(*path, io::Env::posix());
  if (!ckpt.is_ok()) return command_error("zoffload export", ckpt.status());
  auto io = io::IoEngine::create(io::IoOptions{});
  if (!io.is_ok()) return command_error("zoffload export", io.status().to_string(), 1);

  auto lora = lora_export_of(*ckpt, a.merge);
  if (!lora.is_ok()) return command_error("zoffload export", lora.status());
  // A checkpoint's step directory is pruned whole, with whatever was written into it.
  for (std::filesystem::path p = std::filesystem::absolute(a.out).lexically_normal(); !p.empty();
       p = p.parent_path()) {
    Result<io::PathKind> manifest = io::Env::posix()->path_kind((p / "manifest.json").string());
    Result<io::PathKind> state = io::Env::posix()->path_kind((p / "trainer_state.json").string());
    if (manifest.is_ok() && *manifest == io::PathKind::kFile && state.is_ok() && *state == io::PathKind::kFile)
      return command_error("zoffload export",
                           "--out " + a.out + " is inside the checkpoint " + p.string() +
                               ", which pruning removes whole (with the export): export outside the checkpoint "
                               "directory's step-N directories",
                           2);
    if (p == p.parent_path()) break;
  }

  Progress progress(!a.quiet && !a.json);
  engine::ExportOptions options;
  options.lora = *lora;
  options.dtype = *dtype;
  options.out_dir = a.out;
  options.shard_bytes = *shard_bytes;
  options.staging_bytes = *staging;
  options.env = io::Env::posix();
  options.progress = [&progress](uint64_t done, uint64_t total) { progress.update(done, total); };
  // The tokenizer (and generation config) of the model the run trained, so the export is a
  // complete model directory: from --tokenizer-from, else from the run's --model when it was a
  // directory that is still there; "none" copies nothing.
  if (a.tokenizer_from != "none") {
    const bool given = !a.tokenizer_from.empty();
    const std::string from = given ? a.tokenizer_from : ckpt->state.model;
    Result<io::PathKind> kind = io::Env::posix()->path_kind(from);
    const bool is_dir = kind.is_ok() && *kind == io::PathKind::kDirectory;
    if (given && !is_dir) return command_error("zoffload export", "--tokenizer-from " + from + ": not a directory", 2);
    options.side_files = engine::model_side_files(from, io::Env::posix());
    if (!is_dir && !engine::model_preset(from).is_ok() && !a.quiet)
      std::cerr << "zoffload export: note: no tokenizer copied: the run's --model " << from
                << " is not a directory here (pass --tokenizer-from DIR)\n";
    else if (given && options.side_files.empty() && !a.quiet)
      std::cerr << "zoffload export: note: no tokenizer copied: " << from
                << " has none of the tokenizer files (tokenizer.json, tokenizer.model, ...)\n";
  }

  // The RAM the export itself adds (the staging buffer, by design): the peak over the export
  // minus the RSS just before it; -1 where the kernel does not let the peak be reset.
  const PhaseRss phase;
  const Stopwatch watch;
  auto result = engine::export_checkpoint(*ckpt, **io, options);
  const double seconds = watch.elapsed_s();
  const int64_t extra_rss = phase.peak_extra_bytes();
  if (!result.is_ok()) {
    progress.abandon();
    return command_error("zoffload export", result.status());
  }

  const std::string dtype_text(dtype_name(*dtype));
  if (a.json) {
    nlohmann::json j = {{"checkpoint", *path},
                        {"out_dir", result->out_dir},
                        {"files", result->files},
                        {"tensor_bytes", result->tensor_bytes},
                        {"seconds", seconds},
                        {"dtype", dtype_text},
                        {"format", !*lora            ? "model"
                                   : (*lora)->merged ? "merged"
                                                     : "peft_adapter"},
                        {"overflowed", result->overflowed},
                        {"step", ckpt->manifest.step},
                        {"staging_bytes", *staging},
                        {"peak_extra_rss_bytes", extra_rss}};
    std::cout << j.dump(2) << "\n";
  } else if (!a.quiet) {
    std::printf("exported %s (step %llu) as %s%s: %llu tensors, %s in %zu files to %s in %.1f s%s\n", path->c_str(),
                static_cast<unsigned long long>(ckpt->manifest.step), dtype_text.c_str(),
                !*lora            ? ""
                : (*lora)->merged ? ", LoRA adapters merged"
                                  : ", PEFT adapter",
                static_cast<unsigned long long>(result->tensors), format_bytes(result->tensor_bytes).c_str(),
                result->files.size(), result->out_dir.c_str(), seconds,
                extra_rss >= 0 ? (", peak extra RSS " + format_bytes(static_cast<uint64_t>(extra_rss))).c_str() : "");
  }
  if (result->overflowed != 0 && !a.quiet)
    std::cerr << "zoffload export: warning: " << result->overflowed
              << " weights are beyond the fp16 range and were written as +-inf; export bf16 or fp32 instead\n";
  return 0;
}

}  // namespace

void register_export_command(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<ExportArgs>();
  CLI::App* cmd = app.add_subcommand(
      "export",
      "Write a checkpoint's weights as a Hugging Face model directory: config.json and model.safetensors\n"
      "(or model-0000k-of-0000n.safetensors with model.safetensors.index.json), converted from the fp32\n"
      "master weights with round-to-nearest-even. Streams through --staging bytes of RAM whatever the\n"
      "model's size, checking the checkpoint's checksums as it reads. A LoRA run's checkpoint is written\n"
      "as PEFT's adapter directory (PeftModel.from_pretrained loads it over the base), or merged with\n"
      "--merge. See docs/export.md.");
  cmd->add_option("--checkpoint", args->checkpoint,
                  "A checkpoint step directory (DIR/step-N) or a checkpoint DIR (its `latest` is taken)")
      ->required();
  cmd->add_option("--dtype", args->dtype, "bf16 | fp16 | fp32")->required();
  cmd->add_option("--out", args->out, "The model directory to write (new or empty)")->required();
  cmd->add_option("--shard-size", args->shard_size,
                  "Most tensor bytes per safetensors file, e.g. 5GB (the default, as Hugging Face), 2GiB");
  cmd->add_option("--staging", args->staging, "RAM used to stream the weights (default 256MiB; at least 1MiB)");
  cmd->add_option("--tokenizer-from", args->tokenizer_from,
                  "Model directory whose tokenizer files and generation_config.json are copied into --out "
                  "(default: the run's --model, when it was a directory that still exists; none: copy nothing)");
  cmd->add_flag("--merge", args->merge,
                "A LoRA run's checkpoint (zoffload.lora): write the merged model (each adapted weight W + s*B*A) as a "
                "full Hugging Face directory instead of PEFT's adapter directory (adapter_config.json, "
                "adapter_model.safetensors)");
  cmd->add_flag("--json", args->json, "Print a JSON summary on stdout instead of progress");
  cmd->add_flag("-q,--quiet", args->quiet, "Print nothing but errors");
  cmd->callback([args, exit_code] { *exit_code = run_export(*args); });
}

}  // namespace zo::tools
