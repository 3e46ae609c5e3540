// The inputs and gradients of the attention calls (softmax and linear, forward and backward):
// q, k, v (and d_out) checked, viewed as the batched Heads the kernels read, and new outputs.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <linrope/linrope.hpp>
#include <string_view>
#include <utility>

#include "arrays.hpp"
#include "threads.hpp"

namespace linrope::python {

// Checks q, k, v (and d_out) and the lengths, and calls body.template operator()<T>() with T their
// dtype.
template <class Body>
py::object with_inputs(std::string_view function, const py::array& q, const py::array& k,
                       const py::array& v, const py::array* d_out, const Lengths& q_lengths,
                       const Lengths& k_lengths, Body&& body) {
  require_rank(function, "q", q);
  require_rank(function, "k", k);
  require_rank(function, "v", v);
  for (const auto& [name, a] : {std::pair{"k", &k}, std::pair{"v", &v}})
    if (a->ndim() != q.ndim())
      fail(function, name, " has ", a->ndim(), " dimensions but q has ", q.ndim());
  check_lengths(function, "q_lengths", q_lengths, q, "q");
  check_lengths(function, "k_lengths", k_lengths, k, "k");
  DType dtype;
  if (d_out) {
    if (d_out->ndim() != q.ndim())
      fail(function, "d_out has ", d_out->ndim(), " dimensions but q has ", q.ndim());
    dtype = common_dtype<4>(function, {"q", "k", "v", "d_out"}, {&q, &k, &v, d_out});
  } else {
    dtype = common_dtype<3>(function, {"q", "k", "v"}, {&q, &k, &v});
  }
  if (dtype == DType::Float32) return body.template operator()<float>();
  return body.template operator()<double>();
}

// The C-contiguous q, k, v (and d_out) of one call, as the Heads views its kernels read: q and
// d_out with q's lengths, k and v with k's.
template <class T>
struct Inputs {
  CArray<T> q, k, v, d_out;
  const Lengths &q_lengths, &k_lengths;

  Heads<const T> q_heads() const { return with_lengths(input_heads(q), q_lengths); }
  Heads<const T> k_heads() const { return with_lengths(input_heads(k), k_lengths); }
  Heads<const T> v_heads() const { return with_lengths(input_heads(v), k_lengths); }
  Heads<const T> d_out_heads() const { return with_lengths(input_heads(d_out), q_lengths); }
  // The output [.., n, d_v], zero where the lengths leave rows unwritten.
  CArray<T> new_output() const {
    const py::ssize_t d_v = v.shape(v.ndim() - 1);
    return q_lengths ? zero_array<T>(q, d_v) : new_array<T>(q, d_v);
  }
};

template <class T>
Inputs<T> inputs(const py::array& q, const py::array& k, const py::array& v, const py::array* d_out,
                 const Lengths& q_lengths, const Lengths& k_lengths) {
  return {contiguous<T>(q), contiguous<T>(k),
          contiguous<T>(v), d_out ? contiguous<T>(*d_out) : CArray<T>(),
          q_lengths,        k_lengths};
}

// dq, dk, dv: new arrays of the shapes of q, k, v; `run` calls the C++ backward on their views
// (which writes every row, zeros past the lengths), holding `map` (if any) while it runs.
template <class T, class Run>
py::object gradients(const Inputs<T>& in, const FeatureMap* map, Run&& run) {
  CArray<T> dq = new_array<T>(in.q, in.q.shape(in.q.ndim() - 1));
  CArray<T> dk = new_array<T>(in.k, in.k.shape(in.k.ndim() - 1));
  CArray<T> dv = new_array<T>(in.v, in.v.shape(in.v.ndim() - 1));
  {
    KernelScope scope(map);
    run(with_lengths(output_heads(dq), in.q_lengths), with_lengths(output_heads(dk), in.k_lengths),
        with_lengths(output_heads(dv), in.k_lengths));
  }
  return py::make_tuple(std::move(dq), std::move(dk), std::move(dv));
}

}  // namespace linrope::python
