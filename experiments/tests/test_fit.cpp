// The log-log slope and the crossover, on synthetic timings whose answers are known exactly.
#include <doctest/doctest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "fit.hpp"

using namespace linrope::experiments;

namespace {
std::vector<double> powers_of_two(int from, int to) {
  std::vector<double> n;
  for (int e = from; e <= to; ++e) n.push_back(std::ldexp(1.0, e));
  return n;
}
}  // namespace

TEST_CASE("fit_loglog recovers the exponent of t = c n^p") {
  const std::vector<double> n = powers_of_two(8, 20);
  for (const double p : {1.0, 2.0, 1.5}) {
    for (const double c : {1e-6, 3.0}) {
      CAPTURE(p);
      CAPTURE(c);
      std::vector<double> t;
      for (const double x : n) t.push_back(c * std::pow(x, p));
      const LogLogFit fit = fit_loglog(n, t, 2048);
      // Exact power law: only rounding of log/pow, ~1e-15 relative per value, over a log-range
      // of ln(2^20 / 2^11) = 6.2: 1e-12 is a wide margin.
      CHECK(fit.slope == doctest::Approx(p).epsilon(1e-12));
      CHECK(std::exp(fit.intercept) == doctest::Approx(c).epsilon(1e-9));
      CHECK(fit.r2 == doctest::Approx(1.0).epsilon(1e-12));
      CHECK(fit.points == 10);  // 2^11 .. 2^20
    }
  }
}

TEST_CASE("fit_loglog ignores the points below min_n, and non-positive or non-finite values") {
  const std::vector<double> n = powers_of_two(8, 16);
  std::vector<double> t;
  // Constant overhead dominates the short lengths; quadratic from 2048 on.
  for (const double x : n) t.push_back(x < 2048 ? 5.0 : 1e-6 * x * x);
  t[0] = -1;  // never log of a non-positive time
  CHECK(fit_loglog(n, t, 2048).slope == doctest::Approx(2.0).epsilon(1e-12));
  CHECK(fit_loglog(n, t, 0).slope < 1.9);  // the overhead bends the unfiltered fit
  t.back() = NAN;
  CHECK(fit_loglog(n, t, 2048).points == 5);  // 2^11 .. 2^15
}

TEST_CASE("fit_loglog with multiplicative noise stays close to the true slope") {
  const std::vector<double> n = powers_of_two(11, 20);
  std::vector<double> t;
  for (std::size_t i = 0; i < n.size(); ++i)
    t.push_back(2e-5 * n[i] * (i % 2 ? 1.01 : 0.99));  // +-1% alternating
  // Slope error <= 2 * 0.01 / (spread of log n ~ 2.9 std over 10 points) ~ 0.007; bound 0.01.
  CHECK(std::abs(fit_loglog(n, t, 0).slope - 1.0) < 0.01);
}

TEST_CASE("fit_loglog returns NaN with fewer than two distinct lengths") {
  const std::vector<double> n = {4096, 4096}, t = {1, 2};
  CHECK(std::isnan(fit_loglog(n, t).slope));
  CHECK(std::isnan(fit_loglog(std::vector<double>{}, std::vector<double>{}).slope));
  CHECK_THROWS_AS(fit_loglog(n, std::vector<double>{1}), std::invalid_argument);
}

TEST_CASE("crossover of a linear and a quadratic power law") {
  // t_fast = 1e-3 n, t_slow = 1e-6 n^2 cross at n = 1000; log(t_fast/t_slow) is linear in log n,
  // so the log-log interpolation is exact.
  const std::vector<double> n = powers_of_two(6, 14);
  std::vector<double> fast, slow;
  for (const double x : n) {
    fast.push_back(1e-3 * x);
    slow.push_back(1e-6 * x * x);
  }
  const Crossover c = crossover(n, fast, slow);
  CHECK(c.kind == Crossover::Kind::Interpolated);
  CHECK(c.n == doctest::Approx(1000).epsilon(1e-9));
  CHECK(describe(c) == "n ~ 1000");

  SUBCASE("faster throughout") {
    const std::vector<double> m(n.begin() + 5, n.end());  // from 2048
    const Crossover x = crossover(m, std::vector<double>(fast.begin() + 5, fast.end()),
                                  std::vector<double>(slow.begin() + 5, slow.end()));
    CHECK(x.kind == Crossover::Kind::FasterThroughout);
    CHECK(x.n == 2048);
  }
  SUBCASE("not reached: extrapolated from the fits") {
    const std::vector<double> m(n.begin(), n.begin() + 4);  // up to 512
    const Crossover x = crossover(m, std::vector<double>(fast.begin(), fast.begin() + 4),
                                  std::vector<double>(slow.begin(), slow.begin() + 4));
    CHECK(x.kind == Crossover::Kind::NotReached);
    CHECK(x.n == doctest::Approx(1000).epsilon(1e-9));
  }
}
