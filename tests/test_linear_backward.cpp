// linear_attention_backward (include/linrope/attention.hpp, "Gradients"; batched.hpp) against
// central finite differences of the naive reference forward (tests/reference/linear_reference.hpp:
// explicit rotation matrices, explicit n x n_k weights, features by the reference formulas), never
// of the library's forward; plus the properties a causal gradient must have, batched against
// per-head, long sequences split across threads against a double backward, and bad input.
//
// Tolerances. With D_i = den_i + eps, g_i = d_out_i / D_i and c_i = <d_out_i, o_i> / D_i, the
// gradient of L = sum(d_out .* o) is
//   dv_j = sum_i A_ij g_i,
//   dq_i = sum_j <g_i, v_j> dA_ij/dq_i - c_i dB_ij/dq_i,   dk_j likewise over i,
// (A, B the numerator and denominator weights of the placement table). A kernel in precision T
// adds up terms whose sizes the reference bounds entry by entry (`gradient_bounds`, G below):
//   - dA_ij/dq_i = J_i^T (R_i^T R_j psi_j) (NumeratorOnly, Full), J_i^T psi_j (None), or
//     R_i^T J_i^T psi_j with J_i taken at R_i q_i (BeforeMap, bounded by |J_i| |R_i|); |J_i| is
//     bounded term by term by the analytic pieces of the map's Jacobian (`jacobian_magnitude`),
//     and R_i^T R_j = g^2 x a rotation (g = YaRN's magnitude) pair by pair by g^2 (|a| + |b|);
//   - |<g_i, v_j>| <= |d_out_i|_1 |v_j|_inf / |D_i| and |c_i| <= |d_out_i|_1 |o_i|_inf / |D_i|;
//   - dv's terms |A_ij| |d_out_i| / |D_i| <= M_ij |d_out_i| / |D_i| (M the reference's bound).
// Each term errs by gamma relative, gamma = the forward's rounding_gamma (m + d + n_k + 16 + 2 z
// roundings, z the exp-argument size, margin 8: tests/test_linear_attention.cpp); the row's
// shared 1/D_i errs by gamma cond_i relative, cond_i = (D_i^mag + eps) / |D_i|, and o_i (inside
// c_i) by the forward's bound gamma (N_i / |D_i| + cond_i |o_i|) (N_i, D_i^mag the reference's num
// and den magnitudes). First order, per row i:
//   <g_i, v_j> terms  x |d_out_i|_1 |v_j|_inf (2 + cond_i) / |D_i|
//   c_i terms         x |d_out_i|_1 (N_i / |D_i| + (2 + 2 cond_i) |o_i|_inf) / |D_i|
//   dv terms          x M_ij |d_out_i| (2 + cond_i) / |D_i|
// and |gradient error| <= gamma G with G those magnitudes summed over the admissible pairs.
// A problem where some row has |D_i| <= 2 gamma (D_i^mag + eps) is ill-conditioned at precision T
// (not even the sign of D_i is determined); its comparison is skipped and counted (few allowed).
// G sums absolute values over keys, features and the Jacobian's pieces, so it sits 10^2 - 10^3
// above |gradient| (more for n = 1, where dq and dk cancel to ~eps, and for Full or favor-trig
// with eps = 0, cond up to ~100): float checks are then ~1e-3 - 1e-2 relative (an O(1) bug still
// shows), double ones ~1e-8 (limited by the finite differences) and carry the fine detail: both
// precisions run the same templates.
//
// Finite differences (tests/reference/finite_difference.hpp, h = 1e-5): their error is estimated
// entry by entry (`finite_differences`): the truncation by |FD_2h - FD_h| (3x the h estimate's,
// whose error is c h^2 + O(h^4)), plus rounding 4 (m + d + n_k + 16) u_d S / h with S the size of
// the loss's terms. Measured over the sweep, the double kernels use at most ~1% of that
// allowance and the float ones at most ~1/3 of theirs.
//
// Long sequences (n = 600 - 1200, split across threads) are compared with the double backward on
// one thread: both within gamma G of the exact gradient, so within (gamma_T + gamma_double) G.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <linrope/linrope.hpp>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "linear_cases.hpp"
#include "map_cases.hpp"
#include "reference/finite_difference.hpp"
#include "reference/linear_reference.hpp"
#include "reference/random.hpp"
#include "threads.hpp"

namespace {

using namespace linrope;
namespace ref = linrope::reference;
using linrope::testing::favor_features;
using linrope::testing::gaussian;
using linrope::testing::kMaps;
using linrope::testing::kPlacements;
using linrope::testing::kSplitThreads;
using linrope::testing::make_map;
using linrope::testing::placement_rope;
using linrope::testing::reference_spec;
using linrope::testing::ThreadCount;
using ref::VectorD;

constexpr double kUnitDouble = std::numeric_limits<double>::epsilon() / 2;

// A causal method and chunk size. Non-causal calls run once (the method is ignored).
struct Method {
  CausalMethod method;
  Index chunk;
};
// Scan, and Chunked with chunks of 1, 2, 3 and one longer than any sequence here.
const std::vector<Method> kCausalMethods = {{CausalMethod::Scan, 64},
                                            {CausalMethod::Chunked, 1},
                                            {CausalMethod::Chunked, 2},
                                            {CausalMethod::Chunked, 3},
                                            {CausalMethod::Chunked, 1000}};

struct Problem {
  FeatureMapKind kind = FeatureMapKind::EluPlusOne;
  RopePlacement placement = RopePlacement::None;
  bool causal = false;
  Index n = 7, n_k = 7, d = 5, d_v = 3;
  Index features = -1;  // Favor maps' f; -1: d + 2
  Index q_offset = 0, k_offset = 0;
  double eps = 1e-6;
  RopeLayout layout = RopeLayout::Interleaved;
  bool partial = false;  // rotary width two less than the largest even width
  bool yarn = false;     // YaRN (s = 8, L = 256): kept, ramped and interpolated pairs, g = 1.21
  double scale = 0.7;    // standard deviation of q and k
  double v_mean = 0;     // added to every v entry
  std::uint64_t seed = 1;
};

// Everything a comparison needs: the map, the rope, the options, and inputs (double matrices
// holding float-representable values, so that the float and double kernels and the reference
// all see the same numbers).
struct Setup {
  explicit Setup(const Problem& problem) : p(problem) {
    map = make_map(p.kind, p.d, favor_features(p.kind, p.features > 0 ? p.features : p.d + 2), 7);
    m = map->output_dim();
    if (p.placement != RopePlacement::None) {
      RopeConfig rc = placement_rope(p.placement, p.d, m, p.partial);
      rc.layout = p.layout;
      if (p.yarn)
        rc.scaling = {.kind = RopeScalingKind::Yarn, .factor = 8, .original_max_position = 256};
      rope.emplace(rc);
      spec = ref::rope_spec(rc);
    }
    q = as_float(gaussian(p.n, p.d, p.seed, p.scale));
    k = as_float(gaussian(p.n_k, p.d, p.seed + 1, p.scale));
    v = as_float((gaussian(p.n_k, p.d_v, p.seed + 2).array() + p.v_mean).matrix());
    d_out = as_float(gaussian(p.n, p.d_v, p.seed + 3));
    options.causal = p.causal;
    options.placement = p.placement;
    options.rope = rope ? &*rope : nullptr;
    options.eps = p.eps;
    options.q_offset = p.q_offset;
    options.k_offset = p.k_offset;
    phi = ref::feature_formula(*map);
  }
  Setup(const Setup&) = delete;  // options.rope points into this object

  static MatrixD as_float(const MatrixD& x) { return x.cast<float>().cast<double>(); }

  ref::LinearResult reference(const MatrixD& qq, const MatrixD& kk, const MatrixD& vv) const {
    return ref::linear_attention(qq, kk, vv, phi, reference_spec(options, spec));
  }
  ref::LinearResult reference() const { return reference(q, k, v); }
  double loss(const MatrixD& qq, const MatrixD& kk, const MatrixD& vv) const {
    return ref::weighted_sum(d_out, reference(qq, kk, vv).out);
  }

  template <class T>
  AttentionGradients<T> run(Method method = {CausalMethod::Scan, 64}) const {
    LinearOptions o = options;
    o.method = method.method;
    o.chunk_size = method.chunk;
    return linear_attention_backward(Matrix<T>(q.cast<T>()), Matrix<T>(k.cast<T>()),
                                     Matrix<T>(v.cast<T>()), Matrix<T>(d_out.cast<T>()), *map, o);
  }

