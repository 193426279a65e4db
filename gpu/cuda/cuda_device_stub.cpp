// Built instead of cuda_device.cu, cuda_optim_kernels.cu and cuda_quant_kernels.cu when meson decides there is no CUDA
// (gpu/meson.build). No CudaDevice exists in such a build, so nothing below runs but create().
#include "gpu/cuda/cuda_device.h"
#include "gpu/detail/backend_kernels.h"

namespace zo::gpu {
namespace {

Status no_cuda() {
  return unavailable(
      "CudaDevice: zoffload was built without CUDA (meson -Dcuda=enabled needs nvcc and the CUDA toolkit)");
}

}  // namespace

Result<std::unique_ptr<Device>> CudaDevice::create(int device_index, uint64_t budget_bytes) {
  (void)device_index;
  (void)budget_bytes;
  return no_cuda();
}

Status CudaDevice::delay(Stream, uint32_t) { return no_cuda(); }
Status CudaDevice::record_foreign(Event, void*) { return no_cuda(); }
Status CudaDevice::wait_foreign(void*, Event) { return no_cuda(); }
Status CudaDevice::foreign_work(DeviceWork, uint64_t, void*, const std::string&, const std::function<Status()>&) {
  return no_cuda();
}

namespace detail {

const OptimKernels kCudaOptimKernels{
    .adam_step = [](Device&, const DeviceAdamArgs&, Stream) { return no_cuda(); },
    .adam8bit_step = [](Device&, const DeviceAdam8bitArgs&, Stream) { return no_cuda(); },
};

Status cuda_dequantize_packed(Device&, const DequantizePackedArgs&, Stream) { return no_cuda(); }

}  // namespace detail
}  // namespace zo::gpu
