#include "fit.hpp"

#include <cmath>
#include <cstdio>
#include <limits>
#include <set>
#include <stdexcept>
#include <vector>

namespace linrope::experiments {

LogLogFit fit_loglog(std::span<const double> n, std::span<const double> t, double min_n) {
  if (n.size() != t.size())
    throw std::invalid_argument("fit_loglog: n has " + std::to_string(n.size()) +
                                " values but t has " + std::to_string(t.size()));
  std::vector<double> x, y;
  std::set<double> distinct;
  for (std::size_t i = 0; i < n.size(); ++i) {
    if (!(n[i] >= min_n) || !(n[i] > 0) || !(t[i] > 0) || !std::isfinite(n[i]) ||
        !std::isfinite(t[i]))
      continue;
    x.push_back(std::log(n[i]));
    y.push_back(std::log(t[i]));
    distinct.insert(n[i]);
  }
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  LogLogFit fit{kNaN, kNaN, kNaN, x.size()};
  if (distinct.size() < 2) return fit;
  const double count = double(x.size());
  double mx = 0, my = 0;
  for (std::size_t i = 0; i < x.size(); ++i) mx += x[i], my += y[i];
  mx /= count;
  my /= count;
  double sxx = 0, sxy = 0, syy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sxx += (x[i] - mx) * (x[i] - mx);
    sxy += (x[i] - mx) * (y[i] - my);
    syy += (y[i] - my) * (y[i] - my);
  }
  fit.slope = sxy / sxx;
  fit.intercept = my - fit.slope * mx;
  fit.r2 = syy > 0 ? sxy * sxy / (sxx * syy) : 1.0;
  return fit;
}

Crossover crossover(std::span<const double> n, std::span<const double> t_fast,
                    std::span<const double> t_slow, double fit_min_n) {
  if (n.size() != t_fast.size() || n.size() != t_slow.size() || n.empty())
    throw std::invalid_argument("crossover: n, t_fast and t_slow must have the same, nonzero size");
  std::vector<double> ratio(n.size());
  for (std::size_t i = 0; i < n.size(); ++i) ratio[i] = std::log(t_fast[i] / t_slow[i]);
  // The last length at which the fast curve is not yet faster.
  std::ptrdiff_t last_slower = -1;
  for (std::size_t i = 0; i < n.size(); ++i)
    if (ratio[i] >= 0) last_slower = std::ptrdiff_t(i);
  if (last_slower < 0) return {Crossover::Kind::FasterThroughout, n.front()};
  if (std::size_t(last_slower) + 1 < n.size()) {
    const std::size_t i = std::size_t(last_slower);
    const double a = std::log(n[i]), b = std::log(n[i + 1]);
    const double fraction = ratio[i] / (ratio[i] - ratio[i + 1]);
    return {Crossover::Kind::Interpolated, std::exp(a + fraction * (b - a))};
  }
  const LogLogFit fast = fit_loglog(n, t_fast, fit_min_n), slow = fit_loglog(n, t_slow, fit_min_n);
  double estimate = std::numeric_limits<double>::quiet_NaN();
  if (slow.slope > fast.slope)
    estimate = std::exp((fast.intercept - slow.intercept) / (slow.slope - fast.slope));
  return {Crossover::Kind::NotReached, estimate};
}

std::string describe(const Crossover& c) {
  char buffer[96];
  switch (c.kind) {
    case Crossover::Kind::Interpolated:
      std::snprintf(buffer, sizeof buffer, "n ~ %.0f", c.n);
      break;
    case Crossover::Kind::FasterThroughout:
      std::snprintf(buffer, sizeof buffer, "below %.0f (faster at every length)", c.n);
      break;
    case Crossover::Kind::NotReached:
      if (std::isfinite(c.n))
        std::snprintf(buffer, sizeof buffer, "not reached (~ %.3g by extrapolating the fits)", c.n);
      else
        std::snprintf(buffer, sizeof buffer, "not reached");
      break;
  }
  return buffer;
}

}  // namespace linrope::experiments
