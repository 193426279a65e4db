#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/bnb4_blob.h"
#include "common/bytes.h"
#include "engine/memory/accounting.h"
#include "engine/config/config.h"
#include "engine/memory/memory_plan.h"
#include "engine/memory/pinned_pool.h"
#include "engine/memory/swap_file.h"
#include "gpu/host_device.h"
#include "tests/engine/test_config.h"

namespace zo::engine {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

TEST(MemoryAccounting, TracksResidentAndPeakPerTier) {
  MemoryAccounting acc;
  acc.add_resident(Tier::kDevice, 100);
  acc.add_resident(Tier::kDevice, 50);
  acc.remove_resident(Tier::kDevice, 120);
  acc.add_resident(Tier::kCpu, 4096, /*pinned=*/true);
  acc.add_resident(Tier::kCpu, 1000);
  acc.add_resident(Tier::kNvme, 8192);
  MemoryStats s = acc.snapshot();
  EXPECT_EQ(s.device.resident_bytes, 30u);
  EXPECT_EQ(s.device.peak_bytes, 150u);
  EXPECT_EQ(s.cpu.resident_bytes, 5096u);
  EXPECT_EQ(s.pinned.resident_bytes, 4096u);
  EXPECT_EQ(s.pinned.peak_bytes, 4096u);
  EXPECT_EQ(s.nvme.resident_bytes, 8192u);
}

TEST(MemoryAccounting, ResetPeaksSetsThemToResident) {
  MemoryAccounting acc;
  acc.add_resident(Tier::kCpu, 1000, true);
  acc.remove_resident(Tier::kCpu, 600, true);
  EXPECT_EQ(acc.snapshot().cpu.peak_bytes, 1000u);
  acc.reset_peaks();
  MemoryStats s = acc.snapshot();
  EXPECT_EQ(s.cpu.peak_bytes, 400u);
  EXPECT_EQ(s.pinned.peak_bytes, 400u);
  EXPECT_EQ(s.device.peak_bytes, 0u);
}

TEST(MemoryAccounting, CountsMovedBytesPerDirection) {
  MemoryAccounting acc;
  acc.add_moved(Move::kHostToDevice, 1);
  acc.add_moved(Move::kDeviceToHost, 2);
  acc.add_moved(Move::kNvmeRead, 3);
  acc.add_moved(Move::kNvmeWrite, 4);
  acc.add_moved(Move::kNvmeWrite, 4);
  MemoryStats s = acc.snapshot();
  EXPECT_EQ(s.h2d_bytes, 1u);
  EXPECT_EQ(s.d2h_bytes, 2u);
  EXPECT_EQ(s.nvme_read_bytes, 3u);
  EXPECT_EQ(s.nvme_write_bytes, 8u);
  auto j = nlohmann::json::parse(s.to_json());
  EXPECT_EQ(j["nvme_write_bytes"], 8u);
  EXPECT_EQ(j["device"]["peak_bytes"], 0u);
  EXPECT_TRUE(j.contains("pinned"));
}

TEST(MemoryAccountingDeathTest, RemovingMoreThanResidentAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  MemoryAccounting acc;
  acc.add_resident(Tier::kNvme, 10);
  EXPECT_DEATH(acc.remove_resident(Tier::kNvme, 11), "nvme");
}

TEST(TierName, NamesEveryTier) {
  EXPECT_EQ(tier_name(Tier::kDevice), "device");
  EXPECT_EQ(tier_name(Tier::kCpu), "cpu");
  EXPECT_EQ(tier_name(Tier::kNvme), "nvme");
}

// ---- check_pinned_cap -------------------------------------------------------------------------

HostInfo host_with(uint64_t available, uint64_t memlock) {
  HostInfo h;
  h.mem_total_bytes = available + kGiB;
  h.mem_available_bytes = available;
  h.memlock_limit_bytes = memlock;
  return h;
}

TEST(CheckPinnedCap, RamTooSmallNamesNumbersAndKey) {
  Status s = check_pinned_cap(30 * kGiB, true, host_with(24 * kGiB, UINT64_MAX), true, "zoffload.pinned_memory_limit");
  EXPECT_EQ(s.code(), StatusCode::kOutOfMemory);
  EXPECT_THAT(s.message(), HasSubstr("zoffload.pinned_memory_limit"));
  EXPECT_THAT(s.message(), HasSubstr("30.0 GiB"));
  EXPECT_THAT(s.message(), HasSubstr("24.0 GiB"));
  // The reserve counts too: 23 GiB + 2 GiB reserve > 24 GiB.
  EXPECT_EQ(check_pinned_cap(23 * kGiB, false, host_with(24 * kGiB, UINT64_MAX), true, "x").code(),
            StatusCode::kOutOfMemory);
}

TEST(CheckPinnedCap, MemlockTooSmallWithoutCapabilitySaysHowToFix) {
  Status s = check_pinned_cap(1 * kGiB, true, host_with(24 * kGiB, 8 * kMiB), false, "zoffload.pinned_memory_limit");
  EXPECT_EQ(s.code(), StatusCode::kOutOfMemory);
  EXPECT_THAT(s.message(), HasSubstr("zoffload.pinned_memory_limit"));
  EXPECT_THAT(s.message(), HasSubstr("1.00 GiB"));
  EXPECT_THAT(s.message(), HasSubstr("8.00 MiB"));
  EXPECT_THAT(s.message(), HasSubstr("ulimit -l"));
  EXPECT_THAT(s.message(), HasSubstr("limits.conf"));
  EXPECT_THAT(s.message(), HasSubstr("pin_memory false"));
}

TEST(CheckPinnedCap, CapabilityLiftsMemlock) {
  EXPECT_TRUE(check_pinned_cap(1 * kGiB, true, host_with(24 * kGiB, 8 * kMiB), true, "x").is_ok());
}

TEST(CheckPinnedCap, PageableIgnoresMemlock) {
  EXPECT_TRUE(check_pinned_cap(1 * kGiB, false, host_with(24 * kGiB, 8 * kMiB), false, "x").is_ok());
}

TEST(CheckPinnedCap, UnlimitedMemlockAndFitsIsOk) {
  EXPECT_TRUE(check_pinned_cap(4 * kGiB, true, host_with(24 * kGiB, UINT64_MAX), false, "x").is_ok());
  EXPECT_TRUE(check_pinned_cap(8 * kMiB, true, host_with(24 * kGiB, 8 * kMiB), false, "x").is_ok());
}

TEST(ProcessCanLockUnlimited, AgreesWithProcStatus) {
  // Independent reading of the same fact: bit 14 (CAP_IPC_LOCK) of CapEff.
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) GTEST_SKIP() << "no /proc/self/status";
  char line[512];
  std::optional<bool> cap;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long long bits = 0;
    if (std::sscanf(line, "CapEff: %llx", &bits) == 1) cap = ((bits >> 14) & 1) != 0;
  }
  std::fclose(f);
  ASSERT_TRUE(cap.has_value());
  EXPECT_EQ(process_can_lock_unlimited(), *cap);
}

