// engine/coord on HostDevice with states in memory (device and CPU tiers): the range allocator, the
// parameter coordinator (exact bytes across the schedule, order, budget, persistence, reuse,
// prefetch, invalidate, tied params), the gradient accumulator (reference sums, norm, overflow,
// contribution errors, buffer bounds), the gradient worker (order, bits, back-pressure) and the
// block gatherer of partitioned parameters (ranks as threads of this process).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <latch>
#include <barrier>
#include <cstring>
#include <functional>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <thread>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "cpu_optim/vector_ops.h"
#include "engine/coord/block_gatherer.h"
#include "engine/coord/grad_accumulator.h"
#include "engine/coord/grad_worker.h"
#include "engine/coord/param_coordinator.h"
#include "engine/coord/range_allocator.h"
#include "engine/coord/update_gate.h"
#include "gpu/test_hooks.h"
#include "tests/engine/coord/coord_rig.h"

namespace zo::engine {
namespace {

using testing::Bytes;
using testing::check_every_setting;
using testing::GatherRank;
using ::testing::HasSubstr;
using testing::LocalBus;
using testing::make_coordinator;
using testing::on_ranks;
using testing::opts;
using testing::Placing;
using testing::Rig;

// ---- RangeAllocator ------------------------------------------------------------------------------

TEST(RangeAllocator, FirstFitAlignedAndCoalesced) {
  detail::RangeAllocator a(1024, 4096, 256);
  auto x = a.allocate(1);
  auto y = a.allocate(300);
  auto z = a.allocate(256);
  ASSERT_TRUE(x && y && z);
  EXPECT_EQ(*x, 1024u);
  EXPECT_EQ(*y, 1024u + 256);
  EXPECT_EQ(*z, 1024u + 768);
  EXPECT_EQ(a.free_bytes(), 4096u - 1024);
  a.free(*y, 300);
  // First fit: the hole of 512 at y takes a 512 request, a larger one goes after z.
  auto big = a.allocate(600);
  ASSERT_TRUE(big);
  EXPECT_EQ(*big, 1024u + 1024);
  auto hole = a.allocate(512);
  ASSERT_TRUE(hole);
  EXPECT_EQ(*hole, *y);
  a.free(*x, 1);
  a.free(*hole, 512);
  a.free(*z, 256);
  a.free(*big, 600);
  EXPECT_EQ(a.free_bytes(), 4096u);
  EXPECT_EQ(a.largest_free_bytes(), 4096u);  // all neighbours merged back into one range
  EXPECT_FALSE(a.allocate(4097));
  EXPECT_TRUE(a.allocate(4096));
}

TEST(RangeAllocator, FragmentedSpaceRefusesALargeRange) {
  detail::RangeAllocator a(0, 1024, 256);
  auto p0 = a.allocate(256), p1 = a.allocate(256), p2 = a.allocate(256), p3 = a.allocate(256);
  ASSERT_TRUE(p0 && p1 && p2 && p3);
  a.free(*p0, 256);
  a.free(*p2, 256);
  EXPECT_EQ(a.free_bytes(), 512u);
  EXPECT_EQ(a.largest_free_bytes(), 256u);
  EXPECT_FALSE(a.allocate(512));
}

// ---- ParamCoordinator ----------------------------------------------------------------------------

TEST(ParamCoordinator, AcquireReturnsComputeBytesOnDevice) {
  Placing p;
  p.optimizer = "none";
  p.param = "none";
  check_every_setting(p);
  // Device-resident compute copies need no arena and are never copied.
  Rig rig;
  ASSERT_TRUE(rig.init(p).is_ok());
  auto coord = make_coordinator(rig, CoordinatorOptions{});
  testing::run_micro_step(rig, *coord, rig.gather(StateKind::kCompute));
  EXPECT_EQ(coord->stats().arena_bytes, 0u);
  EXPECT_EQ(coord->stats().fetches, 0u);
  EXPECT_EQ(coord->stats().h2d_bytes, 0u);
}

TEST(ParamCoordinator, AcquireReturnsComputeBytesFromPinnedCpu) {
  Placing p;
  check_every_setting(p);
}

TEST(ParamCoordinator, AcquireReturnsComputeBytesFromPageableCpuInFp32) {
  Placing p;
  p.pin = false;
  p.bf16 = false;
  check_every_setting(p);
}

TEST(ParamCoordinator, OutOfOrderAcquireFailsNamingExpectedAndGiven) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  auto coord = make_coordinator(rig, CoordinatorOptions{});
  auto before = coord->acquire(0);
  ASSERT_FALSE(before.is_ok());
  EXPECT_EQ(before.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(before.status().message(), HasSubstr("begin_micro_step"));

  coord->begin_micro_step();
  auto wrong = coord->acquire(2);
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrong.status().message(), HasSubstr("expected block 0 'embed'"));
  EXPECT_THAT(wrong.status().message(), HasSubstr("given block 2 'layers.1'"));
  auto out_of_range = coord->acquire(99);
  ASSERT_FALSE(out_of_range.is_ok());
  EXPECT_THAT(out_of_range.status().message(), HasSubstr("block 99 (out of range"));

  Status not_held = coord->release(0);
  EXPECT_EQ(not_held.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(not_held.message(), HasSubstr("not acquired"));

  // The schedule goes on from where it was; the backward half starts with the head again.
  const uint32_t n = testing::kLayers + 2;
  for (uint32_t b = 0; b < n; ++b) {
    ASSERT_TRUE(coord->acquire(b).is_ok());
    ASSERT_TRUE(coord->release(b).is_ok());
  }
  auto backward_wrong = coord->acquire(0);
  ASSERT_FALSE(backward_wrong.is_ok());
  EXPECT_THAT(backward_wrong.status().message(), HasSubstr("expected block 5 'head' (backward"));
  for (uint32_t b = n; b-- > 0;) {
    ASSERT_TRUE(coord->acquire(b).is_ok());
    ASSERT_TRUE(coord->release(b).is_ok());
  }
  auto past_end = coord->acquire(0);
  ASSERT_FALSE(past_end.is_ok());
  EXPECT_THAT(past_end.status().message(), HasSubstr("acquires are done"));
}

TEST(ParamCoordinator, BudgetBelowLargestBlockFailsAtCreateWithTheNumbers) {
  Rig rig;
  // CPU compute copies and CPU optimizer: nothing of the store lives on the device.
  ASSERT_TRUE(rig.init(Placing{}, /*device_budget=*/40000).is_ok());
  ASSERT_EQ(rig.device->stats().allocated_bytes, 0u);
  CoordinatorOptions o;
  o.persistence_threshold_elems = 200;  // the 96-element norms: 5 params × 256 bytes
  auto coord = ParamCoordinator::create(*rig.store, nullptr, testing::blocks(), testing::block_names(), o);
  ASSERT_FALSE(coord.is_ok());
  EXPECT_EQ(coord.status().code(), StatusCode::kOutOfMemory);
  const std::string& m = coord.status().message();
  // Largest block: a layer's attn (96×96) + mlp (96×200) in bf16, each slot rounded to 256 bytes.
  const uint64_t layer_bytes = align_up(96 * 96 * 2, 256) + align_up(96 * 200 * 2, 256);
  EXPECT_THAT(m, HasSubstr("gpu budget " + format_bytes(40000)));
  EXPECT_THAT(m, HasSubstr("leaves " + format_bytes(40000) + " (40000 bytes) for parameters"));
  EXPECT_THAT(m, HasSubstr("block 'layers.0' alone needs " + format_bytes(layer_bytes) + " (" +
                           std::to_string(layer_bytes) + " bytes)"));
  EXPECT_THAT(m, HasSubstr("compute dtype bf16"));
  EXPECT_THAT(m, HasSubstr("persistent params"));
  EXPECT_EQ(rig.device->stats().allocated_bytes, 0u);

  // The reserve counts against the budget too.
  Rig big;
  ASSERT_TRUE(big.init(Placing{}, /*device_budget=*/200000).is_ok());
  o.device_reserve_bytes = 190000;
  auto reserved = ParamCoordinator::create(*big.store, nullptr, testing::blocks(), testing::block_names(), o);
  ASSERT_FALSE(reserved.is_ok());
  EXPECT_THAT(reserved.status().message(), HasSubstr("reserve"));
}

TEST(ParamCoordinator, TightBudgetHoldsAndTheArenaIsAllocatedOnce) {
  // Budget: exactly the largest layer plus the persistent norms; no room for prefetch.
  const uint64_t layer_bytes = align_up(96 * 96 * 2, 256) + align_up(96 * 200 * 2, 256);
  const uint64_t persistent = 5 * 256;
  const uint64_t budget = layer_bytes + persistent;
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}, budget).is_ok());
  const auto expected = rig.gather(StateKind::kCompute);
  CoordinatorOptions o;
  o.persistence_threshold_elems = 200;
  auto coord = make_coordinator(rig, o);
  EXPECT_EQ(coord->stats().arena_bytes, budget);
  EXPECT_EQ(rig.device->stats().allocated_bytes, budget);
  for (int step = 0; step < 2; ++step) {
    testing::run_micro_step(rig, *coord, expected);
    if (HasFatalFailure()) return;
  }
  const gpu::DeviceStats ds = rig.device->stats();
  EXPECT_EQ(ds.allocated_bytes, budget);  // nothing allocated after create
  EXPECT_LE(ds.peak_allocated_bytes, budget);
  EXPECT_GT(coord->stats().evictions, 0u);  // the defaults cache by reuse; a tight arena evicts
}

