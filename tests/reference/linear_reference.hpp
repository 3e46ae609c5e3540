// Naive reference for linear attention with the four RoPE placements (docs/DESIGN.md,
// "Placements"), in double precision, sharing no code with src/: features by the formulas of
// feature_map_reference.hpp (from the map only its projection W, which is data), explicit rotation
// matrices R(p) built from theta_i = base^(-2i/r), and the explicit n x n_k weight matrices
//   A_ij (weight of v_j in the numerator) and B_ij (its term in the denominator),
// masked by k_offset + j <= q_offset + i when causal, then
//   num_i = sum_j A_ij v_j,  den_i = sum_j B_ij,  o_i = num_i / (den_i + eps).
// A row with no admissible key has num_i = 0, den_i = 0 and o_i = 0 (also for eps = 0).
// With a decay g (causal only), A_ij and B_ij are multiplied by the explicit decay matrix
// G_ij = g^(p_i - p_j), p_i = q_offset + i, p_j = k_offset + j (`decay_matrix`).
//
//   placement       A_ij                             B_ij
//   None            <phi_i, psi_j>                   <phi_i, psi_j>
//   BeforeMap       <phi(R_i q_i), phi(R_j k_j)>     = A_ij            (rope width d)
//   NumeratorOnly   <R_i phi_i, R_j psi_j>           <phi_i, psi_j>    (rope width m)
//   Full            <R_i phi_i, R_j psi_j>           = A_ij            (rope width m)
// with phi_i = phi(q_i), psi_j = phi(k_j), R_i the rotation at position q_offset + i and R_j the
// one at k_offset + j.
//
// Besides the answer, the reference returns a magnitude M_ij >= |every term that any correct
// evaluation of A_ij or B_ij adds up| (see `magnitude` below), from which the tests derive their
// tolerances: a kernel in precision u has |num_i error| <= gamma sum_j M_ij |v_j|_inf and
// |den_i error| <= gamma sum_j M_ij, gamma = O(u (m + n_k)).
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <linrope/attention.hpp>
#include <linrope/feature_maps.hpp>
#include <linrope/rope.hpp>
#include <linrope/types.hpp>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "feature_map_reference.hpp"
#include "rope_reference.hpp"
#include "softmax_reference.hpp"

