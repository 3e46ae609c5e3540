// Exact softmax attention: argument checks and the single-head entry points, forward and backward
// (the kernels are softmax_kernel.cpp and softmax_backward.cpp).
#include <cmath>
#include <linrope/attention.hpp>

#include "common/check.hpp"
#include "common/nonfinite.hpp"
#include "softmax/softmax_backward.hpp"
#include "softmax/softmax_kernel.hpp"

namespace linrope {
namespace detail {

void check_softmax_options(std::string_view function, Index d, const SoftmaxOptions& options) {
  if (options.rope != nullptr && options.rope->dim() != d)
    throw_invalid(function, "options.rope has dim = ", options.rope->dim(), " but q has d = ", d);
  if (!std::isfinite(options.scale) || options.scale < 0)
    throw_invalid(function, "options.scale is ", options.scale,
                  " but expected a finite scale >= 0 (0 means 1/sqrt(d))");
  if (options.block_size < 0)
    throw_invalid(function, "options.block_size is ", options.block_size,
                  " but expected block_size >= 0 (0 chooses)");
}

double softmax_scale(Index d, const SoftmaxOptions& options) {
  if (options.scale > 0) return options.scale;
  return d > 0 ? 1.0 / std::sqrt(double(d)) : 1.0;
}

}  // namespace detail

namespace {

// What the forward and the backward both check: q [n x d], k [n_k x d], v [n_k x d_v], the
// options, the positions and that every input is finite.
template <class T>
void check_inputs(std::string_view fn, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                  const SoftmaxOptions& options) {
  const Index n = q.rows(), d = q.cols(), n_k = k.rows();
  if (k.cols() != d) detail::throw_invalid(fn, "k is ", detail::shape_of(k), " but q has d = ", d);
  if (v.rows() != n_k)
    detail::throw_invalid(fn, "v is ", detail::shape_of(v), " but k has n_k = ", n_k, " rows");
  detail::check_softmax_options(fn, d, options);
  detail::require_positions(fn, "options.q_offset", options.q_offset, n);
  detail::require_positions(fn, "options.k_offset", options.k_offset, n_k);
  detail::require_finite_each(fn, "q", q, "k", k, "v", v);  // up front: common/nonfinite.hpp
}

template <class T>
Matrix<T> softmax_attention_impl(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                                 const SoftmaxOptions& options) {
  check_inputs("softmax_attention", q, k, v, options);
  const Index n = q.rows(), d = q.cols(), n_k = k.rows(), d_v = v.cols();
  Matrix<T> out(n, d_v);
  detail::softmax_head<T>({q.data(), k.data(), v.data(), out.data(), n, n_k, d, d_v}, options,
                          detail::Threads::Parallel);
  return out;
}

template <class T>
AttentionGradients<T> softmax_attention_backward_impl(const Matrix<T>& q, const Matrix<T>& k,
                                                      const Matrix<T>& v, const Matrix<T>& d_out,
                                                      const SoftmaxOptions& options) {
  constexpr std::string_view kFn = "softmax_attention_backward";
  check_inputs(kFn, q, k, v, options);
  const Index n = q.rows(), d = q.cols(), n_k = k.rows(), d_v = v.cols();
  if (d_out.rows() != n || d_out.cols() != d_v)
    detail::throw_invalid(kFn, "d_out is ", detail::shape_of(d_out), " but expected ",
                          detail::Shape{n, d_v});
  detail::require_finite(kFn, "d_out", d_out);
  AttentionGradients<T> g{Matrix<T>(n, d), Matrix<T>(n_k, d), Matrix<T>(n_k, d_v)};
  detail::softmax_head_backward<T>({q.data(), k.data(), v.data(), d_out.data(), g.dq.data(),
                                    g.dk.data(), g.dv.data(), n, n_k, d, d_v},
                                   options, detail::Threads::Parallel);
  return g;
}

}  // namespace

MatrixF softmax_attention(const MatrixF& q, const MatrixF& k, const MatrixF& v,
                          const SoftmaxOptions& options) {
  return softmax_attention_impl(q, k, v, options);
}
MatrixD softmax_attention(const MatrixD& q, const MatrixD& k, const MatrixD& v,
                          const SoftmaxOptions& options) {
  return softmax_attention_impl(q, k, v, options);
}

AttentionGradients<float> softmax_attention_backward(const MatrixF& q, const MatrixF& k,
                                                     const MatrixF& v, const MatrixF& d_out,
                                                     const SoftmaxOptions& options) {
  return softmax_attention_backward_impl(q, k, v, d_out, options);
}
AttentionGradients<double> softmax_attention_backward(const MatrixD& q, const MatrixD& k,
                                                      const MatrixD& v, const MatrixD& d_out,
                                                      const SoftmaxOptions& options) {
  return softmax_attention_backward_impl(q, k, v, d_out, options);
}

}  // namespace linrope
