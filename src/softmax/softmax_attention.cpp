// Exact softmax attention: argument checks and the single-head entry points (the kernel is
// softmax_kernel.cpp).
#include <cmath>
#include <linrope/attention.hpp>

#include "common/check.hpp"
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

template <class T>
Matrix<T> softmax_attention_impl(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                                 const SoftmaxOptions& options) {
  constexpr std::string_view kFn = "softmax_attention";
  const Index n = q.rows(), d = q.cols(), n_k = k.rows(), d_v = v.cols();
  if (k.cols() != d) detail::throw_invalid(kFn, "k is ", detail::shape_of(k), " but q has d = ", d);
  if (v.rows() != n_k)
    detail::throw_invalid(kFn, "v is ", detail::shape_of(v), " but k has n_k = ", n_k, " rows");
  detail::check_softmax_options(kFn, d, options);
  detail::require_positions(kFn, "options.q_offset", options.q_offset, n);
  detail::require_positions(kFn, "options.k_offset", options.k_offset, n_k);
  detail::require_finite(kFn, "q", q);
  detail::require_finite(kFn, "k", k);
  detail::require_finite(kFn, "v", v);
  Matrix<T> out(n, d_v);
  detail::softmax_head<T>({q.data(), k.data(), v.data(), out.data(), n, n_k, d, d_v}, options,
                          /*parallel=*/true);
  return out;
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

}  // namespace linrope
