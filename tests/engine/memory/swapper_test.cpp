// StateStore, OptimizerSwapper and ParamSwapper over real swap files (a temp dir under /tmp),
// HostDevice and the real I/O engine: states round-trip through every tier, a step is bit-identical
// wherever the states live and equal to cpu_optim::adam_step on whole params, budgets hold, I/O
// faults are reported with their sub-group, file and offset and tear the store, and the parameter
// swapper returns exact compute bytes from bounded buffers.
#include "engine/memory/optimizer_swapper.h"
#include "engine/memory/param_swapper.h"
#include "engine/memory/state_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <numeric>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <thread>
#include <string>
#include <vector>

#include "common/half.h"
#include "cpu_optim/adagrad.h"
#include "cpu_optim/adam.h"
#include "cpu_optim/adam8bit.h"
#include "cpu_optim/lion.h"
#include "cpu_optim/vector_ops.h"
#include "engine/config/config.h"
#include "gpu/device.h"
#include "io/env.h"
#include "io/fault_injector.h"
#include "io/io_engine.h"
#include "tests/engine/file_bytes.h"
#include "tests/engine/temp_dir.h"
#include "tests/engine/test_config.h"

namespace zo::engine {
namespace {

using ::testing::HasSubstr;
using Bytes = std::vector<std::byte>;

constexpr uint64_t kDefaultBudget = uint64_t{64} << 20;

// What a test varies; everything else is fixed.
struct Placing {
  std::string optimizer = "none";  // offload_optimizer.device
  std::string param = "none";      // offload_param.device
  bool pipeline_read = false;
  bool pipeline_write = false;
  bool pin_optimizer = true;
  bool pin_param = true;
  bool bf16 = true;           // compute dtype bf16, else fp32
  std::string grad = "fp32";  // data_types.grad_accum_dtype
  uint64_t max_in_cpu = 1'000'000'000;
  uint64_t param_buffer_count = 3;
  std::string optimizer_type = "AdamW";
  std::string accumulators = "auto";  // zoffload.gradient_accumulators
  std::string moments = "fp32";       // zoffload.moment_dtype
  uint64_t read_ahead = 0;            // zoffload.optimizer_read_ahead

  std::string describe() const {
    return "optimizer " + optimizer + " accumulators " + accumulators + " param " + param + " read " +
           std::to_string(pipeline_read) + " write " + std::to_string(pipeline_write) + " pin " +
           std::to_string(pin_optimizer) + std::to_string(pin_param) + (bf16 ? " bf16" : " fp32") + " grad " + grad +
           " max_in_cpu " + std::to_string(max_in_cpu) + " moments " + moments;
  }
};

std::string b(bool v) { return v ? "true" : "false"; }

Config make_config(const Placing& s, const std::string& dir) {
  std::string json = R"({"train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "sub_group_size": 8192,
      "offload_optimizer": {"device": ")" +
                     s.optimizer + R"(", "nvme_path": ")" + dir + R"(",
        "pipeline_read": )" +
                     b(s.pipeline_read) + R"(, "pipeline_write": )" + b(s.pipeline_write) + R"(, "pin_memory": )" +
                     b(s.pin_optimizer) + R"(},
      "offload_param": {"device": ")" +
                     s.param + R"(", "nvme_path": ")" + dir + R"(",
        "buffer_count": )" +
                     std::to_string(s.param_buffer_count) + R"(, "buffer_size": 100000,
        "max_in_cpu": )" +
                     std::to_string(s.max_in_cpu) + R"(, "pin_memory": )" + b(s.pin_param) + R"(}},
    "gradient_clipping": )" +
                     std::string(s.accumulators == "none" ? "0" : "1.0") + R"(,
    "bf16": {"enabled": )" +
                     b(s.bf16) + R"(, "check_grad_overflow": )" + b(s.accumulators != "none") + R"(},
    "data_types": {"grad_accum_dtype": ")" +
                     s.grad + R"("},
    "optimizer": {"type": ")" +
                     s.optimizer_type + R"(", "params": {"lr": 0.01, "weight_decay": 0.1}},
    "zoffload": {"gradient_accumulators": ")" +
                     s.accumulators + R"(", "moment_dtype": ")" + s.moments + R"(", "optimizer_read_ahead": )" +
                     std::to_string(s.read_ahead) + R"(}})";
  return parse_test_config(json);
}

// Odd sizes: "b" is split over three sub-groups of 8192 elements, "e" over two.
std::vector<ParamSpec> model() {
  return {{"model.a.weight", {37, 53}}, {"model.b.weight", {3, 7000}}, {"model.c.bias", {5000}}, {"model.d.scale", {1}},
          {"model.e.weight", {12288}},  {"model.f.weight", {4099}},    {"model.g.bias", {777}}};
}

AdamConfig adam_of(const Config& c) {
  AdamConfig a;
  a.lr = static_cast<float>(c.optimizer.lr);
  a.beta1 = static_cast<float>(c.optimizer.betas[0]);
  a.beta2 = static_cast<float>(c.optimizer.betas[1]);
  a.eps = static_cast<float>(c.optimizer.eps);
  a.weight_decay = static_cast<float>(c.optimizer.weight_decay);
  a.adam_w_mode = c.optimizer.adam_w_mode;
  a.bias_correction = c.optimizer.bias_correction;
  return a;
}

// What step() is handed for c's optimizer: its own struct, with adam_of's values as the references
// below use them.
OptimizerHyperparameters hyperparameters_of(const Config& c) {
  const AdamConfig h = adam_of(c);
  switch (c.optimizer.type) {
    case OptimizerType::kLion:
      return cpu_optim::LionConfig{.lr = h.lr, .beta1 = h.beta1, .beta2 = h.beta2, .weight_decay = h.weight_decay};
    case OptimizerType::kAdagrad:
      return cpu_optim::AdagradConfig{.lr = h.lr, .eps = h.eps, .weight_decay = h.weight_decay};
    default: return h;
  }
}

// Everything a store needs, built from a Placing.
struct Rig {
  TempDir dir;
  Config config;
  ParamRegistry registry;
  MemoryPlan plan;
  std::unique_ptr<gpu::Device> device;
  std::shared_ptr<io::FaultInjector> faults = std::make_shared<io::FaultInjector>();
  std::unique_ptr<io::IoEngine> io;
  std::unique_ptr<cpu_optim::Executor> executor;
  MemoryAccounting accounting;
  std::unique_ptr<StateStore> store;
  std::vector<uint32_t> frozen_params;  // of model(): made frozen (ParamSpec::trainable false)
  uint64_t sub_group_size = 0;          // 0: the config's 8192

  // Everything up to the plan; the store is created by create_store().
  Status prepare(const Placing& s, uint64_t device_budget = kDefaultBudget) {
    config = make_config(s, dir.path);
    if (sub_group_size != 0) config.zero.sub_group_size = sub_group_size;
    std::vector<ParamSpec> specs = model();
    for (uint32_t p : frozen_params) specs[p].trainable = false;
    ZO_ASSIGN_OR_RETURN(registry, ParamRegistry::build(std::move(specs), config.zero.sub_group_size));
    ZO_ASSIGN_OR_RETURN(plan, plan_memory(config, registry));
    ZO_ASSIGN_OR_RETURN(device, gpu::make_device(gpu::DeviceKind::kHost, device_budget));
    ZO_ASSIGN_OR_RETURN(io, io::IoEngine::create(io::IoOptions{}, faults));
    cpu_optim::ExecutorOptions eo;
    eo.n_threads = 2;
    ZO_ASSIGN_OR_RETURN(executor, cpu_optim::Executor::create(eo));
    return Status::ok();
  }
  StateStoreOptions store_options(uint64_t pinned_cap = 0) const {
    StateStoreOptions o;
    o.optimizer_nvme_path = config.zero.offload_optimizer.nvme_path;
    o.param_nvme_path = config.zero.offload_param.nvme_path;
    o.pinned_cap_bytes = pinned_cap;
    o.env = io::Env::posix();
    return o;
  }
  Status create_store(uint64_t pinned_cap = 0) {
    ZO_ASSIGN_OR_RETURN(store, StateStore::create(registry, plan, *device, *io, store_options(pinned_cap), accounting));
    return Status::ok();
  }
  Status init(const Placing& s, uint64_t device_budget = kDefaultBudget) {
    ZO_RETURN_IF_ERROR(prepare(s, device_budget));
    return create_store();
  }
  DType compute_dtype() const { return plan.placement.compute_dtype; }
  DType grad_dtype() const { return plan.placement.grad_dtype; }
};

uint64_t size_of(DType d) { return dtype_size_bytes(d); }

Bytes to_dtype(const std::vector<float>& values, DType d) {
  Bytes out(values.size() * size_of(d));
  for (size_t i = 0; i < values.size(); ++i) cpu_optim::store_from_float(out.data(), d, i, values[i]);
  return out;
}

Bytes random_bytes(uint64_t n, std::mt19937& rng) {
  Bytes out(n);
  for (auto& x : out) x = static_cast<std::byte>(rng() & 0xff);
  return out;
}

std::vector<float> random_floats(uint64_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> out(n);
  for (auto& x : out) x = dist(rng);
  return out;
}

// Per-param states assembled from the store's sub-groups, or computed by the reference.
struct ParamStates {
  std::vector<Bytes> master, exp_avg, exp_avg_sq, compute;
};

// Gathers one state of every param from the store (through read_state of every sub-group).
std::vector<Bytes> gather(StateStore& store, StateKind kind) {
  const ParamRegistry& reg = store.registry();
  const uint64_t eb = state_elem_bytes(store.plan().placement, kind);
  std::vector<Bytes> out;
  for (const auto& p : reg.params()) out.emplace_back(p.n_elems * eb);
  for (const auto& g : reg.sub_groups()) {
    Bytes buf(store.state_bytes(g.index, kind));
    Status st = store.read_state(g.index, kind, buf);
    ZO_CHECK(st.is_ok()) << st.to_string();
    for (const auto& piece : reg.pieces_of_group(g.index)) {
      std::memcpy(out[piece.param].data() + piece.param_offset * eb, buf.data() + piece.group_offset * eb,
                  piece.n_elems * eb);
    }
  }
  return out;
}

// Scatters per-param bytes of one state into the store's sub-groups (write_state of every one).
Status scatter(StateStore& store, StateKind kind, const std::vector<Bytes>& per_param) {
  const ParamRegistry& reg = store.registry();
  const uint64_t eb = state_elem_bytes(store.plan().placement, kind);
  for (const auto& g : reg.sub_groups()) {
    Bytes buf(store.state_bytes(g.index, kind));
    for (const auto& piece : reg.pieces_of_group(g.index)) {
      std::memcpy(buf.data() + piece.group_offset * eb, per_param[piece.param].data() + piece.param_offset * eb,
                  piece.n_elems * eb);
    }
    ZO_RETURN_IF_ERROR(store.write_state(g.index, kind, buf));
  }
  return Status::ok();
}

ParamStates gather_all(StateStore& store) {
  return {gather(store, StateKind::kMaster), gather(store, StateKind::kExpAvg), gather(store, StateKind::kExpAvgSq),
          gather(store, StateKind::kCompute)};
}

// Deterministic inputs of a training run: initial weights and the gradients of each step.
struct Inputs {
  std::vector<std::vector<float>> weights;
  std::vector<std::vector<std::vector<float>>> grads;  // [step][param]
};

Inputs make_inputs(int steps) {
  std::mt19937 rng(1234);
  Inputs in;
  for (const auto& spec : model()) {
    uint64_t n = 1;
    for (auto d : spec.shape) n *= static_cast<uint64_t>(d);
    in.weights.push_back(random_floats(n, rng, 0.5f));
  }
  for (int s = 0; s < steps; ++s) {
    in.grads.emplace_back();
    for (const auto& w : in.weights) in.grads.back().push_back(random_floats(w.size(), rng, 1.0f));
  }
  return in;
}

// Streams every param into the store in slices of 1000 elements (unaligned on NVMe).
Status init_all(StateStore& store, const Inputs& in) {
  for (uint32_t p = 0; p < in.weights.size(); ++p) {
    const auto& w = in.weights[p];
    for (uint64_t off = 0; off < w.size(); off += 1000) {
      const uint64_t n = std::min<uint64_t>(1000, w.size() - off);
      ZO_RETURN_IF_ERROR(store.init_param(p, off, std::span<const float>(w.data() + off, n)));
    }
  }
  return Status::ok();
}

