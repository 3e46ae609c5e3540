// Exact softmax attention for one head: the backward kernel, beside the forward's streaming
// kernel (softmax_kernel.cpp), whose blocking it shares.
#include "softmax/softmax_backward.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <linrope/attention.hpp>
#include <vector>

#include "common/block_cache.hpp"
#include "common/gemm.hpp"
#include "rope/rope_access.hpp"
#include "softmax/softmax_blocks.hpp"
#include "softmax/softmax_kernel.hpp"

namespace linrope {
namespace detail {
namespace {

using namespace detail::softmax;

// A stretch of a row of the strip: the rows are 64-byte aligned, so where Eigen's vector code
// starts within it (scalar code before the first aligned address) depends on the column only,
// never on where the scratch sits: the bits are the same whatever thread runs it.
template <class T>
using RowSpan = Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>>;

// What every task reads: the scores' operands as the forward forms them, and the upstream grad.
template <class T>
struct Operands {
  const T* qs;     // [n x d] scale R q: s = qs kr^T
  const T* kr;     // [n_k x d] R k
  const T* v;      // [n_k x d_v]
  const T* d_out;  // [n x d_v]
  Index n, n_k, d, d_v;
  Index bq, bk;  // queries per block (the strip's rows), keys per streamed block
  // kr^T, v^T and kr packed once for the whole head, where products use packed panels (else
  // null): every block of queries multiplies them.
  const PackedRight<T>*kr_t, *v_t, *kr_packed;
};

// a b[:, j0 : j0 + cols] into c, b packed (`packed`) when there is a packed form and the block
// lines up with its panels, else from its view: the same bits either way.
template <class T>
void product_with_block(ConstView<T> a, const PackedRight<T>* packed, ConstView<T> b, Index j0,
                        Index cols, View<T> c) {
  if (packed != nullptr && packed->blockable(j0))
    gemm(a, packed->block(packed->rows(), j0, cols), c, Write::Overwrite);
  else
    gemm(a, ConstView<T>{b.data + j0 * b.col_stride, b.rows, cols, b.row_stride, b.col_stride}, c,
         Write::Overwrite);
}

template <class T>
ConstView<T> rows_of(const T* data, Index first, Index rows, Index width) {
  return const_view(ConstRowMap<T>(data + first * width, rows, width));
}

// One thread's scratch, allocated before the parallel region so that nothing inside it can throw.
// The strip holds a block of queries' scores against every key it admits, so that S and dP are
// computed once and serve both the statistics (log-sum-exp, D) and the gradients.
template <class T>
struct Workspace {
  Workspace(Index bq, Index n_k, Index key_blocks, Index d)
      : stride(aligned_stride<T>(n_k) + 64 / Index(sizeof(T))),
        p(bq * stride),
        ds(bq * stride),
        grad(aligned_array<T>(bq * d)),
        block_max(aligned_array<T>(bq * key_blocks)),
        row_max(aligned_array<T>(bq)),
        sum(bq),
        dot(bq) {}
  Index stride;               // row stride of p and ds: a multiple of 64 bytes, plus one line
  CachedArray<T> p;           // [bq x n_k] exp(s - running max), then P
  CachedArray<T> ds;          // [bq x n_k] dP = d_out V^T, then dS = P (dP - D)
  AlignedArray<T> grad;       // [bq x d] dq of the rotated, scaled queries
  AlignedArray<T> block_max;  // [bq x key blocks] the running max each block's exp used
  AlignedArray<T> row_max;    // [bq]
  std::vector<double> sum;    // [bq] sum_j exp(s_ij - max), then its inverse
  std::vector<double> dot;    // [bq] sum_j exp(s_ij - max) dP_ij, then D_i
};

// A part of the queries: its blocks run in order in one task, which sums their dk and dv into the
// part's own buffers; the parts are added in order afterwards.
template <class T>
struct Part {
  Index block_begin, block_end;  // blocks of queries
  Index key_end;                 // keys [0, key_end) some query of the part admits
  // Transposed: the strip (P, dS) is then the right-hand factor of its products, which gemm packs
  // 32 adjacent values at a time, whereas as the left-hand one (P^T, dS^T) it went 8 at a time
  // (12% of the backward's time).
  Index stride;  // of dk_t's and dv_t's rows: n_k rounded up to a line, plus a line (no 2^k)
  T* dk_t;       // [d x n_k] qs^T dS
  T* dv_t;       // [d_v x n_k] d_out^T P
};

// The gradients of the queries [i0, i0 + rows), and their terms of dk and dv. Pass one: S and dP
// for every admitted block of keys into the strip, with each row's running max, sum of
// exp(s - max) and sum of exp(s - max) dP (D_i = sum_j P_ij dP_ij = <d_out_i, o_i>, so the
// forward's output is never needed); the strip keeps exp(s - the max then). Pass two: P and
// dS = P (dP - D) block by block, then dq += dS kr, dk += dS^T qs, dv += P^T d_out.
template <class T>
void query_block(const Operands<T>& a, Index i0, Index rows, const SoftmaxOptions& options, T scale,
                 Workspace<T>& ws, const Part<T>& part, T* dq) {
  const Index d = a.d, d_v = a.d_v, bk = a.bk, stride = ws.stride;
  const Index first_pos = options.q_offset + i0;  // position of the block's first query
  const Index key_end = keys_admitted_by_block(options, first_pos, rows, a.n_k);
  const Index key_blocks = (key_end + bk - 1) / bk;
  const T lowest = -std::numeric_limits<T>::infinity();
  std::fill_n(ws.row_max.get(), rows, lowest);
  std::fill_n(ws.sum.begin(), rows, 0.0);
  std::fill_n(ws.dot.begin(), rows, 0.0);
  // Key j0 of the strip's rows: 64-byte aligned only when j0 is a multiple of 16 floats.
  const auto strip = [&](T* base, Index j0, Index cols) {
    using Block = Eigen::Map<Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
    return Block(base + j0, rows, cols, Eigen::OuterStride<>(stride));
  };

  for (Index b = 0; b < key_blocks; ++b) {
    const Index j0 = b * bk, cols = std::min(bk, key_end - j0);
    auto s = strip(ws.p.get(), j0, cols);
    auto dp = strip(ws.ds.get(), j0, cols);
    product_with_block(rows_of(a.qs, i0, rows, d), a.kr_t, rows_of(a.kr, 0, a.n_k, d).transposed(),
                       j0, cols, view(s));
    product_with_block(rows_of(a.d_out, i0, rows, d_v), a.v_t,
                       rows_of(a.v, 0, a.n_k, d_v).transposed(), j0, cols, view(dp));
    for (Index i = 0; i < rows; ++i) {
      const Index len = keys_admitted(options, first_pos + i, j0, cols);
      T& max = ws.row_max[i];
      if (len > 0) {
        RowSpan<T> e(s.row(i).data(), len), dp_row(dp.row(i).data(), len);
        const T new_max = std::max(max, e.maxCoeff());
        if (new_max != max) {  // exp(-inf) = 0 on the first admitted block: empty sums stay 0
          const double alpha = std::exp(double(max) - double(new_max));
          ws.sum[i] *= alpha;
          ws.dot[i] *= alpha;
          max = new_max;
        }
        e = (e - max).exp();
        ws.sum[i] += double(e.sum());
        ws.dot[i] += double((e * dp_row).sum());
      }
      ws.block_max[i * key_blocks + b] = max;
    }
  }
  for (Index i = 0; i < rows; ++i) {  // a row with no admitted key: P = 0, D = 0
    const bool any = ws.sum[i] > 0;
    ws.dot[i] = any ? ws.dot[i] / ws.sum[i] : 0.0;
    ws.sum[i] = any ? 1.0 / ws.sum[i] : 0.0;
  }

  for (Index i = 0; i < rows; ++i) {
    T* p_row = ws.p.get() + i * stride;
    T* ds_row = ws.ds.get() + i * stride;
    const Index admitted = keys_admitted(options, first_pos + i, 0, key_end);
    for (Index b = 0; b * bk < admitted; ++b) {
      const Index j0 = b * bk, len = std::min(bk, admitted - j0);
      // P = exp(s - m_b) exp(m_b - m) / sum: the one exp per score was taken in pass one.
      const T max = ws.row_max[i], used = ws.block_max[i * key_blocks + b];
      const T c = T(std::exp(double(used) - double(max)) * ws.sum[i]);
      RowSpan<T> p(p_row + j0, len), ds(ds_row + j0, len);
      p *= c;
      ds = p * (ds - T(ws.dot[i]));
    }
    std::fill(p_row + admitted, p_row + key_end, T(0));  // inadmissible keys: exact zeros
    std::fill(ds_row + admitted, ds_row + key_end, T(0));
  }
  // The three products over the whole strip rather than block by block: the block's d_out and qs
  // rows serve every key at once (packing them per block of keys was 9% of the time).
  const auto p = strip(ws.p.get(), 0, key_end);
  const auto ds = strip(ws.ds.get(), 0, key_end);
  RowMap<T> grad(ws.grad.get(), rows, d);
  gemm(rows_of(a.d_out, i0, rows, d_v).transposed(), const_view(p),
       View<T>{part.dv_t, d_v, key_end, part.stride}, Write::Add);
  if (d > 0) {
    gemm(rows_of(a.qs, i0, rows, d).transposed(), const_view(ds),
         View<T>{part.dk_t, d, key_end, part.stride}, Write::Add);
    if (a.kr_packed != nullptr)
      gemm(const_view(ds), a.kr_packed->block(key_end, 0, d), view(grad), Write::Overwrite);
    else
      gemm(const_view(ds), rows_of(a.kr, 0, key_end, d), view(grad), Write::Overwrite);
  }
  // d s / d(R q) = scale kr: the scale that qs carries, then R^T at the queries' positions.
  grad *= scale;
  if (options.rope != nullptr)
    RopeAccess::rotate_rows(*options.rope, grad.data(), dq + i0 * d, rows, d, first_pos,
                            Turn::Transpose);
  else
    RowMap<T>(dq + i0 * d, rows, d) = grad;
}

// Parts of >= kMinPartQueries queries, at most kMaxParts: enough tasks for 8 threads on long
// sequences, and memory for at most 8 extra copies of dk and dv. Causal parts are cut at equal
// shares of the admitted (query, key) pairs, so that they take about the same time.
constexpr Index kMinPartQueries = 512;
constexpr Index kMaxParts = 8;

template <class T>
std::vector<Part<T>> cut_parts(const Operands<T>& a, const SoftmaxOptions& options) {
  const Index blocks = (a.n + a.bq - 1) / a.bq;
  const Index parts = std::clamp<Index>(a.n / kMinPartQueries, 1, std::min(kMaxParts, blocks));
  const auto rows_of_block = [&](Index b) { return std::min(a.bq, a.n - b * a.bq); };
  const auto keys_of_block = [&](Index b) {
    return keys_admitted_by_block(options, options.q_offset + b * a.bq, rows_of_block(b), a.n_k);
  };
  std::vector<double> work(blocks + 1, 0.0);  // work[b]: pairs in the blocks before b
  for (Index b = 0; b < blocks; ++b)
    work[b + 1] = work[b] + double(rows_of_block(b)) * double(keys_of_block(b) + 1);
  std::vector<Part<T>> out;
  Index begin = 0;
  for (Index p = 0; p < parts; ++p) {
    Index end = blocks;
    if (p + 1 < parts) {
      const double share = work[blocks] * double(p + 1) / double(parts);
      end = begin + 1;
      while (end < blocks - (parts - 1 - p) && work[end] < share) ++end;
    }
    out.push_back({begin, end, keys_of_block(end - 1), 0, nullptr, nullptr});
    begin = end;
  }
  return out;
}

}  // namespace

template <class T>
void softmax_head_backward(const SoftmaxBackwardHead<T>& head, const SoftmaxOptions& options,
                           Threads threading) {
  const Index n = head.n, n_k = head.n_k, d = head.d, d_v = head.d_v;
  // No output (no query, no key, or no value width): L = 0 whatever the inputs.
  if (n == 0 || n_k == 0 || d_v == 0) {
    std::fill_n(head.dq, n * d, T(0));
    std::fill_n(head.dk, n_k * d, T(0));
    std::fill_n(head.dv, n_k * d_v, T(0));
    return;
  }
  const T scale = T(softmax_scale(d, options));
  const auto size = [](Index count) { return static_cast<std::size_t>(count); };

  // The scores' operands, as the forward forms them: qs = scale R q, kr = R k.
  CachedArray<T> qs(n * d), k_rotated(options.rope != nullptr ? n_k * d : 0);
  RowMap<T>(qs.get(), n, d) = scale * ConstRowMap<T>(head.q, n, d);
  const T* kr = head.k;
  if (options.rope != nullptr) {
    RopeAccess::rotate_rows(*options.rope, qs.get(), n, d, options.q_offset, Turn::Apply);
    RopeAccess::rotate_rows(*options.rope, head.k, k_rotated.get(), n_k, d, options.k_offset,
                            Turn::Apply);
    kr = k_rotated.get();
  }
  PackedRight<T> kr_t, v_t, kr_packed;
  if constexpr (kPackedKernel<T>) {
    kr_t = PackedRight<T>(rows_of(kr, 0, n_k, d).transposed());
    v_t = PackedRight<T>(rows_of(head.v, 0, n_k, d_v).transposed());
    kr_packed = PackedRight<T>(rows_of(kr, 0, n_k, d));
  }
  const bool packed = kPackedKernel<T>;
  const Operands<T> a{qs.get(),
                      kr,
                      head.v,
                      head.d_out,
                      n,
                      n_k,
                      d,
                      d_v,
                      task_block_size(n),
                      stream_block_size(options.block_size, n_k),
                      packed ? &kr_t : nullptr,
                      packed ? &v_t : nullptr,
                      packed ? &kr_packed : nullptr};

  // Blocks of queries and the parts they form depend on n, n_k and options only.
  std::vector<Part<T>> parts = cut_parts(a, options);
  const Index part_stride = aligned_stride<T>(n_k) + 64 / Index(sizeof(T));
  const Index part_size = part_stride * (d + d_v);
  const CachedArray<T> part_storage(Index(parts.size()) * part_size);
  for (std::size_t p = 0; p < parts.size(); ++p) {
    parts[p].dk_t = part_storage.get() + Index(p) * part_size;
    parts[p].dv_t = parts[p].dk_t + part_stride * d;
    parts[p].stride = part_stride;
  }
  const int threads = pass_threads(n, n_k, d + d_v, threading);
  const Index key_blocks = (n_k + a.bk - 1) / a.bk;
  std::vector<Workspace<T>> workspaces;
  for (int t = 0; t < threads; ++t) workspaces.emplace_back(a.bq, n_k, key_blocks, d);
  run_tasks(Index(parts.size()), workspaces, [&](Index p, Workspace<T>& ws) {
    const Part<T>& part = parts[size(p)];
    for (Index c = 0; c < d; ++c) std::fill_n(part.dk_t + c * part.stride, part.key_end, T(0));
    for (Index c = 0; c < d_v; ++c) std::fill_n(part.dv_t + c * part.stride, part.key_end, T(0));
    for (Index b = part.block_begin; b < part.block_end; ++b) {
      const Index i0 = b * a.bq;
      query_block(a, i0, std::min(a.bq, n - i0), options, scale, ws, part, head.dq);
    }
  });

  // dk and dv: the parts added in order (each up to its key_end), blocks of keys on all threads.
  // The sums stay transposed, in part 0's rows (dk^T over dv^T, contiguous row by row), and each
  // block is turned once at the end.
  const Eigen::OuterStride<> stride(part_stride);
  parallel_for(key_blocks, threads, Schedule::Static, [&](Index block) {
    const Index j0 = block * a.bk, cols = std::min(a.bk, n_k - j0);
    const auto keys_of = [&](const Part<T>& part) {
      return std::clamp(part.key_end - j0, Index(0), cols);
    };
    auto sum = StridedRowMap<T>(parts[0].dk_t, d + d_v, n_k, stride).middleCols(j0, cols);
    sum.rightCols(cols - keys_of(parts[0])).setZero();  // past part 0's key_end: never written
    for (std::size_t p = 1; p < parts.size(); ++p)
      sum.leftCols(keys_of(parts[p])) +=
          StridedRowMap<T>(parts[p].dk_t, d + d_v, n_k, stride).middleCols(j0, keys_of(parts[p]));
    RowMap<T> dk(head.dk + j0 * d, cols, d), dv(head.dv + j0 * d_v, cols, d_v);
    dk = sum.topRows(d).transpose();
    dv = sum.bottomRows(d_v).transpose();
    if (options.rope != nullptr)
      RopeAccess::rotate_rows(*options.rope, dk.data(), cols, d, options.k_offset + j0,
                              Turn::Transpose);
  });
}

template void softmax_head_backward<float>(const SoftmaxBackwardHead<float>&, const SoftmaxOptions&,
                                           Threads);
template void softmax_head_backward<double>(const SoftmaxBackwardHead<double>&,
                                            const SoftmaxOptions&, Threads);

}  // namespace detail
}  // namespace linrope
