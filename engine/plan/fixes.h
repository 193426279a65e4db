// The config changes `zoffload plan` offers when a plan does not fit, and the search for the least
// lossy combination of the lean-state ones (no accumulator, bf16-stored gradients, bf16 or 8-bit
// moments, bf16 masters) that fits where the config puts its states. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config/config.h"
#include "engine/plan/planner.h"

namespace zo::engine {

// Config changes that make a plan with problems fit, each accepted by the config checker and checked
// by planning again; at most `max_fixes` (≥ 1). Single changes in order (the exact ones first, then
// those that round, least lossy first); when no single one fits, pairs, then triples. Then, unless
// already listed, the least lossy combination of the lean-state changes that fits (Note [Lean
// combinations] in fixes.cpp), taking the last place when the list is full. Empty when the
// plan fits or nothing tried helps.
std::vector<PlanFix> suggest_fixes(const PlanInputs& in, size_t max_fixes = 4);

// One candidate change: a name for the user and how it edits the config.
struct ConfigChange {
  std::string change;                  // "zoffload.moment_dtype: bf16", ...
  std::function<bool(Config&)> apply;  // false: does not apply to this config (as already changed)
  // What it does to the numbers: empty for a placement change, which gives the same weights bit for
  // bit (docs/memory.md); else one line on what rounds or sums differently.
  std::string trade;
  bool rounds = false;  // a narrower state: offered after every change that keeps the arithmetic
};

// The lean-state changes that apply to `base` on `world_size` ranks, least lossy first (Note [Lean
// combinations] in fixes.cpp): no gradient accumulators (exact but for an overflowing step
// being applied), then, rounding, the gradients stored in bf16, bf16 moments, 8-bit moments, bf16
// masters. Each takes the other keys its config rules ask for with it (the vertical schedule at
// GAS > 1, bf16.check_grad_overflow false, bf16.bf16_optimizer_states false).
std::vector<ConfigChange> lean_state_changes(const Config& base, uint32_t world_size);

// The keys whose resolved values differ between `base` and `changed`, nested as in a config file:
// the JSON object to merge into the user's config ({"zoffload": {"master_dtype": "bf16"}}).
nlohmann::json changed_keys(const Config& base, const Config& changed);

// What the config checker (parse_config_json on `world_size` ranks) refuses in `changed` and not in
// `base`: one "key.path: message" per key path with an error of its own. Empty: it accepts the
// change. (A config built in code may break a rule the change does not touch; that is not the
// change's to answer for.)
std::vector<std::string> refused_keys(const Config& base, const Config& changed, uint32_t world_size);

// Plans `in` with `chosen` applied in order: the fix, when every change applies, the config checker
// accepts the result and its plan fits; else nullopt. Disk facts follow the changed nvme paths
// unless the user gave them (PlanInputs::disk_free_given).
std::optional<PlanFix> plan_with_changes(const PlanInputs& in, const std::vector<const ConfigChange*>& chosen);

// The least lossy combination of `lean` (lean_state_changes' order) that makes `in` fit, or nullopt:
// at most 2^lean.size() - 1 plans, in the order of Note [Lean combinations].
std::optional<PlanFix> cheapest_lean_fix(const PlanInputs& in, const std::vector<ConfigChange>& lean);

}  // namespace zo::engine