// ---- PinnedPool -------------------------------------------------------------------------------

std::unique_ptr<gpu::HostDevice> host_device() {
  auto d = gpu::HostDevice::create(64 * kMiB);
  ZO_CHECK(d.is_ok()) << d.status().to_string();
  return std::move(d).value();
}

TEST(PinnedPool, CarvesAlignedSpansAndReusesFirstFit) {
  auto dev = host_device();
  MemoryAccounting acc;
  auto pool = PinnedPool::create(*dev, 10 * 4096 - 100, true, &acc);
  ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  PinnedPool& p = **pool;
  EXPECT_TRUE(p.pinned());
  EXPECT_EQ(p.capacity_bytes(), 10 * 4096u);
  auto a = p.allocate(1, "a");
  auto b = p.allocate(4097, "b");
  auto c = p.allocate(3 * 4096, "c");
  ASSERT_TRUE(a.is_ok() && b.is_ok() && c.is_ok());
  EXPECT_EQ(a->size(), 4096u);
  EXPECT_EQ(b->size(), 8192u);
  for (auto s : {*a, *b, *c}) EXPECT_EQ(reinterpret_cast<uintptr_t>(s.data()) % kPinnedAlignment, 0u);
  EXPECT_EQ(b->data(), a->data() + 4096);
  EXPECT_EQ(c->data(), b->data() + 8192);
  EXPECT_EQ(p.used_bytes(), 6 * 4096u);
  p.free(*b);
  // First fit: a 1-unit request goes into b's hole, not after c.
  auto d = p.allocate(4096, "d");
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(d->data(), a->data() + 4096);
  // Freeing a and d coalesces [0, 3) units so a 3-unit span fits there again.
  p.free(*a);
  p.free(*d);
  auto e = p.allocate(3 * 4096, "e");
  ASSERT_TRUE(e.is_ok());
  EXPECT_EQ(e->data(), a->data());
  EXPECT_EQ(p.peak_used_bytes(), 6 * 4096u);
  std::memset(e->data(), 0xab, e->size());  // the bytes are really there
  p.free(*e);
  p.free(*c);
  EXPECT_EQ(p.used_bytes(), 0u);
  EXPECT_EQ(p.peak_used_bytes(), 6 * 4096u);
}

TEST(PinnedPool, OverCapacityNamesWhatAndNumbers) {
  auto dev = host_device();
  auto pool = PinnedPool::create(*dev, 4 * 4096, false, nullptr);
  ASSERT_TRUE(pool.is_ok());
  EXPECT_FALSE((*pool)->pinned());
  auto a = (*pool)->allocate(2 * 4096, "first");
  ASSERT_TRUE(a.is_ok());
  auto b = (*pool)->allocate(3 * 4096, "optimizer swap buffer 2");
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
  EXPECT_THAT(b.status().message(), HasSubstr("optimizer swap buffer 2"));
  EXPECT_THAT(b.status().message(), HasSubstr("12.0 KiB"));
  EXPECT_THAT(b.status().message(), HasSubstr("8.00 KiB"));
  EXPECT_THAT(b.status().message(), HasSubstr("16.0 KiB"));
  (*pool)->free(*a);
}

TEST(PinnedPool, CountsItsBlockInAccountingAndDeviceStats) {
  auto dev = host_device();
  MemoryAccounting acc;
  {
    auto pinned = PinnedPool::create(*dev, 8192, true, &acc);
    auto pageable = PinnedPool::create(*dev, 4096, false, &acc);
    ASSERT_TRUE(pinned.is_ok() && pageable.is_ok());
    MemoryStats s = acc.snapshot();
    EXPECT_EQ(s.cpu.resident_bytes, 12288u);
    EXPECT_EQ(s.pinned.resident_bytes, 8192u);
    EXPECT_EQ(dev->stats().pinned_bytes, 8192u);
  }
  MemoryStats s = acc.snapshot();
  EXPECT_EQ(s.cpu.resident_bytes, 0u);
  EXPECT_EQ(s.pinned.resident_bytes, 0u);
  EXPECT_EQ(s.pinned.peak_bytes, 8192u);
  EXPECT_EQ(dev->stats().pinned_bytes, 0u);
}

