// adam_step, adam8bit_step, adagrad_step and lion_step: validate the spans and hyperparameters,
// derive every per-call constant once (in double, rounded once to float, so all ISA paths see the
// same values), then run the executor's kernel over tiles. Adam's validation and constants are
// common/adam_math's, the ones gpu::OptimKernels::adam_step uses; the 8-bit Adam's follow bitsandbytes.
#include <cmath>
#include <string>

#include "common/adam_math.h"
#include "cpu_optim/adagrad.h"
#include "cpu_optim/adam.h"
#include "cpu_optim/adam8bit.h"
#include "cpu_optim/detail/kernels.h"
#include "cpu_optim/lion.h"

namespace zo::cpu_optim {
namespace {

std::string size_text(size_t n) { return std::to_string(n); }

Status check_sizes(const char* op, size_t n, std::initializer_list<std::pair<const char*, size_t>> spans) {
  for (const auto& [name, size] : spans)
    if (size != n)
      return invalid_argument(std::string(op) + ": " + name + " has " + size_text(size) + " elements but params has " +
                              size_text(n));
  return Status::ok();
}

Status check_pointers(const char* op, size_t n, std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  if (n == 0) return Status::ok();
  for (const auto& [name, ptr] : ptrs)
    if (ptr == nullptr)
      return invalid_argument(std::string(op) + ": " + name + " is null for " + size_text(n) + " elements");
  return Status::ok();
}

Status check_dtypes(const char* op, ConstElemSpan grad, ElemSpan copy_out) {
  for (DType d : {grad.dtype, copy_out.dtype})
    if (static_cast<unsigned>(d) > static_cast<unsigned>(DType::kF16))
      return invalid_argument(std::string(op) + ": unknown dtype value " + std::to_string(static_cast<unsigned>(d)));
  return Status::ok();
}

Status check_scale(const char* op, float grad_scale) {
  if (!std::isfinite(grad_scale))
    return invalid_argument(std::string(op) + ": grad_scale must be finite, got " + std::to_string(grad_scale));
  return Status::ok();
}

const detail::KernelTable& table_for(const Executor& executor) {
  const detail::KernelTable* table = detail::kernel_table(executor.isa());
  ZO_CHECK(table != nullptr) << "executor ISA " << isa_name(executor.isa()) << " has no kernels";
  return *table;
}

constexpr float kInf = INFINITY;

Status check_state(const char* op, const char* name, size_t n, const BlockwiseState& s) {
  const std::string what = std::string(op) + ": " + name;
  if (s.codes.size() != n)
    return invalid_argument(what + " has " + std::to_string(s.codes.size()) + " codes but params has " +
                            std::to_string(n) + " elements");
  if (s.absmax.size() != quant_block_count(n))
    return invalid_argument(what + " has " + std::to_string(s.absmax.size()) + " absmax values; " + std::to_string(n) +
                            " elements need " + std::to_string(quant_block_count(n)));
  if (n > 0 && (s.codes.data() == nullptr || s.absmax.data() == nullptr))
    return invalid_argument(what + " is null for " + std::to_string(n) + " elements");
  return Status::ok();
}

detail::ParamArgs fp32_params(std::span<float> p) { return {p.data(), DType::kF32, 0, 0}; }

// A bf16 master's span, its copy-out and its state's dtype, checked before anything is written.
Status check_bf16_master(const char* op, const Bf16Master& p, ElemSpan copy_out,
                         std::initializer_list<std::pair<const char*, DType>> states) {
  if (uint64_t{p.first_index} + p.bits.size() > (uint64_t{1} << 32))
    return invalid_argument(std::string(op) + ": elements [" + std::to_string(p.first_index) + ", " +
                            std::to_string(uint64_t{p.first_index} + p.bits.size()) +
                            ") of a parameter: a bf16 master indexes its elements in 32 bits");
  if (copy_out.data != nullptr && copy_out.dtype != DType::kBF16)
    return invalid_argument(std::string(op) + ": a bf16 master's copy-out is bf16 (its own bits), not " +
                            std::string(dtype_name(copy_out.dtype)));
  for (const auto& [name, dtype] : states)
    if (dtype != DType::kF32 && dtype != DType::kBF16)
      return invalid_argument(std::string(op) + ": " + name + " must be fp32 or bf16, not dtype value " +
                              std::to_string(static_cast<unsigned>(dtype)));
  return Status::ok();
}

detail::ParamArgs bf16_params(const Bf16Master& p) { return {p.bits.data(), DType::kBF16, p.sr_key, p.first_index}; }

}  // namespace

namespace {

// adam_step's checks and dispatch, for moments of either dtype (fp32 or bf16; element counts given).
Status run_adam(const char* op, const AdamConfig& config, int64_t step, detail::ParamArgs params, size_t n,
                void* exp_avg, size_t exp_avg_n, void* exp_avg_sq, size_t exp_avg_sq_n, DType moment_dtype,
                ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor) {
  ZO_RETURN_IF_ERROR(check_sizes(op, n, {{"exp_avg", exp_avg_n}, {"exp_avg_sq", exp_avg_sq_n}}));
  ZO_RETURN_IF_ERROR(check_pointers(
      op, n, {{"params", params.params}, {"exp_avg", exp_avg}, {"exp_avg_sq", exp_avg_sq}, {"grad", grad.data}}));
  ZO_RETURN_IF_ERROR(check_adam_hyperparameters(op, config, step, grad_scale));
  ZO_RETURN_IF_ERROR(check_dtypes(op, grad, copy_out));
  if (n == 0) return Status::ok();

  detail::AdamArgs a{};
  a.p = params;
  a.exp_avg = exp_avg;
  a.exp_avg_sq = exp_avg_sq;
  a.moment_dtype = moment_dtype;
  a.grad = grad.data;
  a.grad_dtype = grad.dtype;
  a.copy_out = copy_out.data;
  a.copy_dtype = copy_out.dtype;
  a.k = adam_constants(config, step, grad_scale);  // shared with gpu::OptimKernels::adam_step
  const auto kernel = table_for(executor).adam;
  executor.for_each_tile(n, [&](size_t begin, size_t end) { kernel(a, begin, end); });
  return Status::ok();
}

}  // namespace

Status check_adagrad_config(std::string_view op, const AdagradConfig& config) {
  ZO_RETURN_IF_ERROR(check_hyperparameter(op, "lr", config.lr, 0.0f, kInf, true));
  ZO_RETURN_IF_ERROR(check_hyperparameter(op, "eps", config.eps, 0.0f, kInf, true));
  return check_hyperparameter(op, "weight_decay", config.weight_decay, 0.0f, kInf, true);
}

Status check_lion_config(std::string_view op, const LionConfig& config) {
  ZO_RETURN_IF_ERROR(check_hyperparameter(op, "lr", config.lr, 0.0f, kInf, true));
  ZO_RETURN_IF_ERROR(check_hyperparameter(op, "beta1", config.beta1, 0.0f, 1.0f, false));
  ZO_RETURN_IF_ERROR(check_hyperparameter(op, "beta2", config.beta2, 0.0f, 1.0f, false));
  return check_hyperparameter(op, "weight_decay", config.weight_decay, 0.0f, kInf, true);
}

Status adam_step(const AdamConfig& config, int64_t step, std::span<float> params, std::span<float> exp_avg,
                 std::span<float> exp_avg_sq, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                 const Executor& executor) {
  return run_adam("adam_step", config, step, fp32_params(params), params.size(), exp_avg.data(), exp_avg.size(),
                  exp_avg_sq.data(), exp_avg_sq.size(), DType::kF32, grad, grad_scale, copy_out, executor);
}

Status adam_step_bf16_moments(const AdamConfig& config, int64_t step, std::span<float> params,
                              std::span<uint16_t> exp_avg, std::span<uint16_t> exp_avg_sq, ConstElemSpan grad,
                              float grad_scale, ElemSpan copy_out, const Executor& executor) {
  return run_adam("adam_step_bf16_moments", config, step, fp32_params(params), params.size(), exp_avg.data(),
                  exp_avg.size(), exp_avg_sq.data(), exp_avg_sq.size(), DType::kBF16, grad, grad_scale, copy_out,
                  executor);
}

Status adam_step_bf16_master(const AdamConfig& config, int64_t step, Bf16Master params, ElemSpan exp_avg,
                             ElemSpan exp_avg_sq, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                             const Executor& executor) {
  const char* op = "adam_step_bf16_master";
  ZO_RETURN_IF_ERROR(
      check_bf16_master(op, params, copy_out, {{"exp_avg", exp_avg.dtype}, {"exp_avg_sq", exp_avg_sq.dtype}}));
  if (exp_avg.dtype != exp_avg_sq.dtype)
    return invalid_argument(std::string(op) + ": exp_avg and exp_avg_sq have different dtypes");
  const size_t n = params.bits.size();
  return run_adam(op, config, step, bf16_params(params), n, exp_avg.data, n, exp_avg_sq.data, n, exp_avg.dtype, grad,
                  grad_scale, copy_out, executor);
}

namespace {

// The per-call constants Adagrad's and Lion's kernels share with their 8-bit forms
// (detail::AdagradArgs / LionArgs / OneState8bitArgs).
template <class Args>
void set_adagrad_constants(const AdagradConfig& config, Args& a) {
  a.eps = config.eps;
  a.neg_lr = -config.lr;
  a.weight_decay = config.weight_decay;
  a.use_decay = config.weight_decay > 0.0f;
}

template <class Args>
void set_lion_constants(const LionConfig& config, Args& a) {
  a.beta1 = config.beta1;
  a.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(config.beta1));
  a.beta2 = config.beta2;
  a.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(config.beta2));
  a.lr = config.lr;
  a.after_decay = static_cast<float>(1.0 - static_cast<double>(config.lr) * config.weight_decay);
  a.use_decay = config.weight_decay > 0.0f;
}

