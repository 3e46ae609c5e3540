// FeatureMap::backward (include/linrope/feature_maps.hpp): dx = J^T d_out, J the Jacobian of phi
// at x with W held fixed, against central finite differences of the reference formulas
// (tests/reference/feature_map_reference.hpp, evaluated in double), never of the library's apply.
//
// Tolerances. The finite difference of row i's loss L_i(x_i) = sum_l d_out_il phi_l(x_i), taken
// row by row so that its rounding is relative to that row's terms only, errs by
//   truncation h^2/6 |L_i'''| + rounding ~ u_d |terms of L_i| / h      (finite_difference.hpp).
// Inputs are rows of norm 0.6 .. 2 (so 1+cos's 1/|x| and the Favor maps' exponents stay O(1)):
// each derivative of a feature brings a factor |w_lj| d^(-1/4) + |x'_j| or 1/|x|, at most ~3, so
// |L'''| <= ~30 G_i with G_i the gradient's term magnitude below, and the truncation is below
// 1e-10 / 6 * 30 G_i = 5e-10 G_i; the rounding is 1.1e-11 sum_l |d_out_il phi_il|. The tests
// allow 1e-8 G_i + 1e-10 sum_l |d_out_il phi_il|, about 20x and 10x above those.
//
// The library's own error: it evaluates dx_ij = sum_l d_out_il dphi_l/dx_j from rounded features,
// and every term it adds is bounded by the term magnitude G_ij (`term_magnitude` below: the
// absolute values of the pieces of the analytic derivative, e.g. |d_l| phi_l (|w_lj| + |x'_j|)
// d^(-1/4) for favor+, which also bounds a kernel that forms sum_l d_l phi_l w_lj and
// (sum_l d_l phi_l) x'_j separately). The sums have m + d terms, an exp-based feature carries the
// error of its exponent, (d + 2)(|w| |x'| + |x'|^2/2 + ln 2f + 1) u (as test_feature_maps.cpp's
// FavorTolerance), and a few more roundings come from the scalings: so
//   |dx_ij error| <= gamma_i G_ij,  gamma_i = 8 (u_T + u_d)(m + d + 16 + a_i),
// a_i the exponent's error factor (0 for relu and 1+cos, |x| for elu+1's exp(x)), margin 8. A
// missing term or a wrong sign changes dx at O(G), 10^3 (float) to 10^11 (double) times more.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linrope/feature_maps.hpp>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "map_cases.hpp"
#include "reference/feature_map_reference.hpp"
#include "reference/finite_difference.hpp"
#include "reference/random.hpp"
#include "threads.hpp"

