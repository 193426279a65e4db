// Test rig of engine/coord: a small decoder-shaped model (embedding tied with the head, layers with
// a small persistent norm and split params), its blocks and backward contribution order, and a
// StateStore on HostDevice with the compute copies / gradient accumulators on a chosen tier (NVMe
// swap files under a temp dir); data-parallel ranks as threads with a block gatherer each. Shared
// by coord_test (unit) and coord_io_test (io).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/bnb4_blob.h"
#include "common/check.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/executor.h"
#include "engine/config/config.h"
#include "engine/coord/block_gatherer.h"
#include "engine/coord/grad_accumulator.h"
#include "engine/coord/param_coordinator.h"
#include "engine/memory/memory_plan.h"
#include "engine/memory/param_swapper.h"
#include "engine/memory/state_store.h"
#include "gpu/device.h"
#include "io/fault_injector.h"
#include "io/io_engine.h"
#include "tests/engine/temp_dir.h"
#include "tests/engine/test_config.h"

namespace zo::engine::testing {

using Bytes = std::vector<std::byte>;

struct Placing {
  std::string optimizer = "cpu";  // offload_optimizer.device (also the gradient accumulators' tier)
  std::string param = "cpu";      // offload_param.device
  bool bf16 = true;
  std::string grad = "fp32";   // data_types.grad_accum_dtype
  std::string store = "auto";  // zoffload.gradient_store_dtype
  uint64_t max_in_cpu = 1'000'000'000;
  uint64_t param_buffer_count = 4;
  bool pin = true;
  bool pipeline = false;  // offload_optimizer.pipeline_read and pipeline_write
  // zoffload.gradient_accumulators; "none" also sets gradient_clipping 0 and, with bf16,
  // check_grad_overflow false (what it needs).
  std::string accumulators = "auto";

  std::string describe() const {
    return "optimizer " + optimizer + " param " + param + (bf16 ? " bf16" : " fp32") + " grad " + grad +
           " max_in_cpu " + std::to_string(max_in_cpu) + " buffers " + std::to_string(param_buffer_count);
  }
};

inline std::string json_bool(bool v) { return v ? "true" : "false"; }

inline Config make_config(const Placing& s, const std::string& dir) {
  const std::string json = R"({"train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "sub_group_size": 8192,
      "offload_optimizer": {"device": ")" +
                           s.optimizer + R"(", "nvme_path": ")" + dir + R"(",
        "pin_memory": )" + json_bool(s.pin) +
                           R"(, "pipeline_read": )" + json_bool(s.pipeline) + R"(, "pipeline_write": )" +
                           json_bool(s.pipeline) + R"(},
      "offload_param": {"device": ")" +
                           s.param + R"(", "nvme_path": ")" + dir + R"(",
        "buffer_count": )" +
                           std::to_string(s.param_buffer_count) + R"(, "buffer_size": 100000,
        "max_in_cpu": )" + std::to_string(s.max_in_cpu) +
                           R"(, "pin_memory": )" + json_bool(s.pin) + R"(}},
    "gradient_clipping": )" +
                           std::string(s.accumulators == "none" ? "0" : "1.0") + R"(,
    "bf16": {"enabled": )" +
                           json_bool(s.bf16) + R"(, "check_grad_overflow": )" + json_bool(s.accumulators != "none") +
                           R"(},
    "data_types": {"grad_accum_dtype": ")" +
                           s.grad + R"("},
    "zoffload": {"gradient_store_dtype": ")" +
                           s.store + R"(", "gradient_accumulators": ")" + s.accumulators + R"("},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})";
  return parse_test_config(json);
}

inline constexpr uint32_t kLayers = 4;

