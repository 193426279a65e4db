#include "common/string_util.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <limits>

namespace zo {
namespace {

// Worked out by hand: the shortest decimal that reads back as the same double, in whichever of
// fixed or scientific notation is shorter (fixed on a tie).
TEST(FormatNumber, IsTheShortestTextThatReadsBack) {
  EXPECT_EQ(format_number(0.1), "0.1");
  EXPECT_EQ(format_number(2.5), "2.5");
  EXPECT_EQ(format_number(4), "4");
  EXPECT_EQ(format_number(-0.5), "-0.5");
  EXPECT_EQ(format_number(1e-4), "1e-04");   // "0.0001" is one longer
  EXPECT_EQ(format_number(0.001), "0.001");  // a tie with "1e-03"
  EXPECT_EQ(format_number(1e5), "1e+05");
  EXPECT_EQ(format_number(1500000), "1500000");
  EXPECT_EQ(format_number(1.0 / 3.0), "0.3333333333333333");
  EXPECT_EQ(format_number(0.1 + 0.2), "0.30000000000000004");  // not 0.3: a different double
  EXPECT_EQ(format_number(std::numeric_limits<double>::infinity()), "inf");
  for (double v : {1.0 / 7.0, 6.02214076e23, 5e-324, std::numeric_limits<double>::max(), -123.456})
    EXPECT_EQ(std::strtod(format_number(v).c_str(), nullptr), v) << format_number(v);
}

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
