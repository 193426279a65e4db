// The engine's parts a benchmark steps optimizer states through on the host, no GPU: the emulated
// device, the I/O engine and the executor the config asks for, and the StateStore for a registry
// and plan with its weights initialised to deterministic random values. Shared by
// `zoffload-bench pipeline` and `zoffload-bench host`. Not thread-safe (one benchmark drives it).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "common/status.h"
#include "cpu_optim/executor.h"
#include "engine/config/config.h"
#include "engine/memory/accounting.h"
#include "engine/memory/memory_plan.h"
#include "engine/memory/state_store.h"
#include "gpu/device.h"
#include "io/io_engine.h"

namespace zo::tools {

struct BenchStore {
  std::unique_ptr<gpu::Device> device;
  std::unique_ptr<io::IoEngine> io;
  std::unique_ptr<cpu_optim::Executor> executor;  // zoffload.optimizer_threads, bind_cores
  engine::MemoryAccounting accounting;
  std::unique_ptr<engine::StateStore> store;  // last: destroyed first

  // The device (host, the plan's device bytes and 1 GiB), the I/O engine (the config's aio
  // settings), the executor and the store (the config's nvme paths and pinned_memory_limit).
  // `registry` and `plan` must outlive the result.
  static Result<std::unique_ptr<BenchStore>> create(const engine::Config& config, const engine::ParamRegistry& registry,
                                                    const engine::MemoryPlan& plan);
  // Every param's weights: uniform in [-0.05, 0.05), the same for the same registry on any thread
  // count, streamed into the store 4 Mi elements at a time. progress(done, total) after each param.
  Status init_weights(const std::function<void(uint64_t done, uint64_t total)>& progress = {});
};

// The user's --config file as a JSON object, for a benchmark to lay its own choices over;
// kInvalidArgument naming the file when it cannot be read or is not a JSON object.
Result<nlohmann::json> read_bench_config(const std::string& path);

// `j` parsed by the real config parser; kInvalidArgument listing every error otherwise.
Result<engine::Config> parse_bench_config(const nlohmann::json& j, const engine::ResolveContext& ctx);

}  // namespace zo::tools
