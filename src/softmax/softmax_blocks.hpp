// Private: what the softmax forward (softmax_kernel.cpp) and backward (softmax_backward.cpp)
// kernels share: their blocking, the row-major maps they compute on, and 64-byte aligned scratch.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <linrope/attention.hpp>
#include <linrope/types.hpp>
#include <memory>
#include <new>
#include <vector>

#include "common/parallel.hpp"

namespace linrope::detail::softmax {

// Keys per streamed block when options.block_size is 0, and the largest block of queries. A block
// of 128 queries x 256 keys keeps S (128 KiB in float) and the packed GEMM operands in L2, and each
// GEMM (128 x 256 x 64: 4 MFLOP) is large enough for Eigen's packing to cost a few percent.
constexpr Index kDefaultKeyBlock = 256;
constexpr Index kMaxQueryBlock = 128;
// Blocks of queries are multiples of this (the register tile of Eigen's float GEMM is 16-48 rows).
constexpr Index kQueryBlockQuantum = 16;

// Rows per parallel task (blocks of queries; the backward's blocks of keys too): at most
// kMaxQueryBlock, but small enough that every thread gets several blocks (dynamic scheduling then
// balances the causal triangle). Depends on the length only, never on the thread count, so that
// the result does not depend on how many threads run.
inline Index task_block_size(Index rows) {
  const Index target = (rows + 7) / 8;  // >= 8 blocks when rows allow
  const Index rounded = (target + kQueryBlockQuantum - 1) / kQueryBlockQuantum * kQueryBlockQuantum;
  return std::clamp(rounded, kQueryBlockQuantum, kMaxQueryBlock);
}

// Elements per streamed block: options.block_size, or kDefaultKeyBlock when it is 0; at most
// `length` (the streamed sequence), at least 1.
inline Index stream_block_size(Index block_size, Index length) {
  return std::max<Index>(1, std::min(block_size > 0 ? block_size : kDefaultKeyBlock, length));
}

// The causal mask: query i (position q_offset + i) admits key j (position k_offset + j) when
// k_offset + j <= q_offset + i; without causal, every key. For a key, the queries that admit it are
// a suffix; for a query, the keys it admits are a prefix.

// Keys [0, end) that some query of a block admits: `rows` queries from position first_pos.
inline Index keys_admitted_by_block(const SoftmaxOptions& options, Index first_pos, Index rows,
                                    Index n_k) {
  if (!options.causal) return n_k;
  return std::clamp(first_pos + rows - options.k_offset, Index(0), n_k);
}

// How many of the keys [j0, j0 + cols) (a prefix) the query at position `pos` admits.
inline Index keys_admitted(const SoftmaxOptions& options, Index pos, Index j0, Index cols) {
  if (!options.causal) return cols;
  return std::clamp(pos - options.k_offset - j0 + 1, Index(0), cols);
}

// How many of the queries [i0, i0 + rows) (a prefix) do not admit the key at position `pos`.
inline Index queries_before(const SoftmaxOptions& options, Index pos, Index i0, Index rows) {
  if (!options.causal) return 0;
  return std::clamp(pos - options.q_offset - i0, Index(0), rows);
}

template <class T>
using RowMap = Eigen::Map<Matrix<T>>;
template <class T>
using ConstRowMap = Eigen::Map<const Matrix<T>>;
template <class T>
using StridedRowMap = Eigen::Map<Matrix<T>, Eigen::Aligned64, Eigen::OuterStride<>>;
// A row of scores that starts on a 64-byte boundary.
template <class T>
using AlignedRow = Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>, Eigen::Aligned64>;

// Why alignment matters for more than speed: Eigen's vectorised sum, max and exp handle the
// elements before the first aligned address with scalar code (std::exp, another summation order),
// so the same row at another address rounds differently. Every row of scores starts on a 64-byte
// boundary, so the result never depends on where a thread's scratch happens to be allocated.
constexpr std::size_t kAlign = 64;

template <class T>
Index aligned_stride(Index cols) {
  constexpr Index per_line = Index(kAlign / sizeof(T));
  return (cols + per_line - 1) / per_line * per_line;
}

template <class T>
struct AlignedFree {
  void operator()(T* p) const { std::free(p); }
};
template <class T>
using AlignedArray = std::unique_ptr<T[], AlignedFree<T>>;
template <class T>
AlignedArray<T> aligned_array(Index count) {
  const std::size_t bytes =
      (std::size_t(std::max<Index>(count, 1)) * sizeof(T) + kAlign - 1) / kAlign * kAlign;
  T* p = static_cast<T*>(std::aligned_alloc(kAlign, bytes));
  if (p == nullptr) throw std::bad_alloc();
  return AlignedArray<T>(p);
}

// Threads for one pass over a head: problems under 1e5 multiply-adds (n n_k width) run in the
// calling thread, where waking a team would cost more than it saves; so does everything when
// `threading` is Serial (the caller is inside a parallel region already).
inline int pass_threads(Index n, Index n_k, Index width, Threads threading) {
  const bool tiny = double(n) * double(n_k) * double(width) < 1e5;
  return tiny ? 1 : usable_threads(threading);
}

// run(t, workspace) for every task t in [0, tasks), dynamically scheduled on workspaces.size()
// threads, each thread with its own workspace (built before the region, so that nothing inside it
// allocates). Run serially (one thread, or one task), the caller's thread uses the first, whatever
// its number in an enclosing team.
template <class Workspace, class Run>
void run_tasks(Index tasks, std::vector<Workspace>& workspaces, Run run) {
  const bool team = workspaces.size() > 1 && tasks > 1;
  parallel_for(tasks, int(workspaces.size()), Schedule::Dynamic,
               [&](Index t) { run(t, workspaces[team ? thread_id() : 0]); });
}

}  // namespace linrope::detail::softmax
