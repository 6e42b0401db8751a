#include "imgtool/advise_stats.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <vector>

namespace imgtool::cli {
namespace {

// Ranks 1..n of `values`, ties given their average rank.
std::vector<double> Ranks(const std::vector<double>& values) {
  std::vector<size_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return values[a] < values[b]; });
  std::vector<double> ranks(values.size());
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j + 1 < order.size() && values[order[j + 1]] == values[order[i]]) {
      ++j;
    }
    for (size_t k = i; k <= j; ++k) ranks[order[k]] = (i + j) / 2.0 + 1.0;
    i = j + 1;
  }
  return ranks;
}

// counts[u]: how many orderings of n1 + n2 distinct values give the first
// sample U = u (the largest value is x's, adding n2 to U, or y's).
std::vector<double> ExactUCounts(int n1, int n2) {
  // f[j][u] for the current i.
  std::vector<std::vector<double>> prev(n2 + 1, std::vector<double>{1});
  for (int i = 1; i <= n1; ++i) {
    std::vector<std::vector<double>> cur(n2 + 1);
    cur[0] = {1};
    for (int j = 1; j <= n2; ++j) {
      std::vector<double> row(i * j + 1, 0);
      for (size_t u = 0; u < prev[j].size(); ++u) row[u + j] += prev[j][u];
      for (size_t u = 0; u < cur[j - 1].size(); ++u) row[u] += cur[j - 1][u];
      cur[j] = std::move(row);
    }
    prev = std::move(cur);
  }
  return prev[n2];
}

}  // namespace

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

double MannWhitneyP(const std::vector<double>& x,
                    const std::vector<double>& y) {
  const int n1 = static_cast<int>(x.size());
  const int n2 = static_cast<int>(y.size());
  if (n1 == 0 || n2 == 0) return 1;
  std::vector<double> all(x);
  all.insert(all.end(), y.begin(), y.end());
  const std::vector<double> ranks = Ranks(all);
  double rank_sum = 0;
  for (int i = 0; i < n1; ++i) rank_sum += ranks[i];
  const double u1 = rank_sum - n1 * (n1 + 1) / 2.0;
  const double big = std::max(u1, static_cast<double>(n1) * n2 - u1);
  const int n = n1 + n2;
  std::map<double, int> counts;
  for (double v : all) ++counts[v];
  const bool ties = counts.size() < all.size();
  double p;
  if (std::min(n1, n2) <= 8 && !ties) {
    const std::vector<double> dist = ExactUCounts(n1, n2);
    double tail = 0;
    double total = 0;
    for (size_t u = 0; u < dist.size(); ++u) {
      total += dist[u];
      if (static_cast<double>(u) >= std::ceil(big)) tail += dist[u];
    }
    p = 2.0 * tail / total;
  } else {
    double tie_term = 0;
    for (const auto& [v, c] : counts) {
      tie_term += static_cast<double>(c) * c * c - c;
    }
    tie_term /= static_cast<double>(n) * (n - 1);
    const double var = n1 * n2 / 12.0 * ((n + 1) - tie_term);
    if (var <= 0) return 1;
    const double z = (big - n1 * n2 / 2.0 - 0.5) / std::sqrt(var);
    p = std::erfc(z / std::sqrt(2.0));
  }
  return std::min(p, 1.0);
}

Verdict Decide(const std::vector<double>& best,
               const std::vector<double>& other) {
  Verdict v;
  v.p = MannWhitneyP(best, other);
  if (best.empty() || other.empty()) return v;
  if (best.size() >= 4 && other.size() >= 4) {
    v.utest = true;
    v.decided = v.p < 0.05 && Median(best) > Median(other);
    return v;
  }
  v.decided = *std::min_element(best.begin(), best.end()) >
              *std::max_element(other.begin(), other.end());
  return v;
}

}  // namespace imgtool::cli
