// ProcessGroup over a real TCPStore and Gloo, its ranks threads of this process: the sums against
// a serial loop at odd sizes, reduce to each root, broadcast from each root, and a rank that never
// arrives at a collective named within seconds (Note [A rank that fails]).
#include "engine/dist/process_group.h"

#include <barrier>
#include <chrono>
#include <csignal>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/engine/free_port.h"

namespace zo::engine::dist {
namespace {

using ::testing::HasSubstr;

// As process_group.h asks: a peer that closes mid-send fails the collective, not the process.
const bool kSigpipeIgnored = [] {
  std::signal(SIGPIPE, SIG_IGN);
  return true;
}();

// Runs `body` on `world` ranks, each a thread with its own ProcessGroup; returns each rank's
// status. The groups outlive every thread's body (the ranks share Gloo's device loop: one tears
// down only when all are done).
std::vector<Status> run_ranks(uint32_t world, std::chrono::milliseconds timeout,
                              const std::function<Status(ProcessGroup&)>& body) {
  const uint16_t port = free_port();
  std::vector<Status> out(world);
  std::vector<std::unique_ptr<ProcessGroup>> groups(world);
  std::barrier all_done(static_cast<std::ptrdiff_t>(world));
  std::vector<std::thread> ranks;
  for (uint32_t r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      WorldInfo w;
      w.rank = r;
      w.world_size = world;
      w.local_rank = r;
      w.local_world_size = world;
      w.master_addr = "127.0.0.1";
      w.master_port = port;
      Result<std::unique_ptr<ProcessGroup>> g = ProcessGroup::create(w, timeout);
      if (g.is_ok()) {
        groups[r] = std::move(*g);
        out[r] = body(*groups[r]);
      } else {
        out[r] = g.status();
      }
      all_done.arrive_and_wait();
    });
  }
  for (std::thread& t : ranks) t.join();
  return out;
}

// Rank r's value of element i: small integers, so every order of summation gives the same exact
// float, and the serial loop below is the reference for any algorithm Gloo picks.
float value(uint32_t rank, uint64_t i) { return static_cast<float>((i * 7 + rank * 13) % 101) - 50.0f; }

TEST(ProcessGroup, AllReduceSumsAsASerialLoopDoesAtOddSizes) {
  constexpr uint32_t kWorld = 3;
  const std::vector<uint64_t> sizes = {1, 7, 1001, 262'147};  // odd, and past Gloo's chunking
  const std::vector<Status> st = run_ranks(kWorld, std::chrono::seconds(60), [&](ProcessGroup& g) -> Status {
    for (const uint64_t n : sizes) {
      std::vector<float> data(n);
      for (uint64_t i = 0; i < n; ++i) data[i] = value(g.rank(), i);
      ZO_RETURN_IF_ERROR(g.all_reduce_sum(data.data(), n, DType::kF32, "test sum"));
      for (uint64_t i = 0; i < n; ++i) {
        float want = 0;
        for (uint32_t r = 0; r < kWorld; ++r) want += value(r, i);
        if (data[i] != want)
          return internal_error("rank " + std::to_string(g.rank()) + ", n " + std::to_string(n) + ", element " +
                                std::to_string(i) + ": " + std::to_string(data[i]) + " != " + std::to_string(want));
      }
    }
    std::vector<double> d = {0.5 * g.rank(), 1e300, -3.0};
    ZO_RETURN_IF_ERROR(g.all_reduce_sum(std::span<double>(d), "test doubles"));
    if (d[0] != 1.5 || d[1] != 3e300 || d[2] != -9.0) return internal_error("double sums");
    return Status::ok();
  });
  for (uint32_t r = 0; r < kWorld; ++r) EXPECT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
}

TEST(ProcessGroup, ReduceSumsOnEachRootAndBroadcastCopiesEachRootsBytes) {
  constexpr uint32_t kWorld = 3;
  constexpr uint64_t kN = 1001;
  const std::vector<Status> st = run_ranks(kWorld, std::chrono::seconds(60), [&](ProcessGroup& g) -> Status {
    for (uint32_t root = 0; root < kWorld; ++root) {
      std::vector<float> data(kN);
      for (uint64_t i = 0; i < kN; ++i) data[i] = value(g.rank(), i);
      ZO_RETURN_IF_ERROR(g.reduce_sum(data.data(), kN, DType::kF32, root, "test reduce"));
      if (g.rank() == root) {
        for (uint64_t i = 0; i < kN; ++i)
          if (data[i] != value(0, i) + value(1, i) + value(2, i))
            return internal_error("reduce to root " + std::to_string(root) + ": element " + std::to_string(i));
      }
      // An odd byte count, each rank's own pattern: after the call every rank holds root's.
      std::vector<unsigned char> bytes(kN);
      for (uint64_t i = 0; i < kN; ++i) bytes[i] = static_cast<unsigned char>(i * 31 + g.rank() * 101);
      ZO_RETURN_IF_ERROR(g.broadcast(bytes.data(), kN, root, "test broadcast"));
      for (uint64_t i = 0; i < kN; ++i)
        if (bytes[i] != static_cast<unsigned char>(i * 31 + root * 101))
          return internal_error("broadcast from root " + std::to_string(root) + " on rank " + std::to_string(g.rank()) +
                                ": byte " + std::to_string(i));
    }
    return g.barrier("test barrier");
  });
  for (uint32_t r = 0; r < kWorld; ++r) EXPECT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
}

TEST(ProcessGroup, ARankThatNeverArrivesIsNamedWithinSeconds) {
  const auto timeout = std::chrono::seconds(3);
  std::chrono::steady_clock::duration took{};
  bool broken_after = false;
  const std::vector<Status> st = run_ranks(2, timeout, [&](ProcessGroup& g) -> Status {
    if (g.rank() == 1) return Status::ok();  // joined, but never calls the collective
    float x = 1;
    const auto t0 = std::chrono::steady_clock::now();
    Status s = g.all_reduce_sum(&x, 1, DType::kF32, "the lonely sum");
    took = std::chrono::steady_clock::now() - t0;
    broken_after = g.broken();
    return s;
  });
  EXPECT_TRUE(st[1].is_ok()) << st[1].to_string();
  EXPECT_EQ(st[0].code(), StatusCode::kAborted) << st[0].to_string();
  EXPECT_THAT(st[0].message(), HasSubstr("rank 1 of 2 did not respond"));
  EXPECT_THAT(st[0].message(), HasSubstr("the lonely sum"));
  EXPECT_TRUE(broken_after);
  // The timeout, then a few seconds of check-in with the store: never the minutes of a hang.
  EXPECT_LT(took, timeout + std::chrono::seconds(15));
  EXPECT_GE(took, timeout - std::chrono::milliseconds(200));
}

}  // namespace
}  // namespace zo::engine::dist