TEST(PinnedPool, EmptyPoolIsAllowedAndRefusesCarving) {
  auto dev = host_device();
  auto pool = PinnedPool::create(*dev, 0, true, nullptr);
  ASSERT_TRUE(pool.is_ok());
  EXPECT_EQ((*pool)->capacity_bytes(), 0u);
  EXPECT_EQ((*pool)->allocate(1, "x").status().code(), StatusCode::kOutOfMemory);
}

TEST(PinnedPoolDeathTest, FreeingAnUnknownSpanAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto dev = host_device();
  auto pool = PinnedPool::create(*dev, 8192, false, nullptr);
  ASSERT_TRUE(pool.is_ok());
  auto a = (*pool)->allocate(4096, "a");
  ASSERT_TRUE(a.is_ok());
  EXPECT_DEATH((*pool)->free(std::span<std::byte>(a->data() + 4096, 4096)), "not carved");
}

// ---- ParamRegistry ----------------------------------------------------------------------------

ParamSpec spec(std::string name, std::vector<int64_t> shape) { return ParamSpec{std::move(name), std::move(shape)}; }

ParamRegistry must_build(std::vector<ParamSpec> params, uint64_t sub_group_size) {
  auto r = ParamRegistry::build(std::move(params), sub_group_size);
  ZO_CHECK(r.is_ok()) << r.status().to_string();
  return std::move(r).value();
}

// Every element of every param is covered exactly once, pieces agree with params and groups, and
// groups are filled back to back in the flat space.
void expect_consistent(const ParamRegistry& r, uint64_t sub_group_size) {
  uint64_t flat = 0;
  for (const SubGroup& g : r.sub_groups()) {
    EXPECT_EQ(g.first_elem, flat);
    EXPECT_GT(g.n_elems, 0u);
    EXPECT_LE(g.n_elems, sub_group_size);
    uint64_t in_group = 0;
    for (const ParamPiece& piece : r.pieces_of_group(g.index)) {
      EXPECT_EQ(piece.sub_group, g.index);
      EXPECT_EQ(piece.group_offset, in_group);
      in_group += piece.n_elems;
      const ParamInfo& p = r.params()[piece.param];
      // A piece that is not its param's last fills its group alone, a multiple of 4096 elements.
      if (piece.param_offset + piece.n_elems < p.n_elems) {
        EXPECT_EQ(g.n_pieces, 1u) << "group " << g.index;
        EXPECT_EQ(g.n_elems % kSplitAlignElems, 0u) << "group " << g.index;
      }
    }
    EXPECT_EQ(in_group, g.n_elems);
    flat += g.n_elems;
  }
  EXPECT_EQ(flat, r.total_elems());
  uint64_t total = 0;
  for (const ParamInfo& p : r.params()) {
    auto flat_of = [&](const ParamPiece& piece) {
      return r.sub_groups()[piece.sub_group].first_elem + piece.group_offset;
    };
    const uint64_t start = flat_of(r.pieces_of_param(p.id)[0]);
    uint64_t covered = 0;
    uint32_t prev_group = 0;
    for (const ParamPiece& piece : r.pieces_of_param(p.id)) {
      EXPECT_EQ(piece.param, p.id);
      EXPECT_EQ(piece.param_offset, covered);
      if (covered > 0) {
        EXPECT_EQ(piece.sub_group, prev_group + 1);  // consecutive groups
      }
      EXPECT_EQ(flat_of(piece), start + covered);  // contiguous in the flat space
      covered += piece.n_elems;
      prev_group = piece.sub_group;
    }
    EXPECT_EQ(covered, p.n_elems) << p.name;
    total += p.n_elems;
  }
  EXPECT_EQ(total, r.total_elems());
}

TEST(ParamRegistry, PacksWholeParamsWhileTheyFit) {
  auto r = must_build({spec("a", {3000}), spec("b", {1000, 2}), spec("c", {8000}), spec("d", {10})}, 10000);
  ASSERT_EQ(r.sub_groups().size(), 2u);
  EXPECT_EQ(r.sub_groups()[0].n_elems, 5000u);  // a + b
  EXPECT_EQ(r.sub_groups()[1].n_elems, 8010u);  // c + d: c did not fit after a, b
  EXPECT_EQ(r.params()[1].n_elems, 2000u);
  EXPECT_EQ(r.pieces_of_group(1)[1].group_offset, 8000u);
  EXPECT_EQ(r.max_group_elems(), 8010u);
  EXPECT_EQ(r.max_param_elems(), 8000u);
  EXPECT_EQ(r.total_elems(), 13010u);
  expect_consistent(r, 10000);
}

TEST(ParamRegistry, SplitsABigParamIntoAlignedGroupsOfItsOwn) {
  // sub_group_size 10000 → pieces of 8192; a 30000-element param after a small one.
  auto r = must_build({spec("small", {100}), spec("big", {30000}), spec("tail", {500})}, 10000);
  auto big = r.pieces_of_param(1);
  ASSERT_EQ(big.size(), 4u);
  EXPECT_EQ(big[0].sub_group, 1u);  // the small one's group is closed
  EXPECT_EQ(big[0].n_elems, 8192u);
  EXPECT_EQ(big[1].n_elems, 8192u);
  EXPECT_EQ(big[2].n_elems, 8192u);
  EXPECT_EQ(big[3].n_elems, 30000u - 3 * 8192);
  EXPECT_EQ(big[3].param_offset, 3 * 8192u);
  // The last piece may be followed by the next params.
  EXPECT_EQ(r.pieces_of_param(2)[0].sub_group, big[3].sub_group);
  EXPECT_EQ(r.sub_groups().size(), 5u);
  EXPECT_EQ(r.sub_groups()[4].n_elems, 30000u - 3 * 8192 + 500);
  expect_consistent(r, 10000);
}

