// The torch baselines of `zoffload-bench adam`; the only file of zoffload-bench that includes LibTorch,
// built only when LibTorch is found. The baseline is torch's fused CPU kernel (at::_fused_adamw_,
// at::_fused_adam_, at::_fused_adagrad_: what torch.optim.AdamW(fused=True) and friends call) stepping
// the caller's buffers in place (from_blob, no copies); torch::optim's per-tensor loop is the
// optional second line. Not thread-safe: both set torch's global thread count.
#include "tools/bench_adam_torch.h"

// LibTorch's headers are not clean under -Wextra; silence them here, not project-wide.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <ATen/ops/_fused_adagrad.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/Parallel.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/timer.h"

namespace zo::tools::detail {

const char* torch_fused_kernel(const std::string& optimizer) {
  if (optimizer == "adamw") return "at::_fused_adamw_";
  if (optimizer == "adam") return "at::_fused_adam_";
  if (optimizer == "adagrad") return "at::_fused_adagrad_";
  return nullptr;
}

namespace {

Status torch_failure(const char* what, const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  return internal_error(std::string(what) + ": " + (c10 ? c10->what_without_backtrace() : e.what()));
}

}  // namespace

Result<std::function<Status()>> make_torch_fused_step(const std::string& optimizer, const TorchHyper& h,
                                                      const TorchBuffers& b, int threads) {
  if (torch_fused_kernel(optimizer) == nullptr) return unavailable("torch has no fused CPU kernel for " + optimizer);
  try {
    at::set_num_threads(threads);
    const auto n64 = static_cast<int64_t>(b.n);
    auto wrap = [n64](float* data) { return torch::from_blob(data, {n64}, torch::kFloat32); };
    std::vector<at::Tensor> p{wrap(b.params)}, g{wrap(b.grad)}, v{wrap(b.exp_avg_sq)}, m;
    if (optimizer != "adagrad") m.push_back(wrap(b.exp_avg));
    std::vector<at::Tensor> step{torch::zeros({}, torch::kFloat32)};
    at::Tensor copy;
    if (b.copy != nullptr)
      copy = torch::from_blob(b.copy, {n64}, b.copy_dtype == 1 ? torch::kBFloat16 : torch::kFloat16);
    return std::function<Status()>([=]() -> Status {
      try {
        step[0].add_(1);
        if (optimizer == "adagrad")
          at::_fused_adagrad_(p, g, v, step, h.lr, /*lr_decay=*/0.0, h.weight_decay, h.eps, /*maximize=*/false);
        else if (optimizer == "adamw")
          at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, step, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps,
                            /*amsgrad=*/false, /*maximize=*/false);
        else
          at::_fused_adam_(p, g, m, v, /*max_exp_avg_sqs=*/{}, step, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps,
                           /*amsgrad=*/false, /*maximize=*/false);
        if (copy.defined()) copy.copy_(p[0]);
      } catch (const std::exception& e) { return torch_failure(torch_fused_kernel(optimizer), e); }
      return Status::ok();
    });
  } catch (const std::exception& e) { return torch_failure("setting up the torch baseline", e); }
}

Result<std::vector<double>> time_torch_loop(const std::string& optimizer, const TorchHyper& h, const TorchBuffers& b,
                                            int threads, int repeats) {
  try {
    at::set_num_threads(threads);
    const auto n64 = static_cast<int64_t>(b.n);
    torch::Tensor p = torch::from_blob(b.params, {n64}, torch::kFloat32);
    torch::Tensor g = torch::from_blob(b.grad, {n64}, torch::kFloat32);
    torch::Tensor copy;
    if (b.copy != nullptr)
      copy = torch::from_blob(b.copy, {n64}, b.copy_dtype == 1 ? torch::kBFloat16 : torch::kFloat16);
    p.set_requires_grad(true);
    p.mutable_grad() = g;
    std::vector<torch::Tensor> ps{p};
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (optimizer == "adamw") {
      opt = std::make_unique<torch::optim::AdamW>(
          ps, torch::optim::AdamWOptions(h.lr).betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(h.weight_decay));
    } else if (optimizer == "adam") {
      opt = std::make_unique<torch::optim::Adam>(
          ps, torch::optim::AdamOptions(h.lr).betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(h.weight_decay));
    } else if (optimizer == "adagrad") {
      opt = std::make_unique<torch::optim::Adagrad>(
          ps, torch::optim::AdagradOptions(h.lr).eps(h.eps).weight_decay(h.weight_decay));
    } else {
      return unavailable("torch::optim has no " + optimizer + " optimizer");
    }
    auto one_step = [&] {
      opt->step();
      if (copy.defined()) {
        torch::NoGradGuard no_grad;
        copy.copy_(p);
      }
    };
    one_step();
    std::vector<double> seconds;
    for (int r = 0; r < repeats; ++r) {
      Stopwatch sw;
      one_step();
      seconds.push_back(sw.elapsed_s());
    }
    return seconds;
  } catch (const std::exception& e) { return torch_failure("torch::optim", e); }
}

}  // namespace zo::tools::detail
