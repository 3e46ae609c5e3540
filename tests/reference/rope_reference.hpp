// The naive twin of src/rope.cpp: RoPE as explicit (dim x dim) block-diagonal rotation matrices,
// built in double (angles and trigonometry in long double) from frequencies computed here, straight
// from the formulas documented in include/linrope/rope.hpp. Shares no code with src/: it reads only
// the public configuration structs, never Rope::frequencies() or the library's tables.
//
//   y_i = R(p_i) x_i   (column-vector form; x_i is row i of x)
//   R(p) = identity except, for each pair i = (a, b) with angle p * theta_i and magnitude g:
//     R(a, a) = g cos   R(a, b) = -g sin
//     R(b, a) = g sin   R(b, b) =  g cos
//   pair i = (2i, 2i + 1) for Interleaved, (i, i + r/2) for Half.
#pragma once

#include <algorithm>
#include <cmath>
#include <linrope/rope.hpp>
#include <numbers>
#include <utility>
#include <vector>

namespace linrope::reference {

inline Index rotary_width(const RopeConfig& c) { return c.rotary_dim == 0 ? c.dim : c.rotary_dim; }

// theta_i after scaling, i = 0 .. r/2 - 1, in long double (exp/log instead of pow, so that not even
// the rounding pattern is shared with the library), returned as double.
inline std::vector<double> frequencies(const RopeConfig& c) {
  using L = long double;
  const Index r = rotary_width(c);
  const RopeScaling& sc = c.scaling;
  const L s = sc.factor;
  L log_base = std::log(L(c.base));
  // NTK-aware: base' = base * s^(r / (r - 2)), so log base' = log base + r/(r-2) log s.
  if (sc.kind == RopeScalingKind::Ntk) log_base += L(r) / L(r - 2) * std::log(s);
  std::vector<double> theta(r / 2);
  for (Index i = 0; i < r / 2; ++i) {
    const L t = std::exp(-L(2 * i) / L(r) * log_base);
    L scaled = t;
    switch (sc.kind) {
      case RopeScalingKind::None:
      case RopeScalingKind::Ntk:
        break;
      case RopeScalingKind::Linear:
        scaled = t / s;
        break;
      case RopeScalingKind::Yarn: {
        // rho = turns of pair i over the original context L = original_max_position.
        const L pi = std::numbers::pi_v<long double>;
        const L rho = L(sc.original_max_position) * t / (2 * pi);
        L gamma = (rho - L(sc.beta_slow)) / (L(sc.beta_fast) - L(sc.beta_slow));
        gamma = std::min<L>(std::max<L>(gamma, 0), 1);
        scaled = (1 - gamma) * t / s + gamma * t;
        break;
      }
    }
    theta[i] = double(scaled);
  }
  return theta;
}

// YaRN's attention temperature on the rotated dimensions: 0.1 ln s + 1 for s > 1, else 1 (the
// reference implementation's get_mscale returns 1 for s <= 1).
inline double magnitude(const RopeConfig& c) {
  if (c.scaling.kind != RopeScalingKind::Yarn || c.scaling.factor <= 1) return 1.0;
  return double(0.1L * std::log((long double)c.scaling.factor) + 1.0L);
}

// The two dimensions of rotary pair i of a rotary width r: (2i, 2i + 1) interleaved, (i, i + r/2)
// half.
inline std::pair<Index, Index> pair_of(RopeLayout layout, Index r, Index i) {
  return layout == RopeLayout::Interleaved ? std::pair{2 * i, 2 * i + 1} : std::pair{i, i + r / 2};
}
inline std::pair<Index, Index> pair_of(const RopeConfig& c, Index i) {
  return pair_of(c.layout, rotary_width(c), i);
}

// Writes the explicit (dim x dim) matrix g R(p) into R, row-major: pair i of the rotary width r
// (layout as pair_of) turned by the angle p theta_i (in long double) and scaled by g, identity on
// the pass-through dims. The one place the reference writes a rotation matrix out: for a
// RopeConfig (below), and for linear_reference.hpp's RopeSpec and softmax_reference.hpp's
// PlainRope. Plain loops, so that the sanitizer build stays quick.
inline void fill_rotation(Index d, Index r, RopeLayout layout, const std::vector<double>& theta,
                          long double g, long double p, double* R) {
  std::fill(R, R + d * d, 0.0);
  for (Index a = 0; a < d; ++a) R[a * d + a] = 1.0;
  for (Index i = 0; i < Index(theta.size()); ++i) {
    const long double angle = p * (long double)theta[i];
    const double cs = double(g * std::cos(angle)), sn = double(g * std::sin(angle));
    const auto [a, b] = pair_of(layout, r, i);
    R[a * d + a] = cs;
    R[a * d + b] = -sn;
    R[b * d + a] = sn;
    R[b * d + b] = cs;
  }
}

// R(p) of the configuration for the frequencies theta, into R; inverse = true gives
// R(p)^-1 = R(-p) / magnitude on the rotated block (built as a matrix of its own, not by
// inverting R numerically).
inline void fill_rotation_matrix(const RopeConfig& c, const std::vector<double>& theta,
                                 long double position, bool inverse, double* R) {
  const long double g = inverse ? 1.0L / magnitude(c) : magnitude(c);
  fill_rotation(c.dim, rotary_width(c), c.layout, theta, g, inverse ? -position : position, R);
}

inline MatrixD rotation_matrix(const RopeConfig& c, long double position, bool inverse = false) {
  MatrixD R(c.dim, c.dim);
  fill_rotation_matrix(c, frequencies(c), position, inverse, R.data());
  return R;
}

// Row i of x rotated by the explicit matrix R(positions[i]): y_i^T = R(p_i) x_i^T, the full
// (dim x dim) matrix-vector product written out.
inline MatrixD apply(const RopeConfig& c, const MatrixD& x, const std::vector<Index>& positions,
                     bool inverse = false) {
  const std::vector<double> theta = frequencies(c);
  const Index d = c.dim;
  std::vector<double> R(d * d);
  MatrixD y(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i) {
    fill_rotation_matrix(c, theta, (long double)positions[i], inverse, R.data());
    const double* xi = x.data() + i * x.cols();
    double* yi = y.data() + i * y.cols();
    for (Index a = 0; a < d; ++a) {
      double sum = 0;
      for (Index b = 0; b < d; ++b) sum += R[a * d + b] * xi[b];
      yi[a] = sum;
    }
  }
  return y;
}

// Consecutive positions first, first + 1, ...
inline std::vector<Index> consecutive(Index rows, Index first) {
  std::vector<Index> p(rows);
  for (Index i = 0; i < rows; ++i) p[i] = first + i;
  return p;
}

// RoFormer's long-term decay bound, evaluated the slow way: for every j the partial sum
// S_j = sum_{i<j} exp(1j m theta_i) is recomputed from scratch (O((r/2)^2) per m) and its modulus
// taken from its real and imaginary parts; decay(m) = mean_j |S_j|, j = 1 .. r/2.
inline std::vector<double> decay_curve(const std::vector<double>& theta, Index max_distance) {
  const Index half = Index(theta.size());
  std::vector<double> curve(max_distance + 1);
  for (Index m = 0; m <= max_distance; ++m) {
    long double total = 0;
    for (Index j = 1; j <= half; ++j) {
      long double re = 0, im = 0;
      for (Index i = 0; i < j; ++i) {
        re += std::cos((long double)m * (long double)theta[i]);
        im += std::sin((long double)m * (long double)theta[i]);
      }
      total += std::sqrt(re * re + im * im);
    }
    curve[m] = double(total / half);
  }
  return curve;
}

}  // namespace linrope::reference
