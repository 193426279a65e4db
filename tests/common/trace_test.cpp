#include "common/trace.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

namespace zo::trace {
namespace {

using ::testing::HasSubstr;

TEST(Trace, RecordsOnlyWhileOnAndKeepsAtMostItsCapacity) {
  start(3);
  { Span s(Track::kCompute, "a"); }
  pause();
  bool built = false;
  {
    Span s(Track::kCompute, [&] {
      built = true;
      return std::string("while-paused");
    });
  }
  EXPECT_FALSE(built) << "a span's name is not built while the trace is off";
  resume();
  for (int i = 0; i < 5; ++i) record(Track::kOptimizer, "sub-group " + std::to_string(i), 10, 20);
  pause();
  EXPECT_EQ(spans_kept(), 3u);
  EXPECT_EQ(spans_dropped(), 3u);
  const std::string json = to_chrome_json();
  EXPECT_THAT(json, HasSubstr(R"("spans_dropped":3)"));
  EXPECT_THAT(json, HasSubstr(R"("name":"a")"));
  EXPECT_THAT(json, ::testing::Not(HasSubstr("while-paused")));
  EXPECT_THAT(json, HasSubstr(R"("args":{"name":"optimizer"})"));
}

TEST(Trace, EscapesNamesAndWritesMicroseconds) {
  start(10);
  record(Track::kCheckpoint, "say \"hi\"\\\n", 1'000, 3'500);
  record(Track::kCheckpoint, "later", 4'000, 4'001);
  pause();
  const std::string json = to_chrome_json();
  EXPECT_THAT(json, HasSubstr(R"("name":"say \"hi\"\\\u000a","ts":0.000,"dur":2.500})"));
  EXPECT_THAT(json, HasSubstr(R"("name":"later","ts":3.000,"dur":0.001})"));
}

TEST(Trace, SpansFromManyThreadsAreAllKept) {
  start(100000);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([] {
      for (int i = 0; i < 1000; ++i) Span s(Track::kGradWorker, "x");
    });
  for (auto& th : threads) th.join();
  pause();
  EXPECT_EQ(spans_kept(), 4000u);
  EXPECT_EQ(spans_dropped(), 0u);
}

}  // namespace
}  // namespace zo::trace
