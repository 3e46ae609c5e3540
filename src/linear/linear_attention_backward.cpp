// The gradients of linear attention: argument checks and the entry points, single-head and
// [batch, heads, n, d] (the kernels are linear_noncausal_backward.cpp and
// linear_causal_backward.cpp).
#include <linrope/attention.hpp>
#include <linrope/batched.hpp>
#include <vector>

#include "common/check.hpp"
#include "common/heads.hpp"
#include "linear/linear_backward.hpp"
#include "linear/linear_checks.hpp"
#include "linear/saved.hpp"
#include "linear/state_views.hpp"

namespace linrope {
namespace {

constexpr std::string_view kFn = "linear_attention_backward";

template <class T>
void run_head(const detail::LinearGradientHead<T>& head, const detail::LinearSetup& setup,
              detail::Threads threading, const detail::StatePorts<T>& ports = {},
              const detail::SavedSlice<T>* saved = nullptr) {
  if (setup.options.causal)
    detail::linear_causal_backward(head, setup, threading, ports, saved);
  else
    detail::linear_noncausal_backward(head, setup, threading, saved);
}

template <class T>
AttentionGradients<T> backward_single(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                                      const Matrix<T>& d_out, const FeatureMap& map,
                                      const LinearOptions& options) {
  detail::check_single_inputs(kFn, q, k, v, &d_out);
  detail::check_linear_setup(kFn, map, options, q.cols(), 1);
  detail::require_positions(kFn, "options.q_offset", options.q_offset, q.rows());
  detail::require_positions(kFn, "options.k_offset", options.k_offset, k.rows());
  // Non-finite inputs are found by the kernels as they read them (common/nonfinite.hpp), as in the
  // forward; the first offending argument in the order q, k, v, d_out is named.
  detail::NonFiniteFlag nonfinite;
  const detail::LinearSetup setup(map, options, q.cols(), v.cols(), &nonfinite);
  AttentionGradients<T> grads{Matrix<T>(q.rows(), q.cols()), Matrix<T>(k.rows(), k.cols()),
                              Matrix<T>(v.rows(), v.cols())};
  run_head<T>({q.data(), k.data(), v.data(), d_out.data(), grads.dq.data(), grads.dk.data(),
               grads.dv.data(), q.rows(), k.rows(), options.q_offset, options.k_offset},
              setup, detail::Threads::Parallel);
  detail::name_nonfinite(nonfinite, kFn, "q", q, "k", k, "v", v, "d_out", d_out);
  return grads;
}

// initial, d_final, d_initial: the stateful call's (attention.hpp, "State in, state out"); null for
// the plain call. saved: the forward's features (attention.hpp, LinearSaved), or null.
template <class T>
void backward_batched(Heads<const T> q, Heads<const T> k, Heads<const T> v, Heads<const T> d_out,
                      Heads<T> dq, Heads<T> dk, Heads<T> dv, const FeatureMap& map,
                      const LinearOptions& options, const HeadStates<const T>* initial = nullptr,
                      const HeadStates<const T>* d_final = nullptr,
                      const HeadStates<T>* d_initial = nullptr,
                      const LinearSaved<T>* saved = nullptr) {
  using detail::valid_rows;
  detail::check_backward_heads(kFn, q, k, v, d_out, dq, dk, dv);
  detail::check_linear_setup(kFn, map, options, q.d, q.heads);
  detail::require_positions(kFn, "options.q_offset", options.q_offset, q.n);
  detail::require_positions(kFn, "options.k_offset", options.k_offset, k.n);
  const detail::LinearSetup setup(map, options, q.d, v.d);
  if (initial)
    detail::check_state_views(kFn, q, k, v, "d_out", d_out, setup, *initial, *d_final, "d_initial",
                              *d_initial, false);
  const HeadStates<const T> from = initial ? *initial : HeadStates<const T>{},
                            final_gradient = d_final ? *d_final : HeadStates<const T>{};
  const HeadStates<T> initial_gradient = d_initial ? *d_initial : HeadStates<T>{};
  const detail::SavedHeads<T>* kept = saved ? detail::SavedAccess::read(*saved) : nullptr;
  if (saved) detail::check_saved(kFn, kept, detail::saved_call(map, options, q, k));
  // Non-finite inputs are found by the kernels as they read them (common/nonfinite.hpp), as in the
  // forward; then named as an up-front scan would: q, k, v over the slices in order, then d_out.
  const Index slices = q.batch * q.heads;
  std::vector<detail::NonFiniteFlag> nonfinite(slices);
  const auto run = [&](Index b, Index h, detail::Threads threading) {
    const Index s = b * q.heads + h, n = valid_rows(q, b), n_k = valid_rows(k, b);
    detail::LinearSetup setup_of_slice = setup;
    setup_of_slice.nonfinite = &nonfinite[s];
    setup_of_slice.use_decay(detail::decay_of(options, h));
    const detail::StatePorts<T> ports{detail::S_of(from, s),
                                      detail::z_of(from, s),
                                      detail::log_scale_of(from, s),
                                      detail::S_of(final_gradient, s),
                                      detail::z_of(final_gradient, s),
                                      detail::S_of(initial_gradient, s),
                                      detail::z_of(initial_gradient, s)};
    const detail::SliceRows<T> q_rows(q, b, h, n), k_rows(k, b, h, n_k), v_rows(v, b, h, n_k),
        d_out_rows(d_out, b, h, n);
    const detail::SliceOutput<T> dq_rows(dq, b, h, n), dk_rows(dk, b, h, n_k),
        dv_rows(dv, b, h, n_k);
    run_head<T>({q_rows.data(), k_rows.data(), v_rows.data(), d_out_rows.data(), dq_rows.data(),
                 dk_rows.data(), dv_rows.data(), n, n_k, options.q_offset, options.k_offset},
                setup_of_slice, threading, ports, kept ? &kept->slices[std::size_t(s)] : nullptr);
    dq_rows.write_back();
    dk_rows.write_back();
    dv_rows.write_back();
    detail::zero_rows_past(dq, b, h, n);
    detail::zero_rows_past(dk, b, h, n_k);
    detail::zero_rows_past(dv, b, h, n_k);
  };
  detail::for_each_head(q.batch, q.heads, run);
  for (Index s = 0; s < slices; ++s)
    if (nonfinite[s].raised()) detail::require_finite_slice(kFn, q, k, v, s);
  for (Index s = 0; s < slices; ++s)
    if (nonfinite[s].raised())
      detail::require_finite(kFn, detail::slice_name("d_out", s, q.heads),
                             detail::valid_slice(d_out, s, q));
}

// The single-head backward from the forward's features, as a one-slice batched call.
template <class T>
AttentionGradients<T> backward_single_saved(const Matrix<T>& q, const Matrix<T>& k,
                                            const Matrix<T>& v, const Matrix<T>& d_out,
                                            const FeatureMap& map, const LinearOptions& options,
                                            const LinearSaved<T>& saved) {
  detail::check_single_inputs(kFn, q, k, v, &d_out);
  AttentionGradients<T> grads{Matrix<T>(q.rows(), q.cols()), Matrix<T>(k.rows(), k.cols()),
                              Matrix<T>(v.rows(), v.cols())};
  const auto input = [](const Matrix<T>& x) {
    return Heads<const T>{x.data(), 1, 1, x.rows(), x.cols()};
  };
  const auto output = [](Matrix<T>& x) { return Heads<T>{x.data(), 1, 1, x.rows(), x.cols()}; };
  backward_batched<T>(input(q), input(k), input(v), input(d_out), output(grads.dq),
                      output(grads.dk), output(grads.dv), map, options, nullptr, nullptr, nullptr,
                      &saved);
  return grads;
}

// The stateful single-head backward, as a one-slice batched call.
template <class T>
AttentionGradients<T> backward_single_continued(const Matrix<T>& q, const Matrix<T>& k,
                                                const Matrix<T>& v, const Matrix<T>& d_out,
                                                const FeatureMap& map, const LinearOptions& options,
                                                const LinearAttentionState<T>& initial,
                                                const LinearStateGradient<T>& d_final,
                                                LinearStateGradient<T>* d_initial) {
  detail::check_single_inputs(kFn, q, k, v, &d_out);
  const Index m = map.output_dim(), d_v = v.cols();
  detail::check_state(kFn, "initial_state", initial, m, d_v);
  detail::check_gradient(kFn, "d_final", d_final, m, d_v);
  AttentionGradients<T> grads{Matrix<T>(q.rows(), q.cols()), Matrix<T>(k.rows(), k.cols()),
                              Matrix<T>(v.rows(), v.cols())};
  LinearStateGradient<T> initial_gradient{Matrix<T>(m, d_v), Vector<T>(m)};
  const auto input = [](const Matrix<T>& x) {
    return Heads<const T>{x.data(), 1, 1, x.rows(), x.cols()};
  };
  const auto output = [](Matrix<T>& x) { return Heads<T>{x.data(), 1, 1, x.rows(), x.cols()}; };
  const HeadStates<const T> from = detail::state_view(initial),
                            final_gradient = detail::gradient_view(d_final);
  const HeadStates<T> to = d_initial ? HeadStates<T>{initial_gradient.dS.data(),
                                                     initial_gradient.dz.data(),
                                                     nullptr,
                                                     1,
                                                     1,
                                                     m,
                                                     d_v}
                                     : HeadStates<T>{};
  backward_batched(input(q), input(k), input(v), input(d_out), output(grads.dq), output(grads.dk),
                   output(grads.dv), map, options, &from, &final_gradient, &to);
  if (d_initial) *d_initial = std::move(initial_gradient);
  return grads;
}

}  // namespace

AttentionGradients<float> linear_attention_backward(const MatrixF& q, const MatrixF& k,
                                                    const MatrixF& v, const MatrixF& d_out,
                                                    const FeatureMap& map,
                                                    const LinearOptions& options) {
  return backward_single(q, k, v, d_out, map, options);
}
AttentionGradients<double> linear_attention_backward(const MatrixD& q, const MatrixD& k,
                                                     const MatrixD& v, const MatrixD& d_out,
                                                     const FeatureMap& map,
                                                     const LinearOptions& options) {
  return backward_single(q, k, v, d_out, map, options);
}

void linear_attention_backward(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                               Heads<const float> d_out, Heads<float> dq, Heads<float> dk,
                               Heads<float> dv, const FeatureMap& map,
                               const LinearOptions& options) {
  backward_batched(q, k, v, d_out, dq, dk, dv, map, options);
}
void linear_attention_backward(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                               Heads<const double> d_out, Heads<double> dq, Heads<double> dk,
                               Heads<double> dv, const FeatureMap& map,
                               const LinearOptions& options) {
  backward_batched(q, k, v, d_out, dq, dk, dv, map, options);
}

AttentionGradients<float> linear_attention_backward(
    const MatrixF& q, const MatrixF& k, const MatrixF& v, const MatrixF& d_out,
    const FeatureMap& map, const LinearOptions& options, const LinearAttentionStateF& initial_state,
    const LinearStateGradient<float>& d_final, LinearStateGradient<float>* d_initial) {
  return backward_single_continued(q, k, v, d_out, map, options, initial_state, d_final, d_initial);
}
AttentionGradients<double> linear_attention_backward(
    const MatrixD& q, const MatrixD& k, const MatrixD& v, const MatrixD& d_out,
    const FeatureMap& map, const LinearOptions& options, const LinearAttentionStateD& initial_state,
    const LinearStateGradient<double>& d_final, LinearStateGradient<double>* d_initial) {
  return backward_single_continued(q, k, v, d_out, map, options, initial_state, d_final, d_initial);
}

void linear_attention_backward(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                               Heads<const float> d_out, Heads<float> dq, Heads<float> dk,
                               Heads<float> dv, const FeatureMap& map, const LinearOptions& options,
                               HeadStates<const float> initial_state,
                               HeadStates<const float> d_final, HeadStates<float> d_initial) {
  backward_batched(q, k, v, d_out, dq, dk, dv, map, options, &initial_state, &d_final, &d_initial);
}
void linear_attention_backward(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                               Heads<const double> d_out, Heads<double> dq, Heads<double> dk,
                               Heads<double> dv, const FeatureMap& map,
                               const LinearOptions& options, HeadStates<const double> initial_state,
                               HeadStates<const double> d_final, HeadStates<double> d_initial) {
  backward_batched(q, k, v, d_out, dq, dk, dv, map, options, &initial_state, &d_final, &d_initial);
}

AttentionGradients<float> linear_attention_backward(const MatrixF& q, const MatrixF& k,
                                                    const MatrixF& v, const MatrixF& d_out,
                                                    const FeatureMap& map,
                                                    const LinearOptions& options,
                                                    const LinearSavedF& saved) {
  return backward_single_saved(q, k, v, d_out, map, options, saved);
}
AttentionGradients<double> linear_attention_backward(const MatrixD& q, const MatrixD& k,
                                                     const MatrixD& v, const MatrixD& d_out,
                                                     const FeatureMap& map,
                                                     const LinearOptions& options,
                                                     const LinearSavedD& saved) {
  return backward_single_saved(q, k, v, d_out, map, options, saved);
}

void linear_attention_backward(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                               Heads<const float> d_out, Heads<float> dq, Heads<float> dk,
                               Heads<float> dv, const FeatureMap& map, const LinearOptions& options,
                               const LinearSaved<float>& saved) {
  backward_batched<float>(q, k, v, d_out, dq, dk, dv, map, options, nullptr, nullptr, nullptr,
                          &saved);
}
void linear_attention_backward(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                               Heads<const double> d_out, Heads<double> dq, Heads<double> dk,
                               Heads<double> dv, const FeatureMap& map,
                               const LinearOptions& options, const LinearSaved<double>& saved) {
  backward_batched<double>(q, k, v, d_out, dq, dk, dv, map, options, nullptr, nullptr, nullptr,
                           &saved);
}
void linear_attention_backward(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                               Heads<const float> d_out, Heads<float> dq, Heads<float> dk,
                               Heads<float> dv, const FeatureMap& map, const LinearOptions& options,
                               HeadStates<const float> initial_state,
                               HeadStates<const float> d_final, HeadStates<float> d_initial,
                               const LinearSaved<float>& saved) {
  backward_batched(q, k, v, d_out, dq, dk, dv, map, options, &initial_state, &d_final, &d_initial,
                   &saved);
}
void linear_attention_backward(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                               Heads<const double> d_out, Heads<double> dq, Heads<double> dk,
                               Heads<double> dv, const FeatureMap& map,
                               const LinearOptions& options, HeadStates<const double> initial_state,
                               HeadStates<const double> d_final, HeadStates<double> d_initial,
                               const LinearSaved<double>& saved) {
  backward_batched(q, k, v, d_out, dq, dk, dv, map, options, &initial_state, &d_final, &d_initial,
                   &saved);
}

}  // namespace linrope
