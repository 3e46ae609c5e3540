// Private: the backward passes of linear attention, the gradients of the forms of
// linear_kernel.hpp, and the pieces both the causal and the non-causal backward are made of.
//
// The algebra, on the stabilised scale of linear_kernel.hpp. Query i has numerator-side features
// a_i = exp(alpha_i) a~_i, denominator-side ones b_i = exp(alpha_i) b~_i, reads the state S~_i,
// z~_i at the log scale M_i (the largest key scale it sees), and D~_i = den~_i + eps exp(-(alpha_i
// + M_i)), so that o_i = num~_i / D~_i. With g_i = dL/do_i:
//   g~_i    = g_i / D~_i                          (the gradient of num~_i)
//   Ga_i    = S~_i g~_i         = exp(alpha_i) dL/da_i
//   delta_i = -<a~_i, Ga_i> / D~_i                (= -<g_i, o_i> / D~_i, since
//                                                  <g~_i, num~_i> = <a~_i, Ga_i>)
//   Gb_i    = delta_i z~_i      = exp(alpha_i) dL/db_i
// Key j, with features c_j (numerator side), e_j (denominator side) and log scale gamma_j:
//   Gc_j = sum_{i sees j} exp(gamma_j - M_i) (g~_i . v_j) a~_i     = exp(gamma_j) dL/dc_j
//   Ge_j = sum_{i sees j} exp(gamma_j - M_i) delta_i b~_i          = exp(gamma_j) dL/de_j
//   dv_j = sum_{i sees j} exp(gamma_j - M_i) <a~_i, c~_j> g~_i
// Every weight exp(gamma_j - M_i) is at most 1 (M_i is the largest scale query i sees; e^H with a
// decay's headroom H, linear_kernel.hpp), so large
// inputs give finite gradients, and a causal key's gradient, like a causal output, reads only what
// may see it. The feature gradients are on the features' reciprocal scale, the form
// FeatureMap::backward_rows takes: input_gradient turns them into dq and dk (through R^T where the
// placement rotates). The keys' sums over queries are a reverse state (QueryState below), the
// mirror of the forward's (S, z): the causal backward sweeps it from the last query to the first.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "linear/linear_blocks.hpp"
#include "linear/saved.hpp"
#include "linear/scan_strips.hpp"

