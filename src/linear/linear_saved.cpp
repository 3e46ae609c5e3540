// LinearSaved (attention.hpp): the object, and the check that a backward's call is its forward's.
#include "common/block_cache.hpp"
#include "common/check.hpp"
#include "common/heads.hpp"
#include "feature_maps/maps.hpp"
#include "linear/saved.hpp"

namespace linrope {

template <class T>
LinearSaved<T>::LinearSaved() = default;
template <class T>
LinearSaved<T>::~LinearSaved() = default;
template <class T>
LinearSaved<T>::LinearSaved(LinearSaved&&) noexcept = default;
template <class T>
LinearSaved<T>& LinearSaved<T>::operator=(LinearSaved&&) noexcept = default;

template <class T>
bool LinearSaved<T>::empty() const {
  return detail::SavedAccess::read(*this) == nullptr;
}

template <class T>
std::size_t LinearSaved<T>::bytes() const {
  const auto side_bytes = [&](const auto& side) {
    return std::size_t(side.rows) * (std::size_t(data_->call.m) * sizeof(T) + sizeof(double));
  };
  std::size_t total = 0;
  if (data_)
    for (const auto& slice : data_->slices)
      total += side_bytes(slice.queries) + side_bytes(slice.keys);
  return total;
}

template <class T>
void LinearSaved<T>::clear() {
  data_.reset();
}

template class LinearSaved<float>;
template class LinearSaved<double>;

std::size_t release_cached_memory() { return detail::release_cached_blocks(); }

namespace detail {

template <class T>
SavedCall saved_call(const FeatureMap& map, const LinearOptions& options, Heads<const T> q,
                     Heads<const T> k) {
  SavedCall call;
  // Configurations as the features depend on them, so that maps and ropes made alike compare
  // equal: a deterministic map's random-projection fields, a rope's rotary_dim 0 (= dim) and an
  // unscaled rope's scaling fields do not change a feature; nor does a rope that the placement
  // leaves unused (none), which is then no part of the call.
  call.map = map.config();
  if (!is_favor(call.map.kind)) {
    const FeatureMapConfig defaults;
    call.map.num_features = defaults.num_features;
    call.map.orthogonal = defaults.orthogonal;
    call.map.regularized = defaults.regularized;
    call.map.seed = defaults.seed;
  }
  call.has_rope = options.rope != nullptr && options.placement != RopePlacement::None;
  if (call.has_rope) {
    call.rope = options.rope->config();
    call.rope.rotary_dim = options.rope->rotary_dim();
    if (call.rope.scaling.kind == RopeScalingKind::None) call.rope.scaling = RopeScaling{};
  }
  call.placement = options.placement;
  call.causal = options.causal;
  call.q_offset = options.q_offset;
  call.k_offset = options.k_offset;
  call.batch = q.batch;
  call.heads = q.heads;
  call.n = q.n;
  call.n_k = k.n;
  call.d = q.d;
  call.m = map.output_dim();
  for (Index b = 0; b < q.batch; ++b) {
    call.q_lengths.push_back(valid_rows(q, b));
    call.k_lengths.push_back(valid_rows(k, b));
  }
  for (Index h = 0; h < q.heads; ++h) call.decays.push_back(decay_of(options, h));
  return call;
}

namespace {

template <class V>
void require_same(std::string_view fn, std::string_view what, const V& forward, const V& now) {
  if (forward != now)
    throw_invalid(fn, "saved holds the features of another call: its forward had ", what, " ",
                  forward, ", this call has ", now);
}

template <class V>
void require_same_list(std::string_view fn, std::string_view what, const std::vector<V>& forward,
                       const std::vector<V>& now) {
  for (std::size_t i = 0; i < std::min(forward.size(), now.size()); ++i)
    require_same(fn, std::string(what) + "[" + std::to_string(i) + "] =", forward[i], now[i]);
}

}  // namespace

template <class T>
void check_saved(std::string_view fn, const SavedHeads<T>* saved, const SavedCall& now) {
  if (saved == nullptr)
    throw_invalid(fn, "saved is empty; expected the LinearSaved that this call's forward filled");
  const SavedCall& was = saved->call;
  require_same(fn, "batch =", was.batch, now.batch);
  require_same(fn, "heads =", was.heads, now.heads);
  require_same(fn, "n =", was.n, now.n);
  require_same(fn, "n_k =", was.n_k, now.n_k);
  require_same(fn, "d =", was.d, now.d);
  require_same_list(fn, "q's length", was.q_lengths, now.q_lengths);
  require_same_list(fn, "k's length", was.k_lengths, now.k_lengths);
  require_same(fn, "options.causal =", was.causal, now.causal);
  require_same(fn, "options.placement =", std::string(to_string(was.placement)),
               std::string(to_string(now.placement)));
  require_same(fn, "options.q_offset =", was.q_offset, now.q_offset);
  require_same(fn, "options.k_offset =", was.k_offset, now.k_offset);
  require_same_list(fn, "the decay of head", was.decays, now.decays);
  require_same(fn, "m = map.output_dim() =", was.m, now.m);
  const FeatureMapConfig &map = was.map, &now_map = now.map;
  require_same(fn, "a map of kind", std::string(to_string(map.kind)),
               std::string(to_string(now_map.kind)));
  require_same(fn, "map num_features =", map.num_features, now_map.num_features);
  require_same(fn, "map orthogonal =", map.orthogonal, now_map.orthogonal);
  require_same(fn, "map regularized =", map.regularized, now_map.regularized);
  require_same(fn, "a map drawn from seed", map.seed, now_map.seed);
  // The placements are the same (compared above), so both calls use a rope (checked against d or
  // m by the call) or neither does.
  if (!was.has_rope) return;
  const RopeConfig &rope = was.rope, &now_rope = now.rope;
  // The rope's dim is not compared: a placement fixes it (d before the map, m after), and both
  // are compared above.
  require_same(fn, "options.rope's rotary_dim =", rope.rotary_dim, now_rope.rotary_dim);
  require_same(fn, "options.rope's base =", rope.base, now_rope.base);
  require_same(fn, "options.rope's layout =", std::string(to_string(rope.layout)),
               std::string(to_string(now_rope.layout)));
  const RopeScaling &scaling = rope.scaling, &now_scaling = now_rope.scaling;
  require_same(fn, "options.rope's scaling =", std::string(to_string(scaling.kind)),
               std::string(to_string(now_scaling.kind)));
  require_same(fn, "options.rope's scaling factor =", scaling.factor, now_scaling.factor);
  require_same(fn, "options.rope's original_max_position =", scaling.original_max_position,
               now_scaling.original_max_position);
  require_same(fn, "options.rope's beta_fast =", scaling.beta_fast, now_scaling.beta_fast);
  require_same(fn, "options.rope's beta_slow =", scaling.beta_slow, now_scaling.beta_slow);
}

template SavedCall saved_call<float>(const FeatureMap&, const LinearOptions&, Heads<const float>,
                                     Heads<const float>);
template SavedCall saved_call<double>(const FeatureMap&, const LinearOptions&, Heads<const double>,
                                      Heads<const double>);
template void check_saved<float>(std::string_view, const SavedHeads<float>*, const SavedCall&);
template void check_saved<double>(std::string_view, const SavedHeads<double>*, const SavedCall&);

}  // namespace detail
}  // namespace linrope
