// Private: the argument checks that the forward and the backward entry points share
// (linear_attention.cpp, linear_batched.cpp, linear_attention_backward.cpp), written once so that
// both directions refuse the same calls with the same words.
#pragma once

#include <linrope/attention.hpp>
#include <linrope/batched.hpp>
#include <string>
#include <string_view>
#include <utility>

#include "common/check.hpp"
#include "common/heads.hpp"
#include "linear/linear_kernel.hpp"
#include "linear/state_views.hpp"

namespace linrope::detail {

// The single-head inputs: q [n x d], k [n_k x d], v [n_k x d_v] and, for a backward, d_out
// [n x d_v] (null: a forward).
template <class T>
void check_single_inputs(std::string_view fn, const Matrix<T>& q, const Matrix<T>& k,
                         const Matrix<T>& v, const Matrix<T>* d_out = nullptr) {
  if (k.cols() != q.cols()) throw_invalid(fn, "k is ", shape_of(k), " but q has d = ", q.cols());
  if (v.rows() != k.rows())
    throw_invalid(fn, "v is ", shape_of(v), " but k has ", k.rows(), " rows");
  if (d_out && (d_out->rows() != q.rows() || d_out->cols() != v.cols()))
    throw_invalid(fn, "d_out is ", shape_of(*d_out), " but expected ", Shape{q.rows(), v.cols()},
                  " (q's rows x v's columns)");
}

// The states of a stateful call, forward or backward: the call causal; `initial` and `d_final`
// (the backward's; "none" in a forward) shaped for the call and finite; `written` (the forward's
// final state, with its log_scale; the backward's d_initial, without: `written_has_scale`) shaped
// for the call, in memory of its own: apart from q, k, v, `last` (the forward's out, the
// backward's d_out), the states read and its own other part, except that a final state may be the
// initial state itself (updated in place: each slice reads its initial state before it writes its
// final one).
template <class T, class Last>
void check_state_views(std::string_view fn, const Heads<const T>& q, const Heads<const T>& k,
                       const Heads<const T>& v, std::string_view last_name, const Heads<Last>& last,
                       const LinearSetup& setup, const HeadStates<const T>& initial,
                       const HeadStates<const T>& d_final, std::string_view written_name,
                       const HeadStates<T>& written, bool written_has_scale) {
  if (!setup.options.causal)
    throw_invalid(fn, "options.causal is false but a state in, state out call is causal");
  const Index m = setup.m, d_v = setup.d_v;
  check_states(fn, "initial_state", initial, q, m, d_v, true);
  check_states(fn, "d_final", d_final, q, m, d_v, false);
  check_states(fn, written_name, written, q, m, d_v, written_has_scale);
  require_finite_states(fn, "initial_state", initial, true);
  require_finite_states(fn, "d_final", d_final, false);
  if (written.S == nullptr) return;
  const bool in_place =
      written.S == initial.S && written.z == initial.z && written.log_scale == initial.log_scale;
  const std::string S_name = std::string(written_name) + ".S",
                    z_name = std::string(written_name) + ".z";
  for (const auto& [name, part] : {std::pair{std::string_view(S_name), S_heads(written)},
                                   std::pair{std::string_view(z_name), z_heads(written)}}) {
    require_separate(fn, name, part, "q", q);
    require_separate(fn, name, part, "k", k);
    require_separate(fn, name, part, "v", v);
    require_separate(fn, name, part, last_name, last);
    if (!in_place) {
      require_separate(fn, name, part, "initial_state.S", S_heads(initial));
      require_separate(fn, name, part, "initial_state.z", z_heads(initial));
    }
    require_separate(fn, name, part, "d_final.S", S_heads(d_final));
    require_separate(fn, name, part, "d_final.z", z_heads(d_final));
  }
  require_separate(fn, z_name, z_heads(written), S_name, S_heads(written));
}

}  // namespace linrope::detail
