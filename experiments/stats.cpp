#include "stats.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace linrope::experiments {

namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
}

double mean(std::span<const double> x) {
  if (x.empty()) return kNaN;
  return std::accumulate(x.begin(), x.end(), 0.0) / double(x.size());
}

double std_dev(std::span<const double> x) {
  if (x.empty()) return kNaN;
  if (x.size() == 1) return 0;
  const double m = mean(x);
  double sum = 0;
  for (const double v : x) sum += (v - m) * (v - m);
  return std::sqrt(sum / double(x.size() - 1));
}

double median(std::span<const double> x) {
  if (x.empty()) return kNaN;
  std::vector<double> sorted(x.begin(), x.end());
  std::sort(sorted.begin(), sorted.end());
  const std::size_t mid = sorted.size() / 2;
  return sorted.size() % 2 ? sorted[mid] : 0.5 * (sorted[mid - 1] + sorted[mid]);
}

double minimum(std::span<const double> x) {
  return x.empty() ? kNaN : *std::min_element(x.begin(), x.end());
}

double maximum(std::span<const double> x) {
  return x.empty() ? kNaN : *std::max_element(x.begin(), x.end());
}

}  // namespace linrope::experiments
