// The message of the std::invalid_argument a call throws, for tests that check refusals word for
// word.
#pragma once

#include <stdexcept>
#include <string>

namespace linrope::testing {

// The message of the std::invalid_argument `call` throws ("" if it throws none).
template <class Call>
std::string refusal(Call call) {
  try {
    call();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace linrope::testing
