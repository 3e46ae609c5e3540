// Power laws from measurements: the log-log slope of a curve, and where two curves cross.
#pragma once

#include <cstddef>
#include <span>
#include <string>

namespace linrope::experiments {

// Least squares on log t = slope * log n + intercept over the points with n >= min_n (and n, t > 0
// and finite). slope/intercept/r2 are NaN when fewer than two such points with distinct n exist.
struct LogLogFit {
  double slope, intercept, r2;
  std::size_t points = 0;
};
LogLogFit fit_loglog(std::span<const double> n, std::span<const double> t, double min_n = 0);

// Where curve `fast` (e.g. linear attention) overtakes curve `slow` (softmax), both measured at the
// same lengths `n` (ascending). Ratio r(n) = log(t_fast / t_slow):
//   Interpolated: r >= 0 up to some n_i and r < 0 from n_{i+1} on; `n` is the log-log linear
//                 interpolation of the root between them.
//   FasterThroughout: r < 0 at every n; `n` is the smallest n.
//   NotReached:   r >= 0 at the largest n; `n` is the crossing of the two fitted power laws
//                 (fits over n >= fit_min_n) when the slow curve grows faster, else NaN.
struct Crossover {
  enum class Kind { Interpolated, FasterThroughout, NotReached } kind;
  double n;
};
Crossover crossover(std::span<const double> n, std::span<const double> t_fast,
                    std::span<const double> t_slow, double fit_min_n = 0);
std::string describe(
    const Crossover& c);  // e.g. "n ~ 1400", "below 256", "not reached (~ 3e5 by extrapolation)"

}  // namespace linrope::experiments
