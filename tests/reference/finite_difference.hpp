// Central finite differences, the yardstick of every gradient test: the gradient of a scalar loss
// of one matrix, entry by entry,
//   dL/dx_ab ~ (L(x + h e_ab) - L(x - h e_ab)) / (2h),
// evaluated in double on a naive reference forward (never on the code under test).
//
// Error of one entry: truncation h^2/6 |L'''| plus rounding ~ 2 u |L| / (2h) (u = 2^-53, |L| the
// size of the loss's terms). For the smooth losses of the tests (inputs of norm ~1, |L'''| of
// order the loss), h = 1e-5 gives about 1e-11 + 1e-11: tests allow a few 1e-8 relative to the
// gradient's largest entry, three orders above that, far below any real mistake (a missing term
// is of the order of the gradient itself).
#pragma once

#include <linrope/types.hpp>

namespace linrope::reference {

inline constexpr double kFiniteDifferenceStep = 1e-5;

// The gradient of loss(x) with respect to x, one central difference per entry.
template <class Loss>
MatrixD central_difference(const MatrixD& x, Loss loss, double h = kFiniteDifferenceStep) {
  MatrixD gradient(x.rows(), x.cols());
  MatrixD shifted = x;
  for (Index a = 0; a < x.rows(); ++a)
    for (Index b = 0; b < x.cols(); ++b) {
      const double original = shifted(a, b);
      shifted(a, b) = original + h;
      const double up = loss(shifted);
      shifted(a, b) = original - h;
      const double down = loss(shifted);
      shifted(a, b) = original;
      gradient(a, b) = (up - down) / (2 * h);
    }
  return gradient;
}

// sum(d_out .* out): the loss whose gradient the backward passes compute.
inline double weighted_sum(const MatrixD& d_out, const MatrixD& out) {
  return (d_out.array() * out.array()).sum();
}

}  // namespace linrope::reference
