#include "imgtool/advise_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace imgtool::cli {
namespace {

// The sums over one level's cells that a plan needs.
struct Estimate {
  double inverse = 0;      // seconds per request, summed over the cells
  double overhead = 0;     // seconds per round outside the bench loops
  double calibrating = 0;  // calibration runs still to do
  double fastest = 0;      // the highest rate (requests per second)
};

Estimate EstimateLevel(const PlanInput& in, int level) {
  double mean_inverse = 0, mean_overhead = 0;
  for (const auto& [label, c] : in.costs) {
    mean_inverse += 1 / c.rate / in.costs.size();
    mean_overhead += c.overhead / in.costs.size();
  }
  Estimate e;
  for (const std::string& label : in.levels[level]) {
    if (auto it = in.costs.find(label); it != in.costs.end()) {
      e.inverse += 1 / it->second.rate;
      e.overhead += it->second.overhead;
      e.fastest = std::max(e.fastest, it->second.rate);
    } else if (in.failed.count(label) == 0) {
      e.inverse += mean_inverse;
      e.overhead += mean_overhead;
      e.calibrating += in.calibration_seconds;
    }
  }
  e.fastest = std::max(e.fastest, 1 / mean_inverse);
  return e;
}

// Requests per run that fill the time left with `reps` rounds.
double FittingCount(const PlanInput& in, const Estimate& e, int reps) {
  const double budget = in.seconds * kAdvisePlanFill - e.calibrating;
  return (budget / reps - e.overhead) / e.inverse;
}

uint64_t Floor64(double n) {
  return n >= 64 ? static_cast<uint64_t>(n) / 64 * 64 : 0;
}

}  // namespace

Plan PlanWorkload(const PlanInput& in) {
  const int last = static_cast<int>(in.levels.size()) - 1;
  std::vector<std::pair<int, int>> candidates;  // reps, level
  if (in.fixed_level >= 0) {
    candidates.push_back({in.fixed_reps, std::min(in.fixed_level, last)});
  } else {
    candidates = {{5, 0}, {4, 0}};
    for (int level = 1; level <= std::min(2, last); ++level) {
      candidates.push_back({4, level});
    }
    for (int level = std::min(2, last); level <= last; ++level) {
      candidates.push_back({kAdviseMinReps, level});
    }
  }
  Plan plan;
  Estimate e;
  double n = 0;
  for (const auto& [reps, level] : candidates) {
    e = EstimateLevel(in, level);
    n = FittingCount(in, e, reps);
    plan.reps = reps;
    plan.level = level;
    if (n / e.fastest >= kAdviseMinRunSeconds) break;
  }
  if (n / e.fastest >= kAdviseMinRunSeconds) {
    plan.count = Floor64(n);
  } else if (Floor64(n) > in.calibration_count) {
    plan.count = Floor64(n);
    plan.short_runs = true;
  } else {
    plan.count = in.calibration_count;
    plan.short_runs = true;
    plan.reuse_calibration = true;
  }
  // Cells not calibrated yet run their calibration too (e.calibrating);
  // with reuse_calibration every cell's calibration run is its first
  // repetition.
  const int rounds = plan.reps - (plan.reuse_calibration ? 1 : 0);
  plan.estimated_seconds =
      e.calibrating +
      rounds * (e.overhead + static_cast<double>(plan.count) * e.inverse);
  plan.fits = plan.estimated_seconds <= in.seconds;
  return plan;
}

int PlanCreateRounds(double seconds, double round_seconds, int max_reps) {
  if (seconds <= 0) return 0;
  if (round_seconds <= 0) return max_reps;
  return static_cast<int>(
      std::min<double>(max_reps, std::floor(seconds / round_seconds)));
}

}  // namespace imgtool::cli
