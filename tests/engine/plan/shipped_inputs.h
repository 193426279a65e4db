// The planner's inputs for a shipped llama3-8b config, shared by the plan tests.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "engine/config/config.h"
#include "engine/model/model_config.h"
#include "engine/plan/planner.h"

namespace zo::engine {

// configs/`file` for llama3-8b at seq 1024 and 1000 steps, on a host with `ram_total` bytes of RAM
// (`ram_available` of them MemAvailable) and no ulimit, a card of `device_total` bytes named
// `device_name`, and LibTorch with CUDA loaded (2 GiB: more than `plan` measures without it, so what
// fits here fits there). nullopt without ZO_SOURCE_DIR (set by meson test) or when the config does
// not load.
inline std::optional<PlanInputs> shipped_llama8b(const std::string& file, uint64_t ram_total, uint64_t ram_available,
                                                 const std::string& device_name, uint64_t device_total) {
  const char* src = std::getenv("ZO_SOURCE_DIR");
  if (src == nullptr) return std::nullopt;
  PlanInputs in;
  in.model = *model_preset("llama3-8b");
  in.model_name = "llama3-8b";
  ResolveContext ctx;
  ctx.hidden_size = in.model.hidden_size;
  ctx.total_steps = 1000;
  ConfigDiagnostics d;
  auto c = load_config_file(std::string(src) + "/configs/" + file, ctx, &d);
  if (!c) return std::nullopt;
  in.config = *c;
  in.seq_len = 1024;
  in.device_budget_bytes = in.config.zoffload.gpu_memory_limit;
  in.host.cuda = true;
  in.host.device_name = device_name;
  in.host.device_total_bytes = device_total;
  in.host.ram_total_bytes = ram_total;
  in.host.ram_available_bytes = ram_available;
  in.host.process_bytes = uint64_t{2} << 30;
  return in;
}

}  // namespace zo::engine