TEST(ParamRegistry, RandomShapesAreCoveredExactlyOnce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const uint64_t sgs = kSplitAlignElems + rng() % 50000;
    std::vector<ParamSpec> params;
    const int n = 1 + static_cast<int>(rng() % 30);
    for (int i = 0; i < n; ++i) {
      std::vector<int64_t> shape;
      const int dims = 1 + static_cast<int>(rng() % 3);
      for (int d = 0; d < dims; ++d) shape.push_back(1 + static_cast<int64_t>(rng() % (dims == 1 ? 200000 : 400)));
      params.push_back(spec("p" + std::to_string(i), shape));
    }
    auto r = must_build(params, sgs);
    SCOPED_TRACE("trial " + std::to_string(trial) + " sub_group_size " + std::to_string(sgs));
    expect_consistent(r, sgs);
  }
}

TEST(ParamRegistry, PartitionsAreContiguousBalancedAndCutNoSubGroup) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 60; ++trial) {
    const uint64_t sgs = kSplitAlignElems + rng() % 50000;
    const auto world = static_cast<uint32_t>(2 + rng() % 4);
    std::vector<ParamSpec> params;
    const int n = 1 + static_cast<int>(rng() % 30);
    for (int i = 0; i < n; ++i)
      params.push_back(spec("p" + std::to_string(i), {1 + static_cast<int64_t>(rng() % 300000)}));
    auto built = ParamRegistry::build(params, sgs, world);
    if (!built.is_ok()) {  // only a model too small to cut
      EXPECT_THAT(built.status().message(), HasSubstr("too few to partition"));
      continue;
    }
    const ParamRegistry& r = *built;
    SCOPED_TRACE("trial " + std::to_string(trial) + " world " + std::to_string(world));
    expect_consistent(r, sgs);
    ASSERT_EQ(r.n_partitions(), world);
    uint32_t next = 0;
    for (uint32_t p = 0; p < world; ++p) {
      const auto [first, end] = r.partition_groups(p);
      EXPECT_EQ(first, next);
      EXPECT_LT(first, end);
      for (uint32_t g = first; g < end; ++g) EXPECT_EQ(r.partition_of_group(g), p);
      // Each boundary is within half a split alignment of total·p/world.
      const uint64_t start = r.sub_groups()[first].first_elem;
      const auto target = static_cast<uint64_t>(static_cast<unsigned __int128>(r.total_elems()) * p / world);
      EXPECT_LE(start > target ? start - target : target - start, kSplitAlignElems / 2) << "partition " << p;
      next = end;
    }
    EXPECT_EQ(next, r.sub_groups().size());
  }
  auto small = ParamRegistry::build({spec("a", {100})}, 1 << 20, 2);
  ASSERT_FALSE(small.is_ok());
  EXPECT_THAT(small.status().message(), HasSubstr("too few to partition over 2 data-parallel ranks"));
}

TEST(ParamRegistry, FindsByNameAndSuggestsACloseOne) {
  auto r = must_build({spec("model.layers.0.mlp.up_proj.weight", {64, 64}), spec("model.norm.weight", {64})}, 1 << 20);
  auto id = r.find("model.norm.weight");
  ASSERT_TRUE(id.is_ok());
  EXPECT_EQ(*id, 1u);
  auto missing = r.find("model.norm.wieght");
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("did you mean \"model.norm.weight\""));
  EXPECT_THAT(r.find("lm_head.weight").status().message(), ::testing::Not(HasSubstr("did you mean")));
}

TEST(ParamRegistry, RejectsBadInputNamingIt) {
  EXPECT_EQ(ParamRegistry::build({}, 1 << 20).status().code(), StatusCode::kInvalidArgument);
  auto dup = ParamRegistry::build({spec("w", {2}), spec("w", {3})}, 1 << 20);
  EXPECT_THAT(dup.status().message(), HasSubstr("w is registered twice"));
  auto zero = ParamRegistry::build({spec("w", {2, 0})}, 1 << 20);
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(zero.status().message(), HasSubstr("parameter w"));
  auto unnamed = ParamRegistry::build({spec("", {2})}, 1 << 20);
  EXPECT_THAT(unnamed.status().message(), HasSubstr("empty name"));
  auto tiny = ParamRegistry::build({spec("w", {2})}, 4095);
  EXPECT_THAT(tiny.status().message(), HasSubstr("sub_group_size"));
}

TEST(StateName, NamesEveryState) {
  EXPECT_EQ(state_name(StateKind::kMaster), "master");
  EXPECT_EQ(state_name(StateKind::kExpAvg), "exp_avg");
  EXPECT_EQ(state_name(StateKind::kExpAvgSq), "exp_avg_sq");
  EXPECT_EQ(state_name(StateKind::kGradAccum), "grad_accum");
  EXPECT_EQ(state_name(StateKind::kCompute), "compute");
}

// ---- plan_memory ------------------------------------------------------------------------------

struct Offload {
  std::string optimizer = "none";
  std::string param = "none";
  bool pipeline_read = false;
  bool pipeline_write = false;
  uint64_t optimizer_buffer_count = 4;
  uint64_t param_buffer_count = 5;
  uint64_t param_buffer_size = 100'000'000;
  uint64_t max_in_cpu = 1'000'000'000;
  bool pin_optimizer = true;
  bool pin_param = true;
  uint64_t sub_group_size = 1'000'000'000;
  bool bf16 = true;
};

