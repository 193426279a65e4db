// Activation checkpoints in pinned host memory between forward and backward (activation_store.h).
#include "engine/train/activation_store.h"

#include <string>
#include <vector>

#include "gpu/foreign_streams.h"

namespace zo::engine {
namespace {

// The bytes of block's inputs over f's micro-batches (one copy each way).
uint64_t input_bytes(uint32_t block, const Forward& f) {
  uint64_t bytes = 0;
  for (const MicroBatch& mb : f.micro) bytes += static_cast<uint64_t>(mb.block_inputs[block].nbytes());
  return bytes;
}

}  // namespace

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
Result<std::unique_ptr<ActivationStore>> ActivationStore::create(const RunSetup& setup, BlockRunner& runner) {
  std::unique_ptr<ActivationStore> store(new ActivationStore(setup, runner));
  const RunPlan& plan = setup.run_plan();
  if (!plan.checkpoints_on_host) return store;
  const ModelConfig& model = setup.model().config;
  store->slot_bytes_ =
      host_checkpoint_bytes_per_micro_batch(setup.config(), model, setup.model().seq_len) / model.num_hidden_layers;
  ZO_ASSIGN_OR_RETURN(store->slab_, store->device_.allocate_pinned(plan.checkpoint_host_bytes));
  store->slab_bytes_ = plan.checkpoint_host_bytes;
  store->accounting_.add_resident(Tier::kCpu, store->slab_bytes_, /*pinned=*/true);
  ZO_ASSIGN_OR_RETURN(store->copied_, store->device_.create_event());
  for (gpu::Event& e : store->back_) { ZO_ASSIGN_OR_RETURN(e, store->device_.create_event()); }
  return store;
}

ActivationStore::ActivationStore(const RunSetup& setup, BlockRunner& runner)
    : device_(setup.device()),
      accounting_(setup.accounting()),
      runner_(runner),
      model_(setup.model()),
      n_blocks_(setup.model().n_blocks()) {}

ActivationStore::~ActivationStore() {
  if (slab_ != nullptr) {
    if (copied_) (void)device_.synchronize(copied_);  // copies of a failed step may be in flight
    device_.free_pinned(slab_);
    accounting_.remove_resident(Tier::kCpu, slab_bytes_, /*pinned=*/true);
  }
  if (copied_) device_.destroy_event(copied_);
  for (gpu::Event e : back_)
    if (e) device_.destroy_event(e);
}

torch::Tensor ActivationStore::slot(uint32_t block, size_t k, const torch::Tensor& like) const {
  const uint64_t layers = model_.config.num_hidden_layers;
  const uint64_t offset = (k * layers + (block - 1)) * slot_bytes_;
  ZO_CHECK(static_cast<uint64_t>(like.nbytes()) <= slot_bytes_ && offset + slot_bytes_ <= slab_bytes_)
      << "checkpoint of block " << block << ", micro-batch " << k << ": " << like.nbytes() << " bytes for a slot of "
      << slot_bytes_;
  return torch::from_blob(static_cast<std::byte*>(slab_) + offset, like.sizes(), like.options().device(torch::kCPU));
}

Status ActivationStore::move_out(uint32_t block, Forward& f) {
  const std::string where = "moving the checkpoints of " + model_.layout.blocks[block].name + " to the CPU";
  std::optional<TorchCopyStreamScope> copies;
  ZO_RETURN_IF_ERROR(runner_.begin_copies(&copies, where));
  ZO_RETURN_IF_ERROR(
      gpu::foreign_work(device_, gpu::DeviceWork::kD2H, input_bytes(block, f), copies->native_stream(), {}, [&] {
        return torch_call(where, [&] {
          for (size_t k = 0; k < f.micro.size(); ++k) {
            torch::Tensor& x = f.micro[k].block_inputs[block];
            torch::Tensor host = slot(block, k, x);
            host.copy_(x, /*non_blocking=*/true);
            copies->record_use(x);  // freed now; not reused before the copy has read it
            x = host;
          }
        });
      }));
  return gpu::record_foreign(device_, copied_, copies->native_stream()).with_context(where);
}

Status ActivationStore::move_back(uint32_t block, Forward& f) {
  const std::string where = "moving the checkpoints of " + model_.layout.blocks[block].name + " back to the device";
  std::vector<torch::Tensor> back(f.micro.size());
  ZO_RETURN_IF_ERROR(torch_call(where, [&] {
    // Allocated on the compute stream, which uses them; the copy stream waits for its earlier work.
    for (size_t k = 0; k < back.size(); ++k)
      back[k] = torch::empty_like(f.micro[k].block_inputs[block], runner_.torch_device());
  }));
  std::optional<TorchCopyStreamScope> copies;
  ZO_RETURN_IF_ERROR(runner_.begin_copies(&copies, where));
  ZO_RETURN_IF_ERROR(
      gpu::foreign_work(device_, gpu::DeviceWork::kH2D, input_bytes(block, f), copies->native_stream(), {}, [&] {
        return torch_call(where, [&] {
          for (size_t k = 0; k < back.size(); ++k) {
            back[k].copy_(f.micro[k].block_inputs[block], /*non_blocking=*/true);
            copies->record_use(back[k]);
            f.micro[k].block_inputs[block] = back[k];
          }
        });
      }));
  ZO_RETURN_IF_ERROR(gpu::record_foreign(device_, back_[block % 2], copies->native_stream()).with_context(where));
  return gpu::record_foreign(device_, copied_, copies->native_stream()).with_context(where);
}

Status ActivationStore::wait_back(uint32_t block) {
  ZO_ASSIGN_OR_RETURN(void* compute, runner_.compute_stream());
  return gpu::wait_foreign(device_, compute, back_[block % 2])
      .with_context("waiting for the checkpoints of " + model_.layout.blocks[block].name);
}

}  // namespace zo::engine
