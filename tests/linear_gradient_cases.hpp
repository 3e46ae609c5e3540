// The gradient checks of linear attention, shared by the backward tests (test_linear_backward.cpp)
// and those of state in, state out (test_linear_state.cpp): a problem and its inputs (Setup),
// central finite differences of the naive reference forward with their own error
// (finite_differences), the size of each gradient entry's terms (gradient_bounds), and the
// entry-by-entry comparison (check_gradients).
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
// roundings, z the exp-argument size, margin 8: tests/test_linear_attention.cpp; plus a decay's
// decay_gamma, tests/reference/linear_reference.hpp); the row's
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
// whose error is c h^2 + O(h^4)), plus rounding 4 (m + d + n_k + 16 + |log g| P) u_d S / h with S
// the size of the loss's terms (|log g| P: the decay matrix's pow, P the span of positions).
// Measured over the sweep, the double kernels use at most ~1% of that allowance and the float ones
// at most ~1/3 of theirs.
//
// Long sequences (n = 600 - 1200, split across threads) are compared with the double backward on
// one thread: both within gamma G of the exact gradient, so within (gamma_T + gamma_double) G.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linrope/linrope.hpp>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "linear_cases.hpp"
#include "map_cases.hpp"
#include "reference/finite_difference.hpp"
#include "reference/linear_reference.hpp"
#include "reference/random.hpp"

namespace linrope::testing {

namespace ref = linrope::reference;
using ref::VectorD;

inline constexpr double kUnitDouble = std::numeric_limits<double>::epsilon() / 2;

// A causal method and chunk size. Non-causal calls run once (the method is ignored).
struct Method {
  CausalMethod method;
  Index chunk;
};
// Scan, and Chunked with chunks of 1, 2, 3 and one longer than any sequence here.
inline const std::vector<Method> kGradientMethods = {{CausalMethod::Scan, 64},
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
  bool denominator = true;  // false: o = num (LinearOptions::denominator)
  double decay = 1.0;       // LinearOptions::decay (causal only)
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
    options = linear_options(p.causal, p.placement, rope ? &*rope : nullptr, p.eps, p.q_offset,
                             p.k_offset);
    options.denominator = p.denominator;
    options.decay = p.decay;
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
Gradients finite_differences(const Setup& s);

// |J|*: [m x d], entry (l, j) bounds the terms of d phi_l / d x_j at the row x (the analytic
// pieces of each map's derivative, in absolute value):
//   elu+1 exp(min(x_j, 0)) on the diagonal; relu [x_j > 0] on the diagonal;
//   1+cos (delta_lj + |u_l| |u_j|) / |x| for l < d (u = x/|x|), 0 for the constant feature;
//   favor+ and favor-hyp phi_l (|w_lj| + |x'_j|) d^(-1/4); favor-trig the envelope
//   exp(|x'|^2/2)/sqrt(f) in place of phi_l, for the sin and the cos feature.
MatrixD jacobian_magnitude(FeatureMapKind kind, const MatrixD& w, const MatrixD& x);

// Per feature index: g^2 (|x_a| + |x_b|) on both entries of each rotary pair (a, b), |x_l| on the
// pass-through ones: bounds |R_i^T R_j x| entry by entry, R_i^T R_j being g^2 times a rotation.
MatrixD pair_magnitude(const MatrixD& x, const ref::RopeSpec& spec);

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

Bounds gradient_bounds(const Setup& s, const ref::LinearResult& want);

double rounding_gamma_of(const Setup& s, double u_kernel);
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
inline double max_ratio(const MatrixD& a, const MatrixD& b, const MatrixD& magnitude, double gamma,
                        const MatrixD& absolute) {
  double worst = 0;
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j)
      worst =
          std::max(worst, std::abs(a(i, j) - b(i, j)) / (gamma * magnitude(i, j) + absolute(i, j)));
  return worst;
}
inline double max_ratio(const MatrixD& a, const MatrixD& b, const MatrixD& magnitude, double gamma,
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

std::string describe(const Problem& p);

// Whether some D_i can vanish or change sign, so that a comparison may be skipped as
// ill-conditioned: Full's rotated denominator, favor-trig's signed features, relu's features that
// can all be zero. Elsewhere (eq. 19 or before_map with elu+1, FAVOR+, favor-hyp or 1+cos) each
// D_i is eps plus a sum of positive terms, so |D_i| > 2 gamma (D_i^mag + eps) at any gamma < 1/2
// where eps is not far above the sums.
inline bool denominator_may_vanish(FeatureMapKind kind, RopePlacement placement) {
  return placement == RopePlacement::Full || kind == FeatureMapKind::FavorTrig ||
         kind == FeatureMapKind::Relu;
}

// Counts of comparisons run and skipped as ill-conditioned, per precision.
struct Tally {
  int run_float = 0, skipped_float = 0, run_double = 0, skipped_double = 0;
};

// One problem: finite differences once, then every method in float and double against them.
void check_problem(const Problem& p, Tally& tally);

}  // namespace linrope::testing
