// Naive matrix product in double, and the matching error scale: the reference for detail::gemm.
#pragma once

#include <linrope/types.hpp>

namespace linrope::reference {

// c = a b by the textbook triple loop (no Eigen product, no blocking).
inline MatrixD matmul(const MatrixD& a, const MatrixD& b) {
  MatrixD c = MatrixD::Zero(a.rows(), b.cols());
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < b.cols(); ++j) {
      double sum = 0;
      for (Index p = 0; p < a.cols(); ++p) sum += a(i, p) * b(p, j);
      c(i, j) = sum;
    }
  return c;
}

// |a| |b| element-wise: sum_p |a_ip| |b_pj|, the scale of the rounding error of c_ij.
inline MatrixD abs_matmul(const MatrixD& a, const MatrixD& b) {
  return matmul(a.cwiseAbs(), b.cwiseAbs());
}

}  // namespace linrope::reference