constexpr float kGradScale = 0.5f;

// cpu_optim::adam_step on whole params (adam_step_bf16_moments with bf16 moments): what every
// placement must reproduce bit for bit.
ParamStates reference_run(const Inputs& in, const AdamConfig& adam, DType compute, DType grad, int steps,
                          DType moments = DType::kF32) {
  auto ex = cpu_optim::Executor::create({});
  ZO_CHECK(ex.is_ok());
  const size_t mb = dtype_size_bytes(moments);
  ParamStates r;
  for (const auto& w : in.weights) {
    r.master.emplace_back(w.size() * 4);
    std::memcpy(r.master.back().data(), w.data(), w.size() * 4);
    r.exp_avg.emplace_back(w.size() * mb);
    r.exp_avg_sq.emplace_back(w.size() * mb);
    r.compute.push_back(to_dtype(w, compute));
  }
  for (int s = 0; s < steps; ++s) {
    for (size_t p = 0; p < in.weights.size(); ++p) {
      const size_t n = in.weights[p].size();
      Bytes g = to_dtype(in.grads[s][p], grad);
      const std::span<float> master{reinterpret_cast<float*>(r.master[p].data()), n};
      const cpu_optim::ConstElemSpan gs{g.data(), grad};
      const cpu_optim::ElemSpan out{r.compute[p].data(), compute};
      Status st =
          moments == DType::kBF16
              ? cpu_optim::adam_step_bf16_moments(
                    adam, s + 1, master, {reinterpret_cast<uint16_t*>(r.exp_avg[p].data()), n},
                    {reinterpret_cast<uint16_t*>(r.exp_avg_sq[p].data()), n}, gs, kGradScale, out, **ex)
              : cpu_optim::adam_step(adam, s + 1, master, {reinterpret_cast<float*>(r.exp_avg[p].data()), n},
                                     {reinterpret_cast<float*>(r.exp_avg_sq[p].data()), n}, gs, kGradScale, out, **ex);
      ZO_CHECK(st.is_ok()) << st.to_string();
    }
  }
  return r;
}

Status write_grads(Rig& rig, const Inputs& in, int step) {
  std::vector<Bytes> g;
  for (const auto& v : in.grads[step]) g.push_back(to_dtype(v, rig.grad_dtype()));
  return scatter(*rig.store, StateKind::kGradAccum, g);
}

OptimizerStepArgs step_args(const Rig& rig, int step) {
  OptimizerStepArgs a;
  a.hyperparameters = hyperparameters_of(rig.config);
  a.step = step;
  a.grad_scale = kGradScale;
  return a;
}

// Runs `steps` optimizer steps of `s` and returns every param's final states, as `gather` reads them.
ParamStates engine_run(const Placing& s, const Inputs& in, int steps, ParamStates (*gather)(StateStore&) = gather_all) {
  Rig rig;
  Status st = rig.init(s);
  ZO_CHECK(st.is_ok()) << s.describe() << ": " << st.to_string();
  st = init_all(*rig.store, in);
  ZO_CHECK(st.is_ok()) << st.to_string();
  auto swapper = OptimizerSwapper::create(*rig.store, *rig.executor, PipelineOptions::from_config(rig.config));
  ZO_CHECK(swapper.is_ok()) << swapper.status().to_string();
  for (int i = 0; i < steps; ++i) {
    st = write_grads(rig, in, i);
    ZO_CHECK(st.is_ok()) << st.to_string();
    auto report = (*swapper)->step(step_args(rig, i + 1));
    ZO_CHECK(report.is_ok()) << s.describe() << ": " << report.status().to_string();
    ZO_CHECK_EQ(report->sub_groups, rig.plan.n_sub_groups);
  }
  return gather(*rig.store);
}

void expect_same(const ParamStates& got, const ParamStates& want, const std::string& what) {
  ASSERT_EQ(got.master.size(), want.master.size());
  for (size_t p = 0; p < want.master.size(); ++p) {
    EXPECT_TRUE(got.master[p] == want.master[p]) << what << ": master of param " << p;
    EXPECT_TRUE(got.exp_avg[p] == want.exp_avg[p]) << what << ": exp_avg of param " << p;
    EXPECT_TRUE(got.exp_avg_sq[p] == want.exp_avg_sq[p]) << what << ": exp_avg_sq of param " << p;
    EXPECT_TRUE(got.compute[p] == want.compute[p]) << what << ": compute of param " << p;
  }
}

// ---- 1. Round trips -----------------------------------------------------------------------------

std::vector<Placing> tier_setups() {
  std::vector<Placing> out;
  Placing s;
  out.push_back(s);  // everything on the device
  s.optimizer = "cpu";
  s.param = "cpu";
  out.push_back(s);  // pinned CPU
  s.pin_optimizer = s.pin_param = false;
  out.push_back(s);  // pageable CPU
  s = Placing{};
  s.optimizer = "nvme";
  s.param = "nvme";
  s.max_in_cpu = 0;
  out.push_back(s);  // NVMe
  return out;
}

TEST(StateStore, StatesStartZeroedInEveryTier) {
  for (const Placing& s : tier_setups()) {
    SCOPED_TRACE(s.describe());
    Rig rig;
    ASSERT_TRUE(rig.init(s).is_ok());
    for (const auto& g : rig.registry.sub_groups()) {
      for (int k = 0; k < kNumStateKinds; ++k) {
        const auto kind = static_cast<StateKind>(k);
        Bytes buf(rig.store->state_bytes(g.index, kind), std::byte{0x5a});
        ASSERT_TRUE(rig.store->read_state(g.index, kind, buf).is_ok());
        EXPECT_TRUE(std::all_of(buf.begin(), buf.end(), [](std::byte x) { return x == std::byte{0}; }))
            << "sub-group " << g.index << " " << state_name(kind);
      }
    }
  }
}

TEST(StateStore, ReusedSwapFilesStartZeroedToo) {
  // The swap files of a previous run are reused with their contents ignored: never-written regions
  // must read as zeros (Note [Zero watermark]) although the bytes on disk are not.
  Placing s;
  s.optimizer = "nvme";
  s.param = "nvme";
  s.max_in_cpu = 0;
  Rig rig;
  ASSERT_TRUE(rig.prepare(s).is_ok());
  StateStoreOptions keep = rig.store_options();
  keep.remove_swap_files_on_close = false;
  std::mt19937 rng(11);
  for (int run = 0; run < 2; ++run) {
    auto store = StateStore::create(rig.registry, rig.plan, *rig.device, *rig.io, keep, rig.accounting);
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    for (const auto& g : rig.registry.sub_groups()) {
      for (int k = 0; k < kNumStateKinds; ++k) {
        const auto kind = static_cast<StateKind>(k);
        Bytes buf(std::max<uint64_t>((*store)->state_bytes(g.index, kind), 1), std::byte{0x5a});
        buf.resize((*store)->state_bytes(g.index, kind));
        ASSERT_TRUE((*store)->read_state(g.index, kind, buf).is_ok());
        EXPECT_TRUE(std::all_of(buf.begin(), buf.end(), [](std::byte x) { return x == std::byte{0}; }))
            << "run " << run << " sub-group " << g.index << " " << state_name(kind);
        ASSERT_TRUE((*store)->write_state(g.index, kind, random_bytes(buf.size(), rng)).is_ok());
      }
    }
  }
}

// The swap files are created through StateStoreOptions::env: a fault injected when one is opened
// fails create() naming the file, and leaves no swap file behind.
TEST(StateStore, SwapFilesAreOpenedThroughTheOptionsEnv) {
  Placing s;
  s.optimizer = "nvme";
  s.param = "nvme";
  s.max_in_cpu = 0;
  Rig rig;
  ASSERT_TRUE(rig.prepare(s).is_ok());
  io::FaultyEnv env(io::Env::posix(), rig.faults);
  StateStoreOptions o = rig.store_options();
  o.env = &env;
  for (const char* name : {"optimizer.swp", "param.swp"}) {
    SCOPED_TRACE(name);
    rig.faults->add({.kind = io::FaultKind::kEio, .op = io::IoOp::kOpen, .path_contains = name});
    auto store = StateStore::create(rig.registry, rig.plan, *rig.device, *rig.io, o, rig.accounting);
    ASSERT_FALSE(store.is_ok());
    EXPECT_EQ(store.status().code(), StatusCode::kIoError) << store.status().to_string();
    EXPECT_THAT(store.status().message(), HasSubstr("open " + swap_dir(rig.dir.path, 0) + "/" + name + " (injected)"));
    EXPECT_FALSE(std::filesystem::exists(swap_dir(rig.dir.path, 0) + "/" + name));
  }
  EXPECT_EQ(rig.faults->injected(), 2u);
  auto store = StateStore::create(rig.registry, rig.plan, *rig.device, *rig.io, o, rig.accounting);
  ASSERT_TRUE(store.is_ok()) << "the rules are used up: " << store.status().to_string();
  EXPECT_TRUE(std::filesystem::exists((*store)->optimizer_file()->path()));
}

TEST(StateStore, WriteStateReadsBackBitExactInEveryTier) {
  for (const Placing& s : tier_setups()) {
    SCOPED_TRACE(s.describe());
    Rig rig;
    ASSERT_TRUE(rig.init(s).is_ok());
    ASSERT_GT(rig.plan.n_sub_groups, 4u);
    std::mt19937 rng(7);
    std::vector<std::vector<Bytes>> written(kNumStateKinds);
    for (int k = 0; k < kNumStateKinds; ++k) {
      for (const auto& g : rig.registry.sub_groups()) {
        written[k].push_back(random_bytes(rig.store->state_bytes(g.index, static_cast<StateKind>(k)), rng));
        ASSERT_TRUE(rig.store->write_state(g.index, static_cast<StateKind>(k), written[k].back()).is_ok());
      }
    }
    for (int k = 0; k < kNumStateKinds; ++k) {
      for (const auto& g : rig.registry.sub_groups()) {
        Bytes buf(written[k][g.index].size());
        ASSERT_TRUE(rig.store->read_state(g.index, static_cast<StateKind>(k), buf).is_ok());
        EXPECT_TRUE(buf == written[k][g.index])
            << "sub-group " << g.index << " " << state_name(static_cast<StateKind>(k));
      }
    }
    // A wrong size is refused.
    Bytes small(3);
    EXPECT_EQ(rig.store->read_state(0, StateKind::kMaster, small).code(), StatusCode::kInvalidArgument);
  }
}

