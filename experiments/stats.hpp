// Summary statistics over repetitions and seeds.
#pragma once

#include <span>

namespace linrope::experiments {

double mean(std::span<const double> x);     // NaN when empty
double std_dev(std::span<const double> x);  // sample standard deviation (n - 1); 0 for one value
double median(std::span<const double> x);   // NaN when empty
double minimum(std::span<const double> x);  // NaN when empty
double maximum(std::span<const double> x);  // NaN when empty

}  // namespace linrope::experiments
