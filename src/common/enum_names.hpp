// The names of the public enums (feature map kinds, RoPE layouts and scalings, placements, causal
// methods), kept in one table per enum beside its code so that the command line and the Python
// package hold none of their own. Value i of an enum is names[i].
#pragma once
#include <array>
#include <cstddef>
#include <string>
#include <string_view>

#include "common/check.hpp"

namespace linrope::detail {

// The name of e; std::invalid_argument naming `type` for a value outside the table.
template <class Enum, std::size_t N>
const char* enum_name(Enum e, const std::array<const char*, N>& names, std::string_view type) {
  const int i = static_cast<int>(e);
  if (i < 0 || i >= int(N))
    throw_invalid("to_string", type, " is ", i, " but expected a value in [0, ", N - 1, "]");
  return names[std::size_t(i)];
}

// The value named `name`; std::invalid_argument from `function` listing the valid names.
template <class Enum, std::size_t N>
Enum enum_from_name(std::string_view name, const std::array<const char*, N>& names,
                    std::string_view function, std::string_view what) {
  std::string valid;
  for (std::size_t i = 0; i < N; ++i) {
    if (name == names[i]) return static_cast<Enum>(i);
    valid += (i == 0 ? "" : ", ") + std::string(names[i]);
  }
  throw_invalid(function, what, " is \"", name, "\" but expected one of ", valid);
}

}  // namespace linrope::detail