Status run_adagrad(const char* op, const AdagradConfig& config, detail::ParamArgs params, size_t n, void* exp_avg_sq,
                   size_t exp_avg_sq_n, DType state_dtype, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                   const Executor& executor) {
  ZO_RETURN_IF_ERROR(check_sizes(op, n, {{"exp_avg_sq", exp_avg_sq_n}}));
  ZO_RETURN_IF_ERROR(
      check_pointers(op, n, {{"params", params.params}, {"exp_avg_sq", exp_avg_sq}, {"grad", grad.data}}));
  ZO_RETURN_IF_ERROR(check_adagrad_config(op, config));
  ZO_RETURN_IF_ERROR(check_scale(op, grad_scale));
  ZO_RETURN_IF_ERROR(check_dtypes(op, grad, copy_out));
  if (n == 0) return Status::ok();

  detail::AdagradArgs a{};
  a.p = params;
  a.exp_avg_sq = exp_avg_sq;
  a.state_dtype = state_dtype;
  a.grad = grad.data;
  a.grad_dtype = grad.dtype;
  a.copy_out = copy_out.data;
  a.copy_dtype = copy_out.dtype;
  a.grad_scale = grad_scale;
  set_adagrad_constants(config, a);
  const auto kernel = table_for(executor).adagrad;
  executor.for_each_tile(n, [&](size_t begin, size_t end) { kernel(a, begin, end); });
  return Status::ok();
}