// A state whose size is not a whole number of 4 KiB pages ends mid-page; the rest of that page is
// its region's padding, never read as the state. A write that ends at the state's end zeroes the
// padding instead of reading the page back (Note [Bytes per step] in planner.cpp counts no such
// read), so the padding on disk is zero whatever was there and whatever the store's scratch held,
// and a write of the whole state reads nothing. Checked on the file's bytes as the OS returns them.
TEST(StateStore, AWriteEndingAtAStatesEndZeroesThePaddingOfItsLastPageUnread) {
  Placing s;
  s.optimizer = "nvme";
  s.accumulators = "nvme";
  Rig rig;
  ASSERT_TRUE(rig.init(s).is_ok());
  ASSERT_NE(rig.store->optimizer_file(), nullptr);
  const std::string path = rig.store->optimizer_file()->path();
  // A sub-group ending mid-page, and one larger than its padded region: reading the larger one
  // leaves the scratch holding nonzero bytes where the smaller one's padding would be.
  std::optional<uint32_t> odd, large;
  for (const auto& g : rig.registry.sub_groups()) {
    const uint64_t bytes = rig.store->state_bytes(g.index, StateKind::kMaster);
    if (!odd && bytes % kSwapAlignment != 0) odd = g.index;
  }
  ASSERT_TRUE(odd.has_value()) << "no sub-group of the test model ends mid-page";
  for (const auto& g : rig.registry.sub_groups()) {
    if (rig.store->state_bytes(g.index, StateKind::kMaster) >= rig.store->padded_state_bytes(*odd, StateKind::kMaster))
      large = g.index;
  }
  ASSERT_TRUE(large.has_value());
  const uint32_t g = *odd;
  std::mt19937 rng(23);
  const Bytes garbage_byte(1, std::byte{0xa5});
  auto nonzero = [](const Bytes& b, uint64_t from) {
    return std::count_if(b.begin() + static_cast<std::ptrdiff_t>(from), b.end(),
                         [](std::byte x) { return x != std::byte{0}; });
  };
  for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kGradAccum}) {
    SCOPED_TRACE(std::string(state_name(kind)) + " of sub-group " + std::to_string(g));
    ASSERT_EQ(rig.store->location(g, kind).tier, Tier::kNvme);
    const uint64_t size = rig.store->state_bytes(g, kind);
    const uint64_t padded = rig.store->padded_state_bytes(g, kind);
    const SwapRegion region = rig.store->location(g, kind).region;
    ASSERT_EQ(region.size_bytes, padded);
    ASSERT_LT(size, padded);
    // Written once, so that the last page lies below the zero watermark (Note [Zero watermark]): a
    // read-modify-write of it would read the disk. Then garbage in its padding, past the store.
    ASSERT_TRUE(rig.store->write_state(g, kind, random_bytes(size, rng)).is_ok());
    write_file_bytes(path, region.offset_bytes + size, Bytes(padded - size, std::byte{0xa5}));
    ASSERT_EQ(read_file_bytes(path, region.offset_bytes + size, 1), garbage_byte);
    Bytes other(rig.store->state_bytes(*large, kind));
    ASSERT_TRUE(rig.store->write_state(*large, kind, random_bytes(other.size(), rng)).is_ok());
    ASSERT_TRUE(rig.store->read_state(*large, kind, other).is_ok());

    const Bytes want = random_bytes(size, rng);
    const auto before = rig.accounting.snapshot();
    ASSERT_TRUE(rig.store->write_state(g, kind, want).is_ok());
    const auto after = rig.accounting.snapshot();
    EXPECT_EQ(after.nvme_read_bytes - before.nvme_read_bytes, 0u) << "the last page was read back";
    EXPECT_EQ(after.nvme_write_bytes - before.nvme_write_bytes, padded);
    Bytes disk = read_file_bytes(path, region.offset_bytes, padded);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), disk.begin())) << "the state's bytes on disk";
    EXPECT_EQ(nonzero(disk, size), 0) << "of the " << padded - size << " bytes of padding";

    // A range write of the state's last bytes from mid-page reads that page once, for the bytes
    // before the range, and zeroes the padding all the same.
    write_file_bytes(path, region.offset_bytes + size, Bytes(padded - size, std::byte{0xa5}));
    const uint64_t from = size - (size % kSwapAlignment) / 2;
    ASSERT_NE(from % kSwapAlignment, 0u);
    const Bytes tail = random_bytes(size - from, rng);
    const auto before_tail = rig.accounting.snapshot();
    ASSERT_TRUE(rig.store->write_state_range(g, kind, from, tail).is_ok());
    const auto after_tail = rig.accounting.snapshot();
    EXPECT_EQ(after_tail.nvme_read_bytes - before_tail.nvme_read_bytes, kSwapAlignment);
    disk = read_file_bytes(path, region.offset_bytes, padded);
    EXPECT_TRUE(std::equal(want.begin(), want.begin() + static_cast<std::ptrdiff_t>(from), disk.begin()))
        << "the bytes before the range";
    EXPECT_TRUE(std::equal(tail.begin(), tail.end(), disk.begin() + static_cast<std::ptrdiff_t>(from)))
        << "the range's bytes on disk";
    EXPECT_EQ(nonzero(disk, size), 0) << "of the " << padded - size << " bytes of padding";
  }
}

