// Private: the gradient of exact softmax attention for one head, on raw row-major buffers, shared
// by the single-head entry points (softmax_attention.cpp) and the [batch, heads, n, d] ones
// (softmax_batched.cpp).
#pragma once

#include <linrope/attention.hpp>

#include "common/parallel.hpp"

namespace linrope::detail {

// The gradient of L = sum(d_out .* out) for the forward of softmax_kernel.hpp,
//   o_i = sum_j P_ij v_j, P_ij = softmax_j(s_ij), s_ij = scale <R_i q_i, R_j k_j>:
//   dv_j = sum_i P_ij d_out_i
//   dS_ij = P_ij (<d_out_i, v_j> - D_i), D_i = <d_out_i, o_i>
//   dq_i = scale R_i^T sum_j dS_ij R_j k_j,   dk_j = scale R_j^T sum_i dS_ij R_i q_i
//   q [n x d], k [n_k x d], v [n_k x d_v], d_out [n x d_v] -> dq [n x d], dk [n_k x d],
//   dv [n_k x d_v], every buffer row-major and contiguous (row stride = its width).
// One pass over blocks of queries computes S = qs kr^T and dP = d_out V^T once for every admitted
// (query, key) pair, into a strip [block x n_k] per thread: the strip gives each row's log-sum-exp
// and D_i = sum_j P_ij dP_ij (= <d_out_i, o_i>, so the forward never runs again), then P and
// dS = P (dP - D) give dq, dk and dv. Five block products against the forward's two
// (FlashAttention-2's recomputation took nine, measured 4.8x the forward's time; this one 1.8-3.9x
// in same-run medians on a shared, loaded machine, main-thread CPU time 2.6-3.3x; causal, n = 4096,
// d = 64, 8 heads, float, 2 threads). Blocks of queries form parts (cut by the shapes only); each
// part's blocks run in order in one task, which owns dq's rows and sums its terms of dk and dv into
// the part's own copies, added in part order at the end: nothing is shared between threads and the
// bits do not depend on the thread count. Memory O((n + n_k)(d + d_v)) for the rotated copies and
// at most 8 parts, plus O(block n_k) per thread for the strip; never n x n. A query with no
// admissible key (zero output) gets a zero dq row and contributes nothing. Arguments must already
// be validated (as for softmax_head, and d_out finite); only std::bad_alloc can be thrown.
// `threading` as for softmax_head: the result is bitwise the same whatever it and the thread
// count.
template <class T>
struct SoftmaxBackwardHead {
  const T* q;      // [n x d]
  const T* k;      // [n_k x d]
  const T* v;      // [n_k x d_v]
  const T* d_out;  // [n x d_v]
  T* dq;           // [n x d]
  T* dk;           // [n_k x d]
  T* dv;           // [n_k x d_v]
  Index n, n_k, d, d_v;
};
template <class T>
void softmax_head_backward(const SoftmaxBackwardHead<T>& head, const SoftmaxOptions& options,
                           Threads threading);

extern template void softmax_head_backward<float>(const SoftmaxBackwardHead<float>&,
                                                  const SoftmaxOptions&, Threads);
extern template void softmax_head_backward<double>(const SoftmaxBackwardHead<double>&,
                                                   const SoftmaxOptions&, Threads);

}  // namespace linrope::detail
