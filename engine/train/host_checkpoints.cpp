// Activation checkpoints in pinned host memory between forward and backward (trainer_impl.h).
#include "engine/train/trainer_impl.h"

namespace zo::engine {

// Note [Checkpoints on the CPU]
// The vertical schedule at a large GAS holds GAS times every layer's input: for llama3-8b at
// micro-batch 8, seq 1024, GAS 8 that is 16 GiB, more than a 24 GB card has beside the arena. With
// zoffload.activation_checkpoints "cpu" (or "auto" when the planner finds that this is what fits)
// each decoder layer's input goes to a pinned host slot once the layer's output exists (so the
// forward holds its input and output), and comes back one layer ahead of the layer's backward
// (so backward holds the layer's and the next one's). The copies run on LibTorch's copy stream,
// ordered after the compute stream by an event: the compute stream waits only for a layer's
// copies back, on the GPU. Each (micro-batch, layer) has its own slot, allocated once at start;
// a slot is rewritten only by the next step's forward, whose copy out queues on the same copy
// stream behind the copy back that read it. The embedding's token ids and the head's input stay
// on the device (the head runs right after the forward). The bytes are copied, not recomputed,
// so the weights are bit-identical to checkpoints on the device.
Status Trainer::Impl::create_host_checkpoints() {
  if (!run_plan.checkpoints_on_host) return Status::ok();
  ckpt_slot_bytes = host_checkpoint_bytes_per_micro_batch(opt.config, model, seq_len) / model.num_hidden_layers;
  ZO_ASSIGN_OR_RETURN(ckpt_host, device->allocate_pinned(run_plan.checkpoint_host_bytes));
  accounting.add_resident(Tier::kCpu, run_plan.checkpoint_host_bytes, /*pinned=*/true);
  ZO_ASSIGN_OR_RETURN(ckpt_copied, device->create_event());
  for (gpu::Event& e : ckpt_back) { ZO_ASSIGN_OR_RETURN(e, device->create_event()); }
  return Status::ok();
}

torch::Tensor Trainer::Impl::checkpoint_slot(uint32_t block, size_t k, const torch::Tensor& like) const {
  const uint64_t layers = model.num_hidden_layers;
  const uint64_t offset = (k * layers + (block - 1)) * ckpt_slot_bytes;
  ZO_CHECK(static_cast<uint64_t>(like.nbytes()) <= ckpt_slot_bytes &&
           offset + ckpt_slot_bytes <= run_plan.checkpoint_host_bytes)
      << "checkpoint of block " << block << ", micro-batch " << k << ": " << like.nbytes() << " bytes for a slot of "
      << ckpt_slot_bytes;
  return torch::from_blob(static_cast<std::byte*>(ckpt_host) + offset, like.sizes(),
                          like.options().device(torch::kCPU));
}

// The bytes of block's activation checkpoints, over the micro-batches (one copy each way).
uint64_t Trainer::Impl::checkpoint_bytes(uint32_t block, const Forward& f) const {
  uint64_t bytes = 0;
  for (const auto& m : f.micro) bytes += static_cast<uint64_t>(m.inputs[block].nbytes());
  return bytes;
}

Status Trainer::Impl::checkpoints_out(uint32_t block, Forward& f) {
  const std::string where = "moving the checkpoints of " + layout.blocks[block].name + " to the CPU";
  std::optional<TorchCopyStreamScope> copies;
  ZO_RETURN_IF_ERROR(begin_copies(&copies, where));
  ZO_RETURN_IF_ERROR(
      device->foreign_work(gpu::DeviceWork::kD2H, checkpoint_bytes(block, f), copies->native_stream(), {}, [&] {
        return torch_call(where, [&] {
          for (size_t k = 0; k < f.micro.size(); ++k) {
            torch::Tensor& x = f.micro[k].inputs[block];
            torch::Tensor slot = checkpoint_slot(block, k, x);
            slot.copy_(x, /*non_blocking=*/true);
            copies->record_use(x);  // freed now; not reused before the copy has read it
            x = slot;
          }
        });
      }));
  return device->record_foreign(ckpt_copied, copies->native_stream()).with_context(where);
}

Status Trainer::Impl::checkpoints_back(uint32_t block, Forward& f) {
  const std::string where = "moving the checkpoints of " + layout.blocks[block].name + " back to the device";
  std::vector<torch::Tensor> back(f.micro.size());
  ZO_RETURN_IF_ERROR(torch_call(where, [&] {
    // Allocated on the compute stream, which uses them; the copy stream waits for its earlier work.
    for (size_t k = 0; k < back.size(); ++k) back[k] = torch::empty_like(f.micro[k].inputs[block], torch_device);
  }));
  std::optional<TorchCopyStreamScope> copies;
  ZO_RETURN_IF_ERROR(begin_copies(&copies, where));
  ZO_RETURN_IF_ERROR(
      device->foreign_work(gpu::DeviceWork::kH2D, checkpoint_bytes(block, f), copies->native_stream(), {}, [&] {
        return torch_call(where, [&] {
          for (size_t k = 0; k < back.size(); ++k) {
            back[k].copy_(f.micro[k].inputs[block], /*non_blocking=*/true);
            copies->record_use(back[k]);
            f.micro[k].inputs[block] = back[k];
          }
        });
      }));
  ZO_RETURN_IF_ERROR(device->record_foreign(ckpt_back[block % 2], copies->native_stream()).with_context(where));
  return device->record_foreign(ckpt_copied, copies->native_stream()).with_context(where);
}

Status Trainer::Impl::wait_checkpoints(uint32_t block) {
  ZO_ASSIGN_OR_RETURN(void* compute, compute_stream());
  return device->wait_foreign(compute, ckpt_back[block % 2])
      .with_context("waiting for the checkpoints of " + layout.blocks[block].name);
}

}  // namespace zo::engine
