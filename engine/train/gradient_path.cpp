// The gradients from LibTorch into the accumulators (gradient_path.h).
#include "engine/train/gradient_path.h"

#include <limits>
#include <optional>
#include <span>
#include <string>

#include "common/trace.h"
#include "gpu/foreign_streams.h"

namespace zo::engine {

Result<std::unique_ptr<GradientPath>> GradientPath::create(const RunSetup& setup, BlockRunner& runner) {
  std::unique_ptr<GradientPath> path(new GradientPath(setup, runner));
  const MemoryPlan& plan = setup.plan();
  gpu::Device& device = setup.device();
  ZO_ASSIGN_OR_RETURN(path->landed_, device.create_event());
  ReducerOptions reducer;
  if (plan.partition_grads) {
    // Note [Partitioned gradients] (grad_accumulator.h): on the gradient worker's thread, as
    // backward produces them; the training thread issues no collective until the worker is drained.
    reducer.chunk_elems = kDataParallelChunkElems;
    reducer.reduce = [&setup](uint32_t g, std::byte* data, uint64_t n) {
      // In the sum dtype: stored-16-bit gradients are rounded by their owner after the reduce.
      return setup.data_parallel()->reduce_in_buckets(data, n, setup.plan().placement.grad_sum_dtype,
                                                      setup.registry().partition_of_group(g),
                                                      "reducing the gradients of sub-group " + std::to_string(g));
    };
  }
  FinalGradSink sink;
  if (plan.placement.no_accumulator) {  // Note [No accumulator]: on the gradient worker's thread
    sink = [&setup](uint32_t g, std::byte* grad, double* sum_sq) {
      return setup.optimizer().step_direct(g, grad, sum_sq);
    };
  }
  // Backward's order: head, decoders n-2..1, embedding; their trainable params only.
  ZO_ASSIGN_OR_RETURN(path->grads_, GradAccumulator::create(setup.store(), contribution_order(setup.model().layout),
                                                            setup.executor(), std::move(reducer), std::move(sink)));
  // The landing ring comes from the pool: pinned, so that gradients leave the GPU by DMA.
  ZO_ASSIGN_OR_RETURN(std::span<std::byte> ring,
                      setup.store().pool().allocate(plan.grad_ring_bytes, "the gradient landing ring"));
  ZO_ASSIGN_OR_RETURN(path->worker_, GradWorker::create(*path->grads_, ring, {}, &device));
  return path;
}

GradientPath::GradientPath(const RunSetup& setup, BlockRunner& runner) : setup_(setup), runner_(runner) {}

GradientPath::~GradientPath() {
  gpu::Device& device = setup_.device();
  // Gradient copies of a failed step may still be landing in the pool's ring.
  if (landed_) (void)device.synchronize(landed_);
  worker_.reset();  // it may still wait on `landed_`
  if (landed_) device.destroy_event(landed_);
}

void GradientPath::abandon_micro_step() {
  (void)worker_->drain();  // the worker must be idle before the window closes; the step's error is reported
  grads_->abandon_micro_step();
}

Status GradientPath::offload(uint32_t block, const std::vector<torch::Tensor>& grads, bool inject_overflow) {
  // Each gradient is copied into the gradient worker's landing ring (pinned) and accumulated there
  // behind the next block's backward (Note [Gradient landing ring]). On CUDA the copies are D2H
  // on LibTorch's copy stream, ordered after the backward kernels queued so far by an event on the
  // compute stream, so they overlap the next block's kernels instead of queueing between them; the
  // worker waits for the copy's event, and the host for neither.
  const ModelLayout& layout = setup_.model().layout;
  gpu::Device& device = setup_.device();
  const BlockSpec& spec = layout.blocks[block];
  trace::Span span(trace::Track::kGradOffload, [&] { return "offload " + spec.name; });
  // The compute dtype, or grad_accum_dtype for the vertical schedule's device-side sums.
  const DType dtype = grad_transfer_dtype(setup_.config());
  const std::vector<uint32_t>& slots = setup_.model().trainable_slots[block];
  ZO_CHECK_EQ(grads.size(), slots.size()) << "one gradient per trainable param of " << spec.name;
  if (grads.empty()) return Status::ok();  // a frozen block (Note [Frozen sub-groups])
  std::optional<TorchCopyStreamScope> copies;
  ZO_RETURN_IF_ERROR(runner_.begin_copies(&copies, "sending the gradients of " + spec.name));
  for (size_t i = 0; i < grads.size(); ++i) {
    const uint32_t id = spec.params[slots[i]];
    const std::string& name = layout.params[id].name;
    const torch::Tensor& g = grads[i];
    if (!g.defined()) return internal_error("no gradient reached " + name);
    ZO_CHECK(g.scalar_type() == to_torch_dtype(dtype)) << "the gradient of " << name << " is not " << dtype_name(dtype);
    const uint64_t bytes = static_cast<uint64_t>(g.numel()) * g.element_size();
    ZO_RETURN_IF_ERROR(worker_->submit(
        id, dtype, bytes,
        // Into a ring slot, or into the runs of the sums' buffers where it lands in place (Note
        // [Gradients that land where they are summed] in engine/coord/grad_accumulator.cpp).
        [&](std::span<std::byte> dest, uint64_t from) {
          ZO_RETURN_IF_ERROR(
              gpu::foreign_work(device, gpu::DeviceWork::kD2H, dest.size(), copies->native_stream(), {}, [&] {
                return torch_call("copying the gradient of " + name, [&] {
                  torch::Tensor src = g;
                  if (inject_overflow && i == 0 && from == 0) {  // on the source: the copy may still be in flight
                    src = g.clone();
                    src.view(-1)[0] = std::numeric_limits<float>::infinity();
                  }
                  copies->record_use(src);  // its memory is not reused before the copy stream has read it
                  if (dest.size() == bytes) {
                    torch::Tensor landed = torch::from_blob(dest.data(), g.sizes(), g.options().device(torch::kCPU));
                    landed.copy_(src, /*non_blocking=*/true);
                  } else {  // one run of a param that straddles two sub-groups (a view: nothing to free early)
                    const int64_t eb = g.element_size(), n = static_cast<int64_t>(dest.size()) / eb;
                    torch::Tensor landed = torch::from_blob(dest.data(), {n}, g.options().device(torch::kCPU));
                    landed.copy_(src.view(-1).narrow(0, static_cast<int64_t>(from) / eb, n), /*non_blocking=*/true);
                  }
                });
              }));
          return gpu::record_foreign(device, landed_, copies->native_stream());
        },
        landed_));
    if (runner_.cuda()) setup_.accounting().add_moved(Move::kDeviceToHost, bytes);
  }
  return Status::ok();
}

}  // namespace zo::engine
