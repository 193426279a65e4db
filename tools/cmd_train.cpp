// `zoffload train`: fine-tune a model from the command line with the offload config the user brings.
#include <CLI/CLI.hpp>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/bytes.h"
#include "common/dtype.h"
#include "common/host_info.h"
#include "common/log.h"
#include "common/string_util.h"
#include "common/timer.h"
#include "common/trace.h"
#include "engine/config/config.h"
#include "engine/data/token_source.h"
#include "engine/dist/world.h"
#include "engine/model/model_config.h"
#include "io/env.h"
#include "tools/auto_flags.h"
#include "tools/commands.h"
#include "zo_build_config.h"
#if ZO_HAVE_TORCH
#include "engine/train/trainer.h"
#endif

namespace zo::tools {
namespace {

struct TrainArgs {
  std::string config;
  std::string model;
  std::string data;
  std::string data_format = "auto";
  std::string out = "zoffload-run";
  std::string resume;
  uint64_t steps = 0;
  uint64_t seed = 0;
  uint64_t seq_len = 0;
  std::string eval_data;       // --eval-data
  uint64_t eval_every = 0;     // --eval-every
  uint64_t eval_batches = 16;  // --eval-batches
  AutoFlags flags;
  bool json = false;
  bool quiet = false;
  std::string trace;               // --trace FILE
  std::string trace_steps;         // --trace-steps A-B
  uint64_t dist_timeout_s = 1800;  // --dist-timeout
};

#if ZO_HAVE_TORCH

// The spans a trace keeps at most (about 100 bytes each): 1,000,000 is the tiny model's whole run
// many times over and several steps of an 8B model; the rest are counted as dropped.
constexpr uint64_t kMaxTraceSpans = 1'000'000;

// `text` whole as a count ≥ 1 (no sign, space or suffix).
bool parse_positive(std::string_view text, uint64_t* out) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size() && *out > 0;
}

// "--trace-steps A-B" (or "A"): the first and last step traced, 1-based, inclusive.
Result<std::pair<uint64_t, uint64_t>> parse_trace_steps(const std::string& text) {
  const size_t dash = text.find('-');
  uint64_t a = 0, b = 0;
  const bool ok = dash == std::string::npos ? parse_positive(text, &a) && parse_positive(text, &b)
                                            : parse_positive(std::string_view(text).substr(0, dash), &a) &&
                                                  parse_positive(std::string_view(text).substr(dash + 1), &b);
  if (!ok || b < a)
    return invalid_argument("--trace-steps: expected A-B or A (steps counted from 1, A ≤ B), got \"" +
                            quote_excerpt(text, 40) + "\"");
  return std::pair{a, b};
}

// Note [Interrupted runs]: SIGINT, SIGTERM and SIGHUP remove the NVMe swap files, as a normal exit
// does (issue 19), then end the process by the same signal, so the shell sees the usual status
// (130 for Ctrl-C). The handler is installed before the Trainer starts, and each swap file is
// added to what it removes as soon as this process holds the file's lock (TrainOptions::
// on_swap_file), before the file is sized and the weights are written into it: a Ctrl-C while a
// 70B model loads must not leave hundreds of GB behind, and a file another run holds is never
// this run's to remove. unlink(2), write(2) and raise(3) are async-signal-safe; each path is
// copied into a fixed buffer before the count that makes the handler read it is raised. A
// checkpoint or export the signal cut short is left as a tmp directory that the next run removes.
constexpr size_t kMaxSwapFiles = 2;
char g_swap_paths[kMaxSwapFiles][4096];
volatile sig_atomic_t g_swap_count = 0;

extern "C" void on_stop_signal(int sig) {
  // A signal handler may only call async-signal-safe functions, which the Env's are not.
  const sig_atomic_t n = g_swap_count;
  for (sig_atomic_t i = 0; i < n; ++i) ::unlink(g_swap_paths[i]);  // file-syscall-ok: signal handler
  static constexpr char kRemoved[] = "zoffload train: interrupted; the NVMe swap files are removed\n";
  static constexpr char kNone[] = "zoffload train: interrupted\n";
  const bool removed = n > 0;
  const size_t size = removed ? sizeof kRemoved - 1 : sizeof kNone - 1;
  if (::write(STDERR_FILENO, removed ? kRemoved : kNone, size) < 0) {  // file-syscall-ok: signal handler
    // Nothing to do: the process is ending.
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// TrainOptions::on_swap_file: from now on a stop signal removes `path`.
void remove_on_stop_signal(const std::string& path) {
  const sig_atomic_t n = g_swap_count;
  if (n == static_cast<sig_atomic_t>(kMaxSwapFiles) || path.size() >= sizeof g_swap_paths[0]) {
    std::cerr << "zoffload train: warning: " << path << " will not be removed if the run is interrupted\n";
    return;
  }
  std::memcpy(g_swap_paths[n], path.c_str(), path.size() + 1);
  std::atomic_signal_fence(std::memory_order_release);  // the path is whole before the handler can read it
  g_swap_count = n + 1;
}

void install_stop_signal_handler() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
}

// "rank 1: " in the lines of a data-parallel run's other ranks.
std::string g_rank_prefix;

int fail(const std::string& what, int code) {
  std::cerr << "zoffload train: " << g_rank_prefix << "error: " << what << "\n";
  return code;
}

// "where the time went" in one line.
std::string breakdown(const engine::StepMetrics& m) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "data %.2fs | fetch %.2fs | compute %.2fs | grad offload %.2fs | optimizer wait %.2fs | beside: "
                "gradient worker %.2fs, optimizer %.2fs (nvme read wait %.2fs, write wait %.2fs), nvme busy %.2fs, "
                "device compute %.2fs (busy %.2f), h2d %.2fs, d2h %.2fs",
                m.data_s, m.fetch_s, m.compute_s, m.grad_offload_s, m.optimizer_wait_s, m.grad_worker_s, m.optimizer_s,
                m.nvme_read_wait_s, m.nvme_write_wait_s, m.nvme_busy_s, m.device_compute_s, m.device_busy,
                m.device_h2d_s, m.device_d2h_s);
  return buf;
}

