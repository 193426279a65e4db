// Device: device memory under a byte budget, pinned host memory, streams, events, async copies and
// cast kernels behind opaque handles (no CUDA header leaks); HostDevice and CudaDevice implement it,
// make_device() picks one. Thread-safe: any method from any thread. Memory and handles a Device
// returns are owned by it until the matching free/destroy call, and reclaimed by its destructor.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/dtype.h"
#include "common/status.h"

namespace zo::gpu {

// Element types of cast kernels: zoffload's one DType (common/dtype.h), converted as common/half.h
// defines (round to nearest even), bit for bit like cpu_optim.
using ::zo::DType;
using ::zo::dtype_name;
using ::zo::dtype_size_bytes;

enum class DeviceKind : uint8_t { kAuto = 0, kCuda = 1, kHost = 2 };
std::string_view device_kind_name(DeviceKind kind);  // "auto", "cuda", "host"
// Accepts "auto", "cuda", "host" (case-sensitive); InvalidArgument naming the text otherwise.
Result<DeviceKind> parse_device_kind(std::string_view text);

// Device allocations are aligned to, and accounted in multiples of, this many bytes (the same on
// every backend, so budgets mean the same thing on HostDevice and CudaDevice).
inline constexpr uint64_t kDeviceAlignment = 256;

// An address in device memory. Not dereferenceable on the host (on HostDevice it happens to be a
// host address; code that relies on that is a bug CudaDevice will expose). Offsets are in bytes.
struct DevicePtr {
  void* addr = nullptr;
  explicit operator bool() const { return addr != nullptr; }
  DevicePtr operator+(uint64_t offset_bytes) const { return {static_cast<char*>(addr) + offset_bytes}; }
  friend bool operator==(DevicePtr a, DevicePtr b) { return a.addr == b.addr; }
};

// A queue of operations executed in order. Opaque; valid until destroy_stream() or the Device dies.
struct Stream {
  void* handle = nullptr;
  explicit operator bool() const { return handle != nullptr; }
};

// A marker in a stream's queue that other streams and the host can wait for. Opaque; valid until
// destroy_event() or the Device dies.
struct Event {
  void* handle = nullptr;
  explicit operator bool() const { return handle != nullptr; }
};

// The kinds of work whose time on the device is measured (Device::busy): copies each way, and
// compute that another library queues (gpu::foreign_work, gpu/foreign_streams.h).
enum class DeviceWork : uint8_t { kH2D = 0, kD2H = 1, kCompute = 2 };

// The time the device has spent on each kind of work since it was created, as far as that work has
// completed: per kind, the union of the intervals its operations ran, so two copies at once count
// once (exact on HostDevice; on CUDA, from timing events resolved in queue order, exact when one
// stream carries each kind). Copies: copy_h2d, copy_d2h and foreign_work's; compute:
// foreign_work's only (the device's own kernels, cast and the optimizer's, are not counted).
struct DeviceBusy {
  double h2d_s = 0;
  double d2h_s = 0;
  double compute_s = 0;
};

// Counters since creation. The memory fields are read together under one lock; the moved-bytes
// counters are read separately, so they may be a few operations apart from them.
struct DeviceStats {
  uint64_t budget_bytes = 0;
  uint64_t allocated_bytes = 0;       // device bytes live now (rounded to kDeviceAlignment)
  uint64_t peak_allocated_bytes = 0;  // high-water mark of allocated_bytes
  uint64_t pinned_bytes = 0;          // host bytes from allocate_pinned() live now
  uint64_t registered_bytes = 0;      // host bytes registered with register_host() now
  // Bytes moved per direction, counted when the copy is queued (a copy that is queued runs).
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
  uint64_t d2d_bytes = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual DeviceKind kind() const = 0;  // never kAuto
  // "host (emulated)", "cuda:0 NVIDIA H100 80GB HBM3", ...
  virtual std::string name() const = 0;

  // ---- Device memory (synchronous) ------------------------------------------------------------
  // Allocates `size_bytes` (> 0) of uninitialised device memory aligned to kDeviceAlignment.
  // Fails with kOutOfMemory when the rounded size would take the live total past the budget,
  // naming the requested, in-use and budget bytes; or when the backend itself is out of memory.
  virtual Result<DevicePtr> allocate(uint64_t size_bytes) = 0;
  // Releases an allocation returned by allocate() (its base address). The caller must make sure no
  // queued operation still uses it (synchronize a stream or event first). Unknown address: aborts.
  virtual void free(DevicePtr ptr) = 0;

  // ---- Pinned host memory (synchronous) -------------------------------------------------------
  // Page-locked host memory (4 KiB-aligned, uninitialised) that copies can use asynchronously.
  // kOutOfMemory with the size on failure. The bytes belong to the caller until free_pinned().
  virtual Result<void*> allocate_pinned(uint64_t size_bytes) = 0;
  virtual void free_pinned(void* ptr) = 0;  // unknown pointer: aborts
  // Page-locks caller-owned host memory as one range (a copy may span any part of it), so copies
  // from it are asynchronous. On failure nothing stays registered. The memory stays owned by the
  // caller and must outlive the registration; ranges must not overlap a registered range.
  virtual Status register_host(void* ptr, uint64_t size_bytes) = 0;
  virtual void unregister_host(void* ptr) = 0;  // `ptr` as passed to register_host; unknown: aborts