  Problem p;
  std::unique_ptr<FeatureMap> map;
  Index m = 0;
  std::optional<Rope> rope;
  std::optional<ref::RopeSpec> spec;
  MatrixD q, k, v, d_out;
  LinearOptions options;
  ref::FeatureFn phi;
};

// Finite-difference gradients and, entry by entry, a bound on their own error (the header).
struct Gradients {
  MatrixD dq, dk, dv;
  MatrixD error_q, error_k, error_v;
};

// Central differences with steps h and 2h: the truncation error of the h estimate is c h^2 + O(h^4)
// and that of the 2h one 4 c h^2, so |FD_2h - FD_h| = 3 |c| h^2 bounds the h estimate's
// truncation with a factor 3 to spare. Rounding: the reference evaluates L with about
// m + d + n_k + 16 roundings of the size S = sum_i |d_out_i|_1 (N_i + |o_i|_inf (D_i^mag + eps)) /
// |D_i| of its terms, which the difference quotient divides by 2h: 4 (m + d + n_k + 16) u_d S / h
// (x4), the same for every entry.
Gradients finite_differences(const Setup& s) {
  constexpr double h = ref::kFiniteDifferenceStep;
  const auto both = [&](const MatrixD& x, const auto& loss, MatrixD& gradient, MatrixD& error) {
    gradient = ref::central_difference(x, loss, h);
    error = (ref::central_difference(x, loss, 2 * h) - gradient).cwiseAbs();
  };
  Gradients g;
  both(
      s.q, [&](const MatrixD& x) { return s.loss(x, s.k, s.v); }, g.dq, g.error_q);
  both(
      s.k, [&](const MatrixD& x) { return s.loss(s.q, x, s.v); }, g.dk, g.error_k);
  both(
      s.v, [&](const MatrixD& x) { return s.loss(s.q, s.k, x); }, g.dv, g.error_v);
  const ref::LinearResult r = s.reference();
  double size = 0;
  for (Index i = 0; i < r.den.size(); ++i) {
    const double den = std::abs(r.den(i) + s.p.eps);
    if (r.admissible[std::size_t(i)] == 0 || den == 0) continue;
    const double o = r.out.cols() > 0 ? r.out.row(i).cwiseAbs().maxCoeff() : 0.0;
    size += s.d_out.row(i).cwiseAbs().sum() *
            (r.num_magnitude(i) + o * (r.den_magnitude(i) + s.p.eps)) / den;
  }
  const double rounding = 4 * double(s.m + s.p.d + s.k.rows() + 16) * kUnitDouble * size / h;
  for (MatrixD* e : {&g.error_q, &g.error_k, &g.error_v}) e->array() += rounding;
  return g;
}

// |J|*: [m x d], entry (l, j) bounds the terms of d phi_l / d x_j at the row x (the analytic
// pieces of each map's derivative, in absolute value):
//   elu+1 exp(min(x_j, 0)) on the diagonal; relu [x_j > 0] on the diagonal;
//   1+cos (delta_lj + |u_l| |u_j|) / |x| for l < d (u = x/|x|), 0 for the constant feature;
//   favor+ and favor-hyp phi_l (|w_lj| + |x'_j|) d^(-1/4); favor-trig the envelope
//   exp(|x'|^2/2)/sqrt(f) in place of phi_l, for the sin and the cos feature.
MatrixD jacobian_magnitude(FeatureMapKind kind, const MatrixD& w, const MatrixD& x) {
  const Index d = x.cols();
  switch (kind) {
    case FeatureMapKind::EluPlusOne: {
      MatrixD j = MatrixD::Zero(d, d);
      for (Index c = 0; c < d; ++c) j(c, c) = std::exp(std::min(x(0, c), 0.0));
      return j;
    }
    case FeatureMapKind::Relu: {
      MatrixD j = MatrixD::Zero(d, d);
      for (Index c = 0; c < d; ++c) j(c, c) = x(0, c) > 0 ? 1.0 : 0.0;
      return j;
    }
    case FeatureMapKind::OnePlusCosine: {
      MatrixD j = MatrixD::Zero(d + 1, d);
      const double norm = x.norm();
      if (norm == 0) return j;
      for (Index l = 0; l < d; ++l)
        for (Index c = 0; c < d; ++c)
          j(l, c) = ((l == c ? 1.0 : 0.0) + std::abs(x(0, l) * x(0, c)) / (norm * norm)) / norm;
      return j;
    }
    default: {
      const Index f = w.rows();
      const double s = std::pow(double(d), -0.25);
      const ref::FavorRow r = ref::favor_row(w, x, 0);
      const bool two = kind != FeatureMapKind::FavorPositive;
      MatrixD j = MatrixD::Zero(two ? 2 * f : f, d);
      for (Index l = 0; l < f; ++l) {
        double first = 0, second = 0;
        if (kind == FeatureMapKind::FavorPositive) {
          first = std::exp(r.u[l] - r.h) / std::sqrt(double(f));
        } else if (kind == FeatureMapKind::FavorHyperbolic) {
          first = std::exp(r.u[l] - r.h) / std::sqrt(2.0 * double(f));
          second = std::exp(-r.u[l] - r.h) / std::sqrt(2.0 * double(f));
        } else {
          first = second = std::exp(r.h) / std::sqrt(double(f));
        }
        for (Index c = 0; c < d; ++c) {
          const double piece = (std::abs(w(l, c)) + std::abs(x(0, c)) * s) * s;
          j(l, c) = first * piece;
          if (two) j(f + l, c) = second * piece;
        }
      }
      return j;
    }
  }
}

// Per feature index: g^2 (|x_a| + |x_b|) on both entries of each rotary pair (a, b), |x_l| on the
// pass-through ones: bounds |R_i^T R_j x| entry by entry, R_i^T R_j being g^2 times a rotation.
MatrixD pair_magnitude(const MatrixD& x, const ref::RopeSpec& spec) {
  MatrixD out = x.cwiseAbs();
  const double g2 = spec.magnitude * spec.magnitude;
  for (const auto& [a, b] : ref::rotary_pairs(spec))
    for (Index i = 0; i < x.rows(); ++i) {
      const double sum = g2 * (std::abs(x(i, a)) + std::abs(x(i, b)));
      out(i, a) = sum;
      out(i, b) = sum;
    }
  return out;
}

struct Bounds {
  MatrixD dq, dk, dv;  // G, the size of each gradient entry's terms (see the header)
  VectorD row_den, row_den_magnitude;  // |D_i| and D_i^mag + eps (0 for rows without keys)
  double cond_max = 1;
  // Whether every row with keys has |D_i| > 2 gamma (D_i^mag + eps).
  bool conditioned(double gamma) const {
    for (Index i = 0; i < row_den.size(); ++i)
      if (row_den_magnitude(i) > 0 && !(row_den(i) > 2 * gamma * row_den_magnitude(i)))
        return false;
    return true;
  }
};

Bounds gradient_bounds(const Setup& s, const ref::LinearResult& want) {
  const Problem& p = s.p;
  const Index n = s.q.rows(), n_k = s.k.rows(), d = s.q.cols();
  const MatrixD w = s.map->projection();
  const bool before = p.placement == RopePlacement::BeforeMap;
  const bool rotated =
      p.placement == RopePlacement::NumeratorOnly || p.placement == RopePlacement::Full;
  // The map's inputs and its features.
  const MatrixD qf = before ? ref::rotate_rows(*s.spec, s.q, p.q_offset) : s.q;
  const MatrixD kf = before ? ref::rotate_rows(*s.spec, s.k, p.k_offset) : s.k;
  const MatrixD pq = s.phi(qf), pk = s.phi(kf);
  // Magnitudes of dA/dphi_i (a function of the key j) and dA/dpsi_j (of the query i), and of B's.
  const MatrixD fa = rotated ? pair_magnitude(pk, *s.spec) : MatrixD(pk.cwiseAbs());
  const MatrixD fb = p.placement == RopePlacement::Full ? fa : MatrixD(pk.cwiseAbs());
  const MatrixD ga = rotated ? pair_magnitude(pq, *s.spec) : MatrixD(pq.cwiseAbs());
  const MatrixD gb = p.placement == RopePlacement::Full ? ga : MatrixD(pq.cwiseAbs());

  Bounds b;
  b.row_den = VectorD::Zero(n);
  b.row_den_magnitude = VectorD::Zero(n);
  VectorD a_weight = VectorD::Zero(n), b_weight = VectorD::Zero(n), amp = VectorD::Zero(n);
  for (Index i = 0; i < n; ++i) {
    if (want.admissible[std::size_t(i)] == 0) continue;
    const double den = std::abs(want.den(i) + p.eps);
    const double den_mag = want.den_magnitude(i) + p.eps;
    b.row_den(i) = den;
    b.row_den_magnitude(i) = den_mag;
    if (den == 0) continue;
    const double cond = den_mag / den;
    b.cond_max = std::max(b.cond_max, cond);
    const double o = want.out.cols() > 0 ? want.out.row(i).cwiseAbs().maxCoeff() : 0.0;
    const double d_sum = s.d_out.row(i).cwiseAbs().sum();
    // The weights of the header: (2 + cond_i) on <g_i, v_j> (its own rounding, 1/D_i's, the
    // dA factor's), N_i / |D_i| + (2 + 2 cond_i) |o_i| on c_i (o_i's error, 1/D_i's, its own and
    // the dB factor's), (2 + cond_i) on dv's A_ij / D_i.
    amp(i) = (2 + cond) / den;
    a_weight(i) = d_sum * amp(i);
    b_weight(i) = d_sum * (want.num_magnitude(i) / den + (2 + 2 * cond) * o) / den;
  }
  MatrixD mask = MatrixD::Zero(n, n_k);
  for (Index i = 0; i < n; ++i)
    for (Index j = 0; j < n_k; ++j)
      mask(i, j) = (!p.causal || p.k_offset + j <= p.q_offset + i) ? 1.0 : 0.0;
  VectorD vmax = VectorD::Zero(n_k);
  for (Index j = 0; j < n_k; ++j) vmax(j) = s.v.cols() > 0 ? s.v.row(j).cwiseAbs().maxCoeff() : 0.0;

  // dq: row i = (a_i sum_j mask_ij vmax_j fa_j + b_i sum_j mask_ij fb_j) |J_i|.
  const MatrixD sa = mask * vmax.asDiagonal() * fa, sb = mask * fb;
  // dk: row j = (vmax_j sum_i mask_ij a_i ga_i + sum_i mask_ij b_i gb_i) |J_j|.
  const MatrixD ta = mask.transpose() * a_weight.asDiagonal() * ga;
  const MatrixD tb = mask.transpose() * b_weight.asDiagonal() * gb;
  b.dq = MatrixD::Zero(n, d);
  b.dk = MatrixD::Zero(n_k, d);
  for (Index i = 0; i < n; ++i) {
    MatrixD jac = jacobian_magnitude(p.kind, w, qf.row(i));
    if (before) jac = jac * ref::rotation_matrix(*s.spec, p.q_offset + i).cwiseAbs();
    b.dq.row(i) = (a_weight(i) * sa.row(i) + b_weight(i) * sb.row(i)) * jac;
  }
  for (Index j = 0; j < n_k; ++j) {
    MatrixD jac = jacobian_magnitude(p.kind, w, kf.row(j));
    if (before) jac = jac * ref::rotation_matrix(*s.spec, p.k_offset + j).cwiseAbs();
    b.dk.row(j) = (vmax(j) * ta.row(j) + tb.row(j)) * jac;
  }
  // dv: sum_i M_ij |d_out_i| (2 + cond_i) / |D_i|.
  b.dv = want.magnitude.transpose() * amp.asDiagonal() * s.d_out.cwiseAbs();
  return b;
}

double rounding_gamma_of(const Setup& s, double u_kernel) {
  const bool before = s.p.placement == RopePlacement::BeforeMap;
  const MatrixD qf = before ? ref::rotate_rows(*s.spec, s.q, s.p.q_offset) : s.q;
  const MatrixD kf = before ? ref::rotate_rows(*s.spec, s.k, s.p.k_offset) : s.k;
  const double z = std::max(ref::exponent_size(*s.map, qf), ref::exponent_size(*s.map, kf));
  // ref::rounding_gamma<T> with T's unit roundoff passed in.
  return 8 * (u_kernel + kUnitDouble) * (double(s.m + s.p.d + s.k.rows() + 16) + 2 * z);
}
template <class T>
double rounding_gamma_of(const Setup& s) {
  return rounding_gamma_of(s, std::numeric_limits<T>::epsilon() / 2);
}

// |got - want| <= gamma G + absolute, entry by entry; reports the worst entry.
template <class T>
void check_matrix(const char* what, const Matrix<T>& got, const MatrixD& want,
                  const MatrixD& magnitude, double gamma, const MatrixD& absolute) {
  INFO(what);
  REQUIRE(got.rows() == want.rows());
  REQUIRE(got.cols() == want.cols());
  Index failed = 0, wi = -1, wj = -1;
  double worst_ratio = -1, worst_error = 0, worst_tol = 0;
  for (Index i = 0; i < want.rows(); ++i)
    for (Index j = 0; j < want.cols(); ++j) {
      const double tol = gamma * magnitude(i, j) + absolute(i, j);
      const double error = std::abs(double(got(i, j)) - want(i, j));
      const double ratio = std::isnan(error) ? std::numeric_limits<double>::infinity()
                           : tol > 0         ? error / tol
                           : error > 0       ? std::numeric_limits<double>::infinity()
                                             : 0.0;
      if (!(error <= tol)) ++failed;
      if (ratio > worst_ratio) {
        worst_ratio = ratio;
        worst_error = error;
        worst_tol = tol;
        wi = i;
        wj = j;
      }
    }
  INFO("worst entry (", wi, ", ", wj, "): |error| = ", worst_error, ", tolerance ", worst_tol,
       " (got ", (wi >= 0 ? double(got(wi, wj)) : 0.0), ", want ", (wi >= 0 ? want(wi, wj) : 0.0),
       ")");
  CHECK(failed == 0);
}
template <class T>
void check_matrix(const char* what, const Matrix<T>& got, const MatrixD& want,
                  const MatrixD& magnitude, double gamma, double absolute) {
  check_matrix<T>(what, got, want, magnitude, gamma,
                  MatrixD::Constant(want.rows(), want.cols(), absolute));
}

// max over entries of |a - b| / (gamma G + absolute): how far outside the tolerance a is.
double max_ratio(const MatrixD& a, const MatrixD& b, const MatrixD& magnitude, double gamma,
                 const MatrixD& absolute) {
  double worst = 0;
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j)
      worst =
          std::max(worst, std::abs(a(i, j) - b(i, j)) / (gamma * magnitude(i, j) + absolute(i, j)));
  return worst;
}
double max_ratio(const MatrixD& a, const MatrixD& b, const MatrixD& magnitude, double gamma,
                 double absolute) {
  return max_ratio(a, b, magnitude, gamma, MatrixD::Constant(a.rows(), a.cols(), absolute));
}

