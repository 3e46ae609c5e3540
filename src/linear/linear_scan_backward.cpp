// The gradient of the causal scan (linear_scan.cpp), one segment of it: two sweeps, the forward
// scan's engine (scan_strips.hpp) run three times with other operands. The algebra is in
// linear_backward.hpp; in its terms, with w_ij = exp(gamma_j - M_i):
//   queries, first to last:  Ga_i = sum_{j <= i} w_ij <g~_i, v_j> c~_j      state S^T [d_v x m]
//                             (read g~_i, absorb key v_j with value c~_j): the forward's S, turned
//   keys, last to first:      dv_j = sum_{i >= j} w_ij <a~_i, c~_j> g~_i     state U   [m x d_v]
//                             (read c~_j, absorb a~_i with value g~_i)
//                             Gc_j = sum_{i >= j} w_ij <g~_i, v_j> a~_i      state U^T [d_v x m]
//                             (read v_j, absorb g~_i with value a~_i)
// (indices shifted by q_offset - k_offset when queries and keys start at different positions). So
// the backward streams its states from L1 as the forward does, and has no masked products:
// 6 state-sized products per token against the forward's 2, plus the maps' backward.
// The stabiliser: the queries' sweep keeps the forward's running maximum M (admit_key, as the
// forward does); the keys' sweep keeps K, the smallest M_i absorbed (M_i never grows going back),
// so that each query enters with weight exp(K - M_i) <= 1 and key j reads the state times
// exp(gamma_j - K) <= 1. Every weight is at most 1: large inputs give finite gradients. With a
// decay, gamma_j passes M_i by at most the headroom H (admit_key), so key j's factor is at most
// e^H; the M_i are then the lazily raised ones, which change every H / |log g| queries, so the
// exact rule of the keys' sweep (K = the smallest M_i) rescales as rarely and needs no headroom.
#include <algorithm>

#include "linear/linear_backward.hpp"
#include "linear/scan_strips.hpp"

