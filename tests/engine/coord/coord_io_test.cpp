// engine/coord over real NVMe swap files (a temp dir under /tmp): compute copies fetched through
// the ParamSwapper with few buffers, read errors naming the param, gradient accumulators on NVMe
// bit-identical to the CPU and device tiers, and partitioned compute copies gathered from NVMe.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>
#include <thread>

#include "common/aligned_buffer.h"
#include "engine/coord/grad_accumulator.h"
#include "engine/coord/grad_worker.h"
#include "engine/coord/param_coordinator.h"
#include "engine/coord/update_gate.h"
#include "engine/memory/optimizer_swapper.h"
#include "tests/engine/coord/coord_rig.h"
#include "tests/engine/file_bytes.h"

namespace zo::engine {
namespace {

using testing::Bytes;
using ::testing::HasSubstr;
using testing::Placing;
using testing::Rig;

Placing nvme(uint64_t buffers, uint64_t max_in_cpu = 0) {
  Placing p;
  p.optimizer = "cpu";
  p.param = "nvme";
  p.param_buffer_count = buffers;
  p.max_in_cpu = max_in_cpu;
  return p;
}

TEST(ParamCoordinator, AcquireReturnsComputeBytesFromNvme) { testing::check_every_setting(nvme(4)); }

TEST(ParamCoordinator, AcquireReturnsComputeBytesWithOneSwapBuffer) { testing::check_every_setting(nvme(1)); }

TEST(ParamCoordinator, AcquireReturnsComputeBytesSplitBetweenCpuAndNvme) {
  // max_in_cpu keeps the first sub-groups on the CPU; a param may straddle the two.
  testing::check_every_setting(nvme(2, 20000));
}

TEST(ParamCoordinator, NvmeOptimizerAndNvmeParamsInFp32) {
  Placing p = nvme(3);
  p.optimizer = "nvme";
  p.bf16 = false;
  p.pin = false;
  testing::check_every_setting(p);
}

TEST(ParamCoordinator, CountsNvmeBytesAndReturnsEverySwapBuffer) {
  Rig rig;
  ASSERT_TRUE(rig.init(nvme(2)).is_ok());
  auto coord = testing::make_coordinator(rig, testing::opts(0, 1'000'000, 0, 0));
  testing::run_micro_step(rig, *coord, rig.gather(StateKind::kCompute));
  const CoordinatorStats cs = coord->stats();
  EXPECT_GT(cs.fetches, 0u);
  EXPECT_EQ(cs.nvme_read_bytes, cs.h2d_bytes);  // everything lives on NVMe
  EXPECT_EQ(rig.swapper->buffers_free(), rig.swapper->buffers_total());
}

// Note [The packed 4-bit base]: a frozen 4-bit weight lives as its blob (in pinned RAM, on NVMe or
// on the device), only the blob crosses PCIe, and it arrives in its slot dequantized: the bits the
// store's host reader gives, with prefetch on and off.
TEST(ParamCoordinator, PackedWeightsMoveAsBlobsAndArriveDequantized) {
  for (const char* tier : {"cpu", "nvme", "none"}) {
    for (const uint64_t bucket : {uint64_t{0}, uint64_t{40'000}}) {
      SCOPED_TRACE(std::string("offload_param ") + tier + ", prefetch bucket " + std::to_string(bucket));
      Rig rig;
      rig.packed_base = true;
      Placing s = nvme(3);
      s.param = tier;
      ASSERT_TRUE(rig.init(s).is_ok());
      std::vector<Bytes> expected = rig.gather(StateKind::kCompute);
      uint64_t blobs = 0, weights = 0;
      for (const ParamInfo& p : rig.registry.params()) {
        if (!p.packed) continue;
        std::vector<float> values(p.weights());
        ASSERT_TRUE(rig.store->read_param_compute(p.id, 0, values).is_ok());
        expected[p.id] = testing::to_dtype(values, DType::kBF16);
        if (p.name.starts_with("model.layers.0.")) {
          blobs += p.n_elems * 2;
          weights += p.weights() * 2;
        }
      }
      EXPECT_LT(blobs, weights * 45 / 100);  // NF4 attn 4.5 bits a weight, 8-bit mlp 8 and a scale a row
      // A packed weight takes bytes (init_packed), within its blob; values are refused.
      const uint32_t attn = testing::layer_param(0, 1);
      const ParamInfo& info = rig.registry.params()[attn];
      EXPECT_EQ(rig.store->init_param(attn, 0, std::vector<float>(4)).code(), StatusCode::kInvalidArgument);
      EXPECT_EQ(rig.store->init_packed(attn, info.n_elems * 2 - 1, Bytes(2)).code(), StatusCode::kInvalidArgument);
      EXPECT_EQ(rig.store->init_packed(testing::embed_id(), 0, Bytes(2)).code(), StatusCode::kInvalidArgument);
      auto coord = testing::make_coordinator(rig, testing::opts(bucket, 1'000'000, 0, 0));
      testing::run_micro_step(rig, *coord, expected);
      testing::run_micro_step(rig, *coord, expected);
      // Block 1 (layer 0: its norm in 16 bits, attn and mlp packed) alone, nothing else fetched.
      coord->invalidate();
      coord->begin_micro_step();
      ASSERT_TRUE(coord->acquire(0).is_ok());
      ASSERT_TRUE(coord->release(0).is_ok());
      const CoordinatorStats before = coord->stats();
      ASSERT_TRUE(coord->acquire(1).is_ok());
      const CoordinatorStats after = coord->stats();
      const bool on_device = std::string(tier) == "none";
      const uint64_t norm = on_device ? 0 : 96 * 2;
      if (bucket == 0) {
        EXPECT_EQ(after.h2d_bytes - before.h2d_bytes, on_device ? 0 : norm + blobs);
        EXPECT_EQ(after.fetches - before.fetches, on_device ? 2u : 3u);
      }
      ASSERT_TRUE(coord->release(1).is_ok());
    }
  }
}

TEST(ParamCoordinator, PrefetchReadsAheadFromNvme) {
  Rig rig;
  ASSERT_TRUE(rig.init(nvme(4)).is_ok());
  const uint64_t layer_elems = 96 * 96 + 96 * 200 + 96;
  auto coord = testing::make_coordinator(rig, testing::opts(layer_elems, 1'000'000, 0, 0));
  const auto bl = testing::blocks();
  const uint32_t n = static_cast<uint32_t>(bl.size());
  coord->begin_micro_step();
  for (uint32_t q = 0; q < 2 * n; ++q) {
    const uint32_t b = q < n ? q : 2 * n - 1 - q;
    const uint64_t hits = coord->stats().hits;
    ASSERT_TRUE(coord->acquire(b).is_ok());
    if (q > 0) { EXPECT_EQ(coord->stats().hits - hits, bl[b].size()) << "position " << q; }
    ASSERT_TRUE(coord->release(b).is_ok());
  }
  EXPECT_GT(coord->stats().prefetches, 0u);
}

TEST(ParamCoordinator, InvalidateRereadsChangedNvmeCopies) {
  Rig rig;
  ASSERT_TRUE(rig.init(nvme(2)).is_ok());
  auto coord = testing::make_coordinator(rig, testing::opts(30000, 1'000'000, 200, 1'000'000'000));
  testing::run_micro_step(rig, *coord, rig.gather(StateKind::kCompute));
  if (HasFatalFailure()) return;
  std::mt19937 rng(11);
  std::vector<Bytes> after;
  for (const auto& p : rig.registry.params()) after.push_back(testing::random_bytes(p.n_elems * 2, rng));
  ASSERT_TRUE(rig.scatter(StateKind::kCompute, after).is_ok());
  coord->invalidate();
  testing::run_micro_step(rig, *coord, after);
}

TEST(ParamCoordinator, ReadErrorNamesTheBlockAndParamAndIsRetryable) {
  Rig rig;
  ASSERT_TRUE(rig.init(nvme(2)).is_ok());
  const auto expected = rig.gather(StateKind::kCompute);
  auto coord = testing::make_coordinator(rig, testing::opts(0, 1'000'000, 0, 0));
  rig.faults->add({io::FaultKind::kEio, io::IoOp::kRead, "param.swp", 0, -1});
  coord->begin_micro_step();
  auto failed = coord->acquire(0);
  ASSERT_FALSE(failed.is_ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_THAT(failed.status().message(), HasSubstr("block 0 'embed'"));
  EXPECT_THAT(failed.status().message(), HasSubstr("model.embed_tokens.weight"));
  EXPECT_THAT(failed.status().message(), HasSubstr("param.swp"));
  EXPECT_EQ(rig.swapper->buffers_free(), rig.swapper->buffers_total());
  rig.faults->clear();
  auto retried = coord->acquire(0);
  ASSERT_TRUE(retried.is_ok()) << retried.status().to_string();
  EXPECT_EQ(rig.d2h((*retried)[0], expected[0].size()), expected[0]);
}

TEST(ParamCoordinator, PrefetchReadErrorSurfacesAtTheAcquireThatNeedsIt) {
  Rig rig;
  ASSERT_TRUE(rig.init(nvme(4)).is_ok());
  const auto expected = rig.gather(StateKind::kCompute);
  const uint64_t layer_elems = 96 * 96 + 96 * 200 + 96;
  auto coord = testing::make_coordinator(rig, testing::opts(layer_elems, 1'000'000, 0, 0));
  const uint32_t attn = testing::layer_param(1, 1);
  const ParamPiece& piece = rig.registry.pieces_of_param(attn).front();
  const uint64_t offset = rig.store->location(piece.sub_group, StateKind::kCompute).region.offset_bytes +
                          piece.group_offset * rig.compute_bytes();
  coord->begin_micro_step();
  ASSERT_TRUE(coord->acquire(0).is_ok());
  ASSERT_TRUE(coord->release(0).is_ok());
  rig.faults->add({io::FaultKind::kEio, io::IoOp::kRead, "param.swp", offset, 1});
  const uint64_t prefetches = coord->stats().prefetches;
  ASSERT_TRUE(coord->acquire(1).is_ok());  // prefetches layers.1, whose attn read fails
  ASSERT_TRUE(coord->release(1).is_ok());
  EXPECT_EQ(coord->stats().prefetches - prefetches, 3u);
  const uint64_t hits = coord->stats().hits;
  auto failed = coord->acquire(2);
  EXPECT_EQ(rig.faults->injected(), 1u);
  EXPECT_EQ(coord->stats().hits - hits, 3u);  // the failed read was the prefetch's
  ASSERT_FALSE(failed.is_ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_THAT(failed.status().message(), HasSubstr("block 2 'layers.1'"));
  EXPECT_THAT(failed.status().message(), HasSubstr("model.layers.1.self_attn.weight"));
  auto retried = coord->acquire(2);
  ASSERT_TRUE(retried.is_ok()) << retried.status().to_string();
  for (size_t i = 0; i < testing::blocks()[2].size(); ++i) {
    const uint32_t p = testing::blocks()[2][i];
    EXPECT_EQ(rig.d2h((*retried)[i], expected[p].size()), expected[p]) << rig.registry.params()[p].name;
  }
  ASSERT_TRUE(coord->release(2).is_ok());
  const uint32_t n = testing::kLayers + 2;
  for (uint32_t q = 3; q < 2 * n; ++q) {
    const uint32_t b = q < n ? q : 2 * n - 1 - q;
    ASSERT_TRUE(coord->acquire(b).is_ok()) << "position " << q;
    ASSERT_TRUE(coord->release(b).is_ok());
  }
  EXPECT_EQ(rig.swapper->buffers_free(), rig.swapper->buffers_total());  // none leaked by the failure
}

TEST(ParamCoordinator, NvmeParamWithoutSwapperIsRejected) {
  Rig rig;
  ASSERT_TRUE(rig.init(nvme(2)).is_ok());
  auto coord =
      ParamCoordinator::create(*rig.store, nullptr, testing::blocks(), testing::block_names(), CoordinatorOptions{});
  ASSERT_FALSE(coord.is_ok());
  EXPECT_EQ(coord.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(coord.status().message(), HasSubstr("on NVMe but no ParamSwapper"));
}

uint64_t double_bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

// Note [Overlapped optimizer] with the real parts: an OptimizerSwapper step on its own thread
// publishing to the gate while a coordinator runs a micro-step behind it (NVMe writes of the new
// compute copies racing NVMe reads of the updated ones) serves exactly the compute copies that the
// same step leaves when nothing runs beside it. Also run under TSan (docs/development.md).
TEST(ParamCoordinator, AForwardBehindAnOptimizerStepSeesEveryUpdatedCopy) {
  struct Case {
    const char* name;
    Placing placing;
    bool pipeline;
  };
  Placing cpu;
  Placing nvme_both = nvme(2);
  nvme_both.optimizer = "nvme";
  nvme_both.pipeline = true;
  Placing nvme_opt;
  nvme_opt.optimizer = "nvme";
  const Case cases[] = {{"optimizer cpu, params cpu", cpu, false},
                        {"optimizer nvme, params nvme, pipelined", nvme_both, true},
                        {"optimizer nvme, params cpu", nvme_opt, false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Rig sequential, overlapped;
    ASSERT_TRUE(sequential.init(c.placing).is_ok());
    ASSERT_TRUE(overlapped.init(c.placing).is_ok());
    std::mt19937 rng(11);
    std::vector<Bytes> grads;
    for (const auto& p : sequential.registry.params())
      grads.push_back(testing::to_dtype(testing::random_floats(p.n_elems, rng, 0.1f), DType::kF32));
    ASSERT_TRUE(sequential.scatter(StateKind::kGradAccum, grads).is_ok());
    ASSERT_TRUE(overlapped.scatter(StateKind::kGradAccum, grads).is_ok());
    const PipelineOptions po{.pipeline_read = c.pipeline, .pipeline_write = c.pipeline};
    OptimizerStepArgs args;
    args.hyperparameters = cpu_optim::AdamConfig{.lr = 0.01f, .weight_decay = 0.01f};

    auto seq_opt = OptimizerSwapper::create(*sequential.store, testing::executor(), po);
    ASSERT_TRUE(seq_opt.is_ok()) << seq_opt.status().to_string();
    ASSERT_TRUE((*seq_opt)->step(args).is_ok());
    const auto expected = sequential.gather(StateKind::kCompute);
    ASSERT_NE(expected, overlapped.gather(StateKind::kCompute)) << "the step must change the compute copies";

    auto over_opt = OptimizerSwapper::create(*overlapped.store, testing::executor(), po);
    ASSERT_TRUE(over_opt.is_ok()) << over_opt.status().to_string();
    auto coord = testing::make_coordinator(overlapped, testing::opts(1'000'000, 1'000'000, 200, 1'000'000'000));
    testing::run_micro_step(overlapped, *coord, overlapped.gather(StateKind::kCompute));  // warm: copies cached
    if (HasFatalFailure()) return;
    UpdateGate gate(static_cast<uint32_t>(overlapped.registry.sub_groups().size()));
    coord->set_update_gate(&gate);
    coord->invalidate();
    gate.open();
    std::optional<Status> stepped;
    std::thread optimizer([&] {
      OptimizerStepArgs a = args;
      a.on_compute_ready = [&gate](uint32_t g) { gate.publish(g); };
      auto r = (*over_opt)->step(a);
      stepped = r.is_ok() ? Status::ok() : r.status();
      gate.close(*stepped);
    });
    testing::run_micro_step(overlapped, *coord, expected);
    optimizer.join();
    ASSERT_TRUE(stepped->is_ok()) << stepped->to_string();
    EXPECT_EQ(overlapped.gather(StateKind::kMaster), sequential.gather(StateKind::kMaster));
  }
}

TEST(GradAccumulator, BitIdenticalOnCpuDeviceAndNvme) {
  for (const char* acc_dtype : {"fp32", "bf16"}) {
    for (DType gdt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (int steps : {1, 3}) {
        SCOPED_TRACE(std::string("accumulator ") + acc_dtype + " grad " + std::string(dtype_name(gdt)) + " steps " +
                     std::to_string(steps));
        std::vector<Bytes> ref;
        std::vector<uint64_t> norms;
        for (const char* tier : {"cpu", "none", "nvme"}) {
          Placing p;
          p.optimizer = tier;
          p.param = std::string(tier) == "nvme" ? "cpu" : tier;
          p.grad = acc_dtype;
          Rig rig;
          Status st = rig.init(p);
          ASSERT_TRUE(st.is_ok()) << st.to_string();
          ASSERT_EQ(rig.plan.placement.grad, std::string(tier) == "cpu"    ? Tier::kCpu
                                             : std::string(tier) == "none" ? Tier::kDevice
                                                                           : Tier::kNvme);
          const auto grads = testing::random_grads(rig, steps, gdt, 21);
          if (ref.empty()) ref = testing::reference_accumulate(rig, grads, gdt, rig.plan.placement.grad_dtype);
          // Garbage in the accumulators first: the first micro-step must not read it.
          std::mt19937 rng(5);
          std::vector<Bytes> garbage;
          for (const auto& q : rig.registry.params())
            garbage.push_back(testing::random_bytes(q.n_elems * rig.grad_bytes(), rng));
          ASSERT_TRUE(rig.scatter(StateKind::kGradAccum, garbage).is_ok());
          auto acc = GradAccumulator::create(*rig.store, testing::contribution_order(), testing::executor());
          ASSERT_TRUE(acc.is_ok());
          const auto order = testing::contribution_order();
          GradNormReport report;
          uint64_t moved = 0;
          for (int m = 0; m < steps; ++m) {
            ASSERT_TRUE((*acc)->begin_micro_step(m == 0, m + 1 == steps).is_ok());
            for (size_t c = 0; c < order.size(); ++c) {
              st = (*acc)->add(order[c], grads[m][c], gdt);
              ASSERT_TRUE(st.is_ok()) << st.to_string();
            }
            auto r = (*acc)->end_micro_step();
            ASSERT_TRUE(r.is_ok());
            report = *r;
            moved += r->bytes_read + r->bytes_written;
          }
          ASSERT_EQ(rig.gather(StateKind::kGradAccum), ref) << "tier " << tier;
          EXPECT_FALSE(report.nonfinite);
          EXPECT_GT(report.sum_sq, 0.0);
          norms.push_back(double_bits(report.sum_sq));
          if (std::string(tier) == "cpu") {
            EXPECT_EQ(moved, 0u);
          } else {
            EXPECT_GT(moved, 0u);
          }
        }
        EXPECT_EQ(norms[0], norms[1]);
        EXPECT_EQ(norms[0], norms[2]);
      }
    }
  }
}

// bf16 rounded to nearest even, NaN kept quiet: written here, not taken from cpu_optim.
uint16_t bf16_nearest_even(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

Bytes rounded_to_bf16(const Bytes& fp32) {
  Bytes out(fp32.size() / 2);
  for (size_t i = 0; i < fp32.size() / 4; ++i) {
    float f;
    std::memcpy(&f, fp32.data() + 4 * i, 4);
    const uint16_t b = bf16_nearest_even(f);
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

// Note [Gradients stored in 16 bits]: with zoffload.gradient_store_dtype bf16 over fp32 sums, every
// tier stores each fp32 sum (a tied param's two contributions added in fp32 first) rounded once to
// bf16, and the norm is the fp32 sums' — the same bits as with fp32 accumulators.
TEST(GradAccumulator, Bf16StoredSumsAreTheFp32SumsRoundedOnceWithTheFp32Norm) {
  for (DType gdt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE("grad " + std::string(dtype_name(gdt)));
    std::vector<Bytes> expected;
    uint64_t fp32_norm = 0;
    for (const char* tier : {"cpu", "nvme"}) {  // the config refuses it with the optimizer on the device
      for (const char* store : {"auto", "bf16"}) {
        SCOPED_TRACE(std::string("tier ") + tier + " store " + store);
        Placing p;
        p.optimizer = tier;
        p.param = "cpu";
        p.store = store;
        Rig rig;
        Status st = rig.init(p);
        ASSERT_TRUE(st.is_ok()) << st.to_string();
        const bool rounded = std::string(store) == "bf16";
        ASSERT_EQ(rig.grad_bytes(), rounded ? 2u : 4u);
        const auto grads = testing::random_grads(rig, 1, gdt, 33);
        if (expected.empty()) {
          for (const Bytes& sum : testing::reference_accumulate(rig, grads, gdt, DType::kF32))
            expected.push_back(rounded_to_bf16(sum));
        }
        auto acc = GradAccumulator::create(*rig.store, testing::contribution_order(), testing::executor());
        ASSERT_TRUE(acc.is_ok()) << acc.status().to_string();
        if (rounded) {  // a window that is not the step's only one would add to rounded sums
          st = (*acc)->begin_micro_step(true, false);
          EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
          EXPECT_THAT(st.message(), HasSubstr("vertical schedule"));
        }
        ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
        const auto order = testing::contribution_order();
        for (size_t c = 0; c < order.size(); ++c) {
          st = (*acc)->add(order[c], grads[0][c], gdt);
          ASSERT_TRUE(st.is_ok()) << st.to_string();
        }
        auto report = (*acc)->end_micro_step();
        ASSERT_TRUE(report.is_ok()) << report.status().to_string();
        EXPECT_GT(report->sum_sq, 0.0);
        if (fp32_norm == 0) fp32_norm = double_bits(report->sum_sq);
        EXPECT_EQ(double_bits(report->sum_sq), fp32_norm);
        if (rounded) {
          EXPECT_EQ(rig.gather(StateKind::kGradAccum), expected);
          if (std::string(tier) == "nvme") EXPECT_EQ(report->bytes_written, rig.registry.total_elems() * 2);
        }
      }
    }
  }
}

// Rounding in place through a scratch smaller than the data, over odd sizes, gives what rounding
// into another buffer gives.
TEST(GradAccumulator, NarrowInPlaceThroughASmallScratchMatchesRoundingElsewhere) {
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (uint64_t n : {1u, 7u, 64u, 1000u, 4099u}) {
    for (uint64_t scratch_elems : {1u, 5u, 64u, 5000u}) {
      Bytes data(n * 4);
      for (uint64_t i = 0; i < n; ++i) {
        const float f = normal(rng);
        std::memcpy(data.data() + 4 * i, &f, 4);
      }
      const Bytes want = rounded_to_bf16(data);
      Bytes scratch(scratch_elems * 2);
      Status st = narrow_in_place(data.data(), n, DType::kF32, DType::kBF16, scratch, testing::executor());
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      EXPECT_EQ(Bytes(data.begin(), data.begin() + static_cast<std::ptrdiff_t>(n * 2)), want)
          << "n " << n << " scratch " << scratch_elems;
    }
  }
  Bytes one(4), none;
  EXPECT_EQ(narrow_in_place(one.data(), 1, DType::kF32, DType::kBF16, none, testing::executor()).code(),
            StatusCode::kInvalidArgument);
}

TEST(GradAccumulator, WriteErrorNamesTheSubGroup) {
  Placing p;
  p.optimizer = "nvme";
  Rig rig;
  ASSERT_TRUE(rig.init(p).is_ok());
  auto acc = GradAccumulator::create(*rig.store, testing::contribution_order(), testing::executor());
  ASSERT_TRUE(acc.is_ok());
  for (const auto& g : rig.registry.sub_groups()) {
    const SwapRegion r = rig.store->location(g.index, StateKind::kGradAccum).region;
    rig.faults->add({io::FaultKind::kEio, io::IoOp::kWrite, "optimizer.swp", r.offset_bytes, -1});
  }
  const auto order = testing::contribution_order();
  const auto grads = testing::random_grads(rig, 1, DType::kF32, 3);
  ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
  Status st;
  for (size_t c = 0; c < order.size() && st.is_ok(); ++c) st = (*acc)->add(order[c], grads[0][c], DType::kF32);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_THAT(st.message(), HasSubstr("writing sub-group"));
  EXPECT_THAT(st.message(), HasSubstr("optimizer.swp"));
}

// Note [Asynchronous accumulator writes]: an add that completes a sub-group queues its write and
// returns; the writes are finished by the boundary, whose report and the file's bytes are those of
// the synchronous path (BitIdenticalOnCpuDeviceAndNvme). A write still queued at end_micro_step
// fails it, naming the sub-group, file and offset; abandon_micro_step waits for what is queued and
// frees every buffer, so the next micro-step runs whole.
TEST(GradAccumulator, NvmeWritesAreQueuedBehindTheAddsAndFinishedByTheBoundary) {
  Placing p;
  p.optimizer = "nvme";
  Rig rig;
  ASSERT_TRUE(rig.init(p).is_ok());
  ASSERT_EQ(rig.plan.placement.grad, Tier::kNvme);
  const auto order = testing::contribution_order();
  auto acc = GradAccumulator::create(*rig.store, order, testing::executor());
  ASSERT_TRUE(acc.is_ok());
  EXPECT_EQ((*acc)->buffer_bytes() % kSwapAlignment, 0u) << "whole blocks: a sub-group's padded region";
  const auto grads = testing::random_grads(rig, 3, DType::kF32, 8);
  const std::vector<Bytes> expected = testing::reference_accumulate(rig, {grads[2]}, DType::kF32, DType::kF32);

  // The last sub-group to complete is the one holding the last contribution's param: its write is
  // the one still queued when the adds end.
  const uint32_t last_group = rig.registry.pieces_of_param(order.back()).front().sub_group;
  const SwapRegion last = rig.store->location(last_group, StateKind::kGradAccum).region;
  rig.faults->add({io::FaultKind::kEio, io::IoOp::kWrite, "optimizer.swp", last.offset_bytes, 1});
  ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
  uint32_t most_queued = 0;
  for (size_t c = 0; c < order.size(); ++c) {
    ASSERT_TRUE((*acc)->add(order[c], grads[0][c], DType::kF32).is_ok());
    most_queued = std::max(most_queued, (*acc)->queued_writes());
  }
  EXPECT_GE(most_queued, 1u) << "an add returned with its sub-group's write still queued";
  EXPECT_GE((*acc)->queued_writes(), 1u);
  auto failed = (*acc)->end_micro_step();
  ASSERT_FALSE(failed.is_ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status().to_string();
  EXPECT_THAT(failed.status().message(), HasSubstr("writing sub-group " + std::to_string(last_group)));
  EXPECT_THAT(failed.status().message(), HasSubstr("optimizer.swp"));
  EXPECT_THAT(failed.status().message(), HasSubstr(std::to_string(last.offset_bytes)));
  EXPECT_EQ((*acc)->queued_writes(), 0u);
  (*acc)->abandon_micro_step();

  // Abandoned with writes queued: every buffer comes back, and the next micro-step is whole.
  ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
  for (size_t c = 0; c < order.size() / 2; ++c) ASSERT_TRUE((*acc)->add(order[c], grads[1][c], DType::kF32).is_ok());
  (*acc)->abandon_micro_step();
  EXPECT_EQ((*acc)->queued_writes(), 0u);
  ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
  for (size_t c = 0; c < order.size(); ++c) ASSERT_TRUE((*acc)->add(order[c], grads[2][c], DType::kF32).is_ok());
  auto report = (*acc)->end_micro_step();
  ASSERT_TRUE(report.is_ok()) << report.status().to_string();
  EXPECT_EQ((*acc)->queued_writes(), 0u);
  EXPECT_EQ(rig.gather(StateKind::kGradAccum), expected);
}

// Note [Asynchronous accumulator writes]: the write-behind carries the region's whole pages; past an
// accumulator's end they are its padding, zeroed as the store's own writes zero it
// (StateStore.AWriteEndingAtAStatesEndZeroesThePaddingOfItsLastPageUnread in swapper_test), whatever
// was on disk there and whatever a reused buffer held there from a larger sub-group. Two micro-steps
// send every buffer round the sub-groups twice; the file's bytes are checked as the OS returns them.
TEST(GradAccumulator, NvmeWritesZeroThePaddingPastEachAccumulatorsEnd) {
  Placing p;
  p.optimizer = "nvme";
  Rig rig;
  ASSERT_TRUE(rig.init(p).is_ok());
  ASSERT_EQ(rig.plan.placement.grad, Tier::kNvme);
  const std::string path = rig.store->optimizer_file()->path();
  uint32_t odd = 0;
  for (const auto& g : rig.registry.sub_groups()) {
    const uint64_t size = rig.store->state_bytes(g.index, StateKind::kGradAccum);
    const uint64_t padded = rig.store->padded_state_bytes(g.index, StateKind::kGradAccum);
    if (size == padded) continue;
    ++odd;
    write_file_bytes(path, rig.store->location(g.index, StateKind::kGradAccum).region.offset_bytes + size,
                     Bytes(padded - size, std::byte{0xa5}));
  }
  ASSERT_GE(odd, 2u) << "sub-groups of the test model that end mid-page";
  const auto order = testing::contribution_order();
  auto acc = GradAccumulator::create(*rig.store, order, testing::executor());
  ASSERT_TRUE(acc.is_ok()) << acc.status().to_string();
  const auto grads = testing::random_grads(rig, 2, DType::kF32, 13);
  const std::vector<Bytes> expected = testing::reference_accumulate(rig, grads, DType::kF32, DType::kF32);
  for (int m = 0; m < 2; ++m) {
    ASSERT_TRUE((*acc)->begin_micro_step(m == 0, m == 1).is_ok());
    for (size_t c = 0; c < order.size(); ++c) ASSERT_TRUE((*acc)->add(order[c], grads[m][c], DType::kF32).is_ok());
    auto report = (*acc)->end_micro_step();
    ASSERT_TRUE(report.is_ok()) << report.status().to_string();
  }
  const uint64_t eb = rig.grad_bytes();
  for (const auto& g : rig.registry.sub_groups()) {
    SCOPED_TRACE("sub-group " + std::to_string(g.index));
    const uint64_t size = rig.store->state_bytes(g.index, StateKind::kGradAccum);
    const uint64_t padded = rig.store->padded_state_bytes(g.index, StateKind::kGradAccum);
    Bytes want(padded, std::byte{0});
    for (const auto& piece : rig.registry.pieces_of_group(g.index)) {
      std::memcpy(want.data() + piece.group_offset * eb, expected[piece.param].data() + piece.param_offset * eb,
                  piece.n_elems * eb);
    }
    const Bytes disk =
        read_file_bytes(path, rig.store->location(g.index, StateKind::kGradAccum).region.offset_bytes, padded);
    EXPECT_TRUE(std::equal(disk.begin(), disk.begin() + static_cast<std::ptrdiff_t>(size), want.begin()))
        << "the accumulator's bytes on disk";
    EXPECT_EQ(std::count_if(disk.begin() + static_cast<std::ptrdiff_t>(size), disk.end(),
                            [](std::byte x) { return x != std::byte{0}; }),
              0)
        << "of the " << padded - size << " bytes of padding";
  }
}

// An I/O error in an accumulator write the worker does behind backward: later submits fail fast
// with the same error, drain() reports it naming the sub-group, the file and the offset, and the
// next micro-step starts clean.
TEST(GradWorker, AWriteErrorBehindBackwardIsReportedByDrainAndCleared) {
  Placing p;
  p.optimizer = "nvme";
  Rig rig;
  ASSERT_TRUE(rig.init(p).is_ok());
  auto acc = GradAccumulator::create(*rig.store, testing::contribution_order(), testing::executor());
  ASSERT_TRUE(acc.is_ok());
  AlignedBuffer ring = std::move(AlignedBuffer::allocate(1 << 20)).value();
  auto worker = GradWorker::create(**acc, ring.bytes());
  ASSERT_TRUE(worker.is_ok());
  const SwapRegion first = rig.store->location(0, StateKind::kGradAccum).region;
  rig.faults->add({io::FaultKind::kEio, io::IoOp::kWrite, "optimizer.swp", first.offset_bytes, 1});
  const auto order = testing::contribution_order();
  const auto grads = testing::random_grads(rig, 2, DType::kF32, 4);
  ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
  auto copy_of = [](const Bytes& g) {
    return [&g](std::span<std::byte> dest, uint64_t from) {
      std::memcpy(dest.data(), g.data() + from, dest.size());
      return Status::ok();
    };
  };
  size_t refused = 0;
  Status first_refusal;
  for (size_t c = 0; c < order.size(); ++c) {
    Status st = (*worker)->submit(order[c], DType::kF32, grads[0][c].size(), copy_of(grads[0][c]));
    if (!st.is_ok() && refused++ == 0) first_refusal = st;
  }
  const Status st = (*worker)->drain();
  ASSERT_EQ(st.code(), StatusCode::kIoError) << st.to_string();
  EXPECT_THAT(st.message(), HasSubstr("writing sub-group 0"));
  EXPECT_THAT(st.message(), HasSubstr("optimizer.swp"));
  EXPECT_THAT(st.message(), HasSubstr(std::to_string(first.offset_bytes)));
  if (refused > 0) { EXPECT_EQ(first_refusal.message(), st.message()); }
  (*acc)->abandon_micro_step();

  // The fault fired once: the next window accumulates and drains cleanly.
  EXPECT_TRUE((*worker)->drain().is_ok());
  ASSERT_TRUE((*acc)->begin_micro_step(true, true).is_ok());
  for (size_t c = 0; c < order.size(); ++c)
    ASSERT_TRUE((*worker)->submit(order[c], DType::kF32, grads[1][c].size(), copy_of(grads[1][c])).is_ok());
  EXPECT_TRUE((*worker)->drain().is_ok());
  EXPECT_TRUE((*acc)->end_micro_step().is_ok());
}

// Note [Gathered parameters]: each rank reads its own part of a block from its NVMe swap file.
TEST(BlockGatherer, GathersComputeCopiesFromNvmeAndAFailedOwnReadFailsThatRankOnly) {
  const Placing p = nvme(2);
  const std::vector<Bytes> expected = testing::whole_compute(p);
  testing::LocalBus bus(2);
  testing::on_ranks(2, p, bus, [&](uint32_t r, testing::GatherRank& g) {
    EXPECT_NE(g.rig.store->param_file(), nullptr) << "rank " << r << " holds its compute copies on NVMe";
    // Rank 1 cannot read its first piece once: its acquire fails with the I/O error; rank 0 goes
    // on (with stale bytes for rank 1's part: not checked), and the next micro-step is whole on both.
    if (r == 1)
      g.rig.faults->add(
          {.kind = io::FaultKind::kEio, .op = io::IoOp::kRead, .path_contains = "param.swp", .offset_bytes = 0});
    Status first = g.micro_step({}, false);
    if (r == 1) {
      EXPECT_EQ(first.code(), StatusCode::kIoError) << first.to_string();
      EXPECT_THAT(first.to_string(), HasSubstr("reading this rank's parameters of block"));
      EXPECT_THAT(first.to_string(), HasSubstr("param.swp"));
    } else {
      EXPECT_TRUE(first.is_ok()) << first.to_string();
    }
    Status second = g.micro_step(expected, true);
    EXPECT_TRUE(second.is_ok()) << "rank " << r << ": " << second.to_string();
    EXPECT_GT(g.rig.accounting.snapshot().nvme_read_bytes, 0u);
  });
}

}  // namespace
}  // namespace zo::engine
