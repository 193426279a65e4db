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
};

bool known(DType d) { return static_cast<unsigned>(d) <= static_cast<unsigned>(DType::kF16); }

}  // namespace

Status check_adam_args(const Accounting& acct, const DeviceAdamArgs& args) {
  ZO_RETURN_IF_ERROR(check_adam_hyperparameters("adam_step", args.config, args.step, args.grad_scale));
  for (DType d : {args.grad_dtype, args.copy_dtype})
    if (!known(d))
      return invalid_argument("adam_step: unknown dtype value " + std::to_string(static_cast<unsigned>(d)));
  const uint64_t n = args.n_elems;
  if (n == 0) return Status::ok();
  if (n > std::numeric_limits<uint64_t>::max() / 4)
    return invalid_argument("adam_step: n_elems = " + std::to_string(n) + " is too large");
  const auto at = [](DevicePtr p) { return reinterpret_cast<uintptr_t>(p.addr); };
  Range ranges[5] = {{"params", at(args.params), n * 4},
                     {"exp_avg", at(args.exp_avg), n * 4},
                     {"exp_avg_sq", at(args.exp_avg_sq), n * 4},
                     {"grad", at(args.grad), n * dtype_size_bytes(args.grad_dtype)},
                     {"copy_out", at(args.copy_out), n * dtype_size_bytes(args.copy_dtype)}};
  const int n_ranges = args.copy_out ? 5 : 4;
  for (int i = 0; i < n_ranges; ++i) {
    const Range& r = ranges[i];
    ZO_RETURN_IF_ERROR(acct.check_range(reinterpret_cast<const void*>(r.begin), r.size_bytes,
                                        (std::string("adam_step ") + r.name).c_str()));
  }
  for (int i = 0; i < n_ranges; ++i)
    for (int j = i + 1; j < n_ranges; ++j) {
      const Range& a = ranges[i];
      const Range& b = ranges[j];
      if (a.begin < b.begin + b.size_bytes && b.begin < a.begin + a.size_bytes)
        return invalid_argument(std::string("adam_step: ") + a.name + " and " + b.name + " overlap");
    }
  return Status::ok();
}

}  // namespace zo::gpu::detail