TEST(ParamCoordinator, PersistentParamsAreFetchedOncePerWindowUntilInvalidate) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  const auto expected = rig.gather(StateKind::kCompute);
  // No prefetch and no reuse, so every fetch is the acquire's own.
  auto coord = make_coordinator(rig, opts(0, 1'000'000, 200, 0));
  uint64_t f[4];
  for (int step = 0; step < 3; ++step) {
    testing::run_micro_step(rig, *coord, expected);
    if (HasFatalFailure()) return;
    f[step] = coord->stats().fetches;
  }
  const uint64_t f1 = f[0], f2 = f[1] - f[0], f3 = f[2] - f[1];
  EXPECT_EQ(f2, f3);
  // Cold, the first micro-step also fetches the 5 persistent norms (once each, though each is used
  // twice) and the embedding at position 0, which later windows keep from the previous position
  // 2n-1 (reuse distance 0: adjacent).
  EXPECT_EQ(f1 - f2, 5u + 1u);
  EXPECT_EQ(coord->stats().prefetches, 0u);
  coord->invalidate();
  testing::run_micro_step(rig, *coord, expected);
  EXPECT_EQ(coord->stats().fetches - f[2], f1);
}

TEST(ParamCoordinator, InvalidateServesChangedComputeCopies) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  const auto before = rig.gather(StateKind::kCompute);
  auto coord = make_coordinator(rig, opts(30000, 1'000'000, 200, 1'000'000'000));
  testing::run_micro_step(rig, *coord, before);
  if (HasFatalFailure()) return;

  std::mt19937 rng(7);
  std::vector<Bytes> after;
  for (const auto& b : before) after.push_back(testing::random_bytes(b.size(), rng));
  ASSERT_TRUE(rig.scatter(StateKind::kCompute, after).is_ok());
  coord->invalidate();
  testing::run_micro_step(rig, *coord, after);
  if (HasFatalFailure()) return;
  testing::run_micro_step(rig, *coord, after);
}

// Two micro-steps of the schedule: every acquire after the very first finds all its params
// resident (fetched ahead by prefetch).
void expect_hits_after_the_first_acquire(ParamCoordinator& coord, const std::vector<std::vector<uint32_t>>& bl) {
  const uint32_t n = static_cast<uint32_t>(bl.size());
  for (int step = 0; step < 2; ++step) {
    coord.begin_micro_step();
    for (uint32_t q = 0; q < 2 * n; ++q) {
      const uint32_t b = q < n ? q : 2 * n - 1 - q;
      const uint64_t hits = coord.stats().hits;
      ASSERT_TRUE(coord.acquire(b).is_ok());
      if (step > 0 || q > 0) {
        EXPECT_EQ(coord.stats().hits - hits, bl[b].size()) << "step " << step << " position " << q;
      }
      ASSERT_TRUE(coord.release(b).is_ok());
    }
  }
}

TEST(ParamCoordinator, PrefetchMakesEveryAcquireAfterTheFirstAHit) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  const auto bl = testing::blocks();
  // Bucket = one layer (the largest block) in elements; no reuse, no persistence, so without
  // prefetch nearly every acquire would fetch.
  const uint64_t layer_elems = 96 * 96 + 96 * 200 + 96;
  auto coord = make_coordinator(rig, opts(layer_elems, 1'000'000, 0, 0));
  expect_hits_after_the_first_acquire(*coord, bl);
  if (HasFatalFailure()) return;
  EXPECT_GT(coord->stats().prefetches, 0u);

  // The same schedule without a bucket: acquires of layers fetch.
  Rig cold;
  ASSERT_TRUE(cold.init(Placing{}).is_ok());
  auto none = make_coordinator(cold, opts(0, 1'000'000, 0, 0));
  testing::run_micro_step(cold, *none, cold.gather(StateKind::kCompute));
  EXPECT_EQ(none->stats().prefetches, 0u);
  EXPECT_GT(none->stats().fetches, coord->stats().fetches / 2);
}

// Accelerate's "auto" bucket (0.9·hidden²) holds no MLP projection of an 8B model; a bucket that
// cannot hold the largest param would never prefetch, so it runs by whole blocks instead.
TEST(ParamCoordinator, ABucketBelowTheLargestParamPrefetchesWholeBlocks) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  const auto bl = testing::blocks();
  const ArenaPlan small =
      plan_arena(rig.store->registry(), rig.store->plan().placement, bl, opts(1000, 1'000'000, 0, 0));
  EXPECT_TRUE(small.prefetch_by_blocks);
  EXPECT_GT(small.largest_param_elems, 1000u);
  EXPECT_GE(small.prefetch_bucket_elems, 96u * 96 + 96 * 200);  // at least one layer
  const ArenaPlan off = plan_arena(rig.store->registry(), rig.store->plan().placement, bl, opts(0, 1'000'000, 0, 0));
  EXPECT_FALSE(off.prefetch_by_blocks);
  EXPECT_EQ(off.prefetch_bucket_elems, 0u);  // 0 still turns prefetch off
  const ArenaPlan big =
      plan_arena(rig.store->registry(), rig.store->plan().placement, bl, opts(1'000'000, 1'000'000, 0, 0));
  EXPECT_FALSE(big.prefetch_by_blocks);
  EXPECT_EQ(big.prefetch_bucket_elems, 1'000'000u);

  auto coord = make_coordinator(rig, opts(1000, 1'000'000, 0, 0));
  expect_hits_after_the_first_acquire(*coord, bl);
  if (HasFatalFailure()) return;
  EXPECT_GT(coord->stats().prefetches, 0u);
}

TEST(ParamCoordinator, MaxLiveBoundsPrefetch) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  // A huge bucket but live elements of one layer: nothing beyond the block in use fits.
  const uint64_t layer_elems = 96 * 96 + 96 * 200;
  auto coord = make_coordinator(rig, opts(1'000'000, layer_elems, 200, 0));
  testing::run_micro_step(rig, *coord, rig.gather(StateKind::kCompute));
  const CoordinatorStats cs = coord->stats();
  EXPECT_LE(cs.peak_live_bytes, align_up(layer_elems * 2, 256) + 5 * 256 + 256);
  EXPECT_LE(cs.arena_bytes, align_up(96 * 96 * 2, 256) + align_up(96 * 200 * 2, 256) + 5 * 256);
}

