// Exact softmax attention for one head: the streaming (online-softmax) kernel.
#include "softmax/softmax_kernel.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <linrope/attention.hpp>
#include <vector>

#include "common/block_cache.hpp"
#include "common/check.hpp"
#include "common/gemm.hpp"
#include "common/parallel.hpp"
#include "rope/rope_access.hpp"
#include "softmax/softmax_blocks.hpp"

namespace linrope {
namespace detail {
namespace {

using namespace detail::softmax;

// Per-thread scratch, allocated before the parallel region so that nothing inside it can throw.
template <class T>
struct Workspace {
  Workspace(Index bq, Index bk, Index d, Index d_v)
      : s_stride(aligned_stride<T>(bk)),
        q(aligned_array<T>(bq * d)),
        s(aligned_array<T>(bq * s_stride)),
        acc(aligned_array<T>(bq * d_v)),
        row_max(aligned_array<T>(bq)),
        row_sum(aligned_array<T>(bq)) {}
  Index s_stride;       // row stride of s, a multiple of 64 bytes
  AlignedArray<T> q;    // [bq x d] scaled (and rotated) queries
  AlignedArray<T> s;    // [bq x bk] scores, then probabilities
  AlignedArray<T> acc;  // [bq x d_v] unnormalised output
  AlignedArray<T> row_max, row_sum;
};

struct Geometry {
  Index n, n_k, d, d_v;
  Index bq, bk;      // queries per block, keys per streamed block
  Index key_blocks;  // ceil(n_k / bk)
  Index splits;      // slices of the keys processed as separate tasks (1: none)
};

// The running state of one block of queries: unnormalised output, running max and running sum.
template <class T>
struct BlockState {
  T* acc;  // [rows x d_v]
  T* row_max;
  T* row_sum;
};

// Streams key blocks [kb_begin, kb_end) (in units of bk keys) past the queries [i0, i0 + rows),
// starting from an empty state. k points at the rotated keys when there is a rope.
template <class T>
void stream_keys(const T* q, const T* k, const T* v, Index i0, Index rows, Index kb_begin,
                 Index kb_end, const Geometry& g, const SoftmaxOptions& options, T scale,
                 Workspace<T>& ws, BlockState<T> state) {
  const Index d = g.d, d_v = g.d_v, bk = g.bk;
  RowMap<T> acc(state.acc, rows, d_v);
  acc.setZero();
  T* row_max = state.row_max;
  T* row_sum = state.row_sum;
  std::fill_n(row_max, rows, -std::numeric_limits<T>::infinity());
  std::fill_n(row_sum, rows, T(0));

  const Index first_pos = options.q_offset + i0;  // position of the block's first query
  const Index key_end = keys_admitted_by_block(options, first_pos, rows, g.n_k);
  const Index j_begin = kb_begin * bk, j_end = std::min(kb_end * bk, key_end);
  if (j_begin >= j_end) return;

  RowMap<T> qb(ws.q.get(), rows, d);
  qb = scale * ConstRowMap<T>(q + i0 * d, rows, d);
  if (options.rope != nullptr)
    RopeAccess::rotate_rows(*options.rope, qb.data(), rows, d, options.q_offset + i0,
                            detail::Turn::Apply);

  for (Index j0 = j_begin; j0 < j_end; j0 += bk) {
    const Index cols = std::min(bk, j_end - j0);
    StridedRowMap<T> s(ws.s.get(), rows, cols, Eigen::OuterStride<>(ws.s_stride));
    gemm(const_view(qb), const_view(ConstRowMap<T>(k + j0 * d, cols, d)).transposed(), view(s),
         Write::Overwrite);
    for (Index i = 0; i < rows; ++i) {
      T* srow = ws.s.get() + i * ws.s_stride;
      const Index len = keys_admitted(options, first_pos + i, j0, cols);
      if (len == 0) {  // no admissible key here: zero weights, running state unchanged
        std::fill_n(srow, cols, T(0));
        continue;
      }
      AlignedRow<T> p(srow, len);
      const T new_max = std::max(row_max[i], p.maxCoeff());
      // exp(-inf) = 0 on the first admissible block: the empty accumulator is simply replaced.
      // Once the running max has settled, most blocks leave it unchanged: skip the scalar exp.
      const T alpha = new_max == row_max[i] ? T(1) : std::exp(row_max[i] - new_max);
      p = (p - new_max).exp();
      // Inadmissible scores become exact zeros (rather than exp(-inf), which Eigen's vectorised
      // exp clamps to a tiny non-zero), so later values enter P V only as 0 * v_j = 0.
      std::fill(srow + len, srow + cols, T(0));
      row_sum[i] = alpha * row_sum[i] + p.sum();
      row_max[i] = new_max;
      if (alpha != T(1)) acc.row(i) *= alpha;
    }
    gemm(const_view(s), const_view(ConstRowMap<T>(v + j0 * d_v, cols, d_v)), view(acc), Write::Add);
  }
}

// The log-sum-exp of a row's scaled scores, max + log(sum) (the backward's P = exp(s - lse));
// -inf when no key was admissible.
template <class T>
T log_sum_exp(T max, T sum) {
  return sum > T(0) ? max + std::log(sum) : -std::numeric_limits<T>::infinity();
}

// out_i = acc_i / sum_i, or a zero row when no key was admissible; lse (if not null) its
// log-sum-exp.
template <class T>
void normalise(const BlockState<T>& state, Index rows, Index d_v, T* out, T* lse) {
  for (Index i = 0; i < rows; ++i) {
    RowMap<T> o(out + i * d_v, 1, d_v);
    if (state.row_sum[i] > T(0))
      o = ConstRowMap<T>(state.acc + i * d_v, 1, d_v) / state.row_sum[i];
    else
      o.setZero();
    if (lse != nullptr) lse[i] = log_sum_exp(state.row_max[i], state.row_sum[i]);
  }
}

// Combines the states of the key slices for rows [i0, i0 + rows): rescales each slice to the
// common max M, o_i = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s. Slices are added in order,
// so the result does not depend on which thread computed which slice.
template <class T>
void merge_slices(const std::vector<BlockState<T>>& slices, Index i0, Index rows, Index d_v, T* out,
                  T* lse) {
  for (Index i = i0; i < i0 + rows; ++i) {
    T m = -std::numeric_limits<T>::infinity();
    for (const BlockState<T>& s : slices) m = std::max(m, s.row_max[i]);
    RowMap<T> o(out + i * d_v, 1, d_v);
    o.setZero();
    if (lse != nullptr) lse[i] = -std::numeric_limits<T>::infinity();
    if (m == -std::numeric_limits<T>::infinity()) continue;  // no admissible key at all
    T total = 0;
    for (const BlockState<T>& s : slices) {
      if (s.row_sum[i] == T(0)) continue;  // nothing admissible in this slice
      const T w = std::exp(s.row_max[i] - m);
      total = std::fma(w, s.row_sum[i], total);
      // One rounding per element, spelt out: written as an Eigen expression on `out` (the
      // caller's memory, at any address), the elements before its first aligned address would
      // take a scalar path that the compiler may contract differently from the vector one.
      const T* acc = s.acc + i * d_v;
      for (Index c = 0; c < d_v; ++c) o(0, c) = std::fma(w, acc[c], o(0, c));
    }
    o /= total;
    if (lse != nullptr) lse[i] = log_sum_exp(m, total);
  }
}

// Slices of keys: with fewer than kMinTasks blocks of queries (short queries against a long key
// cache, e.g. decoding) the keys are cut into slices of >= kMinSliceKeys that run as separate tasks
// and are merged. Chosen from n and n_k only, like the blocks of queries.
constexpr Index kMinTasks = 8;
constexpr Index kMinSliceKeys = 1024;

Index key_splits(Index query_blocks, Index key_blocks, Index bk) {
  if (query_blocks >= kMinTasks) return 1;
  const Index wanted = (kMinTasks + query_blocks - 1) / query_blocks;
  const Index possible = std::max<Index>(1, key_blocks * bk / kMinSliceKeys);
  return std::min({wanted, possible, key_blocks});
}

}  // namespace

template <class T>
void softmax_head(const SoftmaxHead<T>& head, const SoftmaxOptions& options, Threads threading) {
  const T *q = head.q, *k = head.k, *v = head.v;
  T* out = head.out;
  T* lse = head.lse;
  const Index n = head.n, n_k = head.n_k, d = head.d, d_v = head.d_v;
  if (n == 0 || d_v == 0) return;
  if (n_k == 0) {
    std::fill_n(out, n * d_v, T(0));
    if (lse != nullptr) std::fill_n(lse, n, -std::numeric_limits<T>::infinity());
    return;
  }
  const T scale = T(softmax_scale(d, options));
  Geometry g{};
  g.n = n, g.n_k = n_k, g.d = d, g.d_v = d_v;
  g.bq = task_block_size(n);
  g.bk = stream_block_size(options.block_size, n_k);
  g.key_blocks = (n_k + g.bk - 1) / g.bk;
  const Index query_blocks = (n + g.bq - 1) / g.bq;
  g.splits = key_splits(query_blocks, g.key_blocks, g.bk);

  // RoPE on a copy: the caller's keys stay untouched.
  const CachedArray<T> k_rotated(options.rope != nullptr ? n_k * d : 0);
  if (options.rope != nullptr) {
    RopeAccess::rotate_rows(*options.rope, k, k_rotated.get(), n_k, d, options.k_offset,
                            detail::Turn::Apply);
    k = k_rotated.get();
  }

  const int threads = pass_threads(n, n_k, d + d_v, threading);
  std::vector<Workspace<T>> workspaces;
  workspaces.reserve(threads);
  for (int t = 0; t < threads; ++t) workspaces.emplace_back(g.bq, g.bk, d, d_v);
  // The states of the key slices, [n x d_v] and [n] each, when the keys are split.
  const CachedArray<T> slice_storage(g.splits > 1 ? g.splits * n * (d_v + 2) : 0);
  std::vector<BlockState<T>> slices;
  if (g.splits > 1) {
    for (Index s = 0; s < g.splits; ++s) {
      T* base = slice_storage.get() + s * n * (d_v + 2);
      slices.push_back({base, base + n * d_v, base + n * d_v + n});
    }
  }

  // Slices of a block of queries still running; the task that finishes last merges them, so that
  // the region needs no barrier besides its end (each barrier can cost a time slice on a busy
  // machine). acq_rel: the last task sees every other slice's state.
  std::vector<std::atomic<Index>> pending(g.splits > 1 ? query_blocks : 0);
  for (auto& p : pending) p.store(g.splits, std::memory_order_relaxed);

  const Index tasks = query_blocks * g.splits;
  const auto run = [&](Index t, Workspace<T>& ws) {
    // Causal: later blocks see more keys, so they go first (largest jobs first balances best).
    const Index qblock = options.causal ? query_blocks - 1 - t / g.splits : t / g.splits;
    const Index split = t % g.splits;
    const Index i0 = qblock * g.bq, rows = std::min(g.bq, n - i0);
    const Index kb_begin = split * g.key_blocks / g.splits;
    const Index kb_end = (split + 1) * g.key_blocks / g.splits;
    if (g.splits == 1) {
      const BlockState<T> state{ws.acc.get(), ws.row_max.get(), ws.row_sum.get()};
      stream_keys(q, k, v, i0, rows, kb_begin, kb_end, g, options, scale, ws, state);
      normalise(state, rows, d_v, out + i0 * d_v, lse != nullptr ? lse + i0 : nullptr);
      return;
    }
    const BlockState<T>& s = slices[split];
    stream_keys(q, k, v, i0, rows, kb_begin, kb_end, g, options, scale, ws,
                BlockState<T>{s.acc + i0 * d_v, s.row_max + i0, s.row_sum + i0});
    if (pending[qblock].fetch_sub(1, std::memory_order_acq_rel) == 1)
      merge_slices(slices, i0, rows, d_v, out, lse);
  };

  run_tasks(tasks, workspaces, run);
}

template void softmax_head<float>(const SoftmaxHead<float>&, const SoftmaxOptions&, Threads);
template void softmax_head<double>(const SoftmaxHead<double>&, const SoftmaxOptions&, Threads);

}  // namespace detail
}  // namespace linrope
