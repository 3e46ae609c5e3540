// The decay= argument of linear_attention and linear_attention_backward
// (include/linrope/attention.hpp, LinearOptions::decay and head_decays): a float, or for (B, H, n,
// d) arrays a sequence of H floats, one per head. Whether each lies in (0, 1] and suits the call is
// the C++ checks' to say.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <linrope/attention.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "arrays.hpp"

namespace linrope::python {

// `options` with `decay` read into it; a sequence's values are kept in `storage`, which must
// outlive the call that reads options.head_decays.
inline LinearOptions with_decay(std::string_view function, LinearOptions options,
                                const py::object& decay, const py::array& q,
                                std::vector<double>& storage) {
  const auto type_name = [&] { return std::string(py::str(decay.get_type().attr("__name__"))); };
  if (py::isinstance<py::str>(decay) || py::isinstance<py::bool_>(decay) ||
      !(py::isinstance<py::sequence>(decay) || PyNumber_Check(decay.ptr())))
    fail(function, "decay is a ", type_name(),
         " but expected a float or, for (B, H, n, d) arrays, a sequence of H floats");
  if (!py::isinstance<py::sequence>(decay)) {
    options.decay = py::float_(decay).cast<double>();
    return options;
  }
  const py::sequence values = decay;
  if (q.ndim() != 4)
    fail(function, "decay is a sequence of ", values.size(), " values but q is ", shape_text(q),
         ": one decay per head needs (B, H, n, d) arrays; expected a float");
  if (py::ssize_t(values.size()) != q.shape(1))
    fail(function, "decay has ", values.size(), " values but q has H = ", q.shape(1),
         " heads: expected a float or one decay per head");
  storage.clear();
  for (const py::handle value : values) {
    if (py::isinstance<py::str>(value) || !PyNumber_Check(value.ptr()))
      fail(function, "decay holds a ", std::string(py::str(value.get_type().attr("__name__"))),
           " but expected floats");
    storage.push_back(py::float_(py::reinterpret_borrow<py::object>(value)).cast<double>());
  }
  options.head_decays = storage;
  return options;
}

}  // namespace linrope::python
