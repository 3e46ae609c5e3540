// linear_attention and linear_attention_backward on NumPy arrays.
#include <string>
#include <string_view>
#include <utility>

#include "attention_inputs.hpp"
#include "bindings.hpp"
#include "options.hpp"

namespace linrope::python {
namespace {

py::object linear_forward(const py::array& q, const py::array& k, const py::array& v,
                          const FeatureMap& map, bool causal, const std::string& placement,
                          const Rope* rope, double eps, Index q_offset, Index k_offset,
                          bool return_stats, double stats_threshold, const std::string& method,
                          Index chunk_size, const Lengths& q_lengths, const Lengths& k_lengths) {
  constexpr std::string_view fn = "linear_attention";
  const LinearOptions options =
      linear_options(fn, causal, placement, rope, eps, q_offset, k_offset, method, chunk_size);
  return with_inputs(fn, q, k, v, nullptr, q_lengths, k_lengths, [&]<class T>() -> py::object {
    const Inputs<T> in = inputs<T>(q, k, v, nullptr, q_lengths, k_lengths);
    CArray<T> out = in.new_output();
    DenominatorStats stats{.threshold = stats_threshold};
    {
      KernelScope scope(&map);
      linear_attention(in.q_heads(), in.k_heads(), in.v_heads(),
                       with_lengths(output_heads(out), q_lengths), map, options,
                       return_stats ? &stats : nullptr);
    }
    if (return_stats) return py::make_tuple(std::move(out), stats_dict(stats));
    return out;
  });
}

py::object linear_backward(const py::array& q, const py::array& k, const py::array& v,
                           const py::array& d_out, const FeatureMap& map, bool causal,
                           const std::string& placement, const Rope* rope, double eps,
                           Index q_offset, Index k_offset, const std::string& method,
                           Index chunk_size, const Lengths& q_lengths, const Lengths& k_lengths) {
  constexpr std::string_view fn = "linear_attention_backward";
  const LinearOptions options =
      linear_options(fn, causal, placement, rope, eps, q_offset, k_offset, method, chunk_size);
  return with_inputs(fn, q, k, v, &d_out, q_lengths, k_lengths, [&]<class T>() -> py::object {
    const Inputs<T> in = inputs<T>(q, k, v, &d_out, q_lengths, k_lengths);
    return gradients<T>(in, &map, [&](Heads<T> dq, Heads<T> dk, Heads<T> dv) {
      linear_attention_backward(in.q_heads(), in.k_heads(), in.v_heads(), in.d_out_heads(), dq, dk,
                                dv, map, options);
    });
  });
}

}  // namespace

void bind_linear_attention(py::module_& m) {
  using namespace pybind11::literals;
  const LinearOptions& o = linear_defaults;
  // The arguments in DESIGN.md's order (positional use allowed), then the ones added since:
  // method, chunk_size, the lengths.
  m.def("linear_attention", &linear_forward, "q"_a, "k"_a, "v"_a, "feature_map"_a,
        "causal"_a = o.causal, "placement"_a = name_of(o.placement), "rope"_a = py::none(),
        "eps"_a = o.eps, "q_offset"_a = o.q_offset, "k_offset"_a = o.k_offset,
        "return_stats"_a = false, "stats_threshold"_a = stats_defaults.threshold,
        "method"_a = name_of(o.method), "chunk_size"_a = o.chunk_size, "q_lengths"_a = py::none(),
        "k_lengths"_a = py::none(),
        "Linear attention; with return_stats=True returns (out, denominator statistics). Holds "
        "feature_map while it runs: a redraw from another thread meanwhile raises RuntimeError.");
  m.def("linear_attention_backward", &linear_backward, "q"_a, "k"_a, "v"_a, "d_out"_a,
        "feature_map"_a, "causal"_a = o.causal, "placement"_a = name_of(o.placement),
        "rope"_a = py::none(), "eps"_a = o.eps, "q_offset"_a = o.q_offset,
        "k_offset"_a = o.k_offset, "method"_a = name_of(o.method), "chunk_size"_a = o.chunk_size,
        "q_lengths"_a = py::none(), "k_lengths"_a = py::none(),
        "(dq, dk, dv) of sum(d_out * linear_attention(...)). Holds feature_map while it runs, as "
        "linear_attention does.");
}

}  // namespace linrope::python
