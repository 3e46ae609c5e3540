#include "options.hpp"

#include <cmath>

namespace linrope::python {

using namespace pybind11::literals;

SoftmaxOptions softmax_options(std::string_view function, bool causal, std::optional<double> scale,
                               const Rope* rope, Index q_offset, Index k_offset) {
  // The C++ API reads scale = 0 as "1/sqrt(d)"; in Python that is None, and an explicit 0 (uniform
  // weights) cannot be passed on, so it is refused rather than silently replaced.
  if (scale && !(std::isfinite(*scale) && *scale > 0))
    fail(function, "scale is ", *scale, " but expected a finite scale > 0 (None means 1/sqrt(d))");
  return {.causal = causal,
          .scale = scale.value_or(0.0),
          .rope = rope,
          .q_offset = q_offset,
          .k_offset = k_offset};
}

LinearOptions linear_options(std::string_view function, bool causal, const std::string& placement,
                             const Rope* rope, double eps, Index q_offset, Index k_offset,
                             const std::string& method, Index chunk_size, bool denominator) {
  return {.causal = causal,
          .placement = parse_name(function, rope_placement_from_string, placement),
          .rope = rope,
          .eps = eps,
          .q_offset = q_offset,
          .k_offset = k_offset,
          .method = parse_name(function, causal_method_from_string, method),
          .chunk_size = chunk_size,
          .denominator = denominator};
}

py::dict stats_dict(const DenominatorStats& s) {
  return py::dict("min"_a = s.min, "nonpositive"_a = s.nonpositive,
                  "below_threshold"_a = s.below_threshold, "threshold"_a = s.threshold,
                  "count"_a = s.count, "no_keys"_a = s.no_keys, "zero_divisor"_a = s.zero_divisor);
}

}  // namespace linrope::python