TEST(ParamCoordinator, TiedParamHeldByTwoBlocksKeepsOneAddress) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  const auto expected = rig.gather(StateKind::kCompute);
  // A bucket big enough that the arena holds a layer besides the held embedding.
  auto coord = make_coordinator(rig, opts(10000, 1'000'000, 0, 0));
  const uint32_t n = testing::kLayers + 2;
  coord->begin_micro_step();
  auto embed = coord->acquire(0);  // kept acquired through the whole forward
  ASSERT_TRUE(embed.is_ok());
  for (uint32_t b = 1; b + 1 < n; ++b) {
    ASSERT_TRUE(coord->acquire(b).is_ok());
    ASSERT_TRUE(coord->release(b).is_ok());
  }
  const uint64_t hits = coord->stats().hits;
  auto head = coord->acquire(n - 1);
  ASSERT_TRUE(head.is_ok());
  EXPECT_EQ((*head)[1], (*embed)[0]);  // held, so found in place, not fetched again
  EXPECT_GE(coord->stats().hits - hits, 1u);
  EXPECT_EQ(rig.d2h((*head)[1], expected[testing::embed_id()].size()), expected[testing::embed_id()]);
  EXPECT_EQ(rig.d2h((*head)[0], expected[testing::final_norm_id()].size()), expected[testing::final_norm_id()]);
  ASSERT_TRUE(coord->release(0).is_ok());
  ASSERT_TRUE(coord->release(n - 1).is_ok());

  // A param listed twice in one block gets one address.
  Rig twice;
  ASSERT_TRUE(twice.init(Placing{}).is_ok());
  auto c2 = ParamCoordinator::create(*twice.store, nullptr, {{0, 1, 0}}, {"dup"}, CoordinatorOptions{});
  ASSERT_TRUE(c2.is_ok()) << c2.status().to_string();
  (*c2)->begin_micro_step();
  auto dup = (*c2)->acquire(0);
  ASSERT_TRUE(dup.is_ok());
  EXPECT_EQ((*dup)[0], (*dup)[2]);
}

TEST(ParamCoordinator, ReleaseWithAnEventOrdersLaterCopies) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  const auto expected = rig.gather(StateKind::kCompute);
  auto coord = make_coordinator(rig, opts(1'000'000, 1'000'000, 0, 0));
  auto compute = rig.device->create_stream();
  auto done = rig.device->create_event();
  ASSERT_TRUE(compute.is_ok() && done.is_ok());
  const auto bl = testing::blocks();
  const uint32_t n = static_cast<uint32_t>(bl.size());
  coord->begin_micro_step();
  for (uint32_t q = 0; q < 2 * n; ++q) {
    const uint32_t b = q < n ? q : 2 * n - 1 - q;
    auto ptrs = coord->acquire(b);
    ASSERT_TRUE(ptrs.is_ok());
    // A "kernel" still reading the block when it is released.
    ASSERT_TRUE(gpu::test_delay(*rig.device, *compute, 2000).is_ok());
    ASSERT_TRUE(rig.device->record(*done, *compute).is_ok());
    ASSERT_TRUE(coord->release(b, *done).is_ok());
  }
  ASSERT_TRUE(rig.device->synchronize(*compute).is_ok());
  testing::run_micro_step(rig, *coord, expected);
  rig.device->destroy_event(*done);
  rig.device->destroy_stream(*compute);
}

// The trainer's compute waits for a block on the device, not the host: acquire_async returns with
// the block's copies still queued, and its ready event completes when they have landed.
TEST(ParamCoordinator, AcquireAsyncReturnsBeforeTheCopiesLandAndItsEventMarksThem) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  const auto expected = rig.gather(StateKind::kCompute);
  auto coord = make_coordinator(rig, opts(0, 1'000'000, 0, 0));  // no prefetch
  auto compute = rig.device->create_stream();
  auto done = rig.device->create_event();
  ASSERT_TRUE(compute.is_ok() && done.is_ok());
  const auto bl = testing::blocks();
  coord->begin_micro_step();
  ASSERT_TRUE(coord->acquire(0).is_ok());
  // Block 0 is released behind a 300 ms "kernel": the copy stream waits for it before block 1's
  // copies, so they cannot land before then.
  ASSERT_TRUE(gpu::test_delay(*rig.device, *compute, 300'000).is_ok());
  ASSERT_TRUE(rig.device->record(*done, *compute).is_ok());
  ASSERT_TRUE(coord->release(0, *done).is_ok());
  auto got = coord->acquire_async(1);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  ASSERT_TRUE(got->ready);
  EXPECT_FALSE(*rig.device->query(got->ready)) << "acquire_async waited for the copies";
  EXPECT_FALSE(*rig.device->query(*done));
  ASSERT_TRUE(rig.device->synchronize(got->ready).is_ok());
  EXPECT_TRUE(*rig.device->query(*done)) << "the ready event completed before the copies it covers";
  ASSERT_EQ(got->ptrs.size(), bl[1].size());
  for (size_t i = 0; i < bl[1].size(); ++i) {
    EXPECT_EQ(Bytes(rig.d2h(got->ptrs[i], expected[bl[1][i]].size())), expected[bl[1][i]]) << "param " << i;
  }
  ASSERT_TRUE(coord->release(1).is_ok());
  rig.device->destroy_event(*done);
  rig.device->destroy_stream(*compute);
}

TEST(ParamCoordinator, BadBlocksAreRejectedAtCreate) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  auto empty = ParamCoordinator::create(*rig.store, nullptr, {}, {}, CoordinatorOptions{});
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
  auto names = ParamCoordinator::create(*rig.store, nullptr, {{0}}, {"a", "b"}, CoordinatorOptions{});
  EXPECT_EQ(names.status().code(), StatusCode::kInvalidArgument);
  auto bad_id = ParamCoordinator::create(*rig.store, nullptr, {{0, 999}}, {"blk"}, CoordinatorOptions{});
  EXPECT_EQ(bad_id.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_id.status().message(), HasSubstr("'blk' uses param id 999"));
}

// ---- UpdateGate and the coordinator behind an optimizer step (Note [Overlapped optimizer]) ------

TEST(UpdateGate, TheFinalPrefixGrowsInAnyPublishOrderAndAFailureReachesTheWaiters) {
  UpdateGate gate(4);
  EXPECT_EQ(gate.final_prefix(), 4u);  // closed: no update running
  gate.open();
  EXPECT_EQ(gate.final_prefix(), 0u);
  gate.publish(1);
  EXPECT_EQ(gate.final_prefix(), 0u);
  gate.publish(0);
  EXPECT_EQ(gate.final_prefix(), 2u);
  EXPECT_TRUE(gate.wait_prefix(2).is_ok());
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gate.publish(3);
    gate.publish(2);
  });
  EXPECT_TRUE(gate.wait_prefix(4).is_ok());  // blocks until both are published
  late.join();
  EXPECT_EQ(gate.final_prefix(), 4u);

  gate.open();
  gate.publish(0);
  std::thread failing([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gate.close(io_error("write of sub-group 1 failed", 5));
  });
  Status st = gate.wait_prefix(3);
  failing.join();
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_THAT(st.to_string(), ::testing::HasSubstr("sub-group 1"));
  EXPECT_TRUE(gate.wait_prefix(1).is_ok());  // what was published stays final
  gate.close(Status::ok());                  // the failure was reported: nothing waits any more
  EXPECT_TRUE(gate.wait_prefix(4).is_ok());
}