TEST(StateStore, InitParamInSlicesSetsMasterComputeAndZeroesMoments) {
  const Inputs in = make_inputs(0);
  for (const Placing& s : tier_setups()) {
    SCOPED_TRACE(s.describe());
    Rig rig;
    ASSERT_TRUE(rig.init(s).is_ok());
    // Moments made non-zero first, so init_param must really zero them.
    std::mt19937 rng(3);
    for (const auto& g : rig.registry.sub_groups()) {
      for (StateKind kind : {StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        ASSERT_TRUE(
            rig.store->write_state(g.index, kind, random_bytes(rig.store->state_bytes(g.index, kind), rng)).is_ok());
      }
    }
    ASSERT_TRUE(init_all(*rig.store, in).is_ok());
    ParamStates got = gather_all(*rig.store);
    for (size_t p = 0; p < in.weights.size(); ++p) {
      Bytes master(in.weights[p].size() * 4);
      std::memcpy(master.data(), in.weights[p].data(), master.size());
      EXPECT_TRUE(got.master[p] == master) << "param " << p;
      EXPECT_TRUE(got.compute[p] == to_dtype(in.weights[p], rig.compute_dtype())) << "param " << p;
      EXPECT_TRUE(got.exp_avg[p] == Bytes(master.size())) << "param " << p;
      EXPECT_TRUE(got.exp_avg_sq[p] == Bytes(master.size())) << "param " << p;
    }
    // Outside the param: refused.
    const float one = 1.0f;
    EXPECT_EQ(rig.store->init_param(3, 1, {&one, 1}).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(rig.store->init_param(99, 0, {&one, 1}).code(), StatusCode::kInvalidArgument);
  }
}

// read_param_* take turns with the other synchronous transfers (the header's thread-safety): a bf16
// compute copy on the device is read through the store's scratch, which the block gatherer's reads
// of this rank's compute copies use from their thread too. Before the lock, a frozen param read this
// way beside the gatherer came back with the other read's bytes (a CI run of a two-rank test).
TEST(StateStore, ParamReadsTakeTurnsWithTransfersOfOtherThreads) {
  const Inputs in = make_inputs(0);
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());  // everything on the (emulated) device, bf16 compute copies
  ASSERT_TRUE(init_all(*rig.store, in).is_ok());
  const uint32_t param = 1;  // "b", over three sub-groups
  std::vector<float> want(in.weights[param].size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = bf16_to_float(float_to_bf16(in.weights[param][i]));
  const uint32_t other = rig.registry.pieces_of_param(4)[0].sub_group;  // "e": not b's
  std::atomic<bool> stop{false};
  std::atomic<int> other_failures{0};
  std::thread reader([&] {
    Bytes buf(rig.store->state_bytes(other, StateKind::kCompute));
    while (!stop.load())
      if (!rig.store->read_state_range(other, StateKind::kCompute, 0, buf).is_ok()) ++other_failures;
  });
  int wrong = 0;
  std::vector<float> got(want.size());
  for (int i = 0; i < 300; ++i) {
    ASSERT_TRUE(rig.store->read_param_compute(param, 0, got).is_ok());
    wrong += got != want;
  }
  stop = true;
  reader.join();
  EXPECT_EQ(wrong, 0) << "reads of param b that came back with other bytes";
  EXPECT_EQ(other_failures.load(), 0);
}

// ---- 2. The step is the same arithmetic wherever the states live --------------------------------

void check_placements_match_reference(bool bf16, const std::string& grad) {
  constexpr int kSteps = 3;
  const Inputs in = make_inputs(kSteps);
  Placing base;
  base.bf16 = bf16;
  base.grad = grad;
  const Config c = make_config(base, "/tmp");
  const ParamStates want = reference_run(in, adam_of(c), bf16 ? DType::kBF16 : DType::kF32,
                                         grad == "bf16" ? DType::kBF16 : DType::kF32, kSteps);
  std::vector<Placing> setups;
  setups.push_back(base);  // optimizer on the device
  for (const char* param : {"none", "cpu", "nvme"}) {
    Placing s = base;
    s.optimizer = "cpu";
    s.param = param;
    setups.push_back(s);
    for (int rw = 0; rw < 4; ++rw) {
      Placing n = base;
      n.optimizer = "nvme";
      n.param = param;
      n.pipeline_read = rw & 1;
      n.pipeline_write = rw & 2;
      setups.push_back(n);
    }
  }
  // Note [Where the gradients wait]: the accumulators apart from the states, both ways.
  for (const char* param : {"none", "cpu", "nvme"}) {
    Placing s = base;
    s.optimizer = "cpu";
    s.accumulators = "nvme";
    s.param = param;
    setups.push_back(s);
    for (int rw : {0, 3}) {
      Placing n = base;
      n.optimizer = "nvme";
      n.accumulators = "cpu";
      n.param = param;
      n.pipeline_read = rw & 1;
      n.pipeline_write = rw & 2;
      setups.push_back(n);
    }
  }
  Placing mixed = base;  // compute copies split between CPU (max_in_cpu) and NVMe, param "b" straddles
  mixed.optimizer = "nvme";
  mixed.param = "nvme";
  mixed.max_in_cpu = 1961 + 8192;
  mixed.pipeline_read = mixed.pipeline_write = true;
  setups.push_back(mixed);
  mixed.optimizer = "cpu";
  setups.push_back(mixed);
  Placing pageable = base;
  pageable.optimizer = "cpu";
  pageable.param = "cpu";
  pageable.pin_optimizer = pageable.pin_param = false;
  setups.push_back(pageable);
  for (const Placing& s : setups) expect_same(engine_run(s, in, kSteps), want, s.describe());
}

TEST(OptimizerSwapper, Bf16ComputeFp32GradsBitIdenticalEverywhere) { check_placements_match_reference(true, "fp32"); }
TEST(OptimizerSwapper, Bf16ComputeBf16GradsBitIdenticalEverywhere) { check_placements_match_reference(true, "bf16"); }
TEST(OptimizerSwapper, Fp32ComputeBitIdenticalEverywhere) { check_placements_match_reference(false, "fp32"); }

// ---- bf16 moments -------------------------------------------------------------------------------

// bf16 moments (zoffload.moment_dtype "bf16") on every tier the optimizer states use (the device's
// included), split over sub-groups and threads: the per-param reference's bits, moments two bytes
// per element.
TEST(OptimizerSwapperBf16, EveryPlacementEqualsPerTensorStepsBitForBit) {
  constexpr int kSteps = 3;
  const Inputs in = make_inputs(kSteps);
  Placing base;
  base.bf16 = true;
  base.moments = "bf16";
  base.optimizer = "cpu";
  const Config c = make_config(base, "/tmp");
  const ParamStates want = reference_run(in, adam_of(c), DType::kBF16, DType::kF32, kSteps, DType::kBF16);
  std::vector<Placing> setups = {base};
  for (const char* param : {"cpu", "nvme"}) {
    Placing n = base;
    n.param = param;
    n.optimizer = "nvme";
    n.pipeline_read = n.pipeline_write = true;
    setups.push_back(n);
  }
  Placing split = base;
  split.accumulators = "nvme";
  setups.push_back(split);
  Placing device = base;  // the device's adam_step with bf16 moments (HostDevice here)
  device.optimizer = "none";
  setups.push_back(device);
  for (const Placing& s : setups) expect_same(engine_run(s, in, kSteps, gather_all), want, s.describe());
  Rig rig;
  ASSERT_TRUE(rig.init(base).is_ok());
  EXPECT_EQ(rig.plan.placement.moments, MomentDtype::kBF16);
  for (const auto& g : rig.registry.sub_groups())
    EXPECT_EQ(rig.store->state_bytes(g.index, StateKind::kExpAvg), 2 * g.n_elems);
}

// ---- 8-bit moments ------------------------------------------------------------------------------

// One param's 8-bit moment as the test reads it: its codes then its absmax bytes (n ≥ 4096), or
// its fp32 moment.
using Moment8 = Bytes;

// Decodes the moments of every param from the store's sub-groups by the layout docs/memory.md
// states (Note [8-bit moment layout]), written out here on its own: per sub-group, the codes of
// its pieces of params of ≥ 4096 elements in order, zeros to a multiple of 4, then per piece its
// absmax (4 bytes per 256 elements, the last block partial) or its fp32 moment.
std::vector<Moment8> gather8(StateStore& store, StateKind kind) {
  const ParamRegistry& reg = store.registry();
  std::vector<Bytes> codes(reg.params().size()), aux(reg.params().size());
  for (const auto& g : reg.sub_groups()) {
    Bytes buf(store.state_bytes(g.index, kind));
    Status st = store.read_state(g.index, kind, buf);
    ZO_CHECK(st.is_ok()) << st.to_string();
    uint64_t at = 0;
    for (const auto& piece : reg.pieces_of_group(g.index)) {
      if (reg.params()[piece.param].n_elems < 4096) continue;
      codes[piece.param].insert(codes[piece.param].end(), buf.begin() + at, buf.begin() + at + piece.n_elems);
      at += piece.n_elems;
    }
    const uint64_t pad = (4 - at % 4) % 4;
    for (uint64_t i = 0; i < pad; ++i) EXPECT_EQ(buf[at + i], std::byte{0}) << "pad of sub-group " << g.index;
    at += pad;
    for (const auto& piece : reg.pieces_of_group(g.index)) {
      const bool q = reg.params()[piece.param].n_elems >= 4096;
      const uint64_t n = q ? 4 * ((piece.n_elems + 255) / 256) : 4 * piece.n_elems;
      aux[piece.param].insert(aux[piece.param].end(), buf.begin() + at, buf.begin() + at + n);
      at += n;
    }
    EXPECT_EQ(at, buf.size()) << "sub-group " << g.index << " " << state_name(kind);
  }
  std::vector<Moment8> out;
  for (size_t p = 0; p < codes.size(); ++p) {
    out.push_back(codes[p]);
    out.back().insert(out.back().end(), aux[p].begin(), aux[p].end());
  }
  return out;
}

ParamStates gather_all8(StateStore& store) {
  return {gather(store, StateKind::kMaster), gather8(store, StateKind::kExpAvg), gather8(store, StateKind::kExpAvgSq),
          gather(store, StateKind::kCompute)};
}

// Every param's fp32 master and compute copy as initialised, and its two states as the 8-bit layout
// starts them: zeros, n codes and an absmax per 256 (n >= 4096), or an fp32 state.
ParamStates initial_states8(const Inputs& in, DType compute) {
  ParamStates r;
  for (const auto& w : in.weights) {
    const uint64_t n = w.size();
    r.master.emplace_back(n * 4);
    std::memcpy(r.master.back().data(), w.data(), n * 4);
    const uint64_t moment = n >= 4096 ? n + 4 * cpu_optim::quant_block_count(n) : 4 * n;
    r.exp_avg.emplace_back(moment);
    r.exp_avg_sq.emplace_back(moment);
    r.compute.push_back(to_dtype(w, compute));
  }
  return r;
}

// bitsandbytes' per-tensor semantics, one whole param at a time on one thread: adam8bit_step for a
// param of ≥ 4096 elements, fp32 adam_step under that. Every placement's sub-groups (pieces of
// split params, several params per sub-group, two threads) must give these bits.
ParamStates reference_run8(const Inputs& in, const AdamConfig& adam, DType compute, DType grad, int steps) {
  auto ex = cpu_optim::Executor::create({.n_threads = 1});
  ZO_CHECK(ex.is_ok());
  ParamStates r = initial_states8(in, compute);
  for (int s = 0; s < steps; ++s) {
    for (size_t p = 0; p < in.weights.size(); ++p) {
      const size_t n = in.weights[p].size();
      Bytes g = to_dtype(in.grads[s][p], grad);
      const std::span<float> master{reinterpret_cast<float*>(r.master[p].data()), n};
      const cpu_optim::ConstElemSpan gs{g.data(), grad};
      const cpu_optim::ElemSpan out{r.compute[p].data(), compute};
      Status st;
      if (n >= 4096) {
        auto state = [&](Bytes& b) {
          return cpu_optim::BlockwiseState{{reinterpret_cast<uint8_t*>(b.data()), n},
                                           {reinterpret_cast<float*>(b.data() + n), cpu_optim::quant_block_count(n)}};
        };
        st = cpu_optim::adam8bit_step(adam, s + 1, master, state(r.exp_avg[p]), state(r.exp_avg_sq[p]), gs, kGradScale,
                                      out, **ex);
      } else {
        st = cpu_optim::adam_step(adam, s + 1, master, {reinterpret_cast<float*>(r.exp_avg[p].data()), n},
                                  {reinterpret_cast<float*>(r.exp_avg_sq[p].data()), n}, gs, kGradScale, out, **ex);
      }
      ZO_CHECK(st.is_ok()) << st.to_string();
    }
  }
  return r;
}

// The model has params under 4096 elements (a, d, g), quantized ones with a partial last block
// (b, c, f), and ones split over sub-groups (b over three, e over two).
TEST(OptimizerSwapper8bit, EveryPlacementEqualsPerTensorStepsBitForBit) {
  constexpr int kSteps = 4;
  const Inputs in = make_inputs(kSteps);
  for (bool bf16 : {true, false}) {
    Placing base;
    base.bf16 = bf16;
    base.moments = "8bit";
    base.optimizer = "cpu";
    const Config c = make_config(base, "/tmp");
    const ParamStates want = reference_run8(in, adam_of(c), bf16 ? DType::kBF16 : DType::kF32, DType::kF32, kSteps);
    std::vector<Placing> setups;
    for (const char* param : {"none", "cpu", "nvme"}) {
      Placing s = base;
      s.param = param;
      setups.push_back(s);
      for (int rw = 0; rw < 4; ++rw) {
        Placing n = s;
        n.optimizer = "nvme";
        n.pipeline_read = rw & 1;
        n.pipeline_write = rw & 2;
        setups.push_back(n);
      }
    }
    Placing split = base;  // the accumulators apart from the states, both ways
    split.accumulators = "nvme";
    setups.push_back(split);
    split.optimizer = "nvme";
    split.accumulators = "cpu";
    split.pipeline_read = split.pipeline_write = true;
    setups.push_back(split);
    Placing pageable = base;
    pageable.pin_optimizer = pageable.pin_param = false;
    pageable.param = "cpu";
    setups.push_back(pageable);
    Placing device = base;  // the device's adam8bit_step per quantized piece, adam_step per small one
    device.optimizer = "none";
    setups.push_back(device);
    for (const Placing& s : setups) expect_same(engine_run(s, in, kSteps, gather_all8), want, s.describe());
  }
}

// Lion's momentum and Adagrad's sum of squares in 8 bits: per param, as bitsandbytes keeps them,
// lion8bit_step / adagrad8bit_step on a param of >= 4096 elements and the fp32 step under that, the
// state in its own region (exp_avg for Lion, exp_avg_sq for Adagrad) and the other one the zero
// state of the same layout (Note [One moment for Adagrad and Lion]). Every placement's sub-groups
// give these bits.
ParamStates reference_run_one8(const Inputs& in, const AdamConfig& h, bool lion, DType compute, int steps) {
  auto ex = cpu_optim::Executor::create({.n_threads = 1});
  ZO_CHECK(ex.is_ok());
  ParamStates r = initial_states8(in, compute);
  const cpu_optim::LionConfig lc{.lr = h.lr, .beta1 = h.beta1, .beta2 = h.beta2, .weight_decay = h.weight_decay};
  const cpu_optim::AdagradConfig ac{.lr = h.lr, .eps = h.eps, .weight_decay = h.weight_decay};
  for (int s = 0; s < steps; ++s) {
    for (size_t p = 0; p < in.weights.size(); ++p) {
      const size_t n = in.weights[p].size();
      const Bytes g = to_dtype(in.grads[s][p], DType::kF32);
      const std::span<float> master{reinterpret_cast<float*>(r.master[p].data()), n};
      const cpu_optim::ConstElemSpan gs{g.data(), DType::kF32};
      const cpu_optim::ElemSpan out{r.compute[p].data(), compute};
      Bytes& state = lion ? r.exp_avg[p] : r.exp_avg_sq[p];
      Status st;
      if (n >= 4096) {
        const cpu_optim::BlockwiseState b{
            {reinterpret_cast<uint8_t*>(state.data()), n},
            {reinterpret_cast<float*>(state.data() + n), cpu_optim::quant_block_count(n)}};
        st = lion ? cpu_optim::lion8bit_step(lc, master, b, gs, kGradScale, out, **ex)
                  : cpu_optim::adagrad8bit_step(ac, master, b, gs, kGradScale, out, **ex);
      } else {
        const std::span<float> f{reinterpret_cast<float*>(state.data()), n};
        st = lion ? cpu_optim::lion_step(lc, master, f, gs, kGradScale, out, **ex)
                  : cpu_optim::adagrad_step(ac, master, f, gs, kGradScale, out, **ex);
      }
      ZO_CHECK(st.is_ok()) << st.to_string();
    }
  }
  return r;
}

TEST(OptimizerSwapper8bit, LionAndAdagradOnEveryTierEqualPerTensorStepsBitForBit) {
  constexpr int kSteps = 4;
  const Inputs in = make_inputs(kSteps);
  for (const char* type : {"Lion", "Adagrad"}) {
    SCOPED_TRACE(type);
    Placing base;
    base.bf16 = false;
    base.moments = "8bit";
    base.optimizer = "cpu";
    base.optimizer_type = type;
    const Config c = make_config(base, "/tmp");
    const ParamStates want = reference_run_one8(in, adam_of(c), std::string(type) == "Lion", DType::kF32, kSteps);
    std::vector<Placing> setups = {base};
    Placing nvme = base;
    nvme.optimizer = "nvme";
    nvme.param = "nvme";
    nvme.pipeline_read = nvme.pipeline_write = true;
    setups.push_back(nvme);
    Placing split = base;
    split.accumulators = "nvme";
    setups.push_back(split);
    for (const Placing& s : setups) expect_same(engine_run(s, in, kSteps, gather_all8), want, s.describe());
    const ParamStates fp32 = [&] {
      Placing f = base;
      f.moments = "fp32";
      return engine_run(f, in, kSteps);
    }();
    bool differs = false;
    for (size_t p = 0; p < want.master.size(); ++p) differs |= fp32.master[p] != want.master[p];
    EXPECT_TRUE(differs) << "the 8-bit state changes the weights (it ran)";
  }
}

// Both moments take 2.03 bytes per element of a large param: the plan, the store and the swap file
// agree on the closed form.
TEST(OptimizerSwapper8bit, MomentsTakeTheirLayoutsBytesInThePlanAndTheStore) {
  Placing s;
  s.moments = "8bit";
  s.optimizer = "nvme";
  Rig rig;
  ASSERT_TRUE(rig.init(s).is_ok());
  uint64_t codes = 0, aux = 0;
  for (const ParamInfo& p : rig.registry.params()) {
    const uint64_t n = p.n_elems;
    if (n >= 4096) {
      codes += n;
      aux += 4 * ((n + 255) / 256);
    } else {
      aux += 4 * n;
    }
  }
  uint64_t stored = 0, pad = 0;
  for (const auto& g : rig.registry.sub_groups()) {
    const uint64_t bytes = rig.store->state_bytes(g.index, StateKind::kExpAvg);
    EXPECT_EQ(bytes, rig.store->state_bytes(g.index, StateKind::kExpAvgSq));
    stored += bytes;
    uint64_t group_codes = 0;
    for (const auto& piece : rig.registry.pieces_of_group(g.index))
      if (rig.registry.params()[piece.param].n_elems >= 4096) group_codes += piece.n_elems;
    pad += (4 - group_codes % 4) % 4;
  }
  EXPECT_EQ(stored, codes + pad + aux);
  EXPECT_EQ(rig.plan.placement.moments, MomentDtype::k8bit);
}

// Adagrad and Lion step on the CPU; with the states on the device (which config check refuses
// already) the swapper refuses too, naming the optimizer and the way out.
// Note [Frozen sub-groups]: with params "b" (split over three sub-groups) and "e" (two) frozen, the
// store holds only their compute copies on every tier, the optimizer steps the other sub-groups
// alone (stored and direct), and every trainable param ends bit for bit as per-tensor Adam leaves
// it, the frozen ones as they started.
TEST(OptimizerSwapperFrozen, FrozenSubGroupsKeepTheirComputeCopyAndAreNeverStepped) {
  constexpr int kSteps = 3;
  const std::vector<uint32_t> frozen = {1, 4};
  const Inputs in = make_inputs(kSteps);
  std::vector<Placing> setups = tier_setups();
  Placing piped;
  piped.optimizer = piped.param = "nvme";
  piped.pipeline_read = piped.pipeline_write = true;
  setups.push_back(piped);
  Placing grads_on_nvme;
  grads_on_nvme.optimizer = "cpu";
  grads_on_nvme.accumulators = "nvme";
  grads_on_nvme.moments = "bf16";
  setups.push_back(grads_on_nvme);
  for (const std::string tier : {"cpu", "nvme"}) {  // no accumulators: every step direct
    Placing direct;
    direct.optimizer = tier;
    direct.accumulators = "none";
    setups.push_back(direct);
  }
  for (const Placing& s : setups) {
    SCOPED_TRACE(s.describe());
    Rig rig;
    rig.frozen_params = frozen;
    ASSERT_TRUE(rig.init(s).is_ok());
    const ParamRegistry& reg = rig.registry;
    std::vector<char> is_frozen(reg.params().size(), 0);
    for (uint32_t p : frozen) is_frozen[p] = 1;
    uint32_t n_frozen = 0;
    for (const SubGroup& g : reg.sub_groups()) {
      for (const ParamPiece& piece : reg.pieces_of_group(g.index)) ASSERT_EQ(!g.trainable, is_frozen[piece.param]);
      n_frozen += g.trainable ? 0 : 1;
    }
    ASSERT_EQ(n_frozen, 5u);
    ASSERT_EQ(rig.plan.stepped.size(), reg.sub_groups().size() - n_frozen);
    ASSERT_TRUE(init_all(*rig.store, in).is_ok());
    // Only the compute copy of a frozen sub-group exists; asking for another state says so.
    for (const SubGroup& g : reg.sub_groups()) {
      if (g.trainable) continue;
      Bytes buf(rig.store->state_bytes(g.index, StateKind::kCompute));
      EXPECT_TRUE(rig.store->read_state(g.index, StateKind::kCompute, buf).is_ok());
      Bytes master(g.n_elems * 4);
      Status st = rig.store->read_state(g.index, StateKind::kMaster, master);
      EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
      EXPECT_THAT(st.message(), HasSubstr("the sub-group is frozen"));
    }
    auto swapper = OptimizerSwapper::create(*rig.store, *rig.executor, PipelineOptions::from_config(rig.config));
    ASSERT_TRUE(swapper.is_ok()) << swapper.status().to_string();
    const bool direct = s.accumulators == "none";
    const uint64_t eb = dtype_size_bytes(rig.grad_dtype());
    // The trainable sub-group g's gradient of step i.
    auto grad_of = [&](const SubGroup& g, int i) {
      Bytes buf(g.n_elems * eb);
      for (const ParamPiece& piece : reg.pieces_of_group(g.index)) {
        const Bytes v = to_dtype(in.grads[i][piece.param], rig.grad_dtype());
        std::memcpy(buf.data() + piece.group_offset * eb, v.data() + piece.param_offset * eb, piece.n_elems * eb);
      }
      return buf;
    };
    for (int i = 0; i < kSteps; ++i) {
      if (!direct) {
        for (const SubGroup& g : reg.sub_groups())
          if (g.trainable) ASSERT_TRUE(rig.store->write_state(g.index, StateKind::kGradAccum, grad_of(g, i)).is_ok());
        auto report = (*swapper)->step(step_args(rig, i + 1));
        ASSERT_TRUE(report.is_ok()) << report.status().to_string();
        EXPECT_EQ(report->sub_groups, rig.plan.stepped.size());
        continue;
      }
      // Without accumulators (Note [No accumulator]): every sub-group offered in the order, the
      // frozen ones dropped from it, the trainable ones stepped as their gradients come.
      std::vector<uint32_t> order(reg.sub_groups().size());
      for (uint32_t g = 0; g < order.size(); ++g) order[g] = g;
      Status begun = (*swapper)->begin_direct(step_args(rig, i + 1), order);
      ASSERT_TRUE(begun.is_ok()) << begun.to_string();
      for (const SubGroup& g : reg.sub_groups()) {
        if (!g.trainable) continue;
        const Bytes grad = grad_of(g, i);
        ASSERT_TRUE((*swapper)->step_direct(g.index, grad.data()).is_ok());
      }
      auto report = (*swapper)->end_direct();
      ASSERT_TRUE(report.is_ok()) << report.status().to_string();
      EXPECT_EQ(report->sub_groups, rig.plan.stepped.size());
    }
    const ParamStates want = reference_run(in, adam_of(rig.config), rig.compute_dtype(), rig.grad_dtype(), kSteps,
                                           s.moments == "bf16" ? DType::kBF16 : DType::kF32);
    const std::vector<Bytes> compute = gather(*rig.store, StateKind::kCompute);
    for (uint32_t p = 0; p < reg.params().size(); ++p) {
      if (is_frozen[p]) {
        EXPECT_TRUE(compute[p] == to_dtype(in.weights[p], rig.compute_dtype())) << "frozen param " << p;
        continue;
      }
      EXPECT_TRUE(compute[p] == want.compute[p]) << "compute of param " << p;
    }
    // The trainable params' optimizer states, read from their sub-groups only.
    for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
      const uint64_t sb = state_elem_bytes(rig.plan.placement, kind);
      const std::vector<Bytes>& ref = kind == StateKind::kMaster   ? want.master
                                      : kind == StateKind::kExpAvg ? want.exp_avg
                                                                   : want.exp_avg_sq;
      for (const SubGroup& g : reg.sub_groups()) {
        if (!g.trainable) continue;
        Bytes buf(rig.store->state_bytes(g.index, kind));
        ASSERT_TRUE(rig.store->read_state(g.index, kind, buf).is_ok());
        for (const ParamPiece& piece : reg.pieces_of_group(g.index)) {
          EXPECT_EQ(std::memcmp(buf.data() + piece.group_offset * sb, ref[piece.param].data() + piece.param_offset * sb,
                                piece.n_elems * sb),
                    0)
              << state_name(kind) << " of param " << piece.param;
        }
      }
    }
    if (!direct) continue;
    // A direct step refuses a frozen sub-group by name.
    std::vector<uint32_t> order;
    ASSERT_TRUE((*swapper)->begin_direct(step_args(rig, kSteps + 1), order).is_ok());
    Bytes grad(rig.store->state_bytes(1, StateKind::kCompute) * 4);
    Status refused = (*swapper)->step_direct(1, grad.data());
    EXPECT_THAT(refused.message(), HasSubstr("sub-group 1 is frozen"));
    (void)(*swapper)->end_direct();
  }
}

TEST(OptimizerSwapper, RejectsAdagradAndLionOnTheDevice) {
  for (OptimizerType type : {OptimizerType::kAdagrad, OptimizerType::kLion}) {
    Rig rig;
    ASSERT_TRUE(rig.init(Placing{}).is_ok());
    PipelineOptions options = PipelineOptions::from_config(rig.config);
    options.optimizer = type;
    auto swapper = OptimizerSwapper::create(*rig.store, *rig.executor, options);
    ASSERT_FALSE(swapper.is_ok());
    EXPECT_EQ(swapper.status().code(), StatusCode::kUnavailable);
    EXPECT_THAT(swapper.status().message(), HasSubstr(std::string(to_string(type))));
    EXPECT_THAT(swapper.status().message(), HasSubstr("offload_optimizer.device to cpu or nvme"));
  }
}

// Each optimizer is stepped with its own struct of hyperparameters, held to its own check before
// any sub-group is touched: Lion's states with Adam's struct, or with beta1 = 1.5, are refused with
// kInvalidArgument and change nothing; then the right ones step.
TEST(OptimizerSwapper, EachOptimizerTakesAndChecksItsOwnHyperparameters) {
  Placing s;
  s.optimizer = "cpu";
  s.optimizer_type = "Lion";
  Rig rig;
  ASSERT_TRUE(rig.init(s).is_ok());
  const Inputs in = make_inputs(1);
  ASSERT_TRUE(init_all(*rig.store, in).is_ok());
  ASSERT_TRUE(write_grads(rig, in, 0).is_ok());
  auto swapper = OptimizerSwapper::create(*rig.store, *rig.executor, PipelineOptions::from_config(rig.config));
  ASSERT_TRUE(swapper.is_ok()) << swapper.status().to_string();
  const ParamStates before = gather_all(*rig.store);
  OptimizerStepArgs args = step_args(rig, 1);
  args.hyperparameters = adam_of(rig.config);
  auto report = (*swapper)->step(args);
  ASSERT_FALSE(report.is_ok());
  EXPECT_EQ(report.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(report.status().message(), HasSubstr("Lion"));
  EXPECT_THAT(report.status().message(), HasSubstr("AdamConfig"));
  args = step_args(rig, 1);
  std::get<cpu_optim::LionConfig>(args.hyperparameters).beta1 = 1.5f;
  report = (*swapper)->step(args);
  ASSERT_FALSE(report.is_ok());
  EXPECT_EQ(report.status().code(), StatusCode::kInvalidArgument);
  // Refused by the step's own check, not by the first kernel (whose message names lion_step).
  EXPECT_THAT(report.status().message(), HasSubstr("optimizer step 1: beta1 = 1.5 is outside [0, 1)"));
  EXPECT_TRUE(rig.store->torn_reason().empty()) << rig.store->torn_reason();
  expect_same(gather_all(*rig.store), before, "states after the refused steps");
  EXPECT_TRUE((*swapper)->step(step_args(rig, 1)).is_ok());
}

// optimizer_hyperparameters gives each optimizer.type its own struct, with the schedule's lr (here
// 0.005, not the config's 0.01) and the config's weight decay (0.1).
TEST(OptimizerHyperparameters, EachTypeGetsItsOwnStruct) {
  for (const char* type : {"AdamW", "Lion", "Adagrad"}) {
    SCOPED_TRACE(type);
    Placing s;
    s.optimizer = "cpu";
    s.optimizer_type = type;
    const OptimizerHyperparameters h = optimizer_hyperparameters(make_config(s, "/tmp").optimizer, 0.005);
    if (std::string(type) == "AdamW") {
      const auto* a = std::get_if<AdamConfig>(&h);
      ASSERT_NE(a, nullptr);
      EXPECT_EQ(a->lr, 0.005f);
      EXPECT_EQ(a->weight_decay, 0.1f);
      EXPECT_TRUE(a->adam_w_mode);
    } else if (std::string(type) == "Lion") {
      const auto* l = std::get_if<cpu_optim::LionConfig>(&h);
      ASSERT_NE(l, nullptr);
      EXPECT_EQ(l->lr, 0.005f);
      EXPECT_EQ(l->weight_decay, 0.1f);
    } else {
      const auto* g = std::get_if<cpu_optim::AdagradConfig>(&h);
      ASSERT_NE(g, nullptr);
      EXPECT_EQ(g->lr, 0.005f);
      EXPECT_EQ(g->weight_decay, 0.1f);
    }
  }
}

TEST(OptimizerSwapper, NvmeStepReportsItsTraffic) {
  Placing s;
  s.optimizer = "nvme";
  s.param = "nvme";
  s.pipeline_read = s.pipeline_write = true;
  Rig rig;
  ASSERT_TRUE(rig.init(s).is_ok());
  const Inputs in = make_inputs(1);
  ASSERT_TRUE(init_all(*rig.store, in).is_ok());
  ASSERT_TRUE(write_grads(rig, in, 0).is_ok());
  auto swapper = OptimizerSwapper::create(*rig.store, *rig.executor, PipelineOptions::from_config(rig.config));
  ASSERT_TRUE(swapper.is_ok());
  const auto before = rig.accounting.snapshot();
  auto report = (*swapper)->step(step_args(rig, 1));
  ASSERT_TRUE(report.is_ok()) << report.status().to_string();
  const auto after = rig.accounting.snapshot();
  EXPECT_EQ(report->sub_groups, rig.plan.n_sub_groups);
  EXPECT_GT(report->bytes_read, 0u);
  // master|m|v of every sub-group plus every compute copy; the gradients are not written back.
  uint64_t expect_written = 0;
  for (const auto& g : rig.registry.sub_groups()) {
    for (StateKind k : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kCompute}) {
      expect_written += rig.store->location(g.index, k).region.size_bytes;
    }
  }
  EXPECT_EQ(report->bytes_written, expect_written);
  EXPECT_EQ(after.nvme_write_bytes - before.nvme_write_bytes, expect_written);
  EXPECT_GE(report->total_s, report->update_s);
}

TEST(OptimizerSwapper, AccumulatorsInRamLeaveTheSwapFileAndItsTraffic) {
  // Note [Where the gradients wait]: the same step, with the accumulators in the file and in RAM.
  const Inputs in = make_inputs(1);
  uint64_t read[2] = {0, 0}, file[2] = {0, 0}, grad_bytes = 0;
  for (int in_ram = 0; in_ram < 2; ++in_ram) {
    Placing s;
    s.optimizer = "nvme";
    s.accumulators = in_ram ? "cpu" : "nvme";
    s.pipeline_read = s.pipeline_write = true;
    Rig rig;
    ASSERT_TRUE(rig.init(s).is_ok());
    EXPECT_EQ(rig.plan.placement.grad, in_ram ? Tier::kCpu : Tier::kNvme);
    EXPECT_EQ(rig.store->location(0, StateKind::kGradAccum).tier, rig.plan.placement.grad);
    ASSERT_TRUE(init_all(*rig.store, in).is_ok());
    ASSERT_TRUE(write_grads(rig, in, 0).is_ok());
    auto swapper = OptimizerSwapper::create(*rig.store, *rig.executor, PipelineOptions::from_config(rig.config));
    ASSERT_TRUE(swapper.is_ok()) << swapper.status().to_string();
    auto report = (*swapper)->step(step_args(rig, 1));
    ASSERT_TRUE(report.is_ok()) << report.status().to_string();
    read[in_ram] = report->bytes_read;
    file[in_ram] = rig.plan.nvme_optimizer_bytes;
    if (in_ram) continue;
    for (const auto& g : rig.registry.sub_groups())
      grad_bytes += rig.store->location(g.index, StateKind::kGradAccum).region.size_bytes;
  }
  ASSERT_GT(grad_bytes, 0u);
  EXPECT_EQ(file[0] - file[1], grad_bytes) << "the accumulators' sections leave the swap file";
  EXPECT_EQ(read[0] - read[1], grad_bytes) << "and the step reads them from RAM";
}

// Note [Reading the states ahead]: the reads issued before the gradients arrive are the reads the
// step would make, so the states are those of the step that reads them itself, however many
// buffers read ahead (more than there are sub-groups included), pipelined or not, with a step
// skipped in between; the step reports the bytes read ahead, and nothing is read twice.
TEST(OptimizerSwapper, StatesReadAheadGiveTheSameStepsBitForBit) {
  const Inputs in = make_inputs(3);
  const AdamConfig adam = adam_of(make_config(Placing{}, "/tmp"));
  struct Case {
    bool pipeline;
    uint64_t read_ahead;
  };
  for (const Case c : {Case{false, 0}, Case{true, 0}, Case{true, 2}, Case{false, 3}, Case{true, 1000}}) {
    Placing s;
    s.optimizer = "nvme";
    s.param = "cpu";
    s.accumulators = "cpu";
    s.pipeline_read = s.pipeline_write = c.pipeline;
    s.read_ahead = c.read_ahead;
    SCOPED_TRACE(s.describe() + " read_ahead " + std::to_string(c.read_ahead));
    Rig rig;
    ASSERT_TRUE(rig.init(s).is_ok());
    const uint32_t groups = rig.plan.n_sub_groups;
    ASSERT_GT(groups, 4u);
    EXPECT_EQ(rig.plan.optimizer_swap_buffers, std::min<uint64_t>(1 + 2 * uint64_t{c.pipeline} + c.read_ahead, groups));
    ASSERT_TRUE(init_all(*rig.store, in).is_ok());
    auto swapper = OptimizerSwapper::create(*rig.store, *rig.executor, PipelineOptions::from_config(rig.config));
    ASSERT_TRUE(swapper.is_ok()) << swapper.status().to_string();
    uint64_t file_bytes = 0;  // every record, read once per step
    for (uint32_t g = 0; g < groups; ++g) {
      for (StateKind k : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq})
        file_bytes += rig.store->location(g, k).region.size_bytes;
    }
    for (int i = 0; i < 3; ++i) {
      const uint64_t read_before = rig.accounting.snapshot().nvme_read_bytes;
      ASSERT_TRUE((*swapper)->read_states_ahead().is_ok());
      if (i == 1) ASSERT_TRUE((*swapper)->read_states_ahead().is_ok());  // a step skipped: nothing read twice
      ASSERT_TRUE(write_grads(rig, in, i).is_ok());                      // the backward, under the reads
      auto report = (*swapper)->step(step_args(rig, i + 1));
      ASSERT_TRUE(report.is_ok()) << report.status().to_string();
      EXPECT_EQ(report->sub_groups, groups);
      if (i > 0) EXPECT_EQ(report->bytes_read, file_bytes) << "step " << i + 1;  // the first reads masters only
      EXPECT_EQ(rig.accounting.snapshot().nvme_read_bytes - read_before, report->bytes_read) << "step " << i + 1;
    }
    const ParamStates want = reference_run(in, adam, rig.compute_dtype(), rig.grad_dtype(), 3);
    expect_same(gather_all(*rig.store), want, "after three steps with reads ahead");
    // Reads ahead that no step takes are waited for when the swapper goes.
    ASSERT_TRUE((*swapper)->read_states_ahead().is_ok());
    swapper->reset();
    EXPECT_EQ(rig.io->wait_all().code(), StatusCode::kOk);
  }
}

