// What the LibTorch zoffload is linked with can do: its version, whether its CUDA backend is
// linked, the CUDA version it was built with and the GPUs it sees (`zoffload info`, the trainer's
// device checks), and the streams the trainer queues copies on. Thread-safe unless a type says
// otherwise. This header includes no LibTorch header (at::Tensor is declared); torch_runtime.cpp does.
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "gpu/device_info.h"

namespace at {
class Tensor;
}

namespace zo::engine {

struct LibTorchInfo {
  std::string version;       // TORCH_VERSION, e.g. "2.11.0"
  bool cuda_linked = false;  // libtorch_cuda is loaded and registered LibTorch's CUDA backend
  std::string cuda_version;  // the CUDA LibTorch was built with, "13.0"; empty when !cuda_linked
  int cuda_devices = 0;      // GPUs LibTorch can use: 0 without a GPU, a driver or cuda_linked
};

LibTorchInfo libtorch_info();

// The GPUs a run can compute on: gpu::probe_gpus(), emptied with the reason when LibTorch cannot use
// them (no CUDA backend linked, or it sees none while the CUDA runtime lists some). train and plan
// choose their device from it (docs/gpu.md), so the two cannot choose differently.
gpu::GpuProbe probe_usable_gpus();

// LibTorch's own allocations (activations, autograd buffers, parameter gradients): the bytes live
// now and the high-water mark since the last reset. On CUDA they are the caching allocator's
// allocated bytes of GPU 0; on the CPU they are counted by a wrapper around LibTorch's CPU allocator,
// installed by the first track_torch_memory(false) (allocations made before it are not counted).
// This is what the planner's activation estimate is measured against (metrics.jsonl
// "torch_peak_bytes"). Thread-safe.
struct TorchMemory {
  uint64_t current_bytes = 0;
  uint64_t peak_bytes = 0;
};
void track_torch_memory(bool cuda);
TorchMemory torch_memory(bool cuda);
void reset_torch_memory_peak(bool cuda);  // peak := current

// The stream LibTorch queues this thread's kernels on, as the backend's handle (a cudaStream_t
// for GPU 0 when `cuda`), for gpu::record_foreign (gpu/foreign_streams.h); nullptr on the CPU, where LibTorch
// computes synchronously.
void* torch_compute_stream(bool cuda);

// While alive, LibTorch queues this thread's work for GPU 0 on a copy stream (one stream from c10's
// pool, the same for the whole process) instead of the compute stream, so copies do not queue
// behind kernels; the previous stream is current again after. Nothing happens on the CPU. The
// caller orders the copy stream after the compute stream (gpu::record_foreign/wait_foreign
// with native_stream()), and passes every tensor the compute stream allocated and the copies read
// to record_use, so LibTorch's caching allocator does not hand its memory to new kernels before
// the copies have read it. Not copyable; one thread.
class TorchCopyStreamScope {
 public:
  explicit TorchCopyStreamScope(bool cuda);
  ~TorchCopyStreamScope();
  TorchCopyStreamScope(const TorchCopyStreamScope&) = delete;
  TorchCopyStreamScope& operator=(const TorchCopyStreamScope&) = delete;
  void* native_stream() const { return native_; }  // nullptr on the CPU
  void record_use(const at::Tensor& tensor) const;

 private:
  bool cuda_ = false;
  void* native_ = nullptr;
  int64_t previous_[3] = {0, 0, 0};  // the previous stream, packed (c10::Stream::pack3)
};

// Dense matmul FLOP/s of LibTorch here (square bf16/fp16/fp32 matmuls on GPU 0 or the CPU threads
// LibTorch uses, best of a few after a warm-up; about a second). The planner's compute speed.
double measure_matmul_flops(DType dtype, bool cuda);

}  // namespace zo::engine
