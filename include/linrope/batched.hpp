// linrope: multi-head attention over contiguous row-major [batch, heads, n, d] buffers (PyTorch's
// layout, `x.contiguous()`), parallel across (batch, head) and, when there are fewer heads than
// threads, along the sequence. Each (b, h) slice gives exactly what the single-head call gives,
// bit for bit, except causal linear attention on heads long enough to be split along the
// sequence, which agrees to rounding ("Reproducibility" in attention.hpp).
#pragma once

#include <linrope/attention.hpp>

namespace linrope {

// A view of a [batch, heads, n, d] buffer. `lengths` (optional, `batch` entries) marks padding:
// rows at or past lengths[b] are neither attended to (keys) nor written (outputs).
template <class T>
struct Heads {
  T* data = nullptr;
  Index batch = 1, heads = 1, n = 0, d = 0;
  const Index* lengths = nullptr;
};

// q [B,H,n,d], k [B,H,n_k,d], v [B,H,n_k,d_v] -> out [B,H,n,d_v]. Options as for the single-head
// calls. Throws std::invalid_argument on null data, mismatched batch/heads/widths, lengths outside
// [0, n], a view whose batch * heads * n * d overflows, an output that shares memory with an
// input (in place) or, in a backward, with another gradient, or non-finite inputs (within the
// lengths). softmax_attention checks its inputs before
// it writes anything; linear_attention finds a non-finite value as its kernels read each block (a
// separate scan would cost one more pass over memory), so when it throws for one, `out` may hold
// partial results.
void softmax_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                       Heads<float> out, const SoftmaxOptions& options = {});
void softmax_attention(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                       Heads<double> out, const SoftmaxOptions& options = {});
// stats, if given, accumulate over every (b, h) slice.
void linear_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                      Heads<float> out, const FeatureMap& map, const LinearOptions& options = {},
                      DenominatorStats* stats = nullptr);
void linear_attention(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                      Heads<double> out, const FeatureMap& map, const LinearOptions& options = {},
                      DenominatorStats* stats = nullptr);

// Gradients of the two calls above (attention.hpp, "Gradients"): d_out [B,H,n,d_v] in, dq, dk, dv
// (the shapes of q, k, v) out. Rows at or past the lengths are neither read from d_out nor
// attended to, and get zero gradients. Each (b, h) slice equals the single-head backward.
void softmax_attention_backward(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                                Heads<const float> d_out, Heads<float> dq, Heads<float> dk,
                                Heads<float> dv, const SoftmaxOptions& options = {});
void softmax_attention_backward(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                                Heads<const double> d_out, Heads<double> dq, Heads<double> dk,
                                Heads<double> dv, const SoftmaxOptions& options = {});
void linear_attention_backward(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                               Heads<const float> d_out, Heads<float> dq, Heads<float> dk,
                               Heads<float> dv, const FeatureMap& map,
                               const LinearOptions& options = {});
void linear_attention_backward(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                               Heads<const double> d_out, Heads<double> dq, Heads<double> dk,
                               Heads<double> dv, const FeatureMap& map,
                               const LinearOptions& options = {});

}  // namespace linrope
