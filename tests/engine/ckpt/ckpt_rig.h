// A StateStore over real swap files for checkpoint tests: a small model with odd shapes, a chosen
// placement and sub-group size, states filled with values that are a function of (seed, state,
// element) so any two stores can be compared. Test-only; not thread-safe.
#pragma once

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/half.h"
#include "engine/config/config.h"
#include "engine/memory/moment_layout.h"
#include "engine/memory/memory_plan.h"
#include "engine/memory/state_store.h"
#include "gpu/device.h"
#include "io/fault_injector.h"
#include "io/io_engine.h"
#include "tests/engine/test_config.h"

namespace zo::engine::testing {

struct Placing {
  std::string optimizer = "nvme";  // offload_optimizer.device: none (device), cpu, nvme
  std::string param = "cpu";       // offload_param.device
  uint64_t sub_group_size = 8192;
  std::string precision = "bf16";  // bf16, fp16 or fp32 compute
  uint32_t stage = 3;              // zero_optimization.stage (offload_param needs 3)
  std::string moments = "fp32";    // zoffload.moment_dtype
};

// Odd sizes: params split over sub-groups, tails that are not multiples of 4 KiB.
inline std::vector<ParamSpec> rig_model(uint64_t scale = 1) {
  return {{"model.embed_tokens.weight", {static_cast<int64_t>(37 * scale), 53}},
          {"model.layers.0.mlp.up_proj.weight", {3, static_cast<int64_t>(7000 * scale)}},
          {"model.layers.0.input_layernorm.weight", {5000}},
          {"model.layers.0.self_attn.q_proj.bias", {1}},
          {"model.layers.0.mlp.down_proj.weight", {12288}},
          {"model.norm.weight", {4099}},
          {"lm_head.weight", {777}}};
}

inline Config rig_config(const Placing& p, const std::string& nvme_dir) {
  const std::string precision =
      p.precision == "fp32" ? ""
                            : R"("fp16": {"enabled": )" + std::string(p.precision == "fp16" ? "true" : "false") +
                                  R"(}, "bf16": {"enabled": )" + (p.precision == "bf16" ? "true" : "false") + "},";
  const std::string json = R"({"train_micro_batch_size_per_gpu": 1, )" + precision + R"(
    "zero_optimization": {"stage": )" +
                           std::to_string(p.stage) + R"(, "sub_group_size": )" + std::to_string(p.sub_group_size) + R"(,
      "offload_optimizer": {"device": ")" +
                           p.optimizer + R"(", "nvme_path": ")" + nvme_dir + R"("},
      "offload_param": {"device": ")" +
                           p.param + R"(", "nvme_path": ")" + nvme_dir + R"(", "max_in_cpu": 0}},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zoffload": {"moment_dtype": ")" +
                           p.moments + R"("}})";
  return parse_test_config(json);
}

// The value of element i of `kind` in generation `gen`: distinct per state, exact in fp32.
inline float rig_value(uint64_t gen, StateKind kind, uint64_t i) {
  const uint64_t h = (i * 2654435761u + gen * 40503u + static_cast<uint64_t>(kind) * 977u) % 100003u;
  const float v = static_cast<float>(h) / 4096.0f - 12.0f;
  return kind == StateKind::kExpAvgSq ? v * v : v;
}

struct Rig {
  std::string nvme_dir;
  Config config;
  ParamRegistry registry;
  MemoryPlan plan;
  std::unique_ptr<gpu::Device> device;
  std::shared_ptr<io::FaultInjector> faults = std::make_shared<io::FaultInjector>();
  std::unique_ptr<io::IoEngine> io;
  MemoryAccounting accounting;
  std::unique_ptr<StateStore> store;

  // With n_partitions > 1: rank `rank` of a data-parallel run, holding the optimizer states of its
  // partition only (its swap files under rank<r>).
  Status init(const Placing& p, const std::string& dir, uint64_t scale = 1, uint32_t n_partitions = 1,
              uint32_t rank = 0) {
    nvme_dir = dir;
    config = rig_config(p, dir);
    ZO_ASSIGN_OR_RETURN(registry, ParamRegistry::build(rig_model(scale), config.zero.sub_group_size, n_partitions));
    ZO_ASSIGN_OR_RETURN(plan,
                        plan_memory(config, registry, n_partitions > 1 ? std::optional<uint32_t>(rank) : std::nullopt));
    ZO_ASSIGN_OR_RETURN(device, gpu::make_device(gpu::DeviceKind::kHost, uint64_t{256} << 20));
    ZO_ASSIGN_OR_RETURN(io, io::IoEngine::create(io::IoOptions{}, faults));
    StateStoreOptions o;
    o.optimizer_nvme_path = dir;
    o.param_nvme_path = dir;
    o.rank = rank;
    o.env = io::Env::posix();
    ZO_ASSIGN_OR_RETURN(store, StateStore::create(registry, plan, *device, *io, o, accounting));
    return Status::ok();
  }

