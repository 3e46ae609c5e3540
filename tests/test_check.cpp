// all_finite (src/common/check.hpp), the test behind every non-finite refusal: one NaN, +inf or
// -inf at any position of a contiguous run, of a row of a strided block or of an expression
// without direct access is found, whatever the run's length (the 64-wide sums, their tail, the
// halving reduction), and finite values, however large, are accepted.
#include <doctest/doctest.h>

#include <Eigen/Core>
#include <cmath>
#include <limits>
#include <vector>

#include "common/check.hpp"

namespace {

using linrope::Index;
using linrope::detail::all_finite;

template <class T>
using RowMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <class T>
std::vector<T> bad_values() {
  return {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
          -std::numeric_limits<T>::infinity()};
}

TEST_CASE_TEMPLATE("all_finite finds one non-finite value at every position", T, float, double) {
  for (const Index n : {1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 200}) {
    CAPTURE(n);
    // Large finite values: x * 0 is still 0 (the sums never see an overflow).
    std::vector<T> x(n, std::numeric_limits<T>::max());
    const Eigen::Map<const RowMajor<T>> run(x.data(), 1, n);
    CHECK(all_finite(run));
    for (const T bad : bad_values<T>())
      for (Index at = 0; at < n; ++at) {
        x[at] = bad;
        CHECK_FALSE(all_finite(run));
        x[at] = T(-1.5);
      }
    CHECK(all_finite(run));
  }
}

TEST_CASE_TEMPLATE("all_finite on blocks: rows apart, columns, no direct access", T, float,
                   double) {
  RowMajor<T> m = RowMajor<T>::Constant(7, 70, T(2));
  const auto block = m.block(1, 3, 5, 66);  // rows 70 apart, 66 wide: the per-row path
  CHECK(all_finite(block));
  CHECK(all_finite(m.col(5)));
  CHECK(all_finite(m.array() + T(1)));
  for (const T bad : bad_values<T>())
    for (Index i = 0; i < m.rows(); ++i)
      for (Index j = 0; j < m.cols(); ++j) {
        m(i, j) = bad;
        const bool inside = i >= 1 && i < 6 && j >= 3 && j < 69;
        CHECK(all_finite(block) == !inside);
        CHECK(all_finite(m.col(5)) == (j != 5));
        CHECK_FALSE(all_finite(m.array() + T(1)));
        CHECK_FALSE(all_finite(m));
        m(i, j) = T(2);
      }
}

}  // namespace
