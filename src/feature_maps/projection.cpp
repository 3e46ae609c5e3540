// The random projection W of the FAVOR maps: iid Gaussian rows or Haar-orthogonal blocks.
#include <Eigen/QR>
#include <cmath>
#include <linrope/random.hpp>

#include "feature_maps/maps.hpp"

namespace linrope::detail {

MatrixD draw_projection(Index d, Index f, bool orthogonal, bool regularized, std::uint64_t seed) {
  Random random(seed);
  const auto gaussian = [&random] { return random.gaussian(); };
  MatrixD w(f, d);
  if (!orthogonal) {
    for (Index i = 0; i < f; ++i)
      for (Index j = 0; j < d; ++j) w(i, j) = gaussian();
    return w;
  }
  Eigen::MatrixXd g(d, d);
  for (Index first = 0; first < f; first += d) {
    for (Index r = 0; r < d; ++r)
      for (Index c = 0; c < d; ++c) g(r, c) = gaussian();
    const Eigen::HouseholderQR<Eigen::MatrixXd> qr(g);
    Eigen::MatrixXd q = qr.householderQ();
    for (Index c = 0; c < d; ++c)
      if (qr.matrixQR()(c, c) < 0) q.col(c) = -q.col(c);
    const Index rows = std::min(d, f - first);
    for (Index r = 0; r < rows; ++r) {
      double norm = std::sqrt(double(d));
      if (!regularized) {
        double sum = 0;
        for (Index j = 0; j < d; ++j) {
          const double z = gaussian();
          sum += z * z;
        }
        norm = std::sqrt(sum);
      }
      w.row(first + r) = q.row(r) * norm;
    }
  }
  return w;
}

}  // namespace linrope::detail
