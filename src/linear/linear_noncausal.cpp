// Non-causal linear attention: every query sees every key. The keys are absorbed into the state
// S, z in parts, then the queries read it out.
#include <vector>

#include "linear/linear_blocks.hpp"

namespace linrope::detail {
namespace {

// Non-causal read-out of n queries against a complete state. Each block's product fetches the
// output rows it is about to write and the next block's queries (as absorb_keys does).
template <class T>
void read_out(const LinearState<T>& state, const T* q, T* out, Index n, Index q_offset,
              const LinearSetup& setup, DenominatorTally* tally, KeptFeatures<T>* keep) {
  const Index block = std::min<Index>(block_rows(setup.m), std::max<Index>(n, 1));
  FeatureBlock<T> queries(setup, Role::Queries, block);
  queries.keep_into(keep);
  Matrix<T> numerator;
  Vector<T> den;
  for (Index qs = 0; qs < n; qs += block) {
    const Index rows = std::min(block, n - qs), next_rows = std::min(block, n - qs - rows);
    queries.compute(q + qs * setup.d, rows, q_offset + qs);
    numerator.resize(rows, setup.d_v);
    gemm(const_view(queries.num()), const_view(state.S), view(numerator), Write::Overwrite,
         Prefetch{{rows_of(out, setup.d_v, qs, rows), rows_of(q, setup.d, qs + rows, next_rows)}});
    den.noalias() = queries.den() * state.z;
    for (Index r = 0; r < rows; ++r)
      write_output(out + (qs + r) * setup.d_v, numerator.data() + r * setup.d_v, setup.d_v,
                   double(den[r]), queries.log_scale(r) + state.M, setup.options, tally);
  }
}

}  // namespace

template <class T>
void absorb_key_parts(LinearState<T>& state, const T* k, const T* v, Index n_k, Index k_offset,
                      const LinearSetup& setup, int threads, KeptFeatures<T>* keep,
                      KeptFeatures<T>* sink) {
  const Index d = setup.d, d_v = setup.d_v;
  state.reset(setup.m, d_v);
  const Index key_parts = part_count(n_k, kPartRows);
  if (key_parts == 1) {
    absorb_keys(state, k, v, n_k, k_offset, setup, keep, 0, sink);
    return;
  }
  std::vector<LinearState<T>> parts(key_parts);
  for (auto& part : parts) part.reset(setup.m, d_v);
  parallel_for(key_parts, threads, Schedule::Static, [&](Index t) {
    const Index begin = split_point(n_k, key_parts, t, kPartRows);
    const Index end = split_point(n_k, key_parts, t + 1, kPartRows);
    absorb_keys(parts[t], k + begin * d, v + begin * d_v, end - begin, k_offset + begin, setup,
                keep, begin, sink);
  });
  for (const auto& part : parts) merge(state, part, setup.headroom);
}

template void absorb_key_parts<float>(LinearState<float>&, const float*, const float*, Index, Index,
                                      const LinearSetup&, int, KeptFeatures<float>*,
                                      KeptFeatures<float>*);
template void absorb_key_parts<double>(LinearState<double>&, const double*, const double*, Index,
                                       Index, const LinearSetup&, int, KeptFeatures<double>*,
                                       KeptFeatures<double>*);

// Keys cut into parts (part_count), each absorbed into its own state, the states merged in order;
// then the queries read out in parts. Parts run on the OpenMP threads when `threading` is
// Parallel, else in turn: the same arithmetic either way.
template <class T>
void linear_noncausal(const LinearHead<T>& head, const LinearSetup& setup, DenominatorTally* tally,
                      Threads threading) {
  const T *q = head.q, *k = head.k, *v = head.v;
  T* out = head.out;
  const Index n = head.n, n_k = head.n_k, q_offset = head.q_offset, k_offset = head.k_offset;
  const Index d = setup.d, d_v = setup.d_v;
  const int threads = usable_threads(threading);
  LinearState<T> state;
  absorb_key_parts<T>(state, k, v, n_k, k_offset, setup, threads, nullptr, head.keep_keys);
  // Query parts at multiples of read_out's block, so that every block of rows, and so every
  // product's shape, is the same whatever the cut.
  const Index block = block_rows(setup.m);
  const Index query_parts = part_count(n, block);
  if (query_parts > 1) {
    std::vector<DenominatorTally> tallies(query_parts,
                                          tally ? tally->empty() : DenominatorTally(0));
    parallel_for(query_parts, threads, Schedule::Static, [&](Index t) {
      const Index begin = split_point(n, query_parts, t, block);
      const Index end = split_point(n, query_parts, t + 1, block);
      read_out(state, q + begin * d, out + begin * d_v, end - begin, q_offset + begin, setup,
               tally ? &tallies[t] : nullptr, head.keep_queries);
    });
    if (tally)
      for (const auto& part : tallies) tally->merge(part);
  } else {
    read_out(state, q, out, n, q_offset, setup, tally, head.keep_queries);
  }
}

template void linear_noncausal<float>(const LinearHead<float>&, const LinearSetup&,
                                      DenominatorTally*, Threads);
template void linear_noncausal<double>(const LinearHead<double>&, const LinearSetup&,
                                       DenominatorTally*, Threads);

}  // namespace linrope::detail
