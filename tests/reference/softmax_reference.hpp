// Naive reference for exact softmax attention, in double precision: explicit d x d rotation
// matrices and an explicit n x n_k score matrix. Deliberately shares no code with src/ (it does not
// call linrope::Rope): the fast kernel is proven against this.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <linrope/rope.hpp>  // RopeLayout only (an enum, no code)
#include <linrope/types.hpp>

namespace linrope::reference {

// Plain, un-scaled RoPE: theta_i = base^(-2i/r), i = 0 .. r/2 - 1; dims >= r pass through.
struct PlainRope {
  Index dim = 0;
  Index rotary_dim = 0;  // 0 means dim
  double base = 10000.0;
  RopeLayout layout = RopeLayout::Interleaved;
};

// The d x d rotation matrix R_p of the plain rope at position p: block-diagonal up to a
// permutation, a 2 x 2 rotation by p * theta_i on pair i ((2i, 2i+1) interleaved, (i, i + r/2)
// half), identity on the pass-through dims. Rows are rotated as x -> R_p x.
inline MatrixD plain_rope_matrix(const PlainRope& rope, Index position) {
  const Index d = rope.dim;
  const Index r = rope.rotary_dim == 0 ? d : rope.rotary_dim;
  MatrixD rot = MatrixD::Identity(d, d);
  for (Index i = 0; i < r / 2; ++i) {
    const double theta = std::pow(rope.base, -2.0 * double(i) / double(r));
    const double angle = double(position) * theta;
    const Index a = rope.layout == RopeLayout::Interleaved ? 2 * i : i;
    const Index b = rope.layout == RopeLayout::Interleaved ? 2 * i + 1 : i + r / 2;
    rot(a, a) = std::cos(angle);
    rot(a, b) = -std::sin(angle);
    rot(b, a) = std::sin(angle);
    rot(b, b) = std::cos(angle);
  }
  return rot;
}

struct SoftmaxReferenceOptions {
  bool causal = false;
  double scale = 0;                 // 0 means 1/sqrt(d)
  const PlainRope* rope = nullptr;  // width d
  Index q_offset = 0, k_offset = 0;
};

// o_i = sum_j softmax_j(scale * <R_{p_i} q_i, R_{p_j} k_j>) v_j over the admissible j (all, or
// p_j <= p_i when causal), p_i = q_offset + i, p_j = k_offset + j; a row with no admissible key is
// zero. The full n x n_k score matrix is built, then each row is exponentiated after subtracting
// its maximum (so that large scores do not overflow).
//   q [n x d], k [n_k x d], v [n_k x d_v] -> [n x d_v]
inline MatrixD softmax_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                                 const SoftmaxReferenceOptions& options = {}) {
  const Index n = q.rows(), n_k = k.rows(), d = q.cols(), d_v = v.cols();
  MatrixD qr = q, kr = k;
  if (options.rope != nullptr) {
    for (Index i = 0; i < n; ++i)
      qr.row(i) = (plain_rope_matrix(*options.rope, options.q_offset + i) * q.row(i).transpose())
                      .transpose();
    for (Index j = 0; j < n_k; ++j)
      kr.row(j) = (plain_rope_matrix(*options.rope, options.k_offset + j) * k.row(j).transpose())
                      .transpose();
  }
  const double scale =
      options.scale != 0 ? options.scale : (d > 0 ? 1.0 / std::sqrt(double(d)) : 1.0);
  const double minus_inf = -std::numeric_limits<double>::infinity();

  // Plain loops over the row-major storage (Eigen's checked operator() would make the n = 1000
  // cases take seconds in a sanitizer build).
  MatrixD scores(n, n_k);
  for (Index i = 0; i < n; ++i) {
    const double* qi = qr.data() + i * d;
    double* si = scores.data() + i * n_k;
    for (Index j = 0; j < n_k; ++j) {
      const bool admissible = !options.causal || options.k_offset + j <= options.q_offset + i;
      const double* kj = kr.data() + j * d;
      double dot = 0;
      for (Index c = 0; c < d; ++c) dot += qi[c] * kj[c];
      si[j] = admissible ? scale * dot : minus_inf;
    }
  }

  MatrixD out = MatrixD::Zero(n, d_v);
  for (Index i = 0; i < n; ++i) {
    double* si = scores.data() + i * n_k;
    double* oi = out.data() + i * d_v;
    double row_max = minus_inf;
    for (Index j = 0; j < n_k; ++j) row_max = std::max(row_max, si[j]);
    if (row_max == minus_inf) continue;  // no admissible key
    double total = 0;
    for (Index j = 0; j < n_k; ++j) {
      si[j] = si[j] == minus_inf ? 0.0 : std::exp(si[j] - row_max);
      total += si[j];
    }
    for (Index j = 0; j < n_k; ++j) {
      const double w = si[j] / total;
      const double* vj = v.data() + j * d_v;
      for (Index c = 0; c < d_v; ++c) oi[c] += w * vj[c];
    }
  }
  return out;
}

}  // namespace linrope::reference
