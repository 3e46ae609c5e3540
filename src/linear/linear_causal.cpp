// Causal linear attention: picks the scan or the chunked form, and splits a long head into one
// segment of the sequence per thread.
#include <algorithm>
#include <vector>

#include "linear/causal_plan.hpp"
#include "linear/linear_forms.hpp"

namespace linrope::detail {

// Split across threads (when allowed and long enough; causal_plan.hpp): the queries are cut into
// one segment per thread at chunk (or scan block) boundaries, each segment's starting key state
// summed first (prefix_states), then each segment runs the chunked form or the scan from it. The
// key features that prefix_states absorbed are computed again by the segments (for the chunked
// form, measured when it was the only one split: ~25% more work for 2x the threads).
template <class T>
void linear_causal(const LinearHead<T>& head, const LinearSetup& setup, LinearState<T>& state,
                   FinalState final_state, DenominatorTally* tally, Threads threading) {
  const T *q = head.q, *k = head.k, *v = head.v;
  T* out = head.out;
  const Index n = head.n, n_k = head.n_k, q_offset = head.q_offset, k_offset = head.k_offset;
  // Keys past the last query's horizon are never read: check them here.
  if (final_state == FinalState::Discarded) {
    const Index horizon = causal_horizon(n, n_k, q_offset, k_offset);
    check_input(setup, k + horizon * setup.d, n_k - horizon, setup.d);
    check_input(setup, v + horizon * setup.d_v, n_k - horizon, setup.d_v);
  }
  // A call of a few tokens (a stream's step) runs as the scan whatever the method: the chunked
  // form's products pack the m x d_v state on every call, which the scan's rank-1 updates do not.
  // One-token steps, eq. 19: elu+1 1.15 -> 0.61 us, FAVOR+ 5.4 -> 3.0 us; at 4 tokens the two tie.
  constexpr Index kScanTokens = 3;
  const bool scan =
      setup.options.method == CausalMethod::Scan || (n <= kScanTokens && n_k <= kScanTokens);
  const Index d = setup.d, d_v = setup.d_v;
  // Queries [q0, q0 + rows) against the keys from k0 on, from the state `from`.
  const auto run = [&](Index q0, Index k0, Index rows, LinearState<T>& from, FinalState rest,
                       DenominatorTally* part) {
    const LinearHead<T> segment{
        q + q0 * d, k + k0 * d,    v + k0 * d_v,  out + q0 * d_v,    rows,
        n_k - k0,   q_offset + q0, k_offset + k0, head.keep_queries, head.keep_keys};
    if (scan)
      causal_scan(segment, setup, from, rest, part);
    else
      causal_chunked(segment, setup, from, rest, part);
  };
  const Index L =
      scan ? kScanBlock : std::min(setup.options.chunk_size, std::max<Index>({n, n_k, 1}));
  const CausalPlan plan = plan_causal(n, n_k, q_offset, k_offset, L, usable_threads(threading));
  if (plan.segments < 2) {
    run(0, 0, n, state, final_state, tally);
    return;
  }
  const Index segments = plan.segments;
  std::vector<LinearState<T>> prefix =
      prefix_states<T>(plan, state, k, v, k_offset, setup, /*keep=*/nullptr);
  std::vector<DenominatorTally> tallies(segments, tally ? tally->empty() : DenominatorTally(0));
  parallel_for(segments, int(segments), Schedule::Static, [&](Index t) {
    const Index q0 = plan.query_start[t], k0 = plan.key_start[t];
    run(q0, k0, plan.query_start[t + 1] - q0, prefix[t],
        t + 1 == segments ? final_state : FinalState::Discarded, tally ? &tallies[t] : nullptr);
  });
  if (final_state == FinalState::EveryKey) state = std::move(prefix[segments - 1]);
  if (tally)
    for (const auto& part : tallies) tally->merge(part);
}

template void linear_causal<float>(const LinearHead<float>&, const LinearSetup&,
                                   LinearState<float>&, FinalState, DenominatorTally*, Threads);
template void linear_causal<double>(const LinearHead<double>&, const LinearSetup&,
                                    LinearState<double>&, FinalState, DenominatorTally*, Threads);

}  // namespace linrope::detail