// The optimizer writes each sub-group's new compute copy and then publishes it; the forward behind
// it must see only new values: acquire waits for its block's sub-groups, prefetch stops at the first
// param that is not final, and a failed update is the acquire's error.
TEST(ParamCoordinator, AcquireWaitsForTheUpdateGateAndPrefetchStopsAtIt) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  const auto bl = testing::blocks();
  const uint32_t n = static_cast<uint32_t>(bl.size());
  const uint32_t n_groups = static_cast<uint32_t>(rig.registry.sub_groups().size());
  auto coord = make_coordinator(rig, opts(1'000'000, 1'000'000, 0, 1'000'000'000));
  UpdateGate gate(n_groups);
  coord->set_update_gate(&gate);
  testing::run_micro_step(rig, *coord, rig.gather(StateKind::kCompute));  // closed gate: no waiting
  if (HasFatalFailure()) return;

  std::mt19937 rng(3);
  std::vector<Bytes> after;
  for (const auto& b : rig.gather(StateKind::kCompute)) after.push_back(testing::random_bytes(b.size(), rng));
  auto update = [&](uint32_t g) {
    Status st = rig.scatter_group(g, StateKind::kCompute, after);
    ZO_CHECK(st.is_ok()) << st.to_string();
    gate.publish(g);
  };
  auto groups_end = [&](uint32_t p) { return rig.registry.pieces_of_param(p).back().sub_group + 1; };
  coord->invalidate();
  gate.open();
  const uint32_t embed_end = groups_end(testing::embed_id());
  for (uint32_t g = 0; g < embed_end; ++g) update(g);
  // What prefetch may fetch behind block 0: block 1's params, in order, while their sub-groups are final.
  uint64_t ready_ahead = 0;
  for (uint32_t p : bl[1]) {
    if (groups_end(p) > embed_end) break;
    ++ready_ahead;
  }
  ASSERT_LT(ready_ahead, bl[1].size()) << "the rig's block 1 must wait for a sub-group";

  const uint64_t prefetches = coord->stats().prefetches;
  coord->begin_micro_step();
  auto first = coord->acquire(0);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  EXPECT_EQ(Bytes(rig.d2h((*first)[0], after[testing::embed_id()].size())), after[testing::embed_id()]);
  EXPECT_EQ(coord->stats().prefetches - prefetches, ready_ahead);
  ASSERT_TRUE(coord->release(0).is_ok());

  std::thread optimizer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (uint32_t g = embed_end; g < n_groups; ++g) update(g);
  });
  for (uint32_t q = 1; q < 2 * n; ++q) {
    const uint32_t b = q < n ? q : 2 * n - 1 - q;
    auto ptrs = coord->acquire(b);
    ASSERT_TRUE(ptrs.is_ok()) << "position " << q << ": " << ptrs.status().to_string();
    for (size_t i = 0; i < bl[b].size(); ++i) {
      const uint32_t p = bl[b][i];
      EXPECT_EQ(Bytes(rig.d2h((*ptrs)[i], after[p].size())), after[p]) << "position " << q << " param " << p;
    }
    ASSERT_TRUE(coord->release(b).is_ok());
  }
  optimizer.join();
  EXPECT_GT(coord->stats().update_wait_s, 0.0);

  coord->invalidate();
  gate.open();
  gate.close(io_error("optimizer step 9: sub-group 0: write failed", 5));
  coord->begin_micro_step();
  auto failed = coord->acquire(0);
  ASSERT_FALSE(failed.is_ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_THAT(failed.status().to_string(), ::testing::HasSubstr("acquire block 0 'embed'"));
  EXPECT_THAT(failed.status().to_string(), ::testing::HasSubstr("optimizer step 9"));
}

TEST(CoordinatorOptions, FromConfigTakesTheStage3Keys) {
  Config c = testing::make_config(Placing{}, "/tmp");
  c.zero.stage3_prefetch_bucket_size = 11;
  c.zero.stage3_max_live_parameters = 22;
  c.zero.stage3_param_persistence_threshold = 33;
  c.zero.stage3_max_reuse_distance = 44;
  const CoordinatorOptions o = CoordinatorOptions::from_config(c);
  EXPECT_EQ(o.prefetch_bucket_elems, 11u);
  EXPECT_EQ(o.max_live_elems, 22u);
  EXPECT_EQ(o.persistence_threshold_elems, 33u);
  EXPECT_EQ(o.max_reuse_distance_elems, 44u);
  EXPECT_EQ(o.device_reserve_bytes, 0u);
}

// ---- GradAccumulator -----------------------------------------------------------------------------

struct AccResult {
  std::vector<Bytes> acc;
  std::vector<GradNormReport> reports;
};

// The trainer's asynchronous fill on the rig's device: each gradient is uploaded, then landed in
// its ring slot by a D2H copy queued on a stream behind a delay, with the event recorded behind it
// (re-recorded per copy) passed to GradWorker::submit. Until the stream reaches the copy the slot
// holds stale bytes.
class AsyncLander {
 public:
  explicit AsyncLander(Rig& rig)
      : rig_(rig),
        upload_(std::move(rig.device->create_stream()).value()),
        stream_(std::move(rig.device->create_stream()).value()),
        landed_(std::move(rig.device->create_event()).value()) {}
  ~AsyncLander() {
    ZO_CHECK(rig_.device->synchronize(stream_).is_ok());
    for (gpu::DevicePtr d : sources_) rig_.device->free(d);
    rig_.device->destroy_event(landed_);
    rig_.device->destroy_stream(stream_);
    rig_.device->destroy_stream(upload_);
  }
  gpu::Event landed() const { return landed_; }
  // Submits the first `size` bytes of `g` to `worker` as `param`'s contribution.
  Status submit(GradWorker& worker, uint32_t param, DType dtype, const Bytes& g, uint64_t size, uint32_t delay_us) {
    const gpu::DevicePtr src = std::move(rig_.device->allocate(g.size())).value();
    sources_.push_back(src);
    // On its own stream, so that the upload does not wait for the copies still landing.
    ZO_CHECK(rig_.device->copy_h2d(src, g.data(), g.size(), upload_).is_ok());
    ZO_CHECK(rig_.device->synchronize(upload_).is_ok());
    return worker.submit(
        param, dtype, size,
        [&](std::span<std::byte> dest, uint64_t from) {
          ZO_RETURN_IF_ERROR(gpu::test_delay(*rig_.device, stream_, delay_us));
          ZO_RETURN_IF_ERROR(rig_.device->copy_d2h(dest.data(), src + from, dest.size(), stream_));
          return rig_.device->record(landed_, stream_);
        },
        landed_);
  }

 private:
  Rig& rig_;
  gpu::Stream upload_;
  gpu::Stream stream_;
  gpu::Event landed_;
  std::vector<gpu::DevicePtr> sources_;
};

// Runs `grads` (micro-steps × contributions in contribution order) through a GradAccumulator, after
// filling the accumulators with garbage the first micro-step must ignore: added directly, or with
// ring_bytes > 0 through a GradWorker with a landing ring that size (its stats to `stats`). With
// `async_fill` each gradient lands by a D2H copy queued on a device stream behind a delay, with an
// event the worker must wait for: the slot holds stale bytes until the stream reaches the copy.
AccResult accumulate_all(Rig& rig, const std::vector<std::vector<Bytes>>& grads, DType gdt, uint64_t ring_bytes = 0,
                         GradWorker::Stats* stats = nullptr, bool async_fill = false) {
  AccResult r;
  std::mt19937 rng(99);
  std::vector<Bytes> garbage;
  for (const auto& p : rig.registry.params())
    garbage.push_back(testing::random_bytes(p.n_elems * rig.grad_bytes(), rng));
  Status st = rig.scatter(StateKind::kGradAccum, garbage);
  ZO_CHECK(st.is_ok()) << st.to_string();
  auto acc = GradAccumulator::create(*rig.store, testing::contribution_order(), testing::executor());
  ZO_CHECK(acc.is_ok()) << acc.status().to_string();
  AlignedBuffer ring;  // outlives the worker
  std::unique_ptr<GradWorker> worker;
  if (ring_bytes > 0) {
    ring = std::move(AlignedBuffer::allocate(align_up(ring_bytes, 64))).value();
    // A worker slower than the producer, so that a small ring fills and submits wait.
    auto w = GradWorker::create(
        **acc, ring.bytes(), [] { std::this_thread::sleep_for(std::chrono::milliseconds(1)); }, rig.device.get());
    ZO_CHECK(w.is_ok()) << w.status().to_string();
    worker = std::move(*w);
  }
  std::optional<AsyncLander> lander;
  if (async_fill) lander.emplace(rig);
  const auto order = testing::contribution_order();
  for (size_t m = 0; m < grads.size(); ++m) {
    st = (*acc)->begin_micro_step(m == 0, m + 1 == grads.size());
    ZO_CHECK(st.is_ok()) << st.to_string();
    for (size_t c = 0; c < order.size(); ++c) {
      const Bytes& g = grads[m][c];
      if (!worker) {
        st = (*acc)->add(order[c], g, gdt);
      } else if (!async_fill) {
        st = worker->submit(order[c], gdt, g.size(), [&](std::span<std::byte> dest, uint64_t from) {
          std::memcpy(dest.data(), g.data() + from, dest.size());
          return Status::ok();
        });
      } else {
        st = lander->submit(*worker, order[c], gdt, g, g.size(), 2000);
      }
      ZO_CHECK(st.is_ok()) << st.to_string();
    }
    if (worker) {
      st = worker->drain();
      ZO_CHECK(st.is_ok()) << st.to_string();
    }
    auto report = (*acc)->end_micro_step();
    ZO_CHECK(report.is_ok()) << report.status().to_string();
    r.reports.push_back(*report);
  }
  if (stats != nullptr && worker) *stats = worker->stats();
  r.acc = rig.gather(StateKind::kGradAccum);
  return r;
}