Status run_lion(const char* op, const LionConfig& config, detail::ParamArgs params, size_t n, void* exp_avg,
                size_t exp_avg_n, DType state_dtype, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                const Executor& executor) {
  ZO_RETURN_IF_ERROR(check_sizes(op, n, {{"exp_avg", exp_avg_n}}));
  ZO_RETURN_IF_ERROR(check_pointers(op, n, {{"params", params.params}, {"exp_avg", exp_avg}, {"grad", grad.data}}));
  ZO_RETURN_IF_ERROR(check_lion_config(op, config));
  ZO_RETURN_IF_ERROR(check_scale(op, grad_scale));
  ZO_RETURN_IF_ERROR(check_dtypes(op, grad, copy_out));
  if (n == 0) return Status::ok();

  detail::LionArgs a{};
  a.p = params;
  a.exp_avg = exp_avg;
  a.state_dtype = state_dtype;
  a.grad = grad.data;
  a.grad_dtype = grad.dtype;
  a.copy_out = copy_out.data;
  a.copy_dtype = copy_out.dtype;
  a.grad_scale = grad_scale;
  set_lion_constants(config, a);
  const auto kernel = table_for(executor).lion;
  executor.for_each_tile(n, [&](size_t begin, size_t end) { kernel(a, begin, end); });
  return Status::ok();
}

}  // namespace

Status adagrad_step(const AdagradConfig& config, std::span<float> params, std::span<float> exp_avg_sq,
                    ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor) {
  return run_adagrad("adagrad_step", config, fp32_params(params), params.size(), exp_avg_sq.data(), exp_avg_sq.size(),
                     DType::kF32, grad, grad_scale, copy_out, executor);
}

Status adagrad_step_bf16_moments(const AdagradConfig& config, std::span<float> params, std::span<uint16_t> exp_avg_sq,
                                 ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor) {
  return run_adagrad("adagrad_step_bf16_moments", config, fp32_params(params), params.size(), exp_avg_sq.data(),
                     exp_avg_sq.size(), DType::kBF16, grad, grad_scale, copy_out, executor);
}