// embed (0), per layer i: norm (small), attn, mlp (split over three sub-groups), final norm, and a
// head that reuses embed (tied).
inline std::vector<ParamSpec> model() {
  std::vector<ParamSpec> specs = {{"model.embed_tokens.weight", {64, 96}}};
  for (uint32_t i = 0; i < kLayers; ++i) {
    const std::string l = "model.layers." + std::to_string(i);
    specs.push_back({l + ".input_layernorm.weight", {96}});
    specs.push_back({l + ".self_attn.weight", {96, 96}});
    specs.push_back({l + ".mlp.weight", {96, 200}});
  }
  specs.push_back({"model.norm.weight", {96}});
  return specs;
}
inline uint32_t embed_id() { return 0; }
inline uint32_t layer_param(uint32_t layer, uint32_t k) { return 1 + 3 * layer + k; }
inline uint32_t final_norm_id() { return 1 + 3 * kLayers; }

// Block 0: embedding; blocks 1..kLayers: layers; last block: final norm + head (tied embed).
inline std::vector<std::vector<uint32_t>> blocks() {
  std::vector<std::vector<uint32_t>> out = {{embed_id()}};
  for (uint32_t i = 0; i < kLayers; ++i) out.push_back({layer_param(i, 0), layer_param(i, 1), layer_param(i, 2)});
  out.push_back({final_norm_id(), embed_id()});
  return out;
}
inline std::vector<std::string> block_names() {
  std::vector<std::string> out = {"embed"};
  for (uint32_t i = 0; i < kLayers; ++i) out.push_back("layers." + std::to_string(i));
  out.push_back("head");
  return out;
}
// The executor the gradient accumulator's kernels run on (two threads: the tiles split between them).
inline const cpu_optim::Executor& executor() {
  static const std::unique_ptr<cpu_optim::Executor> ex = [] {
    auto r = cpu_optim::Executor::create({.n_threads = 2});
    ZO_CHECK(r.is_ok()) << r.status().to_string();
    return std::move(*r);
  }();
  return *ex;
}
// The order gradients arrive in one micro-step: blocks backward, each block's params reversed.
inline std::vector<uint32_t> contribution_order() {
  std::vector<uint32_t> out;
  auto bl = blocks();
  for (size_t b = bl.size(); b-- > 0;) {
    for (size_t i = bl[b].size(); i-- > 0;) out.push_back(bl[b][i]);
  }
  return out;
}

inline Bytes random_bytes(uint64_t n, std::mt19937& rng) {
  Bytes out(n);
  for (auto& x : out) x = static_cast<std::byte>(rng() & 0xff);
  return out;
}

inline std::vector<float> random_floats(uint64_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> out(n);
  for (auto& x : out) x = dist(rng);
  return out;
}

inline Bytes to_dtype(const std::vector<float>& values, DType d) {
  Bytes out(values.size() * dtype_size_bytes(d));
  for (size_t i = 0; i < values.size(); ++i) cpu_optim::store_from_float(out.data(), d, i, values[i]);
  return out;
}

// The rig's packed weights: the mlp's 8-bit rows, the attention's NF4.
inline uint8_t rig_blob_type(const std::string& name) {
  return name.find("mlp") != std::string::npos ? bnb4::kBlobInt8 : uint8_t{0};
}

// A packed weight's blob (Note [The packed 4-bit base]) with random codes and scales, padded to its
// compute copy's bytes.
inline Bytes random_blob(const ParamInfo& p, uint64_t compute_bytes, std::mt19937& rng) {
  const bnb4::BlobHeader h{.type = rig_blob_type(p.name),
                           .round = DType::kBF16,
                           .rows = static_cast<uint64_t>(p.shape[0]),
                           .cols = static_cast<uint64_t>(p.shape[1])};
  Bytes out(p.n_elems * compute_bytes, std::byte{0});
  auto* b = reinterpret_cast<uint8_t*>(out.data());
  bnb4::write_blob_header(h, b);
  for (uint64_t i = 0; i < bnb4::blob_code_bytes(h.type, h.n()); ++i)
    b[bnb4::blob_codes_offset() + i] = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(0.01f, 2.0f);
  for (uint64_t j = 0; j < bnb4::blob_scale_count(h.type, h.rows, h.cols); ++j) {
    const float a = scale(rng);
    std::memcpy(b + h.scales_offset() + 4 * j, &a, 4);
  }
  return out;
}