double reference_sum_sq(const std::vector<Bytes>& acc, DType d) {
  double s = 0;
  for (const auto& a : acc) {
    for (size_t i = 0; i < a.size() / dtype_size_bytes(d); ++i) {
      const double v = cpu_optim::load_as_float(a.data(), d, i);
      s += v * v;
    }
  }
  return s;
}

uint64_t double_bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

// CPU (in place) and device (through buffers) against the reference, for every grad/accumulator
// dtype pair and 1 and 3 micro-steps. The NVMe tier is in coord_io_test.
TEST(GradAccumulator, MatchesTheReferenceSumOnCpuAndDeviceBitForBit) {
  for (const char* acc_dtype : {"fp32", "bf16"}) {
    for (DType gdt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (int steps : {1, 3}) {
        SCOPED_TRACE(std::string("accumulator ") + acc_dtype + " grad " + std::string(dtype_name(gdt)) + " steps " +
                     std::to_string(steps));
        std::vector<AccResult> results;
        std::vector<Bytes> ref;
        for (const char* tier : {"cpu", "none"}) {
          Placing p;
          p.optimizer = tier;
          p.param = tier;
          p.grad = acc_dtype;
          Rig rig;
          ASSERT_TRUE(rig.init(p).is_ok());
          const auto grads = testing::random_grads(rig, steps, gdt, 5);
          if (ref.empty()) ref = testing::reference_accumulate(rig, grads, gdt, rig.plan.placement.grad_dtype);
          results.push_back(accumulate_all(rig, grads, gdt));
          ASSERT_EQ(results.back().acc, ref) << "tier " << tier;
          const GradNormReport& last = results.back().reports.back();
          EXPECT_FALSE(last.nonfinite);
          EXPECT_NEAR(last.sum_sq, reference_sum_sq(ref, rig.plan.placement.grad_dtype), 1e-9 * last.sum_sq);
          for (size_t m = 0; m + 1 < results.back().reports.size(); ++m)
            EXPECT_EQ(results.back().reports[m].sum_sq, 0.0);
        }
        EXPECT_EQ(double_bits(results[0].reports.back().sum_sq), double_bits(results[1].reports.back().sum_sq));
        EXPECT_EQ(results[0].reports.back().bytes_read + results[0].reports.back().bytes_written, 0u);  // in place
        EXPECT_GT(results[1].reports.back().bytes_written, 0u);
        if (steps > 1) { EXPECT_GT(results[1].reports.back().bytes_read, 0u); }
        EXPECT_EQ(results[1].reports.front().bytes_read, 0u);  // first: nothing read
      }
    }
  }
}

// Backward copies gradients into the ring and goes on; the accumulators and the norm must be the
// bits of direct adds, with the producer held back when the ring is full (a ring of the largest
// gradient: slots wrap around and nearly every submit waits for the worker). With asynchronous
// fills (the trainer's copies from the GPU, queued and only recorded) the worker must read a slot
// after the copy's event, not when submit returns.
TEST(GradWorker, AddsInOrderBitIdenticalToDirectAddsUnderBackPressureAndAsynchronousFills) {
  for (const char* tier : {"cpu", "none"}) {
    SCOPED_TRACE(tier);
    Placing p;
    p.optimizer = tier;
    p.param = tier;
    Rig direct_rig;
    ASSERT_TRUE(direct_rig.init(p).is_ok());
    const auto grads = testing::random_grads(direct_rig, 3, DType::kBF16, 17);
    const AccResult direct = accumulate_all(direct_rig, grads, DType::kBF16);
    uint64_t largest = 0;
    for (const auto& g : grads[0]) largest = std::max<uint64_t>(largest, g.size());
    for (bool async_fill : {false, true})
      for (uint64_t ring : {largest, 3 * largest + 100}) {
        SCOPED_TRACE(std::string(async_fill ? "asynchronous" : "synchronous") + " fills, ring " + std::to_string(ring));
        Rig rig;
        ASSERT_TRUE(rig.init(p).is_ok());
        GradWorker::Stats stats;
        const AccResult via = accumulate_all(rig, grads, DType::kBF16, ring, &stats, async_fill);
        EXPECT_EQ(via.acc, direct.acc);
        ASSERT_EQ(via.reports.size(), direct.reports.size());
        EXPECT_EQ(double_bits(via.reports.back().sum_sq), double_bits(direct.reports.back().sum_sq));
        EXPECT_EQ(stats.items, 3 * testing::contribution_order().size());
        EXPECT_LE(stats.peak_in_flight_bytes, align_up(ring, 64));
        if (ring == largest) { EXPECT_GT(stats.full_waits, 0u) << "back-pressure was not exercised"; }
      }
  }
}

// After a failed add the worker drops what is queued; an asynchronously filled slot may still be
// receiving its copy then, so drain() must not return (and the ring be reused) before it lands.
TEST(GradWorker, ItemsDroppedAfterAnErrorStillWaitForTheirCopies) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  auto acc = GradAccumulator::create(*rig.store, testing::contribution_order(), testing::executor());
  ASSERT_TRUE(acc.is_ok());
  AlignedBuffer ring = std::move(AlignedBuffer::allocate(1 << 20)).value();
  // The worker holds the first item, after waiting for its copy, until every later item is queued:
  // their copies are covered only by their own waits. Latches, not sleeps: the order is the same
  // however loaded the machine is.
  std::latch past_first_wait{1}, later_items_queued{1};
  std::atomic<int> adds{0};
  auto hold_first = [&] {
    if (adds++ != 0) return;
    past_first_wait.count_down();
    later_items_queued.wait();
  };
  auto worker = GradWorker::create(**acc, ring.bytes(), hold_first, rig.device.get());
  ASSERT_TRUE(worker.is_ok());
  const auto order = testing::contribution_order();
  const auto grads = testing::random_grads(rig, 1, DType::kF32, 6);
  AsyncLander lander(rig);
  ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
  for (size_t c = 0; c < order.size(); ++c) {
    // The first contribution is 4 bytes short: its add fails, and every later item is dropped.
    const uint64_t size = grads[0][c].size() - (c == 0 ? 4 : 0);
    (void)lander.submit(**worker, order[c], DType::kF32, grads[0][c], size, 20'000);
    if (c == 0) past_first_wait.wait();  // the worker is past the first item's wait
  }
  later_items_queued.count_down();
  const Status st = (*worker)->drain();
  ASSERT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  Result<bool> done = rig.device->query(lander.landed());
  ASSERT_TRUE(done.is_ok());
  EXPECT_TRUE(*done) << "drain returned while a dropped item's copy was still landing in the ring";
  (*acc)->abandon_micro_step();
}

TEST(GradWorker, RefusesAZeroRingAnOversizedGradientAndReturnsAFailedFill) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  auto acc = GradAccumulator::create(*rig.store, testing::contribution_order(), testing::executor());
  ASSERT_TRUE(acc.is_ok());
  EXPECT_EQ(GradWorker::create(**acc, {}).status().code(), StatusCode::kInvalidArgument);
  AlignedBuffer ring = std::move(AlignedBuffer::allocate(1024)).value();
  auto worker = GradWorker::create(**acc, ring.bytes());
  ASSERT_TRUE(worker.is_ok());
  auto never = [](std::span<std::byte>, uint64_t) -> Status {
    ADD_FAILURE() << "filled";
    return Status::ok();
  };
  const Status big = (*worker)->submit(0, DType::kF32, 4096, never);
  EXPECT_EQ(big.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(big.message(), HasSubstr("landing ring"));
  const Status bad = (*worker)->submit(0, DType::kF32, 64,
                                       [](std::span<std::byte>, uint64_t) { return internal_error("copy failed"); });
  EXPECT_THAT(bad.message(), HasSubstr("copy failed"));
  EXPECT_TRUE((*worker)->drain().is_ok());
  EXPECT_EQ((*worker)->stats().items, 0u);
}

