// A batch checked against the vocabulary and moved to the device (micro_batch.h).
#include "engine/train/micro_batch.h"

#include "engine/model/decoder.h"

namespace zo::engine {

Status load_micro_batch(const Batch& batch, const std::string& path, const ModelConfig& model, uint32_t n_blocks,
                        torch::Device device, MicroBatch* mb) {
  mb->position = batch.position;
  for (size_t i = 0; i < batch.inputs.size(); ++i) {
    const bool bad_input = outside_vocab(model, batch.inputs[i], false);
    if (bad_input || outside_vocab(model, batch.targets[i], true))
      return invalid_argument(path + ": " + (bad_input ? "token " : "label ") +
                              std::to_string(bad_input ? batch.inputs[i] : batch.targets[i]) + " (window " +
                              std::to_string(batch.windows[i / batch.seq_len]) +
                              ") is outside the model's vocabulary of " + std::to_string(model.vocab_size));
  }
  mb->tokens = 0;
  for (int32_t t : batch.targets) mb->tokens += t != kIgnoreLabel;
  mb->block_inputs.assign(n_blocks, torch::Tensor());
  return torch_call("preparing the batch", [&] {
    const int64_t b = static_cast<int64_t>(batch.batch), t = static_cast<int64_t>(batch.seq_len);
    // from_blob does not copy: the copies to the device's int64 are made before `batch` is reused.
    mb->block_inputs[0] =
        torch::from_blob(const_cast<int32_t*>(batch.inputs.data()), {b, t}, torch::kInt32).to(device, torch::kInt64);
    mb->targets =
        torch::from_blob(const_cast<int32_t*>(batch.targets.data()), {b, t}, torch::kInt32).to(device, torch::kInt64);
  });
}

}  // namespace zo::engine
