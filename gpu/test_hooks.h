// Device operations for tests and benchmarks only, kept out of the Device interface: they exist to
// expose ordering, not to train. Thread-safe like Device.
#pragma once

#include <cstdint>

#include "common/status.h"
#include "gpu/device.h"

namespace zo::gpu {

// Occupies `stream` of `device` for at least `duration_us` microseconds (a sleeping kernel on CUDA,
// a sleeping worker on HostDevice), so that an operation queued after it is visibly late.
Status test_delay(Device& device, Stream stream, uint32_t duration_us);

}  // namespace zo::gpu