  // ---- Streams and events ---------------------------------------------------------------------
  virtual Result<Stream> create_stream() = 0;
  // Waits for the stream's queued work, then destroys it.
  virtual void destroy_stream(Stream stream) = 0;
  // Blocks the calling thread until everything queued on `stream` (or, with no argument, on every
  // stream) has completed; returns the first asynchronous error the backend reported.
  virtual Status synchronize(Stream stream) = 0;
  virtual Status synchronize() = 0;

  virtual Result<Event> create_event() = 0;
  virtual void destroy_event(Event event) = 0;  // may be called while a recorded wait is pending
  // Queues the event on `stream`: it completes when everything queued on `stream` before it has.
  // Re-recording moves the event; waits already queued keep waiting for the record they saw.
  virtual Status record(Event event, Stream stream) = 0;
  // The device's busy time so far (DeviceBusy). Never blocks. HostDevice counts work in progress
  // up to now; CUDA counts work once its timing events have completed.
  virtual DeviceBusy busy() = 0;
  // Makes `stream` wait (without blocking the host) until the event's latest record — as of this
  // call — completes. An event never recorded counts as complete.
  virtual Status wait(Stream stream, Event event) = 0;
  // Blocks the calling thread until the event's latest record completes.
  virtual Status synchronize(Event event) = 0;
  // true if the event's latest record has completed (or it was never recorded); never blocks.
  virtual Result<bool> query(Event event) = 0;

  // ---- Asynchronous operations ----------------------------------------------------------------
  // Each call validates its arguments (device ranges must lie inside one live allocation:
  // InvalidArgument otherwise, and nothing is queued), queues the work on `stream` and returns at
  // once; the work runs after everything queued before it on that stream — on the GPU for
  // CudaDevice, on the stream's worker thread for HostDevice — and its completion is observed
  // only through synchronize/record/query. Host buffers stay owned by the caller and must stay
  // valid until the work completes; pin or register them, or CUDA stages the copy and may block.
  virtual Status copy_h2d(DevicePtr dst, const void* src, uint64_t size_bytes, Stream stream) = 0;
  virtual Status copy_d2h(void* dst, DevicePtr src, uint64_t size_bytes, Stream stream) = 0;
  virtual Status copy_d2d(DevicePtr dst, DevicePtr src, uint64_t size_bytes, Stream stream) = 0;
  virtual Status fill_zero(DevicePtr dst, uint64_t size_bytes, Stream stream) = 0;
  // Converts `n_elems` elements from src_dtype to dst_dtype (fp32→bf16/fp16 round to nearest even,
  // the 16-bit→fp32 directions are exact; NaN stays NaN, ±inf and denormals are kept as the
  // scalar reference in common/half.h defines). Same dtype copies. src and dst must not overlap.
  virtual Status cast(DevicePtr dst, DType dst_dtype, DevicePtr src, DType src_dtype, uint64_t n_elems,
                      Stream stream) = 0;
  // The optimizer kernels are not methods: each backend has a table of them beside it
  // (gpu/optim_kernels.h), so a new state format adds a kernel there and leaves this interface.
  // Nor is the interop with another library's streams (gpu/foreign_streams.h).

  virtual DeviceStats stats() const = 0;
};

struct GpuProbe;

// Which backend make_device() takes for a requested kind, given what the probe found, and the line
// it logs. kAuto: CUDA when the probe lists a usable GPU; otherwise the host, logged as a warning
// naming the reason when a GPU is present but unusable (driver too old, runtime mismatch, a
// LibTorch without CUDA: the caller folds that into the probe), at info level when there is none.
// kCuda without a usable GPU: kUnavailable with the reason. Never a silent fallback.
struct DeviceChoice {
  DeviceKind kind = DeviceKind::kHost;  // kHost or kCuda
  bool warn = false;                    // log `message` as a warning, not as information
  std::string message;
};
Result<DeviceChoice> choose_device(DeviceKind kind, const GpuProbe& probe);

// The one place that creates a backend, as choose_device() decides, with `probe` (or
// probe_gpus()) and logging its message. The CUDA device is GPU 0 of the probe. `budget_bytes`
// (> 0) caps device memory; InvalidArgument when 0. A listed GPU that cannot be opened is an error
// even for kAuto.
Result<std::unique_ptr<Device>> make_device(DeviceKind kind, uint64_t budget_bytes);
Result<std::unique_ptr<Device>> make_device(DeviceKind kind, uint64_t budget_bytes, const GpuProbe& probe);

}  // namespace zo::gpu