namespace linrope::reference {

using VectorD = Eigen::VectorXd;

// ---------------------------------------------------------------------------------------------
// RoPE as explicit rotation matrices.

struct RopeSpec {
  Index dim = 0;         // width of the rows
  Index rotary_dim = 0;  // r: leading dims that rotate (even); the rest pass through
  double base = 10000.0;
  RopeLayout layout = RopeLayout::Interleaved;
  // Scaled ropes: theta_i after scaling (empty: plain base^(-2i/r)) and the factor g on the
  // rotated dims (YaRN's 0.1 ln s + 1), both from rope_reference.hpp's own formulas.
  std::vector<double> frequencies = {};
  double magnitude = 1.0;
};

// The same rope as a RopeConfig describes. Scaled kinds (Linear, Ntk, Yarn) take their frequencies
// and magnitude from rope_reference.hpp (long double, written from the documented formulas; no
// code shared with src/).
inline RopeSpec rope_spec(const RopeConfig& config) {
  RopeSpec spec{config.dim, config.rotary_dim == 0 ? config.dim : config.rotary_dim, config.base,
                config.layout};
  if (config.scaling.kind != RopeScalingKind::None) {
    spec.frequencies = frequencies(config);
    spec.magnitude = magnitude(config);
  }
  return spec;
}

// Rotary pair i as (cosine slot, sine partner): (2i, 2i+1) interleaved, (i, i + r/2) half.
inline std::vector<std::pair<Index, Index>> rotary_pairs(const RopeSpec& spec) {
  if (spec.rotary_dim % 2 != 0 || spec.rotary_dim > spec.dim || spec.rotary_dim < 0)
    throw std::logic_error("reference::rotary_pairs: bad rotary_dim");
  const Index half = spec.rotary_dim / 2;
  std::vector<std::pair<Index, Index>> pairs;
  for (Index i = 0; i < half; ++i) pairs.push_back(pair_of(spec.layout, spec.rotary_dim, i));
  return pairs;
}

// theta_i = base^(-2i/r), i = 0 .. r/2 - 1 (or the scaled frequencies when the spec has them).
inline double frequency(const RopeSpec& spec, Index i) {
  if (!spec.frequencies.empty()) return spec.frequencies.at(std::size_t(i));
  return std::pow(spec.base, -2.0 * double(i) / double(spec.rotary_dim));
}

// R(p) [dim x dim], acting on column vectors: pair (a, b) -> g (a cos - b sin, a sin + b cos) with
// angle p * theta_i and g = spec.magnitude (1 but for YaRN); identity on the pass-through dims.
// Written out by rope_reference.hpp's fill_rotation.
inline MatrixD rotation_matrix(const RopeSpec& spec, Index position) {
  const Index half = Index(rotary_pairs(spec).size());  // also checks rotary_dim
  std::vector<double> theta(std::size_t(half), 0.0);
  for (Index i = 0; i < half; ++i) theta[std::size_t(i)] = frequency(spec, i);
  MatrixD r(spec.dim, spec.dim);
  fill_rotation(spec.dim, spec.rotary_dim, spec.layout, theta, spec.magnitude,
                (long double)position, r.data());
  return r;
}

// Row i of x [n x dim] rotated by R(first_position + i), as an explicit matrix-vector product.
inline MatrixD rotate_rows(const RopeSpec& spec, const MatrixD& x, Index first_position) {
  if (x.cols() != spec.dim) throw std::logic_error("reference::rotate_rows: width != rope dim");
  MatrixD out(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i)
    out.row(i) = (rotation_matrix(spec, first_position + i) * x.row(i).transpose()).transpose();
  return out;
}

// ---------------------------------------------------------------------------------------------
// Feature maps.

using FeatureFn = std::function<MatrixD(const MatrixD&)>;

// phi by the reference's own formulas (feature_map_reference.hpp, evaluated row by row in double),
// never through the library's FeatureMap::apply: w = the projection W [f x d], ignored by the
// deterministic maps. Unstabilised: fine in double for |x| up to ~30.
inline MatrixD features(FeatureMapKind kind, const MatrixD& w, const MatrixD& x) {
  switch (kind) {
    case FeatureMapKind::EluPlusOne:
      return elu_plus_one(x);
    case FeatureMapKind::Relu:
      return relu(x);
    case FeatureMapKind::OnePlusCosine:
      return one_plus_cosine(x);
    case FeatureMapKind::FavorPositive:
    case FeatureMapKind::FavorTrig:
    case FeatureMapKind::FavorHyperbolic:
      if (w.cols() != x.cols()) throw std::logic_error("reference::features: W width != d");
      if (kind == FeatureMapKind::FavorPositive) return favor_positive(w, x);
      if (kind == FeatureMapKind::FavorTrig) return favor_trig(w, x);
      return favor_hyperbolic(w, x);
  }
  throw std::logic_error("reference::features: unknown kind");
}

// phi by the formulas above for the map's kind. The only thing taken from the map is its
// projection W (random data, public API), copied, so the functor outlives a redraw.
inline FeatureFn feature_formula(const FeatureMap& map) {
  return [kind = map.kind(), w = MatrixD(map.projection())](const MatrixD& x) {
    return features(kind, w, x);
  };
}

// ---------------------------------------------------------------------------------------------
// Linear attention.

struct LinearSpec {
  bool causal = false;
  RopePlacement placement = RopePlacement::None;
  std::optional<RopeSpec> rope = std::nullopt;  // required for every placement but None
  double eps = 1e-6;
  Index q_offset = 0, k_offset = 0;
  bool denominator = true;  // false: o_i = num_i
  double decay = 1.0;       // g in (0, 1]; < 1 causal only
};

// G [n x n_k]: g^(p_i - p_j) for every pair the causal mask admits, 0 for the others (1 and no
// mask when not causal, which admits no decay). pow in double: an entry below 1e-308 is 0, as the
// term it weights is then far below any other of its row.
inline MatrixD decay_matrix(const LinearSpec& spec, Index n, Index n_k) {
  if (!spec.causal) {
    if (spec.decay != 1.0) throw std::logic_error("reference::decay_matrix: a non-causal decay");
    return MatrixD::Ones(n, n_k);
  }
  MatrixD g = MatrixD::Zero(n, n_k);
  for (Index i = 0; i < n; ++i)
    for (Index j = 0; j < n_k; ++j) {
      const Index distance = (spec.q_offset + i) - (spec.k_offset + j);
      if (distance >= 0) g(i, j) = std::pow(spec.decay, double(distance));
    }
  return g;
}

struct LinearResult {
  MatrixD numerator_weights;    // A [n x n_k], 0 where masked
  MatrixD denominator_weights;  // B [n x n_k], 0 where masked
  MatrixD magnitude;            // M [n x n_k] >= |terms of A_ij|, 0 where masked (`magnitude_rows`)
  MatrixD den_magnitude_weights;  // the same bound for the terms of B_ij
  MatrixD num;                    // [n x d_v]
  VectorD den;                    // [n]
  VectorD num_magnitude;          // N_i = sum_j M_ij max_c |v_jc|
  VectorD den_magnitude;          // D_i = sum_j (bound for B_ij)
  std::vector<Index> admissible;  // keys each query attends to
  MatrixD out;                    // [n x d_v]
  bool denominator = true;        // the spec's: false, out = num
};

// Row-wise magnitudes for the error bound of inner products of (possibly rotated) features:
// entry p is g (|a| + |b|) for rotary pair p = (a, b) (g = the rope's magnitude, 1 but for YaRN),
// then |x_l| for each pass-through dim l. For two
// rows x, y, mag(x) . mag(y) bounds |<R x, R' y>| pair by pair (|<R(a,b), R'(c,e)>| <=
// |(a,b)| |(c,e)| <= (|a|+|b|)(|c|+|e|)), the sums of |products| inside any evaluation order of
// <R x, R' y> or <x, y>, and the rounding of the rotation itself (each rotated entry is a
// two-term sum bounded by |a| + |b|). Without a rope it is the element-wise |x|.
inline MatrixD magnitude_rows(const MatrixD& x, const std::optional<RopeSpec>& spec) {
  if (!spec) return x.cwiseAbs();
  const auto pairs = rotary_pairs(*spec);
  const Index np = Index(pairs.size()), pass = x.cols() - spec->rotary_dim;
  MatrixD out(x.rows(), np + pass);
  for (Index i = 0; i < x.rows(); ++i) {
    for (Index p = 0; p < np; ++p)
      out(i, p) = spec->magnitude * (std::abs(x(i, pairs[std::size_t(p)].first)) +
                                     std::abs(x(i, pairs[std::size_t(p)].second)));
    for (Index l = 0; l < pass; ++l) out(i, np + l) = std::abs(x(i, spec->rotary_dim + l));
  }
  return out;
}

// q [n x d], k [n_k x d], v [n_k x d_v] -> LinearResult, following the table at the top.
inline LinearResult linear_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                                     const FeatureFn& phi, const LinearSpec& spec) {
  if (k.cols() != q.cols() || v.rows() != k.rows())
    throw std::logic_error("reference::linear_attention: shapes");
  if (spec.placement != RopePlacement::None && !spec.rope)
    throw std::logic_error("reference::linear_attention: placement needs a rope");
  const Index n = q.rows(), n_k = k.rows();

  MatrixD a, b, mag, mag_den;
  switch (spec.placement) {
    case RopePlacement::None: {
      const MatrixD pq = phi(q), pk = phi(k);
      a = pq * pk.transpose();
      b = a;
      mag = pq.cwiseAbs() * pk.cwiseAbs().transpose();
      mag_den = mag;
      break;
    }
    case RopePlacement::BeforeMap: {
      if (spec.rope->dim != q.cols()) throw std::logic_error("reference: BeforeMap rope width");
      const MatrixD pq = phi(rotate_rows(*spec.rope, q, spec.q_offset));
      const MatrixD pk = phi(rotate_rows(*spec.rope, k, spec.k_offset));
      a = pq * pk.transpose();
      b = a;
      // The kernel also rotates q and k before the map; that rounding enters through the map's
      // argument, which the tests' gamma accounts for, so the feature magnitudes suffice here.
      mag = pq.cwiseAbs() * pk.cwiseAbs().transpose();
      mag_den = mag;
      break;
    }
    case RopePlacement::NumeratorOnly:
    case RopePlacement::Full: {
      const MatrixD pq = phi(q), pk = phi(k);
      if (spec.rope->dim != pq.cols()) throw std::logic_error("reference: feature rope width");
      const MatrixD rq = rotate_rows(*spec.rope, pq, spec.q_offset);
      const MatrixD rk = rotate_rows(*spec.rope, pk, spec.k_offset);
      a = rq * rk.transpose();
      b = spec.placement == RopePlacement::Full ? a : MatrixD(pq * pk.transpose());
      mag = magnitude_rows(pq, spec.rope) * magnitude_rows(pk, spec.rope).transpose();
      // NumeratorOnly's denominator is the unrotated inner product: its terms are bounded by the
      // element-wise |phi||psi|, which can be far smaller than the pair bound when the features
      // are peaked (large norms), and using the pair bound there would call such rows
      // ill-conditioned for no reason.
      mag_den = spec.placement == RopePlacement::Full
                    ? mag
                    : MatrixD(pq.cwiseAbs() * pk.cwiseAbs().transpose());
      break;
    }
  }

  LinearResult r;
  r.admissible.assign(std::size_t(n), 0);
  for (Index i = 0; i < n; ++i)
    for (Index j = 0; j < n_k; ++j) {
      const bool keep = !spec.causal || spec.k_offset + j <= spec.q_offset + i;
      if (keep) {
        ++r.admissible[std::size_t(i)];
      } else {
        a(i, j) = 0;
        b(i, j) = 0;
        mag(i, j) = 0;
        mag_den(i, j) = 0;
      }
    }

  if (spec.decay != 1.0) {
    const MatrixD g = decay_matrix(spec, n, n_k);
    a = a.cwiseProduct(g);
    b = b.cwiseProduct(g);
    mag = mag.cwiseProduct(g);
    mag_den = mag_den.cwiseProduct(g);
  }

  VectorD vmax(n_k);
  for (Index j = 0; j < n_k; ++j) vmax(j) = v.cols() > 0 ? v.row(j).cwiseAbs().maxCoeff() : 0.0;

  r.num = a * v;
  r.den = b.rowwise().sum();
  r.num_magnitude = mag * vmax;
  r.den_magnitude = mag_den.rowwise().sum();
  r.out.resize(n, v.cols());
  r.denominator = spec.denominator;
  if (!spec.denominator) r.out = r.num;
  for (Index i = 0; i < n && spec.denominator; ++i) {
    const double denominator = r.den(i) + spec.eps;
    for (Index c = 0; c < v.cols(); ++c)
      r.out(i, c) = (denominator == 0 && r.num(i, c) == 0) ? 0.0 : r.num(i, c) / denominator;
  }
  r.numerator_weights = std::move(a);
  r.denominator_weights = std::move(b);
  r.magnitude = std::move(mag);
  r.den_magnitude_weights = std::move(mag_den);
  return r;
}

