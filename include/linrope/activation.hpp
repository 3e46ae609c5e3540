// linrope: GELU (Hendrycks and Gimpel 2016), the activation of a transformer's MLP, exact form
// x Phi(x) (Phi the standard normal CDF, nn.GELU's default), forward and backward element by
// element on linrope's threads.
#pragma once

#include <linrope/types.hpp>

namespace linrope {

// y = x Phi(x) = x (1 + erf(x / sqrt 2)) / 2, element by element over x (any contiguous array,
// viewed flat); y may be x itself. float: erf by Abramowitz and Stegun 7.1.26 (absolute error
// <= 1.5e-7, the form PyTorch's vectorised CPU erf uses) with one vectorised exp, so
// |y - exact| <= 0.75e-7 |x| + rounding; double: std::erfc. Throws std::invalid_argument when the
// sizes differ or y overlaps x without being x.
void gelu(const Eigen::Ref<const Vector<float>>& x, Eigen::Ref<Vector<float>> y);
void gelu(const Eigen::Ref<const Vector<double>>& x, Eigen::Ref<Vector<double>> y);

// d_x = d_y GELU'(x), GELU'(x) = Phi(x) + x phi(x) (phi the standard normal density), Phi and
// exp(-x^2 / 2) computed once for both terms. d_x may be d_y or x itself. Values are not checked
// (here or in gelu): NaN propagates.
void gelu_backward(const Eigen::Ref<const Vector<float>>& x,
                   const Eigen::Ref<const Vector<float>>& d_y, Eigen::Ref<Vector<float>> d_x);
void gelu_backward(const Eigen::Ref<const Vector<double>>& x,
                   const Eigen::Ref<const Vector<double>>& d_y, Eigen::Ref<Vector<double>> d_x);

}  // namespace linrope
