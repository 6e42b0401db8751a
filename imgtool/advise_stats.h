// Statistics of `imgtool advise`: the median of repetitions and the
// two-sided Mann-Whitney U test that decides whether the winner of a
// workload beats its runner-up or the two tie. The same test as
// benchmarks/results.py mann_whitney_u (scipy.stats.mannwhitneyu's defaults
// in scipy 1.7-1.13: method 'auto', continuity correction), so advise's
// verdict and `report`'s agree on the same repetitions.
#ifndef IMGTOOL_IMGTOOL_ADVISE_STATS_H_
#define IMGTOOL_IMGTOOL_ADVISE_STATS_H_

#include <vector>

namespace imgtool::cli {

// The median of `values` (the mean of the middle two for an even count);
// 0 for none.
double Median(std::vector<double> values);

// Two-sided p value of the Mann-Whitney U test of samples x and y: exact
// (the null distribution of U counted) when no value occurs twice and one
// sample has at most 8 values, else the normal approximation with the
// tie-corrected variance and a continuity correction of 1/2. 1 when a
// sample is empty or every value is equal.
double MannWhitneyP(const std::vector<double>& x, const std::vector<double>& y);

// How advise calls the difference between the best configuration (`best`,
// its repetitions) and the runner-up: with at least 4 repetitions on each
// side (3 against 3 cannot reach p < 0.05 whatever the values), decided if
// MannWhitneyP < 0.05; with fewer, decided only if the ranges do not
// overlap (every repetition of `best` above every one of `other`: the
// weaker rule, exact p = 0.1 for 3 against 3). Higher is better.
struct Verdict {
  bool decided = false;
  bool utest = false;  // decided by the U test (else by the range rule)
  double p = 1;        // the U test's p, also when the range rule decided
};
Verdict Decide(const std::vector<double>& best,
               const std::vector<double>& other);

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_ADVISE_STATS_H_