  // Sets master, exp_avg and exp_avg_sq of every element to generation `gen`'s values and the
  // compute copies to the master rounded (as the optimizer leaves them). Partitioned: the optimizer
  // states (and, at stage 3, the compute copies) of the rank's own sub-groups.
  // With 8-bit moments, each code and absmax is likewise a function of (gen, state, param, element
  // or block), whatever the sub-group size; bf16 moments are those values rounded to bf16.
  Status fill(uint64_t gen) {
    for (const SubGroup& g : registry.sub_groups()) {
      for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        if (kind != StateKind::kMaster && plan.placement.moments == MomentDtype::k8bit) {
          if (plan.owns(g.index)) ZO_RETURN_IF_ERROR(store->write_state(g.index, kind, moment8(gen, kind, g)));
          continue;
        }
        if (kind != StateKind::kMaster && plan.placement.moments == MomentDtype::kBF16) {
          std::vector<uint16_t> h(g.n_elems);
          for (uint64_t i = 0; i < g.n_elems; ++i) h[i] = float_to_bf16(rig_value(gen, kind, g.first_elem + i));
          if (plan.owns(g.index)) ZO_RETURN_IF_ERROR(store->write_state(g.index, kind, std::as_bytes(std::span(h))));
          continue;
        }
        std::vector<float> v(g.n_elems);
        for (uint64_t i = 0; i < g.n_elems; ++i) v[i] = rig_value(gen, kind, g.first_elem + i);
        if (plan.owns(g.index)) ZO_RETURN_IF_ERROR(store->write_state(g.index, kind, std::as_bytes(std::span(v))));
        if (kind == StateKind::kMaster && plan.holds(g.index, StateKind::kCompute))
          ZO_RETURN_IF_ERROR(store->write_compute_from_master(g.index, 0, v));
      }
    }
    return Status::ok();
  }

  // Sub-group g's 8-bit moment of generation `gen` in the store's layout.
  std::vector<std::byte> moment8(uint64_t gen, StateKind kind, const SubGroup& g) const {
    const MomentLayout layout = moment_layout(registry, g.index);
    std::vector<std::byte> out(layout.total_bytes);
    for (const MomentPiece& mp : layout.pieces) {
      const ParamPiece& piece = *mp.piece;
      const uint64_t key = uint64_t{piece.param} << 32;
      if (!mp.quantized) {
        for (uint64_t i = 0; i < piece.n_elems; ++i) {
          const float v = rig_value(gen, kind, g.first_elem + piece.group_offset + i);
          std::memcpy(out.data() + mp.aux_offset_bytes + 4 * i, &v, 4);
        }
        continue;
      }
      for (uint64_t i = 0; i < piece.n_elems; ++i) {
        const float v = rig_value(gen, kind, key + piece.param_offset + i);
        out[mp.codes_offset_bytes + i] = static_cast<std::byte>(static_cast<uint32_t>(v * 4096.0f) & 0xff);
      }
      for (uint64_t b = 0; b < mp.aux_bytes / 4; ++b) {
        const float v = std::abs(rig_value(gen, kind, key + (uint64_t{1} << 31) + piece.param_offset / 256 + b));
        std::memcpy(out.data() + mp.aux_offset_bytes + 4 * b, &v, 4);
      }
    }
    return out;
  }

  // One state of the whole flat parameter space, in sub-group order. 8-bit moments: per param
  // (in order) its codes then its absmax, or its fp32 moment — independent of the sub-groups.
  std::vector<std::byte> gather(StateKind kind) {
    if (kind != StateKind::kMaster && kind != StateKind::kCompute && plan.placement.moments == MomentDtype::k8bit) {
      std::vector<std::vector<std::byte>> codes(registry.params().size()), aux(registry.params().size());
      for (const SubGroup& g : registry.sub_groups()) {
        std::vector<std::byte> part(store->state_bytes(g.index, kind));
        ZO_CHECK(store->read_state(g.index, kind, part).is_ok());
        for (const MomentPiece& mp : moment_layout(registry, g.index).pieces) {
          auto& c = codes[mp.piece->param];
          if (mp.quantized)
            c.insert(c.end(), part.begin() + mp.codes_offset_bytes,
                     part.begin() + mp.codes_offset_bytes + mp.piece->n_elems);
          auto& a = aux[mp.piece->param];
          a.insert(a.end(), part.begin() + mp.aux_offset_bytes, part.begin() + mp.aux_offset_bytes + mp.aux_bytes);
        }
      }
      std::vector<std::byte> out;
      for (size_t p = 0; p < codes.size(); ++p) {
        out.insert(out.end(), codes[p].begin(), codes[p].end());
        out.insert(out.end(), aux[p].begin(), aux[p].end());
      }
      return out;
    }
    std::vector<std::byte> out;
    for (const SubGroup& g : registry.sub_groups()) {
      std::vector<std::byte> part(store->state_bytes(g.index, kind));
      ZO_CHECK(store->read_state(g.index, kind, part).is_ok());
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  }
};

}  // namespace zo::engine::testing
