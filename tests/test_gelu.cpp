// linrope::gelu and gelu_backward (include/linrope/activation.hpp) against the naive double GELU
// (reference/gelu_reference.hpp, from std::erf): a grid over [-12, 12], the tails where exp(-x^2/2)
// leaves float's normal range, tiny values and gaussian samples, at sizes around the kernels'
// 16384-element blocks and packet tails; writes confined to the output; the backward against the
// analytic derivative and, in double, finite differences; in place; the same bits on 1 and 2
// threads and at any address; gelu(x) - gelu(-x) = x; refused calls.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linrope/activation.hpp>
#include <stdexcept>
#include <vector>

#include "reference/finite_difference.hpp"
#include "reference/gelu_reference.hpp"
#include "reference/random.hpp"
#include "threads.hpp"

namespace {

using linrope::Index;
using linrope::MatrixD;
using linrope::Vector;
namespace ref = linrope::reference;

// How far the kernel's gelu(x) may be from the reference (scale = |x|), and its gelu_backward
// (scale = |d_y|), exact = the reference value; u = 2^-24 for float, 2^-53 for double.
//  - float: Phi by Abramowitz and Stegun 7.1.26, |erfc error| <= 1.5e-7, so Phi within 0.75e-7.
//    Its rounding: z = |x| / sqrt 2 and t = 1 / (1 + p z) (constants rounded too) carry ~6 u, the
//    Horner steps with the five rounded coefficients ~11 u more, exp(-z^2) a few u (its argument's
//    5 u relative error times z^2 e^(-z^2) <= 1 / e), and 1 - E / 2 one. With t in (0, 1] every
//    Horner partial stays below ~1.5 in magnitude and t d(t p(t))/dt below ~3.5, so t's error is
//    amplified at most 3.5x: ~16-20 u absolute in all, 32 u with margin (measured: <= 3.5 u; a
//    coefficient mistyped in its fifth digit gives ~45 u and fails). x phi in the backward adds
//    < 2 u (x phi(x) <= 0.25). The final product(s) add 2 u |exact|.
//  - double: each side's Phi is within ~3 u absolutely (std::erfc in the kernel, std::erf and
//    1 + erf in the reference, each within a few ulp, an ulp <= 2 u below 2; the argument's
//    rounding moves them by < u), x phi(x) adds < 2 u in the backward: 16 u |scale| covers both
//    sides, with room for a libm erfc of up to 5 ulp; the products add 4 u |exact|. (In the far
//    negative tail 1 + erf cancels: the reference is then only this accurate absolutely, which the
//    |scale| term allows.)
template <class T>
double tolerance(double scale, double exact) {
  const double u = std::numeric_limits<T>::epsilon() / 2;
  if constexpr (sizeof(T) == sizeof(float))
    return std::abs(scale) * (0.75e-7 + 32 * u) + 2 * u * std::abs(exact);
  else
    return std::abs(scale) * 16 * u + 4 * u * std::abs(exact);
}

// The test values, rounded to T: tiny ones and the tails first (|x| > 13.2: exp(-x^2 / 2) below
// float's normal range, where Eigen's float exp clamps its argument at -88.7), then [-12, 12] in
// steps of 1/64, then N(0, 4^2) samples up to n.
template <class T>
Vector<double> values(Index n, std::uint64_t seed = 1) {
  std::vector<double> v;
  for (double a : {0.0, 1e-30, 1e-3, 0.5, 12.9, 13.0, 13.2, 13.3, 14.0, 14.4, 15.0, 20.0, 100.0}) {
    v.push_back(a);
    if (a != 0) v.push_back(-a);
  }
  for (int k = -12 * 64; k <= 12 * 64; ++k) v.push_back(k / 64.0);
  linrope::testing::Gaussian g(seed);
  Vector<double> x(n);
  for (Index i = 0; i < n; ++i) x(i) = double(T(i < Index(v.size()) ? v[std::size_t(i)] : 4 * g()));
  return x;
}

template <class T>
Vector<double> gaussian(Index n, std::uint64_t seed) {
  const MatrixD g = linrope::testing::gaussian(n, 1, seed);
  return g.template cast<T>().template cast<double>();
}

// max_i |got_i - want_i| / tolerance<T>(scale_i, want_i); +inf past the tolerance or for a NaN.
template <class T>
double worst_ratio(const Vector<T>& got, const Vector<double>& want, const Vector<double>& scale) {
  double worst = 0;
  for (Index i = 0; i < want.size(); ++i) {
    const double error = std::abs(double(got(i)) - want(i)),
                 bound = tolerance<T>(scale(i), want(i));
    if (!(error <= bound)) return std::numeric_limits<double>::infinity();
    if (error > 0) worst = std::max(worst, error / bound);
  }
  return worst;
}

template <class T>
Vector<T> gelu(const Vector<double>& x) {
  Vector<T> y(x.size());
  linrope::gelu(x.cast<T>(), y);
  return y;
}
template <class T>
Vector<T> gelu_backward(const Vector<double>& x, const Vector<double>& d_y) {
  Vector<T> d_x(x.size());
  linrope::gelu_backward(x.cast<T>(), d_y.cast<T>(), d_x);
  return d_x;
}

TEST_CASE_TEMPLATE("gelu and gelu_backward match the naive double GELU around the block edges", T,
                   float, double) {
  // 16384-element blocks: one, one and a tail of 1, several; packet tails of 15, 16, 17.
  for (Index n : {0, 1, 15, 16, 17, 1000, 16384, 16385, 40000}) {
    CAPTURE(n);
    const Vector<double> x = values<T>(n), d_y = gaussian<T>(n, 2);
    Vector<double> y_want(n), d_x_want(n);
    for (Index i = 0; i < n; ++i) {
      y_want(i) = ref::gelu(x(i));
      d_x_want(i) = d_y(i) * ref::gelu_derivative(x(i));
    }
    // The outputs one element into a buffer whose other entries must keep their sentinel.
    const T sentinel = T(12345);
    Vector<T> y = Vector<T>::Constant(n + 2, sentinel), d_x = y;
    linrope::gelu(x.cast<T>(), y.segment(1, n));
    linrope::gelu_backward(x.cast<T>(), d_y.cast<T>(), d_x.segment(1, n));
    const double y_ratio = worst_ratio<T>(y.segment(1, n), y_want, x);
    const double d_x_ratio = worst_ratio<T>(d_x.segment(1, n), d_x_want, d_y);
    CAPTURE(y_ratio);
    CAPTURE(d_x_ratio);
    CHECK(y_ratio <= 1);
    CHECK(d_x_ratio <= 1);
    CHECK(y(0) == sentinel);
    CHECK(y(n + 1) == sentinel);
    CHECK(d_x(0) == sentinel);
    CHECK(d_x(n + 1) == sentinel);
  }
}

TEST_CASE("gelu_backward matches finite differences of the reference gelu (double)") {
  // d/dx sum(d_y .* gelu(x)) by the reference's own forward; tolerance 3e-8 of the largest entry
  // (reference/finite_difference.hpp; the loss's terms sum to ~500 here, so its rounding adds
  // ~u 500 / h ~ 5e-9 of an entry ~2: still far below).
  Vector<double> x(100);
  x.head(4) << 0, 1e-30, -1e-3, 1e-3;
  for (Index i = 4; i < 100; ++i) x(i) = -12 + 0.25 * double(i - 4);
  const Vector<double> d_y = gaussian<double>(100, 3);
  const MatrixD fd = ref::central_difference(MatrixD(x), [&](const MatrixD& xx) {
    return ref::weighted_sum(MatrixD(d_y), MatrixD(ref::gelu(Vector<double>(xx))));
  });
  const Vector<double> got = gelu_backward<double>(x, d_y);
  const double error = (got - Vector<double>(fd)).cwiseAbs().maxCoeff() / fd.cwiseAbs().maxCoeff();
  CAPTURE(error);
  CHECK(error <= 3e-8);
}

TEST_CASE_TEMPLATE("gelu and gelu_backward in place give the out-of-place bits", T, float, double) {
  const Vector<double> x = values<T>(16385, 4), d_y = gaussian<T>(16385, 5);
  Vector<T> y = x.cast<T>(), d_x = d_y.cast<T>();
  linrope::gelu(y, y);
  linrope::gelu_backward(x.cast<T>(), d_x, d_x);
  Vector<T> x_then_d_x = x.cast<T>();  // d_x = x, the header's other in-place call
  linrope::gelu_backward(x_then_d_x, d_y.cast<T>(), x_then_d_x);
  CHECK((y.array() == gelu<T>(x).array()).all());
  CHECK((d_x.array() == gelu_backward<T>(x, d_y).array()).all());
  CHECK((x_then_d_x.array() == gelu_backward<T>(x, d_y).array()).all());
}

TEST_CASE_TEMPLATE("gelu and gelu_backward give the same bits on one thread and on two", T, float,
                   double) {
  // 40000 elements: three blocks, split between the threads.
  const Vector<double> x = values<T>(40000, 6), d_y = gaussian<T>(40000, 7);
  Vector<T> y_one, y_two, d_x_one, d_x_two;
  {
    const linrope::testing::ThreadCount threads(1);
    y_one = gelu<T>(x);
    d_x_one = gelu_backward<T>(x, d_y);
  }
  {
    const linrope::testing::ThreadCount threads(linrope::testing::kSplitThreads);
    y_two = gelu<T>(x);
    d_x_two = gelu_backward<T>(x, d_y);
  }
  CHECK((y_one.array() == y_two.array()).all());
  CHECK((d_x_one.array() == d_x_two.array()).all());
}

TEST_CASE_TEMPLATE("gelu and gelu_backward give the same bits at any address", T, float, double) {
  // Each value shifted by 1 to 16 elements lands in another lane of its packet, or a packet tail.
  const Index n = 1000;
  const Vector<double> x = values<T>(n, 8), d_y = gaussian<T>(n, 9);
  const Vector<T> y = gelu<T>(x), d_x = gelu_backward<T>(x, d_y);
  for (Index shift = 1; shift <= 16; ++shift) {
    CAPTURE(shift);
    Vector<T> x_at = Vector<T>::Zero(n + shift), d_y_at = x_at, y_at = x_at, d_x_at = x_at;
    x_at.tail(n) = x.cast<T>();
    d_y_at.tail(n) = d_y.cast<T>();
    linrope::gelu(x_at.tail(n), y_at.tail(n));
    linrope::gelu_backward(x_at.tail(n), d_y_at.tail(n), d_x_at.tail(n));
    CHECK((y_at.tail(n).array() == y.array()).all());
    CHECK((d_x_at.tail(n).array() == d_x.array()).all());
  }
}

TEST_CASE_TEMPLATE("gelu(x) - gelu(-x) = x within the tolerances of both values", T, float,
                   double) {
  // Phi(x) + Phi(-x) = 1: the difference is x exactly, each value within tolerance<T> of its
  // exact one (which the reference gives to double precision).
  const Vector<double> x = values<T>(40000, 10);
  const Vector<T> y = gelu<T>(x), y_neg = gelu<T>(-x);
  double worst = 0;
  for (Index i = 0; i < x.size(); ++i) {
    const double error = std::abs(double(y(i)) - double(y_neg(i)) - x(i));
    const double bound = tolerance<T>(x(i), ref::gelu(x(i))) + tolerance<T>(x(i), ref::gelu(-x(i)));
    worst = std::max(worst, error > 0 ? error / bound : 0.0);
  }
  CAPTURE(worst);
  CHECK(worst <= 1);
}

TEST_CASE_TEMPLATE("gelu and gelu_backward refuse sizes that differ and partly shared memory", T,
                   float, double) {
  using V = Vector<T>;
  using E = std::invalid_argument;
  const V x = V::Ones(5), d_y = V::Ones(5);
  V d_x(5), four(4), six(6);
  REQUIRE_THROWS_WITH_AS(linrope::gelu(x, four), "gelu: y has 4 elements but x has 5", E);
  REQUIRE_THROWS_WITH_AS(linrope::gelu_backward(x, V::Ones(4), d_x),
                         "gelu_backward: d_y has 4 elements but x has 5", E);
  REQUIRE_THROWS_WITH_AS(linrope::gelu_backward(x, d_y, six),
                         "gelu_backward: d_x has 6 elements but x has 5", E);
  // Overlaps of one element and of four are refused, and a refused call writes nothing; the
  // neighbouring segment is fine.
  V buffer = V::Constant(10, T(7));
  for (Index start : {1, 4}) {
    CAPTURE(start);
    REQUIRE_THROWS_WITH_AS(linrope::gelu(buffer.head(5), buffer.segment(start, 5)),
                           "gelu: y partly overlaps x; expected x itself or separate storage", E);
    REQUIRE_THROWS_WITH_AS(
        linrope::gelu_backward(buffer.head(5), d_y, buffer.segment(start, 5)),
        "gelu_backward: d_x partly overlaps x; expected x itself or separate storage", E);
    REQUIRE_THROWS_WITH_AS(
        linrope::gelu_backward(x, buffer.head(5), buffer.segment(start, 5)),
        "gelu_backward: d_x partly overlaps d_y; expected d_y itself or separate storage", E);
  }
  CHECK((buffer.array() == T(7)).all());
  const Vector<double> sevens = Vector<double>::Constant(5, 7.0);
  linrope::gelu(buffer.head(5), buffer.tail(5));
  CHECK((buffer.tail(5).array() == gelu<T>(sevens).array()).all());
  linrope::gelu_backward(buffer.head(5), buffer.head(5), buffer.tail(5));
  CHECK((buffer.tail(5).array() == gelu_backward<T>(sevens, sevens).array()).all());
}

}  // namespace
