#include "engine/dist/world.h"

#include <charconv>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "common/string_util.h"

namespace zo::engine::dist {
namespace {

struct Launcher {
  const char* name;
  const char* size_var;
  const char* rank_var;
  const char* local_rank_var;  // nullptr: the launcher sets none
  const char* local_size_var;
};

constexpr Launcher kLaunchers[] = {
    {"torchrun", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"MPICH/Intel MPI", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"srun", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID", nullptr},
};

// A whole decimal count (digits only: no sign, space or exponent), at most `max`. Stricter than
// zo::parse_count, which takes config values such as "5e8".
bool parse_decimal(std::string_view text, uint64_t max, uint64_t* out) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v > max) return false;
  *out = v;
  return true;
}

}  // namespace

std::string WorldInfo::describe() const {
  if (!distributed()) return "one process";
  return "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " (" + launcher + ")";
}

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

Result<WorldInfo> world_from_env(const EnvLookup& env) {
  WorldInfo w;
  const Launcher* launcher = nullptr;
  for (const Launcher& l : kLaunchers) {
    const std::optional<std::string> v = env(l.size_var);
    if (v && !v->empty()) {
      launcher = &l;
      break;
    }
  }
  if (launcher == nullptr) return w;
  auto count = [&](const char* var, uint64_t max, bool required, uint64_t* out) -> Status {
    const std::optional<std::string> v = env(var);
    if (!v || v->empty()) {
      if (!required) return Status::ok();
      return invalid_argument(std::string(var) + " is not set, but " + launcher->size_var + " is (" + launcher->name +
                              "): both are needed to know this process's rank");
    }
    if (!parse_decimal(*v, UINT64_MAX, out))
      return invalid_argument(std::string(var) + "=" + quote_excerpt(*v, 40) + " (set by " + launcher->name +
                              ") is not a count");
    if (*out > max)
      return invalid_argument(
          std::string(var) + "=" + *v + " (set by " + launcher->name + ") is over " +
          (std::string_view(var) == launcher->size_var
               ? std::string("the ") + std::to_string(max) + " ranks zoffload takes"
               : std::string("the last rank, ") + launcher->size_var + " - 1 = " + std::to_string(max)));
    return Status::ok();
  };
  uint64_t size = 0, rank = 0, local_rank = 0, local_size = 1;
  ZO_RETURN_IF_ERROR(count(launcher->size_var, 1u << 20, true, &size));
  if (size == 0)
    return invalid_argument(std::string(launcher->size_var) + "=0 (set by " + launcher->name + "): no process to run");
  w.launcher = launcher->name;
  w.world_size = static_cast<uint32_t>(size);
  if (size == 1) return w;
  ZO_RETURN_IF_ERROR(count(launcher->rank_var, size - 1, true, &rank));
  ZO_RETURN_IF_ERROR(count(launcher->local_rank_var, size - 1, false, &local_rank));
  if (launcher->local_size_var != nullptr)
    ZO_RETURN_IF_ERROR(count(launcher->local_size_var, size, false, &local_size));
  w.rank = static_cast<uint32_t>(rank);
  w.local_rank = static_cast<uint32_t>(local_rank);
  w.local_world_size = static_cast<uint32_t>(std::max<uint64_t>(local_size, 1));

  const std::optional<std::string> addr = env("MASTER_ADDR");
  const std::optional<std::string> port = env("MASTER_PORT");
  const std::string hint = std::string(" (torchrun sets it; with ") + launcher->name +
                           " export it to every process: the host of rank 0 and a free port, e.g. MASTER_ADDR=node0 "
                           "MASTER_PORT=29500)";
  if (!addr || addr->empty()) return invalid_argument(w.describe() + ": MASTER_ADDR is not set" + hint);
  if (!port || port->empty()) return invalid_argument(w.describe() + ": MASTER_PORT is not set" + hint);
  uint64_t p = 0;
  if (!parse_decimal(*port, 65535, &p) || p == 0)
    return invalid_argument(w.describe() + ": MASTER_PORT=" + quote_excerpt(*port, 40) + " is not a port (1-65535)");
  w.master_addr = *addr;
  w.master_port = static_cast<uint16_t>(p);
  const std::optional<std::string> agent = env("TORCHELASTIC_USE_AGENT_STORE");
  w.agent_store = agent && *agent == "True";
  // torchrun restarts its workers with a new TORCHELASTIC_RESTART_COUNT against the same store.
  w.store_prefix = "zoffload/" + env("TORCHELASTIC_RESTART_COUNT").value_or("0") + "/";
  return w;
}

Result<std::optional<std::string>> visible_device_for_rank(const WorldInfo& world,
                                                           const std::optional<std::string>& cuda_visible_devices) {
  if (!world.distributed()) return std::optional<std::string>();
  if (!cuda_visible_devices) return std::optional<std::string>(std::to_string(world.local_rank));
  const std::vector<std::string> list = split(*cuda_visible_devices, ',');
  if (list.size() <= 1) return std::optional<std::string>();  // bound by the launcher, or no GPU at all
  if (world.local_rank >= list.size())
    return invalid_argument(world.describe() + " is local rank " + std::to_string(world.local_rank) +
                            " of its node, but CUDA_VISIBLE_DEVICES=" + quote_excerpt(*cuda_visible_devices, 80) +
                            " lists " + std::to_string(list.size()) + " GPUs: start at most one process per GPU");
  return std::optional<std::string>(list[world.local_rank]);
}

}  // namespace zo::engine::dist
