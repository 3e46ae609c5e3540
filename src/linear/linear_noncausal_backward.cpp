// The gradient of non-causal linear attention (the algebra is in linear_backward.hpp). Every query
// reads the same state (S~, z~) at the same scale M, so the pass is: the keys' state, as in the
// forward, their features kept; the queries in parts, each giving its rows of dq and its share of
// the query state (U, y); the shares merged in order; then the keys in parts, each giving its rows
// of dk and dv from the kept features. The parts are those of the forward (part_count): the same
// bits for any number of threads.
#include <vector>

#include "linear/linear_backward.hpp"

namespace linrope::detail {
namespace {

// Queries [0, n) against the complete key state: dq, and their query state.
template <class T>
void query_pass(const LinearState<T>& keys_state, const T* q, const T* d_out, T* dq, Index n,
                Index q_pos0, const LinearSetup& setup, QueryState<T>& queries_state) {
  const Index m = setup.m, d = setup.d, dv = setup.dv;
  const Index block = std::min<Index>(block_rows(m), std::max<Index>(n, 1));
  FeatureBlock<T> queries(setup, block, Plain::Kept);
  Scratch<T> g_scratch(block * dv), ga_scratch(block * m), gb_scratch(block * m),
      weighted(block * dv);
  std::vector<double> delta(block), scale(block);
  const bool separate = setup.plan.separate_denominator;
  for (Index qs = 0; qs < n; qs += block) {
    const Index rows = std::min(block, n - qs);
    queries.compute(q + qs * d, rows, q_pos0 + qs);
    check_input(setup, d_out + qs * dv, rows, dv);
    RowMap<T> g(g_scratch.data(), rows, dv), ga(ga_scratch.data(), rows, m),
        gb(gb_scratch.data(), rows, m);
    const Vector<T> den = queries.den() * keys_state.z;
    std::vector<double> divisor(rows);
    for (Index r = 0; r < rows; ++r) {
      const double log_scale = queries.log_scale(r) + keys_state.M;
      divisor[r] = stabilized_divisor(double(den[r]), log_scale, setup.options.eps);
      scale[r] = divisor[r] == 0 ? kEmpty : keys_state.M;
      scaled_gradient(d_out + (qs + r) * dv, g.data() + r * dv, dv, divisor[r]);
    }
    gemm(const_view(g), const_view(keys_state.S).transposed(), view(ga), false);
    RowMap<T>& den_side = separate ? gb : ga;
    if (separate) gb.setZero();
    for (Index r = 0; r < rows; ++r) {
      delta[r] = divisor[r] == 0 ? 0.0 : -double(queries.num().row(r).dot(ga.row(r))) / divisor[r];
      den_side.row(r) += T(delta[r]) * keys_state.z.transpose();
    }
    absorb_queries(queries_state, queries.all(),
                   QueryTerms<T>{g.data(), delta.data(), scale.data()}, weighted.data());
    input_gradient(queries.all(), q + qs * d, q_pos0 + qs, ga.data(),
                   separate ? gb.data() : nullptr, dq + qs * d);
  }
}

// Keys [first, first + count) of the head: dk and dv from the complete query state and the kept
// key features.
template <class T>
void key_pass(const QueryState<T>& queries_state, const KeptFeatures<T>& features,
              const LinearGradientHead<T>& head, Index first, Index count,
              const LinearSetup& setup) {
  const Index m = setup.m, d = setup.d, dvw = setup.dv;
  const Index block = std::min<Index>(block_rows(m), std::max<Index>(count, 1));
  Scratch<T> gc(block * m), ge(block * m), scratch_m(block * m), scratch_dv(block * dvw);
  const bool separate = setup.plan.separate_denominator;
  for (Index js = first; js < first + count; js += block) {
    const Index rows = std::min(block, first + count - js);
    const FeatureRows<T> keys = features.range(js, rows);
    T* dv = head.dv + js * dvw;
    RowMap<T>(gc.data(), rows, m).setZero();
    if (separate) RowMap<T>(ge.data(), rows, m).setZero();
    RowMap<T>(dv, rows, dvw).setZero();
    key_terms_from_state(queries_state, keys, head.v + js * dvw, gc.data(), ge.data(), dv,
                         scratch_m.data(), scratch_dv.data());
    input_gradient(keys, head.k + js * d, head.k_pos0 + js, gc.data(),
                   separate ? ge.data() : nullptr, head.dk + js * d);
  }
}

}  // namespace

template <class T>
void linear_noncausal_backward(const LinearGradientHead<T>& head, const LinearSetup& setup,
                               Threads threading) {
  const Index n = head.n, nk = head.nk, d = setup.d, dv = setup.dv;
  const int threads = usable_threads(threading);
  LinearState<T> keys_state;
  KeptFeatures<T> key_features(setup, nk, Plain::Kept);
  absorb_key_parts(keys_state, head.k, head.v, nk, head.k_pos0, setup, threads, &key_features);
  key_features.fill(nk);

  const Index block = block_rows(setup.m);
  const Index query_parts = part_count(n, block);
  std::vector<QueryState<T>> parts(query_parts);
  parallel_for(query_parts, threads, Schedule::Static, [&](Index t) {
    const Index begin = split_point(n, query_parts, t, block);
    const Index end = split_point(n, query_parts, t + 1, block);
    parts[t].reset(setup.m, dv);
    query_pass(keys_state, head.q + begin * d, head.d_out + begin * dv, head.dq + begin * d,
               end - begin, head.q_pos0 + begin, setup, parts[t]);
  });
  QueryState<T> queries_state;
  queries_state.reset(setup.m, dv);
  for (const auto& part : parts) merge(queries_state, part);

  const Index key_parts = part_count(nk, kPartRows);
  parallel_for(key_parts, threads, Schedule::Static, [&](Index t) {
    const Index begin = split_point(nk, key_parts, t, kPartRows);
    const Index end = split_point(nk, key_parts, t + 1, kPartRows);
    key_pass(queries_state, key_features, head, begin, end - begin, setup);
  });
}

template void linear_noncausal_backward<float>(const LinearGradientHead<float>&, const LinearSetup&,
                                               Threads);
template void linear_noncausal_backward<double>(const LinearGradientHead<double>&,
                                                const LinearSetup&, Threads);

}  // namespace linrope::detail