namespace {

using namespace linrope;
namespace ref = linrope::reference;
using linrope::testing::favor_features;
using linrope::testing::gaussian;
using linrope::testing::is_favor;
using linrope::testing::kMaps;
using linrope::testing::make_map;

template <class T>
constexpr double kUnit = std::numeric_limits<T>::epsilon() / 2;

// The maps here: seed 11, and f random features for the FAVOR+ maps only.
std::unique_ptr<FeatureMap> make(FeatureMapKind kind, Index d, Index f = 0, bool orthogonal = true,
                                 std::uint64_t seed = 11) {
  return make_map(kind, d, favor_features(kind, f), seed, orthogonal);
}

// phi by the reference formulas, with W = the map's projection (data, not code).
MatrixD reference_phi(FeatureMapKind kind, const MatrixD& w, const MatrixD& x) {
  switch (kind) {
    case FeatureMapKind::EluPlusOne:
      return ref::elu_plus_one(x);
    case FeatureMapKind::Relu:
      return ref::relu(x);
    case FeatureMapKind::OnePlusCosine:
      return ref::one_plus_cosine(x);
    case FeatureMapKind::FavorPositive:
      return ref::favor_positive(w, x);
    case FeatureMapKind::FavorTrig:
      return ref::favor_trig(w, x);
    case FeatureMapKind::FavorHyperbolic:
      return ref::favor_hyperbolic(w, x);
  }
  return {};
}

// The finite-difference gradient of sum(d_out .* phi(x)), one row at a time.
MatrixD finite_difference_backward(FeatureMapKind kind, const MatrixD& w, const MatrixD& x,
                                   const MatrixD& d_out) {
  MatrixD dx(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i) {
    const MatrixD d_row = d_out.row(i);
    dx.row(i) = ref::central_difference(MatrixD(x.row(i)), [&](const MatrixD& xi) {
      return ref::weighted_sum(d_row, reference_phi(kind, w, xi));
    });
  }
  return dx;
}

// G [n x d]: the magnitude of the terms of dx_ij (see the header comment), and a [n]: the
// exponent's error factor of each row.
struct Magnitudes {
  MatrixD terms;
  Eigen::VectorXd exponent;
  Eigen::VectorXd loss_terms;  // sum_l |d_out_il phi_il|, the size of row i's loss
};

Magnitudes term_magnitude(FeatureMapKind kind, const MatrixD& w, const MatrixD& x,
                          const MatrixD& d_out) {
  const Index n = x.rows(), d = x.cols();
  Magnitudes g;
  g.terms = MatrixD::Zero(n, d);
  g.exponent = Eigen::VectorXd::Zero(n);
  g.loss_terms = (d_out.array() * reference_phi(kind, w, x).array()).abs().rowwise().sum();
  const double s = std::pow(double(d), -0.25);
  for (Index i = 0; i < n; ++i) {
    switch (kind) {
      case FeatureMapKind::EluPlusOne:
        for (Index j = 0; j < d; ++j)
          g.terms(i, j) = std::abs(d_out(i, j)) * (x(i, j) > 0 ? 1.0 : std::exp(x(i, j)));
        g.exponent(i) = x.row(i).cwiseAbs().maxCoeff();
        break;
      case FeatureMapKind::Relu:
        for (Index j = 0; j < d; ++j) g.terms(i, j) = x(i, j) > 0 ? std::abs(d_out(i, j)) : 0.0;
        break;
      case FeatureMapKind::OnePlusCosine: {
        // dx = (d_1..d - (d . u) u) / |x|, u = x / |x|.
        const double norm = x.row(i).norm();
        if (norm == 0) break;
        double du = 0;
        for (Index j = 0; j < d; ++j) du += std::abs(d_out(i, j) * x(i, j)) / norm;
        for (Index j = 0; j < d; ++j)
          g.terms(i, j) = (std::abs(d_out(i, j)) + du * std::abs(x(i, j)) / norm) / norm;
        break;
      }
      default: {
        const Index f = w.rows();
        const ref::FavorRow r = ref::favor_row(w, x, i);
        const double xs = x.row(i).norm() * s;
        g.exponent(i) = double(d + 2) *
                        (w.rowwise().norm().maxCoeff() * xs + r.h + std::log(2.0 * double(f)) + 1);
        for (Index l = 0; l < f; ++l) {
          // |d phi_l / d x_j| pieces, times |d_out|; summed over the features of both halves.
          double weight = 0;
          if (kind == FeatureMapKind::FavorPositive) {
            weight = std::abs(d_out(i, l)) * std::exp(r.u[l] - r.h) / std::sqrt(double(f));
          } else if (kind == FeatureMapKind::FavorHyperbolic) {
            weight = (std::abs(d_out(i, l)) * std::exp(r.u[l] - r.h) +
                      std::abs(d_out(i, f + l)) * std::exp(-r.u[l] - r.h)) /
                     std::sqrt(2.0 * double(f));
          } else {  // trig: the envelope exp(h) / sqrt(f) on both sin and cos, and on their
                    // derivatives
            weight = (std::abs(d_out(i, l)) + std::abs(d_out(i, f + l))) * std::exp(r.h) /
                     std::sqrt(double(f));
          }
          for (Index j = 0; j < d; ++j)
            g.terms(i, j) += weight * (std::abs(w(l, j)) + std::abs(x(i, j)) * s) * s;
        }
      }
    }
  }
  return g;
}

template <class T>
double gamma(Index m, Index d, double exponent) {
  return 8 * (kUnit<T> + kUnit<double>)*(double(m + d + 16) + exponent);
}

// Compares got (precision T) with the finite differences of the reference, row by row:
// |got_ij - fd_ij| <= gamma_i G_ij + 1e-8 max_j G_ij + 1e-10 |terms of L_i| + absolute.
// `absolute` covers results below T's normal range (float's exp flushes them towards 0).
template <class T>
void check_against_finite_differences(const FeatureMap& map, const MatrixD& x, const MatrixD& d_out,
                                      const Matrix<T>& got, double absolute = 0) {
  const MatrixD w = map.projection();
  const MatrixD want = finite_difference_backward(map.kind(), w, x, d_out);
  const Magnitudes g = term_magnitude(map.kind(), w, x, d_out);
  REQUIRE(got.rows() == x.rows());
  REQUIRE(got.cols() == x.cols());
  Index failed = 0;
  double worst_ratio = 0, worst_error = 0, worst_tol = 0;
  Index worst_i = -1, worst_j = -1;
  for (Index i = 0; i < x.rows(); ++i) {
    const double gam = gamma<T>(map.output_dim(), x.cols(), g.exponent(i));
    const double row_scale = g.terms.row(i).maxCoeff();
    for (Index j = 0; j < x.cols(); ++j) {
      const double tol =
          gam * g.terms(i, j) + 1e-8 * row_scale + 1e-10 * g.loss_terms(i) + absolute;
      const double error = std::abs(double(got(i, j)) - want(i, j));
      const double ratio = tol > 0 ? error / tol : (error > 0 ? 1e300 : 0);
      if (!(error <= tol)) ++failed;
      if (std::isnan(error) || ratio > worst_ratio) {
        worst_ratio = std::isnan(error) ? 1e300 : ratio;
        worst_error = error;
        worst_tol = tol;
        worst_i = i;
        worst_j = j;
      }
    }
  }
  INFO("worst entry (", worst_i, ", ", worst_j, "): |error| = ", worst_error, ", tolerance ",
       worst_tol, ", ratio ", worst_ratio);
  CHECK(failed == 0);
}

// n x d inputs, N(0, 1) directions with row norms cycling through 0.6, 1, 1.5, 2 (see the header),
// then every entry nudged away from 0 by at least 1e-3 (>> h = 1e-5): relu's kink and elu's
// second-derivative jump stay outside the finite differences' reach.
MatrixD inputs(Index n, Index d, std::uint64_t seed) {
  MatrixD x = gaussian(n, d, seed);
  const double norms[] = {0.6, 1.0, 1.5, 2.0};
  for (Index i = 0; i < n; ++i) {
    const double norm = x.row(i).norm();
    x.row(i) *= norms[i % 4] / (norm > 0 ? norm : 1.0);
    for (Index j = 0; j < d; ++j)
      if (std::abs(x(i, j)) < 1e-3) x(i, j) = x(i, j) < 0 ? -1e-3 : 1e-3;
  }
  return x;
}

template <class T>
Matrix<T> backward(const FeatureMap& map, const Matrix<T>& x, const Matrix<T>& d_out) {
  Matrix<T> dx(x.rows(), x.cols());
  dx.setConstant(T(-7));  // every entry must be written
  map.backward(x, d_out, dx);
  return dx;
}

// Runs one map at one shape in precision T: inputs and d_out rounded to T, the reference on
// exactly those rounded values.
template <class T>
void check_map(const FeatureMap& map, Index n, std::uint64_t seed) {
  const Index d = map.input_dim(), m = map.output_dim();
  const Matrix<T> x = inputs(n, d, seed).cast<T>();
  const Matrix<T> d_out = gaussian(n, m, seed + 1).cast<T>();
  const Matrix<T> dx = backward<T>(map, x, d_out);
  check_against_finite_differences<T>(map, x.template cast<double>(), d_out.template cast<double>(),
                                      dx);
}

}  // namespace

