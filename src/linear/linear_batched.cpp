// Linear attention over [batch, heads, n, d] buffers: checks, then one single-head kernel per
// (batch, head) slice, the slices spread over the OpenMP threads.
#include <exception>
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
using detail::valid_rows;

// Clears `saved` (if any) when the scope it guards throws: a forward that throws once it has begun
// refilling it leaves it empty (attention.hpp), its memory freed, not held by rows that no backward
// may read.
template <class T>
class ClearedOnThrow {
 public:
  explicit ClearedOnThrow(LinearSaved<T>* saved) : saved_(saved) {}
  ~ClearedOnThrow() {
    if (saved_ && std::uncaught_exceptions() > exceptions_) saved_->clear();
  }
  ClearedOnThrow(const ClearedOnThrow&) = delete;
  ClearedOnThrow& operator=(const ClearedOnThrow&) = delete;

 private:
  LinearSaved<T>* saved_;
  int exceptions_ = std::uncaught_exceptions();
};

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
  const ClearedOnThrow<T> cleared(saved);
  detail::SavedHeads<T>* kept = saved ? &detail::SavedAccess::refill(*saved) : nullptr;
  const auto mapped_keys = [&](Index b) {
    return detail::mapped_keys(options.causal, keep_state, valid_rows(q, b), valid_rows(k, b),
                               options.q_offset, options.k_offset);
  };
  if (kept) {
    kept->call = detail::saved_call(map, options, q, k);
    std::vector<Index> query_rows, key_rows;
    for (Index s = 0; s < slices; ++s) {
      query_rows.push_back(valid_rows(q, s / q.heads));
      key_rows.push_back(mapped_keys(s / q.heads));
    }
    kept->lay_out(query_rows, key_rows, setup.m);
  }
  const auto run = [&](Index b, Index h, detail::Threads threading) {
    const Index s = b * q.heads + h;
    detail::DenominatorTally* tally = stats ? &tallies[s] : nullptr;
    detail::LinearSetup setup_of_slice = setup;
    setup_of_slice.nonfinite = &nonfinite[s];
    setup_of_slice.use_decay(detail::decay_of(options, h));
    const Index n = valid_rows(q, b), n_k = valid_rows(k, b);
    const detail::SliceRows<T> q_rows(q, b, h, n), k_rows(k, b, h, n_k), v_rows(v, b, h, n_k);
    const detail::SliceOutput<T> out_rows(out, b, h, n);
    detail::LinearHead<T> head{q_rows.data(), k_rows.data(),    v_rows.data(),   out_rows.data(), n,
                               n_k,           options.q_offset, options.k_offset};
    // The forward's features stored straight into the slice's rows as they are computed.
    std::optional<detail::KeptFeatures<T>> keep_queries, keep_keys;
    detail::SavedSlice<T>* slice_kept = kept ? &kept->slices[std::size_t(s)] : nullptr;
    if (slice_kept) {
      const detail::SavedSide<T>&queries = slice_kept->queries, &keys = slice_kept->keys;
      keep_queries.emplace(setup_of_slice, detail::Role::Queries, queries.rows, options.q_offset,
                           queries.plain, queries.log_scale, 0);
      keep_keys.emplace(setup_of_slice, detail::Role::Keys, keys.rows, options.k_offset, keys.plain,
                        keys.log_scale, 0);
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
    out_rows.write_back();
    if (slice_kept) {
      slice_kept->queries.given = slice_kept->queries.rows;
      slice_kept->keys.given = slice_kept->keys.rows;
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
