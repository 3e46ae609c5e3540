// The gradient of causal linear attention (the algebra is in linear_backward.hpp), in chunks of L
// queries as the chunked forward: inside a chunk, masked (rows x keys) products; between chunks,
// a running state. Two sweeps over the same chunks:
//   forward: the keys' state (S~, z~) grows chunk by chunk, as in the forward; each chunk gives its
//            queries' g~, delta and M (kept: O(n d_v)) and their rows of dq;
//   reverse: the queries' state (U, y) grows from the last chunk back; each chunk gives its own
//            keys' rows of dk and dv (those keys are seen by this chunk's queries through the
//            masked products, and by every later query through the state).
// Nothing n x n, nothing recomputed from a later key: query i's terms depend on keys up to i only,
// and key j's on queries from j on. Each chunk's features are computed once per sweep.
#include <algorithm>
#include <vector>

#include "linear/linear_backward.hpp"

namespace linrope::detail {
namespace {

// One chunk's masked weights W_rj = exp(gamma_j - M_r) for the keys row r sees (j < visible_r),
// else 0; rows with M_r = kEmpty (zero output) are all 0. Computed again only when M_r changes.
template <class T>
void chunk_weights(const FeatureBlock<T>& keys, Index rows, Index kb, const double* scale,
                   const Index* visible, T* w) {
  double weight_max = kEmpty;
  Index ready = 0;
  std::vector<T> row_weight(std::size_t(std::max<Index>(kb, 1)));
  for (Index r = 0; r < rows; ++r) {
    T* row = w + r * kb;
    if (scale[r] == kEmpty) {
      std::fill(row, row + kb, T(0));
      continue;
    }
    if (scale[r] != weight_max) weight_max = scale[r], ready = 0;
    for (; ready < visible[r]; ++ready)
      row_weight[std::size_t(ready)] = T(std::exp(keys.log_scale(ready) - weight_max));
    std::copy(row_weight.begin(), row_weight.begin() + visible[r], row);
    std::fill(row + visible[r], row + kb, T(0));
  }
}

template <class T>
class CausalBackward {
 public:
  CausalBackward(const LinearGradientHead<T>& head, const LinearSetup& setup)
      : h_(head),
        s_(setup),
        L_(std::min(setup.options.chunk_size, std::max<Index>({head.n, head.nk, 1}))),
        shift_(head.q_pos0 - head.k_pos0),
        separate_(setup.options.placement == RopePlacement::NumeratorOnly),
        queries_(setup, L_, true),
        keys_(setup, L_, true),
        g_(head.n * setup.dv),
        delta_(std::size_t(head.n)),
        scale_(std::size_t(head.n)),
        ga_(L_ * setup.m),
        gb_(L_ * setup.m),
        z_rows_(L_ * setup.m),
        products_(L_ * L_),
        weights_(L_ * L_),
        scratch_m_(L_ * setup.m),
        scratch_dv_(L_ * setup.dv),
        visible_(std::size_t(L_)),
        divisor_(std::size_t(L_)) {}

  void run() {
    forward_sweep();
    reverse_sweep();
  }

 private:
  // Keys [js, je) are first seen by chunk qs's queries; keys before clamp(shift) by every query.
  Index first_key(Index qs) const { return std::clamp(qs + shift_, Index(0), h_.nk); }
  Index chunk_rows(Index qs) const { return std::min(L_, h_.n - qs); }

  void compute_chunk(Index qs, Index js, Index kb) {
    queries_.compute(h_.q + qs * s_.d, chunk_rows(qs), h_.q_pos0 + qs);
    if (kb > 0) keys_.compute(h_.k + js * s_.d, kb, h_.k_pos0 + js);
    for (Index r = 0; r < chunk_rows(qs); ++r)
      visible_[std::size_t(r)] = std::clamp(qs + r + shift_ - js + 1, Index(0), kb);
  }

  // P = g~ V^T over the chunk's rows x keys.
  void score_products(Index qs, Index js, Index kb, T* out) const {
    gemm(const_view(ConstRowMap<T>(g_.data() + qs * s_.dv, chunk_rows(qs), s_.dv)),
         const_view(ConstRowMap<T>(h_.v + js * s_.dv, kb, s_.dv)).transposed(),
         View<T>{out, chunk_rows(qs), kb, kb}, false);
  }