TEST_CASE_TEMPLATE("FeatureMap::backward matches finite differences: every map, odd d, n = 1", T,
                   float, double) {
  // d = 1, 2, 5 (odd), 8; f = d + 3 (the last orthogonal block cut; odd m for favor+ at even d)
  // and, at d = 8, f = 3 < d; orthogonal and iid W.
  for (const FeatureMapKind kind : kMaps)
    for (const Index d : {1, 2, 5, 8})
      for (const Index f : {d + 3, Index(3)})
        for (const bool orthogonal : {true, false}) {
          if (!is_favor(kind) && (!orthogonal || f != d + 3)) continue;
          if (f == 3 && d != 8) continue;
          const std::string name = to_string(kind);
          CAPTURE(name);
          CAPTURE(d);
          CAPTURE(f);
          CAPTURE(orthogonal);
          const auto map = make(kind, d, f, orthogonal);
          for (const Index n : {1, 7}) {
            CAPTURE(n);
            check_map<T>(*map, n, std::uint64_t(100 * d + n + (orthogonal ? 0 : 50)));
          }
        }
}

TEST_CASE("W is held fixed: after a redraw the gradient follows the new projection") {
  for (const FeatureMapKind kind : {FeatureMapKind::FavorPositive, FeatureMapKind::FavorTrig,
                                    FeatureMapKind::FavorHyperbolic}) {
    const std::string name = to_string(kind);
    CAPTURE(name);
    auto map = make(kind, 6, 9);
    const MatrixD before = map->projection();
    map->redraw(12345);
    REQUIRE(map->projection() != before);
    check_map<double>(*map, 5, 77);
  }
}

