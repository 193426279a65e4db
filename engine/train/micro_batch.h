// A micro-batch on the device as the trainer's LibTorch parts pass it along: its token ids, the
// activations each block's backward recomputes from, its labels; and the forward of the
// micro-batches one backward takes. Private to engine/train; includes LibTorch. Not thread-safe.
#pragma once

// Not <torch/torch.h>: tensors, autograd and NoGradGuard are all the trainer uses, and the whole
// C++ frontend (nn, optim, data, serialize) costs each of its files some 10 s more to compile.
#include <torch/csrc/autograd/autograd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/data/dataset.h"
#include "engine/model/model_config.h"

namespace zo::engine {

// One micro-batch run forward up to the head.
struct MicroBatch {
  // Block b's input, kept from forward to backward (the activation checkpoint, on the device or in
  // an ActivationStore slot); block_inputs[0] the token ids.
  std::vector<torch::Tensor> block_inputs;
  torch::Tensor targets;
  uint64_t tokens = 0;    // labelled targets
  DataPosition position;  // where its batch was read from
};

// The forward of the micro-batches one backward takes: one with the horizontal schedule, all of a
// step's with the vertical one (Note [Vertical schedule] in step.cpp).
struct Forward {
  std::vector<MicroBatch> micro;
  double data_s = 0;
};

// Whether `id` is no token of the model's vocabulary; a label (a target) may also be kIgnoreLabel.
inline bool outside_vocab(const ModelConfig& model, int32_t id, bool label) {
  return !(label && id == kIgnoreLabel) && (id < 0 || static_cast<uint64_t>(id) >= model.vocab_size);
}

// `batch` (read from `path`) as mb's token ids and targets on `device`, room for `n_blocks` block
// inputs, its labelled targets in mb.tokens; kInvalidArgument naming the file and window for a
// token outside the vocabulary.
Status load_micro_batch(const Batch& batch, const std::string& path, const ModelConfig& model, uint32_t n_blocks,
                        torch::Device device, MicroBatch* mb);

}  // namespace zo::engine