  void forward_sweep() {
    const Index n = h_.n, m = s_.m, dv = s_.dv;
    LinearState<T> state;
    state.reset(m, dv);
    Matrix<T> weighted;
    Vector<T> weights;
    Index absorbed = 0;
    for (Index qs = 0; qs < n; qs += L_) {
      const Index rows = chunk_rows(qs), js = first_key(qs), je = first_key(qs + rows);
      const Index kb = je - js;
      absorb_through(state, keys_, h_.k, h_.v, h_.k_pos0, absorbed, js, weighted, weights);
      compute_chunk(qs, js, kb);
      // The z-scan: each row's M_r, den~_r, and z~_r (kept for Gb).
      RowMap<T> z_rows(z_rows_.data(), rows, m);
      Vector<T> z = state.z;
      double running = state.M;
      Index next = 0;
      for (Index r = 0; r < rows; ++r) {
        for (; next < visible_[std::size_t(r)]; ++next) {
          const double c = keys_.log_scale(next);
          if (c > running) {
            if (running != kEmpty) z *= T(std::exp(running - c));
            running = c;
          }
          z += T(std::exp(c - running)) * keys_.den().row(next).transpose();
        }
        z_rows.row(r) = z.transpose();
        const double den = running == kEmpty ? 0.0 : double(queries_.den().row(r).dot(z));
        divisor_[std::size_t(r)] = stabilized_divisor(
            den, running == kEmpty ? kEmpty : queries_.log_scale(r) + running, s_.options.eps);
        scale_[std::size_t(qs + r)] = divisor_[std::size_t(r)] == 0 ? kEmpty : running;
        scaled_gradient(h_.d_out + (qs + r) * dv, g_.data() + (qs + r) * dv, dv,
                        divisor_[std::size_t(r)]);
      }
      // Ga = S~_r g~_r: the state's part (rescaled to each row's M_r), then the chunk's own keys.
      RowMap<T> ga(ga_.data(), rows, m), gb(gb_.data(), rows, m);
      const ConstRowMap<T> g(g_.data() + qs * dv, rows, dv);
      if (state.M != kEmpty) {
        gemm(const_view(g), const_view(state.S).transposed(), view(ga), false);
        for (Index r = 0; r < rows; ++r) {
          const double M = scale_[std::size_t(qs + r)];
          if (M != kEmpty && M > state.M) ga.row(r) *= T(std::exp(state.M - M));
        }
      } else {
        ga.setZero();
      }
      if (kb > 0) {
        score_products(qs, js, kb, products_.data());
        chunk_weights(keys_, rows, kb, scale_.data() + qs, visible_.data(), weights_.data());
        T* p = products_.data();
        const T* w = weights_.data();
        for (Index e = 0; e < rows * kb; ++e) p[e] *= w[e];
        gemm(ConstView<T>{p, rows, kb, kb, 1}, const_view(keys_.num()), view(ga), true);
      }
      // delta and Gb = delta z~_r, then dq.
      RowMap<T>& den_side = separate_ ? gb : ga;
      if (separate_) gb.setZero();
      for (Index r = 0; r < rows; ++r) {
        const double D = divisor_[std::size_t(r)];
        const double delta = D == 0 ? 0.0 : -double(queries_.num().row(r).dot(ga.row(r))) / D;
        delta_[std::size_t(qs + r)] = delta;
        den_side.row(r) += T(delta) * z_rows.row(r);
      }
      input_gradient(queries_, h_.q_pos0 + qs, ga.data(), separate_ ? gb.data() : nullptr,
                     h_.dq + qs * s_.d);
      if (kb > 0 && qs + rows < n) {
        absorb(state, keys_, h_.v + js * dv, weighted, weights);
        absorbed = je;
      }
    }
  }

