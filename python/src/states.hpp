// The states of state in, state out (include/linrope/batched.hpp, HeadStates) as NumPy arrays: a
// state is the tuple (S, z, log_scale), S [..., m, d_v], z [..., m] of q's dtype and log_scale
// [...] float64, "..." being q's leading dimensions (none for (n, d) inputs, (B, H) for
// (B, H, n, d)); a state's gradient is the pair (dS, dz).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <linrope/batched.hpp>
#include <string_view>
#include <vector>

#include "arrays.hpp"

namespace linrope::python {

// One state or gradient's arrays, C-contiguous; `present` false: None (an empty state, a zero
// gradient, one not wanted).
template <class T>
struct StateArrays {
  bool present = false, has_scale = false;  // has_scale: a state's, not a gradient's
  CArray<T> S, z;
  CArray<double> log_scale;

  HeadStates<const T> view(Index batch, Index heads, Index m, Index d_v) const {
    if (!present) return {};
    return {S.data(), z.data(), has_scale ? log_scale.data() : nullptr, batch, heads, m, d_v};
  }
  HeadStates<T> mutable_view(Index batch, Index heads, Index m, Index d_v) {
    if (!present) return {};
    return {S.mutable_data(),
            z.mutable_data(),
            has_scale ? log_scale.mutable_data() : nullptr,
            batch,
            heads,
            m,
            d_v};
  }
  // (S, z, log_scale) for a state, (dS, dz) for a gradient.
  py::tuple to_tuple() const {
    if (has_scale) return py::make_tuple(S, z, log_scale);
    return py::make_tuple(S, z);
  }
};

// The leading dimensions of q (the states' batch and heads): () or (B, H).
std::vector<py::ssize_t> leading_shape(const py::array& q);

// `state` (None, or a tuple (S, z, log_scale) when with_scale, else (dS, dz)) checked against the
// call: q's leading shape, m, d_v, dtype T; copies only where a view is not C-contiguous.
template <class T>
StateArrays<T> read_state(std::string_view function, const char* name, const py::object& state,
                          const py::array& q, Index m, Index d_v, bool with_scale);

// New arrays for a state (with_scale) or a gradient of the call's shape.
template <class T>
StateArrays<T> new_state(const py::array& q, Index m, Index d_v, bool with_scale);

}  // namespace linrope::python