TEST_CASE("float backward agrees with double backward on the same rounded inputs") {
  // Each is within gamma_T G of the exact gradient (header comment), so they differ by at most
  // (gamma_float + gamma_double) G; n = 65 and d = 16 with f = 40 go past any vector width.
  for (const FeatureMapKind kind : kMaps) {
    const std::string name = to_string(kind);
    CAPTURE(name);
    const Index n = 65, d = 16;
    const auto map = make(kind, d, 40);
    const MatrixF xf = inputs(n, d, 5).cast<float>();
    const MatrixF df = gaussian(n, map->output_dim(), 6).cast<float>();
    const MatrixD x = xf.cast<double>(), d_out = df.cast<double>();
    const MatrixF got_f = backward<float>(*map, xf, df);
    const MatrixD got_d = backward<double>(*map, x, d_out);
    const Magnitudes g = term_magnitude(kind, map->projection(), x, d_out);
    Index failed = 0;
    for (Index i = 0; i < n; ++i) {
      const double gam = gamma<float>(map->output_dim(), d, g.exponent(i)) +
                         gamma<double>(map->output_dim(), d, g.exponent(i));
      for (Index j = 0; j < d; ++j)
        failed += !(std::abs(double(got_f(i, j)) - got_d(i, j)) <= gam * g.terms(i, j));
    }
    CHECK(failed == 0);
  }
}

TEST_CASE("special points: relu at 0 gives 0, elu+1 at 0 gives 1, 1+cos at x = 0 gives 0") {
  const MatrixD d_out_5 = gaussian(3, 5, 21);
  SUBCASE("relu and elu+1 at exactly 0, beside entries of both signs") {
    MatrixD x = gaussian(3, 5, 20);
    x(0, 1) = 0;
    x(1, 3) = 0;
    x(2, 0) = -0.0;
    for (const FeatureMapKind kind : {FeatureMapKind::Relu, FeatureMapKind::EluPlusOne}) {
      const std::string name = to_string(kind);
      CAPTURE(name);
      const auto map = make(kind, 5);
      const MatrixD dx = backward<double>(*map, x, d_out_5);
      const MatrixF dxf = backward<float>(*map, x.cast<float>(), d_out_5.cast<float>());
      const double slope = kind == FeatureMapKind::Relu ? 0.0 : 1.0;
      for (const std::pair<Index, Index>& zero : {std::pair<Index, Index>{0, 1}, {1, 3}, {2, 0}}) {
        const Index i = zero.first, j = zero.second;
        CAPTURE(i);
        CAPTURE(j);
        CHECK(dx(i, j) == slope * d_out_5(i, j));
        CHECK(dxf(i, j) == float(slope * d_out_5(i, j)));
      }
      // Away from 0: relu passes d_out where x > 0 and blocks it where x < 0, exactly; elu+1
      // passes it where x > 0 and multiplies by exp(x) where x < 0 (a few ulp).
      for (Index i = 0; i < 3; ++i)
        for (Index j = 0; j < 5; ++j) {
          if (x(i, j) == 0) continue;
          if (x(i, j) > 0) {
            CHECK(dx(i, j) == d_out_5(i, j));
          } else if (kind == FeatureMapKind::Relu) {
            CHECK(dx(i, j) == 0);
          } else {
            CHECK(std::abs(dx(i, j) - d_out_5(i, j) * std::exp(x(i, j))) <=
                  4 * kUnit<double> * std::abs(d_out_5(i, j)));
          }
        }
    }
  }
  SUBCASE("1+cos: a zero row gets a zero gradient, the other rows x/|x|'s") {
    const auto map = make(FeatureMapKind::OnePlusCosine, 4);
    MatrixD x = inputs(3, 4, 22);
    x.row(1).setZero();
    const MatrixD d_out = gaussian(3, 5, 23);
    const MatrixD dx = backward<double>(*map, x, d_out);
    const MatrixF dxf = backward<float>(*map, x.cast<float>(), d_out.cast<float>());
    CHECK(dx.row(1).isZero(0));
    CHECK(dxf.row(1).isZero(0));
    REQUIRE(dx.allFinite());
    REQUIRE(dxf.allFinite());
    // The other rows against finite differences (the zero row, where x/|x| has no derivative, is
    // left out).
    MatrixD x2(2, 4), d2(2, 5), g2(2, 4);
    x2 << x.row(0), x.row(2);
    d2 << d_out.row(0), d_out.row(2);
    g2 << dx.row(0), dx.row(2);
    check_against_finite_differences<double>(*map, x2, d2, g2);
    // The constant feature has no dependence on x: d_out's last column alone gives 0.
    MatrixD last_only = MatrixD::Zero(3, 5);
    last_only.col(4).setConstant(3.0);
    CHECK(backward<double>(*map, x, last_only).isZero(0));
    // Radial directions do not change x/|x|: dx is orthogonal to x (d_out = x itself gives 0).
    MatrixD radial = MatrixD::Zero(3, 5);
    radial.leftCols(4) = x;
    const MatrixD dr = backward<double>(*map, x, radial);
    CHECK(dr.cwiseAbs().maxCoeff() <= 16 * kUnit<double> * x.cwiseAbs().maxCoeff());
  }
  SUBCASE("1+cos with d = 1: x/|x| = sign(x) is constant, so the gradient is 0") {
    const auto map = make(FeatureMapKind::OnePlusCosine, 1);
    MatrixD x(4, 1);
    x << 0.3, -2.0, 0.0, 1e-200;
    const MatrixD d_out = gaussian(4, 2, 24);
    CHECK(backward<double>(*map, x, d_out).isZero(0));
  }
}

