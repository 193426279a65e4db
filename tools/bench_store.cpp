#include "tools/bench_store.h"

#include <algorithm>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <vector>

#include "engine/config/io_settings.h"
#include "tools/bench_util.h"

namespace zo::tools {

Result<std::unique_ptr<BenchStore>> BenchStore::create(const engine::Config& config,
                                                       const engine::ParamRegistry& registry,
                                                       const engine::MemoryPlan& plan) {
  auto b = std::make_unique<BenchStore>();
  ZO_ASSIGN_OR_RETURN(b->device, gpu::make_device(gpu::DeviceKind::kHost, plan.device_bytes + (uint64_t{1} << 30)));
  ZO_ASSIGN_OR_RETURN(io::IoOptions io_options, engine::io_options_from_config(config));
  ZO_ASSIGN_OR_RETURN(b->io, io::IoEngine::create(io_options));
  ZO_ASSIGN_OR_RETURN(b->executor,
                      cpu_optim::Executor::create({.n_threads = static_cast<int>(config.zoffload.optimizer_threads),
                                                   .bind_cores = config.zoffload.bind_cores}));
  engine::StateStoreOptions so;
  so.optimizer_nvme_path = config.zero.offload_optimizer.nvme_path;
  so.param_nvme_path = config.zero.offload_param.nvme_path;
  so.pinned_cap_bytes = config.zoffload.pinned_memory_limit;
  so.env = io::Env::posix();
  ZO_ASSIGN_OR_RETURN(b->store, engine::StateStore::create(registry, plan, *b->device, *b->io, so, b->accounting));
  return b;
}

Status BenchStore::init_weights(const std::function<void(uint64_t done, uint64_t total)>& progress) {
  const engine::ParamRegistry& reg = store->registry();
  const uint64_t chunk = uint64_t{1} << 22;
  std::vector<float> values(chunk);
  uint64_t done = 0;
  for (const auto& p : reg.params()) {
    for (uint64_t off = 0; off < p.n_elems; off += chunk) {
      const uint64_t n = std::min(chunk, p.n_elems - off);
      random_fill(values.data(), DType::kF32, n, 1000 + p.id * 7919 + off, -0.05f, 0.05f, *executor);
      Status st = store->init_param(p.id, off, std::span<const float>(values.data(), n));
      if (!st.is_ok()) return st.with_context("initialising " + p.name);
      done += n;
    }
    if (progress) progress(done, reg.total_elems());
  }
  return Status::ok();
}

Result<nlohmann::json> read_bench_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) return invalid_argument(path + ": cannot read the file");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return invalid_argument(path + ": not a JSON object (run `zoffload config check` for details)");
  return j;
}

Result<engine::Config> parse_bench_config(const nlohmann::json& j, const engine::ResolveContext& ctx) {
  engine::ConfigDiagnostics diag;
  std::optional<engine::Config> c = engine::parse_config_json(j, ctx, &diag);
  if (c) return *c;
  std::string msg = "the benchmark's config is invalid:";
  for (const auto& e : diag.errors) msg += "\n  " + e.to_string();
  return invalid_argument(msg);
}

}  // namespace zo::tools
