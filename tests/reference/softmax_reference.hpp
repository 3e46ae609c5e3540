// Naive reference for exact softmax attention: explicit d x d rotation matrices and an explicit
// n x n_k score matrix. Deliberately shares no code with src/ (it does not call linrope::Rope):
// the fast kernel is proven against this.
//
// The attention itself (textbook_softmax_attention) is written once, for any scalar type: in
// double, after the explicit rotations, it is the tests' oracle (softmax_attention below); in
// float it is the O(n^2)-memory baseline that bench_softmax and the scaling experiment time
// beside the streaming kernel.
#pragma once

#include <algorithm>
#include <cmath>
#include <linrope/rope.hpp>  // RopeLayout and RopeConfig only (no code)
#include <linrope/types.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "rope_reference.hpp"

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
// half), identity on the pass-through dims. Rows are rotated as x -> R_p x. Built by
// rope_reference.hpp, the one place the reference writes a rotation matrix from a configuration.
inline MatrixD plain_rope_matrix(const PlainRope& rope, Index position) {
  return rotation_matrix(
      RopeConfig{
          .dim = rope.dim, .rotary_dim = rope.rotary_dim, .base = rope.base, .layout = rope.layout},
      (long double)position);
}

// Softmax attention the textbook way, on rows already rotated (or not rotated at all):
//   S = q k^T [n x n_k], materialised. Row i keeps its admissible keys, a prefix of length
//   a_i = n_k (not causal) or clamp(q_offset + i - k_offset + 1, 0, n_k) (causal: p_j <= p_i);
//   o_i = sum_{j < a_i} softmax_j(scale S_ij) v_j, exponentiated after subtracting the row's
//   largest scaled score (so that large scores do not overflow); a row with no admissible key
//   is zero.
//   q [n x d], k [n_k x d], v [n_k x d_v] -> out [n x d_v]; scores: scratch, resized to n x n_k
//   (the caller keeps it, so that a loop over heads allocates it once: 4 n n_k bytes in float).
// Eigen's products and array expressions; no linrope code. (The products were plain loops in the
// oracle before it served as the timed baseline too; Eigen's GEMM is what linear_reference.hpp
// already used, and test_gemm proves the kernels' own product against matmul_reference.hpp's
// triple loop.)
template <class T>
void textbook_softmax_attention(const Eigen::Ref<const Matrix<T>>& q,
                                const Eigen::Ref<const Matrix<T>>& k,
                                const Eigen::Ref<const Matrix<T>>& v, double scale, bool causal,
                                Index q_offset, Index k_offset, Matrix<T>& scores,
                                Eigen::Ref<Matrix<T>> out) {
  const Index n = q.rows(), n_k = k.rows();
  const T s = T(scale);
  scores.resize(n, n_k);
  // Inside a parallel region Eigen keeps this product on the calling thread.
  scores.noalias() = q * k.transpose();
#ifdef _OPENMP
  // Rows in parallel for the large single calls that bench_softmax times (n n_k >= 2^18), never
  // inside a parallel region (the scaling experiment's loop over heads: a nested team per head
  // waited on descheduled threads, 20-50x slower than one thread at n = 512 on a loaded machine)
  // nor for small problems, where a team's fork and join costs more than the rows (the
  // finite-difference tests call this thousands of times at n n_k < 10^4: 16x slower with 2
  // threads than with 1, measured at load 10 on 2 cores).
  const bool rows_in_parallel = !omp_in_parallel() && n * n_k >= (Index(1) << 18);
#pragma omp parallel for schedule(static) if (rows_in_parallel)
#endif
  for (Index i = 0; i < n; ++i) {
    auto row = scores.row(i);
    const Index admissible = causal ? std::clamp<Index>(q_offset + i - k_offset + 1, 0, n_k) : n_k;
    row.tail(n_k - admissible).setZero();
    if (admissible == 0) continue;
    auto head = row.head(admissible);
    // The largest of s S_ij: s max_j S_ij, or s min_j S_ij for a negative scale.
    const T top = s >= 0 ? head.maxCoeff() : head.minCoeff();
    head = ((head.array() - top) * s).exp();
    head /= head.sum();
  }
  out.noalias() = scores * v;
}

struct SoftmaxReferenceOptions {
  bool causal = false;
  double scale = 0;                 // 0 means 1/sqrt(d)
  const PlainRope* rope = nullptr;  // width d
  Index q_offset = 0, k_offset = 0;
};

// o_i = sum_j softmax_j(scale * <R_{p_i} q_i, R_{p_j} k_j>) v_j over the admissible j (all, or
// p_j <= p_i when causal), p_i = q_offset + i, p_j = k_offset + j; a row with no admissible key is
// zero. The rows are rotated by explicit matrices, then the full n x n_k score matrix is built
// (textbook_softmax_attention, in double).
//   q [n x d], k [n_k x d], v [n_k x d_v] -> [n x d_v]
inline MatrixD softmax_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                                 const SoftmaxReferenceOptions& options = {}) {
  const Index n = q.rows(), n_k = k.rows(), d = q.cols();
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
  MatrixD scores, out(n, v.cols());
  textbook_softmax_attention<double>(qr, kr, v, scale, options.causal, options.q_offset,
                                     options.k_offset, scores, out);
  return out;
}

}  // namespace linrope::reference