TEST_CASE("large-norm float inputs give finite gradients that match the reference") {
  // Rows of norm 20, 50, 100 in float, d = 16, f = 40. The exact gradients of favor+ and
  // favor-hyp are tiny (phi ~ exp(|w||x'| - |x'|^2/2), |x'|^2/2 = 50, 312, 1250), so a kernel
  // that forms exp(W x') and exp(-|x'|^2/2) apart overflows to inf * 0 = NaN; they must come out
  // finite and match. elu+1, relu and 1+cos are finite at any norm. favor-trig's exact gradient
  // carries exp(|x'|^2/2): 5e21 at norm 20 (finite in float), beyond float's range (exp(312)) at
  // norm 50, so only norm 20 is asked of it.
  // Tolerance as everywhere (the exponent's error factor a_i grows with the norm: at norm 100
  // gamma ~ 1e-2 relative, still far below an O(1) error), plus, for results below float's normal
  // range, f features flushed to 0 or subnormal, each contributing up to FLT_MIN |d_out| (|w| +
  // |x'|) d^(-1/4) (x 4).
  const Index d = 16, f = 40, n = 6;
  for (const FeatureMapKind kind : kMaps)
    for (const double norm : {20.0, 50.0, 100.0}) {
      if (kind == FeatureMapKind::FavorTrig && norm > 20) continue;
      const std::string name = to_string(kind);
      CAPTURE(name);
      CAPTURE(norm);
      const auto map = make(kind, d, f, true, 3);
      MatrixD xd = gaussian(n, d, std::uint64_t(norm) + 1);
      for (Index i = 0; i < n; ++i) xd.row(i) *= norm / xd.row(i).norm();
      const MatrixF x = xd.cast<float>();
      const MatrixF d_out = gaussian(n, map->output_dim(), 31).cast<float>();
      const MatrixF dx = backward<float>(*map, x, d_out);
      CHECK(dx.allFinite());
      double absolute = 0;
      if (is_favor(kind)) {
        const double wmax = map->projection().rowwise().norm().maxCoeff();
        const double xs = norm * std::pow(double(d), -0.25);
        absolute = 4 * double(f) * d_out.cwiseAbs().maxCoeff() * (wmax + xs) *
                   std::pow(double(d), -0.25) * double(std::numeric_limits<float>::min());
      }
      check_against_finite_differences<float>(*map, x.cast<double>(), d_out.cast<double>(), dx,
                                              absolute);
    }
}

