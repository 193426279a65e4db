// The torch baselines of `zoffload-bench adam`, defined in bench_adam_torch.cpp (built only with
// LibTorch; this header includes none). Not thread-safe: the calls set torch's global thread count.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"

namespace zo::tools::detail {

struct TorchHyper {
  float lr, beta1, beta2, eps, weight_decay;
};
// fp32 buffers of n elements owned by the caller. exp_avg is null for Adagrad, whose single state
// (state_sum) is exp_avg_sq. copy is null or n bf16 (copy_dtype 1) / fp16 (copy_dtype 2) elements.
struct TorchBuffers {
  float* params;
  float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  size_t n;
  void* copy;
  int copy_dtype;
};

// The fused kernel torch.optim uses for `optimizer` ("adamw", "adam", "adagrad"), by its ATen name;
// null when torch has none (Lion).
const char* torch_fused_kernel(const std::string& optimizer);

// One step as torch.optim's fused path takes it: state_step += 1 (a float tensor per parameter, as
// torch.optim keeps it), then the kernel with amsgrad and maximize off and no grad_scale/found_inf,
// then, when a copy is asked for, copy_ into the 16-bit tensor (what a PyTorch user does next).
// The moments must hold torch's initial state (zeros) before the first step.
Result<std::function<Status()>> make_torch_fused_step(const std::string& optimizer, const TorchHyper& h,
                                                      const TorchBuffers& b, int threads);

// torch::optim::AdamW / Adam / Adagrad, the per-tensor loop (about ten passes over memory per step),
// on the same params and grads with its own moments, followed by the same copy_. One untimed
// warm-up step (which allocates the moments), then the seconds of each of `repeats` steps.
Result<std::vector<double>> time_torch_loop(const std::string& optimizer, const TorchHyper& h, const TorchBuffers& b,
                                            int threads, int repeats);

}  // namespace zo::tools::detail
