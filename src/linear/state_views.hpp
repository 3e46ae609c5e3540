// Private: the states of state in, state out (attention.hpp, "State in, state out") as the entry
// points receive them: HeadStates views checked against the call, one slice's pointers, and the
// single-head LinearAttentionState seen as a one-slice view.
#pragma once

#include <cmath>
#include <linrope/batched.hpp>
#include <string>

#include "common/heads.hpp"

namespace linrope::detail {

// S as a [batch, heads, m, d_v] view and z as [batch, heads, 1, m], for the overlap checks.
template <class T>
Heads<T> S_heads(const HeadStates<T>& s) {
  return {s.S, s.batch, s.heads, s.m, s.d_v};
}
template <class T>
Heads<T> z_heads(const HeadStates<T>& s) {
  return {s.z, s.batch, s.heads, 1, s.m};
}

// A view called `name` (S null: "none", accepted) must have z (and log_scale, `with_scale`) and
// the shape [q.batch, q.heads, m, d_v].
template <class T, class Q>
void check_states(std::string_view fn, std::string_view name, const HeadStates<T>& s,
                  const Heads<Q>& q, Index m, Index d_v, bool with_scale) {
  if (s.S == nullptr) return;
  if (s.z == nullptr) throw_invalid(fn, name, ".z is null but ", name, ".S is not");
  if (with_scale && s.log_scale == nullptr)
    throw_invalid(fn, name, ".log_scale is null but ", name, ".S is not");
  if (s.batch != q.batch || s.heads != q.heads || s.m != m || s.d_v != d_v)
    throw_invalid(fn, name, " is [batch ", s.batch, ", heads ", s.heads, ", m ", s.m, ", d_v ",
                  s.d_v, "] but expected [", q.batch, ", ", q.heads, ", ", m, ", ", d_v,
                  "] (q's batch and heads, m = map.output_dim(), v's d_v)");
}

// Every S and z entry finite, and (with_scale) every log_scale finite or -inf (an empty state).
template <class T>
void require_finite_states(std::string_view fn, std::string_view name, const HeadStates<T>& s,
                           bool with_scale) {
  if (s.S == nullptr) return;
  const Index slices = s.batch * s.heads;
  require_finite(fn, std::string(name) + ".S",
                 Eigen::Map<const Matrix<std::remove_const_t<T>>>(s.S, slices * s.m, s.d_v));
  require_finite(fn, std::string(name) + ".z",
                 Eigen::Map<const Matrix<std::remove_const_t<T>>>(s.z, slices, s.m));
  if (!with_scale) return;
  for (Index i = 0; i < slices; ++i)
    if (std::isnan(s.log_scale[i]) || s.log_scale[i] == std::numeric_limits<double>::infinity())
      throw_nonfinite(fn, name, ".log_scale[", i / s.heads, ", ", i % s.heads, "] is ",
                      s.log_scale[i], " but expected a finite value or -inf (an empty state)");
}

// Slice s's pointers into a view (null when the view is "none").
template <class T>
T* S_of(const HeadStates<T>& h, Index s) {
  return h.S ? h.S + s * h.m * h.d_v : nullptr;
}
template <class T>
T* z_of(const HeadStates<T>& h, Index s) {
  return h.S ? h.z + s * h.m : nullptr;
}
template <class T>
double log_scale_of(const HeadStates<T>& h, Index s) {
  return h.S ? h.log_scale[s] : -std::numeric_limits<double>::infinity();
}

// A single-head state (or gradient) as a one-slice view; an empty state (or a gradient of size 0)
// as "none". Sizes are checked first (check_state).
template <class T>
HeadStates<const T> state_view(const LinearAttentionState<T>& state) {
  if (state.log_scale == -std::numeric_limits<double>::infinity()) return {};
  return {state.S.data(), state.z.data(), &state.log_scale, 1, 1, state.S.rows(), state.S.cols()};
}
template <class T>
HeadStates<const T> gradient_view(const LinearStateGradient<T>& gradient) {
  if (gradient.dS.size() == 0 && gradient.dz.size() == 0) return {};
  return {gradient.dS.data(), gradient.dz.data(), nullptr, 1, 1,
          gradient.dS.rows(), gradient.dS.cols()};
}

// A single-head state (empty, or [m x d_v] and [m]) or gradient (of size 0, or those shapes).
template <class S, class Z>
void check_state_shape(std::string_view fn, std::string_view name, const S& matrix, const Z& vector,
                       std::string_view matrix_name, std::string_view vector_name, Index m,
                       Index d_v) {
  if (matrix.rows() != m || matrix.cols() != d_v || vector.size() != m)
    throw_invalid(fn, name, ".", matrix_name, " is ", shape_of(matrix), " and ", name, ".",
                  vector_name, " has ", vector.size(), " entries but expected [", m, " x ", d_v,
                  "] and ", m, " (m = map.output_dim(), v's d_v)");
}
template <class T>
void check_state(std::string_view fn, std::string_view name, const LinearAttentionState<T>& state,
                 Index m, Index d_v) {
  if (state.log_scale == -std::numeric_limits<double>::infinity()) return;  // empty
  check_state_shape(fn, name, state.S, state.z, "S", "z", m, d_v);
}
template <class T>
void check_gradient(std::string_view fn, std::string_view name,
                    const LinearStateGradient<T>& gradient, Index m, Index d_v) {
  if (gradient.dS.size() == 0 && gradient.dz.size() == 0) return;  // zero
  check_state_shape(fn, name, gradient.dS, gradient.dz, "dS", "dz", m, d_v);
}

}  // namespace linrope::detail
