// Multi-head attention over [batch, heads, n, d] buffers: checks, then one single-head kernel per
// (batch, head) slice, the slices spread over OpenMP threads.
#include <exception>
#include <linrope/batched.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "check.hpp"
#include "linear_kernel.hpp"
#include "parallel.hpp"
#include "softmax_kernel.hpp"

namespace linrope {
namespace {

using detail::max_threads;

// "[B, H, n, d]". (A stream, not std::string concatenation: GCC 12 raises a false -Wrestrict on
// the latter, GCC bug 105329.)
template <class T>
std::string describe(const Heads<T>& h) {
  std::ostringstream s;
  s << '[' << h.batch << ", " << h.heads << ", " << h.n << ", " << h.d << ']';
  return s.str();
}

// Valid rows of batch b (the padding mask).
template <class T>
Index valid_rows(const Heads<T>& h, Index b) {
  return h.lengths ? h.lengths[b] : h.n;
}

template <class T>
const T* slice(const Heads<T>& h, Index b, Index head) {
  return h.data + (b * h.heads + head) * h.n * h.d;
}
template <class T>
T* slice_out(const Heads<T>& h, Index b, Index head) {
  return h.data + (b * h.heads + head) * h.n * h.d;
}

template <class T>
void check_view(std::string_view fn, std::string_view name, const Heads<T>& h) {
  if (h.batch < 0 || h.heads < 0 || h.n < 0 || h.d < 0)
    detail::throw_invalid(fn, name, " is ", describe(h), " but expected non-negative sizes");
  if (h.data == nullptr && h.batch * h.heads * h.n * h.d > 0)
    detail::throw_invalid(fn, name, ".data is null but ", name, " is ", describe(h));
  if (h.lengths)
    for (Index b = 0; b < h.batch; ++b)
      if (h.lengths[b] < 0 || h.lengths[b] > h.n)
        detail::throw_invalid(fn, name, ".lengths[", b, "] is ", h.lengths[b],
                              " but expected a length in [0, ", h.n, "]");
}

// Shapes shared by both attentions: q [B,H,n,d], k [B,H,n_k,d], v [B,H,n_k,d_v], out [B,H,n,d_v].
template <class T>
void check_heads(std::string_view fn, const Heads<const T>& q, const Heads<const T>& k,
                 const Heads<const T>& v, const Heads<T>& out) {
  check_view(fn, "q", q);
  check_view(fn, "k", k);
  check_view(fn, "v", v);
  check_view(fn, "out", out);
  const auto same_batch_heads = [&](std::string_view name, Index batch, Index heads,
                                    const std::string& shape) {
    if (batch != q.batch || heads != q.heads)
      detail::throw_invalid(fn, name, " is ", shape, " but q has batch = ", q.batch,
                            ", heads = ", q.heads);
  };
  same_batch_heads("k", k.batch, k.heads, describe(k));
  same_batch_heads("v", v.batch, v.heads, describe(v));
  same_batch_heads("out", out.batch, out.heads, describe(out));
  if (k.d != q.d) detail::throw_invalid(fn, "k is ", describe(k), " but q has d = ", q.d);
  if (v.n != k.n) detail::throw_invalid(fn, "v is ", describe(v), " but k has n = ", k.n);
  if (out.n != q.n || out.d != v.d)
    detail::throw_invalid(fn, "out is ", describe(out), " but expected [", q.batch, ", ", q.heads,
                          ", ", q.n, ", ", v.d, "]");
}

// The rows of slice s of q, k or v within the lengths (v's are k's).
template <class T>
detail::ConstRowMap<T> valid_slice(const Heads<const T>& h, Index s,
                                   const Heads<const T>& lengths_from) {
  const Index b = s / h.heads;
  return detail::ConstRowMap<T>(slice(h, b, s % h.heads), valid_rows(lengths_from, b), h.d);
}

// Throws naming the first non-finite value of slice s (q, then k, then v), if there is one.
template <class T>
void require_finite_slice(std::string_view fn, const Heads<const T>& q, const Heads<const T>& k,
                          const Heads<const T>& v, Index s) {
  const auto name = [&](char tensor) {
    std::ostringstream out;
    out << tensor << '[' << s / q.heads << ", " << s % q.heads << ']';
    return out.str();
  };
  detail::require_finite(fn, name('q'), valid_slice(q, s, q));
  detail::require_finite(fn, name('k'), valid_slice(k, s, k));
  detail::require_finite(fn, name('v'), valid_slice(v, s, k));
}

// Every valid row finite, checked before softmax runs (the linear kernels check as they read).
// The scan reads every input once, so the slices are scanned on all threads; the first offending
// slice in order is then reported (the same message whatever the thread count).
template <class T>
void require_finite_heads(std::string_view fn, const Heads<const T>& q, const Heads<const T>& k,
                          const Heads<const T>& v) {
  const Index slices = q.batch * q.heads;
  std::vector<char> finite(slices);
#pragma omp parallel for schedule(dynamic)
  for (Index s = 0; s < slices; ++s)
    finite[s] = detail::all_finite(valid_slice(q, s, q)) &&
                detail::all_finite(valid_slice(k, s, k)) &&
                detail::all_finite(valid_slice(v, s, k));
  for (Index s = 0; s < slices; ++s)
    if (!finite[s]) require_finite_slice(fn, q, k, v, s);
}

// Runs body(b, h) for every slice on the OpenMP threads; the first exception (only bad_alloc can
// occur after the checks) is rethrown outside the parallel region.
template <class Body>
void for_each_slice(Index batch, Index heads, Body body) {
  const Index slices = batch * heads;
  std::exception_ptr failure;
#pragma omp parallel for schedule(dynamic)
  for (Index s = 0; s < slices; ++s) {
    try {
      body(s / heads, s % heads);
    } catch (...) {
#pragma omp critical(linrope_batched_failure)
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

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
    detail::softmax_head(slice(q, b, h), slice(k, b, h), slice(v, b, h), slice_out(out, b, h),
                         valid_rows(q, b), valid_rows(k, b), q.d, v.d, options, parallel);
  };
  // Enough slices for every thread: one slice per thread. Otherwise each slice uses all threads.
  if (q.batch * q.heads >= max_threads()) {
    for_each_slice(q.batch, q.heads, [&](Index b, Index h) { run(b, h, false); });
  } else {
    for (Index b = 0; b < q.batch; ++b)
      for (Index h = 0; h < q.heads; ++h) run(b, h, true);
  }
}

template <class T>
void linear_batched(Heads<const T> q, Heads<const T> k, Heads<const T> v, Heads<T> out,
                    const FeatureMap& map, const LinearOptions& options, DenominatorStats* stats) {
  constexpr std::string_view fn = "linear_attention";
  check_heads(fn, q, k, v, out);
  detail::check_linear_setup(fn, map, options, q.d);
  detail::require_positions(fn, "options.q_offset", options.q_offset, q.n);
  detail::require_positions(fn, "options.k_offset", options.k_offset, k.n);
  const detail::LinearSetup setup{&map, options, q.d, v.d, map.output_dim()};
  const double threshold = stats ? stats->threshold : 0.0;
  const Index slices = q.batch * q.heads;
  std::vector<detail::DenominatorTally> tallies(slices, detail::DenominatorTally(threshold));
  // Non-finite inputs are found by the kernels as they read them (see NonFiniteFlag).
  std::vector<detail::NonFiniteFlag> nonfinite(slices);
  const auto run = [&](Index b, Index h, bool parallel) {
    const Index s = b * q.heads + h;
    detail::DenominatorTally* tally = stats ? &tallies[s] : nullptr;
    detail::LinearSetup setup_of_slice = setup;
    setup_of_slice.nonfinite = &nonfinite[s];
    const Index n = valid_rows(q, b), nk = valid_rows(k, b);
    if (options.causal) {
      detail::LinearState<T> state;
      state.reset(setup.m, setup.dv);
      detail::linear_causal(slice(q, b, h), slice(k, b, h), slice(v, b, h), slice_out(out, b, h), n,
                            nk, options.q_offset, options.k_offset, setup_of_slice, state, false,
                            tally, parallel);
    } else {
      detail::linear_noncausal(slice(q, b, h), slice(k, b, h), slice(v, b, h), slice_out(out, b, h),
                               n, nk, options.q_offset, options.k_offset, setup_of_slice, tally,
                               parallel);
    }
  };
  // As for softmax: one slice per thread when there are enough, else each slice on all threads.
  if (q.batch * q.heads >= max_threads()) {
    for_each_slice(q.batch, q.heads, [&](Index b, Index h) { run(b, h, false); });
  } else {
    for (Index b = 0; b < q.batch; ++b)
      for (Index h = 0; h < q.heads; ++h) run(b, h, true);
  }
  for (Index s = 0; s < slices; ++s)
    if (nonfinite[s].raised()) require_finite_slice(fn, q, k, v, s);
  if (stats) {
    detail::DenominatorTally(threshold).store(*stats);
    for (const auto& tally : tallies) tally.merge_into(*stats);
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

}  // namespace linrope