  void reverse_sweep() {
    const Index n = h_.n, nk = h_.nk, m = s_.m, d = s_.d, dv = s_.dv;
    QueryState<T> state;
    state.reset(m, dv);
    // Keys no query sees get zero gradients.
    const Index horizon = n > 0 ? first_key(n) : 0;
    std::fill(h_.dk + horizon * d, h_.dk + nk * d, T(0));
    std::fill(h_.dv + horizon * dv, h_.dv + nk * dv, T(0));
    const Index chunks = (n + L_ - 1) / L_;
    for (Index c = chunks - 1; c >= 0; --c) {
      const Index qs = c * L_, rows = chunk_rows(qs), js = first_key(qs), je = first_key(qs + rows);
      const Index kb = je - js;
      compute_chunk(qs, js, kb);
      const QueryTerms<T> terms{g_.data() + qs * dv, delta_.data() + qs, scale_.data() + qs};
      if (kb > 0) {
        // Gc (and Ge) and dv of the chunk's keys: this chunk's queries through the masked
        // products, the later ones through the state.
        RowMap<T> gc(ga_.data(), kb, m), ge(gb_.data(), kb, m), dvalue(h_.dv + js * dv, kb, dv);
        chunk_weights(keys_, rows, kb, scale_.data() + qs, visible_.data(), weights_.data());
        T* p = products_.data();
        // (W .* (P + delta)) for the placements whose den and num features are the same rows.
        score_products(qs, js, kb, p);
        for (Index r = 0; r < rows; ++r)
          for (Index j = 0; j < kb; ++j)
            p[r * kb + j] = (p[r * kb + j] + (separate_ ? T(0) : T(terms.delta[r]))) *
                            weights_.data()[r * kb + j];
        gemm(ConstView<T>{p, rows, kb, kb, 1}.transposed(), const_view(queries_.num()), view(gc),
             false);
        if (separate_) {
          for (Index r = 0; r < rows; ++r)
            for (Index j = 0; j < kb; ++j)
              p[r * kb + j] = T(terms.delta[r]) * weights_.data()[r * kb + j];
          gemm(ConstView<T>{p, rows, kb, kb, 1}.transposed(), const_view(queries_.den()), view(ge),
               false);
        }
        // dv = (W .* (a~ c~^T))^T g~
        gemm(const_view(queries_.num()), const_view(keys_.num()).transposed(),
             View<T>{p, rows, kb, kb}, false);
        for (Index e = 0; e < rows * kb; ++e) p[e] *= weights_.data()[e];
        gemm(ConstView<T>{p, rows, kb, kb, 1}.transposed(),
             const_view(ConstRowMap<T>(terms.g, rows, dv)), view(dvalue), false);
        key_terms_from_state(state, keys_, h_.v + js * dv, gc.data(), ge.data(), dvalue.data(),
                             scratch_m_.data(), scratch_dv_.data());
        input_gradient(keys_, h_.k_pos0 + js, gc.data(), separate_ ? ge.data() : nullptr,
                       h_.dk + js * d);
      }
      absorb_queries(state, queries_, terms, scratch_dv_.data());
    }
    // Keys before the first chunk's: seen by every query, through the state only.
    const Index prefix = n > 0 ? first_key(0) : 0;
    for (Index js = 0; js < prefix; js += L_) {
      const Index kb = std::min(L_, prefix - js);
      keys_.compute(h_.k + js * d, kb, h_.k_pos0 + js);
      RowMap<T> gc(ga_.data(), kb, m), ge(gb_.data(), kb, m), dvalue(h_.dv + js * dv, kb, dv);
      gc.setZero();
      ge.setZero();
      dvalue.setZero();
      key_terms_from_state(state, keys_, h_.v + js * dv, gc.data(), ge.data(), dvalue.data(),
                           scratch_m_.data(), scratch_dv_.data());
      input_gradient(keys_, h_.k_pos0 + js, gc.data(), separate_ ? ge.data() : nullptr,
                     h_.dk + js * d);
    }
  }

  const LinearGradientHead<T>& h_;
  const LinearSetup& s_;
  const Index L_, shift_;
  const bool separate_;
  FeatureBlock<T> queries_, keys_;
  std::vector<T> g_;  // g~, [n x dv]
  std::vector<double> delta_, scale_;
  Scratch<T> ga_, gb_, z_rows_, products_, weights_, scratch_m_, scratch_dv_;
  std::vector<Index> visible_;
  std::vector<double> divisor_;  // D~ of the chunk's rows (0: a zero output)
};

}  // namespace

template <class T>
void linear_causal_backward(const LinearGradientHead<T>& head, const LinearSetup& setup,
                            bool /*parallel*/) {
  CausalBackward<T>(head, setup).run();
}

template void linear_causal_backward<float>(const LinearGradientHead<float>&, const LinearSetup&,
                                            bool);
template void linear_causal_backward<double>(const LinearGradientHead<double>&, const LinearSetup&,
                                             bool);

}  // namespace linrope::detail