TEST_CASE("elu+1 far below 0 in float: exp(x) down to the subnormals, finite") {
  // elu+1's derivative at x < 0 is its feature exp(x), from the forward's packet exp: a few ulp
  // above 2^-126, and below it the slack test_feature_maps.cpp documents for that exp (2^-150 with
  // AVX-512; the portable build's Eigen exp clamps x at -88.7 and returns ~2.9e-39 < 2^-126).
#if defined(__AVX512F__)
  const double subnormal_slack = 0x1.0p-150;
#else
  const double subnormal_slack = 0x1.0p-126;
#endif
  const auto map = make(FeatureMapKind::EluPlusOne, 4);
  MatrixF x(1, 4);
  x << -80.0f, -100.0f, -104.0f, -200.0f;  // exp: 1.8e-35, 3.7e-44 (subnormal), 0 in float
  const MatrixF d_out = MatrixF::Ones(1, 4);
  const MatrixF dx = backward<float>(*map, x, d_out);
  CHECK(dx.allFinite());
  for (Index j = 0; j < 4; ++j) {
    CAPTURE(j);
    const double want = std::exp(double(x(0, j)));
    CHECK(std::abs(double(dx(0, j)) - want) <= 4 * kUnit<float> * want + subnormal_slack);
    CHECK(dx(0, j) >= 0);
  }
}

TEST_CASE("many rows over threads: blocks of rows, same bits for 1 and 2 threads") {
  // n = 700 is past any row block the public calls cut for a parallel region; every row against
  // the finite differences, and the thread count must not change a bit (the maps' cut of the
  // work depends on the shapes only: attention.hpp, "Reproducibility").
  for (const FeatureMapKind kind : kMaps) {
    const std::string name = to_string(kind);
    CAPTURE(name);
    const auto map = make(kind, 8, 13);
    const MatrixD x = inputs(700, 8, 40);
    const MatrixD d_out = gaussian(700, map->output_dim(), 41);
    MatrixD one, two;
    {
      const linrope::testing::ThreadCount threads(1);
      one = backward<double>(*map, x, d_out);
    }
    {
      const linrope::testing::ThreadCount threads(linrope::testing::kSplitThreads);
      two = backward<double>(*map, x, d_out);
    }
    CHECK(one == two);
    check_against_finite_differences<double>(*map, x, d_out, two);
  }
}

TEST_CASE("strided views: blocks of larger matrices are read and written within their bounds") {
  for (const FeatureMapKind kind : kMaps) {
    const std::string name = to_string(kind);
    CAPTURE(name);
    const Index n = 9, d = 5;
    const auto map = make(kind, d, 7);
    const Index m = map->output_dim();
    const MatrixD x_big = inputs(n + 2, d + 3, 50), d_big = gaussian(n + 1, m + 2, 51);
    MatrixD dx_big = MatrixD::Constant(n + 3, d + 4, 42.0);
    const MatrixD before = dx_big;
    map->backward(x_big.block(1, 2, n, d), d_big.block(1, 1, n, m), dx_big.block(2, 3, n, d));
    MatrixD outside = dx_big - before;
    outside.block(2, 3, n, d).setZero();
    CHECK(outside.isZero(0));  // nothing written outside the view
    const MatrixD x = x_big.block(1, 2, n, d), d_out = d_big.block(1, 1, n, m);
    const MatrixD got = dx_big.block(2, 3, n, d);
    CHECK(got == backward<double>(*map, x, d_out));
    check_against_finite_differences<double>(*map, x, d_out, got);
  }
}