namespace linrope::detail {

template <class T>
void scan_queries_backward(CausalGradients<T>& c, Index q_begin, Index q_end,
                           LinearState<T>& state) {
  const LinearGradientHead<T>& h = c.head;
  const LinearSetup& s = c.setup;
  const Index m = s.m, d = s.d, d_v = s.d_v;
  const bool separate = s.plan.separate_denominator;  // den-side features are other rows
  Matrix<T> weighted;
  Vector<T> weights;
  if (q_begin == 0)  // the keys every query sees
    for (Index js = 0, prefix = c.first_key(0); js < prefix; js += kScanBlock) {
      const KeptBlock<T> keys(c.keys, js, std::min(kScanBlock, prefix - js));
      absorb(state, keys.rows(), h.v + js * d_v, weighted, weights);
    }
  Scratch<T> ga_rows(kScanBlock * m), gb_rows(kScanBlock * m), z_rows(kScanBlock * m);
  PanelState<T> st(d_v, m);  // S^T, at the scale state.M
  st.load(state.S.transpose());
  ScanSteps<T> steps;
  double divisor[kScanBlock];  // D~ of the block's rows (0: a zero output)
  for (Index qs = q_begin; qs < q_end; qs += kScanBlock) {
    const Index rows = std::min(kScanBlock, q_end - qs);
    c.queries.compute_at(qs, h.q + qs * d, rows);
    check_input(s, h.d_out + qs * d_v, rows, d_v);
    // The block's own keys [first, last); their values are checked here (the others' where they
    // are absorbed).
    const Index first = c.first_key(qs), last = c.first_key(qs + rows);
    check_input(s, h.v + first * d_v, last - first, d_v);
    const KeptBlock<T> query_block(c.queries, qs, rows), key_block(c.keys, first, last - first);
    const FeatureRows<T>&queries = query_block.rows(), &keys = key_block.rows();
    RowMap<T> ga(ga_rows.data(), rows, m), gb(gb_rows.data(), rows, m), z(z_rows.data(), rows, m);
    steps.count = rows;
    for (Index r = 0; r < rows; ++r) {
      const Index i = qs + r, j = i + c.shift;  // the query and its own key
      steps.key[r] = nullptr;
      steps.factor[r] = T(1);
      if (j >= 0 && j < h.n_k) {
        const Index at = j - first;  // in the block's keys
        const Admitted<T> a =
            admit_key(state.z, state.M, keys.log_scale(at), keys.den().data() + at * m, s.headroom);
        steps.key[r] = h.v + j * d_v;
        steps.value[r] = keys.num().data() + at * m;
        steps.factor[r] = a.factor;
        steps.weight[r] = a.weight;
      }
      z.row(r) = state.z.transpose();
      const double den = state.M == kEmpty ? 0.0 : double(queries.den().row(r).dot(state.z));
      divisor[r] = output_divisor(den, state.M == kEmpty ? kEmpty : queries.log_scale(r) + state.M,
                                  s.options);
      c.scale[i] = divisor[r] == 0 ? kEmpty : state.M;
      scaled_gradient(h.d_out + i * d_v, c.g + i * d_v, d_v, divisor[r]);
      steps.read[r] = c.g + i * d_v;
      steps.out[r] = ga_rows.data() + r * m;
    }
    scan_steps(st.state(), steps);  // Ga = S~_i g~_i, at each row's own scale M_i
    // delta and Gb = delta z~, then dq.
    denominator_terms(
        queries, divisor, [&](Index r) { return z.row(r); }, ga, gb, c.delta + qs);
    input_gradient(queries, h.q + qs * d, h.q_offset + qs, ga.data(),
                   separate ? gb.data() : nullptr, h.dq + qs * d);
  }
}

template <class T>
void scan_keys_backward(CausalGradients<T>& c, Index k_begin, Index k_end, Index q_end,
                        QueryState<T>& state) {
  const LinearGradientHead<T>& h = c.head;
  const LinearSetup& s = c.setup;
  const Index m = s.m, d = s.d, d_v = s.d_v;
  const bool separate = s.plan.separate_denominator;  // den-side features are other rows
  if (k_begin == k_end) return;  // a segment past the horizon, or whose queries see no key
  // The segment's queries whose own key lies at or past k_end see every key of it: in first.
  absorb_query_range(state, c, std::clamp(k_end - c.shift, Index(0), q_end), q_end);
  Scratch<T> gc_rows(kScanBlock * m), ge_rows(kScanBlock * m);
  PanelState<T> u(m, d_v), ut(d_v, m);  // U and U^T, at the scale state.K
  u.load(state.U);
  ut.load(state.U.transpose());
  ScanSteps<T> values, features;  // the dv sweep over U, the Gc sweep over U^T
  double read_scale[kScanBlock];  // K when key r reads the states
  for (Index je = k_end; je > k_begin; je -= kScanBlock) {
    const Index rows = std::min(kScanBlock, je - k_begin), js = je - rows;
    // The block's keys [js, je) and their own queries [first, last).
    const Index first = std::clamp(js - c.shift, Index(0), h.n);
    const Index last = std::clamp(je - c.shift, Index(0), h.n);
    const KeptBlock<T> key_block(c.keys, js, rows), query_block(c.queries, first, last - first);
    const FeatureRows<T>&keys = key_block.rows(), &queries = query_block.rows();
    RowMap<T> gc(gc_rows.data(), rows, m), ge(ge_rows.data(), rows, m);
    values.count = features.count = rows;
    for (Index r = 0; r < rows; ++r) {
      const Index j = je - 1 - r, i = j - c.shift;  // the key, its own query (first to see it)
      values.key[r] = features.key[r] = nullptr;
      values.factor[r] = features.factor[r] = T(1);
      if (i >= 0 && i < h.n && c.scale[i] != kEmpty) {
        const double M = c.scale[i];
        if (M < state.K) {
          if (state.K != kNoQueries) {
            const T factor = T(std::exp(M - state.K));
            state.y *= factor;
            values.factor[r] = features.factor[r] = factor;
          }
          state.K = M;
        }
        const T weight = T(std::exp(state.K - M));
        state.y += (weight * T(c.delta[i])) * queries.den().row(i - first).transpose();
        values.key[r] = queries.num().data() + (i - first) * m;
        values.value[r] = c.g + i * d_v;
        features.key[r] = c.g + i * d_v;
        features.value[r] = queries.num().data() + (i - first) * m;
        values.weight[r] = features.weight[r] = weight;
      }
      read_scale[r] = state.K;
      values.read[r] = keys.num().data() + (j - js) * m;
      values.out[r] = h.dv + j * d_v;
      features.read[r] = h.v + j * d_v;
      features.out[r] = gc_rows.data() + (j - js) * m;
      ge.row(j - js) = state.y.transpose();
    }
    scan_steps(u.state(), values);
    scan_steps(ut.state(), features);
    // Every read times exp(gamma_j - K); Ge = that times y, into Gc where the two sides are the
    // same rows.
    for (Index r = 0; r < rows; ++r) {
      const Index j = je - 1 - r;
      const T f =
          read_scale[r] == kNoQueries ? T(0) : T(std::exp(keys.log_scale(j - js) - read_scale[r]));
      RowMap<T>(h.dv + j * d_v, 1, d_v) *= f;
      gc.row(j - js) *= f;
      ge.row(j - js) *= f;
      if (!separate) gc.row(j - js) += ge.row(j - js);
    }
    input_gradient(keys, h.k + js * d, h.k_offset + js, gc.data(), separate ? ge.data() : nullptr,
                   h.dk + js * d);
  }
  u.store(state.U);
}

template void scan_queries_backward<float>(CausalGradients<float>&, Index, Index,
                                           LinearState<float>&);
template void scan_queries_backward<double>(CausalGradients<double>&, Index, Index,
                                            LinearState<double>&);
template void scan_keys_backward<float>(CausalGradients<float>&, Index, Index, Index,
                                        QueryState<float>&);
template void scan_keys_backward<double>(CausalGradients<double>&, Index, Index, Index,
                                         QueryState<double>&);

}  // namespace linrope::detail
