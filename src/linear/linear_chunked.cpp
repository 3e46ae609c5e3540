// The chunked causal form: quadratic (masked GEMMs) inside each chunk of queries, the running
// state between chunks.
#include <algorithm>
#include <vector>

#include "linear/linear_blocks.hpp"
#include "linear/linear_forms.hpp"

namespace linrope::detail {

// Keys per block of a chunk's masked products (see causal_chunked): the GEMM micro-kernel's 32
// columns, the finest split of the score product that wastes no part of a tile.
constexpr Index kKeyBlock = 32;

// Chunked causal form: per chunk of queries, the state holds every key before the chunk's first
// visible key; the chunk's own keys enter through masked (rows x keys) GEMMs, a block of keys at a
// time, weighted with exp(c_j - M_i) computed once per run of queries sharing the same M_i.
template <class T>
void causal_chunked(const LinearHead<T>& head, const LinearSetup& setup, LinearState<T>& state,
                    FinalState final_state, DenominatorTally* tally) {
  const T *q = head.q, *k = head.k, *v = head.v;
  T* out = head.out;
  const Index n = head.n, n_k = head.n_k, q_offset = head.q_offset, k_offset = head.k_offset;
  // A chunk longer than the sequence is the whole sequence (and must not allocate chunk_size rows).
  const Index L = std::min(setup.options.chunk_size, std::max<Index>({n, n_k, 1}));
  const Index d = setup.d, d_v = setup.d_v;
  const Index shift = q_offset - k_offset;  // query i sees key j iff j <= i + shift
  FeatureBlock<T> queries(setup, Role::Queries, L), keys(setup, Role::Keys, L);
  queries.keep_into(head.keep_queries);
  keys.keep_into(head.keep_keys);
  Matrix<T> weighted, numerator, scores;
  Vector<T> weights, z_running;
  std::vector<double> query_max(L), den(L);
  std::vector<T> key_weight(L);
  Index absorbed = 0;  // keys [0, absorbed) are in the state
  const auto absorb_until = [&](Index end) {
    absorb_through(state, keys, k, v, k_offset, absorbed, end, weighted, weights);
  };
  for (Index qs = 0; qs < n; qs += L) {
    const Index rows = std::min(L, n - qs);
    const Index js = std::clamp(qs + shift, Index(0), n_k);
    const Index je = std::clamp(qs + rows + shift, Index(0), n_k);
    absorb_until(js);
    queries.compute(q + qs * d, rows, q_offset + qs);
    const Index kb = je - js;
    if (kb > 0) keys.compute(k + js * d, kb, k_offset + js);
    // The next chunk's rows, which this chunk's products fetch (gemm.hpp's Prefetch): its
    // queries and keys [je, next_je) during the read-out, its values and output rows during the
    // state update (elu+1 at n = 16384, 8 heads, 2 threads: 0.89x the time).
    const Index next_rows = std::min(L, n - qs - rows);
    const Index next_je = std::clamp(qs + rows + next_rows + shift, je, n_k);

    // Denominators and per-query maxima M_i, admitting the chunk's keys as they become visible.
    z_running = state.z;
    double m_running = state.M;
    Index next = 0;  // next key of the chunk, relative to js
    for (Index r = 0; r < rows; ++r) {
      for (; next < kb && js + next <= qs + r + shift; ++next)
        admit_key(z_running, m_running, keys.log_scale(next), keys.den().data() + next * setup.m,
                  setup.headroom);
      query_max[r] = m_running;
      den[r] = m_running == kEmpty ? 0.0 : double(queries.den().row(r).dot(z_running));
    }

    // Numerators: the state's part, then the chunk's own keys.
    numerator.resize(rows, d_v);
    if (state.M != kEmpty) {
      gemm(const_view(queries.num()), const_view(state.S), view(numerator), Write::Overwrite,
           Prefetch{{rows_of(q, d, qs + rows, next_rows), rows_of(k, d, je, next_je - je)}});
      for (Index r = 0; r < rows; ++r)
        if (query_max[r] > state.M) numerator.row(r) *= T(std::exp(state.M - query_max[r]));
    } else {
      numerator.setZero();
    }
    if (kb > 0) {
      // Query r sees keys [0, visible_r) of the chunk (j <= i + shift): a triangle of the
      // rows x kb block. Both products run one block of kKeyBlock keys at a time over the rows
      // from the first that sees the block's first key, so the block above the triangle is mostly
      // never computed (a quarter of both products for the default 64 x 64 chunk, nearly half for
      // long chunks), while each key and value is still packed once. An entry left out (r, j)
      // has j >= visible_r, so the masking loop zeroes it as it zeroed the whole block's.
      scores.resize(rows, kb);
      // product(c0, r0, width): keys c0 .. c0 + width - 1, seen from row r0 on.
      const auto for_each_key_block = [&](auto product) {
        for (Index c0 = 0; c0 < kb; c0 += kKeyBlock) {
          const Index r0 = std::clamp(js + c0 - qs - shift, Index(0), rows);  // sees key c0 first
          if (r0 == rows) break;
          product(c0, r0, std::min(kKeyBlock, kb - c0));
        }
      };
      for_each_key_block([&](Index c0, Index r0, Index width) {
        gemm(const_view(queries.num().bottomRows(rows - r0)),
             const_view(keys.num().middleRows(c0, width)).transposed(),
             View<T>{scores.data() + r0 * kb + c0, rows - r0, width, kb}, Write::Overwrite);
      });
      double weight_max = kEmpty;
      Index weight_count = 0;
      for (Index r = 0; r < rows; ++r) {
        const Index visible = std::clamp(qs + r + shift - js + 1, Index(0), kb);
        if (query_max[r] != weight_max) weight_max = query_max[r], weight_count = 0;
        for (; weight_count < visible; ++weight_count)
          key_weight[weight_count] = T(std::exp(keys.log_scale(weight_count) - weight_max));
        T* row = scores.data() + r * kb;
        for (Index j = 0; j < visible; ++j) row[j] *= key_weight[j];
        std::fill(row + visible, row + kb, T(0));
      }
      for_each_key_block([&](Index c0, Index r0, Index width) {
        gemm(ConstView<T>{scores.data() + r0 * kb + c0, rows - r0, width, kb, 1},
             const_view(ConstRowMap<T>(v + (js + c0) * d_v, width, d_v)),
             view(numerator.bottomRows(rows - r0)), Write::Add);
      });
    }
    for (Index r = 0; r < rows; ++r)
      write_output(out + (qs + r) * d_v, numerator.data() + r * d_v, d_v, den[r],
                   queries.log_scale(r) + query_max[r], setup.options, tally);
    if (kb > 0 && (final_state == FinalState::EveryKey || next_rows > 0)) {
      absorb(
          state, keys, v + js * d_v, weighted, weights,
          Prefetch{{rows_of(v, d_v, je, next_je - je), rows_of(out, d_v, qs + rows, next_rows)}});
      absorbed = je;
    } else if (kb > 0) {
      // The last chunk's keys would only serve a later call, which has none: leave them out of
      // the state (1/16 of the state updates at n = 1024), but check their values, as absorb does.
      check_input(setup, v + js * d_v, kb, d_v);
    }
  }
  if (final_state == FinalState::EveryKey) absorb_until(n_k);
}

template void causal_chunked<float>(const LinearHead<float>&, const LinearSetup&,
                                    LinearState<float>&, FinalState, DenominatorTally*);
template void causal_chunked<double>(const LinearHead<double>&, const LinearSetup&,
                                     LinearState<double>&, FinalState, DenominatorTally*);

}  // namespace linrope::detail
