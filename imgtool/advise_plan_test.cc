#include "imgtool/advise_plan.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace imgtool::cli {
namespace {

// Five cut levels as advise has them (level 0 the most cells, each level a
// subset of the one before), with one-letter cell labels.
PlanInput Input(double seconds, std::map<std::string, CellCost> costs) {
  PlanInput in;
  in.seconds = seconds;
  in.levels = {{"a", "b", "c", "d", "e", "f"},
               {"a", "b", "c", "d"},
               {"a", "b", "c"},
               {"a", "b"},
               {"a"}};
  in.costs = std::move(costs);
  in.calibration_count = 1024;
  in.calibration_seconds = 0.6;
  return in;
}

void ExpectPlan(const Plan& p, int reps, int level, uint64_t count,
                bool short_runs, bool reuse, double estimated, bool fits) {
  EXPECT_EQ(p.reps, reps);
  EXPECT_EQ(p.level, level);
  EXPECT_EQ(p.count, count);
  EXPECT_EQ(p.short_runs, short_runs);
  EXPECT_EQ(p.reuse_calibration, reuse);
  EXPECT_NEAR(p.estimated_seconds, estimated, 1e-9);
  EXPECT_EQ(p.fits, fits);
}

// 100 s, two cells calibrated at 1,000 requests/s and 0.1 s overhead, four
// not (0.5 s of calibration each): 5 rounds of all six cells,
// ((95 - 2) / 5 - 0.6) / 0.006 = 3,000 requests, 2,944 in steps of 64.
TEST(AdvisePlanTest, AGenerousBudgetGetsTheFullMatrix) {
  PlanInput in = Input(100, {{"a", {1000, 0.1}}, {"b", {1000, 0.1}}});
  in.calibration_seconds = 0.5;
  ExpectPlan(PlanWorkload(in), 5, 0, 2944, false, false,
             2 + 5 * (0.6 + 2944 * 0.006), true);
}

// 12 s: 5 and 4 rounds of level 0 leave runs under 0.1 s of the fastest
// cell (2,000/s), 4 rounds of level 1 (a, b and two uncalibrated cells at
// the mean 1/rate 0.00075 s and overhead 0.25 s) give 516 requests: 512.
TEST(AdvisePlanTest, AMiddleBudgetCutsClusterSizesFirst) {
  PlanInput in = Input(12, {{"a", {2000, 0.2}}, {"b", {1000, 0.3}}});
  ExpectPlan(PlanWorkload(in), 4, 1, 512, false, false,
             1.2 + 4 * (1.0 + 512 * 0.003), true);
}

// A cell the filesystem refused is neither run nor calibrated: level 0
// then has five cells and fits 4 rounds of 256 requests.
TEST(AdvisePlanTest, FailedCellsAreNotCounted) {
  PlanInput in = Input(12, {{"a", {2000, 0.2}}, {"b", {1000, 0.3}}});
  in.failed = {"c"};
  ExpectPlan(PlanWorkload(in), 4, 0, 256, false, false,
             1.8 + 4 * (1.25 + 256 * 0.00375), true);
}

// Fast cells with large overheads (image create and delete on a slow
// disk): 3 rounds of level 3, then of level 4 (one cell).
TEST(AdvisePlanTest, OverheadsCutTheSmallestMatrixFurther) {
  PlanInput in = Input(5, {{"a", {50000, 0.5}}, {"b", {40000, 0.5}}});
  in.calibration_seconds = 0.7;
  ExpectPlan(PlanWorkload(in), 3, 3, 12928, false, false,
             3 * (1.0 + 12928 * (1.0 / 50000 + 1.0 / 40000)), true);
  in.seconds = 3;
  ExpectPlan(PlanWorkload(in), 3, 4, 22464, false, false,
             3 * (0.5 + 22464.0 / 50000), true);
}

// Below 0.1 s of the fastest cell at the last level: as many requests as
// fit (3,500: 3,456) while that is more than the calibration count...
TEST(AdvisePlanTest, ShortRunsWhenEvenTheLastLevelIsTooLong) {
  PlanInput in = Input(1.8, {{"a", {50000, 0.5}}, {"b", {40000, 0.5}}});
  ExpectPlan(PlanWorkload(in), 3, 4, 3456, true, false,
             3 * (0.5 + 3456.0 / 50000), true);
}

// ... else the calibration count, the calibration run being the first
// repetition (2 rounds left), and the plan says it will not fit.
TEST(AdvisePlanTest, CalibrationRunsCountWhenNothingFits) {
  PlanInput in = Input(1, {{"a", {50000, 0.5}}, {"b", {40000, 0.5}}});
  ExpectPlan(PlanWorkload(in), 3, 4, 1024, true, true,
             2 * (0.5 + 1024.0 / 50000), false);
}

// After the cells of the chosen level were calibrated: only the count for
// the fixed repetitions and level, from the measured costs.
TEST(AdvisePlanTest, FixedRepsAndLevelGiveTheCount) {
  PlanInput in = Input(10, {{"a", {2000, 0.2}},
                            {"b", {1000, 0.3}},
                            {"c", {1500, 0.25}}});
  in.fixed_reps = 4;
  in.fixed_level = 2;
  const double inverse = 1.0 / 2000 + 1.0 / 1000 + 1.0 / 1500;
  ExpectPlan(PlanWorkload(in), 4, 2, 704, false, false,
             4 * (0.75 + 704 * inverse), true);
}

TEST(AdvisePlanTest, CreateTableRoundsFitTheTimeLeft) {
  EXPECT_EQ(PlanCreateRounds(10, 3.5, 4), 2);   // 2.86 rounds fit
  EXPECT_EQ(PlanCreateRounds(60, 3.5, 4), 4);   // 17, at most 4
  EXPECT_EQ(PlanCreateRounds(3, 3.5, 4), 0);    // not one
  EXPECT_EQ(PlanCreateRounds(-2, 0.5, 4), 0);   // the budget is spent
  EXPECT_EQ(PlanCreateRounds(1, 0, 4), 4);      // a round took no time
}

}  // namespace
}  // namespace imgtool::cli
