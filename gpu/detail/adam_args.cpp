#include "gpu/detail/adam_args.h"

#include <cstdint>
#include <limits>
#include <string>

#include "common/adam_math.h"

namespace zo::gpu::detail {
namespace {

struct Range {
  const char* name;
  uintptr_t begin;
  uint64_t size_bytes;
  uint64_t align;  // the size of the element the kernels read there
};

bool known(DType d) { return static_cast<unsigned>(d) <= static_cast<unsigned>(DType::kF16); }

// The parameters' dtype rules common to both steps: fp32, or bf16 masters whose copy-out (if any)
// is bf16 (it gets the master's bits).
Status check_params(const char* op, DType param_dtype, bool copy, DType copy_dtype) {
  if (param_dtype != DType::kF32 && param_dtype != DType::kBF16)
    return invalid_argument(std::string(op) + ": param_dtype must be fp32 or bf16, got " +
                            std::string(dtype_name(param_dtype)));
  if (param_dtype == DType::kBF16 && copy && copy_dtype != DType::kBF16)
    return invalid_argument(std::string(op) +
                            ": bf16 masters copy out their own bits, so copy_dtype must be bf16, got " +
                            std::string(dtype_name(copy_dtype)));
  return Status::ok();
}

// Each range inside one live allocation, aligned to its element (a misaligned fp32 absmax is a CUDA
// fault, not a slow read), no two overlapping.
Status check_ranges(const Accounting& acct, const char* op, const Range* ranges, int n_ranges) {
  for (int i = 0; i < n_ranges; ++i) {
    const Range& r = ranges[i];
    if (r.begin % r.align != 0)
      return invalid_argument(std::string(op) + ": " + r.name + " is not " + std::to_string(r.align) +
                              "-byte aligned (address " + std::to_string(r.begin) + ")");
    ZO_RETURN_IF_ERROR(acct.check_range(reinterpret_cast<const void*>(r.begin), r.size_bytes,
                                        (std::string(op) + " " + r.name).c_str()));
  }
  for (int i = 0; i < n_ranges; ++i)
    for (int j = i + 1; j < n_ranges; ++j) {
      const Range& a = ranges[i];
      const Range& b = ranges[j];
      if (a.begin < b.begin + b.size_bytes && b.begin < a.begin + a.size_bytes)
        return invalid_argument(std::string(op) + ": " + a.name + " and " + b.name + " overlap");
    }
  return Status::ok();
}

uintptr_t at(DevicePtr p) { return reinterpret_cast<uintptr_t>(p.addr); }

}  // namespace

Status check_adam_args(const Accounting& acct, const DeviceAdamArgs& args) {
  ZO_RETURN_IF_ERROR(check_adam_hyperparameters("adam_step", args.config, args.step, args.grad_scale));
  for (DType d : {args.grad_dtype, args.copy_dtype, args.param_dtype, args.moment_dtype})
    if (!known(d))
      return invalid_argument("adam_step: unknown dtype value " + std::to_string(static_cast<unsigned>(d)));
  ZO_RETURN_IF_ERROR(check_params("adam_step", args.param_dtype, static_cast<bool>(args.copy_out), args.copy_dtype));
  if (args.moment_dtype != DType::kF32 && args.moment_dtype != DType::kBF16)
    return invalid_argument("adam_step: moment_dtype must be fp32 or bf16, got " +
                            std::string(dtype_name(args.moment_dtype)));
  const uint64_t n = args.n_elems;
  if (n == 0) return Status::ok();
  if (n > std::numeric_limits<uint64_t>::max() / 4)
    return invalid_argument("adam_step: n_elems = " + std::to_string(n) + " is too large");
  const uint64_t mb = dtype_size_bytes(args.moment_dtype);
  const uint64_t ps = dtype_size_bytes(args.param_dtype), gs = dtype_size_bytes(args.grad_dtype),
                 cs = dtype_size_bytes(args.copy_dtype);
  const Range ranges[5] = {{"params", at(args.params), n * ps, ps},
                           {"exp_avg", at(args.exp_avg), n * mb, mb},
                           {"exp_avg_sq", at(args.exp_avg_sq), n * mb, mb},
                           {"grad", at(args.grad), n * gs, gs},
                           {"copy_out", at(args.copy_out), n * cs, cs}};
  return check_ranges(acct, "adam_step", ranges, args.copy_out ? 5 : 4);
}

Status check_adam8bit_args(const Accounting& acct, const DeviceAdam8bitArgs& args) {
  ZO_RETURN_IF_ERROR(check_adam_hyperparameters("adam8bit_step", args.config, args.step, args.grad_scale));
  for (DType d : {args.grad_dtype, args.copy_dtype, args.param_dtype})
    if (!known(d))
      return invalid_argument("adam8bit_step: unknown dtype value " + std::to_string(static_cast<unsigned>(d)));
  ZO_RETURN_IF_ERROR(
      check_params("adam8bit_step", args.param_dtype, static_cast<bool>(args.copy_out), args.copy_dtype));
  const uint64_t n = args.n_elems;
  if (n == 0) return Status::ok();
  if (n > std::numeric_limits<uint64_t>::max() / 4)
    return invalid_argument("adam8bit_step: n_elems = " + std::to_string(n) + " is too large");
  const uint64_t absmax_bytes = (n + 255) / 256 * 4;
  const uint64_t ps = dtype_size_bytes(args.param_dtype), gs = dtype_size_bytes(args.grad_dtype),
                 cs = dtype_size_bytes(args.copy_dtype);
  const Range ranges[7] = {{"params", at(args.params), n * ps, ps},          {"m_codes", at(args.m_codes), n, 1},
                           {"m_absmax", at(args.m_absmax), absmax_bytes, 4}, {"v_codes", at(args.v_codes), n, 1},
                           {"v_absmax", at(args.v_absmax), absmax_bytes, 4}, {"grad", at(args.grad), n * gs, gs},
                           {"copy_out", at(args.copy_out), n * cs, cs}};
  return check_ranges(acct, "adam8bit_step", ranges, args.copy_out ? 7 : 6);
}

AdamElementArgs element_args(const DeviceAdamArgs& a) {
  const auto d = [](DType t) { return static_cast<uint8_t>(t); };
  return {.params = a.params.addr,
          .param_dtype = d(a.param_dtype),
          .sr_key = a.sr_key,
          .sr_first = a.sr_first,
          .exp_avg = a.exp_avg.addr,
          .exp_avg_sq = a.exp_avg_sq.addr,
          .moment_dtype = d(a.moment_dtype),
          .grad = a.grad.addr,
          .grad_dtype = d(a.grad_dtype),
          .copy = a.copy_out.addr,
          .copy_dtype = d(a.copy_dtype)};
}

Adam8bitElementArgs element_args(const DeviceAdam8bitArgs& a) {
  const auto d = [](DType t) { return static_cast<uint8_t>(t); };
  return {.params = a.params.addr,
          .param_dtype = d(a.param_dtype),
          .sr_key = a.sr_key,
          .sr_first = a.sr_first,
          .m_codes = static_cast<uint8_t*>(a.m_codes.addr),
          .m_absmax = static_cast<float*>(a.m_absmax.addr),
          .v_codes = static_cast<uint8_t*>(a.v_codes.addr),
          .v_absmax = static_cast<float*>(a.v_absmax.addr),
          .grad = a.grad.addr,
          .grad_dtype = d(a.grad_dtype),
          .copy = a.copy_out.addr,
          .copy_dtype = d(a.copy_dtype)};
}

}  // namespace zo::gpu::detail
