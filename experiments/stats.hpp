// Statistics over the repetitions of a timing.
#pragma once

#include <span>

namespace linrope::experiments {

double median(std::span<const double> x);   // NaN when empty
double minimum(std::span<const double> x);  // NaN when empty
double maximum(std::span<const double> x);  // NaN when empty

}  // namespace linrope::experiments