TEST(GradAccumulator, AnInfInAnEarlyMicroStepIsReportedAtTheBoundary) {
  for (const char* tier : {"cpu", "none"}) {
    SCOPED_TRACE(tier);
    Placing p;
    p.optimizer = tier;
    p.param = tier;
    Rig rig;
    ASSERT_TRUE(rig.init(p).is_ok());
    auto grads = testing::random_grads(rig, 2, DType::kBF16, 3);
    const AccResult clean = accumulate_all(rig, grads, DType::kBF16);
    EXPECT_FALSE(clean.reports.back().nonfinite);
    EXPECT_TRUE(std::isfinite(clean.reports.back().sum_sq));
    cpu_optim::store_from_float(grads[0][5].data(), DType::kBF16, 17, std::numeric_limits<float>::infinity());
    const AccResult bad = accumulate_all(rig, grads, DType::kBF16);
    EXPECT_FALSE(bad.reports.front().nonfinite);  // not the boundary: not computed
    EXPECT_TRUE(bad.reports.back().nonfinite);
    EXPECT_TRUE(std::isinf(bad.reports.back().sum_sq));
  }
}

TEST(GradAccumulator, MissingContributionFailsNamingTheParam) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  auto acc = GradAccumulator::create(*rig.store, testing::contribution_order(), testing::executor());
  ASSERT_TRUE(acc.is_ok());
  const auto order = testing::contribution_order();
  const auto grads = testing::random_grads(rig, 1, DType::kF32, 1);
  ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
  // Everything but the last contribution (the embedding's second use).
  for (size_t c = 0; c + 1 < order.size(); ++c) ASSERT_TRUE((*acc)->add(order[c], grads[0][c], DType::kF32).is_ok());
  auto report = (*acc)->end_micro_step();
  ASSERT_FALSE(report.is_ok());
  EXPECT_EQ(report.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(report.status().message(), HasSubstr("model.embed_tokens.weight (1 of 2)"));
  EXPECT_EQ((*acc)->begin_micro_step(true, true).code(), StatusCode::kFailedPrecondition);  // still open
  ASSERT_TRUE((*acc)->add(order.back(), grads[0].back(), DType::kF32).is_ok());
  EXPECT_TRUE((*acc)->end_micro_step().is_ok());
}

TEST(GradAccumulator, ExtraOrMisshapenContributionFails) {
  Rig rig;
  Placing p;
  p.optimizer = "none";
  p.param = "none";
  ASSERT_TRUE(rig.init(p).is_ok());
  auto acc = GradAccumulator::create(*rig.store, testing::contribution_order(), testing::executor());
  ASSERT_TRUE(acc.is_ok());
  const uint32_t norm = testing::final_norm_id();
  const Bytes g(96 * 4);
  EXPECT_EQ((*acc)->add(norm, g, DType::kF32).code(), StatusCode::kFailedPrecondition);  // no micro-step
  ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
  Status wrong_size = (*acc)->add(norm, Bytes(95 * 4), DType::kF32);
  EXPECT_EQ(wrong_size.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong_size.message(), HasSubstr("model.norm.weight: 380 bytes, expected 96 elements"));
  EXPECT_EQ((*acc)->add(999, g, DType::kF32).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*acc)->add(norm, g, DType::kF32).is_ok());
  Status extra = (*acc)->add(norm, g, DType::kF32);
  EXPECT_EQ(extra.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(extra.message(), HasSubstr("contribution 2 of model.norm.weight beyond its 1 use(s)"));
  // The tied embedding takes two.
  const Bytes e(96 * 64 * 2);
  EXPECT_TRUE((*acc)->add(testing::embed_id(), e, DType::kBF16).is_ok());
  EXPECT_TRUE((*acc)->add(testing::embed_id(), e, DType::kBF16).is_ok());
  EXPECT_EQ((*acc)->add(testing::embed_id(), e, DType::kBF16).code(), StatusCode::kInvalidArgument);
  (*acc)->abandon_micro_step();
  EXPECT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
}

TEST(GradAccumulator, AParamWithoutContributionsIsRejectedAtCreate) {
  Rig rig;
  ASSERT_TRUE(rig.init(Placing{}).is_ok());
  auto order = testing::contribution_order();
  std::erase(order, testing::final_norm_id());
  auto acc = GradAccumulator::create(*rig.store, order, testing::executor());
  ASSERT_FALSE(acc.is_ok());
  EXPECT_EQ(acc.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(acc.status().message(), HasSubstr("model.norm.weight never appears"));
  order.push_back(12345);
  EXPECT_EQ(GradAccumulator::create(*rig.store, order, testing::executor()).status().code(),
            StatusCode::kInvalidArgument);
}

// The number of sub-groups open at once in contribution order, counted by hand from the layout.
uint32_t expected_open_groups(const ParamRegistry& reg, const std::vector<uint32_t>& order) {
  std::vector<int> remaining(reg.sub_groups().size(), 0);
  for (uint32_t p : order) {
    for (const auto& piece : reg.pieces_of_param(p)) ++remaining[piece.sub_group];
  }
  std::vector<bool> seen(remaining.size(), false);
  uint32_t open = 0, most = 0;
  for (uint32_t p : order) {
    for (const auto& piece : reg.pieces_of_param(p)) {
      if (!seen[piece.sub_group]) {
        seen[piece.sub_group] = true;
        most = std::max(most, ++open);
      }
    }
    for (const auto& piece : reg.pieces_of_param(p)) open -= --remaining[piece.sub_group] == 0 ? 1 : 0;
  }
  return most;
}

TEST(GradAccumulator, BuffersAreBoundedByTheOpenSubGroupsWithTiedParams) {
  Placing p;
  p.optimizer = "none";
  p.param = "none";
  Rig rig;
  ASSERT_TRUE(rig.init(p).is_ok());
  const auto order = testing::contribution_order();
  const uint32_t expected = expected_open_groups(rig.registry, order);
  // The tied embedding's sub-group stays open from the head (first) to block 0 (last), so at least
  // two are open at once, but far fewer than there are sub-groups.
  EXPECT_GE(expected, 2u);
  EXPECT_LT(expected, rig.registry.sub_groups().size());
  auto acc = GradAccumulator::create(*rig.store, order, testing::executor());
  ASSERT_TRUE(acc.is_ok());
  EXPECT_EQ((*acc)->buffer_count(), expected);
  EXPECT_EQ((*acc)->buffer_bytes(), rig.registry.max_group_elems() * 4);
  const auto grads = testing::random_grads(rig, 1, DType::kF32, 2);
  ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
  for (size_t c = 0; c < order.size(); ++c) ASSERT_TRUE((*acc)->add(order[c], grads[0][c], DType::kF32).is_ok());
  ASSERT_TRUE((*acc)->end_micro_step().is_ok());

  // The mlp gradients first, then the rest: more sub-groups open at once than the buffers allow,
  // refused (not overrun) when the buffers run out.
  std::vector<uint32_t> scrambled;
  std::vector<size_t> scrambled_index;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t c = 0; c < order.size(); ++c) {
      const bool mlp = order[c] != testing::final_norm_id() && order[c] % 3 == 0 && order[c] != 0;
      if (mlp == (pass == 0)) {
        scrambled.push_back(order[c]);
        scrambled_index.push_back(c);
      }
    }
  }
  ASSERT_GT(expected_open_groups(rig.registry, scrambled), expected);
  ASSERT_TRUE((*acc)->begin_micro_step(false, true).is_ok());
  Status st;
  for (size_t i = 0; i < scrambled.size() && st.is_ok(); ++i) {
    st = (*acc)->add(scrambled[i], grads[0][scrambled_index[i]], DType::kF32);
  }
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("contribution order"));
  (*acc)->abandon_micro_step();

  // CPU-resident accumulators need no buffers.
  Rig cpu;
  ASSERT_TRUE(cpu.init(Placing{}).is_ok());
  auto in_place = GradAccumulator::create(*cpu.store, order, testing::executor());
  ASSERT_TRUE(in_place.is_ok());
  EXPECT_EQ((*in_place)->buffer_count(), 0u);
}