Status adagrad_step_bf16_master(const AdagradConfig& config, Bf16Master params, ElemSpan exp_avg_sq, ConstElemSpan grad,
                                float grad_scale, ElemSpan copy_out, const Executor& executor) {
  const char* op = "adagrad_step_bf16_master";
  ZO_RETURN_IF_ERROR(check_bf16_master(op, params, copy_out, {{"exp_avg_sq", exp_avg_sq.dtype}}));
  const size_t n = params.bits.size();
  return run_adagrad(op, config, bf16_params(params), n, exp_avg_sq.data, n, exp_avg_sq.dtype, grad, grad_scale,
                     copy_out, executor);
}

Status lion_step(const LionConfig& config, std::span<float> params, std::span<float> exp_avg, ConstElemSpan grad,
                 float grad_scale, ElemSpan copy_out, const Executor& executor) {
  return run_lion("lion_step", config, fp32_params(params), params.size(), exp_avg.data(), exp_avg.size(), DType::kF32,
                  grad, grad_scale, copy_out, executor);
}

Status lion_step_bf16_moments(const LionConfig& config, std::span<float> params, std::span<uint16_t> exp_avg,
                              ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor) {
  return run_lion("lion_step_bf16_moments", config, fp32_params(params), params.size(), exp_avg.data(), exp_avg.size(),
                  DType::kBF16, grad, grad_scale, copy_out, executor);
}

Status lion_step_bf16_master(const LionConfig& config, Bf16Master params, ElemSpan exp_avg, ConstElemSpan grad,
                             float grad_scale, ElemSpan copy_out, const Executor& executor) {
  const char* op = "lion_step_bf16_master";
  ZO_RETURN_IF_ERROR(check_bf16_master(op, params, copy_out, {{"exp_avg", exp_avg.dtype}}));
  const size_t n = params.bits.size();
  return run_lion(op, config, bf16_params(params), n, exp_avg.data, n, exp_avg.dtype, grad, grad_scale, copy_out,
                  executor);
}

namespace {

Status run_adam8bit(const char* op, const AdamConfig& config, int64_t step, detail::ParamArgs params, size_t n,
                    BlockwiseState exp_avg, BlockwiseState exp_avg_sq, ConstElemSpan grad, float grad_scale,
                    ElemSpan copy_out, const Executor& executor) {
  ZO_RETURN_IF_ERROR(check_state(op, "exp_avg", n, exp_avg));
  ZO_RETURN_IF_ERROR(check_state(op, "exp_avg_sq", n, exp_avg_sq));
  ZO_RETURN_IF_ERROR(check_pointers(op, n, {{"params", params.params}, {"grad", grad.data}}));
  ZO_RETURN_IF_ERROR(check_adam_hyperparameters(op, config, step, grad_scale));
  ZO_RETURN_IF_ERROR(check_dtypes(op, grad, copy_out));
  if (n == 0) return Status::ok();

  detail::Adam8bitArgs a{};
  a.p = params;
  a.m_codes = exp_avg.codes.data();
  a.m_absmax = exp_avg.absmax.data();
  a.v_codes = exp_avg_sq.codes.data();
  a.v_absmax = exp_avg_sq.absmax.data();
  a.m_map = signed_dynamic_map().data();
  a.v_map = unsigned_dynamic_map().data();
  a.m_quant = &detail::signed_map_quant_table();
  a.v_quant = &detail::unsigned_map_quant_table();
  a.grad = grad.data;
  a.grad_dtype = grad.dtype;
  a.copy_out = copy_out.data;
  a.copy_dtype = copy_out.dtype;
  a.k = adam8bit_constants(config, step, grad_scale);
  static_assert(kTileElems % kQuantBlockElems == 0, "a block must not straddle two tiles");
  static_assert(detail::kQuantBlock == kQuantBlockElems);
  const auto kernel = table_for(executor).adam8bit;
  executor.for_each_tile(n, [&](size_t begin, size_t end) { kernel(a, begin, end); });
  return Status::ok();
}

}  // namespace

Status adam8bit_step(const AdamConfig& config, int64_t step, std::span<float> params, BlockwiseState exp_avg,
                     BlockwiseState exp_avg_sq, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                     const Executor& executor) {
  return run_adam8bit("adam8bit_step", config, step, fp32_params(params), params.size(), exp_avg, exp_avg_sq, grad,
                      grad_scale, copy_out, executor);
}