TEST_CASE("FeatureMap::backward rejects bad input, naming the argument") {
  using doctest::Contains;
  for (const FeatureMapKind kind : kMaps) {
    const std::string name = to_string(kind);
    CAPTURE(name);
    const auto map = make(kind, 4, 6);
    const Index m = map->output_dim();
    MatrixD x = MatrixD::Ones(3, 4), d_out = MatrixD::Ones(3, m), dx = MatrixD::Zero(3, 4);
    {
      const MatrixD wide = MatrixD::Ones(3, 5);
      MatrixD dx5 = MatrixD::Zero(3, 5);
      CHECK_THROWS_WITH_AS(map->backward(wide, d_out, dx5),
                           Contains("FeatureMap::backward: x is [3 x 5] but input_dim is 4"),
                           std::invalid_argument);
    }
    {
      const MatrixD short_d = MatrixD::Ones(3, m - 1), tall_d = MatrixD::Ones(4, m);
      const std::string message = "FeatureMap::backward: d_out is [3 x " + std::to_string(m - 1) +
                                  "] but expected [3 x " + std::to_string(m) + "]";
      CHECK_THROWS_WITH_AS(map->backward(x, short_d, dx), Contains(message.c_str()),
                           std::invalid_argument);
      CHECK_THROWS_WITH_AS(map->backward(x, tall_d, dx),
                           Contains("FeatureMap::backward: d_out is [4 x"), std::invalid_argument);
    }
    {
      MatrixD dx_short = MatrixD::Zero(2, 4);
      MatrixF dxf_wide = MatrixF::Zero(3, 5);
      CHECK_THROWS_WITH_AS(map->backward(x, d_out, dx_short),
                           Contains("FeatureMap::backward: dx is [2 x 4] but expected [3 x 4]"),
                           std::invalid_argument);
      CHECK_THROWS_WITH_AS(map->backward(MatrixF::Ones(3, 4), MatrixF::Ones(3, m), dxf_wide),
                           Contains("FeatureMap::backward: dx is [3 x 5] but expected [3 x 4]"),
                           std::invalid_argument);
    }
    {
      MatrixD bad = d_out;
      bad(1, 2) = std::numeric_limits<double>::quiet_NaN();
      CHECK_THROWS_WITH_AS(
          map->backward(x, bad, dx),
          Contains("FeatureMap::backward: d_out has the non-finite value nan at row 1, column 2"),
          std::invalid_argument);
      MatrixF badf = MatrixF::Ones(3, m);
      badf(2, 0) = -std::numeric_limits<float>::infinity();
      MatrixF dxf = MatrixF::Zero(3, 4);
      CHECK_THROWS_WITH_AS(map->backward(MatrixF::Ones(3, 4), badf, dxf),
                           Contains("d_out has the non-finite value -inf at row 2, column 0"),
                           std::invalid_argument);
      MatrixD bad_x = x;
      bad_x(0, 3) = std::numeric_limits<double>::infinity();
      CHECK_THROWS_WITH_AS(
          map->backward(bad_x, d_out, dx),
          Contains("FeatureMap::backward: x has the non-finite value inf at row 0, column 3"),
          std::invalid_argument);
    }
    {
      // dx may overlap neither x nor d_out, not even exactly in place for the element-wise maps.
      // (Storage is compared by address range, so the other argument lives in its own matrix.)
      MatrixD x_buffer = inputs(3, 8, 60), d_buffer = gaussian(3, m + 4, 61);
      const MatrixD x_before = x_buffer, d_before = d_buffer;
      const MatrixD separate_d = gaussian(3, m, 62), separate_x = inputs(3, 4, 63);
      CHECK_THROWS_WITH_AS(map->backward(x_buffer.leftCols(4), separate_d, x_buffer.leftCols(4)),
                           Contains("FeatureMap::backward: dx overlaps x"), std::invalid_argument);
      CHECK_THROWS_WITH_AS(
          map->backward(x_buffer.leftCols(4), separate_d, x_buffer.middleCols(2, 4)),
          Contains("FeatureMap::backward: dx overlaps x"), std::invalid_argument);
      CHECK_THROWS_WITH_AS(
          map->backward(separate_x, d_buffer.leftCols(m), d_buffer.middleCols(m, 4)),
          Contains("FeatureMap::backward: dx overlaps d_out"), std::invalid_argument);
      CHECK_THROWS_WITH_AS(map->backward(separate_x, d_buffer.leftCols(m), d_buffer.leftCols(4)),
                           Contains("FeatureMap::backward: dx overlaps d_out"),
                           std::invalid_argument);
      CHECK(x_buffer == x_before);  // a rejected call writes nothing
      CHECK(d_buffer == d_before);
    }
    // Zero rows: nothing to do, nothing thrown.
    const MatrixD none(0, 4), none_d(0, m);
    MatrixD none_dx(0, 4);
    CHECK_NOTHROW(map->backward(none, none_d, none_dx));
    CHECK(dx.isZero(0));  // no rejected call above wrote into dx
  }
}
