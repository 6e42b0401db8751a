// The time plan of `imgtool advise` (issue 20 part 4): how many repetitions,
// which cells and how many requests per run a workload gets, and how many
// rounds the create table gets, from the time left and what calibration
// measured. Pure functions (no clock, no I/O): advise.cc measures, these
// decide, advise_plan_test checks the decisions for given inputs.
//
// Units: seconds are wall-clock seconds, rates requests per second, counts
// requests, sizes bytes. Thread-safety: none needed (no state).
#ifndef IMGTOOL_IMGTOOL_ADVISE_PLAN_H_
#define IMGTOOL_IMGTOOL_ADVISE_PLAN_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace imgtool::cli {

// The fewest repetitions a verdict needs (advise_stats.h Decide: 3 against 3
// with ranges apart).
inline constexpr int kAdviseMinReps = 3;
// The shortest run of the fastest cell a plan aims at: shorter runs measure
// mostly noise (timer steps, the first requests' setup).
inline constexpr double kAdviseMinRunSeconds = 0.1;
// The share of the time left that a plan fills (the rest absorbs the
// error of the estimate).
inline constexpr double kAdvisePlanFill = 0.95;

// What one calibration run of a cell measured.
struct CellCost {
  double rate = 0;      // requests per second of the bench loop
  double overhead = 0;  // seconds per run outside the bench loop: create,
                        // FIEMAP, waiting for the previous image's deletion
};

struct PlanInput {
  double seconds = 0;  // time left for the workload, calibration of the
                       // cells still to calibrate included
  // levels[i]: the cell labels of cut level i, level 0 the full matrix,
  // each level a subset of the one before; at least one level.
  std::vector<std::vector<std::string>> levels;
  std::map<std::string, CellCost> costs;  // the calibrated cells
  std::set<std::string> failed;  // tried and refused: never counted
  uint64_t calibration_count = 0;   // requests of a calibration run
  double calibration_seconds = 0;   // mean wall time of a calibration run
  // With fixed_level >= 0: no choice, only the count for these repetitions
  // and this level (after its cells were calibrated).
  int fixed_reps = 0;
  int fixed_level = -1;
};

struct Plan {
  int reps = kAdviseMinReps;
  int level = 0;
  uint64_t count = 0;  // requests per run, a multiple of 64 (or the
                       // calibration count)
  // The count is the calibration count, and a calibration run is the
  // cell's first repetition: reps - 1 rounds remain after calibration.
  bool reuse_calibration = false;
  // The runs are shorter than kAdviseMinRunSeconds of the fastest cell.
  bool short_runs = false;
  double estimated_seconds = 0;  // calibration still to do plus the rounds
  bool fits = true;              // estimated_seconds <= PlanInput::seconds
};

// The plan of one workload. The candidates, in order: 5 repetitions at
// level 0, 4 at levels 0, 1, 2, 3 at levels 2, 3, ... up to the last level;
// the first one whose runs (the time left times kAdvisePlanFill, less the
// calibration of its cells not calibrated yet, split into its rounds, less
// each cell's overhead, divided by the sum of the cells' 1/rate) give the
// fastest cell at least kAdviseMinRunSeconds is taken, with that count.
// Cells not calibrated yet count with the mean 1/rate, overhead and
// calibration time of the calibrated ones. When none does: 3 repetitions of
// the last level, and as many requests as fit if that is more than the
// calibration count (short_runs), else the calibration count with the
// calibration runs as the first repetition (short_runs, reuse_calibration).
// `fits` says whether even that is expected to end in time; the caller
// stops between runs at its deadline.
// Needs a non-empty `costs` (at least one cell calibrated).
Plan PlanWorkload(const PlanInput& in);

// The create table's rounds after its first (advise runs one round first,
// the others after the workloads with the time then left): as many as fit
// in `seconds` (0 or less: none) at `round_seconds` each (the first
// round's wall time), at most `max_reps`.
int PlanCreateRounds(double seconds, double round_seconds, int max_reps);

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_ADVISE_PLAN_H_