namespace linrope::detail {

// One head's rows and their gradients: q [n x d], k [n_k x d], v [n_k x d_v], d_out [n x d_v] ->
// dq, dk, dv of the shapes of q, k, v (every row written), positions as in LinearHead.
template <class T>
struct LinearGradientHead {
  const T* q;
  const T* k;
  const T* v;
  const T* d_out;
  T* dq;
  T* dk;
  T* dv;
  Index n, n_k;
  Index q_offset, k_offset;
};

// The gradients of linear_noncausal and linear_causal (any method: the causal backward has one
// form, the scan's sweeps). `threading` as for the forwards. Shapes must already be checked; the
// kernels check q, k, v and d_out for non-finite values as they read them, as the forwards do
// (setup.nonfinite). `saved`: the forward's features of this head (saved.hpp), read instead of
// mapping q and k again where they cover what the backward reads; null: none. Never throw but
// std::bad_alloc.
template <class T>
void linear_noncausal_backward(const LinearGradientHead<T>& head, const LinearSetup& setup,
                               Threads threading, const SavedSlice<T>* saved = nullptr);
// A causal backward's state in and state out (attention.hpp, "State in, state out"), one head's:
// the state its forward started from (null: empty), dL/dS and dL/dz of the state the forward left
// (null: zero), and where dL/dS and dL/dz of the initial state go (null: not wanted); S-shaped
// pointers are [m x d_v], z-shaped [m], row-major.
template <class T>
struct StatePorts {
  const T* initial_S = nullptr;
  const T* initial_z = nullptr;
  double initial_log_scale = -std::numeric_limits<double>::infinity();
  const T* d_final_S = nullptr;
  const T* d_final_z = nullptr;
  T* d_initial_S = nullptr;
  T* d_initial_z = nullptr;
};
template <class T>
void linear_causal_backward(const LinearGradientHead<T>& head, const LinearSetup& setup,
                            Threads threading, const StatePorts<T>& ports = {},
                            const SavedSlice<T>* saved = nullptr);

inline constexpr double kNoQueries = std::numeric_limits<double>::infinity();

// What the queries absorbed so far give their keys: U = sum_i exp(K - M_i) a~_i g~_i^T [m x d_v]
// and y = sum_i exp(K - M_i) delta_i b~_i [m], at the log scale K, the smallest M_i absorbed
// (+inf: none), so that every weight is at most 1 and key j reads them times exp(gamma_j - K).
template <class T>
struct QueryState {
  Matrix<T> U;
  Vector<T> y;
  double K = kNoQueries;
  void reset(Index m, Index d_v) {
    U.setZero(m, d_v);
    y.setZero(m);
    K = kNoQueries;
  }
};

// Lowers the state's scale to new_min (<= K).
template <class T>
void lower_scale(QueryState<T>& state, double new_min) {
  if (new_min >= state.K) return;
  if (state.K != kNoQueries) {
    const T factor = T(std::exp(new_min - state.K));
    state.U *= factor;
    state.y *= factor;
  }
  state.K = new_min;
}

// state += other, both brought to the smaller of their scales.
template <class T>
void merge(QueryState<T>& state, const QueryState<T>& other) {
  if (other.K == kNoQueries) return;
  lower_scale(state, other.K);
  const T factor = T(std::exp(state.K - other.K));
  state.U += factor * other.U;
  state.y += factor * other.y;
}

// One block of queries' terms: g~ [rows x d_v], delta and M per row (M = kEmpty for a row whose
// output is zero: it contributes nothing).
template <class T>
struct QueryTerms {
  const T* g;
  const double* delta;
  const double* scale;
};

// Adds a block of queries (features `queries`, terms `terms`) to the state: U += a~^T diag(w) g~,
// y += b~^T (w delta) with w_i = exp(K - M_i). weighted: scratch of at least rows x d_v.
template <class T>
void absorb_queries(QueryState<T>& state, const FeatureRows<T>& queries, const QueryTerms<T>& terms,
                    T* weighted) {
  const Index rows = queries.rows(), d_v = queries.setup().d_v;
  double lowest = kNoQueries;
  for (Index r = 0; r < rows; ++r)
    if (terms.scale[r] != kEmpty) lowest = std::min(lowest, terms.scale[r]);
  if (lowest == kNoQueries) return;  // every row's output is zero
  lower_scale(state, lowest);
  Scratch<T> weights(rows);
  Eigen::Map<Vector<T>> w(weights.data(), rows);
  for (Index r = 0; r < rows; ++r)
    w[r] = terms.scale[r] == kEmpty ? T(0) : T(std::exp(state.K - terms.scale[r]));
  RowMap<T> g(weighted, rows, d_v);
  g = w.asDiagonal() * ConstRowMap<T>(terms.g, rows, d_v);
  gemm(const_view(queries.num()).transposed(), const_view(g), view(state.U), Write::Add);
  for (Index r = 0; r < rows; ++r) w[r] *= T(terms.delta[r]);
  state.y.noalias() += queries.den().transpose() * w;
}

// The keys' gradients from the queries in `state` (all of whom see every key of the block):
//   Gc += f_j U v_j,  dv_j += f_j U^T c~_j,  Ge += f_j y  (into Gc when den and num features are
// the same rows: every placement but NumeratorOnly),  f_j = exp(gamma_j - K).
// gc, ge [rows x m], dv [rows x d_v] are accumulated into; ge is used for NumeratorOnly only.
template <class T>
void key_terms_from_state(const QueryState<T>& state, const FeatureRows<T>& keys, const T* v, T* gc,
                          T* ge, T* dv, T* scratch_m, T* scratch_d_v) {
  if (state.K == kNoQueries) return;
  const LinearSetup& setup = keys.setup();
  const Index rows = keys.rows(), m = setup.m, d_v = setup.d_v;
  RowMap<T> from_u(scratch_m, rows, m), from_ut(scratch_d_v, rows, d_v);
  gemm(const_view(ConstRowMap<T>(v, rows, d_v)), const_view(state.U).transposed(), view(from_u),
       Write::Overwrite);
  gemm(const_view(keys.num()), const_view(state.U), view(from_ut), Write::Overwrite);
  RowMap<T> c(gc, rows, m), e(setup.plan.separate_denominator ? ge : gc, rows, m),
      value(dv, rows, d_v);
  for (Index j = 0; j < rows; ++j) {
    const T f = T(std::exp(keys.log_scale(j) - state.K));
    c.row(j) += f * from_u.row(j);
    e.row(j) += f * state.y.transpose();
    value.row(j) += f * from_ut.row(j);
  }
}

// Keys [first, first + count) of the head: dk and dv (every row written) from a query state that
// holds everything that reads them, and their kept features, by blocks of GEMMs
// (key_terms_from_state, then input_gradient): the non-causal backward's key pass, and the causal
// one's for keys past the last query, which only the final state's gradient reads.
template <class T>
void keys_from_state(const QueryState<T>& state, const KeptFeatures<T>& features,
                     const LinearGradientHead<T>& head, Index first, Index count,
                     const LinearSetup& setup);

// dx [rows x d], the gradient of the input rows x [rows x d] whose features are `block`, from the
// gradients of their numerator-side features g_num [rows x m] (overwritten) and of their
// denominator-side ones g_den (null when the caller has already added them into g_num: placements
// whose two sides are the same rows), both on the features' reciprocal scale: through R^T where
// the placement rotates, then the map.
template <class T>
void input_gradient(const FeatureRows<T>& block, const T* x, Index offset, T* g_num, const T* g_den,
                    T* dx) {
  const LinearSetup& setup = block.setup();
  const Index rows = block.rows(), m = setup.m, d = setup.d;
  if (rows == 0) return;
  RowMap<T> g(g_num, rows, m);
  const Rope* rope = setup.options.rope;
  const auto add_den = [&] {
    if (g_den) g += ConstRowMap<T>(g_den, rows, m);
  };
  const PlacementPlan& plan = setup.plan;
  if (plan.rotate_features && plan.separate_denominator) {  // den: the unrotated features
    RopeAccess::rotate_rows(*rope, g_num, rows, m, offset, Turn::Transpose);
    add_den();
  } else {
    add_den();
    if (plan.rotate_features)
      RopeAccess::rotate_rows(*rope, g_num, rows, m, offset, Turn::Transpose);
  }
  if (plan.rotate_input) {  // the map read R_p x
    Scratch<T> rotated(rows * d);
    RopeAccess::rotate_rows<T>(*rope, x, rotated.data(), rows, d, offset, Turn::Apply);
    FeatureMapAccess::backward<T>(*setup.map, ConstRowMap<T>(rotated.data(), rows, d),
                                  block.plain(), g, RowMap<T>(dx, rows, d));
    RopeAccess::rotate_rows(*rope, dx, rows, d, offset, Turn::Transpose);
  } else {
    FeatureMapAccess::backward<T>(*setup.map, ConstRowMap<T>(x, rows, d), block.plain(), g,
                                  RowMap<T>(dx, rows, d));
  }
}

// What the segments of a causal backward share (linear_causal_backward.cpp): the head, every
// query's and every seen key's features (kept: both sweeps read them; the forward's, from
// `saved`, where they cover every key the backward maps, [0, keys_read)), and each query's terms g~
// [n x d_v], delta and M (kEmpty for a zero output row), written by the sweep over the queries and
// read by the sweep over the keys.
template <class T>
struct CausalGradients {
  CausalGradients(const LinearGradientHead<T>& h, const LinearSetup& s, const SavedSlice<T>* saved,
                  Index keys_read)
      : CausalGradients(h, s, SavedRows<T>(saved ? &saved->queries : nullptr, h.n),
                        SavedRows<T>(saved ? &saved->keys : nullptr, keys_read)) {}
  CausalGradients(const LinearGradientHead<T>& h, const LinearSetup& s, SavedRows<T> q_rows,
                  SavedRows<T> k_rows)
      : head(h),
        setup(s),
        shift(h.q_offset - h.k_offset),
        queries(s, Role::Queries, q_rows.capacity(h.n), h.q_offset, q_rows.plain, q_rows.log_scale,
                q_rows.given),
        keys(s, Role::Keys, k_rows.capacity(h.n_k), h.k_offset, k_rows.plain, k_rows.log_scale,
             k_rows.given),
        g_(h.n * s.d_v, Lifetime::Thread),
        delta_(h.n, Lifetime::Thread),
        scale_(h.n, Lifetime::Thread),
        g(g_.data()),
        delta(delta_.data()),
        scale(scale_.data()) {}

