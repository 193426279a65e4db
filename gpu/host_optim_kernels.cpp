// HostDevice's optimizer kernels (OptimKernels): the element bodies CudaDevice's kernels run
// (gpu/detail/adam_element.h), as loops on the stream's worker thread.
#include <algorithm>
#include <cstdint>
#include <utility>

#include "common/adam_math.h"
#include "common/check.h"
#include "common/dynamic_maps.h"
#include "gpu/detail/adam_args.h"
#include "gpu/detail/adam_element.h"
#include "gpu/detail/backend_kernels.h"
#include "gpu/host_device.h"

namespace zo::gpu::detail {
namespace {

// Checks `args` as CudaDevice's kernels do and, unless there is nothing to do, queues `work` on the
// stream's worker thread.
template <class Args, class Work>
Status check_and_queue(Device& device, const Args& args, Stream stream, Status (*check)(const Accounting&, const Args&),
                       Work&& work) {
  ZO_CHECK(device.kind() == DeviceKind::kHost) << "HostDevice's kernels on " << device.name();
  auto& host = static_cast<HostDevice&>(device);
  ZO_RETURN_IF_ERROR(check(host.accounting(), args));
  if (args.n_elems == 0) return Status::ok();
  host.enqueue(stream, std::forward<Work>(work));
  return Status::ok();
}

Status adam_step(Device& device, const DeviceAdamArgs& args, Stream stream) {
  const AdamConstants k = adam_constants(args.config, args.step, args.grad_scale);
  return check_and_queue(device, args, stream, &check_adam_args, [a = element_args(args), n = args.n_elems, k] {
    for (uint64_t i = 0; i < n; ++i) adam_element(k, a, i);
  });
}

Status adam8bit_step(Device& device, const DeviceAdam8bitArgs& args, Stream stream) {
  const Adam8bitConstants k = adam8bit_constants(args.config, args.step, args.grad_scale);
  return check_and_queue(device, args, stream, &check_adam8bit_args, [a = element_args(args), n = args.n_elems, k] {
    // Block by block, as CudaDevice's kernel does with one thread block per quantization block.
    constexpr uint64_t kBlock = kQuantBlockElems;
    float m[kBlock], v[kBlock];
    for (uint64_t first = 0; first < n; first += kBlock) {
      const uint64_t count = std::min(kBlock, n - first);
      float m_amax = 0.0f, v_amax = 0.0f;
      for (uint64_t j = 0; j < count; ++j) {
        adam8bit_element(k, a, kSignedDynamicMap.data(), kUnsignedDynamicMap.data(), first + j, m[j], v[j]);
        m_amax = std::max(m_amax, absmax_term(m[j]));
        v_amax = std::max(v_amax, absmax_term(v[j]));
      }
      a.m_absmax[first / kBlock] = m_amax;
      a.v_absmax[first / kBlock] = v_amax;
      for (uint64_t j = 0; j < count; ++j) {
        a.m_codes[first + j] = requantize(kSignedDynamicMap.data(), m[j], m_amax);
        a.v_codes[first + j] = requantize(kUnsignedDynamicMap.data(), v[j], v_amax);
      }
    }
  });
}

}  // namespace

const OptimKernels kHostOptimKernels{.adam_step = &adam_step, .adam8bit_step = &adam8bit_step};

}  // namespace zo::gpu::detail
