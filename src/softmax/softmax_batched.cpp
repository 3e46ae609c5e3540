// Softmax attention over [batch, heads, n, d] buffers: checks, then one single-head kernel per
// (batch, head) slice, the slices spread over the OpenMP threads.
#include <linrope/batched.hpp>

#include "common/heads.hpp"
#include "softmax/softmax_kernel.hpp"

namespace linrope {
namespace {

using detail::check_heads;
using detail::for_each_slice;
using detail::max_threads;
using detail::require_finite_heads;
using detail::slice;
using detail::slice_out;
using detail::valid_rows;

template <class T>
void softmax_batched(Heads<const T> q, Heads<const T> k, Heads<const T> v, Heads<T> out,
                     const SoftmaxOptions& options) {
  constexpr std::string_view fn = "softmax_attention";
  check_heads(fn, q, k, v, out);
  require_finite_heads(fn, q, k, v);
  detail::check_softmax_options(fn, q.d, options);
  detail::require_positions(fn, "options.q_offset", options.q_offset, q.n);
  detail::require_positions(fn, "options.k_offset", options.k_offset, k.n);
  const auto run = [&](Index b, Index h, bool parallel) {
    const detail::SoftmaxHead<T> head{slice(q, b, h),
                                      slice(k, b, h),
                                      slice(v, b, h),
                                      slice_out(out, b, h),
                                      valid_rows(q, b),
                                      valid_rows(k, b),
                                      q.d,
                                      v.d};
    detail::softmax_head(head, options, parallel);
  };
  // Enough slices for every thread: one slice per thread. Otherwise each slice uses all threads.
  if (q.batch * q.heads >= max_threads()) {
    for_each_slice(q.batch, q.heads, [&](Index b, Index h) { run(b, h, false); });
  } else {
    for (Index b = 0; b < q.batch; ++b)
      for (Index h = 0; h < q.heads; ++h) run(b, h, true);
  }
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
}  // namespace linrope
