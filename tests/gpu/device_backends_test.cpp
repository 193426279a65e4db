// Every backend that exists here through the same checks (suite gpu). CUDA is skipped, with the
// probe's reason, where no GPU is usable; HostDevice always runs and is the reference the CUDA
// results are held to (both must equal cpu_optim's scalar conversions bit for bit).
#include <gtest/gtest.h>

#include "tests/gpu/device_conformance.h"

namespace zo::gpu {
namespace {

using test::DeviceConformance;

INSTANTIATE_TEST_SUITE_P(AllBackends, DeviceConformance, ::testing::Values(DeviceKind::kHost, DeviceKind::kCuda),
                         test::KindName());

}  // namespace
}  // namespace zo::gpu