// Reading ahead needs the gradient out of the states' records: with the accumulators in them (the
// backward is still writing them; "auto" puts them there when RAM has no room, as plan_memory alone
// does) the plan adds no buffers, nothing is read ahead, and the step reads them itself.
TEST(OptimizerSwapper, NothingIsReadAheadFromRecordsThatHoldTheGradient) {
  Placing s;
  s.optimizer = "nvme";
  s.pipeline_read = s.pipeline_write = true;
  s.read_ahead = 2;
  Rig rig;
  ASSERT_TRUE(rig.init(s).is_ok());
  ASSERT_EQ(rig.plan.placement.grad, Tier::kNvme);
  EXPECT_EQ(rig.plan.optimizer_swap_buffers, 3u) << "the pipeline's own, none to read ahead into";
  const Inputs in = make_inputs(1);
  ASSERT_TRUE(init_all(*rig.store, in).is_ok());
  auto swapper = OptimizerSwapper::create(*rig.store, *rig.executor, PipelineOptions::from_config(rig.config));
  ASSERT_TRUE(swapper.is_ok()) << swapper.status().to_string();
  const uint64_t before = rig.accounting.snapshot().nvme_read_bytes;
  ASSERT_TRUE((*swapper)->read_states_ahead().is_ok());
  EXPECT_EQ(rig.accounting.snapshot().nvme_read_bytes, before) << "the backward is still writing the gradients";
  ASSERT_TRUE(write_grads(rig, in, 0).is_ok());
  ASSERT_TRUE((*swapper)->step(step_args(rig, 1)).is_ok());
  const ParamStates want = reference_run(in, adam_of(rig.config), rig.compute_dtype(), rig.grad_dtype(), 1);
  expect_same(gather_all(*rig.store), want, "accumulators in the records");
}