// DenominatorStats of den (on the exact scale, without eps), threshold as given.
struct Stats {
  double min = 0;
  Index nonpositive = 0;
  Index below_threshold = 0;
  Index count = 0;
};
inline Stats denominator_stats(const VectorD& den, double threshold) {
  Stats s;
  s.count = den.size();
  s.min = den.size() > 0 ? den.minCoeff() : 0.0;
  for (Index i = 0; i < den.size(); ++i) {
    s.nonpositive += den(i) <= 0;
    s.below_threshold += std::abs(den(i)) < threshold;
  }
  return s;
}

// Exact softmax attention, o_i = sum_j softmax_j(scale <q_i, k_j>) v_j, explicitly and without
// RoPE: only what the FAVOR+ estimator is checked against (softmax_reference.hpp's textbook form).
inline MatrixD softmax_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                                 double scale) {
  MatrixD scores, out(q.rows(), v.cols());
  textbook_softmax_attention<double>(q, k, v, scale, false, 0, 0, scores, out);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Error bounds for a kernel evaluated in precision T (the derivation is in
// tests/test_linear_attention.cpp, at the top).

template <class T>
constexpr double kUnitRoundoff = std::numeric_limits<T>::epsilon() / 2;

// Size of the argument of exp in the features of rows x: 0 for maps without exp, max |x| for
// elu+1 (exp(x) for x < 0), (d + 2)(|w| |x'| + |x'|^2 / 2) for the Favor maps (the rounding of
// w . x' over d terms, and of the shift |x'|^2 / 2). Rotation-invariant, so it also covers
// BeforeMap.
inline double exponent_size(const FeatureMap& map, const MatrixD& x) {
  if (x.size() == 0) return 0;
  switch (map.kind()) {
    case FeatureMapKind::EluPlusOne:
      return x.cwiseAbs().maxCoeff();
    case FeatureMapKind::Relu:
    case FeatureMapKind::OnePlusCosine:
      return 0;
    default: {
      const double d = double(map.input_dim());
      const double xs = x.rowwise().norm().maxCoeff() * std::pow(d, -0.25);
      const double ws = map.projection().rowwise().norm().maxCoeff();
      return (d + 2) * (ws * xs + xs * xs / 2);
    }
  }
}

// gamma: |num_i error| <= gamma N_i and |den_i error| <= gamma D_i for a kernel in precision T
// (plus the reference's own rounding in double), with a margin of 8 over the first-order bound.
template <class T>
double rounding_gamma(Index m, Index d, Index n_k, double z_size) {
  return 8 * (kUnitRoundoff<T> + kUnitRoundoff<double>)*(double(m + d + n_k + 16) + 2 * z_size);
}

// |log g| P: the size of a decay's exponents, P the span of the call's positions (plus one, for
// the state's position k_offset - 1); 0 without a decay.
inline double decay_exponent_size(const LinearSpec& spec, Index n, Index n_k) {
  if (spec.decay == 1.0) return 0;
  const Index first = std::min(spec.q_offset, spec.k_offset - 1);
  const Index last = std::max(spec.q_offset + n, spec.k_offset + n_k);
  return std::abs(std::log(spec.decay)) * double(last - first + 1);
}

// The decay's part of gamma. A kernel carries g^(p_i - p_j) in its log scales, shifted by
// log g (p - o) (o a position of the call): each weight's exponent is formed, in double, by at
// most 4 roundings of terms of size <= |log g| P (decay_exponent_size), and the reference's pow
// errs by about one more: 5 u_double |log g| P relative, times the margin of 8. Not scaled by the
// kernel's precision: the shifts are doubles whatever T is.
inline double decay_gamma(const LinearSpec& spec, Index n, Index n_k) {
  return 40 * kUnitRoundoff<double> * decay_exponent_size(spec, n, n_k);
}

// Per-row bound on |o_i error|_inf:
//   gamma (N_i + |o_i|_inf (D_i + eps)) / (|den_i + eps| - gamma (D_i + eps)) + absolute;
// without a denominator (o_i = num_i), gamma N_i + absolute;
// +inf marks an ill-conditioned row (|den_i + eps| <= 2 gamma (D_i + eps)), 0 a row with no
// admissible key (its output must be exactly zero). `absolute` is the output type's smallest
// normal number: an exact output below it cannot be represented (it underflows to 0 or a
// subnormal), which happens in float with large-norm Favor inputs whose den ~ e^-100 << eps.
inline VectorD row_tolerances(const LinearResult& want, double gamma, double eps,
                              double absolute = 0) {
  const Index n = want.den.size();
  VectorD tol(n);
  for (Index i = 0; i < n; ++i) {
    if (want.admissible[std::size_t(i)] == 0) {
      tol(i) = 0;
      continue;
    }
    if (!want.denominator) {  // o_i = num_i: the numerator's own bound
      tol(i) = gamma * want.num_magnitude(i) + absolute;
      continue;
    }
    const double big_d = want.den_magnitude(i) + eps;
    const double denominator = std::abs(want.den(i) + eps);
    const double o = want.out.cols() > 0 ? want.out.row(i).cwiseAbs().maxCoeff() : 0.0;
    if (denominator <= 2 * gamma * big_d) {
      tol(i) = std::numeric_limits<double>::infinity();
    } else {
      tol(i) =
          gamma * (want.num_magnitude(i) + o * big_d) / (denominator - gamma * big_d) + absolute;
    }
  }
  return tol;
}

}  // namespace linrope::reference
