// The gradient of causal linear attention, whichever form ran the forward (the chunked form and
// the scan compute one function): the scan's two sweeps (linear_scan_backward.cpp), over the
// segments of the forward's plan (causal_plan.hpp). Nothing n x n, nothing recomputed from a
// later key: query i's terms depend on keys up to i only, and key j's on queries from j on. The
// features are computed once and kept for both sweeps (O(n m)), and each query's g~, delta and M
// (O(n d_v)).
//
// A long head, when threads are free, is cut into one segment per thread: the keys' state at each
// segment's start (prefix_states, as the forward) and the queries' state at each segment's end
// are summed first (one extra GEMM pass over the keys and one over the queries), then the
// segments sweep in parallel; the last bits then depend on the thread count (attention.hpp,
// "Reproducibility").
#include <algorithm>
#include <vector>

#include "linear/causal_plan.hpp"
#include "linear/linear_backward.hpp"
#include "linear/scan_strips.hpp"

namespace linrope::detail {

// The final state's gradient enters the keys' sweep as one more query, one that sees every key at
// the final scale (the largest key scale, or the initial state's): U = dL/dS~, y = dL/dz~ at K =
// that scale. dL/dS~ of the initial state is what every query (and that one) gives it, the keys'
// sweep's state once all of them are in, times exp(initial log scale - K) <= 1.
template <class T>
QueryState<T> final_state_gradient(const StatePorts<T>& ports, double final_scale, Index m,
                                   Index d_v) {
  QueryState<T> state;
  state.reset(m, d_v);
  if (ports.d_final_S == nullptr || final_scale == kEmpty) return state;
  state.U = ConstRowMap<T>(ports.d_final_S, m, d_v);
  state.y = Eigen::Map<const Vector<T>>(ports.d_final_z, m);
  state.K = final_scale;
  return state;
}

template <class T>
void store_initial_gradient(const StatePorts<T>& ports, const QueryState<T>& all, Index m,
                            Index d_v) {
  RowMap<T> dS(ports.d_initial_S, m, d_v);
  Eigen::Map<Vector<T>> dz(ports.d_initial_z, m);
  if (ports.initial_log_scale == kEmpty || all.K == kNoQueries) {
    dS.setZero();
    dz.setZero();
    return;
  }
  const T factor = T(std::exp(ports.initial_log_scale - all.K));
  dS = factor * all.U;
  dz = factor * all.y;
}

template <class T>
void linear_causal_backward(const LinearGradientHead<T>& head, const LinearSetup& setup,
                            Threads threading, const StatePorts<T>& ports,
                            const SavedSlice<T>* saved) {
  const Index n = head.n, n_k = head.n_k, d = setup.d, d_v = setup.d_v, m = setup.m;
  // Keys [horizon, n_k) are seen by no query. Without the final state's gradient nothing reads
  // them; with it, it alone does: a GEMM pass at the end (keys_from_state), not the sweeps (a
  // keys-only call, as linrope.torch.distributed makes, is all such keys).
  const bool final_gradient = ports.d_final_S != nullptr;
  const Index horizon = causal_horizon(n, n_k, head.q_offset, head.k_offset);
  // The keys this backward maps: up to the horizon, and with no query at all still those before
  // the first one (the sweep over the queries absorbs them); all of them for the final state.
  const Index keys_read =
      final_gradient ? n_k : causal_first_key(n, head.q_offset, head.k_offset, n_k);
  CausalGradients<T> c(head, setup, saved, keys_read);
  const int threads = usable_threads(threading);
  check_input(setup, head.v + horizon * d_v, n_k - horizon, d_v);  // read by no sweep
  if (!final_gradient) {
    std::fill(head.dk + horizon * d, head.dk + n_k * d, T(0));
    std::fill(head.dv + horizon * d_v, head.dv + n_k * d_v, T(0));
    check_input(setup, head.k + horizon * d, n_k - horizon, d);  // (else their features check)
  }
  const LinearState<T> initial =
      load_state(ports.initial_S, ports.initial_z, ports.initial_log_scale, m, d_v);
  const CausalPlan plan = plan_causal(n, n_k, head.q_offset, head.k_offset, kScanBlock, threads);
  const Index segments = plan.segments;
  const std::vector<Index>&query_start = plan.query_start, &key_start = plan.key_start;
  std::vector<LinearState<T>> start =
      prefix_states<T>(plan, initial, head.k, head.v, head.k_offset, setup, &c.keys);
  if (final_gradient) {  // the keys past the horizon too, for their own pass and the final scale
    keep_features(c.keys, head.k, horizon, n_k);
    c.keys.fill(n_k);
  }
  parallel_for(segments, int(segments), Schedule::Static, [&](Index t) {
    scan_queries_backward(c, query_start[t], query_start[t + 1], start[t]);
  });
  c.queries.fill(n);
  // The queries' state at each segment's end: the later segments' queries, summed from the back,
  // after the final state's gradient.
  std::vector<QueryState<T>> end(segments);
  parallel_for(segments, int(segments), Schedule::Static, [&](Index t) {
    end[t].reset(m, d_v);
    if (t > 0) absorb_query_range(end[t], c, query_start[t], query_start[t + 1]);  // for end[t - 1]
  });
  for (Index t = 0; t + 1 < segments; ++t) end[t] = std::move(end[t + 1]);
  const double final_scale = std::max(initial.M, c.keys.max_log_scale());
  end[segments - 1] = final_state_gradient(ports, final_scale, m, d_v);
  if (final_gradient) {
    const QueryState<T>& final_only = end[segments - 1];
    const Index tail = n_k - horizon, parts = part_count(tail, kPartRows);
    parallel_for(parts, threads, Schedule::Static, [&](Index t) {
      const Index begin = horizon + split_point(tail, parts, t, kPartRows);
      const Index end_key = horizon + split_point(tail, parts, t + 1, kPartRows);
      keys_from_state(final_only, c.keys, head, begin, end_key - begin, setup);
    });
  }
  for (Index t = segments - 2; t >= 0; --t) merge(end[t], end[t + 1]);
  parallel_for(segments, int(segments), Schedule::Static, [&](Index t) {
    scan_keys_backward(c, key_start[t], key_start[t + 1], query_start[t + 1], end[t]);
  });
  if (ports.d_initial_S == nullptr) return;
  // end[0] now holds every query whose own key is a key of this call; those before the first key
  // (or all of segment 0's, when its sweep had no key and so took none) saw the initial state only.
  const Index unseen =
      key_start[1] > 0 ? std::clamp(-c.shift, Index(0), query_start[1]) : query_start[1];
  absorb_query_range(end[0], c, 0, unseen);
  store_initial_gradient(ports, end[0], m, d_v);
}

template void linear_causal_backward<float>(const LinearGradientHead<float>&, const LinearSetup&,
                                            Threads, const StatePorts<float>&,
                                            const SavedSlice<float>*);
template void linear_causal_backward<double>(const LinearGradientHead<double>&, const LinearSetup&,
                                             Threads, const StatePorts<double>&,
                                             const SavedSlice<double>*);

}  // namespace linrope::detail
