#include "engine/monitor/monitor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "io/env.h"
#include "io/fault_injector.h"

namespace zo::monitor {
namespace {

using ::testing::HasSubstr;

std::string read_all(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

class MonitorDir : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/zo-monitor-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST(MonitorTags, AreDeepSpeedsForEveryNumberOfTheRecord) {
  const std::vector<Scalar> s = scalars_of_metrics_record(nlohmann::json::parse(
      R"({"step":3,"loss":2.5,"lr":1e-4,"grad_norm":null,"skipped":true,"time_s":{"compute":1.5},"memory":{"cpu":{"peak_bytes":7}}})"));
  std::map<std::string, double> got;
  for (const Scalar& x : s) got[x.tag] = x.value;
  const std::map<std::string, double> want = {{"Train/Samples/train_loss", 2.5},
                                              {"Train/Samples/lr", 1e-4},
                                              {"Train/Samples/skipped", 1.0},
                                              {"Train/Samples/time_s/compute", 1.5},
                                              {"Train/Samples/memory/cpu/peak_bytes", 7.0}};
  EXPECT_EQ(got, want);  // no step (the x axis), no null grad_norm
}

TEST_F(MonitorDir, CsvFilesHoldOneHeaderAndAppendWhenResumed) {
  {
    auto m = CsvMonitor::open(io::Env::posix(), dir_ + "/job", /*append=*/false);
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    ASSERT_TRUE((*m)->write(8, {{"Train/Samples/train_loss", 2.5}, {"Train/Samples/lr", 0.1}}).is_ok());
  }
  {
    auto m = CsvMonitor::open(io::Env::posix(), dir_ + "/job", /*append=*/true);
    ASSERT_TRUE(m.is_ok());
    ASSERT_TRUE((*m)->write(16, {{"Train/Samples/train_loss", 1.0 / 3}}).is_ok());
  }
  // The shortest text that reads back to the same double.
  EXPECT_EQ(read_all(dir_ + "/job/Train_Samples_train_loss.csv"), "step,train_loss\n8,2.5\n16,0.3333333333333333\n");
  EXPECT_EQ(read_all(dir_ + "/job/Train_Samples_lr.csv"), "step,lr\n8,0.1\n");
  {
    auto m = CsvMonitor::open(io::Env::posix(), dir_ + "/job", /*append=*/false);  // a new run starts afresh
    ASSERT_TRUE(m.is_ok());
    ASSERT_TRUE((*m)->write(8, {{"Train/Samples/train_loss", 4}}).is_ok());
  }
  EXPECT_EQ(read_all(dir_ + "/job/Train_Samples_train_loss.csv"), "step,train_loss\n8,4\n");
}

// Issue 40: a new run's csv_monitor once removed whatever stood at a tag's file name, a directory
// of the user's included. A directory there is refused before the first step and kept.
TEST_F(MonitorDir, ADirectoryWhereACsvFileGoesIsRefusedAndKept) {
  std::filesystem::create_directories(dir_ + "/job/Train_Samples_lr.csv/mine");
  std::ofstream(dir_ + "/job/Train_Samples_lr.csv/mine/notes.txt") << "keep\n";
  auto m = CsvMonitor::open(io::Env::posix(), dir_ + "/job", /*append=*/false);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  const std::vector<Scalar> record = {{"Train/Samples/train_loss", 2.5}, {"Train/Samples/lr", 0.1}};
  const Status checked = CsvMonitor::check_files(io::Env::posix(), dir_ + "/job", record);
  EXPECT_EQ(checked.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(checked.message(),
            "csv_monitor file " + dir_ + "/job/Train_Samples_lr.csv is a directory: give the path of a file");
  EXPECT_FALSE((*m)->write(8, record).is_ok());
  EXPECT_EQ(read_all(dir_ + "/job/Train_Samples_lr.csv/mine/notes.txt"), "keep\n");
  ASSERT_TRUE(CsvMonitor::check_files(io::Env::posix(), dir_ + "/job", {{"Train/Samples/train_loss", 2.5}}).is_ok());
}

TEST_F(MonitorDir, AFailedWriteNamesTheFile) {
  auto faults = std::make_shared<io::FaultInjector>();
  io::FaultyEnv env(io::Env::posix(), faults);
  auto m = CsvMonitor::open(&env, dir_, false);
  ASSERT_TRUE(m.is_ok());
  faults->add({.kind = io::FaultKind::kNoSpace, .op = io::IoOp::kWrite, .path_contains = "train_loss", .times = -1});
  const Status st = (*m)->write(8, {{"Train/Samples/lr", 0.1}, {"Train/Samples/train_loss", 2.5}});
  ASSERT_FALSE(st.is_ok());
  EXPECT_THAT(st.to_string(), HasSubstr(dir_ + "/Train_Samples_train_loss.csv"));
}

TEST(TfRecord, FramesWithLengthAndMaskedCrc32c) {
  const std::string framed = tfrecord_frame("abc");
  ASSERT_EQ(framed.size(), 8u + 4 + 3 + 4);
  EXPECT_EQ(framed.substr(0, 8), std::string("\x03\0\0\0\0\0\0\0", 8));
  EXPECT_EQ(framed.substr(12, 3), "abc");
  // TensorBoard reads the records back in tests/tools/monitors_cli_test.py; here only the framing
  // around an empty record, whose CRCs are fixed: masked crc32c("") = 0xa282ead8.
  const std::string empty = tfrecord_frame("");
  EXPECT_EQ(empty.substr(12, 4), std::string("\xd8\xea\x82\xa2", 4));
}

}  // namespace
}  // namespace zo::monitor
