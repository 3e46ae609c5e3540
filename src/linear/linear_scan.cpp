// The causal scan: the recurrence one token at a time (the RNN view of Katharopoulos et al.), its
// state swept in cache-sized strips by blocks of queries (scan_strips.hpp).
#include <algorithm>
#include <optional>

#include "linear/linear_blocks.hpp"
#include "linear/linear_forms.hpp"
#include "linear/scan_strips.hpp"

namespace linrope::detail {

// S += psi_j v_j^T and z += psi_j one key at a time, o_i = phi_i S / (phi_i z + eps). Queries go in
// blocks of kScanBlock: their features, and their own keys', are computed by block; admit_key
// works out each query's scale and denominator (scalars and the m-vector z), then scan_steps runs
// the block's rank-one updates and read-outs through strips of S. Keys that no query reads between
// enter a block at a time, as in the chunked form (absorb): those before a block's first query
// (n_k ahead of n), and those after the last query for FinalState::EveryKey (which no caller has
// yet: the stream's queries and keys are the same tokens).
template <class T>
void causal_scan(const LinearHead<T>& head, const LinearSetup& setup, LinearState<T>& state,
                 FinalState final_state, DenominatorTally* tally) {
  const T *q = head.q, *k = head.k, *v = head.v;
  T* out = head.out;
  const Index n = head.n, n_k = head.n_k, q_offset = head.q_offset, k_offset = head.k_offset;
  const Index d = setup.d, d_v = setup.d_v, m = setup.m;
  const Index shift = q_offset - k_offset;  // query i sees key j iff j <= i + shift
  FeatureBlock<T> queries(setup, Role::Queries, kScanBlock), keys(setup, Role::Keys, kScanBlock);
  queries.keep_into(head.keep_queries);
  keys.keep_into(head.keep_keys);
  ScanSteps<T> steps;
  double scale[kScanBlock], den[kScanBlock];  // the state's log scale M and den~ at each read
  Scratch<T> numerator(kScanBlock * d_v);     // the block's numerators, row-major
  Matrix<T> weighted;
  Vector<T> weights;
  // A long scan sweeps S in panels (scan_strips.hpp); a stream's few tokens read it in place,
  // where copying it in and out would cost more than the panels save.
  std::optional<PanelState<T>> panels;
  if (n >= kPanelSteps) {
    panels.emplace(m, d_v);
    panels->load(state.S);
  }
  const ScanState<T> S = panels ? panels->state() : ScanState<T>{state.S.data(), m, d_v, false};
  Index next = 0;  // keys [0, next) are in the state
  const auto absorb_until = [&](Index end) {
    if (end <= next) return;
    if (panels) panels->store(state.S);  // absorb's products and rescaling work on S itself
    absorb_through(state, keys, k, v, k_offset, next, end, weighted, weights);
    if (panels) panels->load(state.S);
  };
  for (Index qs = 0; qs < n; qs += kScanBlock) {
    const Index rows = std::min(kScanBlock, n - qs);
    absorb_until(std::clamp(qs + shift, next, n_k));
    // Query r's own key qs + r + shift, when it exists: keys [first, last).
    const Index first = next, last = std::clamp(qs + rows + shift, next, n_k);
    if (last > first) {
      keys.compute(k + first * d, last - first, k_offset + first);
      check_input(setup, v + first * d_v, last - first, d_v);
      state.peak = std::max(state.peak, keys.max_log_scale());  // each is admitted below
    }
    queries.compute(q + qs * d, rows, q_offset + qs);
    steps.count = rows;
    for (Index r = 0; r < rows; ++r) {
      const Index j = qs + r + shift - first;  // relative to first
      steps.read[r] = queries.num().data() + r * m;
      steps.out[r] = numerator.data() + r * d_v;
      steps.key[r] = nullptr;
      steps.factor[r] = T(1);
      if (j >= 0 && j < last - first) {
        const Admitted<T> a = admit_key(state.z, state.M, keys.log_scale(j),
                                        keys.den().data() + j * m, setup.headroom);
        steps.key[r] = keys.num().data() + j * m;
        steps.value[r] = v + (first + j) * d_v;
        steps.factor[r] = a.factor;
        steps.weight[r] = a.weight;
      }
      scale[r] = state.M;
      den[r] = state.M == kEmpty ? 0.0 : double(queries.den().row(r).dot(state.z));
    }
    scan_steps(S, steps);
    for (Index r = 0; r < rows; ++r)
      write_output(out + (qs + r) * d_v, numerator.data() + r * d_v, d_v, den[r],
                   queries.log_scale(r) + scale[r], setup.options, tally);
    next = last;
  }
  if (panels) panels->store(state.S);
  if (final_state == FinalState::EveryKey)
    absorb_through(state, keys, k, v, k_offset, next, n_k, weighted, weights);
}

template void causal_scan<float>(const LinearHead<float>&, const LinearSetup&, LinearState<float>&,
                                 FinalState, DenominatorTally*);
template void causal_scan<double>(const LinearHead<double>&, const LinearSetup&,
                                  LinearState<double>&, FinalState, DenominatorTally*);

}  // namespace linrope::detail