// Note [No accumulator]: a direct step takes each sub-group's gradient as it is handed over, in
// any order (backward's is the reverse), and leaves the states and compute copies bit-identical to a
// step from the accumulators; the two kinds of step are not mixed up, and a step that ends before
// every sub-group was stepped leaves the store torn.
TEST(OptimizerSwapperDirect, AnyOrderOfSubGroupsEqualsTheStoredStepBitForBit) {
  const Inputs in = make_inputs(2);
  struct Case {
    const char* optimizer;
    const char* param;
    bool pipeline;
  };
  for (const Case& c : {Case{"cpu", "none", false}, Case{"cpu", "cpu", false}, Case{"cpu", "nvme", false},
                        Case{"nvme", "cpu", true}, Case{"nvme", "nvme", true}, Case{"nvme", "none", false}}) {
    SCOPED_TRACE(std::string("optimizer ") + c.optimizer + ", params " + c.param + (c.pipeline ? ", pipelined" : ""));
    Placing stored_p;
    stored_p.optimizer = c.optimizer;
    stored_p.param = c.param;
    stored_p.max_in_cpu = 0;
    stored_p.pipeline_read = stored_p.pipeline_write = c.pipeline;
    stored_p.accumulators = "cpu";
    Placing direct_p = stored_p;
    direct_p.accumulators = "none";
    Rig stored, direct;
    ASSERT_TRUE(stored.init(stored_p).is_ok());
    ASSERT_TRUE(direct.init(direct_p).is_ok());
    ASSERT_TRUE(init_all(*stored.store, in).is_ok());
    ASSERT_TRUE(init_all(*direct.store, in).is_ok());
    auto a = OptimizerSwapper::create(*stored.store, *stored.executor, PipelineOptions::from_config(stored.config));
    auto d = OptimizerSwapper::create(*direct.store, *direct.executor, PipelineOptions::from_config(direct.config));
    ASSERT_TRUE(a.is_ok() && d.is_ok()) << d.status().to_string();
    const uint32_t n_groups = stored.plan.n_sub_groups;
    ASSERT_GT(n_groups, 2u);
    for (int step = 0; step < 2; ++step) {
      ASSERT_TRUE(write_grads(stored, in, step).is_ok());
      ASSERT_TRUE((*a)->step(step_args(stored, step + 1)).is_ok());
      // Backward's order as expected, then another one than expected (what is read ahead comes
      // later): the result may not depend on either.
      std::vector<uint32_t> order(n_groups);
      std::iota(order.begin(), order.end(), 0u);
      std::reverse(order.begin(), order.end());
      ASSERT_TRUE((*d)->begin_direct(step_args(direct, step + 1), order).is_ok());
      if (step == 1) std::rotate(order.begin(), order.begin() + n_groups / 2, order.end());
      for (uint32_t g : order) {
        Bytes grad(stored.store->state_bytes(g, StateKind::kGradAccum));
        ASSERT_TRUE(stored.store->read_state(g, StateKind::kGradAccum, grad).is_ok());
        ASSERT_TRUE((*d)->step_direct(g, grad.data()).is_ok()) << "sub-group " << g;
      }
      auto report = (*d)->end_direct();
      ASSERT_TRUE(report.is_ok()) << report.status().to_string();
      EXPECT_EQ(report->sub_groups, n_groups);
    }
    for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kCompute})
      EXPECT_EQ(gather(*direct.store, kind), gather(*stored.store, kind)) << state_name(kind);

    if (std::string(c.optimizer) == "nvme") { EXPECT_GT(direct.plan.nvme_optimizer_bytes, 0u); }
    // The two kinds of step refuse each other's plan; a sub-group is stepped once, an order names
    // each sub-group at most once.
    ASSERT_TRUE((*d)->begin_direct(step_args(direct, 3), {0, 1, 0}).code() == StatusCode::kInvalidArgument);
    EXPECT_EQ((*d)->step(step_args(direct, 3)).status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ((*a)->begin_direct(step_args(stored, 3)).code(), StatusCode::kFailedPrecondition);
    // An incomplete direct step: the sub-group stepped is ahead of the others, so the store is torn.
    ASSERT_TRUE((*d)->begin_direct(step_args(direct, 3)).is_ok());
    EXPECT_EQ((*d)->begin_direct(step_args(direct, 3)).code(), StatusCode::kFailedPrecondition);
    Bytes grad(stored.store->state_bytes(0, StateKind::kGradAccum));
    ASSERT_TRUE(stored.store->read_state(0, StateKind::kGradAccum, grad).is_ok());
    ASSERT_TRUE((*d)->step_direct(0, grad.data()).is_ok());
    EXPECT_EQ((*d)->step_direct(0, grad.data()).code(), StatusCode::kInvalidArgument);
    auto incomplete = (*d)->end_direct();
    ASSERT_FALSE(incomplete.is_ok());
    EXPECT_EQ(incomplete.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(incomplete.status().to_string(), HasSubstr("optimizer step 3"));
    EXPECT_THAT(incomplete.status().to_string(), HasSubstr("1 of " + std::to_string(n_groups) + " sub-groups"));
    EXPECT_FALSE(direct.store->torn_reason().empty());
    EXPECT_THAT((*d)->begin_direct(step_args(direct, 3)).to_string(), HasSubstr("torn"));
  }
}