Config config_for(const Offload& o) {
  json oo = {{"device", o.optimizer},
             {"buffer_count", o.optimizer_buffer_count},
             {"pin_memory", o.pin_optimizer},
             {"pipeline_read", o.pipeline_read},
             {"pipeline_write", o.pipeline_write}};
  json op = {{"device", o.param},
             {"buffer_count", o.param_buffer_count},
             {"buffer_size", o.param_buffer_size},
             {"max_in_cpu", o.max_in_cpu},
             {"pin_memory", o.pin_param}};
  if (o.optimizer == "nvme") oo["nvme_path"] = "/nvme";
  if (o.param == "nvme") op["nvme_path"] = "/nvme";
  json j = {{"train_micro_batch_size_per_gpu", 1},
            {"bf16", {{"enabled", o.bf16}}},
            {"zero_optimization",
             {{"stage", 3}, {"sub_group_size", o.sub_group_size}, {"offload_optimizer", oo}, {"offload_param", op}}}};
  return parse_test_config(j.dump());
}

// `n` params of `elems` elements each.
ParamRegistry uniform(uint32_t n, uint64_t elems, uint64_t sub_group_size) {
  std::vector<ParamSpec> params;
  for (uint32_t i = 0; i < n; ++i) params.push_back(spec("p" + std::to_string(i), {static_cast<int64_t>(elems)}));
  return must_build(std::move(params), sub_group_size);
}

MemoryPlan must_plan(const Config& c, const ParamRegistry& r) {
  auto p = plan_memory(c, r);
  ZO_CHECK(p.is_ok()) << p.status().to_string();
  return std::move(p).value();
}

TEST(PlanMemory, EverythingOnTheDeviceByDefault) {
  Offload o;
  auto r = uniform(4, 10000, 1 << 20);
  MemoryPlan p = must_plan(config_for(o), r);
  EXPECT_EQ(p.placement.optimizer, Tier::kDevice);
  EXPECT_EQ(p.placement.grad, Tier::kDevice);
  EXPECT_EQ(p.placement.compute_dtype, DType::kBF16);
  EXPECT_EQ(p.placement.grad_dtype, DType::kF32);
  EXPECT_EQ(p.n_sub_groups, 1u);
  // master, m, v, grad fp32 + bf16 compute = 18 bytes per element, each section device-aligned.
  EXPECT_EQ(p.device_bytes, 4 * 160000u + align_up(80000, gpu::kDeviceAlignment));
  EXPECT_EQ(p.pinned_pool_bytes(), 0u);
  EXPECT_EQ(p.cpu_pinned_bytes + p.cpu_pageable_bytes + p.nvme_optimizer_bytes + p.nvme_param_bytes, 0u);
}

TEST(PlanMemory, APartitionHoldsItsOwnOptimizerStatesFromStage2ItsGradientsAndAtStage3ItsComputeCopies) {
  Offload o;
  o.optimizer = "cpu";
  o.param = "cpu";
  std::vector<ParamSpec> params;
  for (int i = 0; i < 8; ++i) params.push_back(spec("p" + std::to_string(i), {100000}));
  auto reg = ParamRegistry::build(params, 1 << 17, 2);
  ASSERT_TRUE(reg.is_ok());
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    Config c = config_for(o);
    c.zero.stage = stage;
    const MemoryPlan whole = must_plan(c, must_build(params, 1 << 17));
    // Pageable: the optimizer states (12 B per element) of the rank's half; the gradient
    // accumulators (4 B) of every element at stage 1, of its half from stage 2. Pinned: every
    // compute copy, its half at stage 3 (then gathered by block, and read by no parameter swapper).
    const double grads_whole = stage >= 2 ? 0 : 4.0 * 800000;
    const double per_elem = stage >= 2 ? 16.0 : 12.0;
    double parts = 0;
    for (uint32_t rank = 0; rank < 2; ++rank) {
      auto p = plan_memory(c, *reg, rank);
      ASSERT_TRUE(p.is_ok()) << p.status().to_string();
      EXPECT_TRUE(p->partitioned());
      EXPECT_EQ(p->partition_grads, stage >= 2);
      EXPECT_EQ(p->partition_params, stage == 3);
      EXPECT_EQ(std::make_pair(p->owned_begin, p->owned_end), reg->partition_groups(rank));
      if (stage < 3) {
        EXPECT_EQ(p->cpu_pinned_bytes, whole.cpu_pinned_bytes);
      } else {
        EXPECT_NEAR(static_cast<double>(p->cpu_pinned_bytes), whole.cpu_pinned_bytes / 2.0, 2 * 4 * 4096);
        for (uint32_t g = 0; g < p->n_sub_groups; ++g)
          EXPECT_EQ(p->holds(g, StateKind::kCompute), p->owns(g)) << "sub-group " << g;
      }
      const double own = static_cast<double>(p->cpu_pageable_bytes) - grads_whole;
      EXPECT_NEAR(own, per_elem * 400000, per_elem * 4096 + 4 * 4 * 4096);
      parts += own;
    }
    EXPECT_NEAR(parts, static_cast<double>(whole.cpu_pageable_bytes) - grads_whole, per_elem * 4096 * 4);
  }
}