struct Rig {
  TempDir dir;
  Config config;
  ParamRegistry registry;
  MemoryPlan plan;
  std::unique_ptr<gpu::Device> device;
  std::shared_ptr<io::FaultInjector> faults = std::make_shared<io::FaultInjector>();
  std::unique_ptr<io::IoEngine> io;
  MemoryAccounting accounting;
  std::unique_ptr<StateStore> store;
  std::unique_ptr<ParamSwapper> swapper;  // only when some compute copy is on NVMe
  // Before init: the plan's landing buffers as the planner sets them where gradients land in place
  // (Note [Gradients that land where they are summed]; plan_memory alone leaves them 0).
  bool land_in_place = false;
  // Before init: the layers' attn and mlp weights frozen and packed (Note [The packed 4-bit base]),
  // each a random blob (NF4 for attn, 8-bit rows for mlp: rig_blob_type).
  bool packed_base = false;

  // With world > 1: rank `rank`'s partition of a data-parallel run at stage 3 (its compute copies
  // only, MemoryPlan::partition_params); every rank gets the same values.
  Status init(const Placing& s, uint64_t device_budget = uint64_t{64} << 20, uint32_t seed = 1, uint32_t world = 1,
              uint32_t rank = 0) {
    config = make_config(s, dir.path);
    std::vector<ParamSpec> specs = model();
    const uint64_t cb = s.bf16 ? 2 : 4;
    if (packed_base) {
      for (uint32_t i = 0; i < kLayers; ++i) {
        for (uint32_t k : {1u, 2u}) {
          ParamSpec& spec = specs[layer_param(i, k)];
          spec.trainable = false;
          spec.storage_elems = bnb4::blob_bytes(rig_blob_type(spec.name), static_cast<uint64_t>(spec.shape[0]),
                                                static_cast<uint64_t>(spec.shape[1])) /
                               cb;
        }
      }
    }
    ZO_ASSIGN_OR_RETURN(registry, ParamRegistry::build(specs, config.zero.sub_group_size, world));
    ZO_ASSIGN_OR_RETURN(plan, plan_memory(config, registry, world > 1 ? std::optional<uint32_t>(rank) : std::nullopt));
    if (land_in_place) {
      const GradAccumulator::BufferPlan b =
          GradAccumulator::plan_buffers(registry, plan.placement, contribution_order());
      plan.landing_buffers = b.count;
      plan.landing_buffer_bytes = b.bytes_each;
    }
    ZO_ASSIGN_OR_RETURN(device, gpu::make_device(gpu::DeviceKind::kHost, device_budget));
    ZO_ASSIGN_OR_RETURN(io, io::IoEngine::create(io::IoOptions{}, faults));
    StateStoreOptions o;
    o.optimizer_nvme_path = config.zero.offload_optimizer.nvme_path;
    o.param_nvme_path = config.zero.offload_param.nvme_path;
    o.env = io::Env::posix();
    ZO_ASSIGN_OR_RETURN(store, StateStore::create(registry, plan, *device, *io, o, accounting));
    std::mt19937 rng(seed);
    for (const ParamInfo& p : registry.params()) {
      if (p.packed) {
        ZO_RETURN_IF_ERROR(store->init_packed(p.id, 0, random_blob(p, cb, rng)));
        continue;
      }
      ZO_RETURN_IF_ERROR(store->init_param(p.id, 0, random_floats(p.n_elems, rng, 1.0f)));
    }
    if (store->param_file() != nullptr && !plan.partition_params) {
      ZO_ASSIGN_OR_RETURN(swapper, ParamSwapper::create(*store));
    }
    return Status::ok();
  }

