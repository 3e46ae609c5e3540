// linrope: multi-head attention over contiguous row-major [batch, heads, n, d] buffers (PyTorch's
// layout, `x.contiguous()`) or [batch, n, heads, d] ones (HeadsLayout), parallel across (batch,
// head) and, when there are fewer heads than threads, along the sequence. Each (b, h) slice gives
// exactly what the single-head call gives, bit for bit, except causal linear attention on heads
// long enough to be split along the sequence, which agrees to rounding ("Reproducibility" in
// attention.hpp).
#pragma once

#include <linrope/attention.hpp>
#include <type_traits>

namespace linrope {

// How a Heads view's buffer holds its [batch, heads, n, d] elements, each layout dense:
// BHND: [batch, heads, n, d], a head's rows one block (PyTorch's `x.contiguous()`);
// BNHD: [batch, n, heads, d], a position's heads side by side: a projection's output [B, n, H d]
//       seen per head, which PyTorch's `x.view(B, n, H, d).transpose(1, 2)` gives without a copy.
// The kernels read a BNHD slice's rows gathered into per-thread scratch (a head's rows are H d
// apart) and write its outputs back the same way; the results are the same bits in either layout.
enum class HeadsLayout { BHND, BNHD };

// A view of a buffer of [batch, heads, n, d] elements laid out as `layout` says. `lengths`
// (optional, `batch` entries) marks padding: rows at or past lengths[b] are neither attended to
// (keys) nor written (outputs). The views of one call may have different layouts.
template <class T>
struct Heads {
  T* data = nullptr;
  Index batch = 1, heads = 1, n = 0, d = 0;
  const Index* lengths = nullptr;
  HeadsLayout layout = HeadsLayout::BHND;
};

// q [B,H,n,d], k [B,H,n_k,d], v [B,H,n_k,d_v] -> out [B,H,n,d_v]. Options as for the single-head
// calls; a linear attention's LinearOptions::head_decays, when not empty, holds H decays, head h
// decaying by head_decays[h]. Throws std::invalid_argument on null data, mismatched
// batch/heads/widths, a layout that is neither HeadsLayout, lengths outside [0, n], a view whose
// batch * heads * n * d overflows, an output that shares memory with an input (in place) or, in a
// backward, with another gradient, or non-finite inputs (within the lengths). softmax_attention
// checks its inputs before it writes anything; linear_attention finds a non-finite value as its
// kernels read each block (a separate scan would cost one more pass over memory), so when it
// throws for one, `out` may hold partial results.
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

// The states of every (b, h) slice (attention.hpp, "State in, state out"), contiguous row-major
// buffers in PyTorch's layout: S [batch, heads, m, d_v], z [batch, heads, m], log_scale [batch,
// heads] (-inf: an empty state). A view whose S is null stands for "none": every state empty
// (an initial state), or not wanted (a final state, a gradient). Gradients leave log_scale null.
template <class T>
struct HeadStates {
  T* S = nullptr;
  T* z = nullptr;
  std::conditional_t<std::is_const_v<T>, const double, double>* log_scale = nullptr;
  Index batch = 1, heads = 1, m = 0, d_v = 0;
};

// Causal linear attention per slice, each continued from its initial state, leaving in
// final_state (if not "none") the initial state plus every key of the slice within the lengths.
// final_state may be initial_state itself (the states are then updated in place); it must not
// otherwise share memory with it nor with q, k, v or out. options.causal must be true. Throws as
// the call above does, and on states of the wrong shape (batch and heads of q, m =
// map.output_dim(), d_v of v), a null z or log_scale beside a non-null S, or a non-finite S, z or
// log_scale (+inf, NaN) in the initial state.
void linear_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                      Heads<float> out, const FeatureMap& map, const LinearOptions& options,
                      HeadStates<const float> initial_state, HeadStates<float> final_state,
                      DenominatorStats* stats = nullptr);
void linear_attention(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                      Heads<double> out, const FeatureMap& map, const LinearOptions& options,
                      HeadStates<const double> initial_state, HeadStates<double> final_state,
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

// The gradients of the stateful call above (attention.hpp's single-head form says what they are):
// dq, dk, dv, and, unless d_initial is "none", dL/dS and dL/dz of each slice's initial state, from
// d_final (dL/dS and dL/dz of each final state; "none": zero).
void linear_attention_backward(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                               Heads<const float> d_out, Heads<float> dq, Heads<float> dk,
                               Heads<float> dv, const FeatureMap& map, const LinearOptions& options,
                               HeadStates<const float> initial_state,
                               HeadStates<const float> d_final, HeadStates<float> d_initial);
void linear_attention_backward(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                               Heads<const double> d_out, Heads<double> dq, Heads<double> dk,
                               Heads<double> dv, const FeatureMap& map,
                               const LinearOptions& options, HeadStates<const double> initial_state,
                               HeadStates<const double> d_final, HeadStates<double> d_initial);

// The four linear calls above with a LinearSaved (attention.hpp): the forwards fill `saved`, one
// slice per (b, h), the backwards read it (the same gradients, the same bits). The backwards also
// check that `saved` comes from a forward of the same batch, heads, n, n_k, d and lengths.
void linear_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                      Heads<float> out, const FeatureMap& map, const LinearOptions& options,
                      LinearSaved<float>& saved, DenominatorStats* stats = nullptr);
void linear_attention(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                      Heads<double> out, const FeatureMap& map, const LinearOptions& options,
                      LinearSaved<double>& saved, DenominatorStats* stats = nullptr);
void linear_attention(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                      Heads<float> out, const FeatureMap& map, const LinearOptions& options,
                      HeadStates<const float> initial_state, HeadStates<float> final_state,
                      LinearSaved<float>& saved, DenominatorStats* stats = nullptr);
void linear_attention(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                      Heads<double> out, const FeatureMap& map, const LinearOptions& options,
                      HeadStates<const double> initial_state, HeadStates<double> final_state,
                      LinearSaved<double>& saved, DenominatorStats* stats = nullptr);
void linear_attention_backward(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                               Heads<const float> d_out, Heads<float> dq, Heads<float> dk,
                               Heads<float> dv, const FeatureMap& map, const LinearOptions& options,
                               const LinearSaved<float>& saved);
void linear_attention_backward(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                               Heads<const double> d_out, Heads<double> dq, Heads<double> dk,
                               Heads<double> dv, const FeatureMap& map,
                               const LinearOptions& options, const LinearSaved<double>& saved);
void linear_attention_backward(Heads<const float> q, Heads<const float> k, Heads<const float> v,
                               Heads<const float> d_out, Heads<float> dq, Heads<float> dk,
                               Heads<float> dv, const FeatureMap& map, const LinearOptions& options,
                               HeadStates<const float> initial_state,
                               HeadStates<const float> d_final, HeadStates<float> d_initial,
                               const LinearSaved<float>& saved);
void linear_attention_backward(Heads<const double> q, Heads<const double> k, Heads<const double> v,
                               Heads<const double> d_out, Heads<double> dq, Heads<double> dk,
                               Heads<double> dv, const FeatureMap& map,
                               const LinearOptions& options, HeadStates<const double> initial_state,
                               HeadStates<const double> d_final, HeadStates<double> d_initial,
                               const LinearSaved<double>& saved);

}  // namespace linrope
