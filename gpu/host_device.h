// HostDevice: a GPU emulated in host memory, always built, so everything above gpu/ is testable
// without one. Each stream is a real worker thread that runs its queue in order, so copies and
// kernels are genuinely asynchronous and missing synchronisation shows up as wrong data in tests;
// events work across streams; the device byte budget is enforced exactly as on CudaDevice; bytes
// moved are counted per direction. Thread-safe like every Device. New device allocations are
// filled with 0xFF bytes (NaN as fp32/bf16/fp16), so reading memory nobody wrote shows.
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

class HostDevice final : public Device {
 public:
  // budget_bytes > 0 (InvalidArgument otherwise).
  static Result<std::unique_ptr<HostDevice>> create(uint64_t budget_bytes);
  // Waits for all queued work on every stream, stops the workers and releases all memory that
  // was not freed (device, pinned; registrations are dropped).
  ~HostDevice() override;

  DeviceKind kind() const override { return DeviceKind::kHost; }
  std::string name() const override { return "host (emulated)"; }

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
  // For the optimizer kernels (gpu/optim_kernels.h): queues `work` on `stream`'s worker thread, to
  // run after everything queued on it before; the allocation table their range checks read.
  void enqueue(Stream stream, std::function<void()> work);
  const detail::Accounting& accounting() const;
  // For tests (gpu/test_hooks.h): occupies `stream` for at least `duration_us` (its worker sleeps).
  Status delay(Stream stream, uint32_t duration_us);

  struct State;

 private:
  explicit HostDevice(std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

}  // namespace zo::gpu
