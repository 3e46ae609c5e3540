// The gradient of causal linear attention (the algebra is in linear_backward.hpp), in chunks of L
// queries as the chunked forward: inside a chunk, masked (rows x keys) products; between chunks,
// a running state. Two sweeps over the same chunks:
//   forward: the keys' state (S~, z~) grows chunk by chunk, as in the forward; each chunk gives its
//            queries' g~, delta and M (kept: O(n d_v)) and their rows of dq;
//   reverse: the queries' state (U, y) grows from the last chunk back; each chunk gives its own
//            keys' rows of dk and dv (those keys are seen by this chunk's queries through the
//            masked products, and by every later query through the state).
// Nothing n x n, nothing recomputed from a later key: query i's terms depend on keys up to i only,
// and key j's on queries from j on. The features are computed once and kept for both sweeps
// (O(n m)): computing them again cost more than a third of the backward.
//
// A long head, when threads are free, is cut into one segment of chunks per thread, as the forward
// does (linear_causal.cpp): the keys' state at each segment's start and the queries' state at each
// segment's end are summed first (one extra pass over the keys and one over the queries, each
// ~1/10 of the backward's work), then the segments sweep in parallel; the last bits then depend
// on the thread count (attention.hpp, "Reproducibility").
#include <algorithm>
#include <vector>

#include "linear/linear_backward.hpp"

