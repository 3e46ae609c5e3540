// Exact softmax attention for one head: the backward kernel (FlashAttention-2's recomputation),
// beside the forward's streaming kernel (softmax_kernel.cpp), whose blocking it shares.
#include "softmax/softmax_backward.hpp"

#include <algorithm>
#include <cmath>
#include <linrope/attention.hpp>
#include <vector>

#include "common/gemm.hpp"
#include "rope/rope_access.hpp"
#include "softmax/softmax_blocks.hpp"
#include "softmax/softmax_kernel.hpp"

namespace linrope {
namespace detail {
namespace {

using namespace detail::softmax;

template <class T>
using ConstArrayRow = Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>>;

// One task's scratch, allocated before the parallel region so that nothing inside it can throw.
// A task owns `rows` gradient rows (queries in the first pass, keys in the second) and streams
// blocks of `cols` of the other side past them.
template <class T>
struct Workspace {
  Workspace(Index rows, Index cols, Index d, Index d_v)
      : stride(aligned_stride<T>(cols)),
        p(aligned_array<T>(rows * stride)),
        ds(aligned_array<T>(rows * stride)),
        grad(aligned_array<T>(rows * d)),
        dv(aligned_array<T>(rows * d_v)) {}
  Index stride;          // row stride of p and ds, a multiple of 64 bytes
  AlignedArray<T> p;     // [rows x cols] scores, then probabilities
  AlignedArray<T> ds;    // [rows x cols] d_out v^T (dP), then dS = P (dP - D)
  AlignedArray<T> grad;  // [rows x d] the gradient of the rotated, scaled queries or keys
  AlignedArray<T> dv;    // [rows x d_v] (key pass only) P^T d_out
};

// What both passes read: the forward's operands as the scores see them, and its statistics.
template <class T>
struct Operands {
  const T* qs;     // [n x d] scale R q: s = qs kr^T
  const T* kr;     // [n_k x d] R k
  const T* v;      // [n_k x d_v]
  const T* d_out;  // [n x d_v]
  const T* lse;    // [n] each row's log-sum-exp
  const T* delta;  // [n] D_i = <d_out_i, o_i>
  Index n, n_k, d, d_v;
};

template <class T>
ConstView<T> rows_of(const T* data, Index first, Index rows, Index width) {
  return const_view(ConstRowMap<T>(data + first * width, rows, width));
}

// One row of `count` scores: p = exp(p - lse), its first `skip` entries then set to exact zeros
// (inadmissible: their exp(s - lse) may be anything, even inf for a query with no admissible key,
// lse = -inf), and ds = p (ds - delta). lse and delta are a scalar (a query's row) or a row (a
// key's row, one per query). Rows start on 64-byte boundaries, so Eigen's vector exp runs from the
// first element: the bits do not depend on where the scratch sits.
template <class T, class Stat>
void probabilities_and_ds(T* p_row, T* ds_row, Index count, Index skip, const Stat& lse,
                          const Stat& delta) {
  AlignedRow<T> p(p_row, count), ds(ds_row, count);
  p = (p - lse).exp();
  std::fill_n(p_row, skip, T(0));
  ds = p * (ds - delta);
}

// dq for the queries [i0, i0 + rows): S = qs K^T and dP = d_out V^T over the blocks of bk
// admissible keys, dS = P (dP - D), dq = scale R^T sum dS kr.
template <class T>
void query_pass(const Operands<T>& a, Index i0, Index rows, Index bk, const SoftmaxOptions& options,
                T scale, Workspace<T>& ws, T* dq) {
  const Index d = a.d, d_v = a.d_v;
  RowMap<T> grad(ws.grad.get(), rows, d);
  grad.setZero();
  const Index first_pos = options.q_offset + i0;  // position of the block's first query
  const Index key_end = keys_admitted_by_block(options, first_pos, rows, a.n_k);
  for (Index j0 = 0; j0 < key_end; j0 += bk) {
    const Index cols = std::min(bk, key_end - j0);
    StridedRowMap<T> s(ws.p.get(), rows, cols, Eigen::OuterStride<>(ws.stride));
    StridedRowMap<T> ds(ws.ds.get(), rows, cols, Eigen::OuterStride<>(ws.stride));
    gemm(rows_of(a.qs, i0, rows, d), rows_of(a.kr, j0, cols, d).transposed(), view(s), false);
    gemm(rows_of(a.d_out, i0, rows, d_v), rows_of(a.v, j0, cols, d_v).transposed(), view(ds),
         false);
    for (Index i = 0; i < rows; ++i) {
      T* ds_row = ws.ds.get() + i * ws.stride;
      const Index len = keys_admitted(options, first_pos + i, j0, cols);
      if (len > 0)
        probabilities_and_ds(ws.p.get() + i * ws.stride, ds_row, len, Index(0), a.lse[i0 + i],
                             a.delta[i0 + i]);
      std::fill(ds_row + len, ds_row + cols, T(0));  // inadmissible keys: exact zeros
    }
    if (d > 0) gemm(const_view(ds), rows_of(a.kr, j0, cols, d), view(grad), true);
  }
  // d s / d(R q) = scale kr: the scale that qs carries, then R^T at the queries' positions.
  grad *= scale;
  if (options.rope != nullptr)
    RopeAccess::rotate_rows(*options.rope, grad.data(), dq + i0 * d, rows, d, first_pos,
                            Turn::Transpose);
  else
    RowMap<T>(dq + i0 * d, rows, d) = grad;
}

// dk and dv for the keys [j0, j0 + cols): S^T = kr qs^T and dP^T = V d_out^T over the blocks of
// bq queries that may see them, dv = sum P^T d_out, dk = R^T sum dS^T qs.
template <class T>
void key_pass(const Operands<T>& a, Index j0, Index cols, Index bq, const SoftmaxOptions& options,
              Workspace<T>& ws, T* dk, T* dv) {
  const Index d = a.d, d_v = a.d_v;
  RowMap<T> grad(ws.grad.get(), cols, d), grad_v(ws.dv.get(), cols, d_v);
  grad.setZero();
  grad_v.setZero();
  const Index first_pos = options.k_offset + j0;  // position of the block's first key
  const Index query_begin = queries_before(options, first_pos, 0, a.n);  // see no key of the block
  for (Index i0 = query_begin; i0 < a.n; i0 += bq) {
    const Index rows = std::min(bq, a.n - i0);
    StridedRowMap<T> p(ws.p.get(), cols, rows, Eigen::OuterStride<>(ws.stride));
    StridedRowMap<T> ds(ws.ds.get(), cols, rows, Eigen::OuterStride<>(ws.stride));
    gemm(rows_of(a.kr, j0, cols, d), rows_of(a.qs, i0, rows, d).transposed(), view(p), false);
    gemm(rows_of(a.v, j0, cols, d_v), rows_of(a.d_out, i0, rows, d_v).transposed(), view(ds),
         false);
    const ConstArrayRow<T> lse(a.lse + i0, rows), delta(a.delta + i0, rows);
    for (Index c = 0; c < cols; ++c) {
      T* p_row = ws.p.get() + c * ws.stride;
      T* ds_row = ws.ds.get() + c * ws.stride;
      const Index skip = queries_before(options, first_pos + c, i0, rows);
      if (skip < rows) {
        probabilities_and_ds(p_row, ds_row, rows, skip, lse, delta);
      } else {
        std::fill_n(p_row, rows, T(0));
        std::fill_n(ds_row, rows, T(0));
      }
    }
    gemm(const_view(p), rows_of(a.d_out, i0, rows, d_v), view(grad_v), true);
    if (d > 0) gemm(const_view(ds), rows_of(a.qs, i0, rows, d), view(grad), true);
  }
  RowMap<T>(dv + j0 * d_v, cols, d_v) = grad_v;
  if (options.rope != nullptr)
    RopeAccess::rotate_rows(*options.rope, grad.data(), dk + j0 * d, cols, d, first_pos,
                            Turn::Transpose);
  else
    RowMap<T>(dk + j0 * d, cols, d) = grad;
}

}  // namespace

template <class T>
void softmax_head_backward(const SoftmaxBackwardHead<T>& head, const SoftmaxOptions& options,
                           bool parallel) {
  const Index n = head.n, n_k = head.n_k, d = head.d, d_v = head.d_v;
  // No output (no query, no key, or no value width): L = 0 whatever the inputs.
  if (n == 0 || n_k == 0 || d_v == 0) {
    std::fill_n(head.dq, n * d, T(0));
    std::fill_n(head.dk, n_k * d, T(0));
    std::fill_n(head.dv, n_k * d_v, T(0));
    return;
  }
  const T scale = T(softmax_scale(d, options));

  // The forward again, for o and each row's log-sum-exp; then D_i = <d_out_i, o_i>, summed in
  // double in a fixed order (it is subtracted from dP, where its rounding would show).
  const auto size = [](Index count) { return static_cast<std::size_t>(count); };
  std::vector<T> out(size(n * d_v)), lse(size(n)), delta(size(n));
  softmax_head<T>({head.q, head.k, head.v, out.data(), n, n_k, d, d_v, lse.data()}, options,
                  parallel);
  for (Index i = 0; i < n; ++i) {
    double sum = 0;
    for (Index c = 0; c < d_v; ++c)
      sum += double(head.d_out[i * d_v + c]) * double(out[i * d_v + c]);
    delta[size(i)] = T(sum);
  }

  // The scores' operands, as the forward forms them: qs = scale R q, kr = R k.
  std::vector<T> qs(size(n * d)), k_rotated;
  RowMap<T>(qs.data(), n, d) = scale * ConstRowMap<T>(head.q, n, d);
  const T* kr = head.k;
  if (options.rope != nullptr) {
    RopeAccess::rotate_rows(*options.rope, qs.data(), n, d, options.q_offset, Turn::Apply);
    k_rotated.resize(size(n_k * d));
    RopeAccess::rotate_rows(*options.rope, head.k, k_rotated.data(), n_k, d, options.k_offset,
                            Turn::Apply);
    kr = k_rotated.data();
  }
  const Operands<T> a{qs.data(), kr, head.v, head.d_out, lse.data(), delta.data(), n, n_k, d, d_v};

  // Both passes: blocks of task_block_size rows own their gradient rows; the other side streams
  // in blocks of stream_block_size. Both depend on n, n_k and options only.
  const int threads = pass_threads(n, n_k, d + d_v, parallel);
  {
    const Index bq = task_block_size(n), bk = stream_block_size(options.block_size, n_k);
    const Index blocks = (n + bq - 1) / bq;
    std::vector<Workspace<T>> workspaces;
    for (int t = 0; t < threads; ++t) workspaces.emplace_back(bq, bk, d, 0);
    run_tasks(blocks, workspaces, [&](Index t, Workspace<T>& ws) {
      // Causal: later blocks see more keys, so they go first (largest jobs first balances best).
      const Index block = options.causal ? blocks - 1 - t : t;
      const Index i0 = block * bq;
      query_pass(a, i0, std::min(bq, n - i0), bk, options, scale, ws, head.dq);
    });
  }
  {
    const Index bk = task_block_size(n_k), bq = stream_block_size(options.block_size, n);
    const Index blocks = (n_k + bk - 1) / bk;
    std::vector<Workspace<T>> workspaces;
    for (int t = 0; t < threads; ++t) workspaces.emplace_back(bk, bq, d, d_v);
    // Causal: earlier keys are seen by more queries, so the natural order is largest first.
    run_tasks(blocks, workspaces, [&](Index block, Workspace<T>& ws) {
      const Index j0 = block * bk;
      key_pass(a, j0, std::min(bk, n_k - j0), bq, options, ws, head.dk, head.dv);
    });
  }
}

template void softmax_head_backward<float>(const SoftmaxBackwardHead<float>&, const SoftmaxOptions&,
                                           bool);
template void softmax_head_backward<double>(const SoftmaxBackwardHead<double>&,
                                            const SoftmaxOptions&, bool);

}  // namespace detail
}  // namespace linrope
