// LinearAttentionStream: causal linear attention one token (or block) at a time, O(m d_v) memory.
#include <linrope/attention.hpp>

#include "common/check.hpp"
#include "common/nonfinite.hpp"
#include "linear/linear_kernel.hpp"

namespace linrope {

template <class T>
struct LinearAttentionStream<T>::State {
  detail::LinearSetup setup;
  detail::LinearState<T> running;
  Index position = 0;
};

template <class T>
LinearAttentionStream<T>::LinearAttentionStream(const FeatureMap& map, Index value_dim,
                                                const LinearOptions& options) {
  constexpr std::string_view fn = "LinearAttentionStream";
  if (value_dim < 1)
    detail::throw_invalid(fn, "value_dim is ", value_dim, " but expected value_dim >= 1");
  if (options.q_offset != options.k_offset)
    detail::throw_invalid(fn, "options.q_offset is ", options.q_offset, " but options.k_offset is ",
                          options.k_offset, "; a stream needs them equal");
  LinearOptions causal = options;
  causal.causal = true;
  detail::check_linear_setup(fn, map, causal, map.input_dim(), 1);
  // The stream outlives the caller's span: it keeps its one decay as a number.
  causal.decay = detail::decay_of(options, 0);
  causal.head_decays = {};
  state_ = std::make_unique<State>(State{{map, causal, map.input_dim(), value_dim}, {}, 0});
  reset();
}

template <class T>
LinearAttentionStream<T>::~LinearAttentionStream() = default;
template <class T>
LinearAttentionStream<T>::LinearAttentionStream(LinearAttentionStream&&) noexcept = default;
template <class T>
LinearAttentionStream<T>& LinearAttentionStream<T>::operator=(LinearAttentionStream&&) noexcept =
    default;

namespace {

// A moved-from stream has no state: each member refuses it with a clear error rather than
// dereferencing null.
template <class State>
void require_state(const std::unique_ptr<State>& state, std::string_view fn) {
  if (!state)
    detail::throw_invalid(fn,
                          "this stream was moved from and has no state; assign a "
                          "LinearAttentionStream to it before using it again");
}

}  // namespace

template <class T>
void LinearAttentionStream<T>::reset() {
  require_state(state_, "LinearAttentionStream::reset");
  state_->running.reset(state_->setup.m, state_->setup.d_v);
  state_->position = state_->setup.options.q_offset;
}

template <class T>
Index LinearAttentionStream<T>::position() const {
  require_state(state_, "LinearAttentionStream::position");
  return state_->position;
}

template <class T>
Matrix<T> LinearAttentionStream<T>::step(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                                         DenominatorStats* stats) {
  constexpr std::string_view fn = "LinearAttentionStream::step";
  require_state(state_, fn);
  detail::LinearSetup& setup = state_->setup;
  if (q.cols() != setup.d)
    detail::throw_invalid(fn, "q is ", detail::shape_of(q), " but the map has input_dim ", setup.d);
  if (k.rows() != q.rows() || k.cols() != setup.d)
    detail::throw_invalid(fn, "k is ", detail::shape_of(k), " but expected [", q.rows(), " x ",
                          setup.d, "]");
  if (v.rows() != q.rows() || v.cols() != setup.d_v)
    detail::throw_invalid(fn, "v is ", detail::shape_of(v), " but expected [", q.rows(), " x ",
                          setup.d_v, "]");
  detail::require_positions(fn, "position()", state_->position, q.rows());
  // Up front, not lazily (common/nonfinite.hpp): a bad token must not reach the state.
  detail::require_finite_each(fn, "q", q, "k", k, "v", v);
  Matrix<T> out(q.rows(), setup.d_v);
  detail::DenominatorTally tally(stats ? stats->threshold : 0.0);
  const detail::LinearHead<T> head{q.data(), k.data(), v.data(),         out.data(),
                                   q.rows(), k.rows(), state_->position, state_->position};
  // The running state is kept as the public state is, at the position of its last key (a decay's
  // frame, linear_kernel.hpp): each step starts there and moves it past its own keys.
  setup.origin = state_->position - 1;
  detail::linear_causal(head, setup, state_->running, detail::FinalState::EveryKey,
                        stats ? &tally : nullptr, detail::Threads::Parallel);
  detail::move_frame(state_->running, setup.log_decay, q.rows());
  state_->position += q.rows();
  if (stats) tally.store(*stats);
  return out;
}

template class LinearAttentionStream<float>;
template class LinearAttentionStream<double>;

}  // namespace linrope
