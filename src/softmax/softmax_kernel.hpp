// Private: the exact softmax attention kernel for one head, on raw row-major buffers, shared by the
// single-head entry points (softmax_attention.cpp) and the [batch, heads, n, d] ones
// (softmax_batched.cpp).
#pragma once

#include <linrope/attention.hpp>
#include <string_view>

#include "common/parallel.hpp"

namespace linrope::detail {

// Checks the options that do not depend on the data: a rope of width d, a finite scale >= 0 and
// block_size >= 0. Throws std::invalid_argument naming `function`.
void check_softmax_options(std::string_view function, Index d, const SoftmaxOptions& options);

// The scale actually used: options.scale, or 1/sqrt(d) when it is 0 (1 when d = 0: every score is
// the empty dot product 0 then, so any scale gives the same uniform weights).
double softmax_scale(Index d, const SoftmaxOptions& options);

// One head of exact softmax attention:
//   o_i = sum_j softmax_j(scale * <R_i q_i, R_j k_j>) v_j, causal: k_offset + j <= q_offset + i
//   q [n x d], k [n_k x d], v [n_k x d_v] -> out [n x d_v], every buffer row-major and contiguous
//   (row stride = its width); a query with no admissible key gets a zero row.
// Scores are computed in T: inputs so large that scale * <q_i, k_j> overflows T (|q| |k| scale
// beyond ~3e38 in float) give NaN rows; anything below that is safe, however large.
// Arguments must already be validated (shapes, finiteness, check_softmax_options); nothing is
// checked here. Only std::bad_alloc can be thrown (inside the parallel region, where the rope's
// angle buffers and gemm's packing buffers may be allocated, it is caught and rethrown after it).
// Keys stream in blocks of options.block_size (0 chooses) with an online softmax (running max,
// running sum, rescaled accumulator); each block is two GEMMs, Q_b K_b^T and P V_b. Memory
// O((n + n_k) d): a rotated copy of k when there is a rope, plus per-thread blocks; never n x n.
// Threads::Parallel: open an OpenMP region over blocks of queries (and over slices of keys when
// there are fewer than 8 blocks of queries, e.g. decoding against a long cache); Serial when
// calling from inside a parallel region, e.g. one head per thread. The blocking depends on n, n_k
// and options only, so the result is bitwise the same whatever `threading` and the thread count.
template <class T>
struct SoftmaxHead {
  const T* q;  // [n x d]
  const T* k;  // [n_k x d]
  const T* v;  // [n_k x d_v]
  T* out;      // [n x d_v]
  Index n, n_k, d, d_v;
  // Optional, [n]: each row's log-sum-exp of its scaled scores, max_j s_ij + log sum_j
  // exp(s_ij - max_j s_ij) over the admissible j (-inf for a row with none): the statistic a
  // FlashAttention-style backward saves (ours recomputes it, see softmax_backward.hpp).
  T* lse = nullptr;
};
template <class T>
void softmax_head(const SoftmaxHead<T>& head, const SoftmaxOptions& options, Threads threading);

extern template void softmax_head<float>(const SoftmaxHead<float>&, const SoftmaxOptions&, Threads);
extern template void softmax_head<double>(const SoftmaxHead<double>&, const SoftmaxOptions&,
                                          Threads);

}  // namespace linrope::detail
