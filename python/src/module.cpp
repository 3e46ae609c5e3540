// linrope._core: the C++ API on NumPy arrays (docs/DESIGN.md, "Python"). A thin layer: it checks
// dtype and rank, views C-contiguous arrays without a copy, releases the GIL around every kernel
// and calls the C++ API, whose std::invalid_argument pybind11 turns into ValueError with the same
// message (linrope::NonFiniteError, non-finite input data, becomes linrope.NonFiniteError, a
// ValueError subclass). No mathematics here.
//
// Arrays are float32 or float64, shaped (n, d) or (B, H, n, d). The attention calls go through the
// batched Heads entry points for both ranks ((n, d) is B = H = 1), which read raw pointers: the
// single-head calls take `const MatrixF&`, which a NumPy buffer can only reach through a copy.
// Every output is a new array, so none aliases an input.
//
// The pieces: arrays.* (NumPy <-> the C++ views), threads.* (thread count, GIL, maps in use),
// options.hpp and bind_options.cpp (the options structs and the keyword defaults they hold), and
// one bind_<name>.cpp per class or operation.
#include <pybind11/pybind11.h>

#include <linrope/types.hpp>

#include "bindings.hpp"

PYBIND11_MODULE(_core, m) {
  using namespace linrope::python;
  m.doc() = "linrope: linear attention with Rotary Position Embedding, on NumPy arrays.";
  // A ValueError subclass, so that `except ValueError` catches it as it catches every other
  // refusal; tried before pybind11's own std::invalid_argument -> ValueError translation.
  auto& non_finite =
      py::register_exception<linrope::NonFiniteError>(m, "NonFiniteError", PyExc_ValueError);
  non_finite.attr("__doc__") =
      "Raised when an input's values are not finite (NaN or inf in q, k, v, d_out, a feature "
      "map's x, a state's S or z). A ValueError; options that are not finite (eps, scale) raise "
      "a plain ValueError.";
  non_finite.attr("__module__") = "linrope";  // where programs import it from
  bind_threads(m);
  bind_arrays(m);
  bind_options(m);
  bind_rope(m);
  bind_feature_maps(m);
  bind_stream(m);
  bind_softmax_attention(m);
  bind_linear_attention(m);
  bind_matmul(m);
  bind_layer_functions(m);
}
