// Linear attention over [batch, heads, n, d] buffers: checks, then one single-head kernel per
// (batch, head) slice, the slices spread over the OpenMP threads.
#include <linrope/batched.hpp>
#include <optional>

#include "common/heads.hpp"
#include "linear/linear_checks.hpp"
#include "linear/linear_kernel.hpp"
#include "linear/saved.hpp"
#include "linear/state_views.hpp"

namespace linrope {
namespace {

using detail::check_heads;
using detail::slice;
using detail::slice_out;
using detail::valid_rows;

// initial and final: the stateful call's (attention.hpp, "State in, state out"); null for the
// plain call, whose causal slices start empty and discard their state. saved: where to keep the
// features (attention.hpp, LinearSaved), or null.
template <class T>
void linear_batched(Heads<const T> q, Heads<const T> k, Heads<const T> v, Heads<T> out,
                    const FeatureMap& map, const LinearOptions& options, DenominatorStats* stats,
                    const HeadStates<const T>* initial = nullptr,
                    const HeadStates<T>* final = nullptr, LinearSaved<T>* saved = nullptr) {
  constexpr std::string_view fn = "linear_attention";
  check_heads(fn, q, k, v, out);
  detail::check_linear_setup(fn, map, options, q.d, q.heads);
  detail::require_positions(fn, "options.q_offset", options.q_offset, q.n);
  detail::require_positions(fn, "options.k_offset", options.k_offset, k.n);
  const detail::LinearSetup setup(map, options, q.d, v.d);
  if (initial)
    detail::check_state_views(fn, q, k, v, "out", out, setup, *initial, HeadStates<const T>{},
                              "final_state", *final, true);
  const HeadStates<const T> from = initial ? *initial : HeadStates<const T>{};  // none: empty
  const bool keep_state = final && final->S;
  const double threshold = stats ? stats->threshold : 0.0;
  const Index slices = q.batch * q.heads;
  std::vector<detail::DenominatorTally> tallies(slices, detail::DenominatorTally(threshold));
  // Non-finite inputs are found by the kernels as they read them (common/nonfinite.hpp).
  std::vector<detail::NonFiniteFlag> nonfinite(slices);
  detail::SavedHeads<T>* kept = saved ? &detail::SavedAccess::refill(*saved) : nullptr;
  if (kept) {
    kept->call = detail::saved_call(map, options, q, k);
    kept->slices.resize(std::size_t(slices));
  }
  const auto run = [&](Index b, Index h, detail::Threads threading) {
    const Index s = b * q.heads + h;
    detail::DenominatorTally* tally = stats ? &tallies[s] : nullptr;
    detail::LinearSetup setup_of_slice = setup;
    setup_of_slice.nonfinite = &nonfinite[s];
    setup_of_slice.use_decay(detail::decay_of(options, h));
    const Index n = valid_rows(q, b), n_k = valid_rows(k, b);
    detail::LinearHead<T> head{
        slice(q, b, h),   slice(k, b, h),  slice(v, b, h), slice_out(out, b, h), n, n_k,
        options.q_offset, options.k_offset};
    // The forward's features stored straight into the slice's rows as they are computed.
    std::optional<detail::KeptFeatures<T>> keep_queries, keep_keys;
    detail::SavedSlice<T>* slice_kept = kept ? &kept->slices[std::size_t(s)] : nullptr;
    const Index mapped_keys =
        detail::mapped_keys(options.causal, keep_state, n, n_k, options.q_offset, options.k_offset);
    if (slice_kept) {
      slice_kept->queries.resize(n, setup.m);
      slice_kept->keys.resize(mapped_keys, setup.m);
      keep_queries.emplace(setup_of_slice, detail::Role::Queries, n, options.q_offset,
                           slice_kept->queries.plain.data(), slice_kept->queries.log_scale.data(),
                           0);
      keep_keys.emplace(setup_of_slice, detail::Role::Keys, mapped_keys, options.k_offset,
                        slice_kept->keys.plain.data(), slice_kept->keys.log_scale.data(), 0);
      head.keep_queries = &*keep_queries;
      head.keep_keys = &*keep_keys;
    }
    if (options.causal) {
      detail::LinearState<T> state =
          detail::load_state(detail::S_of(from, s), detail::z_of(from, s),
                             detail::log_scale_of(from, s), setup.m, setup.d_v);
      detail::linear_causal(
          head, setup_of_slice, state,
          keep_state ? detail::FinalState::EveryKey : detail::FinalState::Discarded, tally,
          threading);
      if (keep_state)
        detail::store_state(state, setup_of_slice, n_k, detail::S_of(*final, s),
                            detail::z_of(*final, s), final->log_scale + s);
    } else {
      detail::linear_noncausal(head, setup_of_slice, tally, threading);
    }
    if (slice_kept) {
      slice_kept->queries.given = n;
      slice_kept->keys.given = mapped_keys;
    }
  };
  detail::for_each_head(q.batch, q.heads, run);
  for (Index s = 0; s < slices; ++s)
    if (nonfinite[s].raised()) detail::require_finite_slice(fn, q, k, v, s);
  if (stats) {
    detail::DenominatorTally(threshold).store(*stats);
    for (const auto& tally : tallies) tally.merge_into(*stats);
  }
  if (kept) kept->complete = true;
}

}  // namespace

void linear_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                      Heads<float> out, const FeatureMap& map, const LinearOptions& options,
                      DenominatorStats* stats) {
  linear_batched(q, k, v, out, map, options, stats);
}
void linear_attention(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                      Heads<double> out, const FeatureMap& map, const LinearOptions& options,
                      DenominatorStats* stats) {
  linear_batched(q, k, v, out, map, options, stats);
}

void linear_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                      Heads<float> out, const FeatureMap& map, const LinearOptions& options,
                      HeadStates<const float> initial_state, HeadStates<float> final_state,
                      DenominatorStats* stats) {
  linear_batched(q, k, v, out, map, options, stats, &initial_state, &final_state);
}
void linear_attention(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                      Heads<double> out, const FeatureMap& map, const LinearOptions& options,
                      HeadStates<const double> initial_state, HeadStates<double> final_state,
                      DenominatorStats* stats) {
  linear_batched(q, k, v, out, map, options, stats, &initial_state, &final_state);
}

void linear_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                      Heads<float> out, const FeatureMap& map, const LinearOptions& options,
                      LinearSaved<float>& saved, DenominatorStats* stats) {
  linear_batched<float>(q, k, v, out, map, options, stats, nullptr, nullptr, &saved);
}
void linear_attention(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                      Heads<double> out, const FeatureMap& map, const LinearOptions& options,
                      LinearSaved<double>& saved, DenominatorStats* stats) {
  linear_batched<double>(q, k, v, out, map, options, stats, nullptr, nullptr, &saved);
}
void linear_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                      Heads<float> out, const FeatureMap& map, const LinearOptions& options,
                      HeadStates<const float> initial_state, HeadStates<float> final_state,
                      LinearSaved<float>& saved, DenominatorStats* stats) {
  linear_batched(q, k, v, out, map, options, stats, &initial_state, &final_state, &saved);
}
void linear_attention(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                      Heads<double> out, const FeatureMap& map, const LinearOptions& options,
                      HeadStates<const double> initial_state, HeadStates<double> final_state,
                      LinearSaved<double>& saved, DenominatorStats* stats) {
  linear_batched(q, k, v, out, map, options, stats, &initial_state, &final_state, &saved);
}

}  // namespace linrope
