// LinearAttentionStream: causal linear attention one token (or block) at a time, O(m d_v) memory.
#include <linrope/attention.hpp>

#include "common/check.hpp"
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
  detail::check_linear_setup(fn, map, options, map.input_dim());
  state_ = std::make_unique<State>();
  state_->setup = {&map, options, map.input_dim(), value_dim, map.output_dim()};
  state_->setup.options.causal = true;
  reset();
}

template <class T>
LinearAttentionStream<T>::~LinearAttentionStream() = default;
template <class T>
LinearAttentionStream<T>::LinearAttentionStream(LinearAttentionStream&&) noexcept = default;
template <class T>
LinearAttentionStream<T>& LinearAttentionStream<T>::operator=(LinearAttentionStream&&) noexcept =
    default;

template <class T>
void LinearAttentionStream<T>::reset() {
  state_->running.reset(state_->setup.m, state_->setup.dv);
  state_->position = state_->setup.options.q_offset;
}

template <class T>
Index LinearAttentionStream<T>::position() const {
  return state_->position;
}

template <class T>
Matrix<T> LinearAttentionStream<T>::step(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                                         DenominatorStats* stats) {
  constexpr std::string_view fn = "LinearAttentionStream::step";
  const detail::LinearSetup& setup = state_->setup;
  if (q.cols() != setup.d)
    detail::throw_invalid(fn, "q is ", detail::shape_of(q), " but the map has input_dim ", setup.d);
  if (k.rows() != q.rows() || k.cols() != setup.d)
    detail::throw_invalid(fn, "k is ", detail::shape_of(k), " but expected [", q.rows(), " x ",
                          setup.d, "]");
  if (v.rows() != q.rows() || v.cols() != setup.dv)
    detail::throw_invalid(fn, "v is ", detail::shape_of(v), " but expected [", q.rows(), " x ",
                          setup.dv, "]");
  detail::require_positions(fn, "position()", state_->position, q.rows());
  detail::require_finite(fn, "q", q);
  detail::require_finite(fn, "k", k);
  detail::require_finite(fn, "v", v);
  Matrix<T> out(q.rows(), setup.dv);
  detail::DenominatorTally tally(stats ? stats->threshold : 0.0);
  const detail::LinearHead<T> head{q.data(), k.data(), v.data(),         out.data(),
                                   q.rows(), k.rows(), state_->position, state_->position};
  detail::linear_causal(head, setup, state_->running, true, stats ? &tally : nullptr, true);
  state_->position += q.rows();
  if (stats) tally.store(*stats);
  return out;
}

template class LinearAttentionStream<float>;
template class LinearAttentionStream<double>;

}  // namespace linrope
