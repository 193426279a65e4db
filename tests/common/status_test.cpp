#include "common/status.h"

#include <gtest/gtest.h>

#include <cerrno>

namespace zo {
namespace {

Result<int> half(int x) {
  if (x % 2) return invalid_argument("odd: " + std::to_string(x));
  return x / 2;
}

Status quarter(int x, int* out) {
  ZO_ASSIGN_OR_RETURN(int h, half(x));
  ZO_ASSIGN_OR_RETURN(*out, half(h));
  return Status::ok();
}

TEST(Status, CarriesCodeErrnoAndContext) {
  Status s = errno_status("pwrite /tmp/x offset 4096 length 512", ENOSPC);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_EQ(s.sys_errno(), ENOSPC);
  s.with_context("sub-group 3");
  EXPECT_EQ(s.to_string().rfind("NoSpace: sub-group 3: pwrite /tmp/x offset 4096 length 512: ", 0), 0u)
      << s.to_string();
  EXPECT_EQ(errno_status("read", EIO).code(), StatusCode::kIoError);
  EXPECT_TRUE(Status::ok().is_ok());
  EXPECT_EQ(Status::ok().to_string(), "OK");
}

TEST(Result, PropagatesThroughMacros) {
  int out = 0;
  EXPECT_TRUE(quarter(8, &out).is_ok());
  EXPECT_EQ(out, 2);
  Status s = quarter(6, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "odd: 3");
}

TEST(ResultDeathTest, ValueOnErrorAborts) {
  EXPECT_DEATH({ (void)half(3).value(); }, "Result::value\\(\\) on error: InvalidArgument: odd: 3");
}

TEST(CheckDeathTest, ReportsFileAndLine) {
  EXPECT_DEATH({ ZO_CHECK(1 + 1 == 3) << "arithmetic"; },
               "status_test.cpp:[0-9]+: check failed: 1 \\+ 1 == 3 arithmetic");
}

}  // namespace
}  // namespace zo