// Note [No accumulator]: every sub-group reaches the sink once, when its last contribution lands,
// with the bits a CPU accumulator holds after the same adds (also rounded to a bf16 store), and the
// norm of the stored path; the buffers are the sub-groups open at once, none behind.
TEST(GradAccumulator, NoAccumulatorHandsEachSubGroupItsFinalSumOnce) {
  const auto order = testing::contribution_order();
  for (const char* store : {"auto", "bf16"}) {
    SCOPED_TRACE(store);
    Placing stored_p;
    stored_p.store = store;
    Placing direct_p = stored_p;
    direct_p.accumulators = "none";
    Rig stored, direct;
    ASSERT_TRUE(stored.init(stored_p).is_ok());
    ASSERT_TRUE(direct.init(direct_p).is_ok());
    ASSERT_TRUE(direct.plan.placement.no_accumulator);
    uint64_t accumulator_bytes = 0;  // each sub-group's accumulator, rounded up as the store carves it
    for (const SubGroup& g : stored.registry.sub_groups())
      accumulator_bytes += align_up(g.n_elems * stored.grad_bytes(), kPinnedAlignment);
    EXPECT_EQ(stored.plan.cpu_pageable_bytes - direct.plan.cpu_pageable_bytes, accumulator_bytes);
    const auto grads = testing::random_grads(stored, 1, DType::kBF16, 9);

    auto plain = GradAccumulator::create(*stored.store, order, testing::executor());
    ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
    ASSERT_TRUE((*plain)->begin_micro_step(true, true).is_ok());
    for (size_t c = 0; c < order.size(); ++c) ASSERT_TRUE((*plain)->add(order[c], grads[0][c], DType::kBF16).is_ok());
    auto plain_report = (*plain)->end_micro_step();
    ASSERT_TRUE(plain_report.is_ok());

    std::map<uint32_t, Bytes> handed;
    std::vector<uint32_t> order_handed;
    uint32_t fail_at = UINT32_MAX;
    const uint64_t gb = direct.grad_bytes();
    FinalGradSink sink = [&](uint32_t g, std::byte* grad, double* sum_sq) -> Status {
      EXPECT_EQ(sum_sq, nullptr);  // not landed in place: the accumulator took the norm
      if (g == fail_at) return io_error("the optimizer failed", EIO);
      order_handed.push_back(g);
      const uint64_t bytes = direct.registry.sub_groups()[g].n_elems * gb;
      handed[g] = Bytes(grad, grad + bytes);
      return Status::ok();
    };
    auto acc = GradAccumulator::create(*direct.store, order, testing::executor(), {}, sink);
    ASSERT_TRUE(acc.is_ok()) << acc.status().to_string();
    EXPECT_EQ((*acc)->buffer_count(), expected_open_groups(direct.registry, order));
    EXPECT_EQ((*acc)->begin_micro_step(true, false).code(), StatusCode::kFailedPrecondition);
    ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
    for (size_t c = 0; c < order.size(); ++c) ASSERT_TRUE((*acc)->add(order[c], grads[0][c], DType::kBF16).is_ok());
    auto report = (*acc)->end_micro_step();
    ASSERT_TRUE(report.is_ok());
    EXPECT_EQ(double_bits(report->sum_sq), double_bits(plain_report->sum_sq));
    EXPECT_EQ(report->bytes_read + report->bytes_written, 0u);
    ASSERT_EQ(handed.size(), direct.registry.sub_groups().size());
    ASSERT_EQ(order_handed.size(), handed.size());
    EXPECT_EQ(order_handed, (*acc)->completion_order()) << "the order an optimizer reads ahead in";
    for (const auto& [g, bytes] : handed) {
      Bytes want(stored.store->state_bytes(g, StateKind::kGradAccum));
      ASSERT_TRUE(stored.store->read_state(g, StateKind::kGradAccum, want).is_ok());
      EXPECT_EQ(bytes, want) << "sub-group " << g;
    }

    // A sink that fails fails the add that completed the sub-group, naming it; the buffers come back.
    fail_at = order_handed[order_handed.size() / 2];
    ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
    Status st;
    for (size_t c = 0; c < order.size() && st.is_ok(); ++c) st = (*acc)->add(order[c], grads[0][c], DType::kBF16);
    EXPECT_EQ(st.code(), StatusCode::kIoError);
    EXPECT_THAT(st.to_string(), HasSubstr("sub-group " + std::to_string(fail_at) + " stepped from its gradient"));
    (*acc)->abandon_micro_step();
    fail_at = UINT32_MAX;
    ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
    for (size_t c = 0; c < order.size(); ++c) ASSERT_TRUE((*acc)->add(order[c], grads[0][c], DType::kBF16).is_ok());
    ASSERT_TRUE((*acc)->end_micro_step().is_ok());

    // The sink is given exactly when the plan has no accumulators.
    EXPECT_EQ(GradAccumulator::create(*direct.store, order, testing::executor()).status().code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(GradAccumulator::create(*stored.store, order, testing::executor(), {}, sink).status().code(),
              StatusCode::kInvalidArgument);
  }
}

// Note [Gradients that land where they are summed]: through a GradWorker whose gradients land in
// the sums' buffers (the tied embedding's two uses still through the ring), each sub-group reaches
// the sink with the bits and the norm of the ring path — −0 turned to +0 and a signalling NaN
// quieted as accumulate from zero does — with the copies asynchronous, a worker slower than the
// producer (which then waits for buffers), and a sink failure that returns to the producer instead
// of leaving it waiting.
TEST(GradWorker, GradientsLandWhereTheyAreSummedWithTheRingsBits) {
  const auto order = testing::contribution_order();
  Placing p;
  p.accumulators = "none";
  Rig ring_rig, place_rig;
  place_rig.land_in_place = true;
  ASSERT_TRUE(ring_rig.init(p).is_ok());
  ASSERT_TRUE(place_rig.init(p).is_ok());
  ASSERT_EQ(place_rig.plan.placement.grad_sum_dtype, DType::kF32);
  ASSERT_TRUE(gradients_land_in_place(place_rig.plan.placement, false, DType::kF32));
  ASSERT_GT(place_rig.plan.landing_buffers, 0u);
  std::vector<Bytes> grads = testing::random_grads(ring_rig, 1, DType::kF32, 21)[0];
  const uint32_t minus_zero = 0x80000000u, signalling = 0x7f800001u, quiet_payload = 0x7fc00123u;
  auto poke = [&](size_t c, size_t i, uint32_t bits) { std::memcpy(grads[c].data() + 4 * i, &bits, 4); };
  for (size_t c = 0; c < grads.size(); ++c) poke(c, (7 * c) % (grads[c].size() / 4), minus_zero);
  struct Run {
    std::map<uint32_t, Bytes> handed;
    GradNormReport report;
    GradWorker::Stats stats;
    Status failed;
  };
  auto run = [&](Rig& rig, const std::vector<Bytes>& g, uint32_t fail_at) {
    Run out;
    const uint64_t gb = 4;
    FinalGradSink sink = [&](uint32_t group, std::byte* grad, double* sum_sq) -> Status {
      if (group == fail_at) return io_error("the optimizer failed", EIO);
      // Landed in place, the norm is the sink's to take (the optimizer's, as it reads the sums).
      EXPECT_EQ(sum_sq != nullptr, rig.plan.landing_buffers > 0);
      if (sum_sq != nullptr) {
        Result<double> sq = cpu_optim::squared_norm_canonical(
            {grad, DType::kF32}, rig.registry.sub_groups()[group].n_elems, testing::executor());
        if (!sq.is_ok()) return sq.status();
        *sum_sq = *sq;
      }
      out.handed[group] = Bytes(grad, grad + rig.registry.sub_groups()[group].n_elems * gb);
      return Status::ok();
    };
    auto acc = GradAccumulator::create(*rig.store, order, testing::executor(), {}, sink);
    ZO_CHECK(acc.is_ok()) << acc.status().to_string();
    uint64_t largest = 0;  // a ring of two of the largest gradients: the ring rig's items wait for room
    for (const ParamInfo& info : rig.registry.params()) largest = std::max(largest, info.n_elems * gb);
    AlignedBuffer ring = std::move(AlignedBuffer::allocate(align_up(2 * largest, 64))).value();
    {
      auto worker = GradWorker::create(
          **acc, ring.bytes(), [] { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }, rig.device.get());
      ZO_CHECK(worker.is_ok()) << worker.status().to_string();
      AsyncLander lander(rig);
      ZO_CHECK((*acc)->begin_micro_step(true, true).is_ok());
      Status st;
      for (size_t c = 0; c < order.size() && st.is_ok(); ++c)
        st = lander.submit(**worker, order[c], DType::kF32, g[c], g[c].size(), 500);
      Status drained = (*worker)->drain();
      out.failed = st.is_ok() ? drained : st;
      out.stats = (*worker)->stats();
    }
    if (out.failed.is_ok()) {
      auto report = (*acc)->end_micro_step();
      ZO_CHECK(report.is_ok()) << report.status().to_string();
      out.report = *report;
    } else {
      (*acc)->abandon_micro_step();
    }
    return out;
  };
  for (bool with_nans : {false, true}) {
    SCOPED_TRACE(with_nans ? "with NaNs" : "finite");
    if (with_nans) {
      poke(1, 3, signalling);
      poke(2, 5, quiet_payload);
    }
    const Run through_ring = run(ring_rig, grads, UINT32_MAX);
    const Run in_place = run(place_rig, grads, UINT32_MAX);
    ASSERT_TRUE(through_ring.failed.is_ok()) << through_ring.failed.to_string();
    ASSERT_TRUE(in_place.failed.is_ok()) << in_place.failed.to_string();
    EXPECT_EQ(through_ring.stats.in_place_items, 0u);
    // Every contribution but the tied embedding's two lands in place.
    EXPECT_EQ(in_place.stats.in_place_items, order.size() - 2);
    EXPECT_EQ(double_bits(in_place.report.sum_sq), double_bits(through_ring.report.sum_sq));
    EXPECT_EQ(in_place.report.nonfinite, with_nans);
    ASSERT_EQ(in_place.handed.size(), place_rig.registry.sub_groups().size());
    EXPECT_EQ(in_place.handed, through_ring.handed);
    // The ring's values really differ from the raw gradients where it matters: +0 for −0.
    bool saw_positive_zero = false;
    for (const auto& [group, bytes] : in_place.handed) {
      for (size_t i = 0; i + 4 <= bytes.size(); i += 4) {
        uint32_t u;
        std::memcpy(&u, bytes.data() + i, 4);
        ASSERT_NE(u, minus_zero) << "sub-group " << group << " element " << i / 4;
        ASSERT_NE(u, signalling) << "sub-group " << group << " element " << i / 4;
        saw_positive_zero = saw_positive_zero || u == 0;
      }
    }
    EXPECT_TRUE(saw_positive_zero);
  }
  // A sink that fails mid-step: the producer gets the error (never left waiting for a buffer).
  const Run failed = run(place_rig, grads, place_rig.registry.sub_groups().size() / 2);
  EXPECT_EQ(failed.failed.code(), StatusCode::kIoError);
  EXPECT_THAT(failed.failed.to_string(), HasSubstr("stepped from its gradient"));
  // And the next step runs clean.
  const Run again = run(place_rig, grads, UINT32_MAX);
  EXPECT_TRUE(again.failed.is_ok()) << again.failed.to_string();
  EXPECT_EQ(again.handed, run(ring_rig, grads, UINT32_MAX).handed);
}

// ---- BlockGatherer (partitioned parameters, Note [Gathered parameters]) -------------------------

TEST(BlockGatherer, EveryRankFetchesEveryBlockWholeFromItsOwnersAtEveryPosition) {
  for (const std::string param : {"none", "cpu"}) {
    Placing p;
    p.param = param;
    const std::vector<Bytes> expected = testing::whole_compute(p);
    uint64_t schedule_bytes = 0;  // every block twice per micro-step
    for (const auto& b : testing::blocks()) {
      std::vector<uint32_t> unique(b);
      std::sort(unique.begin(), unique.end());
      unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
      for (uint32_t id : unique) schedule_bytes += 2 * expected[id].size();
    }
    for (uint32_t world : {2u, 3u}) {
      SCOPED_TRACE("offload_param " + param + ", world " + std::to_string(world));
      LocalBus bus(world);
      on_ranks(world, p, bus, [&](uint32_t r, GatherRank& g) {
        // This rank holds the compute copies of its own sub-groups only.
        EXPECT_TRUE(g.rig.plan.partition_params);
        for (uint32_t s = 0; s < g.rig.plan.n_sub_groups; ++s)
          EXPECT_EQ(g.rig.store->location(s, StateKind::kCompute).held, g.rig.plan.owns(s)) << "rank " << r;
        for (const bool async : {false, true}) {
          Status st = g.micro_step(expected, async, UINT32_MAX, /*ahead=*/!async);
          EXPECT_TRUE(st.is_ok()) << "rank " << r << ": " << st.to_string();
          g.coord->invalidate();
        }
        const BlockGathererStats gs = g.gatherer->stats();
        EXPECT_EQ(gs.bytes, 2 * schedule_bytes) << "rank " << r;
        EXPECT_GT(g.coord->stats().fetches, 0u);
        EXPECT_GT(g.coord->stats().prefetches, 0u) << "rank " << r << ": a block gathered ahead is prefetched";
      });
    }
  }
}

TEST(BlockGatherer, AllgatherBucketSizeSplitsTheBroadcastsNotTheBytes) {
  Placing p;
  const std::vector<Bytes> expected = testing::whole_compute(p);
  std::vector<int> calls;
  for (const uint64_t bucket : {uint64_t{500'000'000}, uint64_t{1000}}) {
    LocalBus bus(2);
    on_ranks(
        2, p, bus,
        [&](uint32_t r, GatherRank& g) {
          Status st = g.micro_step(expected, false);
          EXPECT_TRUE(st.is_ok()) << "rank " << r << ": " << st.to_string();
        },
        bucket);
    calls.push_back(bus.calls[0]);
  }
  // The largest run (a layer's mlp, 19200 elements) alone needs 20 broadcasts of 1000.
  EXPECT_GE(calls[1], calls[0] + 19);
}

TEST(BlockGatherer, AnAbandonedMicroStepIsGatheredToItsEndForTheOtherRanks) {
  Placing p;
  const std::vector<Bytes> expected = testing::whole_compute(p);
  LocalBus bus(2);
  on_ranks(2, p, bus, [&](uint32_t r, GatherRank& g) {
    // Rank 1 abandons its first micro-step after 3 positions (as a failed forward would); rank 0 runs
    // it whole. The next begin_micro_step on rank 1 finishes the gathering, and both go on.
    Status first = g.micro_step(expected, false, r == 1 ? 3 : UINT32_MAX);
    EXPECT_TRUE(first.is_ok()) << first.to_string();
    Status second = g.micro_step(expected, true);
    EXPECT_TRUE(second.is_ok()) << "rank " << r << ": " << second.to_string();
  });
}

TEST(BlockGatherer, AFailedBroadcastFailsTheAcquireOnEveryRankNamingTheBlock) {
  Placing p;
  const std::vector<Bytes> expected = testing::whole_compute(p);
  LocalBus bus(2);
  bus.fail_call = 3;
  on_ranks(2, p, bus, [&](uint32_t r, GatherRank& g) {
    Status st = g.micro_step(expected, false);
    EXPECT_EQ(st.code(), StatusCode::kAborted) << "rank " << r << ": " << st.to_string();
    EXPECT_THAT(st.to_string(),
                HasSubstr("acquire block 2 'layers.1': gathering the parameters of block 2 'layers.1' from rank 1"));
    EXPECT_THAT(st.to_string(), HasSubstr("did not respond"));
    EXPECT_THAT(st.to_string(), HasSubstr("acquire block"));
  });
}

TEST(BlockGatherer, TheCoordinatorTakesAGathererExactlyWhenTheParamsArePartitioned) {
  LocalBus bus(2);
  GatherRank g;
  ASSERT_TRUE(g.init(Placing{}, 2, 0, bus).is_ok());
  auto without =
      ParamCoordinator::create(*g.rig.store, nullptr, testing::blocks(), testing::block_names(), CoordinatorOptions{});
  EXPECT_EQ(without.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(without.status().message(), HasSubstr("needs a gatherer"));
  Rig whole;
  ASSERT_TRUE(whole.init(Placing{}).is_ok());
  auto with = ParamCoordinator::create(*whole.store, nullptr, testing::blocks(), testing::block_names(),
                                       CoordinatorOptions{}, g.gatherer.get());
  EXPECT_EQ(with.status().code(), StatusCode::kInvalidArgument);
  auto gatherer = BlockGatherer::create(*whole.store, testing::blocks(), {.broadcast = bus.broadcast(0)});
  EXPECT_EQ(gatherer.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(gatherer.status().message(), HasSubstr("does not partition the parameters"));
}

}  // namespace
}  // namespace zo::engine
