// Another library's streams (LibTorch's, for the trainer's blocks), beside the Device interface
// rather than in it: the device's own streams are Device's; these functions order its events
// against streams it did not create, and time the work another library queues there. The trainer
// is the caller (engine/train: BlockRunner, ActivationStore, GradientPath). Thread-safe like Device.
//
// `native_stream` is the backend's own handle: on CUDA a cudaStream_t, such as LibTorch's current
// stream (nullptr is CUDA's legacy default stream). HostDevice has no foreign streams — the host
// computes synchronously — so it takes nullptr only and refuses anything else with
// InvalidArgument, doing nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/status.h"
#include "gpu/device.h"

namespace zo::gpu {

// Queues `event` on `native_stream`: a device stream can then wait for another library's kernels
// without blocking the host. HostDevice: nullptr completes the event at once.
Status record_foreign(Device& device, Event event, void* native_stream);

// The converse: makes `native_stream` wait, without blocking the host, until the event's latest
// record — as of this call — completes, so another library's kernels can consume what a device
// stream produced. HostDevice: nullptr (the host's synchronous compute) blocks the calling thread
// until then. An event never recorded counts as complete.
Status wait_foreign(Device& device, void* native_stream, Event event);

// Calls `queue`, which queues work of `kind` (a copy of `size_bytes`, or compute: 0) on
// `native_stream`, and times that work as the device runs it: it counts in Device::busy() and,
// while the trace records, is a span of the trace's device tracks (trace::Track::kCopyH2D,
// kCopyD2H, kDeviceCompute). Returns queue's Status. HostDevice: the work runs inside queue, on
// the calling thread; with a stream other than nullptr queue is not called.
// `name` names a compute span ("forward of model.layers.3"); copies' spans are named by the
// periods they merge into ("<n> copies, <bytes>").
Status foreign_work(Device& device, DeviceWork kind, uint64_t size_bytes, void* native_stream, const std::string& name,
                    const std::function<Status()>& queue);

}  // namespace zo::gpu
