// The command-line flags that fill a config's "auto" (or absent) keys, as the Hugging Face
// Trainer's arguments fill an Accelerate DeepSpeed config. `zoffload train` and `zoffload config
// check` both register them here, so the two resolve a config the same way and cannot disagree.
// Plain values; not thread-safe (filled by CLI11 during parsing).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "engine/config/config.h"

namespace CLI {
class App;
}

namespace zo::tools {

struct AutoFlags {
  uint64_t micro_batch = 0;   // 0: not given
  uint64_t grad_accum = 0;    // 0: not given
  double lr = 0;              // 0: not given (--lr must be positive)
  double weight_decay = -1;   // < 0: not given
  double max_grad_norm = -1;  // < 0: not given
  int64_t warmup_steps = -1;  // < 0: not given
  std::string precision;      // empty, "bf16", "fp16" or "fp32"
};

// Adds --micro-batch, --grad-accum, --lr, --weight-decay, --max-grad-norm, --warmup-steps and
// --precision to `command`, writing into `*flags` (which must outlive parsing).
void add_auto_flags(CLI::App* command, AutoFlags* flags);

// Copies the given flags into `ctx` (Note [Flags fill the config] in engine/config/config.cpp).
void apply_auto_flags(const AutoFlags& flags, engine::ResolveContext* ctx);

// Loads the config at `path` as `train` and `plan` read it: "auto" resolved from the model's
// hidden size, `steps` (0: not given) and the flags. Prints each warning and error on stderr as
// "PATH: warning|error: ..."; nullopt when there are errors (the caller exits 2).
std::optional<engine::Config> load_config_with_flags(const std::string& path, uint64_t hidden_size, uint64_t steps,
                                                     const AutoFlags& flags, uint64_t world_size = 1);

}  // namespace zo::tools
