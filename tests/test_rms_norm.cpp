// linrope::rms_norm and rms_norm_backward (include/linrope/normalization.hpp) against the naive
// double RMSNorm (reference/rms_norm_reference.hpp): the forward and its inv_rms, the backward's
// d_x and d_weight against the closed form and, in double, against finite differences of the
// reference forward; rows around the 256-row blocks, widths around the packet width, tiny and
// huge rows; writes confined to the outputs; the output rows' mean square; the same bits on 1 and
// 2 threads and at another address; refused calls.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linrope/normalization.hpp>
#include <stdexcept>
#include <utility>

#include "reference/finite_difference.hpp"
#include "reference/random.hpp"
#include "reference/rms_norm_reference.hpp"
#include "threads.hpp"

namespace {

using linrope::Index;
using linrope::Matrix;
using linrope::MatrixD;
using linrope::Vector;
namespace ref = linrope::reference;

// Rounding errors, bounded to first order in the unit roundoff u of T (2^-24 for float, 2^-53 for
// double), row i, d = x.cols():
//  - the sum of d squares, in packet lanes then across them, has relative error <= d u (every
//    term is positive); the division by d, + eps, sqrt (which halves what it is given) and
//    1 / add 4 u: r_i is within (d + 4) u r_i, and y_ij = x_ij r_i w_j, two products more, within
//    (d + 6) u |y_ij|. Forward bound: (d + 16) u |y| (and (d + 16) u r for inv_rms).
//  - d_x_ij = r g_ij - c x_ij, c = r^3 / d * sum_l g_l x_l: g = d_y w rounds once, the dot of d
//    terms is within (d + 1) u sum_l |g_l x_l|, r^3 / d adds 3 roundings, c x, r g and the
//    difference one each: (d + 16) u (r |g_ij| + r^3 |x_ij| / d * sum_l |g_l x_l|).
//  - d_weight_j = sum_i d_y_ij x_ij r_i: two products per term, then n terms added in order
//    (within each 256-row block, then the blocks): (n + d + 16) u sum_i |d_y_ij x_ij r_i|.
// The inputs are rounded to T before the reference sees them (eps too), so the reference is the
// exact result of the kernel's inputs to double precision; for T = double the reference rounds
// as much as the kernel: the bounds double.
template <class T>
constexpr double kU = std::numeric_limits<T>::epsilon() / 2;
template <class T>
constexpr double kSides = sizeof(T) == sizeof(float) ? 1 : 2;

// m's values rounded to T, in double.
template <class T, class M>
auto rounded(const M& m) {
  return m.template cast<T>().template cast<double>().eval();
}

// max over the entries of |got - want| / bound (an error against a zero bound, or a NaN, is
// +inf): the check is worst_ratio(...) <= 1, and the ratio says how close a case came.
template <class A, class B, class C>
double worst_ratio(const A& got, const B& want, const C& bound) {
  double worst = 0;
  for (Index i = 0; i < want.rows(); ++i)
    for (Index j = 0; j < want.cols(); ++j) {
      const double error = std::abs(double(got(i, j)) - want(i, j));
      if (!(error <= bound(i, j))) return std::numeric_limits<double>::infinity();
      if (error > 0) worst = std::max(worst, error / bound(i, j));
    }
  return worst;
}

// x [n x d] gaussian, or with rows scaled by 1e-3, 1 and 1e3 in turn; weight and d_y gaussian.
struct Inputs {
  MatrixD x;
  Vector<double> w;
  MatrixD d_y;
};
template <class T>
Inputs inputs(Index n, Index d, std::uint64_t seed, bool scaled_rows = false) {
  MatrixD x = linrope::testing::gaussian(n, d, seed);
  if (scaled_rows)
    for (Index i = 0; i < n; ++i) x.row(i) *= (i % 3 == 0 ? 1e-3 : i % 3 == 1 ? 1.0 : 1e3);
  const Vector<double> w = linrope::testing::gaussian(d, 1, seed + 1);
  return {rounded<T>(x), rounded<T>(w), rounded<T>(linrope::testing::gaussian(n, d, seed + 2))};
}

template <class T>
struct Forward {
  Matrix<T> y;
  Vector<T> inv_rms;
};
template <class T>
Forward<T> forward(const MatrixD& x, const Vector<double>& w, T eps) {
  Forward<T> out{Matrix<T>(x.rows(), x.cols()), Vector<T>(x.rows())};
  linrope::rms_norm(x.cast<T>(), w.cast<T>(), eps, out.y, out.inv_rms);
  return out;
}

// The forward and the backward against the reference, the outputs inside larger buffers whose
// other entries must keep their sentinel.
template <class T>
void check(const Inputs& in, T eps) {
  const Index n = in.x.rows(), d = in.x.cols();
  CAPTURE(n);
  CAPTURE(d);
  CAPTURE(eps);
  const double u = kU<T> * kSides<T>;
  const T sentinel = T(12345);
  Matrix<T> y = Matrix<T>::Constant(n + 2, d + 2, sentinel);
  Vector<T> inv_rms = Vector<T>::Constant(n + 2, sentinel);
  linrope::rms_norm(in.x.cast<T>(), in.w.cast<T>(), eps, y.block(1, 1, n, d),
                    inv_rms.segment(1, n));
  const ref::RmsNorm want = ref::rms_norm(in.x, in.w, double(eps));
  const double y_ratio =
      worst_ratio(y.block(1, 1, n, d), want.y, (double(d + 16) * u * want.y.cwiseAbs()).eval());
  const double r_ratio =
      worst_ratio(inv_rms.segment(1, n), want.inv_rms, (double(d + 16) * u * want.inv_rms).eval());
  CAPTURE(y_ratio);
  CAPTURE(r_ratio);
  CHECK(y_ratio <= 1);
  CHECK(r_ratio <= 1);
  // The backward from the kernel's own inv_rms, which the reference takes as given.
  const Vector<T> r = inv_rms.segment(1, n);
  y.block(1, 1, n, d).setConstant(sentinel);
  inv_rms.segment(1, n).setConstant(sentinel);
  CHECK((y.array() == sentinel).all());
  CHECK((inv_rms.array() == sentinel).all());

  Matrix<T> d_x = Matrix<T>::Constant(n + 2, d + 2, sentinel);
  Vector<T> d_weight = Vector<T>::Constant(d + 2, sentinel);
  linrope::rms_norm_backward(in.x.cast<T>(), in.w.cast<T>(), r, in.d_y.cast<T>(),
                             d_x.block(1, 1, n, d), d_weight.segment(1, d));
  const ref::RmsNormGradients g =
      ref::rms_norm_backward(in.x, in.w, r.template cast<double>(), in.d_y);
  const double d_x_ratio =
      worst_ratio(d_x.block(1, 1, n, d), g.d_x, (double(d + 16) * u * g.d_x_scale).eval());
  const double d_weight_ratio = worst_ratio(d_weight.segment(1, d), g.d_weight,
                                            (double(n + d + 16) * u * g.d_weight_scale).eval());
  CAPTURE(d_x_ratio);
  CAPTURE(d_weight_ratio);
  CHECK(d_x_ratio <= 1);
  CHECK(d_weight_ratio <= 1);  // n = 0: the empty sum, exactly 0
  d_x.block(1, 1, n, d).setConstant(sentinel);
  d_weight.segment(1, d).setConstant(sentinel);
  CHECK((d_x.array() == sentinel).all());
  CHECK((d_weight.array() == sentinel).all());
}

TEST_CASE_TEMPLATE("rms_norm and its backward match the naive double RMSNorm over swept shapes", T,
                   float, double) {
  std::uint64_t seed = 1;
  // Rows: none, one, around the 256-row blocks, several blocks; widths around the packet widths
  // (8 doubles, 16 floats with AVX-512), with tails; eps below and above rounding's reach.
  for (Index n : {0, 1, 7, 255, 256, 257, 600})
    for (Index d : {1, 3, 15, 16, 17, 64, 128, 130})
      for (double eps : {1e-6, 1e-2}) {
        check<T>(inputs<T>(n, d, seed), T(eps));
        seed += 3;
      }
}

TEST_CASE_TEMPLATE("rms_norm and its backward on rows of norm 1e-3 and 1e3", T, float, double) {
  // eps dominates the rows of 1e-3 (mean square 1e-6 against eps = 1e-2) and is lost in those of
  // 1e3: both ends of r, r^3 ~ 1e9 in the backward.
  for (Index d : {1, 17, 130})
    for (double eps : {1e-6, 1e-2}) check<T>(inputs<T>(257, d, 100 + d, true), T(eps));
}

TEST_CASE_TEMPLATE("rms_norm with weight 1 gives rows of mean square m / (m + eps)", T, float,
                   double) {
  // Each y_ij within (d + 16) u |y_ij| (above): y_ij^2 within 2 (d + 16) u, and so is their
  // positive mean; the two means computed here in double add (d + 1) u and (d + 3) u (sum,
  // division, + eps, quotient), negligible for float: 4 (d + 16) u of m / (m + eps).
  for (Index d : {1, 16, 130}) {
    CAPTURE(d);
    const Inputs in = inputs<T>(300, d, 200 + d, true);
    const T eps = T(1e-2);
    const Forward<T> out = forward(in.x, Vector<double>::Ones(d), eps);
    double worst = 0;
    for (Index i = 0; i < in.x.rows(); ++i) {
      const double m = in.x.row(i).squaredNorm() / double(d);
      const double expected = m / (m + double(eps));
      const double got = out.y.row(i).template cast<double>().squaredNorm() / double(d);
      worst = std::max(worst, std::abs(got - expected) / (4 * double(d + 16) * kU<T> * expected));
    }
    CAPTURE(worst);
    CHECK(worst <= 1);
  }
}

TEST_CASE("rms_norm_backward matches finite differences of the reference forward (double)") {
  // The loss sum(d_y .* y(x, w)) differentiated by the reference's own forward, with respect to x
  // and to w; tolerance 3e-8 of the largest entry (reference/finite_difference.hpp).
  for (const auto& [n, d] : {std::pair<Index, Index>{5, 7}, {3, 16}, {6, 2}})
    for (double eps : {1e-6, 1e-2}) {
      CAPTURE(n);
      CAPTURE(d);
      CAPTURE(eps);
      const Inputs in = inputs<double>(n, d, 300 + std::uint64_t(n * d));
      const auto loss = [&](const MatrixD& x, const Vector<double>& w) {
        return ref::weighted_sum(in.d_y, ref::rms_norm(x, w, eps).y);
      };
      const MatrixD fd_x =
          ref::central_difference(in.x, [&](const MatrixD& x) { return loss(x, in.w); });
      const MatrixD fd_w = ref::central_difference(
          in.w.transpose(), [&](const MatrixD& w) { return loss(in.x, w.transpose()); });
      const Forward<double> out = forward(in.x, in.w, eps);
      MatrixD d_x(n, d);
      Vector<double> d_weight(d);
      linrope::rms_norm_backward(in.x, in.w, out.inv_rms, in.d_y, d_x, d_weight);
      const double d_x_error = (d_x - fd_x).cwiseAbs().maxCoeff() / fd_x.cwiseAbs().maxCoeff();
      const double d_weight_error =
          (d_weight.transpose() - fd_w).cwiseAbs().maxCoeff() / fd_w.cwiseAbs().maxCoeff();
      CAPTURE(d_x_error);
      CAPTURE(d_weight_error);
      CHECK(d_x_error <= 3e-8);
      CHECK(d_weight_error <= 3e-8);
    }
}

template <class T>
struct Backward {
  Matrix<T> d_x;
  Vector<T> d_weight;
};
template <class T>
Backward<T> backward(const Inputs& in, const Vector<T>& inv_rms) {
  Backward<T> out{Matrix<T>(in.x.rows(), in.x.cols()), Vector<T>(in.x.cols())};
  linrope::rms_norm_backward(in.x.cast<T>(), in.w.cast<T>(), inv_rms, in.d_y.cast<T>(), out.d_x,
                             out.d_weight);
  return out;
}

TEST_CASE_TEMPLATE("rms_norm and its backward give the same bits on one thread and on two", T,
                   float, double) {
  // 600 rows: three 256-row blocks, so two threads split the rows and d_weight's partial sums.
  const Inputs in = inputs<T>(600, 130, 400);
  const T eps = T(1e-6);
  Forward<T> one, two;
  Backward<T> one_back, two_back;
  {
    const linrope::testing::ThreadCount threads(1);
    one = forward(in.x, in.w, eps);
    one_back = backward(in, one.inv_rms);
  }
  {
    const linrope::testing::ThreadCount threads(linrope::testing::kSplitThreads);
    two = forward(in.x, in.w, eps);
    two_back = backward(in, two.inv_rms);
  }
  CHECK((one.y.array() == two.y.array()).all());
  CHECK((one.inv_rms.array() == two.inv_rms.array()).all());
  CHECK((one_back.d_x.array() == two_back.d_x.array()).all());
  CHECK((one_back.d_weight.array() == two_back.d_weight.array()).all());
}

TEST_CASE_TEMPLATE("rms_norm and its backward give the same bits at another address", T, float,
                   double) {
  // Every argument one element further on, the matrices in a buffer with an extra leading column
  // (outer stride d + 1): a row's packets start at its first element, wherever that lies.
  for (Index d : {17, 130}) {
    CAPTURE(d);
    const Index n = 300;
    const Inputs in = inputs<T>(n, d, 500 + d);
    const T eps = T(1e-2);
    const Forward<T> dense = forward(in.x, in.w, eps);
    const Backward<T> dense_back = backward(in, dense.inv_rms);

    Matrix<T> x(n, d + 1), d_y(n, d + 1), y(n, d + 1), d_x(n, d + 1);
    Vector<T> w(d + 1), inv_rms(n + 1), r(n + 1), d_weight(d + 1);
    x.rightCols(d) = in.x.cast<T>();
    d_y.rightCols(d) = in.d_y.cast<T>();
    w.tail(d) = in.w.cast<T>();
    r.tail(n) = dense.inv_rms;
    linrope::rms_norm(x.rightCols(d), w.tail(d), eps, y.rightCols(d), inv_rms.tail(n));
    linrope::rms_norm_backward(x.rightCols(d), w.tail(d), r.tail(n), d_y.rightCols(d),
                               d_x.rightCols(d), d_weight.tail(d));
    CHECK((y.rightCols(d).array() == dense.y.array()).all());
    CHECK((inv_rms.tail(n).array() == dense.inv_rms.array()).all());
    CHECK((d_x.rightCols(d).array() == dense_back.d_x.array()).all());
    CHECK((d_weight.tail(d).array() == dense_back.d_weight.array()).all());
  }
}

TEST_CASE_TEMPLATE("rms_norm and its backward refuse shapes that disagree, a bad eps, overlaps", T,
                   float, double) {
  using M = Matrix<T>;
  using V = Vector<T>;
  const M x = M::Ones(4, 5), d_y = M::Ones(4, 5);
  const V w = V::Ones(5), r = V::Ones(4);
  M y(4, 5), d_x(4, 5);
  V inv_rms(4), d_weight(5);
  const T eps = T(1e-6);
  using E = std::invalid_argument;

  REQUIRE_THROWS_WITH_AS(linrope::rms_norm(x, V::Ones(3), eps, y, inv_rms),
                         "rms_norm: weight has 3 elements but x is [4 x 5] (expected d = 5)", E);
  // d = 0: the mean square of no values is undefined (0 / 0).
  const M no_columns(4, 0);
  const V no_weight(0);
  M no_columns_out(4, 0);
  V no_weight_out(0);
  REQUIRE_THROWS_WITH_AS(linrope::rms_norm(no_columns, no_weight, eps, no_columns_out, inv_rms),
                         "rms_norm: x is [4 x 0]; expected d >= 1 columns", E);
  REQUIRE_THROWS_WITH_AS(linrope::rms_norm_backward(no_columns, no_weight, r, no_columns,
                                                    no_columns_out, no_weight_out),
                         "rms_norm_backward: x is [4 x 0]; expected d >= 1 columns", E);
  M wide(4, 6);
  REQUIRE_THROWS_WITH_AS(linrope::rms_norm(x, w, eps, wide, inv_rms),
                         "rms_norm: y is [4 x 6] but x is [4 x 5]; expected the same shape", E);
  V short_r(3);
  REQUIRE_THROWS_WITH_AS(linrope::rms_norm(x, w, eps, y, short_r),
                         "rms_norm: inv_rms has 3 elements but expected 4 (one per row of x)", E);
  // eps must be finite and > 0; a refused call writes nothing.
  y.setConstant(T(7));
  REQUIRE_THROWS_WITH_AS(linrope::rms_norm(x, w, T(0), y, inv_rms),
                         "rms_norm: eps is 0 but expected > 0", E);
  REQUIRE_THROWS_WITH_AS(linrope::rms_norm(x, w, T(-1), y, inv_rms),
                         "rms_norm: eps is -1 but expected > 0", E);
  REQUIRE_THROWS_WITH_AS(linrope::rms_norm(x, w, std::numeric_limits<T>::quiet_NaN(), y, inv_rms),
                         "rms_norm: eps is nan but expected > 0", E);
  REQUIRE_THROWS_WITH_AS(linrope::rms_norm(x, w, std::numeric_limits<T>::infinity(), y, inv_rms),
                         "rms_norm: eps is inf but expected > 0", E);
  CHECK((y.array() == T(7)).all());
  // y overlapping x: in place, or rows of one buffer that share a row; disjoint rows are fine.
  M buffer = M::Ones(8, 5);
  REQUIRE_THROWS_WITH_AS(linrope::rms_norm(buffer.topRows(4), w, eps, buffer.topRows(4), inv_rms),
                         "rms_norm: y overlaps x; expected separate storage", E);
  REQUIRE_THROWS_WITH_AS(
      linrope::rms_norm(buffer.topRows(4), w, eps, buffer.middleRows(3, 4), inv_rms),
      "rms_norm: y overlaps x; expected separate storage", E);
  linrope::rms_norm(buffer.topRows(4), w, eps, buffer.bottomRows(4), inv_rms);
  CHECK((buffer.bottomRows(4).array() == T(1) / std::sqrt(T(1) + eps)).all());

  const auto call_backward = [&](const auto& x_, const auto& w_, const auto& r_, const auto& d_y_,
                                 auto&& d_x_, auto&& d_weight_) {
    linrope::rms_norm_backward(x_, w_, r_, d_y_, d_x_, d_weight_);
  };
  REQUIRE_THROWS_WITH_AS(
      call_backward(x, V::Ones(6), r, d_y, d_x, d_weight),
      "rms_norm_backward: weight has 6 elements but x is [4 x 5] (expected d = 5)", E);
  REQUIRE_THROWS_WITH_AS(
      call_backward(x, w, V::Ones(5), d_y, d_x, d_weight),
      "rms_norm_backward: inv_rms has 5 elements but expected 4 (one per row of x)", E);
  REQUIRE_THROWS_WITH_AS(
      call_backward(x, w, r, M::Ones(4, 4), d_x, d_weight),
      "rms_norm_backward: d_y is [4 x 4] but x is [4 x 5]; expected the same shape", E);
  REQUIRE_THROWS_WITH_AS(
      call_backward(x, w, r, d_y, M(3, 5), d_weight),
      "rms_norm_backward: d_x is [3 x 5] but x is [4 x 5]; expected the same shape", E);
  REQUIRE_THROWS_WITH_AS(call_backward(x, w, r, d_y, d_x, V(4)),
                         "rms_norm_backward: d_weight has 4 elements but expected d = 5", E);
  d_weight.setConstant(T(7));
  M grads = M::Ones(8, 5);
  REQUIRE_THROWS_WITH_AS(
      call_backward(grads.topRows(4), w, r, d_y, grads.middleRows(3, 4), d_weight),
      "rms_norm_backward: d_x overlaps x; expected separate storage", E);
  REQUIRE_THROWS_WITH_AS(call_backward(x, w, r, grads.topRows(4), grads.topRows(4), d_weight),
                         "rms_norm_backward: d_x overlaps d_y; expected separate storage", E);
  // The vectors against the matrices: inv_rms in x's memory, d_weight in d_x's.
  M flat = M::Ones(1, 20);
  Eigen::Map<const M> x_in_flat(flat.data(), 4, 5);
  Eigen::Map<V> r_in_flat(flat.data() + 16, 4), d_weight_in_flat(flat.data() + 15, 5);
  REQUIRE_THROWS_WITH_AS(linrope::rms_norm(x_in_flat, w, eps, y, r_in_flat),
                         "rms_norm: inv_rms overlaps x, weight or y; expected separate storage", E);
  Eigen::Map<M> d_x_in_flat(flat.data(), 4, 5);
  REQUIRE_THROWS_WITH_AS(
      call_backward(x, w, r, d_y, d_x_in_flat, d_weight_in_flat),
      "rms_norm_backward: d_weight overlaps an input or d_x; expected separate storage", E);
  CHECK((d_weight.array() == T(7)).all());
  // x, d_y and d_x as disjoint rows of one buffer are fine.
  call_backward(grads.topRows(4), w, r, grads.topRows(4), grads.bottomRows(4), d_weight);
  CHECK((d_weight.array() == T(4)).all());  // sum_i d_y x r = 4 rows of 1
}

}  // namespace