  uint64_t compute_bytes() const { return state_elem_bytes(plan.placement, StateKind::kCompute); }
  uint64_t grad_bytes() const { return state_elem_bytes(plan.placement, StateKind::kGradAccum); }

  // One state of every param, assembled from read_state of every sub-group.
  std::vector<Bytes> gather(StateKind kind) {
    const uint64_t eb = state_elem_bytes(plan.placement, kind);
    std::vector<Bytes> out;
    for (const auto& p : registry.params()) out.emplace_back(p.n_elems * eb);
    for (const auto& g : registry.sub_groups()) {
      Bytes buf(store->state_bytes(g.index, kind));
      Status st = store->read_state(g.index, kind, buf);
      ZO_CHECK(st.is_ok()) << st.to_string();
      for (const auto& piece : registry.pieces_of_group(g.index)) {
        std::memcpy(out[piece.param].data() + piece.param_offset * eb, buf.data() + piece.group_offset * eb,
                    piece.n_elems * eb);
      }
    }
    return out;
  }

  // Writes one state of every param (write_state of every sub-group).
  Status scatter(StateKind kind, const std::vector<Bytes>& per_param) {
    for (const auto& g : registry.sub_groups()) ZO_RETURN_IF_ERROR(scatter_group(g.index, kind, per_param));
    return Status::ok();
  }
  // The same for one sub-group: its pieces of `per_param` (write_state).
  Status scatter_group(uint32_t g, StateKind kind, const std::vector<Bytes>& per_param) {
    const uint64_t eb = state_elem_bytes(plan.placement, kind);
    Bytes buf(store->state_bytes(g, kind));
    for (const auto& piece : registry.pieces_of_group(g)) {
      std::memcpy(buf.data() + piece.group_offset * eb, per_param[piece.param].data() + piece.param_offset * eb,
                  piece.n_elems * eb);
    }
    return store->write_state(g, kind, buf);
  }

  // The bytes at `ptr` on the device.
  // The bytes at `ptr`, read by a stream that first waits (on the device) for `after`, if given.
  Bytes d2h(gpu::DevicePtr ptr, uint64_t size_bytes, gpu::Event after = {}) {
    Bytes out(size_bytes);
    auto stream = device->create_stream();
    ZO_CHECK(stream.is_ok()) << stream.status().to_string();
    Status st = after ? device->wait(*stream, after) : Status::ok();
    if (st.is_ok()) st = device->copy_d2h(out.data(), ptr, size_bytes, *stream);
    if (st.is_ok()) st = device->synchronize(*stream);
    ZO_CHECK(st.is_ok()) << st.to_string();
    device->destroy_stream(*stream);
    return out;
  }
};

