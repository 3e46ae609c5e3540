// Private: the two causal forms behind linear_causal (linear_kernel.hpp), one head, no thread
// split: query i sees key j iff k_offset + j <= q_offset + i, plus everything already in `state`.
// FinalState::EveryKey: every key ends up in `state`. Never throw but std::bad_alloc.
#pragma once

#include "linear/linear_kernel.hpp"
#include "linear/scan_strips.hpp"

namespace linrope::detail {

// Quadratic (masked GEMMs) inside chunks of setup.options.chunk_size queries, the state between.
template <class T>
void causal_chunked(const LinearHead<T>& head, const LinearSetup& setup, LinearState<T>& state,
                    FinalState final_state, DenominatorTally* tally);

// The recurrence, a block of 64 queries at a time, the state swept in strips.
template <class T>
void causal_scan(const LinearHead<T>& head, const LinearSetup& setup, LinearState<T>& state,
                 FinalState final_state, DenominatorTally* tally);

}  // namespace linrope::detail