// Note [Gradients that land where they are summed]: step_direct with sum_sq takes the norm in the
// update's pass, a run of tiles at a time (here one tile, so the one sub-group of 45,126 elements
// goes in three runs, the last partial), or in a pass before it where the sub-group is stepped
// piece by piece (8-bit moments): the states, the rewritten gradient (−0 to +0) and the norm's
// bits are those of squared_norm_canonical then step_direct, with the states in RAM and on NVMe.
TEST(OptimizerSwapperDirect, TheNormTakenWithTheUpdateIsTheNormPassesInRunsOfTiles) {
  const Inputs in = make_inputs(2);
  for (const char* optimizer : {"cpu", "nvme"}) {
    for (const char* moments : {"fp32", "bf16", "8bit"}) {
      SCOPED_TRACE(std::string("optimizer ") + optimizer + ", moments " + moments);
      Placing p;
      p.optimizer = optimizer;
      p.param = "cpu";
      p.accumulators = "none";
      p.moments = moments;
      Rig apart, fused;
      apart.sub_group_size = fused.sub_group_size = 1'000'000;
      ASSERT_TRUE(apart.init(p).is_ok());
      ASSERT_TRUE(fused.init(p).is_ok());
      ASSERT_EQ(fused.plan.n_sub_groups, 1u);
      ASSERT_TRUE(init_all(*apart.store, in).is_ok());
      ASSERT_TRUE(init_all(*fused.store, in).is_ok());
      PipelineOptions runs = PipelineOptions::from_config(fused.config);
      runs.norm_run_elems = cpu_optim::kTileElems;
      auto a = OptimizerSwapper::create(*apart.store, *apart.executor, PipelineOptions::from_config(apart.config));
      auto f = OptimizerSwapper::create(*fused.store, *fused.executor, runs);
      ASSERT_TRUE(a.is_ok() && f.is_ok()) << f.status().to_string();
      runs.norm_run_elems = 1000;
      EXPECT_EQ(OptimizerSwapper::create(*fused.store, *fused.executor, runs).status().code(),
                StatusCode::kInvalidArgument);
      const uint64_t n = fused.registry.sub_groups()[0].n_elems;
      for (int step = 0; step < 2; ++step) {
        std::vector<Bytes> per_param;
        for (const auto& v : in.grads[step]) per_param.push_back(to_dtype(v, DType::kF32));
        Bytes grad(n * 4);
        for (const ParamPiece& piece : fused.registry.pieces_of_group(0))
          std::memcpy(grad.data() + piece.group_offset * 4, per_param[piece.param].data() + piece.param_offset * 4,
                      piece.n_elems * 4);
        const uint32_t minus_zero = 0x80000000u;
        for (uint64_t i = 5; i < n; i += 9973) std::memcpy(grad.data() + 4 * i, &minus_zero, 4);
        Bytes grad_apart = grad, grad_fused = grad;
        ASSERT_TRUE((*a)->begin_direct(step_args(apart, step + 1), {0}).is_ok());
        ASSERT_TRUE((*f)->begin_direct(step_args(fused, step + 1), {0}).is_ok());
        Result<double> want = cpu_optim::squared_norm_canonical({grad_apart.data(), DType::kF32}, n, *apart.executor);
        ASSERT_TRUE(want.is_ok());
        ASSERT_TRUE((*a)->step_direct(0, grad_apart.data()).is_ok());
        double got = -1;
        ASSERT_TRUE((*f)->step_direct(0, grad_fused.data(), &got).is_ok());
        ASSERT_TRUE((*a)->end_direct().is_ok());
        ASSERT_TRUE((*f)->end_direct().is_ok());
        EXPECT_EQ(std::bit_cast<uint64_t>(got), std::bit_cast<uint64_t>(*want)) << "step " << step + 1;
        EXPECT_GT(got, 0.0);
        EXPECT_TRUE(grad_fused == grad_apart) << "the gradient as rewritten, step " << step + 1;
        EXPECT_FALSE(grad_fused == grad) << "the −0s became +0";
      }
      for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kCompute}) {
        Bytes want_bytes(apart.store->state_bytes(0, kind)), got_bytes(fused.store->state_bytes(0, kind));
        ASSERT_TRUE(apart.store->read_state(0, kind, want_bytes).is_ok());
        ASSERT_TRUE(fused.store->read_state(0, kind, got_bytes).is_ok());
        EXPECT_TRUE(got_bytes == want_bytes) << state_name(kind);
      }
    }
  }
}

TEST(OptimizerSwapperFaults, AGradientReadErrorWithTheStatesInRamNamesSubGroupAndFile) {
  Placing s;
  s.optimizer = "cpu";
  s.accumulators = "nvme";
  Rig rig;
  ASSERT_TRUE(rig.init(s).is_ok());
  ASSERT_GT(rig.plan.n_sub_groups, 4u);
  EXPECT_EQ(rig.plan.grad_read_buffers, 2u);
  const Inputs in = make_inputs(1);
  ASSERT_TRUE(init_all(*rig.store, in).is_ok());
  ASSERT_TRUE(write_grads(rig, in, 0).is_ok());
  auto swapper = OptimizerSwapper::create(*rig.store, *rig.executor, PipelineOptions::from_config(rig.config));
  ASSERT_TRUE(swapper.is_ok()) << swapper.status().to_string();
  const uint32_t bad = 3;
  const uint64_t offset = rig.store->location(bad, StateKind::kGradAccum).region.offset_bytes;
  rig.faults->add({io::FaultKind::kEio, io::IoOp::kRead, "optimizer.swp", offset, 1});
  auto report = (*swapper)->step(step_args(rig, 1));
  ASSERT_FALSE(report.is_ok());
  EXPECT_EQ(report.status().code(), StatusCode::kIoError);
  EXPECT_THAT(report.status().message(), HasSubstr("sub-group " + std::to_string(bad)));
  EXPECT_THAT(report.status().message(), HasSubstr(rig.store->optimizer_file()->path()));
  EXPECT_THAT(report.status().message(), HasSubstr(std::to_string(offset)));
  EXPECT_EQ(rig.faults->injected(), 1u);
  EXPECT_FALSE(rig.store->torn_reason().empty()) << "sub-groups before " << bad << " were updated";
  EXPECT_EQ(rig.io->wait_all().code(), StatusCode::kOk) << "no read left in flight";
}

// ---- 3. Budgets ---------------------------------------------------------------------------------

TEST(StateStoreBudget, DeviceBudgetTooSmallFailsAtCreateWithTheNumbers) {
  Rig rig;
  ASSERT_TRUE(rig.prepare(Placing{}, 64 * 1024).is_ok());
  Status st = rig.create_store();
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), StatusCode::kOutOfMemory);
  EXPECT_THAT(st.message(), HasSubstr("budget"));
  EXPECT_THAT(st.message(), HasSubstr("master"));
  EXPECT_EQ(rig.device->stats().allocated_bytes, 0u) << "a failed create leaves nothing allocated";
}

TEST(StateStoreBudget, PinnedCapBelowThePlanFailsAtCreateWithTheNumbers) {
  Placing s;
  s.optimizer = "nvme";
  s.param = "nvme";
  s.pipeline_read = s.pipeline_write = true;
  Rig rig;
  ASSERT_TRUE(rig.prepare(s).is_ok());
  const uint64_t need = rig.plan.pinned_pool_bytes();
  ASSERT_GT(need, 4096u);
  Status st = rig.create_store(need - 4096);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), StatusCode::kOutOfMemory);
  EXPECT_THAT(st.message(), HasSubstr(std::to_string(need)));
  EXPECT_THAT(st.message(), HasSubstr(std::to_string(need - 4096)));
  EXPECT_THAT(st.message(), HasSubstr("zoffload.pinned_memory_limit"));
  EXPECT_THAT(st.message(), HasSubstr("optimizer swap buffers"));
  EXPECT_EQ(rig.accounting.snapshot().pinned.resident_bytes, 0u);
  // Exactly the need is enough.
  EXPECT_TRUE(rig.create_store(need).is_ok());
}

// The cap bounds the pool, it is not its size: a config's cap written for a bigger model pins
// only what this plan needs (and only that is checked against RAM).
TEST(StateStoreBudget, PinnedCapAboveThePlanPinsOnlyThePlan) {
  Placing s;
  s.optimizer = "nvme";
  s.param = "nvme";
  Rig rig;
  ASSERT_TRUE(rig.prepare(s).is_ok());
  const uint64_t need = rig.plan.pinned_pool_bytes();
  ASSERT_TRUE(rig.create_store(uint64_t{1} << 50).is_ok()) << "a 1 PiB cap is only a bound";
  EXPECT_EQ(rig.store->pool().capacity_bytes(), need);
}

TEST(StateStoreBudget, StepsStayWithinTheCapsAndAllocateNothing) {
  struct Case {
    Placing setup;
    uint64_t budget;
  };
  std::vector<Case> cases;
  {
    Placing s;  // everything on the device: the budget is what the states need, rounded
    cases.push_back({s, 0});
    s.optimizer = "cpu";
    cases.push_back({s, 0});
    s.optimizer = "nvme";
    s.param = "nvme";
    s.max_in_cpu = 8192;
    s.pipeline_read = s.pipeline_write = true;
    cases.push_back({s, 0});
  }
  const Inputs in = make_inputs(2);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.setup.describe());
    Rig probe;
    ASSERT_TRUE(probe.prepare(c.setup).is_ok());
    // The tightest budget that fits the device-resident states (per-kind blocks, 256-byte rounding).
    const uint64_t budget = std::max<uint64_t>(probe.plan.device_bytes + 16 * 1024, 4096);
    Rig rig;
    ASSERT_TRUE(rig.prepare(c.setup, budget).is_ok());
    ASSERT_TRUE(rig.create_store().is_ok());
    ASSERT_TRUE(init_all(*rig.store, in).is_ok());
    auto swapper = OptimizerSwapper::create(*rig.store, *rig.executor, PipelineOptions::from_config(rig.config));
    ASSERT_TRUE(swapper.is_ok());
    const uint64_t cap = rig.plan.pinned_pool_bytes();
    const uint64_t pool_used = rig.store->pool().used_bytes();
    const auto dev_before = rig.device->stats();
    rig.accounting.reset_peaks();
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(write_grads(rig, in, i).is_ok());
      auto report = (*swapper)->step(step_args(rig, i + 1));
      ASSERT_TRUE(report.is_ok()) << report.status().to_string();
      EXPECT_EQ(rig.store->pool().used_bytes(), pool_used) << "no pinned allocation inside the step";
      EXPECT_EQ(rig.device->stats().allocated_bytes, dev_before.allocated_bytes)
          << "no device allocation inside the step";
    }
    const auto dev = rig.device->stats();
    const auto mem = rig.accounting.snapshot();
    EXPECT_LE(dev.peak_allocated_bytes, budget);
    EXPECT_EQ(dev.peak_allocated_bytes, dev_before.peak_allocated_bytes) << "the step loop raised the device peak";
    EXPECT_LE(mem.device.peak_bytes, budget);
    EXPECT_LE(rig.store->pool().peak_used_bytes(), rig.store->pool().capacity_bytes());
    EXPECT_EQ(rig.store->pool().capacity_bytes(), cap);
    EXPECT_LE(mem.pinned.peak_bytes, cap);
    EXPECT_EQ(mem.pinned.peak_bytes, mem.pinned.resident_bytes) << "pinned bytes grew during the steps";
  }
}

// ---- 4. Faults ----------------------------------------------------------------------------------

struct FaultRig {
  Rig rig;
  std::unique_ptr<OptimizerSwapper> swapper;
  Inputs in = make_inputs(2);

  static Placing nvme_pipelined() {
    Placing s;
    s.optimizer = "nvme";
    s.param = "nvme";
    s.pipeline_read = s.pipeline_write = true;
    return s;
  }
  void init(const Placing& s = nvme_pipelined()) {
    ASSERT_TRUE(rig.init(s).is_ok());
    ASSERT_GT(rig.plan.n_sub_groups, 4u);
    ASSERT_TRUE(init_all(*rig.store, in).is_ok());
    ASSERT_TRUE(write_grads(rig, in, 0).is_ok());
    auto sw = OptimizerSwapper::create(*rig.store, *rig.executor, PipelineOptions::from_config(rig.config));
    ASSERT_TRUE(sw.is_ok());
    swapper = std::move(sw).value();
  }
  uint64_t record_offset(uint32_t g) const { return rig.store->location(g, StateKind::kMaster).region.offset_bytes; }
};

