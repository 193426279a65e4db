#include "common/string_util.h"

#include <gtest/gtest.h>

namespace zo {
namespace {

TEST(EditDistance, Classic) {
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("", "abc"), 3u);
  EXPECT_EQ(edit_distance("same", "same"), 0u);
}

TEST(ClosestMatch, SuggestsTyposOnly) {
  const std::vector<std::string> keys = {"stage", "offload_param", "offload_optimizer", "sub_group_size",
                                         "stage3_prefetch_bucket_size"};
  EXPECT_EQ(closest_match("stgae", keys), "stage");
  EXPECT_EQ(closest_match("offload_params", keys), "offload_param");
  EXPECT_EQ(closest_match("subgroup_size", keys), "sub_group_size");
  EXPECT_EQ(closest_match("Offload-Optimizer", keys), "offload_optimizer");
  EXPECT_EQ(closest_match("completely_unrelated", keys), "");
}

TEST(Split, KeepsEmptyFields) {
  EXPECT_EQ(split("128K,1M,8M", ','), (std::vector<std::string>{"128K", "1M", "8M"}));
  EXPECT_EQ(split("a,,b", ','), (std::vector<std::string>{"a", "", "b"}));
  std::vector<std::string> parts = {"x", "y"};
  EXPECT_EQ(join(parts, "."), "x.y");
}

TEST(QuoteExcerpt, EscapesAndBoundsUntrustedText) {
  EXPECT_EQ(quote_excerpt("step-3"), "step-3");
  EXPECT_EQ(quote_excerpt(std::string("a\0b\n\t\\\xff", 7)), "a\\x00b\\n\\t\\\\\\xff");
  EXPECT_EQ(quote_excerpt("abcdef", 3), "abc... (6 bytes)");
  EXPECT_EQ(quote_excerpt(std::string(1'000'000, 'x')).size(), 64 + std::string("... (1000000 bytes)").size());
}

}  // namespace
}  // namespace zo
