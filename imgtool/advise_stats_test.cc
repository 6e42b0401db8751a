#include "imgtool/advise_stats.h"

#include <vector>

#include "gtest/gtest.h"

namespace imgtool::cli {
namespace {

TEST(AdviseStatsTest, MedianOfOddAndEvenCounts) {
  EXPECT_EQ(Median({3, 1, 2}), 2);
  EXPECT_EQ(Median({4, 1, 3, 2}), 2.5);
  EXPECT_EQ(Median({}), 0);
}

// scipy.stats.mannwhitneyu's documented example (exact: p = 0.1111).
TEST(AdviseStatsTest, ExactPMatchesScipysExample) {
  EXPECT_NEAR(MannWhitneyP({19, 22, 16, 29, 24}, {20, 11, 17, 12}),
              0.11111, 1e-4);
}

// Five against five without overlap: 2 / C(10, 5) = 0.0079, as report's
// `p=0.0079 significant`.
TEST(AdviseStatsTest, SeparatedFiveAgainstFive) {
  EXPECT_NEAR(MannWhitneyP({10, 11, 12, 13, 14}, {1, 2, 3, 4, 5}),
              2.0 / 252, 1e-9);
}

// With ties: the normal approximation, as benchmarks/results.py
// mann_whitney_u([3, 3, 4, 5], [1, 2, 2, 3]) = (15.0, 0.05300786910196125).
TEST(AdviseStatsTest, TiesUseTheNormalApproximation) {
  EXPECT_NEAR(MannWhitneyP({3, 3, 4, 5}, {1, 2, 2, 3}), 0.0530078691, 1e-9);
}

TEST(AdviseStatsTest, EqualValuesNeverDiffer) {
  EXPECT_EQ(MannWhitneyP({1, 1, 1, 1}, {1, 1, 1, 1}), 1);
  EXPECT_FALSE(Decide({1, 1, 1, 1}, {1, 1, 1, 1}).decided);
}

TEST(AdviseStatsTest, FourRepsUseTheUTest) {
  Verdict v = Decide({10, 11, 12, 13}, {1, 2, 3, 4});
  EXPECT_TRUE(v.utest);
  EXPECT_TRUE(v.decided);  // 2 / 70 = 0.029
  v = Decide({10, 2, 12, 13}, {1, 11, 3, 4});
  EXPECT_FALSE(v.decided);
}

TEST(AdviseStatsTest, ThreeRepsUseTheRangeRule) {
  Verdict v = Decide({10, 11, 12}, {1, 2, 3});
  EXPECT_FALSE(v.utest);
  EXPECT_TRUE(v.decided);
  EXPECT_NEAR(v.p, 0.1, 1e-9);
  EXPECT_FALSE(Decide({10, 2, 12}, {1, 3, 4}).decided);
}

}  // namespace
}  // namespace imgtool::cli
