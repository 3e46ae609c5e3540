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

template <class T>
void linear_causal_backward(const LinearGradientHead<T>& head, const LinearSetup& setup,
                            Threads threading) {
  CausalGradients<T> c(head, setup);
  const Index n = head.n, n_k = head.n_k, d = setup.d, d_v = setup.d_v, m = setup.m;
  const Index horizon = n > 0 ? c.first_key(n) : 0;  // keys [horizon, n_k) are seen by no query
  std::fill(head.dk + horizon * d, head.dk + n_k * d, T(0));
  std::fill(head.dv + horizon * d_v, head.dv + n_k * d_v, T(0));
  check_input(setup, head.k + horizon * d, n_k - horizon, d);  // read by nothing else
  check_input(setup, head.v + horizon * d_v, n_k - horizon, d_v);
  if (n == 0) return;
  const CausalPlan plan =
      plan_causal(n, n_k, head.q_offset, head.k_offset, kScanBlock, usable_threads(threading));
  const Index segments = plan.segments;
  const std::vector<Index>&query_start = plan.query_start, &key_start = plan.key_start;
  LinearState<T> empty;
  empty.reset(m, d_v);
  std::vector<LinearState<T>> start =
      prefix_states<T>(plan, empty, head.k, head.v, head.k_offset, setup, &c.keys);
  parallel_for(segments, int(segments), Schedule::Static, [&](Index t) {
    scan_queries_backward(c, query_start[t], query_start[t + 1], start[t]);
  });
  c.queries.fill(n);
  // The queries' state at each segment's end: the later segments' queries, summed from the back.
  std::vector<QueryState<T>> end(segments);
  parallel_for(segments, int(segments), Schedule::Static, [&](Index t) {
    end[t].reset(m, d_v);
    if (t > 0) absorb_query_range(end[t], c, query_start[t], query_start[t + 1]);  // for end[t - 1]
  });
  for (Index t = 0; t + 1 < segments; ++t) end[t] = std::move(end[t + 1]);
  end[segments - 1].reset(m, d_v);
  for (Index t = segments - 3; t >= 0; --t) merge(end[t], end[t + 1]);
  parallel_for(segments, int(segments), Schedule::Static, [&](Index t) {
    scan_keys_backward(c, key_start[t], key_start[t + 1], query_start[t + 1], end[t]);
  });
}

template void linear_causal_backward<float>(const LinearGradientHead<float>&, const LinearSetup&,
                                            Threads);
template void linear_causal_backward<double>(const LinearGradientHead<double>&, const LinearSetup&,
                                             Threads);

}  // namespace linrope::detail
