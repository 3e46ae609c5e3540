// Options of linrope._core: the C++ options structs from the Python keyword arguments.
#pragma once

#include <pybind11/pybind11.h>

#include <linrope/linrope.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "arrays.hpp"

namespace linrope::python {

namespace py = pybind11;

// The C++ parsers throw std::invalid_argument listing the valid names; prefix the Python function.
template <class Parse>
auto parse_name(std::string_view function, Parse parse, const std::string& name) {
  try {
    return parse(name);
  } catch (const std::invalid_argument& e) {
    fail(function, e.what());
  }
}

SoftmaxOptions softmax_options(std::string_view function, bool causal, std::optional<double> scale,
                               const Rope* rope, Index q_offset, Index k_offset);

LinearOptions linear_options(std::string_view function, bool causal, const std::string& placement,
                             const Rope* rope, double eps, Index q_offset, Index k_offset,
                             const std::string& method, Index chunk_size);

py::dict stats_dict(const DenominatorStats& s);

}  // namespace linrope::python