// Against finite differences: gamma G for the kernel plus the differences' own error.
template <class T>
void check_gradients(const AttentionGradients<T>& got, const Gradients& want, const Bounds& b,
                     double gamma) {
  check_matrix<T>("dq", got.dq, want.dq, b.dq, gamma, want.error_q);
  check_matrix<T>("dk", got.dk, want.dk, b.dk, gamma, want.error_k);
  check_matrix<T>("dv", got.dv, want.dv, b.dv, gamma, want.error_v);
}

std::string describe(const Problem& p) {
  std::string s = std::string(to_string(p.kind)) + " " + to_string(p.placement) +
                  (p.causal ? " causal" : " non-causal") + " n=" + std::to_string(p.n) +
                  " n_k=" + std::to_string(p.n_k) + " d=" + std::to_string(p.d) +
                  " d_v=" + std::to_string(p.d_v) + " q_offset=" + std::to_string(p.q_offset) +
                  " k_offset=" + std::to_string(p.k_offset) + " eps=" + std::to_string(p.eps) +
                  (p.layout == RopeLayout::Half ? " half" : " interleaved") +
                  (p.partial ? " partial" : "") + (p.yarn ? " yarn" : "");
  return s;
}

// Counts of comparisons run and skipped as ill-conditioned, per precision.
struct Tally {
  int run_float = 0, skipped_float = 0, run_double = 0, skipped_double = 0;
};

// One problem: finite differences once, then every method in float and double against them.
void check_problem(const Problem& p, Tally& tally) {
  const std::string name = describe(p);
  CAPTURE(name);
  const Setup s(p);
  const ref::LinearResult want = s.reference();
  const Gradients fd = finite_differences(s);
  const Bounds b = gradient_bounds(s, want);
  const double gamma_f = rounding_gamma_of<float>(s), gamma_d = rounding_gamma_of<double>(s);
  const bool ok_f = b.conditioned(gamma_f), ok_d = b.conditioned(gamma_d);
  const std::vector<Method> methods =
      p.causal ? kCausalMethods : std::vector<Method>{{CausalMethod::Scan, 64}};
  for (const Method& method : methods) {
    CAPTURE(int(method.method));
    CAPTURE(method.chunk);
    if (ok_d) {
      INFO("double");
      check_gradients(s.run<double>(method), fd, b, gamma_d);
      ++tally.run_double;
    } else {
      ++tally.skipped_double;
    }
    if (ok_f) {
      INFO("float");
      check_gradients(s.run<float>(method), fd, b, gamma_f);
      ++tally.run_float;
    } else {
      ++tally.skipped_float;
    }
  }
}

// The shapes every (map, placement, causal) combination runs.
std::vector<Problem> shapes(FeatureMapKind kind, RopePlacement placement, bool causal,
                            std::uint64_t seed) {
  std::vector<Problem> out;
  Problem base;
  base.kind = kind;
  base.placement = placement;
  base.causal = causal;
  base.seed = seed;
  {  // n = 1
    Problem p = base;
    p.n = p.n_k = 1;
    p.d = 4;
    p.d_v = 2;
    out.push_back(p);
  }
  {  // odd sizes, half layout, partial rotary width
    Problem p = base;
    p.n = p.n_k = 7;
    p.d = 5;
    p.d_v = 3;
    p.layout = RopeLayout::Half;
    p.partial = true;
    out.push_back(p);
  }
  {  // cross: 4 new queries after 5 cached keys (9 keys in all), eps > 0 that matters
    Problem p = base;
    p.n = 4;
    p.n_k = 9;
    p.q_offset = 5;
    p.d = 5;
    p.d_v = 2;
    p.eps = 0.3;
    p.partial = true;
    out.push_back(p);
  }
  {  // negative offsets, q_offset != k_offset: causal rows 0-2 see no key; eps = 0
    Problem p = base;
    p.n = 6;
    p.n_k = 5;
    p.q_offset = -8;
    p.k_offset = -5;
    p.d = 4;
    p.d_v = 3;
    p.eps = 0;
    p.layout = RopeLayout::Half;
    out.push_back(p);
  }
  {  // YaRN rope (magnitude 1.21), offsets 3 and 1
    Problem p = base;
    p.n = p.n_k = 6;
    p.q_offset = 3;
    p.k_offset = 1;
    p.d = 6;
    p.d_v = 2;
    p.yarn = true;
    out.push_back(p);
  }
  for (std::size_t i = 0; i < out.size(); ++i) out[i].seed = seed + 10 * i;
  return out;
}