Status adam8bit_step_bf16_master(const AdamConfig& config, int64_t step, Bf16Master params, BlockwiseState exp_avg,
                                 BlockwiseState exp_avg_sq, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                                 const Executor& executor) {
  const char* op = "adam8bit_step_bf16_master";
  ZO_RETURN_IF_ERROR(check_bf16_master(op, params, copy_out, {}));
  return run_adam8bit(op, config, step, bf16_params(params), params.bits.size(), exp_avg, exp_avg_sq, grad, grad_scale,
                      copy_out, executor);
}

namespace {

// Lion's or Adagrad's one 8-bit state (detail::OneState8bitArgs), the hyperparameters checked by
// the caller.
Status run_one_state8bit(const char* op, detail::OneState8bitArgs a, size_t n, const char* state_name,
                         BlockwiseState state, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                         const Executor& executor) {
  ZO_RETURN_IF_ERROR(check_state(op, state_name, n, state));
  ZO_RETURN_IF_ERROR(check_pointers(op, n, {{"params", a.p.params}, {"grad", grad.data}}));
  ZO_RETURN_IF_ERROR(check_scale(op, grad_scale));
  ZO_RETURN_IF_ERROR(check_dtypes(op, grad, copy_out));
  if (n == 0) return Status::ok();
  a.codes = state.codes.data();
  a.absmax = state.absmax.data();
  a.map = signed_dynamic_map().data();
  a.quant = &detail::signed_map_quant_table();
  a.grad = grad.data;
  a.grad_dtype = grad.dtype;
  a.copy_out = copy_out.data;
  a.copy_dtype = copy_out.dtype;
  a.grad_scale = grad_scale;
  const auto kernel = table_for(executor).one_state8bit;
  executor.for_each_tile(n, [&](size_t begin, size_t end) { kernel(a, begin, end); });
  return Status::ok();
}

Status run_lion8bit(const char* op, const LionConfig& config, detail::ParamArgs params, size_t n,
                    BlockwiseState exp_avg, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                    const Executor& executor) {
  ZO_RETURN_IF_ERROR(check_lion_config(op, config));
  detail::OneState8bitArgs a{};
  a.p = params;
  a.lion = true;
  set_lion_constants(config, a);
  return run_one_state8bit(op, a, n, "exp_avg", exp_avg, grad, grad_scale, copy_out, executor);
}

Status run_adagrad8bit(const char* op, const AdagradConfig& config, detail::ParamArgs params, size_t n,
                       BlockwiseState exp_avg_sq, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                       const Executor& executor) {
  ZO_RETURN_IF_ERROR(check_adagrad_config(op, config));
  detail::OneState8bitArgs a{};
  a.p = params;
  a.lion = false;
  set_adagrad_constants(config, a);
  return run_one_state8bit(op, a, n, "exp_avg_sq", exp_avg_sq, grad, grad_scale, copy_out, executor);
}

}  // namespace

Status lion8bit_step(const LionConfig& config, std::span<float> params, BlockwiseState exp_avg, ConstElemSpan grad,
                     float grad_scale, ElemSpan copy_out, const Executor& executor) {
  return run_lion8bit("lion8bit_step", config, fp32_params(params), params.size(), exp_avg, grad, grad_scale, copy_out,
                      executor);
}

Status lion8bit_step_bf16_master(const LionConfig& config, Bf16Master params, BlockwiseState exp_avg,
                                 ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor) {
  const char* op = "lion8bit_step_bf16_master";
  ZO_RETURN_IF_ERROR(check_bf16_master(op, params, copy_out, {}));
  return run_lion8bit(op, config, bf16_params(params), params.bits.size(), exp_avg, grad, grad_scale, copy_out,
                      executor);
}

Status adagrad8bit_step(const AdagradConfig& config, std::span<float> params, BlockwiseState exp_avg_sq,
                        ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor) {
  return run_adagrad8bit("adagrad8bit_step", config, fp32_params(params), params.size(), exp_avg_sq, grad, grad_scale,
                         copy_out, executor);
}

Status adagrad8bit_step_bf16_master(const AdagradConfig& config, Bf16Master params, BlockwiseState exp_avg_sq,
                                    ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor) {
  const char* op = "adagrad8bit_step_bf16_master";
  ZO_RETURN_IF_ERROR(check_bf16_master(op, params, copy_out, {}));
  return run_adagrad8bit(op, config, bf16_params(params), params.bits.size(), exp_avg_sq, grad, grad_scale, copy_out,
                         executor);
}

}  // namespace zo::cpu_optim
