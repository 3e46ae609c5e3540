// softmax_attention and softmax_attention_backward on NumPy arrays.
#include <optional>
#include <string_view>

#include "attention_inputs.hpp"
#include "bindings.hpp"
#include "options.hpp"

namespace linrope::python {
namespace {

py::object softmax_forward(const py::array& q, const py::array& k, const py::array& v, bool causal,
                           std::optional<double> scale, const Rope* rope, Index q_offset,
                           Index k_offset, const Lengths& q_lengths, const Lengths& k_lengths) {
  constexpr std::string_view fn = "softmax_attention";
  const SoftmaxOptions options = softmax_options(fn, causal, scale, rope, q_offset, k_offset);
  return with_inputs(fn, q, k, v, nullptr, q_lengths, k_lengths, [&]<class T>() -> py::object {
    const Inputs<T> in = inputs<T>(q, k, v, nullptr, q_lengths, k_lengths);
    HeadsArray<T> out = in.new_output();
    {
      KernelScope scope;
      softmax_attention(in.q_heads(), in.k_heads(), in.v_heads(), out.mutable_view(q_lengths),
                        options);
    }
    return std::move(out.array);
  });
}

py::object softmax_backward(const py::array& q, const py::array& k, const py::array& v,
                            const py::array& d_out, bool causal, std::optional<double> scale,
                            const Rope* rope, Index q_offset, Index k_offset,
                            const Lengths& q_lengths, const Lengths& k_lengths) {
  constexpr std::string_view fn = "softmax_attention_backward";
  const SoftmaxOptions options = softmax_options(fn, causal, scale, rope, q_offset, k_offset);
  return with_inputs(fn, q, k, v, &d_out, q_lengths, k_lengths, [&]<class T>() -> py::object {
    const Inputs<T> in = inputs<T>(q, k, v, &d_out, q_lengths, k_lengths);
    return gradients<T>(in, nullptr, [&](Heads<T> dq, Heads<T> dk, Heads<T> dv) {
      softmax_attention_backward(in.q_heads(), in.k_heads(), in.v_heads(), in.d_out_heads(), dq, dk,
                                 dv, options);
    });
  });
}

}  // namespace

void bind_softmax_attention(py::module_& m) {
  using namespace pybind11::literals;
  const SoftmaxOptions& o = softmax_defaults;
  // The arguments in docs/DESIGN.md's order ("Python"; positional use allowed), then the
  // lengths, added since.
  m.def("softmax_attention", &softmax_forward, "q"_a, "k"_a, "v"_a, "causal"_a = o.causal,
        "scale"_a = py::none(), "rope"_a = py::none(), "q_offset"_a = o.q_offset,
        "k_offset"_a = o.k_offset, "q_lengths"_a = py::none(), "k_lengths"_a = py::none(),
        "Exact softmax attention: q [.., n, d], k [.., n_k, d], v [.., n_k, d_v] -> [.., n, d_v].");
  m.def("softmax_attention_backward", &softmax_backward, "q"_a, "k"_a, "v"_a, "d_out"_a,
        "causal"_a = o.causal, "scale"_a = py::none(), "rope"_a = py::none(),
        "q_offset"_a = o.q_offset, "k_offset"_a = o.k_offset, "q_lengths"_a = py::none(),
        "k_lengths"_a = py::none(), "(dq, dk, dv) of sum(d_out * softmax_attention(...)).");
}

}  // namespace linrope::python
