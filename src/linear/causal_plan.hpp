// Private: how a causal head is cut along the sequence into one segment of queries per thread, and
// the key states each segment starts from. The forward (linear_causal.cpp) and the backward
// (linear_causal_backward.cpp) both cut by plan_causal and both start from prefix_states, so that
// a change to either is seen by both.
#pragma once

#include <vector>

#include "linear/linear_blocks.hpp"

namespace linrope::detail {

// Segment t holds queries [query_start[t], query_start[t + 1]) and is the first to see keys
// [key_start[t], key_start[t + 1]); key_start[0] = 0 (segment 0 also takes the keys that every
// query sees) and key_start[segments] is the horizon, the first key that no query sees.
struct CausalPlan {
  Index segments = 1;
  std::vector<Index> query_start, key_start;
};

// Queries [0, n) at q_offset, keys [0, n_k) at k_offset (query i sees key j iff k_offset + j <=
// q_offset + i). Segments start at multiples of `align` (the form's block or chunk) and are at
// least max(4 align, 256) queries long, at most `threads` of them: a short head is one segment.
CausalPlan plan_causal(Index n, Index n_k, Index q_offset, Index k_offset, Index align,
                       int threads);

// The key state at each segment's start: [0] = state, [t] = state and keys [0, key_start[t]). The
// key ranges are absorbed in parallel, one per thread, then summed in order (m x d_v each). With
// `keep`, every key's features up to the horizon are also computed into it (the backward reuses
// them), the last segment's keys included.
template <class T>
std::vector<LinearState<T>> prefix_states(const CausalPlan& plan, const LinearState<T>& state,
                                          const T* k, const T* v, Index k_offset,
                                          const LinearSetup& setup, KeptFeatures<T>* keep);

}  // namespace linrope::detail
