// The gradient of non-causal linear attention (the algebra is in linear_backward.hpp). Every query
// reads the same state (S~, z~) at the same scale M, so the pass is: the keys' state, as in the
// forward, their features kept; the queries in parts, each giving its rows of dq and its share of
// the query state (U, y); the shares merged in order; then the keys in parts, each giving its rows
// of dk and dv from the kept features. The parts are those of the forward (part_count): the same
// bits for any number of threads.
#include <optional>
#include <vector>

#include "linear/linear_backward.hpp"

namespace linrope::detail {
namespace {

// Queries [0, n) against the complete key state: dq, and their query state. kept: the forward's
// features of these queries (their row 0 is query 0 here), or null: mapped here.
template <class T>
void query_pass(const LinearState<T>& keys_state, const T* q, const T* d_out, T* dq, Index n,
                Index q_offset, const LinearSetup& setup, QueryState<T>& queries_state,
                const KeptFeatures<T>* kept, Index kept_at) {
  const Index m = setup.m, d = setup.d, d_v = setup.d_v;
  const Index block = std::min<Index>(block_rows(m), std::max<Index>(n, 1));
  FeatureBlock<T> mapped(setup, Role::Queries, kept ? 0 : block, Plain::Kept);
  Scratch<T> g_scratch(block * d_v), ga_scratch(block * m), gb_scratch(block * m),
      weighted(block * d_v);
  std::vector<double> delta(block), scale(block);
  const bool separate = setup.plan.separate_denominator;
  for (Index qs = 0; qs < n; qs += block) {
    const Index rows = std::min(block, n - qs);
    std::optional<KeptBlock<T>> given;
    if (kept)
      given.emplace(*kept, kept_at + qs, rows);
    else
      mapped.compute(q + qs * d, rows, q_offset + qs);
    const FeatureRows<T> queries = kept ? given->rows() : mapped.all();
    check_input(setup, d_out + qs * d_v, rows, d_v);
    RowMap<T> g(g_scratch.data(), rows, d_v), ga(ga_scratch.data(), rows, m),
        gb(gb_scratch.data(), rows, m);
    const Vector<T> den = queries.den() * keys_state.z;
    std::vector<double> divisor(rows);
    for (Index r = 0; r < rows; ++r) {
      const double log_scale = queries.log_scale(r) + keys_state.M;
      divisor[r] = output_divisor(double(den[r]), log_scale, setup.options);
      scale[r] = divisor[r] == 0 ? kEmpty : keys_state.M;
      scaled_gradient(d_out + (qs + r) * d_v, g.data() + r * d_v, d_v, divisor[r]);
    }
    gemm(const_view(g), const_view(keys_state.S).transposed(), view(ga), Write::Overwrite);
    denominator_terms(
        queries, divisor.data(), [&](Index) { return keys_state.z.transpose(); }, ga, gb,
        delta.data());
    absorb_queries(queries_state, queries, QueryTerms<T>{g.data(), delta.data(), scale.data()},
                   weighted.data());
    input_gradient(queries, q + qs * d, q_offset + qs, ga.data(), separate ? gb.data() : nullptr,
                   dq + qs * d);
  }
}

}  // namespace

template <class T>
void keys_from_state(const QueryState<T>& queries_state, const KeptFeatures<T>& features,
                     const LinearGradientHead<T>& head, Index first, Index count,
                     const LinearSetup& setup) {
  const Index m = setup.m, d = setup.d, d_v = setup.d_v;
  const Index block = std::min<Index>(block_rows(m), std::max<Index>(count, 1));
  Scratch<T> gc(block * m), ge(block * m), scratch_m(block * m), scratch_d_v(block * d_v);
  const bool separate = setup.plan.separate_denominator;
  for (Index js = first; js < first + count; js += block) {
    const Index rows = std::min(block, first + count - js);
    const KeptBlock<T> kept(features, js, rows);
    const FeatureRows<T>& keys = kept.rows();
    T* dv = head.dv + js * d_v;
    RowMap<T>(gc.data(), rows, m).setZero();
    if (separate) RowMap<T>(ge.data(), rows, m).setZero();
    RowMap<T>(dv, rows, d_v).setZero();
    key_terms_from_state(queries_state, keys, head.v + js * d_v, gc.data(), ge.data(), dv,
                         scratch_m.data(), scratch_d_v.data());
    input_gradient(keys, head.k + js * d, head.k_offset + js, gc.data(),
                   separate ? ge.data() : nullptr, head.dk + js * d);
  }
}

template <class T>
void linear_noncausal_backward(const LinearGradientHead<T>& head, const LinearSetup& setup,
                               Threads threading, const SavedSlice<T>* saved) {
  const Index n = head.n, n_k = head.n_k, d = setup.d, d_v = setup.d_v;
  const int threads = usable_threads(threading);
  LinearState<T> keys_state;
  const SavedRows<T> k_rows(saved ? &saved->keys : nullptr, n_k),
      q_rows(saved ? &saved->queries : nullptr, n);
  KeptFeatures<T> key_features(setup, Role::Keys, k_rows.capacity(n_k), head.k_offset, k_rows.plain,
                               k_rows.log_scale, k_rows.given);
  std::optional<KeptFeatures<T>> query_features;
  if (q_rows.use)
    query_features.emplace(setup, Role::Queries, n, head.q_offset, q_rows.plain, q_rows.log_scale,
                           q_rows.given);
  absorb_key_parts(keys_state, head.k, head.v, n_k, head.k_offset, setup, threads, &key_features);
  key_features.fill(n_k);

  const Index block = block_rows(setup.m);
  const Index query_parts = part_count(n, block);
  std::vector<QueryState<T>> parts(query_parts);
  parallel_for(query_parts, threads, Schedule::Static, [&](Index t) {
    const Index begin = split_point(n, query_parts, t, block);
    const Index end = split_point(n, query_parts, t + 1, block);
    parts[t].reset(setup.m, d_v);
    query_pass(keys_state, head.q + begin * d, head.d_out + begin * d_v, head.dq + begin * d,
               end - begin, head.q_offset + begin, setup, parts[t],
               query_features ? &*query_features : nullptr, begin);
  });
  QueryState<T> queries_state;
  queries_state.reset(setup.m, d_v);
  for (const auto& part : parts) merge(queries_state, part);

  const Index key_parts = part_count(n_k, kPartRows);
  parallel_for(key_parts, threads, Schedule::Static, [&](Index t) {
    const Index begin = split_point(n_k, key_parts, t, kPartRows);
    const Index end = split_point(n_k, key_parts, t + 1, kPartRows);
    keys_from_state(queries_state, key_features, head, begin, end - begin, setup);
  });
}

template void keys_from_state<float>(const QueryState<float>&, const KeptFeatures<float>&,
                                     const LinearGradientHead<float>&, Index, Index,
                                     const LinearSetup&);
template void keys_from_state<double>(const QueryState<double>&, const KeptFeatures<double>&,
                                      const LinearGradientHead<double>&, Index, Index,
                                      const LinearSetup&);
template void linear_noncausal_backward<float>(const LinearGradientHead<float>&, const LinearSetup&,
                                               Threads, const SavedSlice<float>*);
template void linear_noncausal_backward<double>(const LinearGradientHead<double>&,
                                                const LinearSetup&, Threads,
                                                const SavedSlice<double>*);

}  // namespace linrope::detail
