// Naive matrix product in double, and the matching error bound: the reference for detail::gemm
// and linrope::matmul.
#pragma once

#include <limits>
#include <linrope/types.hpp>
#include <type_traits>

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

// The reference value of a b (+ c0, when given) and how far a product computed in T may be from
// it, entry by entry, for inputs already rounded to T. Each c_ij is a sum of k products (plus
// c0_ij): k (+ 1) roundings of relative size u, each within u of the running sum of magnitudes,
// so |c - ref| <= (k + 1) u (sum_p |a_ip b_pj| + |c0_ij|) (Higham, Accuracy and Stability, 3.1);
// 1.01 covers gamma_{k+1} against (k + 1) u. For float the reference is exact to that precision
// (float products and short sums are exact in double); for double it rounds as much: twice.
struct ProductCheck {
  MatrixD expected, bound;
};
template <class T>
ProductCheck product_check(const MatrixD& a, const MatrixD& b, const MatrixD* c0 = nullptr) {
  ProductCheck check{matmul(a, b), abs_matmul(a, b)};
  if (c0) {
    check.expected += *c0;
    check.bound += c0->cwiseAbs();
  }
  const double u = std::numeric_limits<T>::epsilon() / 2;
  const double sides = std::is_same_v<T, float> ? 1 : 2;
  check.bound *= 1.01 * sides * double(a.cols() + 1) * u;
  return check;
}

}  // namespace linrope::reference
