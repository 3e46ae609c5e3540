// Array marshalling for linrope._core: NumPy arrays <-> the C++ API's views (Heads, row matrices),
// with the dtype, rank and shape checks that turn bad input into a ValueError naming the argument.
// Arrays are float32 or float64; a C-contiguous, aligned array is viewed in place, any other is
// copied once.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // every unit alike: std::optional, std::vector arguments

#include <algorithm>
#include <array>
#include <cstddef>
#include <linrope/linrope.hpp>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "common/block_cache.hpp"

namespace linrope::python {

namespace py = pybind11;

// std::invalid_argument (ValueError in Python) "function: parts...".
template <class... Parts>
[[noreturn]] void fail(std::string_view function, const Parts&... parts) {
  std::ostringstream message;
  message << function << ": ";
  (message << ... << parts);
  throw std::invalid_argument(message.str());
}

template <class T>
using CArray = py::array_t<T, py::array::c_style>;

enum class DType { Float32, Float64 };

DType dtype_of(std::string_view function, const char* name, const py::array& a);

// The dtype shared by all `arrays` (named by `names`), or a ValueError naming the odd one.
template <std::size_t N>
DType common_dtype(std::string_view function, const std::array<const char*, N>& names,
                   const std::array<const py::array*, N>& arrays) {
  const DType first = dtype_of(function, names[0], *arrays[0]);
  for (std::size_t i = 1; i < N; ++i)
    if (dtype_of(function, names[i], *arrays[i]) != first)
      fail(function, names[i], " has dtype ", std::string(py::str(arrays[i]->dtype())), " but ",
           names[0], " has dtype ", std::string(py::str(arrays[0]->dtype())));
  return first;
}

// A C-contiguous view of `a` (dtype already checked): the same buffer when `a` is C-contiguous
// and aligned, else a C-contiguous, aligned copy. (NumPy can view a buffer at any byte offset;
// the kernels read whole floats, which C++ requires aligned.)
template <class T>
CArray<T> contiguous(const py::array& a) {
  CArray<T> c = CArray<T>::ensure(a);
  if (c.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_) return c;
  return CArray<T>::ensure(c.attr("copy")());
}

// "(2, 3, 5)": a's shape as NumPy prints it.
std::string shape_text(const py::array& a);

// a is (n, d) or (B, H, n, d).
void require_rank(std::string_view function, const char* name, const py::array& a);

// a is [..., d] of any rank >= 1: the feature maps act row-wise.
void require_rows(std::string_view function, const char* name, const py::array& a);

// Arrays of at least this many bytes come from the library's block cache (common/block_cache.hpp).
inline constexpr std::size_t kCachedArrayBytes = std::size_t(1) << 18;

// A new array of `shape`, contents unspecified. A large one (an attention's output, its gradients,
// a product) lives in a CachedBlock that goes back to the cache when the
// array dies: a training step makes the same arrays every step, and fresh pages cost a fault each
// (measured: ~1,000 faults and 2.5x the time of the backward at the study's [16, 4, 256, 32] once
// the allocator had started returning such blocks to the system; bench/RESULTS.md).
template <class T>
CArray<T> new_array(const std::vector<py::ssize_t>& shape) {
  std::size_t bytes = sizeof(T);
  for (const py::ssize_t extent : shape) bytes *= std::size_t(extent);
  if (bytes < kCachedArrayBytes) return CArray<T>(shape);
  auto block = std::make_unique<detail::CachedBlock>(bytes);
  T* data = reinterpret_cast<T*>(block->data());
  py::capsule owner(block.get(), [](void* p) { delete static_cast<detail::CachedBlock*>(p); });
  block.release();  // the capsule owns it now
  return CArray<T>(shape, data, owner);
}

// A new array of `like`'s shape with its last dimension replaced by `last`.
template <class T>
CArray<T> new_array(const py::array& like, py::ssize_t last) {
  std::vector<py::ssize_t> shape(like.shape(), like.shape() + like.ndim());
  shape.back() = last;
  return new_array<T>(shape);
}

// Padding: lengths[b] for every batch entry b of `a`, or none. The C++ call reads a raw pointer,
// so the count is checked here; the values (in [0, n]) are checked by the C++ call.
using Lengths = std::optional<std::vector<Index>>;

void check_lengths(std::string_view function, const char* name, const Lengths& lengths,
                   const py::array& a, const char* of);

template <class H>
H with_lengths(H heads, const Lengths& lengths) {
  heads.lengths = lengths ? lengths->data() : nullptr;
  return heads;
}

// x [..., d] as the matrix [rows x d] of all its rows, and its mutable counterpart.
template <class T>
Eigen::Map<const Matrix<T>> rows_of(const CArray<T>& x) {
  const Index d = x.ndim() == 0 ? 0 : Index(x.shape(x.ndim() - 1));
  return {x.data(), d == 0 ? 0 : Index(x.size()) / d, d};
}
template <class T>
Eigen::Map<Matrix<T>> rows_of(CArray<T>& x) {
  const Index d = x.ndim() == 0 ? 0 : Index(x.shape(x.ndim() - 1));
  return {x.mutable_data(), d == 0 ? 0 : Index(x.size()) / d, d};
}

}  // namespace linrope::python