// Note [Frozen sub-groups]: a sub-group never mixes frozen and trainable params; where nothing is
// frozen the layout is the one without the rule.
TEST(ParamRegistry, FrozenAndTrainableParamsNeverShareASubGroup) {
  std::mt19937 rng(45);
  for (int trial = 0; trial < 60; ++trial) {
    const uint64_t sgs = kSplitAlignElems + rng() % 50000;
    const auto world = static_cast<uint32_t>(1 + rng() % 3);
    std::vector<ParamSpec> params;
    const int n = 1 + static_cast<int>(rng() % 30);
    for (int i = 0; i < n; ++i) {
      params.push_back(spec("p" + std::to_string(i), {1 + static_cast<int64_t>(rng() % 60000)}));
      params.back().trainable = rng() % 3 != 0;
    }
    auto built = ParamRegistry::build(params, sgs, world);
    if (!built.is_ok()) continue;  // a model too small to cut over the ranks
    const ParamRegistry& r = *built;
    SCOPED_TRACE("trial " + std::to_string(trial));
    expect_consistent(r, sgs);
    uint64_t trainable = 0, largest = 0;
    for (const SubGroup& g : r.sub_groups()) {
      for (const ParamPiece& piece : r.pieces_of_group(g.index))
        EXPECT_EQ(r.params()[piece.param].trainable, g.trainable) << "sub-group " << g.index;
      if (g.trainable) {
        trainable += g.n_elems;
        largest = std::max(largest, g.n_elems);
      }
    }
    EXPECT_EQ(r.trainable_elems(), trainable);
    EXPECT_EQ(r.max_trainable_group_elems(), largest);
    // The rule only adds boundaries: every trainable one's layout stays the plain rule's.
    for (ParamSpec& p : params) p.trainable = true;
    auto all = ParamRegistry::build(params, sgs, world);
    ASSERT_TRUE(all.is_ok());
    EXPECT_LE(all->sub_groups().size(), r.sub_groups().size());
    EXPECT_EQ(all->trainable_elems(), all->total_elems());
    EXPECT_EQ(all->max_trainable_group_elems(), all->max_group_elems());
  }
  // Packed together when trainable alike, apart otherwise.
  auto alike = must_build({spec("a", {3000}), spec("b", {1000}), spec("c", {2000})}, 10000);
  EXPECT_EQ(alike.sub_groups().size(), 1u);
  std::vector<ParamSpec> mixed = {spec("a", {3000}), spec("b", {1000}), spec("c", {2000})};
  mixed[1].trainable = false;
  auto apart = must_build(mixed, 10000);
  ASSERT_EQ(apart.sub_groups().size(), 3u);
  EXPECT_FALSE(apart.sub_groups()[1].trainable);
  EXPECT_EQ(apart.trainable_elems(), 5000u);
  EXPECT_EQ(apart.max_trainable_group_elems(), 3000u);
}

// A frozen sub-group holds its compute copy and nothing else on every tier; the optimizer's buffers
// are sized for the trainable sub-groups.
TEST(PlanMemory, FrozenSubGroupsHoldOnlyTheirComputeCopy) {
  for (const std::string tier : {"none", "cpu", "nvme"}) {
    SCOPED_TRACE(tier);
    Offload o;
    o.optimizer = tier;
    o.param = tier;
    o.sub_group_size = 8192;
    o.max_in_cpu = 0;  // with param nvme, every compute copy on the drive
    // The frozen embedding fills four sub-groups (8192, 8192, 8192, 5424); q, k and the norm one
    // of 2064.
    std::vector<ParamSpec> params = {spec("embed", {30000}), spec("q", {1000}), spec("k", {1000}), spec("norm", {64})};
    params[0].trainable = false;
    const ParamRegistry r = must_build(params, 8192);
    const MemoryPlan p = must_plan(config_for(o), r);
    ASSERT_EQ(p.n_sub_groups, 5u);
    ASSERT_EQ(p.frozen.size(), p.n_sub_groups);
    for (const SubGroup& g : r.sub_groups()) {
      EXPECT_EQ(p.is_frozen(g.index), !g.trainable);
      EXPECT_EQ(p.steps(g.index), g.trainable);
      EXPECT_TRUE(p.holds(g.index, StateKind::kCompute));
      for (StateKind k : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kGradAccum})
        EXPECT_EQ(p.holds(g.index, k), g.trainable) << "sub-group " << g.index << " " << state_name(k);
    }
    EXPECT_EQ(p.stepped, std::vector<uint32_t>{4});
    // Where the optimizer lives: 16 bytes (fp32 master, moments, accumulator) per trainable element,
    // each state a whole number of pages; the bf16 compute copies of every element where they live.
    const uint64_t states = 4 * align_up(2064 * 4, 4096);
    const uint64_t computes = 3 * align_up(8192 * 2, 4096) + align_up(5424 * 2, 4096) + align_up(2064 * 2, 4096);
    if (tier == "cpu") {
      EXPECT_EQ(p.cpu_pageable_bytes, states);
      EXPECT_EQ(p.cpu_pinned_bytes, computes);
      // The new compute copy of a stepped sub-group leaves through staging as large as the largest.
      EXPECT_EQ(p.compute_staging_buffers, 0u);  // every compute copy is on the CPU
    }
    if (tier == "nvme") {
      EXPECT_EQ(p.nvme_optimizer_bytes, states);
      EXPECT_EQ(p.nvme_param_bytes, computes);
      // One swap buffer, for the one trainable sub-group's four states and its new compute copy
      // (not for the embedding's larger sub-groups, which are never stepped).
      EXPECT_EQ(p.optimizer_swap_buffers, 1u);
      EXPECT_EQ(p.optimizer_swap_buffer_bytes, states + align_up(2064 * 2, kSwapAlignment));
    }
    EXPECT_EQ(nlohmann::json::parse(p.to_json())["frozen_sub_groups"], 4);
  }
  // Nothing frozen: no per-group flags, and every owned sub-group is stepped.
  const MemoryPlan all = must_plan(config_for(Offload{}), must_build({spec("a", {100}), spec("b", {100})}, 8192));
  EXPECT_TRUE(all.frozen.empty());
  EXPECT_EQ(all.stepped, std::vector<uint32_t>{0});
}

