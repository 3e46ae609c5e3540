// linear_attention and linear_attention_backward on NumPy arrays.
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_inputs.hpp"
#include "bindings.hpp"
#include "decay.hpp"
#include "options.hpp"
#include "states.hpp"

namespace linrope::python {
namespace {

// linrope.LinearSaved: what a forward keeps for its backward (attention.hpp, LinearSaved), of
// either dtype; a forward fills the one of its dtype and, once it has, empties the other. The
// kernels run without the GIL: while a forward fills it no other call may use it, and while
// backwards read it no forward may refill it nor clear() free it (SavedUse raises instead).
struct SavedFeatures {
  LinearSavedF f;
  LinearSavedD d;
  int readers = 0;
  bool writing = false;

  template <class T>
  LinearSaved<T>& of() {
    if constexpr (std::is_same_v<T, float>)
      return f;
    else
      return d;
  }
  template <class T>
  void clear_other() {
    if constexpr (std::is_same_v<T, float>)
      d.clear();
    else
      f.clear();
  }
  void clear() {
    if (readers > 0 || writing)
      throw std::runtime_error("LinearSaved.clear: a linear_attention call is using it");
    f.clear();
    d.clear();
  }
  // Read while no forward fills it: a forward lays out and may reallocate its blocks.
  std::size_t bytes() const {
    unfilled("nbytes");
    return f.bytes() + d.bytes();
  }
  bool empty() const {
    unfilled("empty");
    return f.empty() && d.empty();
  }
  const char* dtype() const {
    unfilled("dtype");
    return !f.empty() ? "float32" : !d.empty() ? "float64" : "none";
  }

 private:
  void unfilled(const char* property) const {
    if (writing)
      throw std::runtime_error(std::string("LinearSaved.") + property +
                               ": a linear_attention forward is filling it");
  }
};

// One call's use of a LinearSaved (none: null), taken and given back with the GIL held.
class SavedUse {
 public:
  SavedUse(std::string_view fn, SavedFeatures* saved, bool writes)
      : saved_(saved), writes_(writes) {
    if (!saved_) return;
    if (saved_->writing || (writes_ && saved_->readers > 0))
      throw std::runtime_error(
          std::string(fn) + ": saved is in use by another call (" +
          (saved_->writing ? "a forward filling it" : "a backward reading it") + ")");
    if (writes_)
      saved_->writing = true;
    else
      ++saved_->readers;
  }
  ~SavedUse() {
    if (!saved_) return;
    if (writes_)
      saved_->writing = false;
    else
      --saved_->readers;
  }
  SavedUse(const SavedUse&) = delete;
  SavedUse& operator=(const SavedUse&) = delete;

