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