// Note [The packed 4-bit base]: a packed weight counts its blob's elements everywhere the registry
// and the plan count (sub-groups, bytes per tier) and keeps its own shape and weight count; a
// trainable one is refused.
TEST(ParamRegistry, APackedWeightCountsItsBlob) {
  const uint64_t n = 1000 * 3000, blob_elems = bnb4::blob_bytes(0, 1000, 3000) / 2;  // bf16 compute
  std::vector<ParamSpec> params = {spec("embed", {100, 64}), spec("q_proj.weight", {1000, 3000}), spec("norm", {64})};
  params[1].trainable = false;
  params[1].storage_elems = blob_elems;
  const ParamRegistry r = must_build(params, 1 << 20);
  const ParamInfo& q = r.params()[1];
  EXPECT_TRUE(q.packed);
  EXPECT_EQ(q.n_elems, blob_elems);
  EXPECT_EQ(q.weights(), n);
  EXPECT_EQ(q.shape, (std::vector<int64_t>{1000, 3000}));
  EXPECT_EQ(r.total_elems(), 6400 + blob_elems + 64);
  EXPECT_EQ(r.total_weights(), 6400 + n + 64);
  EXPECT_EQ(r.packed_weights(), n);
  EXPECT_EQ(r.packed_elems(), blob_elems);
  EXPECT_LT(blob_elems * 2, n * 2 * 29 / 100);  // 4.5 bits a weight: 0.28x bf16
  Offload o;
  o.optimizer = "cpu";
  o.param = "cpu";
  const MemoryPlan p = must_plan(config_for(o), r);
  EXPECT_EQ(p.cpu_pinned_bytes, align_up(6400 * 2, 4096) + align_up(blob_elems * 2, 4096) + align_up(64 * 2, 4096));
  params[1].trainable = true;
  auto trained = ParamRegistry::build(params, 1 << 20);
  EXPECT_EQ(trained.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(trained.status().message().find("q_proj.weight is packed in 4 bits but trainable"), std::string::npos)
      << trained.status().to_string();
}

TEST(PlanMemory, OptimizerOnCpuStagesComputeCopiesForTheDevice) {
  Offload o;
  o.optimizer = "cpu";
  auto r = uniform(3, 4096, 8192);  // groups of 8192 and 4096 elements
  MemoryPlan p = must_plan(config_for(o), r);
  ASSERT_EQ(p.n_sub_groups, 2u);
  // Master, moments and accumulators never cross PCIe: pageable even with pin_memory true; the
  // staging buffers the new compute copies go to the device through are pinned (DMA buffers).
  EXPECT_EQ(p.cpu_pinned_bytes, 0u);
  EXPECT_EQ(p.cpu_pageable_bytes, 3 * 4096u * 16);
  EXPECT_EQ(p.device_bytes, 3 * 4096u * 2);
  EXPECT_EQ(p.compute_staging_buffers, 2u);
  EXPECT_EQ(p.compute_staging_buffer_bytes, 8192u * 2);
  EXPECT_EQ(p.optimizer_swap_buffers, 0u);
  EXPECT_EQ(p.pinned_pool_bytes(), 2 * 16384u);
  EXPECT_FALSE(state_is_pinned(p.placement, StateKind::kMaster));
  EXPECT_FALSE(state_is_pinned(p.placement, StateKind::kGradAccum));
  // pin_memory false changes nothing for the states; the pool stays pinned for the buffers while
  // offload_param.pin_memory is true (MemoryPlan does not decide that: StateStore does).
  o.pin_optimizer = false;
  MemoryPlan q = must_plan(config_for(o), r);
  EXPECT_EQ(q.cpu_pinned_bytes, 0u);
  EXPECT_EQ(q.cpu_pageable_bytes, 3 * 4096u * 16);
  EXPECT_EQ(q.pinned_pool_bytes(), 2 * 16384u);
  // Compute on the CPU too: nothing to stage.
  o.param = "cpu";
  MemoryPlan c = must_plan(config_for(o), r);
  EXPECT_EQ(c.compute_staging_buffers, 0u);
  EXPECT_EQ(c.device_bytes, 0u);
  EXPECT_EQ(c.cpu_pinned_bytes, 3 * 4096u * 2);  // the compute copies, pinned per offload_param
}

TEST(PlanMemory, PinnedPoolDoesNotGrowWithTheNumberOfSubGroups) {
  Offload o;
  o.optimizer = "nvme";
  o.pipeline_read = o.pipeline_write = true;
  o.sub_group_size = 1'000'000'000;  // the DeepSpeed default: not what sizes the buffers
  const uint64_t group = 100'000;
  Config c = config_for(o);
  c.zero.sub_group_size = group;
  MemoryPlan ten = must_plan(c, uniform(10, group, group));
  MemoryPlan thousand = must_plan(c, uniform(1000, group, group));
  EXPECT_EQ(ten.n_sub_groups, 10u);
  EXPECT_EQ(thousand.n_sub_groups, 1000u);
  EXPECT_EQ(ten.optimizer_swap_buffers, 3u);
  EXPECT_EQ(ten.pinned_pool_bytes(), thousand.pinned_pool_bytes());
  EXPECT_EQ(thousand.nvme_optimizer_bytes, 100 * ten.nvme_optimizer_bytes);
  // Each buffer: master|m|v|grad (fp32) | compute (bf16), each section 4 KiB-aligned.
  const uint64_t fp32 = align_up(group * 4, 4096), bf16 = align_up(group * 2, 4096);
  EXPECT_EQ(ten.optimizer_swap_buffer_bytes, 4 * fp32 + bf16);
  EXPECT_EQ(ten.pinned_pool_bytes(), 3 * (4 * fp32 + bf16));
  EXPECT_EQ(ten.nvme_optimizer_bytes, 10 * 4 * fp32);
  EXPECT_EQ(ten.device_bytes, 10 * align_up(group * 2, gpu::kDeviceAlignment));
}

TEST(PlanMemory, BuffersAreSizedFromTheLargestRealGroupNotSubGroupSize) {
  Offload o;
  o.optimizer = "nvme";
  Config c = config_for(o);  // sub_group_size 1e9
  auto r = must_build({spec("a", {5000}), spec("b", {7000}), spec("c", {3})}, c.zero.sub_group_size);
  MemoryPlan p = must_plan(c, r);
  EXPECT_EQ(p.n_sub_groups, 1u);
  EXPECT_EQ(p.optimizer_swap_buffers, 1u);  // 1 + no pipelining, and only one group anyway
  EXPECT_EQ(p.optimizer_swap_buffer_bytes, 4 * align_up(12003 * 4, 4096) + align_up(12003 * 2, 4096));
  EXPECT_LT(p.pinned_pool_bytes(), 1u << 20);
}

TEST(PlanMemory, MaxInCpuKeepsLeadingGroupsOnTheCpu) {
  Offload o;
  o.optimizer = "cpu";
  o.param = "nvme";
  o.max_in_cpu = 25000;
  o.param_buffer_count = 2;
  Config c = config_for(o);
  c.zero.sub_group_size = 10000;
  auto r = uniform(5, 10000, 10000);
  MemoryPlan p = must_plan(c, r);
  ASSERT_EQ(p.placement.compute.size(), 5u);
  EXPECT_EQ(p.placement.compute[0], Tier::kCpu);
  EXPECT_EQ(p.placement.compute[1], Tier::kCpu);
  EXPECT_EQ(p.placement.compute[2], Tier::kNvme);
  EXPECT_EQ(p.placement.compute[4], Tier::kNvme);
  EXPECT_EQ(p.nvme_param_bytes, 3 * align_up(20000, 4096));
  EXPECT_EQ(p.param_swap_buffers, 2u);
  EXPECT_EQ(p.param_swap_buffer_bytes, align_up(20000, 4096) + 2 * 4096);
  EXPECT_EQ(p.compute_staging_buffers, 2u);  // groups 2..4 go to NVMe through staging
  auto j = json::parse(p.to_json());
  EXPECT_EQ(j["placement"]["compute"]["cpu"], 2);
  EXPECT_EQ(j["placement"]["compute"]["nvme"], 3);
  EXPECT_EQ(j["placement"]["optimizer"], "cpu");
  EXPECT_EQ(j["pinned_pool_bytes"], p.pinned_pool_bytes());
  EXPECT_EQ(j["param_swap_buffers"], 2);
}

TEST(PlanMemory, ParamBuffersAtMostTheParamsOnNvme) {
  Offload o;
  o.optimizer = "nvme";
  o.param = "nvme";
  o.max_in_cpu = 0;
  auto r = uniform(2, 5000, 1 << 20);
  MemoryPlan p = must_plan(config_for(o), r);
  EXPECT_EQ(p.param_swap_buffers, 2u);       // buffer_count 5, but only 2 params
  EXPECT_EQ(p.compute_staging_buffers, 0u);  // the optimizer swap buffer carries the compute section
}

TEST(PlanMemory, ParamOffloadWithoutOptimizerOffloadNamesTheKey) {
  Config c = config_for(Offload{});
  c.zero.offload_param.device = OffloadDevice::kCpu;
  auto p = plan_memory(c, uniform(1, 10, 1 << 20));
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), HasSubstr("zero_optimization.offload_param.device"));
  EXPECT_THAT(p.status().message(), HasSubstr("offload_optimizer"));
}

