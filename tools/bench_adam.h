// zoffload-bench adam's arguments, shared by its fp32-moment run (bench_adam.cpp) and its 8-bit
// moment run (bench_adam8bit.cpp). Plain values.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>

#include "common/status.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/isa.h"

namespace zo::tools {

struct AdamArgs {
  std::string params = "2e8";
  std::string optimizer = "adamw";
  std::string moments = "fp32";  // fp32 | bf16 | 8bit (zoffload.moment_dtype)
  std::string masters = "fp32";  // fp32 | bf16 (zoffload.master_dtype)
  std::string grad_dtype = "fp32";
  std::string copy_out = "bf16";
  std::string isa = "auto";
  int threads = 0;
  int repeats = 5;
  bool bind_cores = false;
  bool no_torch = false;
  bool torch_loop = false;
  bool json = false;
};

// The flags every run of the command reads, parsed and checked (--params, --grad-dtype, --copy-out,
// --isa, --threads, --repeats); kInvalidArgument with the usage line naming the flag.
struct AdamCommon {
  size_t n = 0;
  cpu_optim::DType grad = cpu_optim::DType::kF32;
  bool has_copy = false;
  cpu_optim::DType copy = cpu_optim::DType::kBF16;
  cpu_optim::Isa isa = cpu_optim::Isa::kAuto;
};
Result<AdamCommon> parse_adam_common(const AdamArgs& args);

// The fields every run's --json opens with: the flags as run (n parameters), the executor, the hyperparameters
// (`h` has lr, beta1, beta2, eps and weight_decay; the gradients are unscaled ×1/1024 in the pass)
// and the check's summary.
template <class Hyper>
nlohmann::json adam_run_json(const AdamArgs& a, size_t n, bool has_copy, const cpu_optim::Executor& ex, const Hyper& h,
                             const std::string& check) {
  nlohmann::json j;
  j["optimizer"] = a.optimizer;
  j["params"] = n;
  j["grad_dtype"] = a.grad_dtype;
  j["copy_out"] = has_copy ? a.copy_out : "none";
  j["isa"] = std::string(cpu_optim::isa_name(ex.isa()));
  j["threads"] = ex.n_threads();
  j["bind_cores"] = ex.cores_bound();
  j["repeats"] = a.repeats;
  j["hyper"] = {{"lr", h.lr},
                {"beta1", h.beta1},
                {"beta2", h.beta2},
                {"eps", h.eps},
                {"weight_decay", h.weight_decay},
                {"grad_scale", 1.0 / 1024.0}};
  j["check"] = check;
  return j;
}

// --moments 8bit | bf16, or --masters bf16 with any moments: adam8bit_step, adam_step_bf16_moments
// or the *_bf16_master steps against the scalar path, then timed beside the fp32 kernel on the same
// parameters and a STREAM triad (tools/bench_adam8bit.cpp).
// Exit code as run_adam_bench's.
int run_adam_narrow_moments_bench(const AdamArgs& args);

}  // namespace zo::tools