// Calls `call` and checks it throws std::invalid_argument whose message contains every fragment.
template <class F>
void check_invalid(F&& call, std::initializer_list<const char*> fragments) {
  std::string message;
  bool thrown = false;
  try {
    call();
  } catch (const std::invalid_argument& e) {
    thrown = true;
    message = e.what();
  }
  CAPTURE(message);
  CHECK(thrown);
  for (const char* fragment : fragments) {
    CAPTURE(fragment);
    CHECK(message.find(fragment) != std::string::npos);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_CASE("the reference's YaRN rope: frequencies and magnitude of the explicit rotation") {
  // The extension of linear_reference.hpp's RopeSpec that the YaRN problems rely on: R(p) is g
  // times a rotation by p theta_i' on each pair, theta' from rope_reference.hpp, and it matches
  // the library's Rope::apply to rounding (test_rope.cpp proves the library against
  // rope_reference.hpp in depth).
  const RopeConfig c{
      .dim = 6,
      .layout = RopeLayout::Interleaved,
      .scaling = {.kind = RopeScalingKind::Yarn, .factor = 8, .original_max_position = 256}};
  const ref::RopeSpec spec = ref::rope_spec(c);
  REQUIRE(spec.frequencies.size() == 3);
  CHECK(spec.magnitude == doctest::Approx(0.1 * std::log(8.0) + 1).epsilon(1e-15));
  const MatrixD r = ref::rotation_matrix(spec, 5);
  CHECK((r.transpose() * r - spec.magnitude * spec.magnitude * MatrixD::Identity(6, 6))
            .cwiseAbs()
            .maxCoeff() <= 1e-14);
  MatrixD x = gaussian(3, 6, 1);
  const MatrixD want = ref::rotate_rows(spec, x, -2);
  Rope(c).apply(x, -2);
  CHECK((x - want).cwiseAbs().maxCoeff() <= 1e-14);
}

TEST_CASE(
    "linear_attention_backward matches finite differences: map x placement x causal x shape") {
  // Every map and placement, causal or not; shapes: n = 1, odd n with the half layout and a
  // partial rotary width, cross lengths with eps = 0.3, negative offsets with q_offset != k_offset
  // and eps = 0 (causal rows without keys), YaRN. Causal problems run Scan and Chunked with chunks
  // of 1, 2, 3 and 1000 (> n), float and double, all against one set of finite differences.
  Tally tally;
  std::uint64_t seed = 1;
  for (const auto kind : kMaps)
    for (const auto placement : kPlacements)
      for (const bool causal : {false, true}) {
        for (const Problem& p : shapes(kind, placement, causal, seed)) check_problem(p, tally);
        seed += 100;
      }
  INFO("float: ", tally.run_float, " run, ", tally.skipped_float,
       " skipped; double: ", tally.run_double, " run, ", tally.skipped_double, " skipped");
  // Ill-conditioned problems (a denominator within rounding of zero) are rare: Full or
  // favor-trig with eps = 0 only.
  CHECK(tally.skipped_double == 0);
  CHECK(tally.skipped_float * 20 <= tally.run_float);
}

TEST_CASE("dk includes the denominator's dependence on the keys: numerator-only and full") {
  // Through den_i, every key j <= i moves o_i: dk_j = sum_i <g_i, v_j> dA_ij/dk_j - c_i
  // dB_ij/dk_j. For NumeratorOnly, B_ij = <phi_i, psi_j> (unrotated), for Full
  // B_ij = <R_i phi_i, R_j psi_j>. A kernel that drops the c_i term, or that takes NumeratorOnly's
  // unrotated B for Full (or the reverse), is caught here: v has mean 2 and d_out mean 1, so
  // c_i = <d_out_i, o_i>/D_i is large, and eps = 0 so that the denominator is all there is. The
  // wrong gradients are finite differences of the reference with den frozen at its value (no
  // c_i term) or with the other placement's den; the check asserts they lie far outside the
  // tolerance that the kernel meets.
  for (const auto kind : {FeatureMapKind::EluPlusOne, FeatureMapKind::FavorPositive})
    for (const auto placement : {RopePlacement::NumeratorOnly, RopePlacement::Full})
      for (const bool causal : {false, true}) {
        Problem p;
        p.kind = kind;
        p.placement = placement;
        p.causal = causal;
        p.n = p.n_k = 6;
        p.d = 4;
        p.d_v = 2;
        p.eps = 0;
        p.v_mean = 2;
        p.seed = 4242;
        const std::string name = describe(p);
        CAPTURE(name);
        Setup s(p);
        s.d_out = Setup::as_float((s.d_out.array() + 1.0).matrix());
        const ref::LinearResult want = s.reference();
        const Gradients fd = finite_differences(s);
        const Bounds b = gradient_bounds(s, want);
        const double gamma = rounding_gamma_of<double>(s);
        REQUIRE(b.conditioned(gamma));
        const AttentionGradients<double> got = s.run<double>();
        check_gradients(got, fd, b, gamma);
        const AttentionGradients<float> got_f = s.run<float>();
        check_gradients(got_f, fd, b, rounding_gamma_of<float>(s));

        // The wrong dk's: den frozen, and the other placement's den.
        Problem other = p;
        other.placement =
            placement == RopePlacement::Full ? RopePlacement::NumeratorOnly : RopePlacement::Full;
        const Setup s_other(other);
        const auto loss_with_den = [&](const MatrixD& kk, bool frozen) {
          const ref::LinearResult r = s.reference(s.q, kk, s.v);
          const VectorD den =
              frozen ? want.den : s_other.reference(s.q, kk, s.v).den;  // other placement's den
          double total = 0;
          for (Index i = 0; i < r.num.rows(); ++i) {
            if (want.admissible[std::size_t(i)] == 0) continue;
            for (Index c = 0; c < r.num.cols(); ++c)
              total += s.d_out(i, c) * r.num(i, c) / (den(i) + p.eps);
          }
          return total;
        };
        const MatrixD dk_frozen = ref::central_difference(
            s.k, [&](const MatrixD& kk) { return loss_with_den(kk, true); });
        const MatrixD dk_swapped = ref::central_difference(
            s.k, [&](const MatrixD& kk) { return loss_with_den(kk, false); });
        // Entry by entry, how far outside the tolerances the wrong gradients fall: the double
        // one (FD-limited, ~1e-8 relative) by 10^4 at least, the float one (looser where Full's
        // den with eps = 0 is ill-conditioned: cond up to ~30 here) by 10 at least; the kernel
        // meets both (ratio <= 1, checked above).
        const double gamma_f = rounding_gamma_of<float>(s);
        const MatrixD& fd_dk = fd.error_k;
        for (const MatrixD* wrong : {&dk_frozen, &dk_swapped}) {
          const char* which = wrong == &dk_frozen ? "den frozen" : "other placement's den";
          CAPTURE(which);
          const double in_double = max_ratio(*wrong, fd.dk, b.dk, gamma, fd_dk);
          const double in_float = max_ratio(*wrong, fd.dk, b.dk, gamma_f, fd_dk);
          CAPTURE(in_double);
          CAPTURE(in_float);
          CAPTURE(b.cond_max);
          CHECK(in_double > 1e4);
          CHECK(in_float > 10);
          CHECK(max_ratio(got.dk, *wrong, b.dk, gamma, fd_dk) > 1e4 / 2);
        }
      }
}

TEST_CASE("causal gradients: what may and may not depend on what") {
  // With p_i = q_offset + i and p_j = k_offset + j, o_i depends on q_i and on the keys and values
  // with p_j <= p_i only, and L = sum_i <d_out_i, o_i>. Hence:
  //   (a) dq_i = d<d_out_i, o_i>/dq_i does not change when k_j, v_j change for p_j > p_i (nor
  //       when q or d_out of other rows change);
  //   (b) dk_j, dv_j sum over the rows with p_i >= p_j: they do not change when q_i or d_out_i
  //       change for p_i < p_j (they do depend on later keys, through those rows' den);
  //   (c) dv_j = sum_i A_ij d_out_i / D_i involves no v at all: any change of v leaves dv as is;
  //   (d) and the checks can fail: changing a key at p_j <= p_i does change dq_i.
  // Both runs are within gamma G of the same exact values (G of the rows concerned is the same in
  // both, as it involves the same rows and keys), so they may differ by 2 gamma G. Later keys are
  // also replaced by keys of norm 20 and values of size 50: a stabiliser that looks ahead (a global
  // key max) would move the earlier rows.
  int counter = 0;
  for (const auto kind : {FeatureMapKind::FavorPositive, FeatureMapKind::EluPlusOne,
                          FeatureMapKind::FavorHyperbolic, FeatureMapKind::OnePlusCosine})
    for (const auto placement : kPlacements)
      for (const Method method : {Method{CausalMethod::Scan, 64}, Method{CausalMethod::Chunked, 2},
                                  Method{CausalMethod::Chunked, 4}}) {
        Problem p;
        p.kind = kind;
        p.placement = placement;
        p.causal = true;
        p.n = 9;
        p.n_k = 10;
        p.q_offset = 1;  // key j at position j, query i at i + 1
        p.d = 5;
        p.d_v = 3;
        p.layout = counter % 2 == 0 ? RopeLayout::Interleaved : RopeLayout::Half;
        p.seed = std::uint64_t(500 + 10 * counter++);
        const std::string name = describe(p);
        CAPTURE(name);
        CAPTURE(int(method.method));
        CAPTURE(method.chunk);
        Setup s(p);
        const ref::LinearResult want = s.reference();
        const Bounds b = gradient_bounds(s, want);
        const double gamma_f = rounding_gamma_of<float>(s), gamma_d = rounding_gamma_of<double>(s);
        REQUIRE(b.conditioned(gamma_f));
        const AttentionGradients<double> base = s.run<double>(method);
        const AttentionGradients<float> base_f = s.run<float>(method);
        const MatrixD q0 = s.q, k0 = s.k, v0 = s.v, d0 = s.d_out;
        for (const Index i : {Index(0), Index(3), Index(7)}) {
          CAPTURE(i);
          const Index p_i = p.q_offset + i;  // keys 0 .. p_i are admissible for row i
          // (a) keys and values after p_i replaced, large.
          s.k = k0;
          s.v = v0;
          const Index later = p.n_k - 1 - p_i;
          if (later > 0) {
            MatrixD big = gaussian(later, p.d, 900 + std::uint64_t(i));
            for (Index r = 0; r < later; ++r) big.row(r) *= 20 / big.row(r).norm();
            s.k.bottomRows(later) = Setup::as_float(big);
            s.v.bottomRows(later) = Setup::as_float(gaussian(later, p.d_v, 901, 50.0));
          }
          // ... and q, d_out of the other rows.
          s.q = q0;
          s.d_out = d0;
          for (Index r = 0; r < p.n; ++r)
            if (r != i) {
              s.q.row(r) = Setup::as_float(gaussian(1, p.d, 902 + std::uint64_t(r), 0.7));
              s.d_out.row(r) = Setup::as_float(gaussian(1, p.d_v, 903 + std::uint64_t(r)));
            }
          {
            const AttentionGradients<double> changed = s.run<double>(method);
            const AttentionGradients<float> changed_f = s.run<float>(method);
            INFO("(a) dq_i after changing later keys, values and other rows");
            check_matrix<double>("dq double", changed.dq.row(i), base.dq.row(i), b.dq.row(i),
                                 2 * gamma_d, 0);
            check_matrix<float>("dq float", changed_f.dq.row(i), base_f.dq.row(i).cast<double>(),
                                b.dq.row(i), 2 * gamma_f, 0);
          }
          // (b) q and d_out of rows 0 .. i changed: dk_j, dv_j for p_j > p_i stay.
          s.q = q0;
          s.k = k0;
          s.v = v0;
          s.d_out = d0;
          s.q.topRows(i + 1) = Setup::as_float(gaussian(i + 1, p.d, 904, 0.7));
          s.d_out.topRows(i + 1) = Setup::as_float(gaussian(i + 1, p.d_v, 905));
          const Index keep = p.n_k - 1 - p_i;  // keys after p_i
          if (keep > 0) {
            const AttentionGradients<double> changed = s.run<double>(method);
            const AttentionGradients<float> changed_f = s.run<float>(method);
            INFO("(b) dk_j, dv_j of later keys after changing earlier queries and d_out");
            check_matrix<double>("dk double", MatrixD(changed.dk.bottomRows(keep)),
                                 base.dk.bottomRows(keep), b.dk.bottomRows(keep), 2 * gamma_d, 0);
            check_matrix<double>("dv double", MatrixD(changed.dv.bottomRows(keep)),
                                 base.dv.bottomRows(keep), b.dv.bottomRows(keep), 2 * gamma_d, 0);
            check_matrix<float>("dk float", MatrixF(changed_f.dk.bottomRows(keep)),
                                base_f.dk.bottomRows(keep).cast<double>(), b.dk.bottomRows(keep),
                                2 * gamma_f, 0);
            check_matrix<float>("dv float", MatrixF(changed_f.dv.bottomRows(keep)),
                                base_f.dv.bottomRows(keep).cast<double>(), b.dv.bottomRows(keep),
                                2 * gamma_f, 0);
          }
          // (d) a key at or before p_i changed: dq_i moves by far more than the tolerance.
          s.q = q0;
          s.d_out = d0;
          s.k.row(p_i) = Setup::as_float(gaussian(1, p.d, 906, 0.7));
          {
            const AttentionGradients<double> changed = s.run<double>(method);
            // ... by far more than (a)'s double tolerance, which would then catch it.
            const double moved = max_ratio(MatrixD(changed.dq.row(i)), MatrixD(base.dq.row(i)),
                                           MatrixD(b.dq.row(i)), 2 * gamma_d, 0);
            INFO("(d) dq_i after changing key p_i: moved by ", moved, " tolerances");
            CHECK(moved > 1e3);
          }
          s.k = k0;
        }
        // (c) every v changed: dv identical up to rounding.
        s.v = Setup::as_float(gaussian(p.n_k, p.d_v, 907, 3.0));
        {
          const AttentionGradients<double> changed = s.run<double>(method);
          INFO("(c) dv after changing every v");
          check_matrix<double>("dv double", changed.dv, base.dv, b.dv, 2 * gamma_d, 0);
        }
        s.v = v0;
      }
}

TEST_CASE("non-causal: dq_i depends on no other query and no other row of d_out") {
  // L is a sum over rows of terms that each involve one query: changing q_r and d_out_r for r != i
  // leaves dq_i as it was (to 2 gamma G, both being within gamma G of the same value).
  for (const auto placement : kPlacements) {
    Problem p;
    p.kind = FeatureMapKind::FavorPositive;
    p.placement = placement;
    p.n = 7;
    p.n_k = 8;
    p.seed = 77;
    const std::string name = describe(p);
    CAPTURE(name);
    Setup s(p);
    const Bounds b = gradient_bounds(s, s.reference());
    const double gamma = rounding_gamma_of<double>(s);
    const AttentionGradients<double> base = s.run<double>();
    s.q.bottomRows(4) = Setup::as_float(gaussian(4, p.d, 78, 0.7));
    s.d_out.bottomRows(4) = Setup::as_float(gaussian(4, p.d_v, 79));
    const AttentionGradients<double> changed = s.run<double>();
    check_matrix<double>("dq", MatrixD(changed.dq.topRows(3)), base.dq.topRows(3), b.dq.topRows(3),
                         2 * gamma, 0);
  }
}

TEST_CASE("large-norm float inputs: finite gradients that match the reference") {
  // Rows of q and k of norm 20: |x'|^2/2 = 82 at d = 6, so the exp-based features span e^(+-100)
  // on the unstabilised scale and a kernel that does not stabilise its backward (or that forms
  // exp(W x') and exp(-|x'|^2/2) apart) overflows. Gradients must be finite and match the finite
  // differences of the reference (in double, where these values are representable) to gamma G, the
  // exponent size z ~ 10^3 making gamma_float ~ 1e-3. eps: 0 where den > 0 (favor+ and favor-hyp
  // but Full), else the median |den| (the exact den ~ e^-100 would be swamped by the default 1e-6).
  for (const auto kind : {FeatureMapKind::FavorPositive, FeatureMapKind::FavorHyperbolic})
    for (const auto placement : kPlacements)
      for (const bool causal : {false, true}) {
        Problem p;
        p.kind = kind;
        p.placement = placement;
        p.causal = causal;
        p.n = p.n_k = 6;
        p.d = 6;
        p.d_v = 2;
        p.seed = 31;
        Setup s(p);
        for (MatrixD* x : {&s.q, &s.k}) {
          for (Index r = 0; r < x->rows(); ++r) x->row(r) *= 20 / x->row(r).norm();
          *x = Setup::as_float(*x);
        }
        if (placement == RopePlacement::Full) {
          const VectorD den = s.reference().den;
          std::vector<double> a(den.data(), den.data() + den.size());
          for (double& e : a) e = std::abs(e);
          std::nth_element(a.begin(), a.begin() + std::ptrdiff_t(a.size() / 2), a.end());
          s.p.eps = s.options.eps = a[a.size() / 2];
        } else {
          s.p.eps = s.options.eps = 0;
        }
        const std::string name = describe(s.p);
        CAPTURE(name);
        const ref::LinearResult want = s.reference();
        const Bounds b = gradient_bounds(s, want);
        const double gamma = rounding_gamma_of<float>(s);
        for (const Method method :
             {Method{CausalMethod::Scan, 64}, Method{CausalMethod::Chunked, 2}}) {
          if (!causal && method.method != CausalMethod::Scan) continue;
          CAPTURE(int(method.method));
          const AttentionGradients<float> got = s.run<float>(method);
          CHECK(got.dq.allFinite());
          CHECK(got.dk.allFinite());
          CHECK(got.dv.allFinite());
          if (!b.conditioned(gamma)) continue;  // Full's den can cross 0
          const Gradients fd = finite_differences(s);
          check_gradients(got, fd, b, gamma);
        }
      }
}

TEST_CASE("long sequences split across threads: float and double against the double backward") {
  // n = 600 - 1200 on 2 threads: the kernels cut the sequence into segments (causal) or parts
  // (non-causal) on the threads. Against the double backward on one thread (the whole sequence in
  // one piece): float within (gamma_float + gamma_double) G, double on 2 threads within
  // 2 gamma_double G. Finite differences would take minutes here; the small shapes above carry
  // them. Maps, placements and methods rotate over the cases.
  struct Case {
    FeatureMapKind kind;
    RopePlacement placement;
    bool causal;
    Method method;
    Index n, n_k;
  };
  const Case cases[] = {
      {FeatureMapKind::FavorPositive,
       RopePlacement::NumeratorOnly,
       true,
       {CausalMethod::Scan, 64},
       640,
       640},
      {FeatureMapKind::EluPlusOne,
       RopePlacement::Full,
       true,
       {CausalMethod::Chunked, 64},
       700,
       700},
      {FeatureMapKind::OnePlusCosine,
       RopePlacement::BeforeMap,
       true,
       {CausalMethod::Chunked, 48},
       1100,
       1100},
      {FeatureMapKind::FavorHyperbolic,
       RopePlacement::None,
       false,
       {CausalMethod::Scan, 64},
       1200,
       1200},
      {FeatureMapKind::Relu,
       RopePlacement::NumeratorOnly,
       false,
       {CausalMethod::Scan, 64},
       600,
       1100},
      {FeatureMapKind::FavorTrig,
       RopePlacement::NumeratorOnly,
       true,
       {CausalMethod::Scan, 64},
       600,
       900},
  };
  int counter = 0;
  for (const Case& c : cases) {
    Problem p;
    p.kind = c.kind;
    p.placement = c.placement;
    p.causal = c.causal;
    p.n = c.n;
    p.n_k = c.n_k;
    p.q_offset = c.n_k - c.n;  // queries are the last n positions of the keys
    p.d = 6;
    p.d_v = 4;
    p.layout = counter % 2 == 0 ? RopeLayout::Half : RopeLayout::Interleaved;
    p.partial = counter % 3 == 1;
    p.yarn = counter == 2;
    p.scale = c.kind == FeatureMapKind::FavorTrig ? 0.4 : 0.7;
    p.seed = std::uint64_t(3000 + 10 * counter++);
    const std::string name = describe(p);
    CAPTURE(name);
    CAPTURE(int(c.method.method));
    CAPTURE(c.method.chunk);
    const Setup s(p);
    const ref::LinearResult want = s.reference();
    const Bounds b = gradient_bounds(s, want);
    const double gamma_f = rounding_gamma_of<float>(s), gamma_d = rounding_gamma_of<double>(s);
    REQUIRE(b.conditioned(gamma_d));
    AttentionGradients<double> one;
    {
      const ThreadCount threads(1);
      one = s.run<double>(c.method);
    }
    const ThreadCount threads(kSplitThreads);
    const AttentionGradients<double> two = s.run<double>(c.method);
    check_matrix<double>("dq double, 2 threads", two.dq, one.dq, b.dq, 2 * gamma_d, 0);
    check_matrix<double>("dk double, 2 threads", two.dk, one.dk, b.dk, 2 * gamma_d, 0);
    check_matrix<double>("dv double, 2 threads", two.dv, one.dv, b.dv, 2 * gamma_d, 0);
    if (!b.conditioned(gamma_f)) {
      MESSAGE("float comparison skipped: ill-conditioned at float precision: ", name);
      continue;
    }
    const AttentionGradients<float> f = s.run<float>(c.method);
    check_matrix<float>("dq float", f.dq, one.dq, b.dq, gamma_f + gamma_d, 0);
    check_matrix<float>("dk float", f.dk, one.dk, b.dk, gamma_f + gamma_d, 0);
    check_matrix<float>("dv float", f.dv, one.dv, b.dv, gamma_f + gamma_d, 0);
  }
}

TEST_CASE("causal heads cut into 3 and 4 segments, with offsets that empty or clamp segments") {
  // The split paths the case above never reaches: more than two segments (the suffix states'
  // merge), segments whose first keys are clamped to 0 (queries that see no key), segments past
  // the horizon with no key of their own, and queries absorbed in bulk because their own key lies
  // past the last (n_k < n + shift, or shift > n_k). Against one thread in double, as above.
  struct Case {
    FeatureMapKind kind;
    RopePlacement placement;
    Index n, n_k, q_offset, k_offset;
    int threads;
  };
  const Case cases[] = {
      // shift -600: the first 600 queries see nothing, segment 1 starts at key 0 too
      {FeatureMapKind::FavorPositive, RopePlacement::NumeratorOnly, 1100, 1100, 0, 600, 4},
      // n_k < n: the keys end at 700; the later segments have none of their own
      {FeatureMapKind::EluPlusOne, RopePlacement::Full, 1100, 700, 0, 0, 3},
      // shift 900: keys [0, 900) seen by all, queries from 400 on see every key
      {FeatureMapKind::FavorPositive, RopePlacement::Full, 1000, 1300, 900, 0, 4},
      // shift 2000 > n_k: every query sees every key; segment 0 takes all keys, none its own
      {FeatureMapKind::OnePlusCosine, RopePlacement::NumeratorOnly, 1100, 1100, 2000, 0, 3},
      {FeatureMapKind::Relu, RopePlacement::BeforeMap, 1300, 1000, 0, 150, 4},
  };
  int counter = 0;
  for (const Case& c : cases) {
    Problem p;
    p.kind = c.kind;
    p.placement = c.placement;
    p.causal = true;
    p.n = c.n;
    p.n_k = c.n_k;
    p.q_offset = c.q_offset;
    p.k_offset = c.k_offset;
    p.d = 6;
    p.d_v = 4;
    p.layout = counter % 2 == 0 ? RopeLayout::Interleaved : RopeLayout::Half;
    p.seed = std::uint64_t(5000 + 10 * counter++);
    const std::string name = describe(p);
    CAPTURE(name);
    CAPTURE(c.threads);
    const Setup s(p);
    const ref::LinearResult want = s.reference();
    const Bounds b = gradient_bounds(s, want);
    const double gamma_d = rounding_gamma_of<double>(s);
    REQUIRE(b.conditioned(gamma_d));
    const Method scan{CausalMethod::Scan, 64};
    AttentionGradients<double> one;
    {
      const ThreadCount threads(1);
      one = s.run<double>(scan);
    }
    const ThreadCount threads(c.threads);
    const AttentionGradients<double> split = s.run<double>(scan);
    check_matrix<double>("dq double, split", split.dq, one.dq, b.dq, 2 * gamma_d, 0);
    check_matrix<double>("dk double, split", split.dk, one.dk, b.dk, 2 * gamma_d, 0);
    check_matrix<double>("dv double, split", split.dv, one.dv, b.dv, 2 * gamma_d, 0);
  }
}

TEST_CASE("float against double on the same inputs, every map and placement") {
  // Each within gamma_T G of the exact gradient: within (gamma_float + gamma_double) G of each
  // other. n = 65 (past the default chunk and Scan's block of 64), causal and not.
  int counter = 0;
  for (const auto kind : kMaps)
    for (const auto placement : kPlacements) {
      Problem p;
      p.kind = kind;
      p.placement = placement;
      p.causal = counter % 2 == 0;
      p.n = p.n_k = 65;
      p.d = 6;
      p.d_v = 3;
      p.scale = kind == FeatureMapKind::FavorTrig ? 0.4 : 0.7;
      p.seed = std::uint64_t(4000 + 10 * counter++);
      const std::string name = describe(p);
      CAPTURE(name);
      const Setup s(p);
      const Bounds b = gradient_bounds(s, s.reference());
      const double gamma = rounding_gamma_of<float>(s) + rounding_gamma_of<double>(s);
      if (!b.conditioned(rounding_gamma_of<float>(s))) continue;
      for (const Method method :
           {Method{CausalMethod::Scan, 64}, Method{CausalMethod::Chunked, 16}}) {
        if (!p.causal && method.method != CausalMethod::Scan) continue;
        CAPTURE(int(method.method));
        const AttentionGradients<double> d = s.run<double>(method);
        const AttentionGradients<float> f = s.run<float>(method);
        check_matrix<float>("dq", f.dq, d.dq, b.dq, gamma, 0);
        check_matrix<float>("dk", f.dk, d.dk, b.dk, gamma, 0);
        check_matrix<float>("dv", f.dv, d.dv, b.dv, gamma, 0);
      }
    }
}

TEST_CASE("batched backward equals the per-head backward, padded rows get zero gradients") {
  // [B, H, n, d] buffers, lengths {9, 4} and {0, 7}: every slice's rows below its length against
  // the single-head backward on the truncated slice (both within gamma G of the exact gradient:
  // 2 gamma G apart; attention.hpp also promises the same bits when the slice is not split), rows
  // at or past it exactly 0. The padding of q, k, v and d_out holds NaN: never read.
  const Index batch = 2, heads = 2, n = 9, d = 5, d_v = 3;
  int counter = 0;
  for (const auto kind :
       {FeatureMapKind::FavorPositive, FeatureMapKind::EluPlusOne, FeatureMapKind::OnePlusCosine})
    for (const auto placement : kPlacements)
      for (const bool causal : {false, true})
        for (const std::vector<Index>& lengths :
             {std::vector<Index>{9, 4}, std::vector<Index>{0, 7}, std::vector<Index>{}}) {
          Problem p;
          p.kind = kind;
          p.placement = placement;
          p.causal = causal;
          p.n = p.n_k = n;
          p.d = d;
          p.d_v = d_v;
          p.q_offset = 2;
          p.k_offset = 1;
          p.seed = std::uint64_t(6000 + 10 * counter++);
          const std::string name = describe(p);
          CAPTURE(name);
          CAPTURE(lengths.size());
          const Setup s(p);  // map, rope and options; the slices' data below
          const double nan = std::numeric_limits<double>::quiet_NaN();
          const std::size_t slice_q = std::size_t(n * d), slice_v = std::size_t(n * d_v);
          std::vector<double> q(batch * heads * slice_q), k(q.size()), v(batch * heads * slice_v),
              d_out(v.size()), dq(q.size(), 7.0), dk(q.size(), 7.0), dv(v.size(), 7.0);
          const auto slice = [&](std::vector<double>& buf, Index b, Index h, Index cols) {
            return Eigen::Map<MatrixD>(buf.data() + (b * heads + h) * n * cols, n, cols);
          };
          for (Index b = 0; b < batch; ++b)
            for (Index h = 0; h < heads; ++h) {
              const std::uint64_t seed = p.seed + std::uint64_t(100 * b + 10 * h);
              slice(q, b, h, d) = Setup::as_float(gaussian(n, d, seed, 0.7));
              slice(k, b, h, d) = Setup::as_float(gaussian(n, d, seed + 1, 0.7));
              slice(v, b, h, d_v) = Setup::as_float(gaussian(n, d_v, seed + 2));
              slice(d_out, b, h, d_v) = Setup::as_float(gaussian(n, d_v, seed + 3));
              if (!lengths.empty()) {
                const Index len = lengths[std::size_t(b)];
                for (auto* buf : {&q, &k})
                  slice(*buf, b, h, d).bottomRows(n - len).setConstant(nan);
                for (auto* buf : {&v, &d_out})
                  slice(*buf, b, h, d_v).bottomRows(n - len).setConstant(nan);
              }
            }
          const Index* len = lengths.empty() ? nullptr : lengths.data();
          const auto in = [&](const std::vector<double>& buf, Index cols) {
            return Heads<const double>{buf.data(), batch, heads, n, cols, len};
          };
          const auto out = [&](std::vector<double>& buf, Index cols) {
            return Heads<double>{buf.data(), batch, heads, n, cols, len};
          };
          linear_attention_backward(in(q, d), in(k, d), in(v, d_v), in(d_out, d_v), out(dq, d),
                                    out(dk, d), out(dv, d_v), *s.map, s.options);
          for (Index b = 0; b < batch; ++b)
            for (Index h = 0; h < heads; ++h) {
              CAPTURE(b);
              CAPTURE(h);
              const Index rows = len ? len[b] : n;
              const MatrixD got_q = slice(dq, b, h, d), got_k = slice(dk, b, h, d),
                            got_v = slice(dv, b, h, d_v);
              CHECK(got_q.bottomRows(n - rows).isZero(0));
              CHECK(got_k.bottomRows(n - rows).isZero(0));
              CHECK(got_v.bottomRows(n - rows).isZero(0));
              if (rows == 0) continue;
              Problem ps = p;
              ps.n = ps.n_k = rows;
              Setup one(ps);
              one.q = slice(q, b, h, d).topRows(rows);
              one.k = slice(k, b, h, d).topRows(rows);
              one.v = slice(v, b, h, d_v).topRows(rows);
              one.d_out = slice(d_out, b, h, d_v).topRows(rows);
              const AttentionGradients<double> single = one.run<double>();
              const Bounds bounds = gradient_bounds(one, one.reference());
              const double gamma = rounding_gamma_of<double>(one);
              check_matrix<double>("dq", MatrixD(got_q.topRows(rows)), single.dq, bounds.dq,
                                   2 * gamma, 0);
              check_matrix<double>("dk", MatrixD(got_k.topRows(rows)), single.dk, bounds.dk,
                                   2 * gamma, 0);
              check_matrix<double>("dv", MatrixD(got_v.topRows(rows)), single.dv, bounds.dv,
                                   2 * gamma, 0);
              CHECK(got_q.topRows(rows) == single.dq);
              CHECK(got_k.topRows(rows) == single.dk);
              CHECK(got_v.topRows(rows) == single.dv);
            }
        }
}

TEST_CASE("batched backward: one long float head split along the sequence") {
  // One slice on 2 threads: the batched path splits it along the sequence (as the forward does
  // from n = 512 causal, 1024 non-causal). Against the single-head float call: both within
  // gamma_float G of the exact gradient.
  const ThreadCount threads(kSplitThreads);
  for (const bool causal : {true, false}) {
    Problem p;
    p.kind = FeatureMapKind::FavorPositive;
    p.placement = RopePlacement::NumeratorOnly;
    p.causal = causal;
    p.n = p.n_k = causal ? 600 : 1100;
    p.d = 6;
    p.d_v = 4;
    p.seed = 7000;
    const std::string name = describe(p);
    CAPTURE(name);
    const Setup s(p);
    const Bounds b = gradient_bounds(s, s.reference());
    const double gamma = rounding_gamma_of<float>(s);
    REQUIRE(b.conditioned(gamma));
    const MatrixF q = s.q.cast<float>(), k = s.k.cast<float>(), v = s.v.cast<float>(),
                  d_out = s.d_out.cast<float>();
    MatrixF dq(p.n, p.d), dk(p.n, p.d), dv(p.n, p.d_v);
    const auto in = [&](const MatrixF& x) {
      return Heads<const float>{x.data(), 1, 1, x.rows(), x.cols(), nullptr};
    };
    const auto out = [&](MatrixF& x) {
      return Heads<float>{x.data(), 1, 1, x.rows(), x.cols(), nullptr};
    };
    linear_attention_backward(in(q), in(k), in(v), in(d_out), out(dq), out(dk), out(dv), *s.map,
                              s.options);
    const AttentionGradients<float> single = s.run<float>();
    check_matrix<float>("dq", dq, single.dq.cast<double>(), b.dq, 2 * gamma, 0);
    check_matrix<float>("dk", dk, single.dk.cast<double>(), b.dk, 2 * gamma, 0);
    check_matrix<float>("dv", dv, single.dv.cast<double>(), b.dv, 2 * gamma, 0);
  }
}

// The bad-input tests' problem: FAVOR+ with d = 6 and 8 features, eq. 19's rope of width m.
struct SmallFavor {
  static constexpr Index d = 6;
  std::unique_ptr<FeatureMap> map =
      make_feature_map({.kind = FeatureMapKind::FavorPositive, .input_dim = d, .num_features = 8});
  Rope rope{RopeConfig{.dim = map->output_dim()}};
};

TEST_CASE("linear_attention_backward: a non-finite value anywhere in q, k, v or d_out is found") {
  // The kernels find non-finite values as they read the inputs (NonFiniteFlag), so every row must
  // pass through a check on every path, including those no gradient reads: keys past the last
  // query's horizon, queries that see no key, a head split into segments (n >= 512 on 2 or more
  // threads), the single-head and the batched calls. One value at a time: the first row, a middle
  // one and the last, of each argument.
  const SmallFavor favor;
  const Index d = favor.d;
  const auto& map = favor.map;
  const Rope& rope = favor.rope;
  struct Case {
    bool causal;
    Index n, n_k, q_offset, k_offset;
  };
  const Case cases[] = {
      {true, 7, 7, 0, 0},       {true, 7, 12, 0, 0},     // keys 7..11 past the horizon
      {true, 9, 9, 0, 4},       {true, 600, 700, 0, 0},  // queries 0..3 see no key; split
      {true, 600, 500, 300, 0}, {false, 7, 9, 0, 0},    {false, 1100, 600, 0, 0}};
  const char* fn = "linear_attention_backward";
  for (const Case& c : cases) {
    CAPTURE(c.causal);
    CAPTURE(c.n);
    CAPTURE(c.n_k);
    CAPTURE(c.q_offset);
    CAPTURE(c.k_offset);
    LinearOptions options;
    options.rope = &rope;
    options.causal = c.causal;
    options.q_offset = c.q_offset;
    options.k_offset = c.k_offset;
    const MatrixF q = gaussian(c.n, d, 1).cast<float>(), k = gaussian(c.n_k, d, 2).cast<float>(),
                  v = gaussian(c.n_k, 3, 3).cast<float>(),
                  d_out = gaussian(c.n, 3, 4).cast<float>();
    REQUIRE_NOTHROW(linear_attention_backward(q, k, v, d_out, *map, options));
    for (int which = 0; which < 4; ++which) {
      const char* name = which == 0 ? "q" : which == 1 ? "k" : which == 2 ? "v" : "d_out";
      CAPTURE(name);
      MatrixF x[4] = {q, k, v, d_out};
      const Index rows = x[which].rows();
      for (const Index row : {Index(0), rows / 2, rows - 1}) {
        CAPTURE(row);
        MatrixF bad[4] = {q, k, v, d_out};
        bad[which](row, row % bad[which].cols()) = std::numeric_limits<float>::quiet_NaN();
        const std::string message = std::string(name) + " has the non-finite value";
        check_invalid(
            [&] { linear_attention_backward(bad[0], bad[1], bad[2], bad[3], *map, options); },
            {fn, message.c_str()});
        const auto in = [](const MatrixF& m) {
          return Heads<const float>{m.data(), 1, 1, m.rows(), m.cols(), nullptr};
        };
        MatrixF dq(c.n, d), dk(c.n_k, d), dv(c.n_k, 3);
        const auto out = [](MatrixF& m) {
          return Heads<float>{m.data(), 1, 1, m.rows(), m.cols(), nullptr};
        };
        const std::string sliced = std::string(name) + "[0, 0] has the non-finite value";
        check_invalid(
            [&] {
              linear_attention_backward(in(bad[0]), in(bad[1]), in(bad[2]), in(bad[3]), out(dq),
                                        out(dk), out(dv), *map, options);
            },
            {fn, sliced.c_str()});
      }
    }
  }
}

TEST_CASE("linear_attention_backward: bad input throws std::invalid_argument naming the argument") {
  const SmallFavor favor;
  const Index d = favor.d;
  const auto& map = favor.map;
  const Rope& rope = favor.rope;
  LinearOptions ok;
  ok.rope = &rope;
  const MatrixF q = gaussian(7, d, 1).cast<float>(), k = gaussian(9, d, 2).cast<float>(),
                v = gaussian(9, 3, 3).cast<float>(), d_out = gaussian(7, 3, 4).cast<float>();
  const MatrixD qd = q.cast<double>(), kd = k.cast<double>(), vd = v.cast<double>(),
                dd = d_out.cast<double>();
  REQUIRE_NOTHROW(linear_attention_backward(q, k, v, d_out, *map, ok));
  const char* fn = "linear_attention_backward";

  SUBCASE("d_out of the wrong shape or not finite") {
    check_invalid([&] { linear_attention_backward(q, k, v, MatrixF(d_out.leftCols(2)), *map, ok); },
                  {fn, "d_out is [7 x 2]"});
    check_invalid([&] { linear_attention_backward(q, k, v, MatrixF(d_out.topRows(6)), *map, ok); },
                  {fn, "d_out is [6 x 3]"});
    check_invalid([&] { linear_attention_backward(qd, kd, vd, MatrixD(8, 3), *map, ok); },
                  {fn, "d_out is [8 x 3]"});
    for (const double bad :
         {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
      CAPTURE(bad);
      MatrixF bad_f = d_out;
      bad_f(5, 1) = float(bad);
      check_invalid([&] { linear_attention_backward(q, k, v, bad_f, *map, ok); },
                    {fn, "d_out has the non-finite value"});
      MatrixD bad_d = dd;
      bad_d(0, 2) = bad;
      LinearOptions causal = ok;
      causal.causal = true;
      check_invalid([&] { linear_attention_backward(qd, kd, vd, bad_d, *map, causal); },
                    {fn, "d_out has the non-finite value"});
    }
  }
  SUBCASE("mismatched q, k, v and non-finite inputs") {
    check_invalid(
        [&] {
          linear_attention_backward(q, MatrixF(gaussian(9, d + 1, 2).cast<float>()), v, d_out, *map,
                                    ok);
        },
        {fn, "k is ["});
    check_invalid([&] { linear_attention_backward(q, k, MatrixF(v.topRows(8)), d_out, *map, ok); },
                  {fn, "v is ["});
    check_invalid(
        [&] {
          linear_attention_backward(MatrixD(gaussian(7, d + 2, 1)), MatrixD(gaussian(9, d + 2, 2)),
                                    vd, dd, *map, ok);
        },
        {fn, "q has d = 8"});
    MatrixF bad_q = q;
    bad_q(2, 3) = std::numeric_limits<float>::quiet_NaN();
    check_invalid([&] { linear_attention_backward(bad_q, k, v, d_out, *map, ok); },
                  {fn, "q has the non-finite value"});
    MatrixD bad_k = kd;
    bad_k(8, 0) = -std::numeric_limits<double>::infinity();
    check_invalid([&] { linear_attention_backward(qd, bad_k, vd, dd, *map, ok); },
                  {fn, "k has the non-finite value"});
  }
  SUBCASE("options") {
    LinearOptions no_rope = ok;
    no_rope.rope = nullptr;
    check_invalid([&] { linear_attention_backward(q, k, v, d_out, *map, no_rope); }, {fn, "rope"});
    const Rope narrow(RopeConfig{.dim = d});
    LinearOptions wrong_width = ok;
    wrong_width.rope = &narrow;  // width d, but NumeratorOnly needs m
    check_invalid([&] { linear_attention_backward(q, k, v, d_out, *map, wrong_width); },
                  {fn, "rope"});
    LinearOptions bad_eps = ok;
    bad_eps.eps = -1;
    check_invalid([&] { linear_attention_backward(qd, kd, vd, dd, *map, bad_eps); }, {fn, "eps"});
    LinearOptions bad_chunk = ok;
    bad_chunk.causal = true;
    bad_chunk.method = CausalMethod::Chunked;
    bad_chunk.chunk_size = 0;
    check_invalid([&] { linear_attention_backward(q, k, v, d_out, *map, bad_chunk); },
                  {fn, "chunk_size"});
  }
  SUBCASE("batched views") {
    const Index b = 2, h = 2, n = 5;
    std::vector<float> qb(std::size_t(b * h * n * d), 0.5f), vb(std::size_t(b * h * n * 3), 0.5f);
    std::vector<float> dqb(qb.size()), dkb(qb.size()), dvb(vb.size());
    const Heads<const float> hq{qb.data(), b, h, n, d}, hv{vb.data(), b, h, n, 3};
    const Heads<float> hdq{dqb.data(), b, h, n, d}, hdk{dkb.data(), b, h, n, d},
        hdv{dvb.data(), b, h, n, 3};
    REQUIRE_NOTHROW(linear_attention_backward(hq, hq, hv, hv, hdq, hdk, hdv, *map, ok));
    Heads<const float> short_d = hv;
    short_d.n = 4;
    check_invalid([&] { linear_attention_backward(hq, hq, hv, short_d, hdq, hdk, hdv, *map, ok); },
                  {fn, "d_out is ["});
    Heads<float> wide_dq = hdq;
    wide_dq.d = d + 1;
    check_invalid([&] { linear_attention_backward(hq, hq, hv, hv, wide_dq, hdk, hdv, *map, ok); },
                  {fn, "dq is ["});
    Heads<float> null_dv = hdv;
    null_dv.data = nullptr;
    check_invalid([&] { linear_attention_backward(hq, hq, hv, hv, hdq, hdk, null_dv, *map, ok); },
                  {fn, "dv.data"});
    std::vector<float> nan_d = vb;
    nan_d[7] = std::numeric_limits<float>::quiet_NaN();
    const Heads<const float> hnan{nan_d.data(), b, h, n, 3};
    check_invalid([&] { linear_attention_backward(hq, hq, hv, hnan, hdq, hdk, hdv, *map, ok); },
                  {fn, "non-finite"});
    // Past the lengths, a NaN is never read.
    const Index lengths[] = {2, 5};  // row 2 of slice (0, 0) is padding: index 2 * 3 + 1
    std::vector<float> padded_nan = vb;
    padded_nan[7] = std::numeric_limits<float>::quiet_NaN();
    const Heads<const float> lq{qb.data(), b, h, n, d, lengths}, lv{vb.data(), b, h, n, 3, lengths},
        lnan{padded_nan.data(), b, h, n, 3, lengths};
    const Heads<float> ldq{dqb.data(), b, h, n, d, lengths}, ldk{dkb.data(), b, h, n, d, lengths},
        ldv{dvb.data(), b, h, n, 3, lengths};
    CHECK_NOTHROW(linear_attention_backward(lq, lq, lv, lnan, ldq, ldk, ldv, *map, ok));
  }
}
