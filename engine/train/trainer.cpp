// The trainer: the one place where the model (LibTorch), the tiers and the optimizer meet. This
// file holds Trainer::Impl, which owns the run's parts and builds them in order (Note [Trainer
// construction]), and the public calls, each handed to the part it belongs to (docs/training.md,
// "The trainer's code").
#include "engine/train/trainer.h"

#include <malloc.h>

#include <memory>
#include <utility>

#include "common/trace.h"
#include "engine/train/activation_store.h"
#include "engine/train/block_runner.h"
#include "engine/train/evaluator.h"
#include "engine/train/gradient_path.h"
#include "engine/train/metrics_sink.h"
#include "engine/train/run_dir.h"
#include "engine/train/run_outputs.h"
#include "engine/train/run_setup.h"
#include "engine/train/step.h"

namespace zo::engine {

// Note [Host compute]: on the emulated device the blocks run on LibTorch's CPU kernels, which
// allocate and free activation-sized buffers for every op. With glibc's defaults each buffer above
// the (dynamic) mmap threshold is a fresh mmap whose pages fault in and whose munmap returns them:
// that was ~40% of the tiny demo's step. Keeping freed memory in the heap (a high mmap and trim
// threshold) removes it. The setting is process-wide, so the program decides (tools/zoffload does).
void tune_allocator_for_host_compute() {
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

// The run's parts, declared so that each is destroyed before what it borrows: the step loop (which
// joins the optimizer thread) first, the setup's objects after every part that uses them, and the
// output directories' locks last.
struct Trainer::Impl {
  explicit Impl(const TrainOptions& options)
      : locks(options.out_dir, options.run_dir_lock),
        setup(options),
        metrics(setup.options(), setup.env(), setup.rank()),
        outputs(setup) {}

  OutputLocks locks;
  RunSetup setup;
  MetricsSink metrics;
  RunOutputs outputs;
  std::unique_ptr<BlockRunner> runner;
  std::unique_ptr<ActivationStore> activations;
  std::unique_ptr<GradientPath> gradients;
  std::unique_ptr<Evaluator> evaluator;  // null without TrainOptions::eval_data_path
  std::unique_ptr<StepLoop> loop;

  // init and its steps beyond the setup's, in the order it runs them.
  Status init();
  Status prepare_run_dir();    // run directory, metrics path, stale checkpoints removed
  Status create_step_parts();  // block runner, activation store, gradient path
  Status open_data();          // step loop (schedules and data), held-out data, RoPE tables
  Status resume();             // the checkpoint's counters into the loop
  // One step: the loop's, the evaluation after it when due, the record.
  Result<StepMetrics> step();
  TrainingState training_state() const;
};

// Note [Trainer construction]: init runs the steps below in order; each one needs only what the
// steps before it built. Nothing large is allocated before plan_memory has checked the run against
// this machine, and nothing of the step loop exists before the states do.
Status Trainer::Impl::init() {
  if (setup.group() != nullptr) {
    const Config& c = setup.config();
    const uint64_t world_size = setup.world_size();
    const uint64_t product = c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps * world_size;
    if (c.train_batch_size != product)
      return invalid_argument("train_batch_size " + std::to_string(c.train_batch_size) +
                              " is not train_micro_batch_size_per_gpu × "
                              "gradient_accumulation_steps × world size (" +
                              std::to_string(c.train_micro_batch_size_per_gpu) + " × " +
                              std::to_string(c.gradient_accumulation_steps) + " × " + std::to_string(world_size) + ")");
  }
  ZO_RETURN_IF_ERROR(setup.resolve_model());
  ZO_RETURN_IF_ERROR(prepare_run_dir());
  ZO_RETURN_IF_ERROR(outputs.find_resume());
  ZO_RETURN_IF_ERROR(setup.open_device());
  ZO_RETURN_IF_ERROR(setup.plan_memory());
  ZO_RETURN_IF_ERROR(setup.create_states(outputs.resume()));
  ZO_RETURN_IF_ERROR(setup.create_pipeline());
  ZO_RETURN_IF_ERROR(create_step_parts());
  ZO_RETURN_IF_ERROR(open_data());
  ZO_RETURN_IF_ERROR(resume());
  ZO_RETURN_IF_ERROR(metrics.open(/*resumed=*/!outputs.resumed_from().empty()));
  ZO_RETURN_IF_ERROR(outputs.write_run_id());
  setup.accounting().reset_peaks();
  return Status::ok();
}

Status Trainer::Impl::prepare_run_dir() {
  // Note [One run per run directory]: two runs on one --out would append to one metrics file, tidy
  // away each other's checkpoint saves in progress and mix their checkpoints. Rank 0 locks the
  // directory before anything in it is touched (the other ranks write nothing there before they
  // have connected to it); the lock file stays, so that no two processes can lock two files. The
  // same holds for every output directory a config can put outside --out, or share between two
  // --out: the checkpoint directory, wherever it is (two runs pruned each other's steps, removed
  // each other's saves in progress as stale and moved `latest` between them: another run's absolute
  // checkpoint.dir may point into this --out), and the monitors' directories outside --out. Each is
  // locked the same way, by a .zoffload.lock of its own, before this run touches it (run_dir.h).
  const bool rank0 = setup.rank() == 0;
  ZO_RETURN_IF_ERROR(locks.lock_run_dir(rank0, setup.env()));
  // Note [Output files] (io/env.h): the files this run writes are checked now, not after a step.
  ZO_RETURN_IF_ERROR(metrics.check_outputs(&locks));
  if (rank0) ZO_RETURN_IF_ERROR(outputs.read_run_id());
  ZO_RETURN_IF_ERROR(metrics.check_monitor_files());
  return outputs.open_checkpoint_dir(&locks);
}

Status Trainer::Impl::create_step_parts() {
  ZO_ASSIGN_OR_RETURN(runner, BlockRunner::create(setup));
  ZO_ASSIGN_OR_RETURN(activations, ActivationStore::create(setup, *runner));
  ZO_ASSIGN_OR_RETURN(gradients, GradientPath::create(setup, *runner));
  return Status::ok();
}

Status Trainer::Impl::open_data() {
  const CheckpointInfo* from = outputs.resume();
  const uint64_t seed = from != nullptr ? from->state.seed : setup.options().seed;
  ZO_ASSIGN_OR_RETURN(loop, StepLoop::create(setup, *runner, *activations, *gradients, seed));
  if (!setup.options().eval_data_path.empty()) {
    ZO_ASSIGN_OR_RETURN(evaluator, Evaluator::open(setup, *runner, loop->data_options()));
  }
  return runner->build_rope();
}

// The counters, loss scale and data position of the checkpoint; what differs from it is said.
Status Trainer::Impl::resume() {
  const CheckpointInfo* from = outputs.resume();
  if (from == nullptr) return Status::ok();
  ZO_RETURN_IF_ERROR(loop->restore(from->state, "resuming from " + from->path));
  outputs.finish_resume(loop->data_options());
  return Status::ok();
}

Result<StepMetrics> Trainer::Impl::step() {
  const bool evaluating = evaluator != nullptr && evaluator->due(loop->steps_done() + 1);
  ZO_ASSIGN_OR_RETURN(StepMetrics out, loop->step(evaluating));
  if (evaluating) {
    trace::Span span(trace::Track::kStep, "evaluate");
    Result<EvalMetrics> eval = evaluator->evaluate();
    if (eval.is_ok()) out.eval = *eval;
    else
      out.eval_error = Status(eval.status()).with_context("evaluating --eval-data " + setup.options().eval_data_path);
  }
  ZO_RETURN_IF_ERROR(metrics.record(out));
  return out;
}

TrainingState Trainer::Impl::training_state() const {
  TrainingState st;
  loop->fill_state(&st);
  outputs.fill_state(&st);
  return st;
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

Result<std::unique_ptr<Trainer>> Trainer::create(const TrainOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  if (Status st = impl->init(); !st.is_ok()) {
    // A run that never started leaves no output directory it created holding only its locks.
    std::vector<std::string> created = impl->locks.take_created_dirs();
    impl.reset();  // closes the locks (the caller may still hold a run directory's it passed in)
    for (const std::string& dir : created) (void)remove_if_only_locks(dir, io::Env::posix());
    return st;
  }
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

Result<StepMetrics> Trainer::step() {
  // Named before it runs: a failure after the update (recording it) is still this step's.
  const std::string name = "step " + std::to_string(impl_->loop->steps_done() + 1);
  trace::Span span(trace::Track::kStep, [&] { return name; });
  Result<StepMetrics> r = impl_->step();
  if (!r.is_ok()) return Status(r.status()).with_context(name);
  return r;
}

uint64_t Trainer::steps_done() const { return impl_->loop->steps_done(); }
std::string Trainer::plan_summary() const { return impl_->setup.run_plan().summary(); }
std::string Trainer::plan_json() const { return impl_->setup.run_plan().to_json(); }
const ModelConfig& Trainer::model_config() const { return impl_->setup.model().config; }
const ModelLayout& Trainer::layout() const { return impl_->setup.model().layout; }
uint64_t Trainer::num_parameters() const { return impl_->setup.registry().total_weights(); }
uint64_t Trainer::packed_weights() const { return impl_->setup.registry().packed_weights(); }
uint64_t Trainer::packed_bytes() const {
  return impl_->setup.registry().packed_elems() * dtype_size_bytes(impl_->setup.model().compute_dtype);
}
std::string Trainer::metrics_path() const { return impl_->metrics.path(); }
std::string Trainer::swap_dir() const { return impl_->setup.swap_dir(); }

Status Trainer::read_master(uint32_t param, std::span<float> out) {
  const ParamRegistry& reg = impl_->setup.registry();
  if (param >= reg.params().size()) return invalid_argument("read_master: no param " + std::to_string(param));
  const ParamInfo& info = reg.params()[param];
  if (out.size() != info.weights())
    return invalid_argument("read_master: " + info.name + " has " + std::to_string(info.weights()) + " elements, not " +
                            std::to_string(out.size()));
  return impl_->setup.store().read_param_value(param, 0, out);
}

const std::string& Trainer::checkpoint_dir() const { return impl_->outputs.checkpoint_dir(); }
const std::string& Trainer::resumed_from() const { return impl_->outputs.resumed_from(); }

bool Trainer::checkpoint_due(bool end_of_run) const {
  return impl_->outputs.checkpoint_due(impl_->loop->steps_done(), end_of_run);
}

TrainingState Trainer::training_state() const { return impl_->training_state(); }

Result<SaveResult> Trainer::save_checkpoint(const std::function<void(uint64_t, uint64_t)>& progress) {
  return impl_->outputs.save(impl_->training_state(), progress);
}

Result<ExportResult> Trainer::export_model(const ExportOptions& options) {
  return impl_->outputs.export_model(options);
}
bool Trainer::export_needs_every_rank() const { return impl_->outputs.export_needs_every_rank(); }
DType Trainer::export_dtype() const { return impl_->outputs.export_dtype(); }

std::string Trainer::describe() const { return impl_->setup.describe(); }

}  // namespace zo::engine