namespace linrope::detail {
namespace {

// Rows per chunk, unless the caller chose the chunked form (then options.chunk_size). The masked
// products grow with the chunk and the per-chunk overheads shrink: FAVOR+ eq. 19 causal at
// n = 4096 (8 heads, 2 threads) took 2.9x its forward's time with chunks of 32 rows, 3.8x with 64,
// 4.1x with 16 (one run, a loaded machine).
constexpr Index kBackwardChunk = 32;

// One chunk's masked weights W_rj = exp(gamma_j - M_r) for the keys row r sees (j < visible_r),
// else 0; rows with M_r = kEmpty (zero output) are all 0. Computed again only when M_r changes.
template <class T>
void chunk_weights(const FeatureRows<T>& keys, Index rows, Index kb, const double* scale,
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

// What the segments share: the head, the kept features, and each query's terms (g~, delta, M).
template <class T>
struct CausalGradients {
  CausalGradients(const LinearGradientHead<T>& h, const LinearSetup& s)
      : head(h),
        setup(s),
        L(std::min(
            s.options.method == CausalMethod::Chunked ? s.options.chunk_size : kBackwardChunk,
            std::max<Index>({h.n, h.nk, 1}))),
        shift(h.q_pos0 - h.k_pos0),
        separate(s.options.placement == RopePlacement::NumeratorOnly),
        queries(s, h.n, /*keep_plain=*/true),
        keys(s, h.nk, /*keep_plain=*/true),
        g_(h.n * s.dv, /*lasting=*/true),
        delta_(h.n, /*lasting=*/true),
        scale_(h.n, /*lasting=*/true),
        g(g_.data()),
        delta(delta_.data()),
        scale(scale_.data()) {}

  // Keys [first_key(qs), first_key(qs + rows)) are first seen by the chunk of queries at qs; keys
  // before first_key(0) by every query, keys from first_key(n) on by none.
  Index first_key(Index qs) const { return std::clamp(qs + shift, Index(0), head.nk); }
  Index chunk_rows(Index qs) const { return std::min(L, head.n - qs); }
  QueryTerms<T> terms(Index qs) const { return {g + qs * setup.dv, delta + qs, scale + qs}; }

  const LinearGradientHead<T>& head;
  const LinearSetup& setup;
  const Index L, shift;
  const bool separate;
  KeptFeatures<T> queries, keys;  // every query's and every seen key's features

 private:
  Scratch<T> g_;
  Scratch<double> delta_, scale_;

 public:
  T* g;  // g~ [n x dv]
  double *delta, *scale;
};

// One thread's working memory, and the two sweeps over a run of chunks.
template <class T>
class ChunkSweeper {
 public:
  explicit ChunkSweeper(CausalGradients<T>& shared)
      : c_(shared),
        h_(shared.head),
        s_(shared.setup),
        L_(shared.L),
        ga_(L_ * s_.m),
        gb_(L_ * s_.m),
        z_rows_(L_ * s_.m),
        products_(L_ * L_),
        weights_(L_ * L_),
        scratch_m_(L_ * s_.m),
        scratch_dv_(L_ * s_.dv),
        visible_(std::size_t(L_)),
        divisor_(std::size_t(L_)) {}

  // Queries [q_begin, q_end) (whole chunks) from `state`, which holds the keys before
  // first_key(q_begin) (before first_key(0) too when q_begin = 0: this absorbs them): their g~,
  // delta, M and rows of dq. Their features are computed here; the keys' are kept already.
  void forward(Index q_begin, Index q_end, LinearState<T>& state) {
    const Index m = s_.m, dv = s_.dv;
    if (q_begin == 0) {
      const Index prefix = c_.first_key(0);
      if (prefix > 0) absorb(state, c_.keys.range(0, prefix), h_.v, weighted_, weights_v_);
    }
    for (Index qs = q_begin; qs < q_end; qs += L_) {
      const Index rows = c_.chunk_rows(qs), js = c_.first_key(qs), je = c_.first_key(qs + rows);
      const Index kb = je - js;
      c_.queries.compute_at(qs, h_.q + qs * s_.d, rows, h_.q_pos0 + qs);
      const FeatureRows<T> queries = c_.queries.range(qs, rows), keys = c_.keys.range(js, kb);
      find_visible(qs, js, kb);
      // The z-scan: each row's M_r, den~_r, and z~_r (kept for Gb).
      RowMap<T> z_rows(z_rows_.data(), rows, m);
      Vector<T> z = state.z;
      double running = state.M;
      Index next = 0;
      for (Index r = 0; r < rows; ++r) {
        for (; next < visible_[std::size_t(r)]; ++next) {
          const double c = keys.log_scale(next);
          if (c > running) {
            if (running != kEmpty) z *= T(std::exp(running - c));
            running = c;
          }
          z += T(std::exp(c - running)) * keys.den().row(next).transpose();
        }
        z_rows.row(r) = z.transpose();
        const double den = running == kEmpty ? 0.0 : double(queries.den().row(r).dot(z));
        divisor_[std::size_t(r)] = stabilized_divisor(
            den, running == kEmpty ? kEmpty : queries.log_scale(r) + running, s_.options.eps);
        c_.scale[qs + r] = divisor_[std::size_t(r)] == 0 ? kEmpty : running;
        scaled_gradient(h_.d_out + (qs + r) * dv, c_.g + (qs + r) * dv, dv,
                        divisor_[std::size_t(r)]);
      }
      // Ga = S~_r g~_r: the state's part (rescaled to each row's M_r), then the chunk's own keys.
      RowMap<T> ga(ga_.data(), rows, m), gb(gb_.data(), rows, m);
      const ConstRowMap<T> g(c_.g + qs * dv, rows, dv);
      if (state.M != kEmpty) {
        gemm(const_view(g), const_view(state.S).transposed(), view(ga), false);
        for (Index r = 0; r < rows; ++r) {
          const double M = c_.scale[qs + r];
          if (M != kEmpty && M > state.M) ga.row(r) *= T(std::exp(state.M - M));
        }
      } else {
        ga.setZero();
      }
      if (kb > 0) {
        T* p = masked_scores(qs, js, keys);
        gemm(ConstView<T>{p, rows, kb, kb, 1}, const_view(keys.num()), view(ga), true);
      }
      // delta and Gb = delta z~_r, then dq.
      RowMap<T>& den_side = c_.separate ? gb : ga;
      if (c_.separate) gb.setZero();
      for (Index r = 0; r < rows; ++r) {
        const double D = divisor_[std::size_t(r)];
        const double delta = D == 0 ? 0.0 : -double(queries.num().row(r).dot(ga.row(r))) / D;
        c_.delta[qs + r] = delta;
        den_side.row(r) += T(delta) * z_rows.row(r);
      }
      input_gradient(queries, h_.q + qs * s_.d, h_.q_pos0 + qs, ga.data(),
                     c_.separate ? gb.data() : nullptr, h_.dq + qs * s_.d);
      if (kb > 0 && qs + rows < q_end) absorb(state, keys, h_.v + js * dv, weighted_, weights_v_);
    }
  }

  // Queries [q_begin, q_end) from the last chunk back, from `state`, which holds the queries from
  // q_end on: the rows of dk and dv of the keys these chunks see first. On return `state` holds
  // the queries from q_begin on.
  void reverse(Index q_begin, Index q_end, QueryState<T>& state) {
    const Index m = s_.m, d = s_.d, dv = s_.dv;
    const Index last = q_begin + (q_end - q_begin - 1) / L_ * L_;
    for (Index qs = last; qs >= q_begin; qs -= L_) {
      const Index rows = c_.chunk_rows(qs), js = c_.first_key(qs), je = c_.first_key(qs + rows);
      const Index kb = je - js;
      const FeatureRows<T> queries = c_.queries.range(qs, rows), keys = c_.keys.range(js, kb);
      const QueryTerms<T> terms = c_.terms(qs);
      if (kb > 0) {
        // Gc (and Ge) and dv of the chunk's keys: this chunk's queries through the masked
        // products, the later ones through the state.
        find_visible(qs, js, kb);
        RowMap<T> gc(ga_.data(), kb, m), ge(gb_.data(), kb, m), dvalue(h_.dv + js * dv, kb, dv);
        T* p = products_.data();
        const T* w = weights_.data();
        // W .* (P + delta), where the den and num features are the same rows; else W .* P.
        score_products(qs, js, kb, p);
        chunk_weights(keys, rows, kb, terms.scale, visible_.data(), weights_.data());
        for (Index r = 0; r < rows; ++r) {
          const T shift = c_.separate ? T(0) : T(terms.delta[r]);
          for (Index j = 0; j < kb; ++j) p[r * kb + j] = (p[r * kb + j] + shift) * w[r * kb + j];
        }
        gemm(ConstView<T>{p, rows, kb, kb, 1}.transposed(), const_view(queries.num()), view(gc),
             false);
        if (c_.separate) {  // Ge = (W diag(delta))^T b~
          for (Index r = 0; r < rows; ++r)
            for (Index j = 0; j < kb; ++j) p[r * kb + j] = T(terms.delta[r]) * w[r * kb + j];
          gemm(ConstView<T>{p, rows, kb, kb, 1}.transposed(), const_view(queries.den()), view(ge),
               false);
        }
        // dv = (W .* (a~ c~^T))^T g~
        gemm(const_view(queries.num()), const_view(keys.num()).transposed(),
             View<T>{p, rows, kb, kb}, false);
        for (Index e = 0; e < rows * kb; ++e) p[e] *= w[e];
        gemm(ConstView<T>{p, rows, kb, kb, 1}.transposed(),
             const_view(ConstRowMap<T>(terms.g, rows, dv)), view(dvalue), false);
        key_terms_from_state(state, keys, h_.v + js * dv, gc.data(), ge.data(), dvalue.data(),
                             scratch_m_.data(), scratch_dv_.data());
        input_gradient(keys, h_.k + js * d, h_.k_pos0 + js, gc.data(),
                       c_.separate ? ge.data() : nullptr, h_.dk + js * d);
      }
      absorb_queries(state, queries, terms, scratch_dv_.data());
    }
  }

  // Keys [0, end), seen by every query in `state` and by no masked product: dk and dv.
  void state_only_keys(Index end, const QueryState<T>& state) {
    const Index m = s_.m, d = s_.d, dv = s_.dv;
    for (Index js = 0; js < end; js += L_) {
      const Index kb = std::min(L_, end - js);
      const FeatureRows<T> keys = c_.keys.range(js, kb);
      RowMap<T> gc(ga_.data(), kb, m), ge(gb_.data(), kb, m), dvalue(h_.dv + js * dv, kb, dv);
      gc.setZero();
      ge.setZero();
      dvalue.setZero();
      key_terms_from_state(state, keys, h_.v + js * dv, gc.data(), ge.data(), dvalue.data(),
                           scratch_m_.data(), scratch_dv_.data());
      input_gradient(keys, h_.k + js * d, h_.k_pos0 + js, gc.data(),
                     c_.separate ? ge.data() : nullptr, h_.dk + js * d);
    }
  }

 private:
  // Which keys of the chunk each row sees: [0, visible_r) of [js, js + kb).
  void find_visible(Index qs, Index js, Index kb) {
    for (Index r = 0; r < c_.chunk_rows(qs); ++r)
      visible_[std::size_t(r)] = std::clamp(qs + r + c_.shift - js + 1, Index(0), kb);
  }

  // P = g~ V^T over the chunk's rows x keys.
  void score_products(Index qs, Index js, Index kb, T* out) const {
    const Index rows = c_.chunk_rows(qs);
    gemm(const_view(ConstRowMap<T>(c_.g + qs * s_.dv, rows, s_.dv)),
         const_view(ConstRowMap<T>(h_.v + js * s_.dv, kb, s_.dv)).transposed(),
         View<T>{out, rows, kb, kb}, false);
  }

  // W .* P for the forward sweep (products_), the weights left in weights_.
  T* masked_scores(Index qs, Index js, const FeatureRows<T>& keys) {
    const Index rows = c_.chunk_rows(qs), kb = keys.rows();
    T* p = products_.data();
    score_products(qs, js, kb, p);
    chunk_weights(keys, rows, kb, c_.scale + qs, visible_.data(), weights_.data());
    const T* w = weights_.data();
    for (Index e = 0; e < rows * kb; ++e) p[e] *= w[e];
    return p;
  }

  CausalGradients<T>& c_;
  const LinearGradientHead<T>& h_;
  const LinearSetup& s_;
  const Index L_;
  Scratch<T> ga_, gb_, z_rows_, products_, weights_, scratch_m_, scratch_dv_;
  std::vector<Index> visible_;
  std::vector<double> divisor_;  // D~ of the chunk's rows (0: a zero output)
  Matrix<T> weighted_;
  Vector<T> weights_v_;
};

// Features of rows [begin, end) of x into `kept`, a block at a time.
template <class T>
void keep_features(KeptFeatures<T>& kept, const T* x, Index begin, Index end, Index pos0,
                   const LinearSetup& setup) {
  const Index block = block_rows(setup.m);
  for (Index at = begin; at < end; at += block)
    kept.compute_at(at, x + at * setup.d, std::min(block, end - at), pos0 + at);
}

}  // namespace

template <class T>
void linear_causal_backward(const LinearGradientHead<T>& head, const LinearSetup& setup,
                            bool parallel) {
  CausalGradients<T> c(head, setup);
  const Index n = head.n, nk = head.nk, d = setup.d, dv = setup.dv, m = setup.m;
  const Index horizon = n > 0 ? c.first_key(n) : 0;  // keys [horizon, nk) are seen by no query
  std::fill(head.dk + horizon * d, head.dk + nk * d, T(0));
  std::fill(head.dv + horizon * dv, head.dv + nk * dv, T(0));
  if (n == 0) return;
  const Index segments = std::max<Index>(
      1, std::min<Index>(usable_threads(parallel), n / std::max<Index>(4 * c.L, 256)));
  std::vector<Index> query_start(segments + 1), key_start(segments + 1);
  for (Index t = 0; t <= segments; ++t) {
    query_start[t] = split_point(n, segments, t, c.L);
    key_start[t] = t == 0 ? 0 : t == segments ? horizon : c.first_key(query_start[t]);
  }
  // Every seen key's features; with segments, also the keys between each segment's start and
  // the next's, absorbed, then summed into each segment's starting state.
  std::vector<LinearState<T>> start(segments);
  parallel_for(segments, int(segments), Schedule::Static, [&](Index t) {
    start[t].reset(m, dv);
    if (t + 1 < segments)
      absorb_keys(start[t], head.k + key_start[t] * d, head.v + key_start[t] * dv,
                  key_start[t + 1] - key_start[t], head.k_pos0 + key_start[t], setup, &c.keys,
                  key_start[t]);
    else
      keep_features(c.keys, head.k, key_start[t], horizon, head.k_pos0, setup);
  });
  c.keys.fill(horizon);
  for (Index t = segments - 1; t > 0; --t) start[t] = std::move(start[t - 1]);
  start[0].reset(m, dv);
  // start[t] now holds the keys of [key_start[t-1], key_start[t]) (segment 0's start is empty: its
  // sweep absorbs the keys before first_key(0) itself); make it the prefix sum.
  for (Index t = 2; t < segments; ++t) merge(start[t], start[t - 1]);
  parallel_for(segments, int(segments), Schedule::Static, [&](Index t) {
    ChunkSweeper<T>(c).forward(query_start[t], query_start[t + 1], start[t]);
  });
  c.queries.fill(n);
  // The queries' state at each segment's end: the later segments' queries, summed from the back.
  std::vector<QueryState<T>> end(segments);
  parallel_for(segments, int(segments), Schedule::Static, [&](Index t) {
    end[t].reset(m, dv);
    if (t == 0) return;  // end[t - 1] takes segment t's queries
    Scratch<T> weighted(c.L * dv);
    for (Index qs = query_start[t]; qs < query_start[t + 1]; qs += c.L)
      absorb_queries(end[t], c.queries.range(qs, c.chunk_rows(qs)), c.terms(qs), weighted.data());
  });
  for (Index t = 0; t + 1 < segments; ++t) end[t] = std::move(end[t + 1]);
  end[segments - 1].reset(m, dv);
  for (Index t = segments - 3; t >= 0; --t) merge(end[t], end[t + 1]);
  parallel_for(segments, int(segments), Schedule::Static, [&](Index t) {
    ChunkSweeper<T> sweeper(c);
    sweeper.reverse(query_start[t], query_start[t + 1], end[t]);
    if (t == 0) sweeper.state_only_keys(c.first_key(0), end[0]);
  });
}

template void linear_causal_backward<float>(const LinearGradientHead<float>&, const LinearSetup&,
                                            bool);
template void linear_causal_backward<double>(const LinearGradientHead<double>&, const LinearSetup&,
                                             bool);

}  // namespace linrope::detail
