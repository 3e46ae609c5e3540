// RoPE's long-term decay curve (RoFormer sec. 3.4.3).
#include <complex>
#include <linrope/rope.hpp>
#include <vector>

#include "common/check.hpp"

namespace linrope {

std::vector<double> rope_decay_curve(const Rope& rope, Index max_distance) {
  if (max_distance < 0)
    detail::throw_invalid("rope_decay_curve", "max_distance is ", max_distance,
                          " but expected max_distance >= 0");
  const std::vector<double> theta = rope.frequencies();
  const Index half = Index(theta.size());
  std::vector<double> curve(max_distance + 1);
  for (Index m = 0; m <= max_distance; ++m) {
    std::complex<double> partial = 0;  // S_j = sum_{i<j} exp(1j m theta_i)
    double total = 0;
    for (Index j = 1; j <= half; ++j) {
      partial += std::polar(1.0, double(m) * theta[j - 1]);
      total += std::abs(partial);
    }
    curve[m] = total / double(half);
  }
  return curve;
}

std::vector<double> rope_decay_curve(Index dim, double base, Index max_distance) {
  return rope_decay_curve(Rope(RopeConfig{.dim = dim, .base = base}), max_distance);
}

}  // namespace linrope
