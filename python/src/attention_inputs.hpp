// The inputs and gradients of the attention calls (softmax and linear, forward and backward):
// q, k, v (and d_out) checked, viewed as the batched Heads the kernels read, and new outputs.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <linrope/linrope.hpp>
#include <stdexcept>
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

// An attention's input or output array and the layout its buffer has (include/linrope/batched.hpp,
// HeadsLayout). An input is read in place when it is C-contiguous (BHND) or the [B, H, n, d] view
// of a C-contiguous [B, n, H, d] buffer (BNHD: what PyTorch's `x.view(B, n, H, d).transpose(1, 2)`
// of a projection's output gives), and aligned; any other is copied once, to BHND. An output takes
// the layout of the input it matches (out and dq q's, dk k's, dv v's), so that a caller that gave
// the one layout gets it back.
template <class T>
struct HeadsArray {
  py::array_t<T> array;
  HeadsLayout layout = HeadsLayout::BHND;

  Heads<const T> view(const Lengths& lengths) const {
    return with_lengths(heads_of<const T>(array.data()), lengths);
  }
  Heads<T> mutable_view(const Lengths& lengths) {
    return with_lengths(heads_of<T>(array.mutable_data()), lengths);
  }

 private:
  template <class U>
  Heads<U> heads_of(U* data) const {
    const py::array& a = array;
    if (a.ndim() == 2) return {data, 1, 1, Index(a.shape(0)), Index(a.shape(1))};
    return {
        data,  Index(a.shape(0)), Index(a.shape(1)), Index(a.shape(2)), Index(a.shape(3)), nullptr,
        layout};
  }
};

// `a` (an array of T, any strides) as a py::array_t<T> without a copy.
template <class T>
py::array_t<T> viewed(const py::object& a) {
  py::array_t<T> view = py::array_t<T>::ensure(a);
  if (!view) throw std::logic_error("linrope: an array of the checked dtype could not be viewed");
  return view;
}

// True when `a` (4-D) is the [B, H, n, d] view of a C-contiguous [B, n, H, d] buffer of T: its
// strides those of that buffer transposed, a stride of an extent-1 dimension not counting.
template <class T>
bool is_bnhd(const py::array& a) {
  if (a.ndim() != 4) return false;
  const py::ssize_t B = a.shape(0), H = a.shape(1), n = a.shape(2), d = a.shape(3);
  const py::ssize_t item = sizeof(T),
                    expected[4] = {n * H * d * item, d * item, H * d * item, item};
  const py::ssize_t extents[4] = {B, H, n, d};
  for (int i = 0; i < 4; ++i)
    if (extents[i] > 1 && a.strides(i) != expected[i]) return false;
  return true;
}

// `a` (dtype already checked) as the kernels read it: in place when C-contiguous or BNHD and
// aligned, else a C-contiguous copy.
template <class T>
HeadsArray<T> heads_array(const py::array& a) {
  const bool aligned = reinterpret_cast<std::uintptr_t>(a.data()) % alignof(T) == 0;
  if (aligned && a.size() > 0 && !(a.flags() & py::array::c_style) && is_bnhd<T>(a))
    return {viewed<T>(a), HeadsLayout::BNHD};
  CArray<T> c = contiguous<T>(a);
  return {py::reinterpret_steal<py::array_t<T>>(c.release()), HeadsLayout::BHND};
}

// A new array laid out as `like` is, of its shape with the last dimension `last`, contents
// unspecified, or zeroed if `zero` (the attention calls leave rows past the lengths unwritten).
template <class T>
HeadsArray<T> new_heads_array(const HeadsArray<T>& like, py::ssize_t last, bool zero = false) {
  CArray<T> buffer;
  if (like.layout == HeadsLayout::BNHD) {
    const py::array& a = like.array;
    buffer = new_array<T>({a.shape(0), a.shape(2), a.shape(1), last});
  } else {
    buffer = new_array<T>(like.array, last);
  }
  if (zero) std::fill_n(buffer.mutable_data(), buffer.size(), T(0));
  if (like.layout == HeadsLayout::BHND)
    return {py::reinterpret_steal<py::array_t<T>>(buffer.release()), HeadsLayout::BHND};
  return {viewed<T>(buffer.attr("transpose")(0, 2, 1, 3)), HeadsLayout::BNHD};
}

// q, k, v (and d_out) of one call as the kernels read them, and their Heads views: q and d_out
// with q's lengths, k and v with k's.
template <class T>
struct Inputs {
  HeadsArray<T> q, k, v, d_out;
  const Lengths &q_lengths, &k_lengths;

  Heads<const T> q_heads() const { return q.view(q_lengths); }
  Heads<const T> k_heads() const { return k.view(k_lengths); }
  Heads<const T> v_heads() const { return v.view(k_lengths); }
  Heads<const T> d_out_heads() const { return d_out.view(q_lengths); }
  // The output [.., n, d_v] in q's layout, zero where the lengths leave rows unwritten.
  HeadsArray<T> new_output() const {
    const py::array& values = v.array;
    return new_heads_array<T>(q, values.shape(values.ndim() - 1), bool(q_lengths));
  }
};

template <class T>
Inputs<T> inputs(const py::array& q, const py::array& k, const py::array& v, const py::array* d_out,
                 const Lengths& q_lengths, const Lengths& k_lengths) {
  return {heads_array<T>(q), heads_array<T>(k),
          heads_array<T>(v), d_out ? heads_array<T>(*d_out) : HeadsArray<T>(),
          q_lengths,         k_lengths};
}

// dq, dk, dv: new arrays of the shapes and layouts of q, k, v; `run` calls the C++ backward on
// their views (which writes every row, zeros past the lengths), holding `map` (if any) while it
// runs.
template <class T, class Run>
py::object gradients(const Inputs<T>& in, const FeatureMap* map, Run&& run) {
  const auto like = [](const HeadsArray<T>& x) {
    const py::array& a = x.array;
    return new_heads_array<T>(x, a.shape(a.ndim() - 1));
  };
  HeadsArray<T> dq = like(in.q), dk = like(in.k), dv = like(in.v);
  {
    KernelScope scope(map);
    run(dq.mutable_view(in.q_lengths), dk.mutable_view(in.k_lengths),
        dv.mutable_view(in.k_lengths));
  }
  return py::make_tuple(std::move(dq.array), std::move(dk.array), std::move(dv.array));
}

}  // namespace linrope::python
