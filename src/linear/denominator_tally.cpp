// DenominatorTally: DenominatorStats accumulated from stabilised denominators.
#include <algorithm>
#include <cmath>
#include <limits>

#include "linear/linear_kernel.hpp"

namespace linrope::detail {

DenominatorTally::DenominatorTally(double threshold)
    : threshold_(threshold),
      log_threshold_(threshold > 0 ? std::log(threshold)
                                   : -std::numeric_limits<double>::infinity()) {}

void DenominatorTally::add(double den, double log_scale, bool zero_divisor) {
  ++count_;
  if (zero_divisor) ++zero_divisor_;
  min_ = std::min(min_, den == 0 ? 0.0 : den * std::exp(log_scale));
  if (den <= 0) ++nonpositive_;
  if (den == 0 ? threshold_ > 0 : std::log(std::abs(den)) + log_scale < log_threshold_) ++below_;
}

void DenominatorTally::merge_into(DenominatorStats& stats) const {
  const Index attended = count_ - no_keys_;
  if (attended > 0) stats.min = stats.count == stats.no_keys ? min_ : std::min(stats.min, min_);
  stats.nonpositive += nonpositive_;
  stats.below_threshold += below_;
  stats.count += count_;
  stats.no_keys += no_keys_;
  stats.zero_divisor += zero_divisor_;
}

void DenominatorTally::store(DenominatorStats& stats) const {
  stats = DenominatorStats{.threshold = threshold_};
  merge_into(stats);
}

void DenominatorTally::merge(const DenominatorTally& other) {
  min_ = std::min(min_, other.min_);
  nonpositive_ += other.nonpositive_;
  below_ += other.below_;
  count_ += other.count_;
  no_keys_ += other.no_keys_;
  zero_divisor_ += other.zero_divisor_;
}

}  // namespace linrope::detail
