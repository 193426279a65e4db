// CudaDevice: the Device interface on a CUDA GPU — a caching cudaMalloc pool under the byte
// budget, cudaHostAlloc / cudaHostRegister (in chunks) for pinned memory, cudaStream/cudaEvent,
// cudaMemcpyAsync and CUDA cast kernels that reuse common/half.h bit for bit.
// Thread-safe like every Device. No CUDA header here: the CUDA state lives behind State.
// Include only from gpu/ (make_device() is the public way in). In builds without CUDA the class
// is not defined and create() (gpu/cuda/cuda_device_stub.cpp) returns kUnavailable.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/status.h"
#include "gpu/device.h"

namespace zo::gpu {

namespace detail {
class Accounting;
}  // namespace detail

class CudaDevice final : public Device {
 public:
  // Opens CUDA device `device_index` with a budget of `budget_bytes` (> 0). kUnavailable when
  // the build has no CUDA or the runtime cannot use the device (the runtime's error in the text).
  static Result<std::unique_ptr<Device>> create(int device_index, uint64_t budget_bytes);
  // Synchronises the device, then releases every allocation, pinned buffer, registration,
  // stream and event still alive.
  ~CudaDevice() override;

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override;

  Result<DevicePtr> allocate(uint64_t size_bytes) override;
  void free(DevicePtr ptr) override;
  Result<void*> allocate_pinned(uint64_t size_bytes) override;
  void free_pinned(void* ptr) override;
  Status register_host(void* ptr, uint64_t size_bytes) override;
  void unregister_host(void* ptr) override;

  Result<Stream> create_stream() override;
  void destroy_stream(Stream stream) override;
  Status synchronize(Stream stream) override;
  Status synchronize() override;
  Result<Event> create_event() override;
  void destroy_event(Event event) override;
  Status record(Event event, Stream stream) override;
  DeviceBusy busy() override;
  Status wait(Stream stream, Event event) override;
  Status synchronize(Event event) override;
  Result<bool> query(Event event) override;

  Status copy_h2d(DevicePtr dst, const void* src, uint64_t size_bytes, Stream stream) override;
  Status copy_d2h(void* dst, DevicePtr src, uint64_t size_bytes, Stream stream) override;
  Status copy_d2d(DevicePtr dst, DevicePtr src, uint64_t size_bytes, Stream stream) override;
  Status fill_zero(DevicePtr dst, uint64_t size_bytes, Stream stream) override;
  Status cast(DevicePtr dst, DType dst_dtype, DevicePtr src, DType src_dtype, uint64_t n_elems, Stream stream) override;

  DeviceStats stats() const override;

  // ---- Beside the Device interface ------------------------------------------------------------
  // For gpu/foreign_streams.h, which documents them.
  Status record_foreign(Event event, void* native_stream);
  Status wait_foreign(void* native_stream, Event event);
  Status foreign_work(DeviceWork kind, uint64_t size_bytes, void* native_stream, const std::string& name,
                      const std::function<Status()>& queue);
  // For the optimizer kernels (gpu/optim_kernels.h): makes this device current on the calling
  // thread and returns the CUDA stream (a cudaStream_t) behind `stream`; the allocation table their
  // range checks read.
  Result<void*> kernel_stream(Stream stream);
  const detail::Accounting& accounting() const;
  // For tests (gpu/test_hooks.h): occupies `stream` for at least `duration_us` (a sleeping kernel).
  Status delay(Stream stream, uint32_t duration_us);

  struct State;

 private:
  explicit CudaDevice(std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

}  // namespace zo::gpu
