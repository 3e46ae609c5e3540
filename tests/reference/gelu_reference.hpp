// Naive GELU in double, element by element: x Phi(x) with Phi(x) = (1 + erf(x / sqrt 2)) / 2 from
// std::erf (the kernels use A&S 7.1.26 in float and std::erfc in double: another formula), and
// its analytic derivative Phi(x) + x phi(x). The reference for linrope::gelu and gelu_backward; it
// calls no linrope kernel.
#pragma once

#include <cmath>
#include <linrope/types.hpp>
#include <numbers>

namespace linrope::reference {

inline double normal_cdf(double x) { return 0.5 * (1 + std::erf(x / std::numbers::sqrt2)); }

inline double gelu(double x) { return x * normal_cdf(x); }

// d gelu / dx = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
inline double gelu_derivative(double x) {
  const double density = std::exp(-0.5 * x * x) / std::sqrt(2 * std::numbers::pi);
  return normal_cdf(x) + x * density;
}

inline Vector<double> gelu(const Vector<double>& x) {
  Vector<double> y(x.size());
  for (Index i = 0; i < x.size(); ++i) y(i) = gelu(x(i));
  return y;
}

}  // namespace linrope::reference