TEST(PlanMemory, TooFewOptimizerBuffersForThePipelineNamesTheKey) {
  Offload o;
  o.optimizer = "nvme";
  o.pipeline_read = o.pipeline_write = true;
  o.optimizer_buffer_count = 2;
  auto p = plan_memory(config_for(o), uniform(1, 10, 1 << 20));
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), HasSubstr("zero_optimization.offload_optimizer.buffer_count"));
  EXPECT_THAT(p.status().message(), HasSubstr("needs 3"));
}

TEST(PlanMemory, ParamBufferSizeBelowTheLargestParamNamesKeyAndParam) {
  Offload o;
  o.optimizer = "cpu";
  o.param = "nvme";
  o.max_in_cpu = 0;
  o.param_buffer_size = 1000;
  auto r = must_build({spec("small", {500}), spec("model.embed_tokens.weight", {100, 64})}, 1 << 20);
  auto p = plan_memory(config_for(o), r);
  ASSERT_FALSE(p.is_ok());
  EXPECT_THAT(p.status().message(), HasSubstr("zero_optimization.offload_param.buffer_size"));
  EXPECT_THAT(p.status().message(), HasSubstr("model.embed_tokens.weight"));
  EXPECT_THAT(p.status().message(), HasSubstr("6400"));
}

}  // namespace
}  // namespace zo::engine
