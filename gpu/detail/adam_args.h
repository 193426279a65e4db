// The argument checks of the device's adam_step and adam8bit_step (gpu/optim_kernels.h), shared by
// HostDevice's and CudaDevice's kernels so both accept and reject exactly the same calls.
// Thread-safe (reads the accounting tables under their lock). Internal to gpu/.
#pragma once

#include "common/status.h"
#include "gpu/detail/accounting.h"
#include "gpu/detail/adam_element.h"
#include "gpu/optim_kernels.h"

namespace zo::gpu::detail {

// OK when `args` may be queued: the hyperparameters, step and grad_scale pass
// zo::check_adam_hyperparameters, the dtypes are known, and (for n_elems > 0) each buffer's range
// lies inside one live allocation of `acct` and no two ranges overlap. InvalidArgument naming the
// buffer otherwise.
Status check_adam_args(const Accounting& acct, const DeviceAdamArgs& args);
// The same for adam8bit_step (its buffers' sizes: n codes and ⌈n / 256⌉ absmax per moment).
Status check_adam8bit_args(const Accounting& acct, const DeviceAdam8bitArgs& args);

// The kernels' view of checked arguments (adam_element.h).
AdamElementArgs element_args(const DeviceAdamArgs& args);
Adam8bitElementArgs element_args(const DeviceAdam8bitArgs& args);

}  // namespace zo::gpu::detail
