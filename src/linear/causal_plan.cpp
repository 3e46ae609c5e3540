// The causal segment plan and the segments' starting key states (causal_plan.hpp).
#include "linear/causal_plan.hpp"

#include <algorithm>

namespace linrope::detail {

CausalPlan plan_causal(Index n, Index n_k, Index q_offset, Index k_offset, Index align,
                       int threads) {
  CausalPlan plan;
  plan.segments = std::clamp<Index>(n / std::max<Index>(4 * align, 256), 1, std::max(threads, 1));
  plan.query_start.resize(plan.segments + 1);
  plan.key_start.resize(plan.segments + 1);
  for (Index t = 0; t <= plan.segments; ++t) {
    plan.query_start[t] = split_point(n, plan.segments, t, align);
    plan.key_start[t] = t == 0 ? 0 : causal_first_key(plan.query_start[t], q_offset, k_offset, n_k);
  }
  return plan;
}

template <class T>
std::vector<LinearState<T>> prefix_states(const CausalPlan& plan, const LinearState<T>& state,
                                          const T* k, const T* v, Index k_offset,
                                          const LinearSetup& setup, KeptFeatures<T>* keep) {
  const Index segments = plan.segments, d = setup.d, d_v = setup.d_v;
  const std::vector<Index>& key_start = plan.key_start;
  std::vector<LinearState<T>> prefix(segments);
  // prefix[t + 1] takes keys [key_start[t], key_start[t + 1]) for now.
  parallel_for(segments, int(segments), Schedule::Static, [&](Index t) {
    const Index begin = key_start[t], end = key_start[t + 1];
    if (t + 1 < segments) {
      prefix[t + 1].reset(setup.m, d_v);
      absorb_keys(prefix[t + 1], k + begin * d, v + begin * d_v, end - begin, k_offset + begin,
                  setup, keep, begin);
    } else if (keep) {
      keep_features(*keep, k, begin, end);
    }
  });
  if (keep) keep->fill(key_start[segments]);
  prefix[0] = state;
  for (Index t = 1; t < segments; ++t) {
    LinearState<T> keys_of_previous = std::move(prefix[t]);
    prefix[t] = prefix[t - 1];
    merge(prefix[t], keys_of_previous, setup.headroom);
  }
  return prefix;
}

template std::vector<LinearState<float>> prefix_states(const CausalPlan&, const LinearState<float>&,
                                                       const float*, const float*, Index,
                                                       const LinearSetup&, KeptFeatures<float>*);
template std::vector<LinearState<double>> prefix_states(const CausalPlan&,
                                                        const LinearState<double>&, const double*,
                                                        const double*, Index, const LinearSetup&,
                                                        KeptFeatures<double>*);

}  // namespace linrope::detail