TEST(OptimizerSwapperFaults, ReadErrorMidStepNamesSubGroupFileAndOffsetAndTearsTheStore) {
  FaultRig f;
  ASSERT_NO_FATAL_FAILURE(f.init());
  const uint32_t bad = 3;
  f.rig.faults->add({io::FaultKind::kEio, io::IoOp::kRead, "optimizer.swp", f.record_offset(bad), 1});
  auto report = f.swapper->step(step_args(f.rig, 1));
  ASSERT_FALSE(report.is_ok());
  const Status& st = report.status();
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_THAT(st.message(), HasSubstr("optimizer step 1"));
  EXPECT_THAT(st.message(), HasSubstr("sub-group " + std::to_string(bad)));
  EXPECT_THAT(st.message(), HasSubstr(f.rig.store->optimizer_file()->path()));
  EXPECT_THAT(st.message(), HasSubstr(std::to_string(f.record_offset(bad))));
  EXPECT_EQ(f.rig.faults->injected(), 1u);
  EXPECT_FALSE(f.rig.store->torn_reason().empty()) << "sub-groups 0.." << bad - 1 << " were written";
  auto again = f.swapper->step(step_args(f.rig, 2));
  ASSERT_FALSE(again.is_ok());
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("sub-group " + std::to_string(bad)));
  EXPECT_EQ(f.rig.io->wait_all().code(), StatusCode::kOk) << "no I/O left in flight";
}

TEST(OptimizerSwapperFaults, WriteErrorMidStepNamesSubGroupAndTearsTheStore) {
  FaultRig f;
  ASSERT_NO_FATAL_FAILURE(f.init());
  const uint32_t bad = 2;
  f.rig.faults->add({io::FaultKind::kEio, io::IoOp::kWrite, "optimizer.swp", f.record_offset(bad), 1});
  auto report = f.swapper->step(step_args(f.rig, 1));
  ASSERT_FALSE(report.is_ok());
  EXPECT_THAT(report.status().message(), HasSubstr("sub-group " + std::to_string(bad)));
  EXPECT_THAT(report.status().message(), HasSubstr(f.rig.store->optimizer_file()->path()));
  EXPECT_FALSE(f.rig.store->torn_reason().empty());
  EXPECT_EQ(f.swapper->step(step_args(f.rig, 2)).status().code(), StatusCode::kFailedPrecondition);
}

TEST(OptimizerSwapperFaults, ErrorBeforeAnyWriteLeavesTheStoreUsable) {
  FaultRig f;
  ASSERT_NO_FATAL_FAILURE(f.init());
  const ParamStates before = gather_all(*f.rig.store);
  f.rig.faults->add({io::FaultKind::kEio, io::IoOp::kRead, "optimizer.swp", f.record_offset(0), 1});
  auto report = f.swapper->step(step_args(f.rig, 1));
  ASSERT_FALSE(report.is_ok());
  EXPECT_THAT(report.status().message(), HasSubstr("sub-group 0"));
  EXPECT_TRUE(f.rig.store->torn_reason().empty()) << f.rig.store->torn_reason();
  expect_same(gather_all(*f.rig.store), before, "states after a failed read of sub-group 0");
  // Bad hyperparameters are refused before anything is touched, too.
  OptimizerStepArgs bad_args = step_args(f.rig, 1);
  std::get<AdamConfig>(bad_args.hyperparameters).beta1 = 1.5f;
  EXPECT_EQ(f.swapper->step(bad_args).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(f.rig.store->torn_reason().empty());
  // The same step now succeeds and matches the reference.
  ASSERT_TRUE(f.swapper->step(step_args(f.rig, 1)).is_ok());
  const ParamStates want = reference_run(f.in, adam_of(f.rig.config), f.rig.compute_dtype(), f.rig.grad_dtype(), 1);
  expect_same(gather_all(*f.rig.store), want, "after the retried step");
}

// Note [Reading the states ahead]: a read ahead that fails fails the step that waits for it, naming
// the sub-group and the file; the first sub-group's leaves the states untouched, and the step run
// again reads it itself.
TEST(OptimizerSwapperFaults, AFailedReadAheadFailsTheStepThatWaitsForIt) {
  FaultRig f;
  Placing s = FaultRig::nvme_pipelined();
  s.param = "cpu";
  s.accumulators = "cpu";
  s.read_ahead = 2;
  ASSERT_NO_FATAL_FAILURE(f.init(s));
  const ParamStates before = gather_all(*f.rig.store);
  f.rig.faults->add({io::FaultKind::kEio, io::IoOp::kRead, "optimizer.swp", f.record_offset(0), 1});
  ASSERT_TRUE(f.swapper->read_states_ahead().is_ok());
  auto report = f.swapper->step(step_args(f.rig, 1));
  ASSERT_FALSE(report.is_ok());
  EXPECT_EQ(report.status().code(), StatusCode::kIoError);
  EXPECT_THAT(report.status().message(), HasSubstr("sub-group 0"));
  EXPECT_THAT(report.status().message(), HasSubstr(f.rig.store->optimizer_file()->path()));
  EXPECT_TRUE(f.rig.store->torn_reason().empty()) << f.rig.store->torn_reason();
  expect_same(gather_all(*f.rig.store), before, "states after a failed read ahead of sub-group 0");
  EXPECT_EQ(f.rig.io->wait_all().code(), StatusCode::kOk) << "no I/O left in flight";
  ASSERT_TRUE(f.swapper->step(step_args(f.rig, 1)).is_ok());
  const ParamStates want = reference_run(f.in, adam_of(f.rig.config), f.rig.compute_dtype(), f.rig.grad_dtype(), 1);
  expect_same(gather_all(*f.rig.store), want, "after the step run again");
}

// ---- 5. ParamSwapper ----------------------------------------------------------------------------

struct ParamRig {
  Rig rig;
  std::unique_ptr<ParamSwapper> swapper;
  Inputs in = make_inputs(0);
  std::vector<uint32_t> nvme_params, cpu_params;

  void init(uint64_t buffer_count) {
    Placing s;
    s.optimizer = "nvme";
    s.param = "nvme";
    s.max_in_cpu = 1961 + 8192;  // sub-groups 0 and 1 on the CPU; param "b" straddles
    s.param_buffer_count = buffer_count;
    ASSERT_TRUE(rig.init(s).is_ok());
    ASSERT_TRUE(init_all(*rig.store, in).is_ok());
    auto sw = ParamSwapper::create(*rig.store);
    ASSERT_TRUE(sw.is_ok());
    swapper = std::move(sw).value();
    for (const auto& p : rig.registry.params()) {
      bool nvme = false;
      for (const auto& piece : rig.registry.pieces_of_param(p.id)) {
        nvme |= rig.store->location(piece.sub_group, StateKind::kCompute).tier == Tier::kNvme;
      }
      (nvme ? nvme_params : cpu_params).push_back(p.id);
    }
    ASSERT_GE(nvme_params.size(), 3u);
    ASSERT_GE(cpu_params.size(), 1u);
  }
};

TEST(ParamSwapper, FetchReturnsTheExactComputeBytesOfEveryParam) {
  ParamRig f;
  ASSERT_NO_FATAL_FAILURE(f.init(2));
  EXPECT_EQ(f.swapper->buffers_total(), 2u);
  for (const auto& p : f.rig.registry.params()) {
    SCOPED_TRACE(p.name);
    auto h = f.swapper->fetch(p.id);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    auto bytes = f.swapper->wait(*h);
    ASSERT_TRUE(bytes.is_ok()) << bytes.status().to_string();
    const Bytes want = to_dtype(f.in.weights[p.id], f.rig.compute_dtype());
    ASSERT_EQ(bytes->size(), want.size());
    EXPECT_TRUE(std::equal(bytes->begin(), bytes->end(), want.begin()));
    f.swapper->release(*h);
  }
  EXPECT_EQ(f.swapper->buffers_free(), 2u);
}

TEST(ParamSwapper, FetchesAfterAStepSeeTheNewComputeCopies) {
  ParamRig f;
  ASSERT_NO_FATAL_FAILURE(f.init(3));
  Inputs in = make_inputs(1);
  ASSERT_TRUE(write_grads(f.rig, in, 0).is_ok());
  auto opt = OptimizerSwapper::create(*f.rig.store, *f.rig.executor, PipelineOptions::from_config(f.rig.config));
  ASSERT_TRUE(opt.is_ok());
  ASSERT_TRUE((*opt)->step(step_args(f.rig, 1)).is_ok());
  const ParamStates want = reference_run(in, adam_of(f.rig.config), f.rig.compute_dtype(), f.rig.grad_dtype(), 1);
  std::vector<ParamHandle> handles;
  for (uint32_t p : f.nvme_params) {
    if (handles.size() == 3) break;
    auto h = f.swapper->fetch(p);
    ASSERT_TRUE(h.is_ok());
    handles.push_back(*h);
  }
  for (const auto& h : handles) {
    auto bytes = f.swapper->wait(h);
    ASSERT_TRUE(bytes.is_ok());
    EXPECT_TRUE(std::equal(bytes->begin(), bytes->end(), want.compute[h.param].begin(), want.compute[h.param].end()))
        << "param " << h.param;
    f.swapper->release(h);
  }
}

TEST(ParamSwapper, BuffersAreBounded) {
  ParamRig f;
  ASSERT_NO_FATAL_FAILURE(f.init(2));
  auto h0 = f.swapper->fetch(f.nvme_params[0]);
  auto h1 = f.swapper->fetch(f.nvme_params[1]);
  ASSERT_TRUE(h0.is_ok() && h1.is_ok());
  EXPECT_EQ(f.swapper->buffers_free(), 0u);
  auto h2 = f.swapper->fetch(f.nvme_params[2]);
  ASSERT_FALSE(h2.is_ok());
  EXPECT_EQ(h2.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(h2.status().message(), HasSubstr("all 2 parameter swap buffers are held"));
  // A CPU-resident param needs no buffer.
  auto hc = f.swapper->fetch(f.cpu_params[0]);
  ASSERT_TRUE(hc.is_ok());
  EXPECT_EQ(hc->buffer, -1);
  ASSERT_TRUE(f.swapper->wait(*hc).is_ok());
  // Released (without a wait first), a buffer serves the next fetch.
  f.swapper->release(*h0);
  auto h3 = f.swapper->fetch(f.nvme_params[2]);
  ASSERT_TRUE(h3.is_ok());
  auto bytes = f.swapper->wait(*h3);
  ASSERT_TRUE(bytes.is_ok());
  EXPECT_TRUE(std::equal(bytes->begin(), bytes->end(),
                         to_dtype(f.in.weights[f.nvme_params[2]], f.rig.compute_dtype()).begin()));
  EXPECT_FALSE(f.swapper->wait(*h0).is_ok()) << "a released handle is stale";
  f.swapper->release(*h1);
  f.swapper->release(*h3);
}

TEST(ParamSwapper, ReadErrorNamesTheParam) {
  ParamRig f;
  ASSERT_NO_FATAL_FAILURE(f.init(2));
  const uint32_t p = f.nvme_params.back();
  const ParamPiece& piece = f.rig.registry.pieces_of_param(p).front();
  const SwapRegion r = f.rig.store->location(piece.sub_group, StateKind::kCompute).region;
  const uint64_t offset = r.offset_bytes + piece.group_offset * dtype_size_bytes(f.rig.compute_dtype());
  f.rig.faults->add({io::FaultKind::kEio, io::IoOp::kRead, "param.swp", offset, 1});
  auto h = f.swapper->fetch(p);
  ASSERT_TRUE(h.is_ok());
  auto bytes = f.swapper->wait(*h);
  ASSERT_FALSE(bytes.is_ok());
  EXPECT_EQ(bytes.status().code(), StatusCode::kIoError);
  EXPECT_THAT(bytes.status().message(), HasSubstr("param " + f.rig.registry.params()[p].name));
  EXPECT_THAT(bytes.status().message(), HasSubstr(f.rig.store->param_file()->path()));
  f.swapper->release(*h);
  EXPECT_EQ(f.swapper->buffers_free(), 2u);
}

TEST(ParamSwapper, DeviceResidentParamsAreRefused) {
  Rig rig;
  Placing s;
  s.optimizer = "cpu";
  ASSERT_TRUE(rig.init(s).is_ok());
  auto sw = ParamSwapper::create(*rig.store);
  ASSERT_TRUE(sw.is_ok());
  EXPECT_EQ((*sw)->fetch(0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zo::engine
