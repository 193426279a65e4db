// LibTorch and the device around each block (block_runner.h).
#include "engine/train/block_runner.h"

#include "common/timer.h"
#include "common/trace.h"
#include "gpu/foreign_streams.h"

namespace zo::engine {

Result<std::unique_ptr<BlockRunner>> BlockRunner::create(const RunSetup& setup) {
  const torch::Device torch_device = setup.cuda() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  std::unique_ptr<BlockRunner> runner(new BlockRunner(setup, torch_device));
  ZO_ASSIGN_OR_RETURN(runner->released_, setup.device().create_event());
  ZO_ASSIGN_OR_RETURN(runner->copies_after_, setup.device().create_event());
  return runner;
}

BlockRunner::BlockRunner(const RunSetup& setup, torch::Device torch_device)
    : device_(setup.device()), coord_(setup.coord()), model_(setup.model()), torch_device_(torch_device) {}

BlockRunner::~BlockRunner() {
  if (released_) device_.destroy_event(released_);
  if (copies_after_) device_.destroy_event(copies_after_);
}

Status BlockRunner::build_rope() {
  return torch_call("building the RoPE tables", [&] {
    rope_ = make_rope_tables(model_.config, static_cast<int64_t>(model_.seq_len), torch_device_);
  });
}

std::vector<torch::Tensor> BlockRunner::wrap(uint32_t block, const std::vector<gpu::DevicePtr>& ptrs, bool grad) const {
  const BlockSpec& spec = model_.layout.blocks[block];
  std::vector<torch::Tensor> out;
  out.reserve(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) {
    const ParamSpec& param = model_.layout.params[spec.params[i]];
    torch::Tensor t = param_tensor(ptrs[i].addr, param, model_.compute_dtype, torch_device_);
    if (grad && param.trainable) t.set_requires_grad(true);  // a frozen one gets no gradient
    out.push_back(std::move(t));
  }
  return out;
}

torch::Tensor BlockRunner::forward(uint32_t block, const std::vector<torch::Tensor>& params,
                                   const torch::Tensor& x) const {
  return block_forward(model_.config, model_.layout.blocks[block], params, x, rope_);
}

Result<void*> BlockRunner::compute_stream() {
  void* stream = nullptr;
  ZO_RETURN_IF_ERROR(torch_call("reading LibTorch's stream", [&] { stream = torch_compute_stream(cuda()); }));
  return stream;
}

// A block's forward or backward: a LibTorch call that is a span of the compute track when tracing,
// timed by the device as it runs it (its busy time, and the trace's device compute track).
Status BlockRunner::compute_call(const std::string& what, const std::function<void()>& fn) {
  trace::Span span(trace::Track::kCompute, [&] { return what; });
  ZO_ASSIGN_OR_RETURN(void* stream, compute_stream());
  return gpu::foreign_work(device_, gpu::DeviceWork::kCompute, 0, stream, what, [&] { return torch_call(what, fn); });
}

Status BlockRunner::begin_copies(std::optional<TorchCopyStreamScope>* copies, const std::string& where) {
  const bool on_cuda = cuda();
  void* compute = nullptr;
  ZO_RETURN_IF_ERROR(torch_call(where, [&] { compute = torch_compute_stream(on_cuda); }));
  ZO_RETURN_IF_ERROR(gpu::record_foreign(device_, copies_after_, compute).with_context(where));
  ZO_RETURN_IF_ERROR(torch_call(where, [&] { copies->emplace(on_cuda); }));
  return gpu::wait_foreign(device_, (*copies)->native_stream(), copies_after_).with_context(where);
}

Result<std::vector<gpu::DevicePtr>> BlockRunner::acquire(uint32_t block) {
  const std::string& name = model_.layout.blocks[block].name;
  trace::Span span(trace::Track::kFetch, [&] { return "fetch " + name; });
  // No host wait on CUDA: LibTorch's stream waits on the device for the block's ready event, so the
  // host queues the block's kernels while its copies are still landing.
  ZO_ASSIGN_OR_RETURN(ParamCoordinator::Acquired a, coord_.acquire_async(block));
  if (!a.ready) return std::move(a.ptrs);  // nothing in transfer
  ZO_ASSIGN_OR_RETURN(void* stream, compute_stream());
  const Stopwatch waited;
  Status st = gpu::wait_foreign(device_, stream, a.ready);
  ready_wait_s_ += waited.elapsed_s();
  ZO_RETURN_IF_ERROR(st.with_context("waiting for the parameters of " + name));
  return std::move(a.ptrs);
}

Status BlockRunner::release(uint32_t block) {
  // No host sync: the coordinator's copy stream waits for this event, recorded after the kernels
  // LibTorch has queued so far (all that read the block), before it refills the block's space.
  ZO_ASSIGN_OR_RETURN(void* stream, compute_stream());
  ZO_RETURN_IF_ERROR(
      gpu::record_foreign(device_, released_, stream).with_context("releasing " + model_.layout.blocks[block].name));
  return coord_.release(block, released_);
}

}  // namespace zo::engine
