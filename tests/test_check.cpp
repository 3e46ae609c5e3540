// all_finite (src/common/check.hpp), the test behind every non-finite refusal: one NaN, +inf or
// -inf at any position of a contiguous run, of a row of a strided block, of a column-major block
// or of an expression without direct access is found, whatever the run's length (zero_sum's
// 64-wide sums, their tail, the halving reduction; Eigen's sum below kZeroSumRun), and finite
// values, however large, are accepted.
#include <doctest/doctest.h>

#include <Eigen/Core>
#include <cmath>
#include <limits>
#include <vector>

#include "common/check.hpp"

namespace {

using linrope::Index;
using linrope::detail::all_finite;
using linrope::detail::kZeroSumRun;
using linrope::detail::zero_sum;

template <class T>
using RowMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <class T>
std::vector<T> bad_values() {
  return {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
          -std::numeric_limits<T>::infinity()};
}

// Every length zero_sum may see in its tail and its reduction, called directly (all_finite sends
// runs this short to Eigen's sum).
TEST_CASE_TEMPLATE("zero_sum is 0 for finite runs and NaN with one non-finite value anywhere", T,
                   float, double) {
  for (Index n = 1; n <= 200; ++n) {
    CAPTURE(n);
    std::vector<T> x(n, std::numeric_limits<T>::max());
    CHECK(zero_sum(x.data(), n) == T(0));
    for (const T bad : bad_values<T>())
      for (Index at = 0; at < n; ++at) {
        x[at] = bad;
        CHECK(std::isnan(zero_sum(x.data(), n)));
        x[at] = T(-1.5);
      }
  }
}

TEST_CASE_TEMPLATE("all_finite finds one non-finite value at every position", T, float, double) {
  for (const Index n : {Index(1), Index(2), Index(17), Index(64), Index(200), kZeroSumRun - 1,
                        kZeroSumRun, kZeroSumRun + 1, kZeroSumRun + 63, kZeroSumRun + 64,
                        kZeroSumRun + 65, 2 * kZeroSumRun + 7}) {
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

// Each cell of the parent set in turn: a block must see exactly the cells inside it. Blocks end at
// the parent's last element too, where a read past a row would leave the buffer (sanitizers).
template <class M, class Block>
void check_every_cell(M& m, Block block, Index top, Index left, Index rows, Index cols) {
  using T = typename M::Scalar;
  const T fill = m(0, 0);
  CHECK(all_finite(block(m)));
  for (const T bad : bad_values<T>())
    for (Index i = 0; i < m.rows(); ++i)
      for (Index j = 0; j < m.cols(); ++j) {
        m(i, j) = bad;
        const bool inside = i >= top && i < top + rows && j >= left && j < left + cols;
        CHECK(all_finite(block(m)) == !inside);
        CHECK_FALSE(all_finite(m));
        m(i, j) = fill;
      }
}

TEST_CASE_TEMPLATE("all_finite on blocks: rows apart, column-major, columns, no direct access", T,
                   float, double) {
  SUBCASE("narrow row-major blocks, rows apart (Eigen's sum)") {
    RowMajor<T> m = RowMajor<T>::Constant(7, 70, T(2));
    check_every_cell(
        m, [](auto& a) { return a.block(1, 3, 5, 66); }, 1, 3, 5, 66);
    check_every_cell(
        m, [](auto& a) { return a.bottomRightCorner(3, 9); }, 4, 61, 3, 9);
    check_every_cell(
        m, [](auto& a) { return a.col(5); }, 0, 5, 7, 1);
  }
  SUBCASE("wide row-major blocks, rows apart (zero_sum per row)") {
    const Index wide = kZeroSumRun + 3;
    RowMajor<T> m = RowMajor<T>::Constant(4, wide + 5, T(2));
    check_every_cell(
        m, [&](auto& a) { return a.block(1, 2, 2, wide); }, 1, 2, 2, wide);
    check_every_cell(
        m, [&](auto& a) { return a.bottomRightCorner(3, wide); }, 1, 5, 3, wide);
  }
  SUBCASE("column-major blocks, columns apart") {
    using ColMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
    ColMajor narrow = ColMajor::Constant(70, 6, T(2));
    check_every_cell(
        narrow, [](auto& a) { return a.block(3, 1, 66, 4); }, 3, 1, 66, 4);
    const Index tall = kZeroSumRun + 3;
    ColMajor wide = ColMajor::Constant(tall + 5, 3, T(2));
    check_every_cell(
        wide, [&](auto& a) { return a.block(2, 1, tall, 2); }, 2, 1, tall, 2);
    check_every_cell(
        wide, [&](auto& a) { return a.bottomRightCorner(tall, 2); }, 5, 1, tall, 2);
  }
  SUBCASE("an expression without direct access") {
    RowMajor<T> m = RowMajor<T>::Constant(5, 9, T(2));
    CHECK(all_finite(m.array() + T(1)));
    for (const T bad : bad_values<T>()) {
      m(4, 8) = bad;
      CHECK_FALSE(all_finite(m.array() + T(1)));
      m(4, 8) = T(2);
    }
  }
}

}  // namespace