 private:
  SavedFeatures* saved_;
  bool writes_;
};

// The options of both functions, decay= read in; `head_decays` keeps the values that
// options.head_decays views while the call runs.
LinearOptions options_of(std::string_view fn, const py::array& q, bool causal,
                         const std::string& placement, const Rope* rope, double eps, Index q_offset,
                         Index k_offset, const std::string& method, Index chunk_size,
                         bool denominator, const py::object& decay,
                         std::vector<double>& head_decays) {
  return with_decay(fn,
                    linear_options(fn, causal, placement, rope, eps, q_offset, k_offset, method,
                                   chunk_size, denominator),
                    decay, q, head_decays);
}

py::object linear_forward(const py::array& q, const py::array& k, const py::array& v,
                          const FeatureMap& map, bool causal, const std::string& placement,
                          const Rope* rope, double eps, Index q_offset, Index k_offset,
                          bool return_stats, double stats_threshold, const std::string& method,
                          Index chunk_size, const Lengths& q_lengths, const Lengths& k_lengths,
                          const py::object& initial_state, bool return_state, bool denominator,
                          const py::object& decay, SavedFeatures* saved) {
  constexpr std::string_view fn = "linear_attention";
  std::vector<double> head_decays;
  const LinearOptions options = options_of(fn, q, causal, placement, rope, eps, q_offset, k_offset,
                                           method, chunk_size, denominator, decay, head_decays);
  return with_inputs(fn, q, k, v, nullptr, q_lengths, k_lengths, [&]<class T>() -> py::object {
    const Inputs<T> in = inputs<T>(q, k, v, nullptr, q_lengths, k_lengths);
    HeadsArray<T> out = in.new_output();
    DenominatorStats stats{.threshold = stats_threshold};
    const Heads<const T> q_heads = in.q_heads();
    const Index m = map.output_dim(), d_v = in.v_heads().d;
    const StateArrays<T> initial =
        read_state<T>(fn, "initial_state", initial_state, q, m, d_v, true);
    StateArrays<T> final = return_state ? new_state<T>(q, m, d_v, true) : StateArrays<T>();
    {
      const SavedUse use(fn, saved, true);
      KernelScope scope(&map);
      const Heads<T> out_heads = out.mutable_view(q_lengths);
      DenominatorStats* wanted = return_stats ? &stats : nullptr;
      const bool stateful = initial.present || return_state;
      // saved_arg: the LinearSaved to fill, or nothing.
      const auto call = [&](auto&... saved_arg) {
        if (stateful)
          linear_attention(q_heads, in.k_heads(), in.v_heads(), out_heads, map, options,
                           initial.view(q_heads.batch, q_heads.heads, m, d_v),
                           final.mutable_view(q_heads.batch, q_heads.heads, m, d_v), saved_arg...,
                           wanted);
        else
          linear_attention(q_heads, in.k_heads(), in.v_heads(), out_heads, map, options,
                           saved_arg..., wanted);
      };
      if (saved)
        call(saved->of<T>());
      else
        call();
    }
    if (saved) saved->clear_other<T>();
    py::list result;
    result.append(std::move(out.array));
    if (return_stats) result.append(stats_dict(stats));
    if (return_state) result.append(final.to_tuple());
    if (result.size() == 1) return result[0];
    return py::tuple(result);
  });
}

py::object linear_backward(const py::array& q, const py::array& k, const py::array& v,
                           const py::array& d_out, const FeatureMap& map, bool causal,
                           const std::string& placement, const Rope* rope, double eps,
                           Index q_offset, Index k_offset, const std::string& method,
                           Index chunk_size, const Lengths& q_lengths, const Lengths& k_lengths,
                           const py::object& initial_state, const py::object& d_final_state,
                           bool return_state_gradient, bool denominator, const py::object& decay,
                           SavedFeatures* saved) {
  constexpr std::string_view fn = "linear_attention_backward";
  std::vector<double> head_decays;
  const LinearOptions options = options_of(fn, q, causal, placement, rope, eps, q_offset, k_offset,
                                           method, chunk_size, denominator, decay, head_decays);
  return with_inputs(fn, q, k, v, &d_out, q_lengths, k_lengths, [&]<class T>() -> py::object {
    const Inputs<T> in = inputs<T>(q, k, v, &d_out, q_lengths, k_lengths);
    const Heads<const T> q_heads = in.q_heads();
    const Index batch = q_heads.batch, heads = q_heads.heads, m = map.output_dim(),
                d_v = in.v_heads().d;
    const StateArrays<T> initial =
        read_state<T>(fn, "initial_state", initial_state, q, m, d_v, true);
    const StateArrays<T> d_final =
        read_state<T>(fn, "d_final_state", d_final_state, q, m, d_v, false);
    StateArrays<T> d_initial =
        return_state_gradient ? new_state<T>(q, m, d_v, false) : StateArrays<T>();
    const bool stateful = initial.present || d_final.present || return_state_gradient;
    const SavedUse use(fn, saved, false);
    py::object grads = gradients<T>(in, &map, [&](Heads<T> dq, Heads<T> dk, Heads<T> dv) {
      // saved_arg: the LinearSaved to read, or nothing.
      const auto call = [&](const auto&... saved_arg) {
        if (stateful)
          linear_attention_backward(q_heads, in.k_heads(), in.v_heads(), in.d_out_heads(), dq, dk,
                                    dv, map, options, initial.view(batch, heads, m, d_v),
                                    d_final.view(batch, heads, m, d_v),
                                    d_initial.mutable_view(batch, heads, m, d_v), saved_arg...);
        else
          linear_attention_backward(q_heads, in.k_heads(), in.v_heads(), in.d_out_heads(), dq, dk,
                                    dv, map, options, saved_arg...);
      };
      if (saved)
        call(std::as_const(saved->of<T>()));
      else
        call();
    });
    if (!return_state_gradient) return grads;
    return py::make_tuple(grads[py::int_(0)], grads[py::int_(1)], grads[py::int_(2)],
                          d_initial.to_tuple());
  });
}

}  // namespace

void bind_linear_attention(py::module_& m) {
  using namespace pybind11::literals;
  const LinearOptions& o = linear_defaults;
  // The arguments in docs/DESIGN.md's order ("Python"; positional use allowed), then the ones
  // added since: method, chunk_size, the lengths.
  py::class_<SavedFeatures>(m, "LinearSaved",
                            "What a linear_attention forward keeps for its backward: the features "
                            "of every query and key row (include/linrope/attention.hpp, "
                            "LinearSaved). Pass it as saved= to the forward, which fills it, then "
                            "to the backward, which reads it: the same gradients, the same bits, "
                            "without mapping q and k again.")
      .def(py::init<>())
      .def_property_readonly("nbytes", &SavedFeatures::bytes)
      .def_property_readonly("empty", &SavedFeatures::empty)
      .def_property_readonly("dtype", &SavedFeatures::dtype)
      .def("clear", &SavedFeatures::clear);
  m.def("release_cached_memory", &release_cached_memory,
        "Frees the memory linrope keeps for reuse (LinearSaved's blocks, large output arrays: up "
        "to 1 GiB, see include/linrope/attention.hpp); returns how many bytes.");
  m.def("linear_attention", &linear_forward, "q"_a, "k"_a, "v"_a, "feature_map"_a,
        "causal"_a = o.causal, "placement"_a = name_of(o.placement), "rope"_a = py::none(),
        "eps"_a = o.eps, "q_offset"_a = o.q_offset, "k_offset"_a = o.k_offset,
        "return_stats"_a = false, "stats_threshold"_a = stats_defaults.threshold,
        "method"_a = name_of(o.method), "chunk_size"_a = o.chunk_size, "q_lengths"_a = py::none(),
        "k_lengths"_a = py::none(), "initial_state"_a = py::none(), "return_state"_a = false,
        "denominator"_a = o.denominator, "decay"_a = o.decay, "saved"_a = nullptr,
        "Linear attention (denominator=False: o = num, no normalisation; causal calls may decay, "
        "decay=g in (0, 1] or one g per head for (B, H, n, d) arrays: key j weighs g^(p_i - p_j) "
        "at query i, and a state is the decayed sum at its last key's position); with "
        "return_stats=True "
        "returns (out, denominator statistics). Causal "
        "calls can continue from initial_state=(S, z, log_scale) and, with return_state=True, "
        "also return the state after their keys, last in the tuple (include/linrope/attention.hpp, "
        "\"State in, state out\"). With saved=LinearSaved(), keeps the features there for the "
        "backward. Holds feature_map while it runs: a redraw from another thread "
        "meanwhile raises RuntimeError.");
  m.def("linear_attention_backward", &linear_backward, "q"_a, "k"_a, "v"_a, "d_out"_a,
        "feature_map"_a, "causal"_a = o.causal, "placement"_a = name_of(o.placement),
        "rope"_a = py::none(), "eps"_a = o.eps, "q_offset"_a = o.q_offset,
        "k_offset"_a = o.k_offset, "method"_a = name_of(o.method), "chunk_size"_a = o.chunk_size,
        "q_lengths"_a = py::none(), "k_lengths"_a = py::none(), "initial_state"_a = py::none(),
        "d_final_state"_a = py::none(), "return_state_gradient"_a = false,
        "denominator"_a = o.denominator, "decay"_a = o.decay, "saved"_a = nullptr,
        "(dq, dk, dv) of sum(d_out * linear_attention(...)) (+ <dS, S> + <dz, z> of the final "
        "state when d_final_state=(dS, dz)); with return_state_gradient=True also (dS, dz) of "
        "initial_state, last. saved: the LinearSaved its forward filled (read, not mapped "
        "again). Holds feature_map while it runs, as linear_attention does.");
}

}  // namespace linrope::python