std::string progress_line(const engine::StepMetrics& m, uint64_t total, bool with_breakdown) {
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(kWidth * static_cast<double>(m.step) / static_cast<double>(total));
  std::string bar(static_cast<size_t>(filled), '=');
  if (filled < kWidth) bar += '>' + std::string(static_cast<size_t>(kWidth - filled - 1), ' ');
  char buf[256];
  std::snprintf(buf, sizeof buf, "step %llu/%llu [%s] loss %.4f | %.0f tok/s | lr %.2e | overlap %.2f%s",
                static_cast<unsigned long long>(m.step), static_cast<unsigned long long>(total), bar.c_str(), m.loss,
                m.step_s > 0 ? static_cast<double>(m.tokens) / m.step_s : 0.0, m.lr, m.overlap,
                m.skipped ? " | overflow: step skipped" : "");
  std::string line = buf;
  if (m.eval) {
    std::snprintf(buf, sizeof buf, " | eval loss %.4f ppl %.4g (%.2f s)", m.eval->loss, m.eval->perplexity,
                  m.eval->eval_s);
    line += buf;
  }
  if (with_breakdown) line += " | " + breakdown(m);
  return line;
}

int run_train(const TrainArgs& args) {
  TrainArgs a = args;
  // -q: errors and warnings only; the engine's info lines (the device chosen, ...) go too.
  if (a.quiet && log_level() < LogLevel::kWarn) set_log_level(LogLevel::kWarn);
  // Note [Launchers] (engine/dist/world.h): torchrun, mpirun and srun start one process per rank.
  auto world = engine::dist::world_from_env();
  if (!world.is_ok()) return fail(world.status().message(), 2);
  // Rank 0 speaks for the run (progress, summary, --json, the trace, the export); the other ranks
  // print only their warnings and errors.
  if (world->rank != 0) {
    g_rank_prefix = "rank " + std::to_string(world->rank) + ": ";
    a.quiet = true;
    a.json = false;
    a.trace.clear();
    a.trace_steps.clear();
    set_log_level(LogLevel::kWarn);
  }
  std::pair<uint64_t, uint64_t> traced{1, std::numeric_limits<uint64_t>::max()};
  if (!a.trace_steps.empty()) {
    if (a.trace.empty()) return fail("--trace-steps needs --trace FILE", 2);
    auto r = parse_trace_steps(a.trace_steps);
    if (!r.is_ok()) return fail(r.status().message(), 2);
    traced = *r;
  }
  auto model = engine::resolve_model_config(a.model, io::Env::posix());
  if (!model.is_ok()) return fail(model.status().message(), 2);

  std::optional<engine::Config> config =
      load_config_with_flags(a.config, model->hidden_size, a.steps, a.flags, world->world_size);
  if (!config) return 2;
  auto format = engine::parse_data_format(a.data_format);
  if (!format.is_ok()) return fail("--data-format: " + format.status().message(), 2);

  uint64_t steps = a.steps ? a.steps : config->scheduler.total_num_steps;
  if (steps == 0) return fail("give --steps N (the config's scheduler has no total_num_steps to take it from)", 2);
  // Note [Output files] (io/env.h): a trace that cannot be written is found now, not after training.
  if (!a.trace.empty()) {
    if (Status st = io::Env::posix()->check_output_file(a.trace, "--trace"); !st.is_ok()) return fail(st.message(), 2);
  }

  engine::TrainOptions options;
  options.config = *config;
  options.model = a.model;
  options.data_path = a.data;
  options.data_format = *format;
  options.seq_len = a.seq_len;
  options.seed = a.seed;
  options.out_dir = a.out;
  options.resume = a.resume;
  options.last_step = steps;
  options.eval_data_path = a.eval_data;
  options.eval_every = a.eval_every;
  options.eval_batches = a.eval_batches;
  // Note [One run per run directory] (engine/train/trainer.cpp): rank 0 locks --out before the ranks
  // connect, so the other ranks of a run refused here never get past the rendezvous.
  std::string created_out;  // the topmost directory locking --out created (empty: it existed)
  if (world->rank == 0) {
    auto lock = engine::lock_run_dir(a.out, io::Env::posix(), &created_out);
    if (!lock.is_ok()) return fail(lock.status().message(), 1);
    options.run_dir_lock = std::move(*lock);
  }
  // A run that fails before it starts leaves no --out it created holding only its lock file.
  auto fail_at_start = [&](const std::string& what, int code) {
    options.run_dir_lock.reset();
    if (!created_out.empty()) (void)engine::remove_if_only_locks(created_out, io::Env::posix());
    return fail(what, code);
  };
  std::unique_ptr<engine::dist::ProcessGroup> group;
  if (world->distributed()) {
    // Note [One GPU per rank] (engine/dist/world.h), before anything initialises CUDA.
    if (config->zoffload.device != gpu::DeviceKind::kHost) {
      auto device = engine::dist::visible_device_for_rank(*world, engine::dist::process_env()("CUDA_VISIBLE_DEVICES"));
      if (!device.is_ok()) return fail_at_start(device.status().message(), 2);
      if (device->has_value()) ::setenv("CUDA_VISIBLE_DEVICES", (*device)->c_str(), 1);
    }
    // A peer that dies while this rank writes to its socket must fail the collective (EPIPE, which
    // names the rank), not kill this process by SIGPIPE, as it did here one run in a few. Python,
    // where torch.distributed usually runs, ignores SIGPIPE from its start.
    ::signal(SIGPIPE, SIG_IGN);
    auto g = engine::dist::ProcessGroup::create(*world, std::chrono::seconds(a.dist_timeout_s));
    if (!g.is_ok()) return fail_at_start(g.status().message(), 1);
    group = std::move(*g);
    options.group = group.get();
  }

  const Stopwatch setup_watch;
  engine::tune_allocator_for_host_compute();
  options.on_swap_file = remove_on_stop_signal;
  install_stop_signal_handler();
  auto trainer_r = engine::Trainer::create(options);
  if (!trainer_r.is_ok()) {
    g_swap_count = 0;  // a failed start has removed what it created
    const Status& s = trainer_r.status();
    return fail_at_start(s.to_string(), s.code() == StatusCode::kInvalidArgument ? 2 : 1);
  }
  engine::Trainer& trainer = **trainer_r;
  const double setup_s = setup_watch.elapsed_s();
  const uint64_t first_step = trainer.steps_done();
  // End-of-training exports a killed run left half-written (hf-export-step-N.tmp-<pid>).
  if (auto names = io::Env::posix()->list_dir(a.out); names.is_ok() && world->rank == 0) {
    for (const std::string& name : *names) {
      if (name.rfind("hf-export-step-", 0) != 0 || name.find(".tmp-") == std::string::npos) continue;
      const std::string path = a.out + "/" + name;
      if (Status s = io::Env::posix()->remove_all(path); !s.is_ok()) {
        std::cerr << "zoffload train: warning: " << s.message() << "\n";
      } else if (!a.quiet) {
        std::cerr << "zoffload train: removed " << path << ", left by an export that did not finish\n";
      }
    }
  }
  if (!a.json && !a.quiet) {
    std::printf("zoffload train: %s\n", trainer.describe().c_str());
    std::printf("%s\n", trainer.plan_summary().c_str());
    if (!trainer.resumed_from().empty())
      std::printf("resumed from %s at step %llu\n", trainer.resumed_from().c_str(),
                  static_cast<unsigned long long>(first_step));
    std::printf("setup %.1f s; training to step %llu, metrics -> %s%s\n", setup_s,
                static_cast<unsigned long long>(steps), trainer.metrics_path().c_str(),
                trainer.checkpoint_dir().empty() ? "" : (", checkpoints -> " + trainer.checkpoint_dir()).c_str());
    std::fflush(stdout);
  }
  if (first_step >= steps && !a.quiet && !a.json) {
    std::printf("nothing to train: the run is already at step %llu of %llu\n",
                static_cast<unsigned long long>(first_step), static_cast<unsigned long long>(steps));
  }

  const bool tty = isatty(fileno(stderr)) != 0;
  const bool show_breakdown = config->wall_clock_breakdown;
  const uint64_t print_every = std::max<uint64_t>(1, config->steps_per_print);
  double first_loss = NAN, last_loss = NAN, train_s = 0;
  uint64_t tokens = 0, skipped = 0;
  nlohmann::json saved = nlohmann::json::array();
  nlohmann::json evals = nlohmann::json::array();  // --eval-data: each evaluation's figures
  std::optional<engine::EvalMetrics> last_eval;
  // Saves when due; a failed save leaves the previous checkpoint and the training state as they were.
  auto save = [&](bool end_of_run) -> Status {
    if (!trainer.checkpoint_due(end_of_run)) return Status::ok();
    const std::string name = "step-" + std::to_string(trainer.steps_done());
    const bool show = tty && !a.quiet && !a.json;
    // The save's extra memory: its peak RSS above the RSS it started with (bounded by the staging
    // buffer, see docs/checkpoint_format.md); -1 where the kernel cannot reset the peak.
    const PhaseRss phase;
    auto r = trainer.save_checkpoint([&](uint64_t done, uint64_t total) {
      if (show)
        std::fprintf(stderr, "\r\033[Ksaving %s: %s of %s", name.c_str(), format_bytes(done).c_str(),
                     format_bytes(total).c_str());
    });
    if (show) std::fputs("\r\033[K", stderr);
    if (!r.is_ok()) return r.status();
    const int64_t extra = phase.peak_extra_bytes();
    saved.push_back({{"path", r->path},
                     {"bytes", r->bytes},
                     {"seconds", r->seconds},
                     {"gb_per_s", r->seconds > 0 ? r->bytes / r->seconds / 1e9 : 0.0},
                     {"peak_extra_rss_bytes", extra}});
    if (!a.quiet && !a.json) {
      std::fprintf(stderr, "checkpoint %s: %s in %.2f s (%.2f GB/s, peak RSS +%s)%s\n", r->path.c_str(),
                   format_bytes(r->bytes).c_str(), r->seconds, r->seconds > 0 ? r->bytes / r->seconds / 1e9 : 0.0,
                   extra >= 0 ? format_bytes(static_cast<uint64_t>(extra)).c_str() : "?",
                   r->pruned.empty() ? "" : (", pruned " + join(r->pruned, ", ")).c_str());
    }
    return Status::ok();
  };
  // Note [Tracing steps]: the trace records while a traced step runs (its call includes the next
  // step's first forward, beside its optimizer) and its checkpoint is saved; it is written at the
  // end of the run, or when a step fails.
  if (!a.trace.empty()) {
    trace::start(kMaxTraceSpans);
    trace::pause();
  }
  auto write_trace = [&]() -> Status {
    if (a.trace.empty()) return Status::ok();
    trace::pause();
    ZO_RETURN_IF_ERROR(io::Env::posix()->publish_file(a.trace, trace::to_chrome_json(), "--trace"));
    if (!a.quiet && !a.json)
      std::fprintf(stderr, "trace: %llu spans%s -> %s (open it in https://ui.perfetto.dev or chrome://tracing)\n",
                   static_cast<unsigned long long>(trace::spans_kept()),
                   trace::spans_dropped()
                       ? (", " + std::to_string(trace::spans_dropped()) + " dropped (over the limit)").c_str()
                       : "",
                   a.trace.c_str());
    return Status::ok();
  };
  for (uint64_t i = first_step; i < steps; ++i) {
    if (!a.trace.empty() && i + 1 >= traced.first && i + 1 <= traced.second) trace::resume();
    auto m = trainer.step();
    if (!m.is_ok()) {
      if (tty && !a.quiet && !a.json) std::fputc('\n', stderr);
      if (Status st = write_trace(); !st.is_ok())
        std::cerr << "zoffload train: warning: writing the trace: " << st.to_string() << "\n";
      return fail(m.status().to_string(), 1);  // "step N: ..."
    }
    if (i == first_step) first_loss = m->loss;
    last_loss = m->loss;
    train_s += m->step_s;
    tokens += m->tokens;
    skipped += m->skipped;
    if (m->eval) {
      last_eval = m->eval;
      nlohmann::json e = m->record()["eval"];
      e["step"] = m->step;
      evals.push_back(std::move(e));
    }
    const bool last = i + 1 == steps;
    if (!m->eval_error.is_ok()) {
      // Note [Evaluation] (engine/train/evaluator.cpp): the step is complete and recorded; it is saved
      // (when there is a checkpoint directory) before the run stops on its evaluation's failure.
      if (tty && !a.quiet && !a.json) std::fputc('\n', stderr);
      const std::string step = "step " + std::to_string(m->step);
      std::string kept = "; " + step + " is trained and recorded in " + trainer.metrics_path();
      if (!trainer.checkpoint_dir().empty()) {
        const Status st = save(true);
        kept += st.is_ok() ? " and saved in " + trainer.checkpoint_dir() + " (continue with --resume latest)"
                           : ", but its checkpoint failed: " + st.to_string();
      }
      if (Status st = write_trace(); !st.is_ok())
        std::cerr << "zoffload train: warning: writing the trace: " << st.to_string() << "\n";
      return fail(step + ": " + m->eval_error.to_string() + kept, 1);
    }
    if (!a.json && !a.quiet) {
      const bool due = trainer.checkpoint_due(last);
      if (tty) {
        std::fprintf(stderr, "\r\033[K%s", progress_line(*m, steps, show_breakdown).c_str());
        if (last || due || m->eval) std::fputc('\n', stderr);  // an evaluation's line stays
      } else if (i == first_step || last || due || m->eval || m->step % print_every == 0) {
        std::fprintf(stderr, "%s\n", progress_line(*m, steps, show_breakdown).c_str());
      }
    }
    if (last) break;
    Status st = save(false);
    // A save that failed because a rank is gone ends the run here: training on would only wait for
    // that rank again, through another --dist-timeout, at the next collective.
    if (!st.is_ok() && group != nullptr && group->broken())
      return fail("the checkpoint after step " + std::to_string(m->step) +
                      " did not complete on every rank, and the "
                      "ranks are no longer connected (`zoffload ckpt verify` tells which checkpoints are whole): " +
                      st.to_string(),
                  1);
    if (!st.is_ok()) {
      std::cerr << "zoffload train: warning: the checkpoint after step " << m->step << " failed: " << st.to_string()
                << "; the previous checkpoints are intact and training goes on\n";
    }
    if (!a.trace.empty()) trace::pause();
  }
  // The end of the run always has a checkpoint when a directory is configured.
  Status final_save = save(true);
  if (!final_save.is_ok()) return fail("the final checkpoint failed: " + final_save.to_string(), 1);
  if (Status st = write_trace(); !st.is_ok()) return fail("writing the trace: " + st.to_string(), 1);

  // stage3_gather_16bit_weights_on_model_save: a Hugging Face directory of the final weights,
  // streamed from their tiers (never gathered in RAM or on the GPU).
  std::string exported;
  // At ZeRO stage 3 across ranks every rank takes part (each sends its partition); rank 0 writes.
  if (config->zero.stage3_gather_16bit_weights_on_model_save &&
      (world->rank == 0 || trainer.export_needs_every_rank())) {
    engine::ExportOptions eo;
    eo.dtype = trainer.export_dtype();
    // Published whole (Note [Publishing a directory]); an earlier run's export of the same step
    // (the same --out run again) is replaced atomically.
    const std::string final_dir = a.out + "/hf-export-step-" + std::to_string(trainer.steps_done());
    eo.out_dir = final_dir;
    eo.replace = true;
    eo.staging_bytes = config->zoffload.checkpoint.staging_buffer_size;
    eo.side_files = engine::model_side_files(a.model, io::Env::posix());  // the tokenizer: a complete model directory
    auto r = trainer.export_model(eo);
    if (!r.is_ok()) return fail("exporting the model: " + r.status().to_string(), 1);
    if (world->rank == 0) exported = final_dir;
    if (world->rank == 0 && !a.quiet && !a.json) {
      std::fprintf(stderr, "exported %s (%s, %s)\n", exported.c_str(), std::string(dtype_name(eo.dtype)).c_str(),
                   format_bytes(r->tensor_bytes).c_str());
    }
  }

  const std::string swap = trainer.swap_dir();
  if (a.json) {
    nlohmann::json j = {{"steps", steps},
                        {"skipped_steps", skipped},
                        {"first_loss", first_loss},
                        {"last_loss", last_loss},
                        {"tokens", tokens},
                        {"train_s", train_s},
                        {"setup_s", setup_s},
                        {"tokens_per_s", train_s > 0 ? tokens / train_s : 0.0},
                        {"metrics_path", trainer.metrics_path()},
                        {"parameters", trainer.num_parameters()},
                        {"packed_base_weights", trainer.packed_weights()},
                        {"packed_base_bytes", trainer.packed_bytes()},
                        {"first_step", first_step},
                        {"resumed_from", trainer.resumed_from()},
                        {"checkpoints", saved},
                        {"evals", evals},
                        {"export", exported},
                        {"trace", a.trace},
                        {"plan", nlohmann::json::parse(trainer.plan_json())}};
    std::cout << j.dump(2) << "\n";
  } else if (!a.quiet) {
    std::printf("done: %llu steps in %.1f s (%.0f tok/s), loss %.4f -> %.4f%s\n",
                static_cast<unsigned long long>(steps - std::min(steps, first_step)), train_s,
                train_s > 0 ? tokens / train_s : 0.0, first_loss, last_loss,
                skipped ? (", " + std::to_string(skipped) + " steps skipped on overflow").c_str() : "");
    if (last_eval)
      std::printf("eval: loss %.4f, perplexity %.4g over %llu batches (%llu tokens) of %s\n", last_eval->loss,
                  last_eval->perplexity, static_cast<unsigned long long>(last_eval->batches),
                  static_cast<unsigned long long>(last_eval->tokens), a.eval_data.c_str());
    std::printf("outputs: metrics %s%s\n", trainer.metrics_path().c_str(),
                swap.empty() ? "" : ("; NVMe swap files under " + swap + " are removed on exit").c_str());
  }
  return 0;
}

