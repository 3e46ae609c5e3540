// Softmax attention over [batch, heads, n, d] buffers, forward and backward: checks, then one
// single-head kernel per (batch, head) slice, the slices spread over the OpenMP threads.
#include <algorithm>
#include <linrope/batched.hpp>

#include "common/heads.hpp"
#include "softmax/softmax_backward.hpp"
#include "softmax/softmax_kernel.hpp"

namespace linrope {
namespace {

using detail::check_heads;
using detail::for_each_head;
using detail::require_finite_heads;
using detail::SliceOutput;
using detail::SliceRows;
using detail::valid_rows;

// What the forward and the backward both check of q, k, v and the options (shapes first).
template <class T>
void check_inputs(std::string_view fn, Heads<const T> q, Heads<const T> k, Heads<const T> v,
                  const SoftmaxOptions& options) {
  require_finite_heads(fn, q, k, v);
  detail::check_softmax_options(fn, q.d, options);
  detail::require_positions(fn, "options.q_offset", options.q_offset, q.n);
  detail::require_positions(fn, "options.k_offset", options.k_offset, k.n);
}

template <class T>
void softmax_batched(Heads<const T> q, Heads<const T> k, Heads<const T> v, Heads<T> out,
                     const SoftmaxOptions& options) {
  constexpr std::string_view fn = "softmax_attention";
  check_heads(fn, q, k, v, out);
  check_inputs(fn, q, k, v, options);
  const auto run = [&](Index b, Index h, detail::Threads threading) {
    const Index n = valid_rows(q, b), n_k = valid_rows(k, b);
    const SliceRows<T> q_rows(q, b, h, n), k_rows(k, b, h, n_k), v_rows(v, b, h, n_k);
    const SliceOutput<T> out_rows(out, b, h, n);
    const detail::SoftmaxHead<T> head{
        q_rows.data(), k_rows.data(), v_rows.data(), out_rows.data(), n, n_k, q.d, v.d};
    detail::softmax_head(head, options, threading);
    out_rows.write_back();
  };
  for_each_head(q.batch, q.heads, run);
}

// Rows at or past the lengths are not handed to the kernel (so d_out's are never read); their
// gradients are zeroed here.
template <class T>
void softmax_batched_backward(Heads<const T> q, Heads<const T> k, Heads<const T> v,
                              Heads<const T> d_out, Heads<T> dq, Heads<T> dk, Heads<T> dv,
                              const SoftmaxOptions& options) {
  constexpr std::string_view fn = "softmax_attention_backward";
  detail::check_backward_heads(fn, q, k, v, d_out, dq, dk, dv);
  check_inputs(fn, q, k, v, options);
  detail::require_finite_view(fn, "d_out", d_out, q);
  const auto run = [&](Index b, Index h, detail::Threads threading) {
    const Index n = valid_rows(q, b), n_k = valid_rows(k, b);
    const SliceRows<T> q_rows(q, b, h, n), k_rows(k, b, h, n_k), v_rows(v, b, h, n_k),
        d_out_rows(d_out, b, h, n);
    const SliceOutput<T> dq_rows(dq, b, h, n), dk_rows(dk, b, h, n_k), dv_rows(dv, b, h, n_k);
    const detail::SoftmaxBackwardHead<T> head{q_rows.data(),
                                              k_rows.data(),
                                              v_rows.data(),
                                              d_out_rows.data(),
                                              dq_rows.data(),
                                              dk_rows.data(),
                                              dv_rows.data(),
                                              n,
                                              n_k,
                                              q.d,
                                              v.d};
    detail::softmax_head_backward(head, options, threading);
    dq_rows.write_back();
    dk_rows.write_back();
    dv_rows.write_back();
    detail::zero_rows_past(dq, b, h, n);
    detail::zero_rows_past(dk, b, h, n_k);
    detail::zero_rows_past(dv, b, h, n_k);
  };
  for_each_head(q.batch, q.heads, run);
}

}  // namespace

void softmax_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                       Heads<float> out, const SoftmaxOptions& options) {
  softmax_batched(q, k, v, out, options);
}
void softmax_attention(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                       Heads<double> out, const SoftmaxOptions& options) {
  softmax_batched(q, k, v, out, options);
}
void softmax_attention_backward(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                                Heads<const float> d_out, Heads<float> dq, Heads<float> dk,
                                Heads<float> dv, const SoftmaxOptions& options) {
  softmax_batched_backward(q, k, v, d_out, dq, dk, dv, options);
}
void softmax_attention_backward(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                                Heads<const double> d_out, Heads<double> dq, Heads<double> dk,
                                Heads<double> dv, const SoftmaxOptions& options) {
  softmax_batched_backward(q, k, v, d_out, dq, dk, dv, options);
}

}  // namespace linrope
