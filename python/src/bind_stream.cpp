// linrope.LinearAttentionStream: causal linear attention for decoding, a few tokens per step.
#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "arrays.hpp"
#include "bindings.hpp"
#include "options.hpp"
#include "threads.hpp"

namespace linrope::python {
namespace {

// LinearAttentionStream<float> or <double>, chosen by the dtype named at construction. The C++
// stream keeps references to the map and the rope; Python keeps them alive (keep_alive below).
class Stream {
 public:
  Stream(const FeatureMap& map, Index value_dim, const std::string& dtype,
         const std::string& placement, const Rope* rope, double eps, Index offset, bool denominator,
         double decay)
      : map_(&map),
        stream_(make(map, value_dim, dtype,
                     {.causal = true,
                      .placement = parse_name("LinearAttentionStream", rope_placement_from_string,
                                              placement),
                      .rope = rope,
                      .eps = eps,
                      .q_offset = offset,
                      .k_offset = offset,
                      .denominator = denominator,
                      .decay = decay})) {}

  // q [t, d], k [t, d], v [t, d_v] of the stream's dtype -> [t, d_v] (and the statistics).
  py::object step(const py::array& q, const py::array& k, const py::array& v, bool return_stats,
                  double stats_threshold) {
    constexpr std::string_view fn = "LinearAttentionStream.step";
    return std::visit(
        [&]<class T>(LinearAttentionStream<T>& stream) -> py::object {
          const std::array<const char*, 3> names = {"q", "k", "v"};
          const std::array<const py::array*, 3> arrays = {&q, &k, &v};
          for (std::size_t i = 0; i < 3; ++i) {
            if (arrays[i]->ndim() != 2)
              fail(fn, names[i], " has ", arrays[i]->ndim(), " dimensions but expected 2 (t, d)");
            if (!arrays[i]->dtype().equal(py::dtype::of<T>()))
              fail(fn, names[i], " has dtype ", std::string(py::str(arrays[i]->dtype())),
                   " but the stream's is ", std::string(py::str(py::dtype::of<T>())));
          }
          // Copies: step takes Matrix<T>, and a step's few rows cost nothing to copy.
          const Matrix<T> qm = rows_of(contiguous<T>(q)), km = rows_of(contiguous<T>(k)),
                          vm = rows_of(contiguous<T>(v));
          DenominatorStats stats{.threshold = stats_threshold};
          Matrix<T> out;
          {
            KernelScope scope(map_);
            out = stream.step(qm, km, vm, return_stats ? &stats : nullptr);
          }
          CArray<T> result({out.rows(), out.cols()});
          rows_of(result) = out;
          if (return_stats) return py::make_tuple(std::move(result), stats_dict(stats));
          return result;
        },
        stream_);
  }

  Index position() const {
    return std::visit([](const auto& stream) { return stream.position(); }, stream_);
  }
  void reset() {
    std::visit([](auto& stream) { stream.reset(); }, stream_);
  }
  std::string dtype() const {
    return std::holds_alternative<LinearAttentionStream<float>>(stream_) ? "float32" : "float64";
  }

 private:
  using Either = std::variant<LinearAttentionStream<float>, LinearAttentionStream<double>>;
  static Either make(const FeatureMap& map, Index value_dim, const std::string& dtype,
                     const LinearOptions& options) {
    if (dtype == "float32") return LinearAttentionStream<float>(map, value_dim, options);
    if (dtype == "float64") return LinearAttentionStream<double>(map, value_dim, options);
    fail("LinearAttentionStream", "dtype is \"", dtype, "\" but expected one of float32, float64");
  }
  const FeatureMap* map_;  // held during each step, which reads its W
  Either stream_;
};

}  // namespace

void bind_stream(py::module_& m) {
  using namespace pybind11::literals;
  const LinearOptions& o = linear_defaults;
  py::class_<Stream>(m, "LinearAttentionStream",
                     "Causal linear attention for decoding, a few tokens per step; "
                     "see include/linrope/attention.hpp.")
      .def(py::init<const FeatureMap&, Index, const std::string&, const std::string&, const Rope*,
                    double, Index, bool, double>(),
           "feature_map"_a, "value_dim"_a, py::kw_only(), "dtype"_a = "float32",
           "placement"_a = name_of(o.placement), "rope"_a = py::none(), "eps"_a = o.eps,
           "offset"_a = o.q_offset, "denominator"_a = o.denominator, "decay"_a = o.decay,
           py::keep_alive<1, 2>(), py::keep_alive<1, 6>())
      .def("step", &Stream::step, "q"_a, "k"_a, "v"_a, py::kw_only(), "return_stats"_a = false,
           "stats_threshold"_a = stats_defaults.threshold,
           "Appends t tokens (q, k [t, d], v [t, d_v]) and returns their outputs [t, d_v].")
      .def_property_readonly("position", &Stream::position, "Position of the next token.")
      .def_property_readonly("dtype", &Stream::dtype)
      .def("reset", &Stream::reset, "Back to an empty state at the first offset.");
}

}  // namespace linrope::python