#else

int run_train(const TrainArgs&) {
  std::cerr << "zoffload train: error: this zoffload was built without LibTorch (run tools/setup.sh, which "
               "builds against PyTorch; `zoffload info` shows the build's features)\n";
  return 1;
}

#endif

}  // namespace

void register_train_command(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* train = app.add_subcommand(
      "train",
      "Train (fine-tune) a model of a LLaMA-shaped family (" + engine::model_type_list() +
          ";\n"
          "multimodal gemma3's text model too) with the offload your config asks for: parameters fetched\n"
          "block by block (ZeRO stage 3) from pinned CPU memory or NVMe, optimizer states on the device, CPU\n"
          "or NVMe, Adam on the CPU. Shows step, loss, tokens/s (and, with wall_clock_breakdown, where the\n"
          "time went); writes one JSON object per step to metrics.jsonl in --out. With zoffload.checkpoint.dir\n"
          "it saves checkpoints every every_steps steps and at the end (--resume continues bit-exactly); with\n"
          "stage3_gather_16bit_weights_on_model_save it exports the final weights to --out/hf-export-step-N.\n"
          "Relative paths in the config (nvme_path, checkpoint.dir, log.metrics_path) are relative to --out\n"
          "(lora.init_from, an input, to the working directory). One run at a time uses an --out and a\n"
          "checkpoint.dir (lock files); --resume latest refuses a checkpoint another run wrote.\n"
          "Configs with \"auto\" (Accelerate's) take their values from --micro-batch, --lr, ... as the HF\n"
          "Trainer's arguments fill them; `zoffload config check` takes the same flags.\n"
          "Launched as N processes (torchrun --no-python --nproc-per-node N zoffload train ..., mpirun, srun)\n"
          "it trains data parallel: each rank reads its slice of every batch; at ZeRO stage 0 the gradients are\n"
          "all-reduced, at stages 1-3 each rank holds and steps its partition of the optimizer states (from\n"
          "stage 2 of the gradient accumulators too, at stage 3 of the parameters, each block gathered from\n"
          "its owners when it is fetched)\n"
          "(docs/training.md, \"Several processes\").");
  train->add_option("--config", args->config, "DeepSpeed/zoffload JSON config (see docs/config.md)")->required();
  train
      ->add_option("--model", args->model,
                   "A Hugging Face model directory (config.json + *.safetensors) or a preset with random init: " +
                       join(engine::model_preset_names(), ", "))
      ->required();
  train
      ->add_option("--data", args->data,
                   "Training data: .bin tokens (llm.c/nanoGPT), .jsonl with input_ids [and labels], or any other "
                   "file as text with the byte-level tokenizer (vocabulary 256, for the tiny model)")
      ->required();
  train->add_option("--data-format", args->data_format,
                    "auto | llmc | raw | jsonl | text (default: by extension; applies to --eval-data too)");
  CLI::Option* eval_data =
      train->add_option("--eval-data", args->eval_data,
                        "Held-out data in --data's formats: after every --eval-every steps and after the last step, "
                        "its first --eval-batches micro-batches (file order) run forward without gradients through "
                        "the same offload; loss and perplexity go to the progress line, metrics.jsonl (\"eval\") "
                        "and the monitors (eval/loss)");
  train->add_option("--eval-every", args->eval_every, "Evaluate --eval-data every N steps (default 0: at the end only)")
      ->check(whole_number(0))
      ->needs(eval_data);
  train
      ->add_option("--eval-batches", args->eval_batches,
                   "Micro-batches per evaluation, all ranks together (default 16; fewer when the file is shorter)")
      ->check(whole_number(1))
      ->needs(eval_data);
  train
      ->add_option(
          "--steps", args->steps,
          "Train until this optimizer step, counted from the start of the run (default: scheduler total_num_steps)")
      ->check(whole_number(1));
  train->add_option("--out", args->out, "Run directory: metrics.jsonl, relative swap paths (default: zoffload-run)");
  train
      ->add_option("--seed", args->seed,
                   "Seed of the random init and the data order (default 0; a resumed run keeps its checkpoint's)")
      ->check(whole_number(0));
  train->add_option("--resume", args->resume,
                    "Continue from a checkpoint: latest (the newest in zoffload.checkpoint.dir), a checkpoint "
                    "directory, or a step-N directory. Weights, optimizer states, loss scale, counters and the data "
                    "position come from it; --steps counts from the start of the run");
  train->add_option("--seq-len", args->seq_len, "Tokens per sequence (default: min(256, max_position_embeddings))")
      ->check(whole_number(1));
  add_auto_flags(train, &args->flags);
  train->add_flag("--json", args->json, "Print a JSON summary on stdout instead of progress");
  train->add_flag("-q,--quiet", args->quiet, "Print nothing but errors and warnings");
  train->add_option(
      "--trace", args->trace,
      "Write a timeline of the steps (Chrome trace JSON: open it in https://ui.perfetto.dev): one track "
      "per stream of work (compute, fetch wait, gradient offload, gradient worker, optimizer, NVMe reads "
      "and writes, the device's own compute and H2D and D2H copies, checkpoint, collectives), spans named by "
      "block and sub-group. See docs/training.md");
  train->add_option("--trace-steps", args->trace_steps, "The steps to trace, A-B or A (default: all)");
  train
      ->add_option("--dist-timeout", args->dist_timeout_s,
                   "Data parallel (torchrun, mpirun, srun): seconds a rank waits for the others at the rendezvous and "
                   "in each collective before it stops with an error naming the ranks that did not respond "
                   "(default 1800, at most a week). See docs/training.md, \"Several processes\"")
      ->check(whole_number(1, 7 * 24 * 3600));
  train->callback([args, exit_code] { *exit_code = run_train(*args); });
}

}  // namespace zo::tools
