#include "engine/memory/sub_group_step.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "common/adam_math.h"
#include "common/half.h"
#include "cpu_optim/adam8bit.h"
#include "cpu_optim/vector_ops.h"
#include "engine/memory/moment_layout.h"
#include "gpu/optim_kernels.h"

namespace zo::engine {

// Note [One table of optimizer kernels]
// What steps a sub-group is decided in one place, kRows below: a row per (optimizer, moment dtype,
// master dtype) names the cpu_optim kernel, and the device's (gpu/optim_kernels.h) where there is
// one, and the gradient dtypes they read (every row reads fp32, bf16 and fp16). Adam and AdamW
// share their rows (AdamConfig::adam_w_mode tells them apart). The CPU's kernels share one
// signature, and the device's another: the hyperparameters (the optimizer's own struct, in
// UpdateArgs) and a Run, the operands of one call over n elements. The walk cuts a sub-group into runs the same way for the
// CPU and the device: one run over the whole sub-group with fp32 masters and fp32 or bf16
// moments; a run per parameter piece with bf16 masters (each piece draws its parameter's rounding
// bits, Note [Stochastic rounding to bf16]); with 8-bit moments a run per piece of their layout,
// the quantized ones by the 8-bit row and a small parameter's fp32 moments by the fp32 row of the
// same optimizer and masters (Note [8-bit moment layout]). Lion's momentum is exp_avg and
// Adagrad's sum of squares exp_avg_sq (Note [One moment for Adagrad and Lion]). A new optimizer or
// state format is therefore a kernel and its rows here, plus, for a new layout, its case in the
// walk; the swapper, which only moves states, does not change.

namespace {

// The operands of one kernel call over n elements. 8-bit moments: codes at exp_avg / exp_avg_sq and
// the absmax at *_absmax; otherwise the elements, in RunDtypes::moments. Bf16 masters draw their
// rounding bits from sr_key and sr_first.
template <class Ptr, class ConstPtr>
struct Run {
  Ptr master;
  uint32_t sr_key = 0;
  uint32_t sr_first = 0;
  Ptr exp_avg, exp_avg_absmax;
  Ptr exp_avg_sq, exp_avg_sq_absmax;
  ConstPtr grad;
  Ptr copy_out;
  uint64_t n = 0;
};
using HostRun = Run<std::byte*, const std::byte*>;
using DeviceRun = Run<gpu::DevicePtr, gpu::DevicePtr>;

struct RunDtypes {
  DType master, moments, grad, copy;
};

// Adam and AdamW share their kernels.
enum class Family : uint8_t { kAdam, kLion, kAdagrad };

Family family(OptimizerType type) {
  switch (type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW: return Family::kAdam;
    case OptimizerType::kLion: return Family::kLion;
    case OptimizerType::kAdagrad: return Family::kAdagrad;
  }
  return Family::kAdam;
}

using CpuKernel = Status (*)(const UpdateArgs&, const HostRun&, const RunDtypes&, const cpu_optim::Executor&);
using DeviceKernel = Status (*)(const UpdateArgs&, const DeviceRun&, const RunDtypes&, gpu::Device&, gpu::Stream);

// ---- Typed views of a run ----------------------------------------------------------------------

std::span<float> f32(std::byte* p, uint64_t n) { return {reinterpret_cast<float*>(p), n}; }
std::span<uint16_t> u16(std::byte* p, uint64_t n) { return {reinterpret_cast<uint16_t*>(p), n}; }
cpu_optim::BlockwiseState blockwise(std::byte* codes, std::byte* absmax, uint64_t n) {
  return {{reinterpret_cast<uint8_t*>(codes), n}, {reinterpret_cast<float*>(absmax), cpu_optim::quant_block_count(n)}};
}
cpu_optim::Bf16Master bf16_master(const HostRun& r) { return {u16(r.master, r.n), r.sr_key, r.sr_first}; }
cpu_optim::ConstElemSpan grad(const HostRun& r, const RunDtypes& d) { return {r.grad, d.grad}; }
cpu_optim::ElemSpan copy(const HostRun& r, const RunDtypes& d) { return {r.copy_out, d.copy}; }

const cpu_optim::AdamConfig& adam(const UpdateArgs& a) { return std::get<cpu_optim::AdamConfig>(a.hyperparameters); }
const cpu_optim::LionConfig& lion(const UpdateArgs& a) { return std::get<cpu_optim::LionConfig>(a.hyperparameters); }
const cpu_optim::AdagradConfig& adagrad(const UpdateArgs& a) {
  return std::get<cpu_optim::AdagradConfig>(a.hyperparameters);
}

// ---- The CPU's kernels: one per cpu_optim entry point ------------------------------------------

using Ex = cpu_optim::Executor;

Status adam_f32(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::adam_step(adam(a), a.step, f32(r.master, r.n), f32(r.exp_avg, r.n), f32(r.exp_avg_sq, r.n),
                              grad(r, d), a.grad_scale, copy(r, d), ex);
}
Status adam_bf16_moments(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::adam_step_bf16_moments(adam(a), a.step, f32(r.master, r.n), u16(r.exp_avg, r.n),
                                           u16(r.exp_avg_sq, r.n), grad(r, d), a.grad_scale, copy(r, d), ex);
}
Status adam_bf16_master(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::adam_step_bf16_master(adam(a), a.step, bf16_master(r), {r.exp_avg, d.moments},
                                          {r.exp_avg_sq, d.moments}, grad(r, d), a.grad_scale, copy(r, d), ex);
}
Status adam_8bit(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::adam8bit_step(adam(a), a.step, f32(r.master, r.n), blockwise(r.exp_avg, r.exp_avg_absmax, r.n),
                                  blockwise(r.exp_avg_sq, r.exp_avg_sq_absmax, r.n), grad(r, d), a.grad_scale,
                                  copy(r, d), ex);
}
Status adam_8bit_bf16_master(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::adam8bit_step_bf16_master(
      adam(a), a.step, bf16_master(r), blockwise(r.exp_avg, r.exp_avg_absmax, r.n),
      blockwise(r.exp_avg_sq, r.exp_avg_sq_absmax, r.n), grad(r, d), a.grad_scale, copy(r, d), ex);
}

// Note [One moment for Adagrad and Lion]: the store keeps both moment regions whatever the
// optimizer; Adagrad's sum of squares lives in exp_avg_sq and Lion's momentum in exp_avg, the other
// region stays zeros (written and checkpointed like any state). Each kernel below takes its own.
Status lion_f32(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::lion_step(lion(a), f32(r.master, r.n), f32(r.exp_avg, r.n), grad(r, d), a.grad_scale, copy(r, d),
                              ex);
}
Status lion_bf16_moments(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::lion_step_bf16_moments(lion(a), f32(r.master, r.n), u16(r.exp_avg, r.n), grad(r, d), a.grad_scale,
                                           copy(r, d), ex);
}
Status lion_bf16_master(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::lion_step_bf16_master(lion(a), bf16_master(r), {r.exp_avg, d.moments}, grad(r, d), a.grad_scale,
                                          copy(r, d), ex);
}
Status lion_8bit(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::lion8bit_step(lion(a), f32(r.master, r.n), blockwise(r.exp_avg, r.exp_avg_absmax, r.n), grad(r, d),
                                  a.grad_scale, copy(r, d), ex);
}
Status lion_8bit_bf16_master(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::lion8bit_step_bf16_master(lion(a), bf16_master(r), blockwise(r.exp_avg, r.exp_avg_absmax, r.n),
                                              grad(r, d), a.grad_scale, copy(r, d), ex);
}

Status adagrad_f32(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::adagrad_step(adagrad(a), f32(r.master, r.n), f32(r.exp_avg_sq, r.n), grad(r, d), a.grad_scale,
                                 copy(r, d), ex);
}
Status adagrad_bf16_moments(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::adagrad_step_bf16_moments(adagrad(a), f32(r.master, r.n), u16(r.exp_avg_sq, r.n), grad(r, d),
                                              a.grad_scale, copy(r, d), ex);
}
Status adagrad_bf16_master(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::adagrad_step_bf16_master(adagrad(a), bf16_master(r), {r.exp_avg_sq, d.moments}, grad(r, d),
                                             a.grad_scale, copy(r, d), ex);
}
Status adagrad_8bit(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::adagrad8bit_step(adagrad(a), f32(r.master, r.n), blockwise(r.exp_avg_sq, r.exp_avg_sq_absmax, r.n),
                                     grad(r, d), a.grad_scale, copy(r, d), ex);
}
Status adagrad_8bit_bf16_master(const UpdateArgs& a, const HostRun& r, const RunDtypes& d, const Ex& ex) {
  return cpu_optim::adagrad8bit_step_bf16_master(adagrad(a), bf16_master(r),
                                                 blockwise(r.exp_avg_sq, r.exp_avg_sq_absmax, r.n), grad(r, d),
                                                 a.grad_scale, copy(r, d), ex);
}

// ---- The device's kernels ----------------------------------------------------------------------

// The fields the device's two kernels share.
template <class Args>
Args device_args(const UpdateArgs& a, const DeviceRun& r, const RunDtypes& d) {
  Args args;
  args.params = r.master;
  args.param_dtype = d.master;
  args.sr_key = r.sr_key;
  args.sr_first = r.sr_first;
  args.grad = r.grad;
  args.grad_dtype = d.grad;
  args.grad_scale = a.grad_scale;
  args.copy_out = r.copy_out;
  args.copy_dtype = d.copy;
  args.n_elems = r.n;
  args.config = adam(a);
  args.step = a.step;
  return args;
}

// fp32 or bf16 moments, either masters.
Status device_adam(const UpdateArgs& a, const DeviceRun& r, const RunDtypes& d, gpu::Device& device,
                   gpu::Stream stream) {
  auto args = device_args<gpu::DeviceAdamArgs>(a, r, d);
  args.exp_avg = r.exp_avg;
  args.exp_avg_sq = r.exp_avg_sq;
  args.moment_dtype = d.moments;
  return gpu::optim_kernels(device).adam_step(device, args, stream);
}

// 8-bit moments, either masters.
Status device_adam8bit(const UpdateArgs& a, const DeviceRun& r, const RunDtypes& d, gpu::Device& device,
                       gpu::Stream stream) {
  auto args = device_args<gpu::DeviceAdam8bitArgs>(a, r, d);
  args.m_codes = r.exp_avg;
  args.m_absmax = r.exp_avg_absmax;
  args.v_codes = r.exp_avg_sq;
  args.v_absmax = r.exp_avg_sq_absmax;
  return gpu::optim_kernels(device).adam8bit_step(device, args, stream);
}

constexpr uint8_t kAnyGrad =
    1u << static_cast<int>(DType::kF32) | 1u << static_cast<int>(DType::kBF16) | 1u << static_cast<int>(DType::kF16);

}  // namespace

struct SubGroupStep::Row {
  Family family;
  MomentDtype moments;
  DType master;
  uint8_t grad_dtypes;  // a bit per DType the kernels read
  CpuKernel cpu;
  DeviceKernel device;  // null: none
};

namespace {

using Row = SubGroupStep::Row;
constexpr DType kF32 = DType::kF32, kBF16 = DType::kBF16;
constexpr MomentDtype kM32 = MomentDtype::kF32, kM16 = MomentDtype::kBF16, kM8 = MomentDtype::k8bit;

// Note [One table of optimizer kernels].
constexpr Row kRows[] = {
    {Family::kAdam, kM32, kF32, kAnyGrad, &adam_f32, &device_adam},
    {Family::kAdam, kM16, kF32, kAnyGrad, &adam_bf16_moments, &device_adam},
    {Family::kAdam, kM8, kF32, kAnyGrad, &adam_8bit, &device_adam8bit},
    {Family::kAdam, kM32, kBF16, kAnyGrad, &adam_bf16_master, &device_adam},
    {Family::kAdam, kM16, kBF16, kAnyGrad, &adam_bf16_master, &device_adam},
    {Family::kAdam, kM8, kBF16, kAnyGrad, &adam_8bit_bf16_master, &device_adam8bit},
    {Family::kLion, kM32, kF32, kAnyGrad, &lion_f32, nullptr},
    {Family::kLion, kM16, kF32, kAnyGrad, &lion_bf16_moments, nullptr},
    {Family::kLion, kM8, kF32, kAnyGrad, &lion_8bit, nullptr},
    {Family::kLion, kM32, kBF16, kAnyGrad, &lion_bf16_master, nullptr},
    {Family::kLion, kM16, kBF16, kAnyGrad, &lion_bf16_master, nullptr},
    {Family::kLion, kM8, kBF16, kAnyGrad, &lion_8bit_bf16_master, nullptr},
    {Family::kAdagrad, kM32, kF32, kAnyGrad, &adagrad_f32, nullptr},
    {Family::kAdagrad, kM16, kF32, kAnyGrad, &adagrad_bf16_moments, nullptr},
    {Family::kAdagrad, kM8, kF32, kAnyGrad, &adagrad_8bit, nullptr},
    {Family::kAdagrad, kM32, kBF16, kAnyGrad, &adagrad_bf16_master, nullptr},
    {Family::kAdagrad, kM16, kBF16, kAnyGrad, &adagrad_bf16_master, nullptr},
    {Family::kAdagrad, kM8, kBF16, kAnyGrad, &adagrad_8bit_bf16_master, nullptr},
};

const Row* find_row(Family f, MomentDtype moments, DType master, DType grad) {
  for (const Row& row : kRows) {
    if (row.family == f && row.moments == moments && row.master == master &&
        (row.grad_dtypes >> static_cast<int>(grad) & 1u) != 0)
      return &row;
  }
  return nullptr;
}

std::byte* at(std::byte* p, uint64_t offset_bytes) { return p == nullptr ? p : p + offset_bytes; }
const std::byte* at(const std::byte* p, uint64_t offset_bytes) { return p == nullptr ? p : p + offset_bytes; }
gpu::DevicePtr at(gpu::DevicePtr p, uint64_t offset_bytes) { return p ? p + offset_bytes : p; }

// The walk of Note [One table of optimizer kernels]: cuts sub-group g into runs and calls
// `run(r, row, moment dtype)` for each. A sub-group that is one run steps only its elements
// [begin, begin + count) (all of them by default).
template <class Ptr, class ConstPtr, class RunFn>
Status walk(const ParamRegistry& registry, uint32_t g, const UpdateArgs& args, GroupStates<Ptr, ConstPtr> s,
            const Row* main, const Row* small, MomentDtype moments, DType master_dtype, DType grad_dtype,
            DType compute_dtype, RunFn&& run, uint64_t begin = 0, uint64_t count = UINT64_MAX) {
  if (s.copy_out == s.master) s.copy_out = {};  // Note [A bf16 master is its compute copy]: updated in place
  const uint64_t pb = dtype_size_bytes(master_dtype), gb = dtype_size_bytes(grad_dtype),
                 cb = dtype_size_bytes(compute_dtype);
  auto piece_run = [&](const ParamPiece* piece, uint64_t offset, uint64_t n) {
    Run<Ptr, ConstPtr> r;
    r.master = at(s.master, offset * pb);
    r.grad = at(s.grad, offset * gb);
    r.copy_out = at(s.copy_out, offset * cb);
    r.n = n;
    if (piece != nullptr && master_dtype == DType::kBF16) {
      r.sr_key = sr_key(args.rounding_seed, static_cast<uint64_t>(args.step), piece->param);
      r.sr_first = static_cast<uint32_t>(piece->param_offset);
    }
    return r;
  };
  if (moments == MomentDtype::k8bit) {
    for (const MomentPiece& mp : moment_layout(registry, g).pieces) {
      auto r = piece_run(mp.piece, mp.piece->group_offset, mp.piece->n_elems);
      const uint64_t states = mp.quantized ? mp.codes_offset_bytes : mp.aux_offset_bytes;
      r.exp_avg = at(s.exp_avg, states);
      r.exp_avg_sq = at(s.exp_avg_sq, states);
      if (mp.quantized) {
        r.exp_avg_absmax = at(s.exp_avg, mp.aux_offset_bytes);
        r.exp_avg_sq_absmax = at(s.exp_avg_sq, mp.aux_offset_bytes);
      }
      Status st = mp.quantized ? run(r, *main, DType::kF32) : run(r, *small, DType::kF32);
      if (!st.is_ok()) return st.with_context(registry.params()[mp.piece->param].name);
    }
    return Status::ok();
  }
  const DType md = moment_elem_dtype(moments);
  const uint64_t mb = dtype_size_bytes(md);
  auto elementwise_run = [&](const ParamPiece* piece, uint64_t offset, uint64_t n) {
    auto r = piece_run(piece, offset, n);
    r.exp_avg = at(s.exp_avg, offset * mb);
    r.exp_avg_sq = at(s.exp_avg_sq, offset * mb);
    return run(r, *main, md);
  };
  if (master_dtype == DType::kBF16) {
    for (const ParamPiece& piece : registry.pieces_of_group(g)) {
      Status st = elementwise_run(&piece, piece.group_offset, piece.n_elems);
      if (!st.is_ok()) return st.with_context(registry.params()[piece.param].name);
    }
    return Status::ok();
  }
  return elementwise_run(nullptr, begin, std::min(count, registry.sub_groups()[g].n_elems - begin));
}

template <class Config>
Status check_own(std::string_view op, const UpdateArgs& args, const Config& config,
                 Status (*check)(std::string_view, const Config&)) {
  if (args.step < 1)
    return invalid_argument(std::string(op) + ": step must be ≥ 1 (1-based), got " + std::to_string(args.step));
  ZO_RETURN_IF_ERROR(check(op, config));
  if (!std::isfinite(args.grad_scale))
    return invalid_argument(std::string(op) + ": grad_scale must be finite, got " + std::to_string(args.grad_scale));
  return Status::ok();
}

}  // namespace

OptimizerHyperparameters optimizer_hyperparameters(const OptimizerConfig& config, double lr) {
  const auto f = [](double v) { return static_cast<float>(v); };
  switch (config.type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW: break;
    case OptimizerType::kLion:
      return cpu_optim::LionConfig{.lr = f(lr),
                                   .beta1 = f(config.betas[0]),
                                   .beta2 = f(config.betas[1]),
                                   .weight_decay = f(config.weight_decay)};
    case OptimizerType::kAdagrad:
      return cpu_optim::AdagradConfig{.lr = f(lr), .eps = f(config.eps), .weight_decay = f(config.weight_decay)};
  }
  return cpu_optim::AdamConfig{.lr = f(lr),
                               .beta1 = f(config.betas[0]),
                               .beta2 = f(config.betas[1]),
                               .eps = f(config.eps),
                               .weight_decay = f(config.weight_decay),
                               .adam_w_mode = config.type == OptimizerType::kAdamW || config.adam_w_mode,
                               .bias_correction = config.bias_correction};
}

Status check_update_args(std::string_view op, OptimizerType optimizer, const UpdateArgs& args) {
  const OptimizerHyperparameters& h = args.hyperparameters;
  switch (family(optimizer)) {
    case Family::kAdam:
      if (const auto* c = std::get_if<cpu_optim::AdamConfig>(&h))
        return check_adam_hyperparameters(op, *c, args.step, args.grad_scale);
      break;
    case Family::kLion:
      if (const auto* c = std::get_if<cpu_optim::LionConfig>(&h))
        return check_own(op, args, *c, &cpu_optim::check_lion_config);
      break;
    case Family::kAdagrad:
      if (const auto* c = std::get_if<cpu_optim::AdagradConfig>(&h))
        return check_own(op, args, *c, &cpu_optim::check_adagrad_config);
      break;
  }
  static constexpr const char* kStructs[] = {"AdamConfig", "LionConfig", "AdagradConfig"};
  return invalid_argument(std::string(op) + ": optimizer.type " + std::string(to_string(optimizer)) +
                          " stepped with the hyperparameters of another optimizer (" + kStructs[h.index()] + ")");
}

Result<SubGroupStep> SubGroupStep::create(OptimizerType optimizer, const Placement& placement, bool on_device,
                                          uint64_t norm_run_elems) {
  SubGroupStep s;
  s.moments_ = placement.moments;
  s.master_dtype_ = placement.master_dtype;
  s.grad_dtype_ = placement.grad_dtype;
  s.compute_dtype_ = placement.compute_dtype;
  s.norm_run_elems_ = norm_run_elems;
  const Family f = family(optimizer);
  s.main_ = find_row(f, placement.moments, placement.master_dtype, placement.grad_dtype);
  s.small_ = placement.moments == MomentDtype::k8bit
                 ? find_row(f, MomentDtype::kF32, placement.master_dtype, placement.grad_dtype)
                 : s.main_;
  const std::string name(to_string(optimizer));
  if (s.main_ == nullptr || s.small_ == nullptr)
    return unavailable("optimizer.type " + name + ": no kernel steps moment_dtype " +
                       std::string(moment_dtype_name(placement.moments)) + " with " +
                       std::string(dtype_name(placement.master_dtype)) + " masters and " +
                       std::string(dtype_name(placement.grad_dtype)) + " gradients");
  if (on_device && (s.main_->device == nullptr || s.small_->device == nullptr))
    return unavailable("optimizer.type " + name +
                       ": runs on the CPU only (the device's optimizer kernel is Adam's); set "
                       "zero_optimization.offload_optimizer.device to cpu or nvme");
  return s;
}

Status SubGroupStep::update_host(const ParamRegistry& registry, uint32_t g, const UpdateArgs& args,
                                 const HostStates& states, const cpu_optim::Executor& executor,
                                 double* fused_norm) const {
  const uint64_t n = registry.sub_groups()[g].n_elems;
  const RunDtypes d{master_dtype_, DType::kF32, grad_dtype_, compute_dtype_};
  auto cpu = [&](const HostRun& r, const Row& row, DType moment_dtype) {
    RunDtypes rd = d;
    rd.moments = moment_dtype;
    return row.cpu(args, r, rd, executor);
  };
  // Only a fused norm writes the gradient: then it is the caller's writable buffer.
  std::byte* canonical = fused_norm != nullptr ? const_cast<std::byte*>(states.grad) : nullptr;
  const bool one_run = moments_ != MomentDtype::k8bit && master_dtype_ == DType::kF32;
  if (!one_run || canonical == nullptr) {
    if (canonical != nullptr) {  // stepped piece by piece: the norm's pass comes first
      Result<double> sq = cpu_optim::squared_norm_canonical({canonical, grad_dtype_}, n, executor);
      if (!sq.is_ok()) return sq.status();
      *fused_norm = *sq;
    }
    return walk(registry, g, args, states, main_, small_, moments_, master_dtype_, grad_dtype_, compute_dtype_, cpu);
  }
  // Note [Gradients that land where they are summed]: a run of tiles at a time, the norm's pass
  // (which rewrites −0 and signalling NaNs) then the update, which finds the run in cache. The runs
  // start at multiples of kTileElems, so the tile sums are squared_norm's, added in order. Every
  // optimizer here is elementwise, so steps over runs are bit-identical to one over all of it.
  const uint64_t gb = dtype_size_bytes(grad_dtype_);
  std::vector<double> tile_sums((n + cpu_optim::kTileElems - 1) / cpu_optim::kTileElems);
  Status st;
  for (uint64_t begin = 0; begin < n && st.is_ok(); begin += norm_run_elems_) {
    const uint64_t count = std::min(norm_run_elems_, n - begin);
    st = cpu_optim::squared_norm_canonical_tiles({canonical + begin * gb, grad_dtype_}, count,
                                                 std::span<double>(tile_sums).subspan(begin / cpu_optim::kTileElems),
                                                 executor);
    if (st.is_ok())
      st = walk(registry, g, args, states, main_, small_, moments_, master_dtype_, grad_dtype_, compute_dtype_, cpu,
                begin, count);
  }
  double sum = 0.0;
  for (double t : tile_sums) sum += t;
  *fused_norm = sum;
  return st;
}

Status SubGroupStep::update_device(const ParamRegistry& registry, uint32_t g, const UpdateArgs& args,
                                   const DeviceStates& states, gpu::Device& device, gpu::Stream stream) const {
  const RunDtypes d{master_dtype_, DType::kF32, grad_dtype_, compute_dtype_};
  auto queue = [&](const DeviceRun& r, const Row& row, DType moment_dtype) {
    RunDtypes rd = d;
    rd.moments = moment_dtype;
    return row.device(args, r, rd, device, stream);
  };
  return walk(registry, g, args, states, main_, small_, moments_, master_dtype_, grad_dtype_, compute_dtype_, queue);
}

}  // namespace zo::engine
