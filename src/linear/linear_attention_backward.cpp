// The gradients of linear attention: argument checks and the entry points, single-head and
// [batch, heads, n, d] (the kernels are linear_noncausal_backward.cpp and
// linear_causal_backward.cpp).
#include <linrope/attention.hpp>
#include <linrope/batched.hpp>
#include <vector>

#include "common/check.hpp"
#include "common/heads.hpp"
#include "linear/linear_backward.hpp"

namespace linrope {
namespace {

constexpr std::string_view kFn = "linear_attention_backward";

template <class T>
void run_head(const detail::LinearGradientHead<T>& head, const detail::LinearSetup& setup,
              detail::Threads threading) {
  if (setup.options.causal)
    detail::linear_causal_backward(head, setup, threading);
  else
    detail::linear_noncausal_backward(head, setup, threading);
}

template <class T>
AttentionGradients<T> backward_single(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                                      const Matrix<T>& d_out, const FeatureMap& map,
                                      const LinearOptions& options) {
  if (k.cols() != q.cols())
    detail::throw_invalid(kFn, "k is ", detail::shape_of(k), " but q has d = ", q.cols());
  if (v.rows() != k.rows())
    detail::throw_invalid(kFn, "v is ", detail::shape_of(v), " but k has ", k.rows(), " rows");
  if (d_out.rows() != q.rows() || d_out.cols() != v.cols())
    detail::throw_invalid(kFn, "d_out is ", detail::shape_of(d_out), " but expected ",
                          detail::Shape{q.rows(), v.cols()}, " (q's rows x v's columns)");
  detail::check_linear_setup(kFn, map, options, q.cols());
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

template <class T>
void backward_batched(Heads<const T> q, Heads<const T> k, Heads<const T> v, Heads<const T> d_out,
                      Heads<T> dq, Heads<T> dk, Heads<T> dv, const FeatureMap& map,
                      const LinearOptions& options) {
  using detail::slice;
  using detail::slice_out;
  using detail::valid_rows;
  detail::check_backward_heads(kFn, q, k, v, d_out, dq, dk, dv);
  detail::check_linear_setup(kFn, map, options, q.d);
  detail::require_positions(kFn, "options.q_offset", options.q_offset, q.n);
  detail::require_positions(kFn, "options.k_offset", options.k_offset, k.n);
  const detail::LinearSetup setup(map, options, q.d, v.d);
  // Non-finite inputs are found by the kernels as they read them (common/nonfinite.hpp), as in the
  // forward; then named as an up-front scan would: q, k, v over the slices in order, then d_out.
  const Index slices = q.batch * q.heads;
  std::vector<detail::NonFiniteFlag> nonfinite(slices);
  const auto run = [&](Index b, Index h, detail::Threads threading) {
    const Index n = valid_rows(q, b), n_k = valid_rows(k, b);
    detail::LinearSetup setup_of_slice = setup;
    setup_of_slice.nonfinite = &nonfinite[b * q.heads + h];
    run_head<T>(
        {slice(q, b, h), slice(k, b, h), slice(v, b, h), slice(d_out, b, h), slice_out(dq, b, h),
         slice_out(dk, b, h), slice_out(dv, b, h), n, n_k, options.q_offset, options.k_offset},
        setup_of_slice, threading);
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

}  // namespace linrope
