// Options of linrope._core: the C++ options structs from the Python keyword arguments, and the
// keyword arguments' defaults, which are the default-constructed C++ structs (bound as classes by
// bind_options, so that linrope.torch reads them too): each default lives in the C++ header alone.
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

inline const SoftmaxOptions softmax_defaults{};
inline const LinearOptions linear_defaults{};
inline const DenominatorStats stats_defaults{};
inline const RopeConfig rope_defaults{};
inline const FeatureMapConfig map_defaults{};

// The C++ parsers throw std::invalid_argument listing the valid names; prefix the Python function.
template <class Parse>
auto parse_name(std::string_view function, Parse parse, const std::string& name) {
  try {
    return parse(name);
  } catch (const std::invalid_argument& e) {
    fail(function, e.what());
  }
}

// An enum's default as the string the Python keyword takes ("numerator_only", "scan", ...).
template <class Enum>
std::string name_of(Enum value) {
  return to_string(value);
}

SoftmaxOptions softmax_options(std::string_view function, bool causal, std::optional<double> scale,
                               const Rope* rope, Index q_offset, Index k_offset);

LinearOptions linear_options(std::string_view function, bool causal, const std::string& placement,
                             const Rope* rope, double eps, Index q_offset, Index k_offset,
                             const std::string& method, Index chunk_size, bool denominator);

py::dict stats_dict(const DenominatorStats& s);

}  // namespace linrope::python