  // Query i's own key, the last it sees: i + shift (outside [0, n_k): none).
  Index first_key(Index query) const {
    return causal_first_key(query, head.q_offset, head.k_offset, head.n_k);
  }
  QueryTerms<T> terms(Index qs) const { return {g + qs * setup.d_v, delta + qs, scale + qs}; }

  const LinearGradientHead<T>& head;
  const LinearSetup& setup;
  const Index shift;
  KeptFeatures<T> queries, keys;

 private:
  Scratch<T> g_;
  Scratch<double> delta_, scale_;

 public:
  T* g;
  double *delta, *scale;
};

// Adds queries [begin, end) (their kept features and terms) to the queries' state, a scan block at
// a time: a later segment's queries for an earlier segment's state, or the queries that see every
// key of a segment.
template <class T>
void absorb_query_range(QueryState<T>& state, const CausalGradients<T>& c, Index begin, Index end) {
  Scratch<T> weighted(kScanBlock * c.setup.d_v);
  for (Index qs = begin; qs < end; qs += kScanBlock) {
    const KeptBlock<T> queries(c.queries, qs, std::min(kScanBlock, end - qs));
    absorb_queries(state, queries.rows(), c.terms(qs), weighted.data());
  }
}

// The two sweeps of the causal backward over one segment (linear_scan_backward.cpp), both the
// forward scan's engine (scan_strips.hpp) with other operands:
//   scan_queries_backward: queries [q_begin, q_end) from `state`, which holds the keys before
//     first_key(q_begin) (segment 0: it absorbs the keys every query sees itself): their
//     features (into c.queries), g~, delta, M and rows of dq. Consumes `state`.
//   scan_keys_backward: keys [k_begin, k_end), from the last back, from `state`, which holds the
//     queries from q_end on (the later segments'); when the range is not empty it absorbs itself
//     the queries before q_end whose own key lies at or past k_end (they see every key of the
//     range): the keys' rows of dk and dv. Consumes `state`.
template <class T>
void scan_queries_backward(CausalGradients<T>& c, Index q_begin, Index q_end,
                           LinearState<T>& state);
template <class T>
void scan_keys_backward(CausalGradients<T>& c, Index k_begin, Index k_end, Index q_end,
                        QueryState<T>& state);

// The denominator's terms of a block of queries, from their Ga [rows x m] (S~_i g~_i) and divisors
// D~_i (0: a zero output row): delta_i = -<a~_i, Ga_i> / D~_i into delta[r] (0 for a zero row,
// and without a denominator), and Gb_i = delta_i z~_i (z_of(r): row r's z~, [1 x m]) into gb,
// overwritten, where the denominator side is other rows (NumeratorOnly), else added into ga.
template <class T, class ZOf>
void denominator_terms(const FeatureRows<T>& queries, const double* divisor, ZOf z_of,
                       RowMap<T>& ga, RowMap<T>& gb, double* delta) {
  const LinearSetup& setup = queries.setup();
  const bool separate = setup.plan.separate_denominator;
  RowMap<T>& den_side = separate ? gb : ga;
  if (separate) gb.setZero();
  for (Index r = 0; r < queries.rows(); ++r) {
    delta[r] = divisor[r] == 0 || !setup.options.denominator
                   ? 0.0
                   : -double(queries.num().row(r).dot(ga.row(r))) / divisor[r];
    den_side.row(r) += T(delta[r]) * z_of(r);
  }
}

// g~_i = g_i / D~_i for one row (zeros when the output row is zero: divisor 0).
template <class T>
void scaled_gradient(const T* g, T* out, Index d_v, double divisor) {
  if (divisor == 0) {
    std::fill(out, out + d_v, T(0));
    return;
  }
  for (Index c = 0; c < d_v; ++c) out[c] = T(double(g[c]) / divisor);
}

}  // namespace linrope::detail
