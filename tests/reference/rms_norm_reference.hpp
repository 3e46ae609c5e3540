// Naive RMSNorm in double, row by row with explicit loops: the forward from its definition, the
// backward from its closed form, and the magnitudes that bound each result's rounding error (the
// sums of absolute values the roundings are relative to). The reference for linrope::rms_norm and
// rms_norm_backward; it calls no linrope kernel.
#pragma once

#include <cmath>
#include <linrope/types.hpp>

namespace linrope::reference {

struct RmsNorm {
  MatrixD y;               // y_ij = x_ij r_i w_j
  Vector<double> inv_rms;  // r_i = 1 / sqrt(mean_j x_ij^2 + eps)
};

inline RmsNorm rms_norm(const MatrixD& x, const Vector<double>& w, double eps) {
  const Index n = x.rows(), d = x.cols();
  RmsNorm out{MatrixD(n, d), Vector<double>(n)};
  for (Index i = 0; i < n; ++i) {
    double squares = 0;
    for (Index j = 0; j < d; ++j) squares += x(i, j) * x(i, j);
    const double r = 1 / std::sqrt(squares / double(d) + eps);
    out.inv_rms(i) = r;
    for (Index j = 0; j < d; ++j) out.y(i, j) = x(i, j) * r * w(j);
  }
  return out;
}

// The gradients of sum(d_y .* y) for the given r (the forward's inv_rms, as the kernel is given
// it), g_ij = d_y_ij w_j:
//   d_x_ij = r_i g_ij - r_i^3 x_ij / d * sum_l g_il x_il,   d_weight_j = sum_i d_y_ij x_ij r_i,
// and the scales of their rounding errors:
//   d_x_scale_ij      = r_i |g_ij| + r_i^3 |x_ij| / d * sum_l |g_il x_il|,
//   d_weight_scale_j  = sum_i |d_y_ij x_ij r_i|.
struct RmsNormGradients {
  MatrixD d_x, d_x_scale;
  Vector<double> d_weight, d_weight_scale;
};

inline RmsNormGradients rms_norm_backward(const MatrixD& x, const Vector<double>& w,
                                          const Vector<double>& r, const MatrixD& d_y) {
  const Index n = x.rows(), d = x.cols();
  RmsNormGradients out{MatrixD(n, d), MatrixD(n, d), Vector<double>::Zero(d),
                       Vector<double>::Zero(d)};
  for (Index i = 0; i < n; ++i) {
    double dot = 0, abs_dot = 0;
    for (Index j = 0; j < d; ++j) {
      const double g = d_y(i, j) * w(j);
      dot += g * x(i, j);
      abs_dot += std::abs(g * x(i, j));
    }
    const double r3 = r(i) * r(i) * r(i) / double(d);
    for (Index j = 0; j < d; ++j) {
      const double g = d_y(i, j) * w(j);
      out.d_x(i, j) = r(i) * g - r3 * x(i, j) * dot;
      out.d_x_scale(i, j) = r(i) * std::abs(g) + r3 * std::abs(x(i, j)) * abs_dot;
      out.d_weight(j) += d_y(i, j) * x(i, j) * r(i);
      out.d_weight_scale(j) += std::abs(d_y(i, j) * x(i, j) * r(i));
    }
  }
  return out;
}

}  // namespace linrope::reference
