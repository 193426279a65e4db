// HostDevice's optimizer kernels (OptimKernels): the element bodies CudaDevice's kernels run
// (gpu/detail/adam_element.h), as loops on the stream's worker thread.
#include <algorithm>
#include <cstdint>

#include "common/adam_math.h"
#include "common/check.h"
#include "common/dynamic_maps.h"
#include "gpu/detail/adam_args.h"
#include "gpu/detail/adam_element.h"
#include "gpu/detail/backend_kernels.h"
#include "gpu/host_device.h"

namespace zo::gpu::detail {
namespace {

HostDevice& host(Device& device) {
  ZO_CHECK(device.kind() == DeviceKind::kHost) << "HostDevice's kernels on " << device.name();
  return static_cast<HostDevice&>(device);
}

Status adam_step(Device& device, const DeviceAdamArgs& args, Stream stream) {
  HostDevice& dev = host(device);
  ZO_RETURN_IF_ERROR(check_adam_args(dev.accounting(), args));
  if (args.n_elems == 0) return Status::ok();
  const AdamConstants k = adam_constants(args.config, args.step, args.grad_scale);
  dev.enqueue(stream, [a = element_args(args), n = args.n_elems, k] {
    for (uint64_t i = 0; i < n; ++i) adam_element(k, a, i);
  });
  return Status::ok();
}

Status adam8bit_step(Device& device, const DeviceAdam8bitArgs& args, Stream stream) {
  HostDevice& dev = host(device);
  ZO_RETURN_IF_ERROR(check_adam8bit_args(dev.accounting(), args));
  if (args.n_elems == 0) return Status::ok();
  const Adam8bitConstants k = adam8bit_constants(args.config, args.step, args.grad_scale);
  dev.enqueue(stream, [a = element_args(args), n = args.n_elems, k] {
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
  return Status::ok();
}

}  // namespace

const OptimKernels kHostOptimKernels{.adam_step = &adam_step, .adam8bit_step = &adam8bit_step};

}  // namespace zo::gpu::detail