// One micro-step through the full schedule (forward 0..n-1, backward n-1..0): every acquired
// address holds exactly `expected[param]` (compute bytes per param), checked by D2H; each block is
// released after use. Counts the params checked in *checked.
// `async`: acquire_async, the bytes read by a stream that waits on the ready event (as LibTorch's
// stream does in the trainer).
inline void run_micro_step(Rig& rig, ParamCoordinator& coord, const std::vector<Bytes>& expected,
                           uint64_t* checked = nullptr, bool async = false) {
  const auto bl = blocks();
  const uint32_t n = static_cast<uint32_t>(bl.size());
  coord.begin_micro_step();
  for (uint32_t q = 0; q < 2 * n; ++q) {
    const uint32_t b = q < n ? q : 2 * n - 1 - q;
    std::vector<gpu::DevicePtr> ptrs;
    gpu::Event ready;
    if (async) {
      auto got = coord.acquire_async(b);
      ASSERT_TRUE(got.is_ok()) << "position " << q << ": " << got.status().to_string();
      ptrs = got->ptrs;
      ready = got->ready;
    } else {
      auto got = coord.acquire(b);
      ASSERT_TRUE(got.is_ok()) << "position " << q << ": " << got.status().to_string();
      ptrs = *got;
    }
    ASSERT_EQ(ptrs.size(), bl[b].size());
    for (size_t i = 0; i < bl[b].size(); ++i) {
      const uint32_t p = bl[b][i];
      ASSERT_EQ(Bytes(rig.d2h(ptrs[i], expected[p].size(), ready)), expected[p])
          << "position " << q << " block " << b << " param " << rig.registry.params()[p].name;
      if (checked != nullptr) ++*checked;
    }
    Status st = coord.release(b);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
}

// Acquires of params that are not device-resident in one micro-step (every one is a hit or a fetch).
inline uint64_t fetchable_uses_per_micro_step(const Rig& rig) {
  uint64_t n = 0;
  for (const auto& b : blocks()) {
    std::vector<uint32_t> seen;
    for (uint32_t p : b) {
      if (std::find(seen.begin(), seen.end(), p) != seen.end()) continue;
      seen.push_back(p);
      const auto& piece = rig.registry.pieces_of_param(p).front();
      n += rig.store->location(piece.sub_group, StateKind::kCompute).tier == Tier::kDevice ? 0 : 1;
    }
  }
  return 2 * n;
}

// The reference accumulation: per param, per element, acc = round(float(acc) + float(g)) over the
// micro-steps' contributions in order, starting from +0. grads[m][c] = contribution c of micro-step m
// (in contribution_order()), as `gdt` bytes.
inline std::vector<Bytes> reference_accumulate(const Rig& rig, const std::vector<std::vector<Bytes>>& grads, DType gdt,
                                               DType acc_dtype) {
  const auto order = contribution_order();
  std::vector<std::vector<float>> acc;
  for (const auto& p : rig.registry.params()) acc.emplace_back(p.n_elems, 0.0f);
  for (const auto& step : grads) {
    for (size_t c = 0; c < order.size(); ++c) {
      auto& a = acc[order[c]];
      for (size_t i = 0; i < a.size(); ++i) {
        Bytes one(dtype_size_bytes(acc_dtype));
        cpu_optim::store_from_float(one.data(), acc_dtype, 0, a[i] + cpu_optim::load_as_float(step[c].data(), gdt, i));
        a[i] = cpu_optim::load_as_float(one.data(), acc_dtype, 0);
      }
    }
  }
  std::vector<Bytes> out;
  for (const auto& a : acc) out.push_back(to_dtype(a, acc_dtype));
  return out;
}

// Random gradients for `micro_steps` micro-steps in contribution order, with a few special values
// (-0, a denormal, a large value) in the first contribution.
inline std::vector<std::vector<Bytes>> random_grads(const Rig& rig, int micro_steps, DType gdt, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<Bytes>> out(micro_steps);
  for (auto& step : out) {
    for (uint32_t p : contribution_order()) {
      auto v = random_floats(rig.registry.params()[p].n_elems, rng, 0.5f);
      v[0] = -0.0f;
      v[1] = 1e-40f;
      v[2] = 3000.0f;
      step.push_back(to_dtype(v, gdt));
    }
  }
  return out;
}

struct Settings {
  const char* name;
  CoordinatorOptions options;
};

inline CoordinatorOptions opts(uint64_t bucket, uint64_t live, uint64_t persist, uint64_t reuse) {
  CoordinatorOptions o;
  o.prefetch_bucket_elems = bucket;
  o.max_live_elems = live;
  o.persistence_threshold_elems = persist;
  o.max_reuse_distance_elems = reuse;
  return o;
}

// World-size ranks as threads of this process: broadcast copies root's bytes to every rank, each call
// a collective. Every rank's call number `fail_call` (0-based) fails on every rank, as a collective
// fails on each survivor when a peer dies.
struct LocalBus {
  explicit LocalBus(uint32_t n) : world(n), sync(n), calls(n, 0) {}
  uint32_t world;
  std::barrier<> sync;
  std::vector<std::byte> buf;
  std::vector<int> calls;  // per rank, touched by that rank's gatherer thread only
  int fail_call = -1;
  std::function<Status(void*, uint64_t, uint32_t, const std::string&)> broadcast(uint32_t rank) {
    return [this, rank](void* data, uint64_t n, uint32_t root, const std::string& what) -> Status {
      if (calls[rank]++ == fail_call) return Status(StatusCode::kAborted, what + ": rank 7 of 2 did not respond");
      if (rank == root) buf.assign(static_cast<std::byte*>(data), static_cast<std::byte*>(data) + n);
      sync.arrive_and_wait();
      if (rank != root) std::memcpy(data, buf.data(), n);
      sync.arrive_and_wait();
      return Status::ok();
    };
  }
};

// One rank: its partitioned rig, gatherer and coordinator.
struct GatherRank {
  Rig rig;
  AlignedBuffer slots;
  std::unique_ptr<BlockGatherer> gatherer;
  std::unique_ptr<ParamCoordinator> coord;
  uint64_t bucket_elems = 500'000'000;  // allgather_bucket_size

  Status init(const Placing& p, uint32_t world, uint32_t rank, LocalBus& bus) {
    ZO_RETURN_IF_ERROR(rig.init(p, uint64_t{64} << 20, 1, world, rank));
    const uint64_t slot = BlockGatherer::slot_bytes(rig.registry, rig.plan.placement, testing::blocks());
    ZO_ASSIGN_OR_RETURN(slots, AlignedBuffer::allocate(BlockGatherer::kDefaultSlots * slot));
    BlockGathererOptions o;
    o.rank = rank;
    o.broadcast = bus.broadcast(rank);
    o.memory = slots.bytes();
    o.bucket_elems = bucket_elems;
    o.block_names = testing::block_names();
    ZO_ASSIGN_OR_RETURN(gatherer, BlockGatherer::create(*rig.store, testing::blocks(), std::move(o)));
    ZO_ASSIGN_OR_RETURN(coord, ParamCoordinator::create(*rig.store, nullptr, testing::blocks(), testing::block_names(),
                                                        opts(30'000, 1'000'000, 100, 0), gatherer.get()));
    return Status::ok();
  }

  // Positions [0, stop_at) of one micro-step; each acquired param's bytes against `expected` (none
  // when empty).
  // Returns the first acquire or release failure (the micro-step is then abandoned). `ahead`: before
  // each acquire, waits until the gatherer has the next position too, so that the acquire's
  // prefetch finds it (otherwise whether it does is a matter of timing).
  Status micro_step(const std::vector<Bytes>& expected, bool async, uint32_t stop_at = UINT32_MAX, bool ahead = false) {
    const auto bl = testing::blocks();
    const uint32_t n = static_cast<uint32_t>(bl.size());
    coord->begin_micro_step();
    for (uint32_t q = 0; q < std::min(2 * n, stop_at); ++q) {
      const uint32_t b = q < n ? q : 2 * n - 1 - q;
      if (ahead && q + 1 < 2 * n) {
        const uint32_t next = q + 1 < n ? q + 1 : 2 * n - 2 - q;
        while (gatherer->poll(q + 1, bl[next].front()) == nullptr) std::this_thread::yield();
      }
      std::vector<gpu::DevicePtr> ptrs;
      gpu::Event ready;
      if (async) {
        ZO_ASSIGN_OR_RETURN(auto a, coord->acquire_async(b));
        ptrs = a.ptrs;
        ready = a.ready;
      } else {
        ZO_ASSIGN_OR_RETURN(ptrs, coord->acquire(b));
      }
      for (size_t i = 0; i < bl[b].size() && !expected.empty(); ++i) {
        const uint32_t p = bl[b][i];
        EXPECT_EQ(rig.d2h(ptrs[i], expected[p].size(), ready), expected[p])
            << "position " << q << " param " << rig.registry.params()[p].name;
      }
      ZO_RETURN_IF_ERROR(coord->release(b));
    }
    return Status::ok();
  }
};

// Every param's compute copy as one process holding everything has it: what every rank must fetch.
inline std::vector<Bytes> whole_compute(const Placing& p) {
  Rig whole;
  Status st = whole.init(p);
  ZO_CHECK(st.is_ok()) << st.to_string();
  return whole.gather(StateKind::kCompute);
}

// Runs fn(rank, GatherRank&) on `world` threads over one bus.
inline void on_ranks(uint32_t world, const Placing& p, LocalBus& bus,
                     const std::function<void(uint32_t, GatherRank&)>& fn, uint64_t bucket_elems = 500'000'000) {
  std::vector<GatherRank> ranks(world);
  std::vector<Status> setup(world);
  for (uint32_t r = 0; r < world; ++r) {
    ranks[r].bucket_elems = bucket_elems;
    setup[r] = ranks[r].init(p, world, r, bus);
  }
  for (uint32_t r = 0; r < world; ++r) ASSERT_TRUE(setup[r].is_ok()) << "rank " << r << ": " << setup[r].to_string();
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < world; ++r) threads.emplace_back([&, r] { fn(r, ranks[r]); });
  for (std::thread& t : threads) t.join();
}

inline std::vector<Settings> settings() {
  return {
      {"defaults", CoordinatorOptions{}},
      {"no prefetch, no persistence, no reuse, tiny live", opts(0, 1, 0, 0)},
      {"bucket of one block, live of two, norms persistent", opts(30000, 60000, 200, 0)},
      {"small bucket, reuse within a layer", opts(10000, 40000, 96, 30000)},
      {"everything persistent", opts(1'000'000, 1'000'000, 1'000'000, 0)},
  };
}

inline std::unique_ptr<ParamCoordinator> make_coordinator(Rig& rig, const CoordinatorOptions& o) {
  auto coord = ParamCoordinator::create(*rig.store, rig.swapper.get(), blocks(), block_names(), o);
  ZO_CHECK(coord.is_ok()) << coord.status().to_string();
  return std::move(coord).value();
}

// Every setting, with acquire() and with acquire_async().
inline void check_every_setting(const Placing& placing) {
  for (const bool async : {false, true})
    for (const Settings& s : settings()) {
      SCOPED_TRACE(placing.describe() + " / " + s.name + (async ? " / acquire_async" : ""));
      Rig rig;
      Status st = rig.init(placing);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      const auto expected = rig.gather(StateKind::kCompute);
      auto coord = make_coordinator(rig, s.options);
      uint64_t checked = 0;
      for (int step = 0; step < 3; ++step) {
        run_micro_step(rig, *coord, expected, &checked, async);
        if (::testing::Test::HasFatalFailure()) return;
      }
      EXPECT_EQ(checked, 3u * 2 * (1 + 3 * kLayers + 2));
      const CoordinatorStats cs = coord->stats();
      // Every use of a fetchable param is a hit or a fetch; prefetches add fetches that become hits.
      if (s.options.prefetch_bucket_elems == 0) {
        EXPECT_EQ(cs.fetches + cs.hits, 3 * fetchable_uses_per_micro_step(rig));
        EXPECT_EQ(cs.prefetches, 0u);
      } else {
        EXPECT_GE(cs.fetches + cs.hits, 3 * fetchable_uses_per_micro_step(rig));
        EXPECT_LE(cs.hits, 3 * fetchable_uses_per_micro_step(rig));
      }
      if (rig.swapper) { EXPECT_EQ(rig.swapper->buffers_free(), rig.swapper->buffers_total()); }
      const gpu::DeviceStats ds = rig.device->stats();
      EXPECT_LE(ds.peak_allocated_bytes, ds.budget_bytes);
      EXPECT_LE(cs.peak_live_bytes, cs.arena_bytes);
    }
}

}  // namespace zo::engine::testing
